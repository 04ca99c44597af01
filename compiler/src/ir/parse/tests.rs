use super::*;
use crate::ir::print::print_graph;
use crate::ops::{Op, UnaryKind};

/// Every op, with every optional attribute both ways, in printed form.
const EVERY_OP: &str = r#"graph every_op (B, T)
params:
  [0] w: f32[8, 8] = normal(std=0.02)  # 64 values
  [1] g: f32[8] = ones no_decay  # 8 values
  [2] e: f32[10, 8] = uniform(bound=0.1)  # 80 values
  [3] k: f32[3, 3, 8, 8] = constant(0.5)  # 576 values
  [4] b: f32[8] = zeros no_decay  # 8 values
forward:
  %0: f32[B, T, 8] = input "x"
  %1: i32[B, T] = input "tokens"
  %2: f32[8, 8] = param "w"
  %3: f32[8] = param "g"
  %4: f32[10, 8] = param "e"
  %5: f32[3, 3, 8, 8] = param "k"
  %6: f32[8] = param "b"
  %7: f32[2, 6, 6, 8] = input "image"
  %8: f32[] = const 0.5
  %9: f32[] = dim_value B*T + 1
  %10: bf16[B, T, 8] = cast(%0) to=bf16
  %11: f32[B, T, 8] = neg(%0)
  %12: f32[B, T, 8] = exp(%11)
  %13: f32[B, T, 8] = log(%12)
  %14: f32[B, T, 8] = sqrt(%12)
  %15: f32[B, T, 8] = rsqrt(%12)
  %16: f32[B, T, 8] = tanh(%0)
  %17: f32[B, T, 8] = sigmoid(%0)
  %18: f32[B, T, 8] = gelu(%0)
  %19: f32[B, T, 8] = relu(%0)
  %20: f32[B, T, 8] = silu(%0)
  %21: f32[B, T, 8] = add(%0, %6)
  %22: f32[B, T, 8] = sub(%21, %8)
  %23: f32[B, T, 8] = mul(%22, %9)
  %24: f32[B, T, 8] = div(%23, %8)
  %25: f32[B, T, 8] = keep_if(%24, %0)
  %26: f32[B, T, 8] = matmul(%25, %2)
  %27: f32[B, 8] = sum(%26) axes=[1]
  %28: f32[1, T, 1] = mean(%26) axes=[0,2] keepdim
  %29: f32[B*T, 8] = reshape(%26) [B*T, 8]
  %30: f32[8, T, B] = permute(%26) [2,1,0]
  %31: f32[B, T - 1, 8] = slice(%26) axis=1 1:T
  %32: f32[B, T, 8] = slice_grad(%31) axis=1 at=1 full=T
  %33: f32[B, T, 16] = concat(%26, %32) axis=2
  %34: f32[B, T, 16] = softmax(%33) axis=2
  %35: f32[2, B, T, 8] = broadcast(%26) [2, B, T, 8]
  %36: f32[B, T, 8] = layernorm(%26, %3, %6) eps=1e-5
  %37: f32[B, T, 8] = rmsnorm(%26, %3) eps=1e-6
  %38: f32[B, T, 8] = embedding(%4, %1)
  %39: f32[B, T] = cross_entropy(%26, %1)
  %40: f32[B, T] = cross_entropy(%26, %1) classes=6
  %41: f32[] = mean(%39) axes=[0,1]
  %42: f32[B, T, 2, 4] = reshape(%26) [B, T, 2, 4]
  %43: f32[B, T, 2, 4] = rope(%42) theta=10000
  %44: f32[B, T, 2, 4] = rope(%43) theta=10000 inverse
  %45: f32[B, 8, T] = permute(%26) [0,2,1]
  %46: f32[B, T, T] = matmul(%26, %45)
  %47: f32[B, T, T] = causal_mask(%46) fill=-inf
  %48: f32[B, T, 2, 4], %49: f32[B, 2, T] = attention(%42, %42, %42) causal=true scale=0.5
  %50: f32[2, 6, 6, 8] = conv2d(%7, %5) stride=1 padding=1
