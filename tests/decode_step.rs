//! The decode step (`fusec_compiler::decode`): a language model run a few
//! positions at a time against its key/value caches gives, row for row,
//! the logits of the whole sequence run at once. Checked on the CPU
//! reference in f64 within 1e-12 relative: the cached attention sums the
//! same terms in the same order as the whole sequence's, so only the
//! rounding of f64 remains. Models (`common::decode_models`): GPT-2 (a
//! learned position table, read at the step's positions), LLaMA (rope at
//! the step's positions, 4 query heads over 2 cache heads), and heads of
//! 80, 40 and 392 features with 8, 3 and 4 query heads a cache head (more
//! than one block's share for 8 and, at 392 features, for 4). What cannot
//! be decoded is refused at its place in the model file.

mod common;

use fusec_compiler::decode::{
    cache_name, decode_graph, greedy_graph, weights_as_read, CACHE_DIM, POSITIONS_INPUT,
};
use fusec_compiler::driver::{logits_graph, Failure};
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{self, Feeds, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::Graph;
use fusec_compiler::ops::Op;
use std::collections::HashMap;

fn graphs(file: &str, sets: &[(&str, &str)]) -> (Graph, Graph) {
    let src = std::fs::read_to_string(common::root().join(file)).unwrap();
    let c = common::compile_with(&src, file, sets);
    let whole = logits_graph(&c).unwrap();
    let step = decode_graph(&whole).unwrap_or_else(|e| panic!("{file}: {}", e.render(file, &src)));
    (whole, step)
}

fn params(g: &Graph, seed: u64) -> HashMap<String, Tensor> {
    g.params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let shape: Vec<usize> =
                p.ty.shape
                    .iter()
                    .map(|d| d.as_const().unwrap() as usize)
                    .collect();
            let n = shape.iter().product();
            let data = common::drawn_f32(n, seed + i as u64)
                .into_iter()
                .map(|x| x as f64 * 0.5)
                .collect();
            (p.name.clone(), Tensor::new(shape, data))
        })
        .collect()
}

/// Zeros for every input of `g` that `feeds` lacks (a training target
/// the logits do not read).
fn zero_other_inputs(g: &Graph, feeds: &mut Feeds) {
    for n in g.g.node_indices() {
        if let Op::Input(i) = &g.g[n].op {
            if !feeds.inputs.contains_key(&i.name) {
                let shape = interp::concrete_shape(&i.ty.shape, &feeds.dims).unwrap();
                feeds.inputs.insert(i.name.clone(), Tensor::zeros(&shape));
            }
        }
    }
}

/// Feeds for `step` at `batch` rows of `s` new positions against caches
/// of `cache` positions, every cache zero.
fn step_feeds(
    step: &Graph,
    batch: usize,
    s: usize,
    cache: usize,
    weights: &HashMap<String, Tensor>,
) -> Feeds {
    let mut feeds = Feeds {
        dims: HashMap::from([
            ("B".into(), batch as i64),
            ("T".into(), s as i64),
            (CACHE_DIM.into(), cache as i64),
        ]),
        params: weights.clone(),
        ..Feeds::default()
    };
    for n in step.g.node_indices() {
        if let Op::State(st) = &step.g[n].op {
            let shape = interp::concrete_shape(&st.ty.shape, &feeds.dims).unwrap();
            feeds.state.insert(st.name.clone(), Tensor::zeros(&shape));
        }
    }
    feeds
}

fn vocab(g: &Graph) -> usize {
    let logits = g.output(&Role::Logits).unwrap();
    g.ty(logits).shape.last().unwrap().as_const().unwrap() as usize
}

