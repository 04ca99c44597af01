//! Data parallelism on real GPUs: N ranks with batch B (NCCL between them,
//! the collectives inside the CUDA graph of the step) against one GPU with
//! batch N x B, over 20 steps: losses and gradient norms within 1e-5
//! relative in fp32 and 1e-2 in bf16, with and without micro-batches, ZeRO
//! stage 1 and gradients averaged in bf16 (`--reduce-dtype bf16`).
//! Needs two GPUs and NCCL; says so and passes over it otherwise (a failure
//! where FUSEC_REQUIRE_GPUS is set). With one GPU, the same checks run with
//! the ranks sharing it and meeting through host memory instead of NCCL
//! (`fusec_runtime::loopback`): the plan's collectives, the executor's
//! issues and joins and ZeRO's pieces on a real GPU, NCCL itself not.

mod common;

use common::sizes;
use fusec::backend::{init_params, ranks, Backend, Gpu, GpuOptions};
use fusec_compiler::autodiff::zero::ZeroStage;
use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use fusec_compiler::ir::DType;
use fusec_compiler::optimisation::LowerOptions;
use fusec_runtime::{device, nccl};
use std::collections::BTreeMap;
use std::sync::Arc;

fn gpus() -> Option<usize> {
    let skip = |why: String| {
        assert!(
            std::env::var_os("FUSEC_REQUIRE_GPUS").is_none(),
            "FUSEC_REQUIRE_GPUS is set: {why}"
        );
        common::skip(&why);
        None
    };
    if !device::driver_present() {
        return skip("no CUDA driver on this machine".into());
    }
    if !nccl::present() {
        return skip("no NCCL library on this machine".into());
    }
    let n = device::count();
    if n < 2 {
        return skip(format!("{n} GPU(s); data parallelism needs 2"));
    }
    Some(n)
}

fn compiled(ranks: u32, precision: &str, micro: u32) -> fusec_compiler::driver::Compiled {
    compiled_for(ranks, 0, None, None, precision, micro)
}

/// The step of rank `zero.0` (its place in its group of `group` ranks; 0:
/// all of them) at ZeRO stage `zero.1`, or of every rank.
fn compiled_for(
    ranks: u32,
    group: u32,
    zero: Option<(u32, ZeroStage)>,
    reduce: Option<DType>,
    precision: &str,
    micro: u32,
) -> fusec_compiler::driver::Compiled {
    let path = common::root().join("dsl-examples/gpt2-small.dsl");
    let src = std::fs::read_to_string(path).unwrap().replace(
        "precision = bf16",
        &format!("precision = {precision}\n    micro_batches = {micro}"),
    );
    let opts = Options {
        overrides: [
            ("layers", "2"),
            ("d", "128"),
            ("n_heads", "2"),
            ("vocab", "997"),
            ("ctx", "64"),
        ]
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
    compile(&src, "gpt2-small", &opts).unwrap_or_else(|f| panic!("{}", f.render("gpt2", &src)))
}

fn batch(s: u64, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut x = s.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 997) as f64
    };
    (
        (0..n).map(|_| next()).collect(),
        (0..n).map(|_| next()).collect(),
    )
}

fn train(b: &mut dyn Backend, rows: usize, t: usize, micro: u64) -> Vec<(f64, f64)> {
    init_params(b, 3).unwrap();
    let mut out = Vec::new();
    for s in 1..=20u64 {
        let mut loss = 0.0;
        let mut norm = 0.0;
        for m in 0..micro {
            let (tokens, targets) = batch(s * 10 + m, rows * t);
            b.set("tokens", &tokens).unwrap();
            b.set("targets", &targets).unwrap();
            if micro > 1 {
                let apply = if m + 1 == micro { 1.0 } else { 0.0 };
                b.set(fusec_compiler::autodiff::APPLY_INPUT, &[apply])
                    .unwrap();
            }
            let st = b.step(3e-4, s).unwrap();
            loss += st.loss / micro as f64;
            norm = st.grad_norm.unwrap_or(f64::NAN);
        }
        out.push((loss, norm));
    }
    out
}

