//! The data-parallel step as the compiler builds it, checked without a GPU:
//! where the gradient buckets sit in the launch order, what they hold, how
//! the memory plan treats them, and that one rank's program computes what
//! the single-GPU program does. The buckets of GPT-2 small on 4 GPUs are a
//! snapshot a reviewer can read.

mod common;

use fusec_compiler::driver::{compile, Compiled};
use fusec_compiler::elaborate::Options;
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::types::DType;
use fusec_compiler::kernel::buckets::{is_collective, BUCKET_BYTES};
use fusec_compiler::kernel::fuse::{fuse, fuse_with};
use fusec_compiler::ops::Op;
use fusec_compiler::optimisation::LowerOptions;
use fusec_compiler::plan::plan;
use fusec_compiler::plan::report::report;
use fusec_compiler::plan::roofline::device;
use std::collections::BTreeMap;

fn build(
    file: &str,
    sets: &[(&str, &str)],
    ranks: u32,
    edit: &dyn Fn(String) -> String,
) -> Compiled {
    let (name, src) = common::example(file);
    let src = edit(src);
    let opts = Options {
        overrides: sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ranks,
        ..Options::default()
    };
    compile(&src, &name, &opts).unwrap_or_else(|f| panic!("{}", f.render(&name, &src)))
}

fn sizes(b: i64, t: i64) -> BTreeMap<String, i64> {
    [("B".to_string(), b), ("T".to_string(), t)].into()
}

#[test]
fn gpt2_small_on_four_gpus_buckets_its_gradients_as_the_backward_pass_finishes_them() {
    let c = build("gpt2-small.dsl", &[], 4, &|s| s);
    let g = &c.optimized;
    let p = fuse(g);
    let dims = sizes(8, 1024);
    let pl = plan(g, &p, &dims).unwrap();
    // Every parameter's gradient, and the loss, averaged exactly once.
    let reduced: Vec<_> = p
        .kernels
        .iter()
        .filter(|k| is_collective(g, k))
        .flat_map(|k| k.nodes.iter().copied())
        .collect();
    assert_eq!(reduced.len(), g.params.len() + 1);
    for &n in &reduced {
        assert!(matches!(g.g[n].op, Op::AllReduce(ref a) if a.ranks == 4));
    }
    // Each bucket launches right after the kernel that writes its last
    // input, and is waited for no later than the first reader of a result.
    for c in &pl.collectives {
        let k = &p.kernels[c.launch];
        let ready = k
            .inputs
            .iter()
            .filter_map(|b| {
                p.kernels[..c.launch]
                    .iter()
                    .rposition(|w| w.outputs.contains(b))
            })
            .max()
            .unwrap();
        assert_eq!(ready + 1, c.launch, "{} starts late", k.name);
        let first_read = p.kernels[c.launch + 1..]
            .iter()
            .position(|r| r.inputs.iter().any(|b| k.outputs.contains(b)))
            .map_or(p.kernels.len(), |i| c.launch + 1 + i);
        assert_eq!(c.join, first_read, "{}", k.name);
    }
    // Buckets close at BUCKET_BYTES (only the last may be smaller, and one
    // whose next gradient is needed sooner).
    let small = pl
        .collectives
        .iter()
        .filter(|c| c.bytes < BUCKET_BYTES)
        .count();
    // The loss (4 bytes, averaged on every micro-batch) goes alone.
    let loss: Vec<_> = pl
        .collectives
        .iter()
        .filter(|c| c.every_micro_batch)
        .collect();
    assert_eq!(loss.len(), 1);
    assert_eq!(loss[0].bytes, 4);
    assert!(small <= 3, "{small} buckets under BUCKET_BYTES");
    // Each bucket's gradients lie end to end, averaged as one NCCL call,
    // at the default size and at PyTorch DDP's 25 MiB (`--bucket-mib`).
    assert!(one_run_per_bucket(&p, &pl) >= 3);
    let narrow = LowerOptions {
        bucket_bytes: Some(25 << 20),
        ..LowerOptions::default()
    };
    let narrow_program = fuse_with(g, &narrow);
    let narrow_plan = plan(g, &narrow_program, &dims).unwrap();
    assert!(narrow_plan.collectives.len() > pl.collectives.len());
    assert!(one_run_per_bucket(&narrow_program, &narrow_plan) >= 12);
    // Averaged in place: the arena is the one-GPU arena.
    let one = build("gpt2-small.dsl", &[], 1, &|s| s);
    let one_plan = plan(&one.optimized, &fuse(&one.optimized), &dims).unwrap();
    assert_eq!(pl.arena_bytes, one_plan.arena_bytes);
    let text = report(
        g,
        &p,
        &pl,
        c.training.g.node_count(),
        device("h100").unwrap(),
    );
    let section: String = text
        .lines()
        .skip_while(|l| !l.starts_with("data parallel"))
        .take_while(|l| !l.is_empty())
        .map(|l| format!("{l}\n"))
        .collect();
    insta::assert_snapshot!("gpt2_small_buckets_on_4_gpus", section);
}

