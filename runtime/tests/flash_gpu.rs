//! The tensor-core attention kernels (`kernels/attention/`, instantiated by
//! `emit/flash/`) launched alone on a real GPU against the kernel-IR interpreter:
//! the forward's O and log-sum-exp, the backward's dq, dk, dv, for head
//! dims 40 to 256, lengths that are not tile multiples, causal and not,
//! grouped query heads, q/k/v read from a fused projection; the forward is
//! also timed at T = 1023. Skipped, with the reason, where there is no GPU
//! (FUSEC_REQUIRE_GPU makes that a failure).

mod common;

use common::{attention_model, gpu};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr};
use fusec_compiler::driver::{compile, Compiled};
use fusec_compiler::elaborate::Options;
use fusec_compiler::emit::flash::{flash_backward, flash_forward, FlashArch};
use fusec_compiler::emit::launch::KernelLaunch;
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::Precision;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::kernel::{Body, Kernel, Program};
use fusec_compiler::ops::Op;
use fusec_runtime::device::Gpu;
use fusec_runtime::exec::{decode, encode, KernelCall};
use fusec_runtime::tensor_map::encode_all;
use petgraph::stable_graph::NodeIndex;
use std::collections::HashMap;

/// One configuration compiled, its attention (or attention_grad) kernel,
/// and the interpreter's buffers at B = 1, T = `t`.
struct Case {
    c: Compiled,
    p: Program,
    kernel: usize,
    node: NodeIndex,
    dims: HashMap<String, i64>,
    reference: Vec<Tensor>,
    at: String,
}

impl Case {
    fn new(cfg: (usize, usize, usize, bool, i64), grad: bool, seed: u64) -> Case {
        let (d, heads, ratio, causal, t) = cfg;
        let src = attention_model(d, heads, ratio, causal, "bf16");
        let c = compile(&src, "flash", &Options::default())
            .unwrap_or_else(|f| panic!("{}", f.render("flash.dsl", &src)));
        let g = &c.optimized;
        let p = fuse(g);
        let kernel = p
            .kernels
            .iter()
            .position(|k| {
                matches!(k.body, Body::Op(n) if matches!(
                    (&g.g[n].op, grad),
                    (Op::Attention(_), false) | (Op::AttentionGrad(_), true)
                ))
            })
            .expect("an attention kernel");
        let Body::Op(node) = p.kernels[kernel].body else {
            unreachable!()
        };
        let dims = HashMap::from([("B".to_string(), 1), ("T".to_string(), t)]);
        let feeds = random_feeds(g, &dims, seed).unwrap();
        let reference = run_program(g, &p, &feeds, Precision::AsStored).unwrap();
        Case {
            c,
            p,
            kernel,
            node,
            dims,
            reference,
            at: format!("D={d} heads={heads} ratio={ratio} causal={causal} T={t}"),
        }
    }

    fn k(&self) -> &Kernel {
        &self.p.kernels[self.kernel]
    }

    fn env(&self) -> impl Fn(&str) -> Option<i64> + '_ {
        |s| self.dims.get(s).copied()
    }

    /// The kernel's inputs as the interpreter has them, its outputs NaN.
    fn upload(&self, gpu: &Gpu) -> Vec<CudaSlice<u8>> {
        let k = self.k();
        let mut bufs = Vec::new();
        for &b in &k.inputs {
            let bytes = encode(self.p.buffers[b].ty.dtype, &self.reference[b].data);
            bufs.push(gpu.stream.clone_htod(&bytes).unwrap());
        }
        for &b in &k.outputs {
            let n = self.reference[b].data.len() * self.p.buffers[b].ty.dtype.size_bytes();
            bufs.push(gpu.stream.clone_htod(&vec![0xffu8; n]).unwrap());
        }
        bufs
    }

    /// Output `slot`'s largest error, and its largest reference value.
    fn error(&self, gpu: &Gpu, bufs: &[CudaSlice<u8>], slot: usize) -> (f64, f64) {
        let k = self.k();
        let b = k.outputs[slot];
        let got = decode(
            self.p.buffers[b].ty.dtype,
            &gpu.stream.clone_dtoh(&bufs[k.inputs.len() + slot]).unwrap(),
        );
        let want = &self.reference[b].data;
        let scale = want
            .iter()
            .filter(|x| x.is_finite())
            .fold(0.0f64, |m, x| m.max(x.abs()))
            .max(1e-6);
        let worst = got
            .iter()
            .zip(want)
            .map(|(a, b)| match (a == b, a.is_finite() && b.is_finite()) {
                (true, _) => 0.0,
                (false, true) => (a - b).abs(),
                (false, false) => f64::INFINITY,
            })
            .fold(0.0, f64::max);
        (worst, scale)
    }
}

