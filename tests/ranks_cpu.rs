//! Data parallelism on the CPU reference: N ranks, each a thread with its
//! own interpreter and its slice of the batch, meeting at every all-reduce,
//! against one rank with the whole batch. In f64 the two agree to rounding
//! (1e-12 relative: only the order of the batch sums differs), and the
//! ranks' weights stay bit for bit the same.

mod common;

use common::sizes;
use fusec::backend::ranks::{Build, Ranks};
use fusec::backend::{init_params, Backend, Cpu};
use fusec_compiler::autodiff::zero::ZeroStage;
use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use fusec_compiler::interp::peers::Peers;
use fusec_compiler::interp::Precision;
use fusec_compiler::ir::DType;

/// A model file, the sizes it is set to, and the parameter whose values
/// the runs compare.
struct Model {
    file: &'static str,
    sets: &'static [(&'static str, &'static str)],
    weights: &'static str,
}

const GPT2: Model = Model {
    file: "dsl-examples/gpt2-small.dsl",
    sets: &[
        ("layers", "1"),
        ("d", "32"),
        ("n_heads", "2"),
        ("vocab", "61"),
        ("ctx", "16"),
    ],
    weights: "wte",
};

/// Sizes nobody chose for the shipped examples: a head dim of 20, one
/// key/value head for two query heads, an MLP width of 100, and a
/// vocabulary of 1713 that `pad-dims` widens to 1728 (its untied head read
/// through a padded copy).
const LLAMA_ODD: Model = Model {
    file: "dsl-examples/llama-small.dsl",
    sets: &[
        ("layers", "1"),
        ("d", "40"),
        ("n_heads", "2"),
        ("n_kv_heads", "1"),
        ("ffn", "100"),
        ("vocab", "1713"),
    ],
    weights: "output",
};

fn compiled(ranks: u32, edit: &dyn Fn(String) -> String) -> fusec_compiler::driver::Compiled {
    compiled_for(ranks, None, edit)
}

fn compiled_for(
    ranks: u32,
    zero_rank: Option<u32>,
    edit: &dyn Fn(String) -> String,
) -> fusec_compiler::driver::Compiled {
    compiled_reducing(
        &GPT2,
        ranks,
        zero_rank.map(|r| (r, ZeroStage::One)),
        None,
        edit,
    )
}

/// The step of rank `zero.0` of a job at ZeRO stage `zero.1`, or (`None`)
/// of every rank, averaging gradients in `reduce` (`--reduce-dtype`).
fn compiled_reducing(
    model: &Model,
    ranks: u32,
    zero: Option<(u32, ZeroStage)>,
    reduce: Option<DType>,
    edit: &dyn Fn(String) -> String,
) -> fusec_compiler::driver::Compiled {
    compiled_grouped(model, ranks, 0, zero, reduce, edit)
}

/// [`compiled_reducing`] with ZeRO's pieces split over groups of `group`
/// consecutive ranks (0: all of them), `zero.0` the rank's place in its
/// group (`--shard-within`).
fn compiled_grouped(
    model: &Model,
    ranks: u32,
    group: u32,
    zero: Option<(u32, ZeroStage)>,
    reduce: Option<DType>,
    edit: &dyn Fn(String) -> String,
) -> fusec_compiler::driver::Compiled {
    let path = common::root().join(model.file);
    let src = edit(std::fs::read_to_string(path).unwrap());
    let opts = Options {
        overrides: model
            .sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ranks,
        zero_rank: zero.map(|z| z.0),
        zero_stage: zero.map_or(ZeroStage::One, |z| z.1),
        shard_group: group,
        reduce_dtype: reduce,
        ..Options::default()
    };
    compile(&src, "model", &opts).unwrap_or_else(|f| panic!("{}", f.render(model.file, &src)))
}

/// Tokens of step `s` for a whole batch of `rows` rows of `t`.
fn batch(s: u64, rows: usize, t: usize, vocab: u64) -> (Vec<f64>, Vec<f64>) {
    let mut x = s.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % vocab) as f64
    };
    let tokens: Vec<f64> = (0..rows * t).map(|_| next()).collect();
    let targets: Vec<f64> = (0..rows * t).map(|_| next()).collect();
    (tokens, targets)
}

struct Run {
    losses: Vec<f64>,
    norms: Vec<Option<f64>>,
    weights: Vec<f64>,
}