/// The logits of `tokens` ([B, L]) run whole, and run through the decode
/// step in `chunks` of positions (their sum L), both in f64.
fn whole_and_decoded(
    whole: &Graph,
    step: &Graph,
    batch: usize,
    tokens: &[f64],
    chunks: &[usize],
    cache: usize,
) -> (Vec<f64>, Vec<f64>) {
    let len = tokens.len() / batch;
    let weights = params(whole, 7);
    let mut feeds = Feeds {
        dims: HashMap::from([("B".into(), batch as i64), ("T".into(), len as i64)]),
        params: weights.clone(),
        ..Feeds::default()
    };
    feeds.inputs.insert(
        "tokens".into(),
        Tensor::new(vec![batch, len], tokens.to_vec()),
    );
    zero_other_inputs(whole, &mut feeds);
    let vals = interp::run(whole, &feeds, Precision::F64).unwrap();
    let all = vals[&whole.output(&Role::Logits).unwrap()].data.clone();

    let v = vocab(whole);
    let mut state = step_feeds(step, batch, 1, cache, &weights).state;
    // Decoded rows, laid out as the whole run's [B, L, V].
    let mut decoded = vec![f64::NAN; batch * len * v];
    let mut at = 0;
    for &s in chunks {
        let mut feeds = step_feeds(step, batch, s, cache, &weights);
        // The caches as the chunks before left them.
        feeds.state = state.clone();
        let rows: Vec<f64> = (0..batch)
            .flat_map(|b| tokens[b * len + at..b * len + at + s].to_vec())
            .collect();
        feeds
            .inputs
            .insert("tokens".into(), Tensor::new(vec![batch, s], rows));
        let positions = (at..at + s).map(|p| p as f64).collect();
        feeds
            .inputs
            .insert(POSITIONS_INPUT.into(), Tensor::new(vec![s], positions));
        zero_other_inputs(step, &mut feeds);
        let r = interp::step::train_step(step, &mut feeds, 0.0, 1, Precision::F64).unwrap();
        let logits = r.logits.expect("the decode step outputs its logits");
        for b in 0..batch {
            for i in 0..s {
                let from = (b * s + i) * v;
                let to = (b * len + at + i) * v;
                decoded[to..to + v].copy_from_slice(&logits.data[from..from + v]);
            }
        }
        state = feeds.state;
        at += s;
    }
    assert_eq!(at, len);
    (all, decoded)
}

#[test]
fn decoding_a_few_positions_at_a_time_gives_the_whole_sequences_logits() {
    for (file, sets) in common::decode_models() {
        let (whole, step) = graphs(&file, &sets);
        let v = vocab(&whole);
        let (batch, len) = (2, 7);
        let tokens: Vec<f64> = (0..batch * len)
            .map(|i| ((i * 7 + 3) % v.min(23)) as f64)
            .collect();
        // A prefill of 3, then one at a time, then 2: every row sees the
        // keys before it, whether written this step or before.
        for (chunks, cache) in [(vec![3, 1, 1, 2], 8), (vec![1; 7], 7), (vec![7], 9)] {
            let (all, decoded) = whole_and_decoded(&whole, &step, batch, &tokens, &chunks, cache);
            let scale = all.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            for (i, (a, d)) in all.iter().zip(&decoded).enumerate() {
                assert!(
                    (a - d).abs() <= 1e-12 * scale.max(1.0),
                    "{file} chunks {chunks:?}: logit {i} is {d} decoded and {a} whole"
                );
            }
        }
        // The step keeps a key and a value cache a layer, and reads the
        // positions.
        let caches = step
            .outputs
            .iter()
            .filter(|(r, _)| matches!(r, Role::NewState(_)))
            .count();
        assert!(caches >= 2 && caches % 2 == 0, "{file}: {caches} caches");
        for which in ["k", "v"] {
            let name = cache_name(0, which);
            assert!(
                step.outputs
                    .iter()
                    .any(|(r, _)| *r == Role::NewState(name.clone())),
                "{file}: no {name}"
            );
        }
    }
}

/// The greedy step (`decode::greedy_graph`) outputs, for each position,
/// the index of the largest of the first `classes` logits the decode step
/// gives it (the first of equals), and no logits. One class fewer than the
/// logits' width: a pick past it would be a padded vocabulary's unused
/// column. f64 on both sides, so the picks agree exactly.
#[test]
fn the_greedy_step_picks_the_largest_logit() {
    for (file, sets) in common::decode_models() {
        let (_, step) = graphs(&file, &sets);
        let v = vocab(&step);
        let greedy = greedy_graph(&step, v as i64 - 1).unwrap();
        assert!(greedy.output(&Role::Logits).is_none(), "{file}");
        let (batch, s, cache) = (3, 4, 6);
        let weights = params(&step, 11);
        let tokens: Vec<f64> = (0..batch * s).map(|i| ((i * 5 + 1) % v) as f64).collect();
        let run = |g: &Graph| {
            let mut feeds = step_feeds(g, batch, s, cache, &weights);
            feeds
                .inputs
                .insert("tokens".into(), Tensor::new(vec![batch, s], tokens.clone()));
            feeds.inputs.insert(
                POSITIONS_INPUT.into(),
                Tensor::new(vec![s], (0..s).map(|p| p as f64).collect()),
            );
            zero_other_inputs(g, &mut feeds);
            interp::step::train_step(g, &mut feeds, 0.0, 1, Precision::F64).unwrap()
        };
        let logits = run(&step).logits.unwrap().data;
        let picks = run(&greedy)
            .next_tokens
            .expect("the greedy step's picks")
            .data;
        assert_eq!(picks.len(), batch * s, "{file}");
        for (r, &pick) in picks.iter().enumerate() {
            let row = &logits[r * v..r * v + v - 1];
            let want = (0..row.len()).fold(0, |best, j| if row[j] > row[best] { j } else { best });
            assert_eq!(pick as usize, want, "{file}: row {r}");
        }
    }
}