backward:
  %51: f32[B, T, 16] = softmax_grad(%34, %34) axis=2
  %52: f32[B, T, 8] = gelu_grad(%0, %26)
  %53: f32[B, T, 8] = silu_grad(%0, %26)
  %54: f32[B, T, 8], %55: f32[256, 8], %56: f32[256, 8] = layernorm_grad(%26, %3, %52) eps=1e-5
  %57: f32[B, T, 8], %58: f32[256, 8] = rmsnorm_grad(%26, %3, %52) eps=1e-6
  %59: f32[10, 8] = embedding_grad(%1, %54) rows=10
  %60: f32[B, T, 8] = cross_entropy_grad(%26, %1, %39)
  %61: f32[B, T, 8], %62: f32[B, T] = cross_entropy_with_grad(%26, %1, %39) classes=6
  %63: f32[B, T, 2, 4], %64: f32[B, T, 2, 4], %65: f32[B, T, 2, 4] = attention_grad(%42, %42, %42, %48, %49, %48) causal=true scale=0.5
  %66: f32[2, 6, 6, 8] = conv2d_grad_input(%50, %5) stride=1 padding=1
  %67: f32[3, 3, 8, 8] = conv2d_grad_weight(%7, %50) stride=1 padding=1
  %68: f32[8, 8] = sum(%67) axes=[0,1]
update:
  %69: f32[] = input "update.lr"
  %70: f32[] = input "update.step"
  %71: f32[] = const 1
  %72: f32[9] = sum_squares(%68, %59) chunk=16
  %73: f32[] = sum(%72) axes=[0]
  %74: f32[] = clip_coef(%73) max_norm=1
  %75: f32[], %76: f32[], %77: f32[] = unscale(%73, %71, %71) max_norm=1
  %78: f32[], %79: f32[], %80: f32[] = unscale(%73, %71, %71)
  %81: f32[8, 8] = state "w.adam_m"
  %82: f32[8, 8] = state "w.adam_v"
  %83: f32[8, 8], %84: f32[8, 8], %85: f32[8, 8] = adamw(%2, %68, %81, %82, %69, %70, %74) betas=(0.9, 0.95) eps=1e-8 wd=0.1
  %86: f32[32] = state "w.adam_m.part"
  %87: f32[8, 8], %88: f32[32], %89: f32[32] = adamw(%2, %68, %86, %86, %69, %70, %74, %76) betas=(0.9, 0.999) eps=1e-8 wd=0 range=16..48
  %90: f32[10, 8] = state "e.momentum"
  %91: f32[10, 8], %92: f32[10, 8] = sgd(%4, %59, %90, %69, %74) momentum=0.9 wd=0
  %93: f32[10, 8], %94: f32[32] = sgd(%4, %59, %86, %69, %74, %76) momentum=0 wd=0.01 range=40..72
  %95: f32[8, 8] = all_reduce(%68) op=mean ranks=2
  %96: f32[] = all_reduce(%41) op=mean ranks=2 every_micro_batch
  %97: f32[3] = sum_squares(%68, %59) chunk=16 piece=0:8..40 piece=1:0..0
  %98: f32[8, 8] = all_reduce(%68) op=mean ranks=2 owners_of=0
  %99: f32[32], %100: f32[32], %101: f32[32] = adamw(%86, %68, %86, %86, %69, %70, %74) betas=(0.9, 0.999) eps=1e-8 wd=0 range=16..48 master
  %102: f32[32], %103: f32[32] = sgd(%86, %59, %86, %69, %74) momentum=0 wd=0 range=40..72 master
  %104: bf16[8, 8] = cast(%2) to=bf16
  %105: bf16[8, 8] = store_piece(%104, %99) range=16..48
  %106: i32[2] = input "dropout.key"
  %107: f32[B, T, 8] = dropout(%0, %106) p=0.1 site=3
  %108: f32[B, T] = counted(%1) ignore_index=-100
  %109: f32[B, T] = cross_entropy(%0, %1) ignore_index=0 smoothing=0.1
  %110: i32[T] = input "positions"
  %111: f32[B, T, 2, 4] = rope(%42, %110) theta=10000 positions
  %112: f32[B, 9, 2, 4] = state "kv_cache.0.k"
  %113: f32[B, 9, 2, 4] = kv_write(%112, %42, %110)
  %114: f32[B, T, 2, 4] = cached_attention(%42, %113, %113, %110) scale=0.5
  %115: i32[B, T] = argmax(%0) classes=7
  %116: f32[8, 8] = all_gather(%86) rank=1 param=0 pieces=0..16,16..48,48..64 [8, 8]
outputs:
  loss = %96
  grad[0] = %95
  grad[2] = %59
  param[0] = %83
  state "w.adam_m" = %84
  grad_norm = %77"#;