fn train(b: &mut dyn Backend, weights: &str, rows: usize, t: usize, steps: u64, micro: u64) -> Run {
    init_params(b, 7).unwrap();
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for s in 1..=steps {
        for m in 0..micro {
            let (tokens, targets) = batch(s * 10 + m, rows, t, 61);
            b.set("tokens", &tokens).unwrap();
            b.set("targets", &targets).unwrap();
            if micro > 1 {
                let apply = if m + 1 == micro { 1.0 } else { 0.0 };
                b.set(fusec_compiler::autodiff::APPLY_INPUT, &[apply])
                    .unwrap();
            }
            let st = b.step(1e-2, s).unwrap();
            if m + 1 == micro {
                losses.push(st.loss);
                norms.push(st.grad_norm);
            }
        }
    }
    let weights = b.get(weights).unwrap();
    Run {
        losses,
        norms,
        weights,
    }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

fn check(ranks: usize, micro: u32) {
    check_with(ranks, micro, None)
}

fn check_with(ranks: usize, micro: u32, zero: Option<ZeroStage>) {
    check_reducing(&GPT2, ranks, micro, zero, None, Precision::F64, 1e-12)
}

fn check_reducing(
    model: &'static Model,
    ranks: usize,
    micro: u32,
    zero: Option<ZeroStage>,
    reduce: Option<DType>,
    precision: Precision,
    tol: f64,
) {
    check_job(Job {
        model,
        ranks,
        group: ranks,
        micro,
        zero,
        reduce,
        precision,
        tol,
    })
}

/// A data-parallel job of the CPU reference, checked against one rank.
#[derive(Clone, Copy)]
struct Job {
    model: &'static Model,
    ranks: usize,
    /// The ranks ZeRO splits its pieces over (`--shard-within`): `ranks`,
    /// or fewer for hybrid sharding.
    group: usize,
    micro: u32,
    zero: Option<ZeroStage>,
    /// `--reduce-dtype`.
    reduce: Option<DType>,
    precision: Precision,
    tol: f64,
}

/// N ranks with batch B against one rank with N x B over 4 steps: losses
/// and gradient norms within `tol` (relative), and in f64 the weights too
/// (absolute); the ranks' weights the same bits (under stage 3, each
/// rank's piece the same bits as the same place's in every other group).
fn check_job(job: Job) {
    let Job {
        model,
        ranks,
        group,
        micro,
        zero,
        reduce,
        precision,
        tol,
    } = job;
    let (b, t) = (2usize, 8usize);
    let edit = move |src: String| {
        if micro > 1 {
            src.replace(
                "clip_grad_norm = 1.0",
                &format!("clip_grad_norm = 1.0\n    micro_batches = {micro}"),
            )
        } else {
            src
        }
    };
    let one = compiled_reducing(model, 1, None, None, &edit);
    let (_, dims_one) = sizes(&[("B", (ranks * b) as i64), ("T", t as i64)]);
    let mut single = Cpu::new(&one.optimized, &dims_one, precision).unwrap();
    let reference = train(&mut single, model.weights, ranks * b, t, 4, micro as u64);

    let (_, dims) = sizes(&[("B", b as i64), ("T", t as i64)]);
    let builds: Vec<(usize, Build)> = Peers::group(ranks)
        .into_iter()
        .enumerate()
        .map(|(r, peers)| {
            let many = compiled_grouped(
                model,
                ranks as u32,
                group as u32,
                zero.map(|z| ((r % group) as u32, z)),
                reduce,
                &edit,
            );
            let g = many.optimized;
            let dims = dims.clone();
            let build: Build = Box::new(move || {
                let mut cpu = Cpu::new(&g, &dims, precision)?;
                cpu.join(peers);
                if zero.is_some() {
                    cpu.share_updates(group as u32);
                }
                Ok(Box::new(cpu) as Box<dyn Backend>)
            });
            (r, build)
        })
        .collect();
    let mut dp = Ranks::new(builds, ranks).unwrap();
    assert_eq!(dp.shapes()["tokens"], vec![ranks * b, t]);
    let run = train(&mut dp, model.weights, ranks * b, t, 4, micro as u64);

    for (s, (a, r)) in run.losses.iter().zip(&reference.losses).enumerate() {
        assert!(
            rel(*a, *r) < tol,
            "{ranks} ranks, step {}: loss {a} against {r}",
            s + 1
        );
    }
    for (a, r) in run.norms.iter().zip(&reference.norms) {
        let (a, r) = (a.expect("a norm"), r.expect("a norm"));
        assert!(rel(a, r) < tol, "{ranks} ranks: grad norm {a} against {r}");
    }
    let worst = run
        .weights
        .iter()
        .zip(&reference.weights)
        .map(|(a, r)| (a - r).abs())
        .fold(0.0, f64::max);
    // As stored, an element whose gradient is near zero may take AdamW's
    // step (about lr whatever the gradient's size) the other way after a
    // rounding: the weights are compared where nothing is rounded.
    if precision == Precision::F64 {
        assert!(worst < tol, "{ranks} ranks: weights differ by {worst}");
    }
    let per_rank = dp.each(|_, b| b.get(model.weights).unwrap()).unwrap();
    if zero == Some(ZeroStage::Three) {
        // Each rank holds its own piece alone, elements [lo, hi) of the
        // one-rank run's weights (in f64, to rounding).
        let params = &dp.graph().params;
        let i = params.iter().position(|p| p.name == model.weights).unwrap();
        for (r, w) in per_rank.iter().enumerate() {
            let place = (r % group) as u32;
            let (lo, hi) = fusec_compiler::autodiff::zero::piece(params, group as u32, place, i)
                .map_or((0, 0), |pc| (pc.lo as usize, pc.hi as usize));
            assert!(
                w == &per_rank[r % group],
                "rank {r}'s piece is not its group's place {place}'s bit for bit"
            );
            assert_eq!(w.len(), hi - lo, "rank {r} holds another piece");
            if precision == Precision::F64 {
                let off = w
                    .iter()
                    .zip(&reference.weights[lo..hi])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0, f64::max);
                assert!(off < tol, "rank {r}'s piece is {off} off");
            }
        }
    } else {
        // Every rank holds the same weights, bit for bit.
        for w in &per_rank[1..] {
            assert!(w == &per_rank[0], "the ranks' weights drifted apart");
        }
    }
    println!(
        "{ranks} ranks (groups of {group}) x B={b}, micro-batches {micro}: losses {:?}, worst weight difference {worst:.1e}",
        run.losses
    );
}