/// A check that bites: the last token's logits differ when every token
/// of the sequence is fed at position 0.
#[test]
fn a_step_at_the_wrong_positions_gives_other_logits() {
    let (file, sets) = common::decode_models().remove(1);
    let (whole, step) = graphs(&file, &sets);
    let tokens: Vec<f64> = (0..5).map(|i| (i * 5 + 1) as f64).collect();
    let (all, decoded) = whole_and_decoded(&whole, &step, 1, &tokens, &[5], 5);
    let same = all.iter().zip(&decoded).all(|(a, d)| (a - d).abs() < 1e-12);
    assert!(same, "one step of the whole sequence is the whole sequence");
    // Now feed every chunk at position 0 by hand: the rotation differs.
    let mut feeds = step_feeds(&step, 1, 1, 5, &params(&whole, 7));
    let mut last = Vec::new();
    for &t in &tokens {
        feeds
            .inputs
            .insert("tokens".into(), Tensor::new(vec![1, 1], vec![t]));
        // Every token at position 0: each overwrites the first cache row,
        // sees itself alone and is rotated as the first.
        feeds
            .inputs
            .insert(POSITIONS_INPUT.into(), Tensor::new(vec![1], vec![0.0]));
        zero_other_inputs(&step, &mut feeds);
        last = interp::step::train_step(&step, &mut feeds, 0.0, 1, Precision::F64)
            .unwrap()
            .logits
            .unwrap()
            .data;
    }
    let v = last.len();
    let want = &all[all.len() - v..];
    let diff = want
        .iter()
        .zip(&last)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff > 1e-3, "positions are ignored: {diff}");
}

fn refusal(src: &str) -> String {
    let c = common::compile_with(src, "model.dsl", &[]);
    let whole = logits_graph(&c).unwrap();
    match decode_graph(&whole) {
        Ok(_) => panic!("decoded:\n{src}"),
        Err(e @ Failure::Model(_)) | Err(e @ Failure::Usage(_)) => e.render("model.dsl", src),
    }
}

#[test]
fn what_cannot_be_decoded_is_refused_at_its_place() {
    let base = |attn: &str, pos: &str| {
        format!(
            "const vocab = 11\nconst d = 8\ndim B, T\ninput tokens: i32[B, T]\ninput targets: i32[B, T]\nparam emb: [vocab, d] = normal(0.02)\nparam pos: [16, d] = normal(0.02)\nparam w: [d, 3 * d] = normal(0.02)\nlet x = embedding(emb, tokens) + {pos}\nlet q, k, v = split(x @ w, 3)\nlet y = merge_heads({attn})\nlet logits = y @ transpose(emb)\ntrain {{\n    loss = cross_entropy(logits, targets)\n    optimizer = sgd(lr = 0.1)\n}}\n"
        )
    };
    let causal = "attention(heads(q, 2), heads(k, 2), heads(v, 2), causal = true)";
    let open = "attention(heads(q, 2), heads(k, 2), heads(v, 2))";
    let e = refusal(&base(open, "pos[0:T]"));
    assert!(
        e.contains("not causal") && e.contains("model.dsl:11:"),
        "{e}"
    );
    let e = refusal(&base(causal, "pos[1:T + 1]"));
    assert!(
        e.contains("slice reads along the positions") && e.contains("model.dsl:9:"),
        "{e}"
    );
    // Heads wider than the cached attention keeps in registers.
    let wide = base(
        "attention(heads(q, 1), heads(k, 1), heads(v, 1), causal = true)",
        "pos[0:T]",
    )
    .replace("const d = 8", "const d = 1032");
    let e = refusal(&wide);
    assert!(
        e.contains("heads of up to 1024 features") && e.contains("model.dsl:11:"),
        "{e}"
    );
    // The same model with its table read from 0 decodes.
    let src = base(causal, "pos[0:T]");
    let c = common::compile_with(&src, "model.dsl", &[]);
    assert!(decode_graph(&logits_graph(&c).unwrap()).is_ok());
}