/// A data-parallel job checked against one GPU with the whole batch.
#[derive(Clone, Copy)]
struct Meeting {
    /// Ranks.
    n: usize,
    /// The ranks ZeRO splits its pieces over (`n`, or fewer for hybrid
    /// sharding).
    group: usize,
    precision: &'static str,
    micro: u32,
    tol: f64,
    zero: Option<ZeroStage>,
    /// `--reduce-dtype`.
    reduce: Option<DType>,
    /// All on GPU 0 meeting through host memory, not on N GPUs over NCCL.
    loopback: bool,
}

impl Meeting {
    fn new(n: usize, precision: &'static str, micro: u32, tol: f64) -> Meeting {
        Meeting {
            n,
            group: n,
            precision,
            micro,
            tol,
            zero: None,
            reduce: None,
            loopback: false,
        }
    }
    fn zero(self, zero: Option<ZeroStage>) -> Meeting {
        Meeting { zero, ..self }
    }
    fn reduce(self, reduce: Option<DType>) -> Meeting {
        Meeting { reduce, ..self }
    }
}

/// N ranks against one GPU with the whole batch, the ranks on N GPUs
/// meeting through NCCL, or (`loopback`) all on GPU 0 meeting through
/// host memory.
fn check_meeting(m: Meeting) {
    let Meeting {
        n,
        group: shard,
        precision,
        micro,
        tol,
        zero,
        reduce,
        loopback,
    } = m;
    let (b, t) = (2usize, 64usize);
    let one = compiled(1, precision, micro);
    let (_, dims_one) = sizes(&[("B", (n * b) as i64), ("T", t as i64)]);
    let session = Gpu::open(
        device::open(0).unwrap(),
        &one.optimized,
        &LowerOptions::default(),
        &dims_one,
        None,
        &|_, _| {},
        GpuOptions::default(),
    )
    .unwrap();
    let mut single = session;
    let reference = train(&mut single, n * b, t, micro as u64);
    drop(single);

    let graphs: Vec<_> = (0..n)
        .map(|r| {
            compiled_for(
                n as u32,
                shard as u32,
                zero.map(|z| ((r % shard) as u32, z)),
                reduce,
                precision,
                micro,
            )
            .optimized
        })
        .collect();
    let (_, dims) = sizes(&[("B", b as i64), ("T", t as i64)]);
    let mut group = if loopback {
        ranks::start_loopback(
            graphs,
            &LowerOptions::default(),
            &dims,
            0,
            GpuOptions::default(),
            zero.is_some(),
        )
        .unwrap()
    } else {
        let here: Vec<(usize, usize)> = (0..n).map(|r| (r, r)).collect();
        let id = nccl::unique_id().unwrap();
        ranks::start_gpus(
            graphs,
            &LowerOptions::default(),
            &dims,
            &here,
            n,
            id,
            GpuOptions::default(),
            None,
            Arc::new(|_, _, _| {}),
            zero.is_some(),
        )
        .unwrap()
    };
    let run = train(&mut group, n * b, t, micro as u64);
    let mut worst: f64 = 0.0;
    for (s, ((l, g), (rl, rg))) in run.iter().zip(&reference).enumerate() {
        let dl = (l - rl).abs() / rl.abs();
        let dg = (g - rg).abs() / rg.abs();
        worst = worst.max(dl).max(dg);
        assert!(
            dl <= tol && dg <= tol,
            "{n} GPUs, {precision}, micro-batches {micro}, step {}: loss {l} against {rl}, norm {g} against {rg}",
            s + 1
        );
    }
    let w = group.each(|_, b| b.get("wte").unwrap()).unwrap();
    if zero == Some(ZeroStage::Three) {
        // Each rank its own piece of the weights, of its piece's length.
        let params = &group.graph().params;
        let i = params.iter().position(|p| p.name == "wte").unwrap();
        for (r, piece) in w.iter().enumerate() {
            let place = (r % shard) as u32;
            let own = fusec_compiler::autodiff::zero::piece(params, shard as u32, place, i)
                .map_or(0, |pc| (pc.hi - pc.lo) as usize);
            assert_eq!(piece.len(), own, "rank {r} holds another piece of wte");
            // Each group holds the same pieces, bit for bit.
            assert!(
                piece == &w[r % shard],
                "rank {r}'s piece is not its place's"
            );
        }
    } else {
        // The ranks' weights are the same bits.
        assert!(
            w.iter().all(|x| x == &w[0]),
            "the ranks' weights drifted apart"
        );
    }
    if zero.is_some() {
        // Every state tensor once, on its owner; the checkpoint gathers them.
        let states = group.state_names();
        assert_eq!(
            states.len(),
            fusec::backend::state_names(&one.optimized).len()
        );
        // Gathered over NCCL (a launched job's checkpoint): every rank gets
        // what this process reads from its ranks' pieces, bit for bit (the
        // moments, and a bf16 model's f32 masters through the parameter).
        let params = &group.graph().params;
        let all = fusec_compiler::autodiff::zero::pieces(params, shard as u32);
        for (name, param) in [("wte.adam_m", "wte"), ("wte.master", "wte"), ("wte", "wte")] {
            let i = params.iter().position(|p| p.name == param).unwrap();
            // Stage 1 and 2's bf16 models keep f32 masters as state; stage
            // 3 keeps the f32 pieces of the weights themselves.
            let stage3 = zero == Some(ZeroStage::Three);
            if name.ends_with(".master") && (precision != "bf16" || stage3) {
                continue;
            }
            if name == param && !stage3 {
                continue;
            }
            let numel = group.numel(param);
            let pieces = std::sync::Arc::new(all[i].clone());
            let key = name.to_string();
            let got = group
                .try_each(move |_, b| b.gather_split(&key, &pieces, numel))
                .unwrap();
            let want = group
                .get(if name.ends_with(".master") {
                    param
                } else {
                    name
                })
                .unwrap();
            for (r, g) in got.iter().enumerate() {
                assert!(g == &want, "rank {r}'s gathered {name} differs");
            }
        }
    }
    println!(
        "{n} {} x B={b} against 1 x B={}{}{}{}: {precision}, micro-batches {micro}: worst relative difference over 20 steps {worst:.2e} (allowed {tol:.0e}); last loss {:.5}",
        if loopback { "loopback ranks on one GPU" } else { "GPUs" },
        n * b,
        if shard < n { format!(", split within groups of {shard}") } else { String::new() },
        match zero {
            Some(ZeroStage::One) => ", ZeRO stage 1",
            Some(ZeroStage::Two) => ", ZeRO stage 2",
            Some(ZeroStage::Three) => ", ZeRO stage 3",
            None => "",
        },
        if reduce.is_some() { ", gradients averaged in bf16" } else { "" },
        run[19].0
    );
}