#[test]
fn two_simulated_ranks_reproduce_one_rank_with_the_whole_batch() {
    check(2, 1);
}

#[test]
fn four_simulated_ranks_with_micro_batches_reproduce_one_rank() {
    check(4, 2);
}

/// ZeRO stage 1: each rank keeps and updates its own parameters' optimizer
/// state and hands the new values on; the run is the one-rank run.
#[test]
fn zero_stage_one_reproduces_one_rank_with_the_state_split() {
    check_with(2, 1, Some(ZeroStage::One));
    check_with(4, 2, Some(ZeroStage::One));
    // As stored: each rank's forward pass reads its bf16 parameters, which
    // the owners round from their f32 masters, as one rank rounds its f32
    // parameters in the step's cast.
    check_reducing(
        &GPT2,
        2,
        1,
        Some(ZeroStage::One),
        None,
        Precision::AsStored,
        1e-2,
    );
    // The ranks keep the parameters in bf16 (nothing reads them in f32),
    // the masters as state.
    let rank = compiled_for(4, Some(1), &|s| s).optimized;
    for p in &rank.params {
        let node = &rank.g[p.node];
        assert_eq!(node.outputs[0].dtype, DType::BF16, "{}", p.name);
        let readers = rank.users(fusec_compiler::ir::Value {
            node: p.node,
            port: 0,
        });
        assert!(
            readers
                .iter()
                .all(|&(n, _)| !matches!(rank.g[n].op, fusec_compiler::ops::Op::Cast(_))),
            "{} is still cast",
            p.name
        );
    }
    // The ranks' states together are the one-rank state plus the f32
    // masters of the parameters (bf16 model: the ranks keep the parameters
    // in bf16), each rank a quarter of it (to 64 elements a parameter).
    let state_elements = |g: &fusec_compiler::ir::Graph| -> usize {
        g.g.node_indices()
            .filter_map(|n| match &g.g[n].op {
                fusec_compiler::ops::Op::State(st) => {
                    Some(st.ty.numel().as_const().unwrap() as usize)
                }
                _ => None,
            })
            .sum()
    };
    let one = compiled(1, &|s| s);
    let params: usize = one
        .optimized
        .params
        .iter()
        .map(|p| p.ty.numel().as_const().unwrap() as usize)
        .sum();
    let full = state_elements(&one.optimized) + params;
    let per_rank: Vec<usize> = (0..4u32)
        .map(|r| state_elements(&compiled_for(4, Some(r), &|s| s).optimized))
        .collect();
    assert_eq!(per_rank.iter().sum::<usize>(), full, "{per_rank:?}");
    let slack = 3 * 64 * one.optimized.params.len();
    for &n in &per_rank {
        assert!(n.abs_diff(full / 4) <= slack, "{per_rank:?} of {full}");
    }
}