/// Which op a node holds, as an index: exhaustive, so an op added to the
/// IR stops this test from building until the text above covers it.
fn variant(op: &Op) -> usize {
    match op {
        Op::Input(_) => 0,
        Op::Param(_) => 1,
        Op::State(_) => 2,
        Op::Constant(_) => 3,
        Op::DimValue(_) => 4,
        Op::Cast(_) => 5,
        Op::Unary(_) => 6,
        Op::UnaryGrad(_) => 7,
        Op::Binary(_) => 8,
        Op::ClipCoef(_) => 9,
        Op::Unscale(_) => 10,
        Op::Reduce(_) => 11,
        Op::Reshape(_) => 12,
        Op::Permute(_) => 13,
        Op::Slice(_) => 14,
        Op::SliceGrad(_) => 15,
        Op::Concat(_) => 16,
        Op::Broadcast(_) => 17,
        Op::MatMul(_) => 18,
        Op::Softmax(_) => 19,
        Op::SoftmaxGrad(_) => 20,
        Op::LayerNorm(_) => 21,
        Op::LayerNormGrad(_) => 22,
        Op::RmsNorm(_) => 23,
        Op::RmsNormGrad(_) => 24,
        Op::Embedding(_) => 25,
        Op::EmbeddingGrad(_) => 26,
        Op::CrossEntropy(_) => 27,
        Op::CrossEntropyGrad(_) => 28,
        Op::CrossEntropyWithGrad(_) => 29,
        Op::Rope(_) => 30,
        Op::CausalMask(_) => 31,
        Op::Attention(_) => 32,
        Op::AttentionGrad(_) => 33,
        Op::Conv2d(_) => 34,
        Op::Conv2dGradInput(_) => 35,
        Op::Conv2dGradWeight(_) => 36,
        Op::AdamW(_) => 37,
        Op::Sgd(_) => 38,
        Op::SumSquares(_) => 39,
        Op::AllReduce(_) => 40,
        Op::StorePiece(_) => 41,
        Op::Dropout(_) => 42,
        Op::Counted(_) => 43,
        Op::AllGather(_) => 44,
        Op::KvWrite(_) => 45,
        Op::CachedAttention(_) => 46,
        Op::ArgMax(_) => 47,
    }
}
const VARIANTS: usize = 48;

#[test]
fn every_op_reads_back_as_printed() {
    let g = parse_graph(EVERY_OP).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(print_graph(&g, None).trim_end(), EVERY_OP.trim_end());
    let mut seen = [false; VARIANTS];
    for n in g.g.node_indices() {
        seen[variant(&g.g[n].op)] = true;
    }
    let missing: Vec<usize> = (0..VARIANTS).filter(|&i| !seen[i]).collect();
    assert!(missing.is_empty(), "ops missing from the text: {missing:?}");
}