#[test]
fn micro_batches_average_the_accumulated_sum_once_per_step() {
    let edit = |s: String| {
        s.replace(
            "clip_grad_norm = 1.0",
            "clip_grad_norm = 1.0\n    micro_batches = 2",
        )
    };
    let sets = [
        ("layers", "1"),
        ("d", "32"),
        ("n_heads", "2"),
        ("vocab", "61"),
        ("ctx", "16"),
    ];
    let c = build("gpt2-small.dsl", &sets, 2, &edit);
    let g = &c.optimized;
    // The all-reduce reads the f32 accumulator's sum, not the micro-batch's gradient.
    for n in g.g.node_indices() {
        if let Op::AllReduce(_) = g.g[n].op {
            let x = g.inputs(n)[0];
            let is_loss = g
                .outputs
                .iter()
                .any(|(r, v)| *r == Role::Loss && g.inputs(v.node).first() == Some(&x));
            if !is_loss {
                assert_eq!(g.ty(x).dtype, fusec_compiler::ir::DType::F32);
                assert!(
                    matches!(g.g[x.node].op, Op::Binary(_)),
                    "reads {}",
                    g.g[x.node].op.name()
                );
            }
        }
    }
}

#[test]
fn one_ranks_program_computes_what_the_single_gpu_program_does() {
    use fusec_compiler::interp::random::random_feeds;
    use fusec_compiler::interp::Precision;
    use fusec_compiler::kernel::interp::run_program;
    let sets = [
        ("layers", "1"),
        ("d", "16"),
        ("n_heads", "2"),
        ("vocab", "23"),
        ("ctx", "8"),
    ];
    let one = build("gpt2-small.dsl", &sets, 1, &|s| s);
    let two = build("gpt2-small.dsl", &sets, 2, &|s| s);
    let dims = common::dims(&[("B", 2), ("T", 5)]);
    let feeds = random_feeds(&one.optimized, &dims, 5).unwrap();
    let run = |c: &Compiled| {
        let p = fuse(&c.optimized);
        let bufs = run_program(&c.optimized, &p, &feeds, Precision::F64).unwrap();
        let pick = |role: Role| {
            let v = c
                .optimized
                .outputs
                .iter()
                .find(|(r, _)| *r == role)
                .unwrap()
                .1;
            bufs[p.buffer_of(v).unwrap()].data.clone()
        };
        (pick(Role::Loss), pick(Role::GradNorm))
    };
    // Alone, a rank's mean over the ranks is its own value: same outputs.
    assert_eq!(run(&one), run(&two));
}