/// `--reduce-dtype bf16`: the gradients averaged in bf16 and read so by
/// the update. Computed in f64 (no rounding to the stored types) the run is
/// the one-rank run to the last bits, so the means, the casts and the
/// buckets' places are right; computed as stored, the bf16 roundings of
/// each rank's gradient (and of micro-batch sums) and of the mean keep the
/// losses and norms within bf16's 1e-2.
#[test]
fn gradients_averaged_in_bf16_reproduce_one_rank() {
    check_reducing(&GPT2, 2, 1, None, Some(DType::BF16), Precision::F64, 1e-12);
    check_reducing(
        &GPT2,
        4,
        1,
        Some(ZeroStage::One),
        Some(DType::BF16),
        Precision::F64,
        1e-12,
    );
    check_reducing(
        &GPT2,
        2,
        1,
        None,
        Some(DType::BF16),
        Precision::AsStored,
        1e-2,
    );
    check_reducing(
        &GPT2,
        4,
        2,
        Some(ZeroStage::One),
        Some(DType::BF16),
        Precision::AsStored,
        1e-2,
    );
    // Each gradient is averaged as the bf16 its product made (not widened
    // first), and the buckets hold the gradients they hold in f32.
    let (_, dims) = sizes(&[("B", 2), ("T", 8)]);
    let plan_of = |reduce| {
        let c = compiled_reducing(&GPT2, 4, None, reduce, &|s| s);
        let p = fusec_compiler::kernel::fuse::fuse(&c.optimized);
        fusec_compiler::plan::plan(&c.optimized, &p, &dims).unwrap()
    };
    let (wide, narrow) = (plan_of(None), plan_of(Some(DType::BF16)));
    let dtypes = |p: &fusec_compiler::plan::Plan| -> Vec<Vec<String>> {
        p.collectives
            .iter()
            .filter(|c| !c.every_micro_batch)
            .map(|c| c.dtypes(&p.buffers).into_iter().map(String::from).collect())
            .collect()
    };
    assert!(dtypes(&wide).iter().flatten().all(|d| d == "f32"));
    assert!(
        dtypes(&narrow).iter().flatten().all(|d| d == "bf16"),
        "{:?}",
        dtypes(&narrow)
    );
    assert_eq!(
        dtypes(&wide).iter().map(Vec::len).collect::<Vec<_>>(),
        dtypes(&narrow).iter().map(Vec::len).collect::<Vec<_>>(),
        "the same gradients in each bucket"
    );
    let bytes = |p: &fusec_compiler::plan::Plan| p.collectives.iter().map(|c| c.bytes).sum::<u64>();
    assert!(
        bytes(&narrow) * 2 <= bytes(&wide) + 64,
        "{} against {}",
        bytes(&narrow),
        bytes(&wide)
    );
}

#[test]
fn the_whole_batch_splits_by_rows_and_a_wrong_size_is_refused() {
    let many = compiled(2, &|s| s);
    let (_, dims) = sizes(&[("B", 1), ("T", 4)]);
    let builds: Vec<(usize, Build)> = Peers::group(2)
        .into_iter()
        .enumerate()
        .map(|(r, peers)| {
            let g = many.optimized.clone();
            let dims = dims.clone();
            let build: Build = Box::new(move || {
                let mut cpu = Cpu::new(&g, &dims, Precision::F64)?;
                cpu.join(peers);
                Ok(Box::new(cpu) as Box<dyn Backend>)
            });
            (r, build)
        })
        .collect();
    let mut group = Ranks::new(builds, 2).unwrap();
    let rows: Vec<f64> = (0..8).map(f64::from).collect();
    group.set("tokens", &rows).unwrap();
    let parts = group.each(|_, b| b.get("tokens").unwrap()).unwrap();
    assert_eq!(
        parts,
        vec![vec![0.0, 1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0, 7.0]]
    );
    let e = group.set("tokens", &rows[..4]).unwrap_err().to_string();
    assert!(e.contains("holds 8 values (all ranks), given 4"), "{e}");
}

/// ZeRO under a launcher: each process runs its own ranks, and a
/// checkpoint gathers the states other processes keep, every process the
/// same states in the same order (NCCL's rule). So a process running one
/// rank of four names every rank's states, the same names on each rank
/// and in a process running them all, and the whole of a state it holds
/// only a piece of is not readable until gathered.
#[test]
fn every_process_names_the_whole_jobs_states() {
    let (_, dims) = sizes(&[("B", 2), ("T", 8)]);
    let open = |ranks: &[u32]| -> Ranks {
        let builds: Vec<(usize, Build)> = ranks
            .iter()
            .map(|&r| {
                let g = compiled_for(4, Some(r), &|s| s).optimized;
                let dims = dims.clone();
                let build: Build = Box::new(move || {
                    Ok(Box::new(Cpu::new(&g, &dims, Precision::F64)?) as Box<dyn Backend>)
                });
                (r as usize, build)
            })
            .collect();
        Ranks::new(builds, 4).unwrap()
    };
    let all = open(&[0, 1, 2, 3]).state_names();
    assert!(all.iter().any(|n| n == "wte.adam_m"), "{all:?}");
    assert!(all.iter().all(|n| !n.ends_with(".master")), "{all:?}");
    for r in 0..4u32 {
        let one = open(&[r]);
        assert_eq!(one.state_names(), all, "rank {r} alone");
        assert_eq!(one.shapes()["wte.adam_m"], one.shapes()["wte"]);
    }
    // wte (the first parameter, 31% of them) lies in rank 0's and rank 1's
    // runs: rank 1 alone holds a piece of its moments.
    let err = open(&[1]).get("wte.adam_m").unwrap_err().to_string();
    assert!(err.contains("other processes"), "{err}");
}

/// ZeRO with master weights on sizes nobody chose: llama-small with a head
/// dim of 20, grouped queries, an MLP width of 100 and a vocabulary padded
/// from 1713 to 1728, on 3 ranks (pieces that fall anywhere): in f64 the
/// one-rank run to the last bits, as stored within bf16's rounding.
#[test]
fn zero_on_odd_sizes_reproduces_one_rank() {
    let rank = compiled_reducing(&LLAMA_ODD, 3, Some((2, ZeroStage::One)), None, &|s| s).optimized;
    assert!(
        (0..rank.params.len()).all(|i| fusec_compiler::autodiff::zero::has_master(&rank, i)),
        "every parameter of the bf16 model kept in bf16"
    );
    check_reducing(
        &LLAMA_ODD,
        3,
        1,
        Some(ZeroStage::One),
        None,
        Precision::F64,
        1e-12,
    );
    check_reducing(
        &LLAMA_ODD,
        3,
        1,
        Some(ZeroStage::One),
        None,
        Precision::AsStored,
        1e-2,
    );
}