#[test]
fn n_gpus_with_batch_b_train_as_one_gpu_with_n_times_b() {
    let Some(count) = gpus() else { return };
    let mut ns = vec![2];
    if count >= 4 {
        ns.push(4);
    }
    for n in ns {
        for m in every_meeting(n) {
            check_meeting(m);
        }
    }
    // Hybrid sharding: two groups of two ranks, each holding every piece.
    if count >= 4 {
        for m in hybrid_meetings(4, 2) {
            check_meeting(m);
        }
    }
}

/// Every check of `n` ranks: fp32 and bf16, micro-batches, each ZeRO
/// stage, bf16 reduces.
fn every_meeting(n: usize) -> Vec<Meeting> {
    let (one, two, three) = (
        Some(ZeroStage::One),
        Some(ZeroStage::Two),
        Some(ZeroStage::Three),
    );
    let bf16 = Some(DType::BF16);
    let (f, h) = (
        |micro| Meeting::new(n, "fp32", micro, 1e-5),
        |micro| Meeting::new(n, "bf16", micro, 1e-2),
    );
    vec![
        f(1),
        h(1),
        f(2),
        h(2),
        f(1).zero(one),
        // bf16: the ranks keep bf16 weights, the owners f32 masters.
        h(1).zero(one),
        h(2).zero(one),
        h(1).reduce(bf16),
        h(2).zero(one).reduce(bf16),
        // Stage 2: each gradient reduced into its owners' pieces.
        f(1).zero(two),
        f(2).zero(two),
        h(1).zero(two),
        h(2).zero(two).reduce(bf16),
        // Stage 3: the weights in pieces, gathered before each pass.
        f(1).zero(three),
        f(2).zero(three),
        h(1).zero(three),
        h(2).zero(three).reduce(bf16),
    ]
}