/// The same layout for models of other shapes: llama-small (its
/// weight-gradient products run late, so gradients are made in another
/// order than the buckets take them) and the awkward-sizes test model
/// (head dim 80, grouped queries, vocabulary 5003, MLP width 1713, whose
/// gradients end between alignment units), on 2 and 4 ranks. One
/// micro-batch: with several, a bucket averages the sums the micro-batches
/// accumulated, temporaries the plan places one by one, and each goes as a
/// call of its own (as the first check shows).
#[test]
fn every_bucket_is_one_run_for_other_shapes() {
    let one_micro = |s: String| s.replace("micro_batches = 2", "micro_batches = 1");
    let c = build("llama-small.dsl", &[], 2, &|s| s);
    let p = fuse(&c.optimized);
    let pl = plan(&c.optimized, &p, &sizes(4, 256)).unwrap();
    let apart = pl
        .collectives
        .iter()
        .filter(|c| c.tensors.len() > 1)
        .any(|c| {
            c.tensors.windows(2).any(|w| {
                let (a, b) = (&pl.buffers[w[0].0], &pl.buffers[w[1].0]);
                b.offset
                    != (a.offset + a.bytes).div_ceil(fusec_compiler::plan::ALIGN)
                        * fusec_compiler::plan::ALIGN
            })
        });
    assert!(
        apart,
        "llama-small's 2 micro-batches now average one run a bucket: tighten this test"
    );
    for ranks in [2, 4] {
        let c = build("llama-small.dsl", &[], ranks, &one_micro);
        let g = &c.optimized;
        let p = fuse(g);
        let pl = plan(g, &p, &sizes(4, 256)).unwrap();
        assert!(one_run_per_bucket(&p, &pl) >= 2, "llama-small on {ranks}");
    }
    let path = common::root().join("tests/models/twins/gqa-hd80.dsl");
    let src = std::fs::read_to_string(path).unwrap();
    for ranks in [2, 4] {
        let opts = Options {
            ranks,
            ..Options::default()
        };
        let c = compile(&src, "gqa-hd80", &opts)
            .unwrap_or_else(|f| panic!("{}", f.render("gqa-hd80", &src)));
        let g = &c.optimized;
        let p = fuse(g);
        let pl = plan(g, &p, &sizes(4, 256)).unwrap();
        assert!(one_run_per_bucket(&p, &pl) >= 1, "gqa-hd80 on {ranks}");
    }
}

/// Checks that each gradient bucket of `pl` lies end to end in the arena,
/// in the bucket's order (the next at the last one's end, aligned up), and
/// that the runtime merges it into one NCCL call; returns how many
/// buckets (the loss's aside) it checked.
fn one_run_per_bucket(
    p: &fusec_compiler::kernel::Program,
    pl: &fusec_compiler::plan::Plan,
) -> usize {
    let align = |x: u64| x.div_ceil(fusec_compiler::plan::ALIGN) * fusec_compiler::plan::ALIGN;
    let mut runs = 0;
    for c in pl.collectives.iter().filter(|c| !c.every_micro_batch) {
        for w in c.tensors.windows(2) {
            let (a, b) = (&pl.buffers[w[0].0], &pl.buffers[w[1].0]);
            assert_eq!(
                b.offset,
                align(a.offset + a.bytes),
                "{}: {} and {} apart",
                p.kernels[c.launch].name,
                a.name,
                b.name
            );
        }
        let tensors: Vec<fusec_runtime::nccl::Tensor> = c
            .tensors
            .iter()
            .map(|&(i, o)| {
                let (bi, bo) = (&pl.buffers[i], &pl.buffers[o]);
                fusec_runtime::nccl::Tensor {
                    input: (1 << 30) + bi.offset,
                    output: (1 << 30) + bo.offset,
                    count: (bi.bytes / 4) as usize,
                    dtype: fusec_compiler::ir::types::DType::F32,
                }
            })
            .collect();
        let merged = fusec_runtime::nccl::coalesce(&tensors, fusec_compiler::plan::ALIGN);
        assert_eq!(merged.len(), 1, "{}", p.kernels[c.launch].name);
        runs += 1;
    }
    runs
}