/// ZeRO stage 2: each gradient reduced into its owners' pieces, which the
/// update reads as they are; with micro-batches each one's gradient is
/// reduced and the pieces summed. With clipping (the model clips at 1.0),
/// on 2, 3 and 4 ranks (pieces that fall anywhere), with micro-batches,
/// with the gradients averaged in bf16, and on the odd-sized LLaMA: in f64
/// the one-rank run to rounding (1e-12: only the batch sums' order
/// differs), as stored within bf16's 1e-2.
#[test]
fn zero_stage_two_reproduces_one_rank_with_the_gradients_split() {
    let two = Some(ZeroStage::Two);
    for ranks in [2, 3, 4] {
        check_with(ranks, 1, two);
    }
    check_with(4, 2, two);
    check_with(3, 3, two);
    check_reducing(&GPT2, 4, 1, two, Some(DType::BF16), Precision::F64, 1e-12);
    check_reducing(&GPT2, 2, 2, two, None, Precision::AsStored, 1e-2);
    check_reducing(&LLAMA_ODD, 3, 1, two, None, Precision::F64, 1e-12);
    check_reducing(&LLAMA_ODD, 3, 1, two, None, Precision::AsStored, 1e-2);
}

/// What stage 2 keeps: no rank's step outputs a whole gradient or keeps a
/// whole accumulator; each collective that reduces a gradient this rank
/// owns a piece of returns that piece alone, and the update reads it; the
/// micro-batch accumulators the ranks keep are their pieces, together the
/// whole model once.
#[test]
fn zero_stage_two_keeps_only_the_pieces_of_the_gradients() {
    use fusec_compiler::ir::graph::Role;
    use fusec_compiler::ops::Op;
    let micro = |s: String| {
        s.replace(
            "clip_grad_norm = 1.0",
            "clip_grad_norm = 1.0\n    micro_batches = 2",
        )
    };
    let one = compiled_reducing(&GPT2, 1, None, None, &micro).optimized;
    let params: i64 = one
        .params
        .iter()
        .map(|p| p.ty.numel().as_const().unwrap())
        .sum();
    let mut acc_total = 0;
    for r in 0..3u32 {
        let g = compiled_reducing(&GPT2, 3, Some((r, ZeroStage::Two)), None, &micro).optimized;
        assert!(
            g.outputs
                .iter()
                .all(|(role, _)| !matches!(role, Role::Grad(_))),
            "rank {r} outputs a whole gradient"
        );
        let mut pieces = 0;
        for n in g.g.node_indices() {
            match &g.g[n].op {
                Op::AllReduce(a) if a.piece.is_some() => {
                    let (lo, hi) = a.piece.unwrap();
                    let p = &g.params[a.owners_of.expect("a piece of a parameter")];
                    let own = fusec_compiler::autodiff::zero::piece(
                        &g.params,
                        3,
                        r,
                        a.owners_of.unwrap(),
                    )
                    .expect("this rank owns the piece");
                    assert_eq!((lo as u64, hi as u64), (own.lo, own.hi), "{}", p.name);
                    assert_eq!(g.g[n].outputs[0].numel().as_const(), Some(hi - lo));
                    assert!(
                        a.every_micro_batch,
                        "with micro-batches each one is reduced"
                    );
                    pieces += 1;
                }
                Op::AdamW(a) => assert_eq!(a.grad_piece, a.range.is_some()),
                Op::State(st) if st.name.ends_with(".grad_acc") => {
                    acc_total += st.ty.numel().as_const().unwrap();
                }
                _ => {}
            }
        }
        assert!(pieces > 0, "rank {r} owns a piece of some parameter");
    }
    assert_eq!(
        acc_total, params,
        "the ranks' accumulators together are the model once"
    );
}