/// `n` ranks in groups of `group` (hybrid sharding) at each stage.
fn hybrid_meetings(n: usize, group: usize) -> Vec<Meeting> {
    let mut out = Vec::new();
    for stage in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let z = Some(stage);
        let f = Meeting::new(n, "fp32", 1, 1e-5).zero(z);
        let h = Meeting::new(n, "bf16", 2, 1e-2)
            .zero(z)
            .reduce(Some(DType::BF16));
        out.push(Meeting { group, ..f });
        out.push(Meeting { group, ..h });
    }
    out
}

/// The same checks with two ranks sharing GPU 0 and meeting through host
/// memory: every ZeRO stage, fp32 and bf16, micro-batches, bf16 reduces;
/// and four in two groups of two (hybrid sharding: the reduces to the
/// owners within a group, the owners' means across the groups, the
/// gathers and broadcasts within). Needs one GPU (no NCCL).
#[test]
fn loopback_ranks_on_one_gpu_train_as_one_gpu_with_n_times_b() {
    if !device::driver_present() || device::count() < 1 {
        assert!(
            std::env::var_os("FUSEC_REQUIRE_GPU").is_none(),
            "FUSEC_REQUIRE_GPU is set: no GPU"
        );
        common::skip("no GPU on this machine");
        return;
    }
    let loopback = |m: Meeting| Meeting {
        loopback: true,
        ..m
    };
    let bf16 = Some(DType::BF16);
    let (f, h) = (
        |micro| Meeting::new(2, "fp32", micro, 1e-5),
        |micro| Meeting::new(2, "bf16", micro, 1e-2),
    );
    let mut ms = vec![f(1), h(2).reduce(bf16)];
    for stage in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let z = Some(stage);
        ms.extend([
            f(1).zero(z),
            f(2).zero(z),
            h(1).zero(z),
            h(2).zero(z).reduce(bf16),
        ]);
    }
    for m in ms {
        check_meeting(loopback(m));
    }
    for m in hybrid_meetings(4, 2) {
        check_meeting(loopback(m));
    }
}

#[test]
fn a_step_built_for_two_ranks_refuses_to_run_alone() {
    if !device::driver_present() {
        common::skip("no CUDA driver on this machine");
        return;
    }
    let Ok(gpu) = device::open(0) else {
        common::skip("no GPU");
        return;
    };
    let many = compiled(2, "fp32", 1);
    let (_, dims) = sizes(&[("B", 2), ("T", 64)]);
    let s = Gpu::open(
        gpu,
        &many.optimized,
        &LowerOptions::default(),
        &dims,
        None,
        &|_, _| {},
        GpuOptions::default(),
    )
    .unwrap();
    let mut b = s;
    init_params(&mut b, 1).unwrap();
    let e = b.step(1e-3, 1).unwrap_err().to_string();
    assert!(e.contains("has no communicator"), "{e}");
    let _: BTreeMap<String, i64> = dims;
}