/// The decode step builds for a Hopper GPU and a consumer Ampere GPU at
/// one new row and at a prefill's 17, for batches of 3 and 32 rows, its
/// plan places the caches, the products of 32 rows or fewer run as skinny
/// GEMMs (chosen at the sizes), and every kernel compiles with NVRTC
/// without spills or local arrays. Skipped, with a message, where NVRTC is
/// not installed (CI installs it).
#[test]
fn decode_steps_build_and_compile_with_nvrtc() {
    use fusec_compiler::kernel::fuse::fuse;
    use fusec_compiler::select::{select_at, Choice};
    use fusec_compiler::target::Target;
    let nvrtc_on = common::nvrtc_ready();
    let mut seen = std::collections::HashSet::new();
    for (file, sets) in common::decode_models() {
        let (_, decode) = graphs(&file, &sets);
        let read = weights_as_read(&decode).unwrap();
        let greedy = greedy_graph(&read, vocab(&decode) as i64).unwrap();
        for step in [decode, read, greedy] {
            let program = fuse(&step);
            for (device, arch) in [("h100", "sm_90a"), ("rtx3090", "sm_86")] {
                let target = Target::for_device(device, false).unwrap();
                for (b, t) in [(3, 1), (3, 17), (32, 1)] {
                    let sizes = std::collections::BTreeMap::from([
                        ("B".to_string(), b),
                        ("T".to_string(), t),
                        (CACHE_DIM.to_string(), 40),
                    ]);
                    let selection = select_at(&step, &program, &target, None, Some(&sizes));
                    assert!(
                        !selection
                            .choices
                            .iter()
                            .any(|c| matches!(c, Choice::Missing)),
                        "{file} {device}: a kernel has no code"
                    );
                    // Every product here has B x T rows: skinny at 32 or
                    // fewer, cuBLASLt past them.
                    let skinny = selection
                        .choices
                        .iter()
                        .filter(|c| matches!(c, Choice::Skinny(_)))
                        .count();
                    let library = selection
                        .choices
                        .iter()
                        .filter(|c| matches!(c, Choice::Library | Choice::SplitGemm))
                        .count();
                    match b * t <= 32 {
                        true => assert!(skinny > 0 && library == 0, "{file} {device} {b}x{t}"),
                        false => assert!(skinny == 0 && library > 0, "{file} {device} {b}x{t}"),
                    }
                    let plan =
                        fusec_compiler::plan::plan_with(&step, &program, Some(&selection), &sizes)
                            .unwrap_or_else(|e| panic!("{file} {device}: {e}"));
                    let caches = plan
                        .buffers
                        .iter()
                        .filter(|b| b.name.starts_with("kv_cache."))
                        .count();
                    assert!(caches >= 2, "{file}: the plan places no caches");
                    assert!(
                        plan.logits.is_some() != plan.next_tokens.is_some(),
                        "{file}: no logits buffer, or logits beside picks"
                    );
                    if !nvrtc_on {
                        continue;
                    }
                    for (name, text) in &selection.sources {
                        let key = (arch, text.replace(name.as_str(), "KERNEL"));
                        if !seen.insert(key) {
                            continue;
                        }
                        let cubin = fusec_runtime::nvrtc::compile(name, text, arch)
                            .unwrap_or_else(|e| panic!("{file} {name} ({arch}): {e}"));
                        assert!(
                            cubin.spill_store_bytes == 0 && cubin.spill_load_bytes == 0,
                            "{name} ({arch}) spills:\n{}",
                            cubin.log
                        );
                        assert!(
                            !cubin.local_arrays(),
                            "{name} ({arch}) keeps an array in local memory:\n{}",
                            cubin.log
                        );
                    }
                }
            }
        }
    }
}

/// gpt2-small's greedy decode step at its own sizes on an H100, batch 1
/// and 32: every product is a skinny GEMM, and each launch has blocks for
/// at least half the GPU's 132 multiprocessors (a product of one row reads
/// its weights once; a launch on a few multiprocessors would read them at
/// a few multiprocessors' bandwidth).
#[test]
fn gpt2_small_decode_products_are_skinny_and_fill_the_gpu() {
    use fusec_compiler::select::Choice;
    let (_, decode) = graphs("dsl-examples/gpt2-small.dsl", &[]);
    let greedy = greedy_graph(&weights_as_read(&decode).unwrap(), 50257).unwrap();
    let target = fusec_compiler::target::Target::for_device("h100", false).unwrap();
    for b in [1, 32] {
        let dims = std::collections::BTreeMap::from([
            ("B".to_string(), b),
            ("T".to_string(), 1),
            (CACHE_DIM.to_string(), 264),
        ]);
        let l = fusec_compiler::lowering::lower(&greedy, &target, &dims, None).unwrap();
        let mut products = 0;
        for (k, c) in l.program.kernels.iter().zip(&l.selection.choices) {
            let product = k
                .nodes
                .iter()
                .any(|&n| matches!(greedy.g[n].op, Op::MatMul(_)));
            if !product {
                continue;
            }
            products += 1;
            let Choice::Skinny(launch) = c else {
                panic!("batch {b}: {} is not a skinny product: {c:?}", k.name);
            };
            let env = |s: &str| dims.get(s).copied();
            let blocks = launch.grid(&env).unwrap()[0];
            assert!(
                blocks >= 66,
                "batch {b}: {} launches {blocks} blocks",
                k.name
            );
        }
        assert_eq!(products, 49, "batch {b}: 4 products a layer and the head");
    }
}