/// A memory budget over ZeRO ranks (stages 1, 2 and 3, 3 ranks): one choice,
/// made on the rank that needs the most, drops the same activations on
/// every rank (each recomputes the same ops, so their backward passes
/// finish the gradients in one order), every rank fits, and the run is
/// still one rank's with the whole batch (f64, 1e-12: recomputing changes
/// no arithmetic).
#[test]
fn a_memory_budget_over_zero_ranks_recomputes_the_same_values_on_each() {
    use fusec_compiler::recompute::{fit_ranks, probe};
    let dev = fusec_compiler::device::default_device();
    let target = fusec_compiler::select::Target::for_device(fusec_compiler::device::DEFAULT, false)
        .expect("the default device's target");
    let (b, t, ranks) = (4usize, 16usize, 3usize);
    let (_, dims) = sizes(&[("B", b as i64), ("T", t as i64)]);
    let one = compiled(1, &|s| s);
    let (_, dims_one) = sizes(&[("B", (ranks * b) as i64), ("T", t as i64)]);
    let mut single = Cpu::new(&one.optimized, &dims_one, Precision::F64).unwrap();
    let reference = train(&mut single, GPT2.weights, ranks * b, t, 4, 1);
    for stage in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let mut graphs: Vec<_> = (0..ranks as u32)
            .map(|r| {
                compiled_reducing(&GPT2, ranks as u32, Some((r, stage)), None, &|s| s).optimized
            })
            .collect();
        let nodes: Vec<usize> = graphs.iter().map(|g| g.g.node_count()).collect();
        let peaks: Vec<u64> = graphs
            .iter()
            .map(|g| probe(g, &dims, &target, dev).unwrap().arena_bytes)
            .collect();
        // Halfway from the largest rank's peak down to the least it can
        // need: activations must go, and can.
        let worst = (0..ranks).max_by_key(|&r| peaks[r]).unwrap();
        let floor = fusec_compiler::recompute::floor(&graphs[worst], &dims, &target, dev)
            .unwrap()
            .arena_bytes;
        let budget = (peaks[worst] + floor) / 2;
        let choice = fit_ranks(&mut graphs, &dims, budget, &target, dev)
            .unwrap_or_else(|e| panic!("{stage:?}: {e}"))
            .expect("a budget under every rank's peak recomputes something");
        assert!(!choice.dropped.is_empty());
        for (r, g) in graphs.iter().enumerate() {
            assert_eq!(
                g.g.node_count() - nodes[r],
                choice.ops_added,
                "{stage:?}: rank {r} recomputes other ops"
            );
            // Stage 3: a recomputed forward op reads the backward pass's
            // gather, not the forward's (which would then live on through
            // the backward pass).
            for n in g.g.node_indices() {
                if !matches!(g.g[n].op, fusec_compiler::ops::Op::AllGather(_)) {
                    continue;
                }
                let phase = g.g[n].phase;
                let mut stack = vec![n];
                while let Some(m) = stack.pop() {
                    for (u, _) in g.users(fusec_compiler::ir::Value { node: m, port: 0 }) {
                        if g.g[u].op.is_view() {
                            stack.push(u);
                        } else {
                            assert_eq!(
                                g.g[u].phase, phase,
                                "rank {r}: a {phase:?} gather read in {:?}",
                                g.g[u].phase
                            );
                        }
                    }
                }
            }
            let after = probe(g, &dims, &target, dev).unwrap().arena_bytes;
            assert!(
                after <= budget,
                "{stage:?}: rank {r} needs {after} of {budget}"
            );
        }
        let builds: Vec<(usize, Build)> = Peers::group(ranks)
            .into_iter()
            .zip(graphs)
            .enumerate()
            .map(|(r, (peers, g))| {
                let dims = dims.clone();
                let build: Build = Box::new(move || {
                    let mut cpu = Cpu::new(&g, &dims, Precision::F64)?;
                    cpu.join(peers);
                    cpu.share_updates(ranks as u32);
                    Ok(Box::new(cpu) as Box<dyn Backend>)
                });
                (r, build)
            })
            .collect();
        let mut group = Ranks::new(builds, ranks).unwrap();
        let run = train(&mut group, GPT2.weights, ranks * b, t, 4, 1);
        for (a, r) in run.losses.iter().zip(&reference.losses) {
            assert!(rel(*a, *r) < 1e-12, "{stage:?}: loss {a} against {r}");
        }
        let worst = run
            .weights
            .iter()
            .zip(&reference.weights)
            .map(|(a, r)| (a - r).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-12, "{stage:?}: weights differ by {worst}");
    }
}

/// ZeRO stage 3: each rank keeps its piece of every parameter, gathered
/// whole before the forward and the backward pass read it; the gradients
/// are stage 2's pieces and the update writes the rank's piece in place.
/// With clipping, on 2, 3 and 4 ranks, with micro-batches, with the
/// gradients averaged in bf16, and on the odd-sized LLaMA: in f64 the
/// one-rank run to rounding (1e-12: only the batch sums' order differs),
/// as stored within bf16's 1e-2 (each rank's forward reads the bf16 cast
/// of the f32 pieces, as one rank reads the cast of its f32 parameter).
#[test]
fn zero_stage_three_reproduces_one_rank_with_the_weights_split() {
    let three = Some(ZeroStage::Three);
    for ranks in [2, 3, 4] {
        check_with(ranks, 1, three);
    }
    check_with(4, 2, three);
    check_reducing(&GPT2, 3, 1, three, Some(DType::BF16), Precision::F64, 1e-12);
    check_reducing(&GPT2, 2, 2, three, None, Precision::AsStored, 1e-2);
    check_reducing(&LLAMA_ODD, 3, 1, three, None, Precision::F64, 1e-12);
    check_reducing(&LLAMA_ODD, 3, 1, three, None, Precision::AsStored, 1e-2);
}