/// Under ZeRO every rank's step is compiled for it (its own pieces), and
/// NCCL needs every rank to issue the same collectives in the same order
/// with the same sizes, or the ranks hang: gpt2-small and llama-small on 4
/// ranks, fp32 and bf16, give each rank the same collectives (launch,
/// tensors, bytes, the parameter each gradient belongs to); each
/// gradient's mean goes to its owners, and the loss and the norm's sum of
/// squares to every rank.
#[test]
fn zero_ranks_issue_the_same_collectives_in_the_same_order() {
    for (file, precision) in [
        ("gpt2-small.dsl", DType::BF16),
        ("gpt2-small.dsl", DType::F32),
        ("llama-small.dsl", DType::BF16),
    ] {
        let (name, src) = common::example(file);
        // Each collective's launch, tensors, bytes and owners.
        type Collectives = Vec<(usize, usize, u64, Vec<Option<usize>>)>;
        let sequences: Vec<Collectives> = (0..4u32)
            .map(|r| {
                let opts = Options {
                    ranks: 4,
                    zero_rank: Some(r),
                    precision: Some(precision),
                    ..Options::default()
                };
                let c = compile(&src, &name, &opts)
                    .unwrap_or_else(|f| panic!("{}", f.render(&name, &src)));
                let g = &c.optimized;
                let p = fuse(g);
                let pl = plan(g, &p, &sizes(2, 64)).unwrap();
                pl.collectives
                    .iter()
                    .map(|c| (c.launch, c.tensors.len(), c.bytes, c.owners_of.clone()))
                    .collect()
            })
            .collect();
        for (r, s) in sequences.iter().enumerate().skip(1) {
            assert_eq!(
                s, &sequences[0],
                "{file} {precision:?}: rank {r} against rank 0"
            );
        }
        let owned: usize = sequences[0]
            .iter()
            .map(|c| c.3.iter().filter(|o| o.is_some()).count())
            .sum();
        let whole: usize = sequences[0]
            .iter()
            .map(|c| c.1 - c.3.iter().filter(|o| o.is_some()).count())
            .sum();
        let params = compile(&src, &name, &Options::default())
            .unwrap()
            .optimized
            .params
            .len();
        assert_eq!(owned, params, "{file}: every gradient to its owners");
        assert_eq!(
            whole, 2,
            "{file}: the loss and the norm's sum to every rank"
        );
    }
}

/// ZeRO with a bf16 model (gpt2-small on 4 ranks): each rank keeps the
/// parameters in bf16 and the f32 masters of its own pieces as optimizer
/// state. The step reads the bf16 parameters as they are (no cast of the
/// masters at its start), the tied table still runs the head's products at
/// the padded 50304 rows (its zero rows are the parameter's own), and a
/// rank holds 2 + 12/4 bytes of parameters and state an element where one
/// GPU holds 4 + 8.
#[test]
fn zero_keeps_bf16_parameters_and_its_own_masters() {
    use fusec_compiler::plan::MemKind;
    let (name, src) = common::example("gpt2-small.dsl");
    let plan_for = |zero_rank: Option<u32>| {
        let opts = Options {
            ranks: 4,
            zero_rank,
            ..Options::default()
        };
        let c = compile(&src, &name, &opts).unwrap_or_else(|f| panic!("{}", f.render(&name, &src)));
        let p = fuse(&c.optimized);
        let pads = p.gemm_pads.len();
        let params: i64 = c
            .optimized
            .params
            .iter()
            .map(|p| p.ty.numel().as_const().unwrap())
            .sum();
        (
            plan(&c.optimized, &p, &sizes(4, 1024)).unwrap(),
            pads,
            params,
        )
    };
    let (whole, whole_pads, n) = plan_for(None);
    let (rank, rank_pads, _) = plan_for(Some(2));
    assert!(whole_pads > 0);
    assert_eq!(rank_pads, whole_pads, "the head's products stay padded");
    let wte = rank.buffers.iter().find(|b| b.name == "wte").unwrap();
    assert_eq!(wte.dtype, DType::BF16);
    assert_eq!(wte.zero_rows, 50304 - 50257);
    // A vocabulary nobody chose (5003, padded to 5056) keeps its padded
    // products too.
    for zero_rank in [None, Some(1)] {
        let opts = Options {
            ranks: 4,
            zero_rank,
            overrides: [("vocab".to_string(), "5003".to_string())].into(),
            ..Options::default()
        };
        let c = compile(&src, &name, &opts).unwrap_or_else(|f| panic!("{}", f.render(&name, &src)));
        let p = fuse(&c.optimized);
        assert_eq!(
            p.gemm_pads.len(),
            whole_pads,
            "vocab 5003, rank {zero_rank:?}"
        );
        // Under ZeRO the zero rows are the bf16 parameter's own (else its
        // cast copy's).
        let pl = plan(&c.optimized, &p, &sizes(4, 1024)).unwrap();
        let wte = pl.buffers.iter().find(|b| b.name == "wte").unwrap();
        let want = if zero_rank.is_some() { 5056 - 5003 } else { 0 };
        assert_eq!(wte.zero_rows, want, "rank {zero_rank:?}");
    }
    for (what, p, dtype) in [
        ("one rank's", &whole, DType::F32),
        ("ZeRO's", &rank, DType::BF16),
    ] {
        let params = p.buffers.iter().filter(|b| b.kind == MemKind::Param);
        assert!(params.clone().all(|b| b.dtype == dtype), "{what}");
        let casts = p
            .launches
            .iter()
            .filter(|l| {
                l.ops.iter().any(|o| o == "cast")
                    && l.inputs
                        .iter()
                        .any(|&b| p.buffers[b].kind == MemKind::Param)
            })
            .count();
        assert_eq!(
            casts > 0,
            dtype == DType::F32,
            "{what} step casts its parameters: {casts}"
        );
    }
    let bytes = |p: &fusec_compiler::plan::Plan, k: MemKind| p.bytes_by_kind[&k] as f64 / n as f64;
    let (wp, ws) = (
        bytes(&whole, MemKind::Param),
        bytes(&whole, MemKind::OptimizerState),
    );
    let (rp, rs) = (
        bytes(&rank, MemKind::Param),
        bytes(&rank, MemKind::OptimizerState),
    );
    assert!(
        (4.0..4.05).contains(&wp) && (8.0..8.05).contains(&ws),
        "{wp} {ws}"
    );
    assert!(
        (2.0..2.05).contains(&rp) && (2.9..3.1).contains(&rs),
        "{rp} {rs}"
    );
}