fn load(gpu: &Gpu, name: &str, source: &str) -> (CudaFunction, Option<u32>) {
    let cubin =
        fusec_runtime::nvrtc::compile(name, source, &gpu.arch()).expect("NVRTC compiles it");
    let module = gpu
        .ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.image))
        .unwrap();
    (module.load_function(name).unwrap(), cubin.registers)
}

/// The runtime's one kernel launch (`exec::KernelCall`) for `l` on these
/// buffers: its arguments, then the sizes at launch, `extra` (the
/// backward's scratch) where given, then the tensor maps.
fn call(
    func: CudaFunction,
    l: &KernelLaunch,
    ptrs: &[u64],
    extra: Option<u64>,
    env: &dyn Fn(&str) -> Option<i64>,
) -> KernelCall {
    let grid = l.grid(env).expect("a grid");
    KernelCall {
        func,
        name: l.name.clone(),
        grid: (grid[0] as u32, grid[1] as u32, grid[2] as u32),
        block: l.block,
        args: ptrs.to_vec(),
        extra,
        smem: l.dynamic_smem_bytes as u32,
        maps: encode_all(&l.tensor_maps, ptrs, env, &l.name, "-").unwrap(),
    }
}

#[test]
fn flash_forward_matches_the_interpreter_and_is_timed() {
    let Some(gpu) = gpu() else { return };
    let mut failures = Vec::new();
    let mut cases = Vec::new();
    for d in [64usize, 80, 128, 256] {
        for (heads, ratio) in [(2usize, 1usize), (4, 4)] {
            for causal in [true, false] {
                for t in [1i64, 17, 1000, 1023] {
                    cases.push((d, heads, ratio, causal, t));
                }
            }
        }
    }
    // Every kernel family this GPU runs: mma.sync, and on Hopper wgmma too.
    let mut archs = vec![FlashArch::Sm80];
    if FlashArch::for_capability(gpu.capability) == Some(FlashArch::Sm90a) {
        archs.push(FlashArch::Sm90a);
    }
    for (cfg, arch) in cases
        .into_iter()
        .flat_map(|c| archs.iter().map(move |&a| (c, a)))
    {
        let case = Case::new(cfg, false, 5);
        let g = &case.c.optimized;
        let fl = flash_forward(
            g,
            &case.p,
            case.k(),
            case.node,
            None,
            arch,
            gpu.multiprocessors,
            false,
        )
        .expect("a supported attention")
        .launch;
        let (func, registers) = load(&gpu, &case.k().name, &fl.source);
        let smem = fl.dynamic_smem_bytes as u32;
        fusec_runtime::exec::allow_dynamic_smem(&func, &case.k().name, smem, &gpu, "-").unwrap();
        let mut bufs = case.upload(&gpu);
        let ptrs: Vec<u64> = bufs.iter().map(|s| s.device_ptr(&gpu.stream).0).collect();
        let sizes: Vec<i64> = g.dims.iter().map(|d| case.dims[d]).collect();
        let kc = call(func, &fl, &ptrs, None, &case.env());
        let run = || kc.launch(&gpu, &sizes).unwrap();
        // The second launch is checked, its outputs NaN before it: the
        // persistent Hopper forward's work counter must be back at zero
        // after the first.
        run();
        for out in &mut bufs[case.k().inputs.len()..] {
            let nan = vec![0xffu8; out.len()];
            gpu.stream.memcpy_htod(&nan, out).unwrap();
        }
        run();
        gpu.stream.synchronize().unwrap();
        for slot in 0..2 {
            let (worst, scale) = case.error(&gpu, &bufs, slot);
            // O (bf16) within 2e-2 of its largest value; LSE within 1e-2.
            let tol = if slot == 0 { 2e-2 * scale } else { 1e-2 };
            if worst > tol {
                failures.push(format!(
                    "{} {arch:?}: out{slot} error {worst:.3e} (tolerance {tol:.1e})",
                    case.at
                ));
            }
        }
        let (d, heads, ratio, causal, t) = cfg;
        if t == 1023 && causal && ratio == 1 {
            use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
            let e0 = gpu.stream.record_event(Some(CU_EVENT_DEFAULT)).unwrap();
            for _ in 0..20 {
                run();
            }
            let e1 = gpu.stream.record_event(Some(CU_EVENT_DEFAULT)).unwrap();
            let ms = e0.elapsed_ms(&e1).unwrap() as f64 / 20.0;
            let flops = 4.0 * (t * t) as f64 / 2.0 * d as f64 * heads as f64;
            println!(
                "{} {arch:?}: {ms:.4} ms, {:.1} TFLOP/s (registers {registers:?})",
                case.at,
                flops / ms / 1e9
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The tensor-core backward (three kernels and a scratch), in both
/// schemes (dQ by atomics, and deterministic), against the interpreter's
/// dq, dk, dv.
#[test]
fn flash_backward_matches_the_interpreter() {
    let Some(gpu) = gpu() else { return };
    let mut failures = Vec::new();
    let hopper = FlashArch::for_capability(gpu.capability) == Some(FlashArch::Sm90a);
    let mut cases = vec![
        (
            (64usize, 2usize, 1usize, true, 1000i64),
            false,
            FlashArch::Sm80,
        ),
        ((64, 4, 4, false, 17), false, FlashArch::Sm80),
        ((128, 2, 1, false, 1023), false, FlashArch::Sm80),
        ((128, 4, 4, true, 100), false, FlashArch::Sm80),
        ((64, 2, 1, true, 1000), true, FlashArch::Sm80),
        ((128, 4, 4, true, 100), true, FlashArch::Sm80),
        ((96, 4, 4, true, 1000), false, FlashArch::Sm80),
        ((256, 2, 1, true, 1000), false, FlashArch::Sm80),
        ((256, 2, 1, false, 300), true, FlashArch::Sm80),
    ];
    if hopper {
        for cfg in [
            (64usize, 2usize, 1usize, true, 1000i64),
            (64, 4, 4, false, 17),
            (64, 2, 1, false, 1),
            (128, 2, 1, false, 1023),
            (128, 4, 4, true, 100),
            (128, 2, 1, true, 1000),
            (80, 8, 8, true, 1000),
            (96, 2, 1, false, 1023),
            (40, 4, 4, true, 300),
            (256, 2, 1, true, 1000),
            (192, 4, 4, false, 300),
            (160, 2, 2, true, 17),
        ] {
            cases.push((cfg, false, FlashArch::Sm90a));
        }
    }
    for (cfg, deterministic, arch) in cases {
        let case = Case::new(cfg, true, 6);
        let g = &case.c.optimized;
        let launches: Vec<_> = flash_backward(
            g,
            &case.p,
            case.k(),
            case.node,
            None,
            deterministic,
            arch,
            false,
        )
        .expect("a supported backward")
        .into_iter()
        .map(|f| f.launch)
        .collect();
        let env = case.env();
        let bufs = case.upload(&gpu);
        let elems = launches[0]
            .scratch_f32
            .as_ref()
            .unwrap()
            .eval(&env)
            .unwrap()
            .max(1) as usize;
        let scratch = gpu.stream.clone_htod(&vec![0xffu8; 4 * elems]).unwrap();
        let ptrs: Vec<u64> = bufs.iter().map(|s| s.device_ptr(&gpu.stream).0).collect();
        let sizes: Vec<i64> = g.dims.iter().map(|d| case.dims[d]).collect();
        let sp = scratch.device_ptr(&gpu.stream).0;
        for l in &launches {
            let (func, _) = load(&gpu, &l.name, &l.source);
            let smem = l.dynamic_smem_bytes as u32;
            fusec_runtime::exec::allow_dynamic_smem(&func, &l.name, smem, &gpu, "").unwrap();
            call(func, l, &ptrs, Some(sp), &env)
                .launch(&gpu, &sizes)
                .unwrap();
        }
        gpu.stream.synchronize().unwrap();
        let errors: Vec<(f64, f64)> = (0..3).map(|slot| case.error(&gpu, &bufs, slot)).collect();
        // With one visible key per query (T = 1), dQ and dK are exactly zero
        // (P = 1, dP = delta): their errors are then measured against the
        // largest output, as the host tests do.
        let largest = errors.iter().fold(0.0f64, |m, e| m.max(e.1));
        for (slot, &(worst, scale)) in errors.iter().enumerate() {
            let scale = if scale > 1e-6 { scale } else { largest };
            if worst > 3e-2 * scale {
                failures.push(format!(
                    "{} (deterministic: {deterministic}, {arch:?}): out{slot} error {:.3e} of max",
                    case.at,
                    worst / scale
                ));
            }
        }
        println!(
            "{} (deterministic: {deterministic}, {arch:?}): checked",
            case.at
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