/// What stage 3 keeps and sends, on 2, 3 and 4 ranks of the bf16 GPT-2:
/// each parameter is stored as the rank's flat f32 piece, read only by
/// its gathers (through a cast to bf16: the gather moves the compute
/// dtype) and by its update; each pass reads a gather of its own (the
/// forward's copy is not read by the backward, even through a view), at
/// most one a pass and parameter, each placed after the previous pass's
/// last node; every rank runs the same collectives in the same order (the
/// kind, the parameter, the sizes: NCCL's rule); and the ranks' parameter
/// pieces and states together hold the one-rank step's parameters and
/// state once.
#[test]
fn zero_stage_three_keeps_only_pieces_of_the_weights() {
    use fusec_compiler::ir::graph::Phase;
    use fusec_compiler::ir::{Graph, Value};
    use fusec_compiler::ops::Op;
    // The pass a node's value serves, looking through views.
    fn pass_of(g: &Graph, v: Value) -> Vec<Phase> {
        if g.g[v.node].op.is_view() {
            return g
                .users(v)
                .into_iter()
                .flat_map(|(m, _)| pass_of(g, Value { node: m, port: 0 }))
                .collect();
        }
        vec![g.g[v.node].phase]
    }
    let elements = |g: &Graph| -> i64 {
        g.g.node_indices()
            .filter_map(|n| match &g.g[n].op {
                Op::State(st) => st.ty.numel().as_const(),
                Op::Param(_) => g.g[n].outputs[0].numel().as_const(),
                _ => None,
            })
            .sum()
    };
    let one = compiled(1, &|s| s).optimized;
    for ranks in [2u32, 3, 4] {
        let mut sequences = Vec::new();
        let mut held = 0;
        for r in 0..ranks {
            let g = compiled_reducing(&GPT2, ranks, Some((r, ZeroStage::Three)), None, &|s| s)
                .optimized;
            held += elements(&g);
            for (i, p) in g.params.iter().enumerate() {
                let own = fusec_compiler::autodiff::zero::piece(&g.params, ranks, r, i)
                    .map_or(0, |pc| (pc.hi - pc.lo) as i64);
                let node = &g.g[p.node];
                assert_eq!(node.outputs[0].dtype, DType::F32, "{}", p.name);
                assert_eq!(node.outputs[0].numel().as_const(), Some(own), "{}", p.name);
                let mut gathers = Vec::new();
                for (n, _) in g.users(Value {
                    node: p.node,
                    port: 0,
                }) {
                    match &g.g[n].op {
                        Op::AllGather(a) => gathers.push((n, a.clone())),
                        Op::Cast(c) if c.to == DType::BF16 => {
                            for (m, _) in g.users(Value { node: n, port: 0 }) {
                                match &g.g[m].op {
                                    Op::AllGather(a) => gathers.push((m, a.clone())),
                                    other => panic!("{}: a cast read by {other:?}", p.name),
                                }
                            }
                        }
                        Op::AdamW(a) => assert!(a.master && a.grad_piece, "{}", p.name),
                        other => panic!("rank {r}: {} read by {other:?}", p.name),
                    }
                }
                assert!(!gathers.is_empty(), "{} is never gathered", p.name);
                let mut passes = Vec::new();
                for (n, a) in &gathers {
                    assert_eq!((a.rank, a.param), (r, i));
                    assert_eq!(g.g[*n].outputs[0].shape, p.ty.shape);
                    let readers: Vec<Phase> = g
                        .users(Value { node: *n, port: 0 })
                        .into_iter()
                        .flat_map(|(m, _)| pass_of(&g, Value { node: m, port: 0 }))
                        .collect();
                    assert!(
                        readers.iter().all(|&ph| ph == g.g[*n].phase),
                        "rank {r}: {}'s {:?} gather read by {readers:?}",
                        p.name,
                        g.g[*n].phase
                    );
                    passes.push(g.g[*n].phase);
                }
                passes.sort_by_key(|&ph| ph as u8);
                let before = passes.len();
                passes.dedup();
                assert_eq!(passes.len(), before, "{}: two gathers for one pass", p.name);
            }
            // The collectives in the step's order, without what differs by
            // rank (the rank and its piece).
            let order = g.topo_order();
            let seq: Vec<String> = order
                .iter()
                .filter_map(|&n| match &g.g[n].op {
                    Op::AllGather(a) => Some(format!(
                        "gather {} {:?} {}",
                        a.param, a.pieces, g.g[n].outputs[0]
                    )),
                    Op::AllReduce(a) => Some(format!(
                        "reduce {:?} {} {}",
                        a.owners_of,
                        g.ty(g.inputs(n)[0]),
                        a.every_micro_batch
                    )),
                    _ => None,
                })
                .collect();
            // The backward's gathers come after the forward pass's nodes.
            let last_forward = order
                .iter()
                .rposition(|&n| g.g[n].phase == Phase::Forward)
                .unwrap();
            let backward_gathers = order
                .iter()
                .enumerate()
                .filter(|&(_, &n)| {
                    matches!(g.g[n].op, Op::AllGather(_)) && g.g[n].phase == Phase::Backward
                })
                .map(|(at, _)| at)
                .collect::<Vec<_>>();
            assert!(!backward_gathers.is_empty());
            assert!(backward_gathers.iter().all(|&at| at > last_forward));
            // Each gather runs just before its first reader (it takes that
            // reader's turn), not at the start of its pass, where the
            // whole model would be gathered at once: at most the other
            // gathers and casts of the same op's parameters in between.
            let at: std::collections::HashMap<_, usize> =
                order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
            for (i, &n) in order.iter().enumerate() {
                if !matches!(g.g[n].op, Op::AllGather(_)) {
                    continue;
                }
                let mut first = usize::MAX;
                let mut stack = vec![n];
                while let Some(m) = stack.pop() {
                    for (u, _) in g.users(Value { node: m, port: 0 }) {
                        if g.g[u].op.is_view() {
                            stack.push(u);
                        } else {
                            first = first.min(at[&u]);
                        }
                    }
                }
                let between = order[i + 1..first]
                    .iter()
                    .filter(|&&m| {
                        !g.g[m].op.is_view() && !matches!(g.g[m].op, Op::AllGather(_) | Op::Cast(_))
                    })
                    .count();
                assert!(
                    between <= 2,
                    "rank {r}: {} nodes between a gather and its first reader",
                    between
                );
            }
            sequences.push(seq);
        }
        for (r, s) in sequences.iter().enumerate().skip(1) {
            assert_eq!(s, &sequences[0], "{ranks} ranks: rank {r} against rank 0");
        }
        assert_eq!(
            held,
            elements(&one),
            "{ranks} ranks: the pieces and states together are one rank's"
        );
    }
}