#[test]
fn every_unary_and_binary_kind_reads_back() {
    for &k in UnaryKind::ALL {
        let text = format!(
            "graph t ()\nforward:\n  %0: f32[3] = input \"x\"\n  %1: f32[3] = {0}(%0)\n  %2: f32[3] = {0}_grad(%0, %1)\n",
            k.name()
        );
        let g = parse_graph(&text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(print_graph(&g, None), text);
    }
    for k in ops::BINARY {
        let text = format!(
            "graph t ()\nforward:\n  %0: f32[3] = input \"x\"\n  %1: f32[3] = {}(%0, %0)\n",
            k.name()
        );
        let g = parse_graph(&text).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(print_graph(&g, None), text);
    }
}

#[test]
fn names_comments_positions_and_recomputation() {
    let text = r#"
; a hand-written graph
graph hand (B)   ; trailing comment

forward:
  %x: f32[B, 4] = input "x"        @3:1
  %w: f32[4, 4] = param "w"
  %y: f32[B, 4] = matmul(%x, %w)   @5:9
  %t: f32[B, 4] = tanh(%y)
backward:
  %t2: f32[B, 4] = tanh(%y)  recomputed  @7:2
  %d: f32[B, 4] = tanh_grad(%y, %t2)
outputs:
  loss = %t
  grad_norm = %d
"#;
    let g = parse_graph(text).unwrap_or_else(|e| panic!("{e}"));
    let want = "graph hand (B)
forward:
  %0: f32[B, 4] = input \"x\"
  %1: f32[4, 4] = param \"w\"
  %2: f32[B, 4] = matmul(%0, %1)
  %3: f32[B, 4] = tanh(%2)
backward:
  %4: f32[B, 4] = tanh(%2)  recomputed
  %5: f32[B, 4] = tanh_grad(%2, %4)
outputs:
  loss = %3
  grad_norm = %5
";
    assert_eq!(print_graph(&g, None), want);
    assert!(g.g.node_weights().all(|n| n.span.is_none()));
}

#[test]
fn special_numbers_and_names_read_back() {
    let text = "graph odd name-1 (S)
forward:
  %0: f32[] = const -inf
  %1: f32[] = const 1e-8
  %2: f32[] = const -0
  %3: f32[] = const 12345678900
  %4: f32[] = dim_value 2*S*S - S + 3
  %5: f32[2, S + 1, 3] = input \"a \\\"quoted\\\" name\"
";
    let g = parse_graph(text).unwrap_or_else(|e| panic!("{e}"));
    let printed = print_graph(&g, None);
    assert_eq!(printed, text.replace("12345678900", "1.23456789e10"));
    assert_eq!(g.name, "odd name-1");
}

/// (text, line, column, part of the message).
const BAD: &[(&str, usize, usize, &str)] = &[
    ("", 1, 1, "expected a header"),
    ("\n\n  ; only a comment\n", 3, 1, "expected a header"),
    ("grph t (B)", 1, 1, "expected a header `graph NAME (DIMS)`, found `grph`"),
    ("graph t (B, B)", 1, 13, "dimension `B` is declared twice"),
    ("graph t (B)\n  %0: f32[B] = input \"x\"", 2, 3, "expected a phase heading"),
    (
        "graph t (B)\nforward:\n  %0: f32[C, 4] = input \"x\"",
        3,
        11,
        "unknown dimension `C` (the header declares B)",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 4] = add(%0, %9)",
        4,
        27,
        "value `%9` is not defined on an earlier line",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 5] = neg(%0)",
        4,
        7,
        "`neg` gives f32[B, 4] here, the line says f32[B, 5]",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 4] = frob(%0)",
        4,
        19,
        "unknown op `frob`",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 4] = softmax(%0)",
        4,
        30,
        "expected `axis=`, found the end of the line",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 4] = softmax(%0) axis=1 extra",
        4,
        38,
        "expected the end of the line (after `softmax` and its attributes), found `extra`",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 4] = tanh(%0)  recomputed",
        4,
        29,
        "only a backward node can be recomputed",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 3] = input \"y\"\n  %2: f32[B, 4] = add(%0, %1)",
        5,
        19,
        "`add` rejects its inputs: shapes do not broadcast",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\noutputs:\n  loss = %0\nforward:",
        6,
        1,
        "`forward:` out of place",
    ),
    (
        "graph t (B)\nparams:\n  [0] w: f32[4] = zeros\nforward:\n  %0: f32[B, 4] = input \"x\"",
        3,
        1,
        "parameter `w` has no node `param \"w\"`",
    ),
    (
        "graph t (B)\nparams:\n  [1] w: f32[4] = zeros",
        3,
        4,
        "expected [0], found [1]",
    ),
    (
        "graph t (B)\nparams:\n  [0] w: f32[4] = gaussian",
        3,
        19,
        "expected an initialiser",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x",
        3,
        25,
        "no closing",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\" $",
        3,
        29,
        "unexpected character `$`",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %0: f32[B, 4] = tanh(%0)",
        4,
        3,
        "value `%0` is defined twice",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\noutputs:\n  gradient = %0",
        5,
        3,
        "expected an output",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\noutputs:\n  grad[0] = %0",
        5,
        8,
        "there is no parameter [0]",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 4] = slice_grad(%0) axis=5 at=0 full=4",
        4,
        19,
        "axis out of range in `slice_grad`: axis 5 for f32[B, 4]",
    ),
    (
        "graph t (B)\nforward:\n  %0: f32[B, 4] = input \"x\"\n  %1: f32[B, 4], %2: f32[B] = tanh(%0)",
        4,
        31,
        "`tanh` gives 1 result here, the line names 2",
    ),
    (
        "graph t (B)\nforward:\n  %0: q32[B, 4] = input \"x\"",
        3,
        7,
        "expected a dtype (f32, bf16, f16 or i32), found `q32`",
    ),
];

#[test]
fn errors_name_the_line_column_and_what_was_expected() {
    let mut wrong = Vec::new();
    for &(text, line, col, message) in BAD {
        match parse_graph(text) {
            Ok(_) => wrong.push(format!(
                "{text:?}\n  parsed; want {line}:{col}: ...{message}..."
            )),
            Err(e) if e.message.contains(message) && (e.line, e.col) == (line, col) => {}
            Err(e) => wrong.push(format!(
                "{text:?}\n  gave {e}\n  want {line}:{col}: ...{message}..."
            )),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn damaged_text_gives_errors_not_panics() {
    // Prefixes, one-character deletions and replacements all over the text.
    let chars: Vec<char> = EVERY_OP.chars().collect();
    for i in (0..chars.len()).step_by(3) {
        let prefix: String = chars[..i].iter().collect();
        let _ = parse_graph(&prefix);
        let deleted: String = chars[..i].iter().chain(&chars[i + 1..]).collect();
        let _ = parse_graph(&deleted);
        let r = [
            '0', '9', '-', ',', '%', '[', ']', '(', ')', 'é', ':', '"', '@', '.',
        ][i % 14];
        let mut replaced = chars.clone();
        replaced[i] = r;
        let replaced: String = replaced.into_iter().collect();
        let _ = parse_graph(&replaced);
    }
}