/// ZeRO stage 3's plan, on 2 and 4 ranks of gpt2-small and llama-small
/// (bf16): every rank runs the same collectives in the same order (NCCL's
/// rule: the launch, the bytes, the owners, each gather's parameter and
/// pieces), each gather runs on every micro-batch, each parameter is
/// gathered for the forward and (where the backward reads it) again for
/// the backward pass, every gather but the step's first is issued while
/// the layer before its reader computes (compute launches between its
/// launch and its join: the prefetch), and a rank's arena at B = 8, T =
/// 1024 is below stage 2's (the bf16 weights whole on every rank) by at
/// least two thirds of the 2 bytes an element stage 3 stops keeping (each
/// rank holds 4 bytes an element of 1 / N of the weights in place of 2
/// bytes of all of them and 4 of 1 / N of the masters): what may take
/// the rest is the gathered weights in flight at the peak (two sets ahead
/// and the sets being read: a few MiB here) and the arena's packing,
/// which moves by a buffer's size (76-99% was measured). (The loss head
/// in chunks, as `fusec train` runs it: its input-gradient products read
/// the forward pass's gather of the tied table, which still lives.)
#[test]
fn zero_stage_three_plans_the_same_gathers_on_every_rank_one_reader_ahead() {
    use fusec_compiler::autodiff::zero::ZeroStage;
    for file in ["gpt2-small.dsl", "llama-small.dsl"] {
        let (name, src) = common::example(file);
        for ranks in [2u32, 4] {
            let compiled = |r: u32, stage: ZeroStage| {
                let opts = Options {
                    ranks,
                    zero_rank: Some(r),
                    zero_stage: stage,
                    ..Options::default()
                };
                let mut c = compile(&src, &name, &opts)
                    .unwrap_or_else(|f| panic!("{}", f.render(&name, &src)));
                // The loss head in chunks, as `fusec train` runs it.
                fusec_compiler::loss_head::chunk(
                    &mut c.optimized,
                    &sizes(8, 1024),
                    fusec_compiler::loss_head::Rows::Auto,
                )
                .unwrap();
                c
            };
            let dims = sizes(8, 1024);
            type Seq = Vec<(
                usize,
                u64,
                Option<(usize, Vec<(u64, u64)>)>,
                Vec<Option<usize>>,
            )>;
            let mut seqs: Vec<Seq> = Vec::new();
            let mut arenas = Vec::new();
            for r in 0..ranks {
                let c = compiled(r, ZeroStage::Three);
                let g = &c.optimized;
                let p = fuse(g);
                let pl = plan(g, &p, &dims).unwrap();
                arenas.push(pl.arena_bytes);
                let gathers: Vec<_> = pl
                    .collectives
                    .iter()
                    .filter(|c| c.gather.is_some())
                    .collect();
                let mut per_param = vec![0; g.params.len()];
                for c in &gathers {
                    let ga = c.gather.as_ref().unwrap();
                    per_param[ga.param] += 1;
                    assert!(c.every_micro_batch, "{file}: a gather skips a micro-batch");
                    assert_eq!(c.tensors.len(), 1);
                }
                assert!(
                    per_param.iter().all(|&k| k == 1 || k == 2),
                    "{file}: gathers a parameter {per_param:?} times"
                );
                // A product's weight is read by the products of both passes.
                let mut weights = std::collections::BTreeSet::new();
                for n in g.g.node_indices() {
                    let Op::AllGather(a) = &g.g[n].op else {
                        continue;
                    };
                    let mut stack = vec![n];
                    while let Some(m) = stack.pop() {
                        for (u, _) in g.users(fusec_compiler::ir::Value { node: m, port: 0 }) {
                            match &g.g[u].op {
                                Op::MatMul(_) => {
                                    weights.insert(a.param);
                                }
                                op if op.is_view() => stack.push(u),
                                _ => {}
                            }
                        }
                    }
                }
                // (but GPT-2's tied table, which the loss head's chunks read
                // as the forward pass gathered it).
                assert!(weights.len() >= 4, "{file}: {weights:?}");
                for &i in &weights {
                    let (k, name) = (per_param[i], &g.params[i].name);
                    let want = if name == "wte" { 1 } else { 2 };
                    assert_eq!(k, want, "{file}: {name} gathered {k} times");
                }
                // Compute between a gather's launch and its join, but for
                // the gathers issued before the step's first compute.
                let first_compute = pl
                    .launches
                    .iter()
                    .position(|l| !l.kind.communicates() && !l.kernel.contains("cast"))
                    .unwrap();
                for c in &gathers {
                    let between = (c.launch + 1..c.join)
                        .filter(|&i| !pl.launches[i].kind.communicates())
                        .count();
                    assert!(
                        between > 0 || c.launch < first_compute,
                        "{file}, {ranks} ranks: {} is issued just before its reader",
                        pl.launches[c.launch].kernel
                    );
                }
                seqs.push(
                    pl.collectives
                        .iter()
                        .map(|c| {
                            (
                                c.launch,
                                c.bytes,
                                c.gather.as_ref().map(|g| (g.param, g.pieces.clone())),
                                c.owners_of.clone(),
                            )
                        })
                        .collect(),
                );
            }
            for (r, s) in seqs.iter().enumerate().skip(1) {
                assert_eq!(
                    s, &seqs[0],
                    "{file}, {ranks} ranks: rank {r} against rank 0"
                );
            }
            let c2 = compiled(0, ZeroStage::Two);
            let stage2 = plan(&c2.optimized, &fuse(&c2.optimized), &dims)
                .unwrap()
                .arena_bytes;
            let numel: u64 = c2
                .optimized
                .params
                .iter()
                .map(|p| p.ty.numel().as_const().unwrap() as u64)
                .sum();
            // Stage 2 keeps 2 bytes of every element and 4 of its piece's
            // masters; stage 3 the 4 bytes of its piece alone.
            let saved = 2 * numel;
            let worst = *arenas.iter().max().unwrap();
            println!(
                "{file}, {ranks} ranks: stage 3 {worst} bytes, stage 2 {stage2}: {:.0}% of the {saved} whole weights saved",
                (stage2 as f64 - worst as f64) / saved as f64 * 100.0
            );
            assert!(
                worst + saved * 2 / 3 <= stage2,
                "{file}, {ranks} ranks: stage 3 needs {worst} bytes, stage 2 {stage2}, of which the whole weights are {saved}"
            );
        }
    }
}