/// Hybrid sharding (`--shard-within`): ZeRO's pieces split over groups of
/// consecutive ranks (a host's), every group holding the same pieces; the
/// gradients still averaged over every rank. At each stage, 4 ranks in 2
/// groups and 6 in 2 groups of 3 (the odd LLaMA) train as one rank with
/// the whole batch does (f64 within 1e-12; as stored within bf16's 1e-2),
/// with micro-batches, bf16 reduces and the gradient norm's clipping (whose
/// sum over the ranks counts each piece once a group).
#[test]
fn hybrid_sharding_reproduces_one_rank_at_every_stage() {
    let job = |model, ranks, group, micro, zero, reduce, precision, tol| Job {
        model,
        ranks,
        group,
        micro,
        zero,
        reduce,
        precision,
        tol,
    };
    let f64_ = Precision::F64;
    for stage in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        check_job(job(&GPT2, 4, 2, 1, Some(stage), None, f64_, 1e-12));
    }
    let three = Some(ZeroStage::Three);
    check_job(job(&GPT2, 4, 2, 2, Some(ZeroStage::Two), None, f64_, 1e-12));
    check_job(job(&GPT2, 4, 2, 1, three, Some(DType::BF16), f64_, 1e-12));
    check_job(job(&LLAMA_ODD, 6, 3, 1, three, None, f64_, 1e-12));
    check_job(job(
        &LLAMA_ODD,
        6,
        2,
        1,
        three,
        None,
        Precision::AsStored,
        1e-2,
    ));
}

/// What a hybrid step says of itself: each gradient's mean is over every
/// rank and its owners are places in a group (`group=` in the printed IR,
/// which parses back to the same op); each gather moves one group's
/// pieces; the ranks at one place in each group build the same step.
#[test]
fn a_hybrid_step_splits_within_its_group_and_averages_over_all() {
    use fusec_compiler::ops::Op;
    let three = ZeroStage::Three;
    let g = compiled_grouped(&GPT2, 4, 2, Some((1, three)), None, &|s| s).optimized;
    let (mut reduces, mut gathers) = (0, 0);
    for n in g.g.node_indices() {
        match &g.g[n].op {
            Op::AllReduce(a) => {
                assert_eq!((a.ranks, a.group), (4, 2));
                reduces += 1;
            }
            Op::AllGather(a) => {
                assert_eq!((a.rank, a.pieces.len()), (1, 2));
                gathers += 1;
            }
            _ => {}
        }
    }
    assert!(
        reduces > 0 && gathers > 0,
        "{reduces} reduces, {gathers} gathers"
    );
    assert_eq!(g.shard_group(), Some(2));
    let print = |g: &fusec_compiler::ir::Graph| fusec_compiler::ir::print::print_graph(g, None);
    let text = print(&g);
    assert!(
        text.contains("ranks=4 group=2"),
        "the printed step names its group"
    );
    let parsed = fusec_compiler::ir::parse::parse_graph(&text).expect("the printed step parses");
    assert_eq!(
        print(&parsed),
        text,
        "the printed step parses back to itself"
    );
    // Whole-job sharding prints no group.
    let all = compiled_grouped(&GPT2, 4, 0, Some((1, three)), None, &|s| s).optimized;
    assert!(!print(&all).contains("group="));
    assert_eq!(all.shard_group(), Some(4));
}
