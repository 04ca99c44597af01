//! `fusec bench-attention`: the attention kernels alone, timed the way
//! `torch_reference.py --attn-sweep` times PyTorch's: B = 16384 / T
//! sequences of H = 2048 / D heads, forward and forward + backward, the
//! forward counted as 4·B·H·T²·D FLOPs (halved when causal) and forward +
//! backward as 3.5 times that.

use crate::device::Gpu;
use crate::exec::encode;
use crate::tensor_map::{encode_all, EncodedMap};
use crate::RuntimeError;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use fusec_compiler::emit::cuda::emit_program;
use fusec_compiler::emit::flash::{flash_backward, flash_forward};
use fusec_compiler::emit::templates::{grid, shape_of, BLOCK};
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::{Body, Kernel, Program};
use fusec_compiler::ops::Op;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
pub struct AttnResult {
    pub head_dim: usize,
    pub seq: usize,
    pub batch: usize,
    pub heads: usize,
    pub causal: bool,
    /// Which forward kernel ran: "flash" (mma.sync tensor cores),
    /// "flash-wgmma" (Hopper's) or "simple".
    pub forward: &'static str,
    /// Which backward kernels ran.
    pub backward: &'static str,
    pub fwd_ms: f64,
    pub fwd_bwd_ms: f64,
    pub fwd_tflops: f64,
    pub fwd_bwd_tflops: f64,
    /// Each backward kernel alone: (name's last part, median ms).
    pub bwd_parts: Vec<(String, f64)>,
    /// Device memory the attention's buffers take (q, k, v, o, lse, dO,
    /// dq, dk, dv): linear in T.
    pub buffer_bytes: u64,
}

impl AttnResult {
    pub fn json(&self) -> String {
        format!(
            "{{\"bench\":\"attention\",\"impl\":\"fusec-{}-fwd-{}-bwd\",\"head_dim\":{},\"seq\":{},\"batch\":{},\"heads\":{},\"causal\":{},\"fwd_ms\":{:.3},\"fwd_tflops\":{:.1},\"fwd_bwd_ms\":{:.3},\"fwd_bwd_tflops\":{:.1},\"bwd_ms\":{{{}}},\"buffer_mib\":{:.1}}}",
            self.forward,
            self.backward,
            self.head_dim,
            self.seq,
            self.batch,
            self.heads,
            self.causal,
            self.fwd_ms,
            self.fwd_tflops,
            self.fwd_bwd_ms,
            self.fwd_bwd_tflops,
            self.bwd_parts
                .iter()
                .map(|(n, ms)| format!("\"{n}\":{ms:.3}"))
                .collect::<Vec<_>>()
                .join(","),
            self.buffer_bytes as f64 / (1u64 << 20) as f64
        )
    }
}

fn err(m: impl Into<String>) -> RuntimeError {
    RuntimeError::Unsupported(m.into())
}

/// The model: one attention over bf16 activations q, k, v [B, T, H, D]. q, k and v are sums of parameters
/// (not the parameters themselves) so that the attention's gradients are
/// bf16 activations as in a model, not fused with the casts into the f32
/// parameter gradients (which the tensor-core backward does not write).
fn model(b: usize, t: usize, h: usize, d: usize, causal: bool) -> String {
    format!(
        "const B = {b}\nconst T = {t}\nparam q: [B, T, {h}, {d}] = normal(1.0)\nparam k: [B, T, {h}, {d}] = normal(1.0)\n\
         param v: [B, T, {h}, {d}] = normal(1.0)\nlet y = attention(q + q, k + k, v + v, causal = {causal})\n\
         train {{\n loss = mean(y * y)\n precision = bf16\n}}\n"
    )
}

struct Launch {
    name: String,
    func: CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    args: Vec<u64>,
    /// Passed after the arguments (the backward's scratch).
    extra: Option<u64>,
    /// Dynamic shared memory, bytes.
    smem: u32,
    /// Tensor maps passed last.
    maps: Vec<EncodedMap>,
}

fn load(gpu: &Gpu, name: &str, src: &str) -> Result<CudaFunction, RuntimeError> {
    let cubin = crate::nvrtc::compile(name, src, &gpu.arch())
        .map_err(|e| RuntimeError::Compile(e.to_string()))?;
    let m = gpu
        .ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.image))
        .map_err(|e| RuntimeError::driver("loading an attention kernel", e))?;
    m.load_function(name)
        .map_err(|e| RuntimeError::driver("finding an attention kernel", e))
}

fn find<'a>(g: &fusec_compiler::ir::Graph, p: &'a Program, grad: bool) -> Option<&'a Kernel> {
    p.kernels.iter().find(|k| {
        matches!(k.body, Body::Op(n) if matches!(
            (&g.g[n].op, grad),
            (Op::Attention(_), false) | (Op::AttentionGrad(_), true)
        ))
    })
}

/// Times one configuration (`batch` sequences, by default 16384 / T);
/// `flash` asks for the tensor-core kernels where they apply, and
/// `deterministic` for their backward without atomics.
pub fn run(
    gpu: &Gpu,
    d: usize,
    t: usize,
    batch: Option<usize>,
    causal: bool,
    flash: bool,
    deterministic: bool,
) -> Result<AttnResult, RuntimeError> {
    let (b, h) = (batch.unwrap_or((16384 / t).max(1)), (2048 / d).max(1));
    let src = model(b, t, h, d, causal);
    let c = compile(&src, "attention", &Options::default())
        .map_err(|f| err(f.render("attention.dsl", &src)))?;
    let g = &c.optimized;
    let p = fuse(g);
    let sources = emit_program(g, &p, None);
    let fwd = find(g, &p, false).ok_or_else(|| err("no attention kernel"))?;
    let bwd = find(g, &p, true).ok_or_else(|| err("no attention_grad kernel"))?;
    let (&Body::Op(nf), &Body::Op(nb)) = (&fwd.body, &bwd.body) else {
        unreachable!()
    };
    // Buffers: the forward's inputs and outputs, then the backward's dO and outputs.
    let numel = |buf: usize| -> usize {
        p.buffers[buf]
            .ty
            .shape
            .iter()
            .map(|d| d.as_const().unwrap_or(0) as usize)
            .product()
    };
    let before = gpu.free_bytes()?;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut device: Vec<(usize, CudaSlice<u8>)> = Vec::new();
    let mut ptr_of =
        |buf: usize, device: &mut Vec<(usize, CudaSlice<u8>)>| -> Result<u64, RuntimeError> {
            if let Some((_, s)) = device.iter().find(|(b2, _)| *b2 == buf) {
                return Ok(s.device_ptr(&gpu.stream).0);
            }
            let dt = p.buffers[buf].ty.dtype;
            let vals: Vec<f64> = (0..numel(buf))
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let s = gpu
                .stream
                .clone_htod(&encode(dt, &vals))
                .map_err(|e| RuntimeError::driver("allocating attention buffers", e))?;
            let ptr = s.device_ptr(&gpu.stream).0;
            device.push((buf, s));
            Ok(ptr)
        };
    let mut forward = "simple";
    let arch = gpu.flash_arch()?.filter(|_| flash);
    let fwd_launch = {
        let args: Vec<u64> = fwd
            .inputs
            .iter()
            .chain(&fwd.outputs)
            .map(|&b2| ptr_of(b2, &mut device))
            .collect::<Result<_, _>>()?;
        match arch.and_then(|a| flash_forward(g, &p, fwd, nf, None, a)) {
            Some(f) => {
                let launch = f.launch;
                forward = if launch.arch_specific {
                    "flash-wgmma"
                } else {
                    "flash"
                };
                let func = load(gpu, &fwd.name, &launch.source)?;
                let smem = launch.dynamic_smem_bytes as u32;
                crate::exec::allow_dynamic_smem(&func, &fwd.name, smem, gpu, "--simple")?;
                let [x, y, z] = launch.grid(&|_| None).ok_or_else(|| err("no flash grid"))?;
                let maps =
                    encode_all(&launch.tensor_maps, &args, &|_| None, &fwd.name, "--simple")?;
                Launch {
                    name: fwd.name.clone(),
                    func,
                    grid: (x as u32, y as u32, z as u32),
                    block: launch.block,
                    args,
                    extra: None,
                    smem,
                    maps,
                }
            }
            None => {
                let text = &sources
                    .iter()
                    .find(|(n2, _)| *n2 == fwd.name)
                    .ok_or_else(|| err("no source"))?
                    .1;
                let blocks = shape_of(g, nf)
                    .and_then(|s| grid(&s, &|_| None))
                    .unwrap_or(1);
                Launch {
                    name: fwd.name.clone(),
                    func: load(gpu, &fwd.name, text)?,
                    grid: (blocks as u32, 1, 1),
                    block: BLOCK as u32,
                    args,
                    extra: None,
                    smem: 0,
                    maps: Vec::new(),
                }
            }
        }
    };
    let mut backward = "simple";
    let mut scratch: Option<CudaSlice<u8>> = None;
    let bwd_launches: Vec<Launch> = {
        let args: Vec<u64> = bwd
            .inputs
            .iter()
            .chain(&bwd.outputs)
            .map(|&b2| ptr_of(b2, &mut device))
            .collect::<Result<_, _>>()?;
        match arch.and_then(|a| flash_backward(g, &p, bwd, nb, None, deterministic, a)) {
            Some(ls) => {
                let ls: Vec<_> = ls.into_iter().map(|f| f.launch).collect();
                backward = match (deterministic, ls.iter().any(|l| l.arch_specific)) {
                    (true, _) => "flash-deterministic",
                    (false, true) => "flash-wgmma",
                    _ => "flash",
                };
                let elems = ls[0]
                    .scratch_f32
                    .as_ref()
                    .and_then(|e| e.eval(&|_| None))
                    .unwrap_or(0)
                    .max(1) as usize;
                let s = gpu
                    .stream
                    .alloc_zeros::<u8>(4 * elems)
                    .map_err(|e| RuntimeError::driver("allocating attention scratch", e))?;
                let sp = s.device_ptr(&gpu.stream).0;
                scratch = Some(s);
                let mut out = Vec::new();
                for l in ls {
                    let [x, y, z] = l.grid(&|_| None).ok_or_else(|| err("no flash grid"))?;
                    let func = load(gpu, &l.name, &l.source)?;
                    let smem = l.dynamic_smem_bytes as u32;
                    crate::exec::allow_dynamic_smem(&func, &l.name, smem, gpu, "--simple")?;
                    let maps = encode_all(&l.tensor_maps, &args, &|_| None, &l.name, "--simple")?;
                    out.push(Launch {
                        name: l.name.clone(),
                        func,
                        grid: (x as u32, y as u32, z as u32),
                        block: l.block,
                        args: args.clone(),
                        extra: Some(sp),
                        smem,
                        maps,
                    });
                }
                out
            }
            None => {
                let text = &sources
                    .iter()
                    .find(|(n2, _)| *n2 == bwd.name)
                    .ok_or_else(|| err("no source"))?
                    .1;
                let blocks = shape_of(g, nb)
                    .and_then(|s| grid(&s, &|_| None))
                    .unwrap_or(1);
                vec![Launch {
                    name: bwd.name.clone(),
                    func: load(gpu, &bwd.name, text)?,
                    grid: (blocks as u32, 1, 1),
                    block: BLOCK as u32,
                    args,
                    extra: None,
                    smem: 0,
                    maps: Vec::new(),
                }]
            }
        }
    };
    let buffer_bytes = before.saturating_sub(gpu.free_bytes()?);
    let launch = |l: &Launch| -> Result<(), RuntimeError> {
        let mut a = gpu.stream.launch_builder(&l.func);
        for x in &l.args {
            a.arg(x);
        }
        if let Some(x) = &l.extra {
            a.arg(x);
        }
        for m in &l.maps {
            a.arg(m);
        }
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: (l.block, 1, 1),
            shared_mem_bytes: l.smem,
        };
        // SAFETY: arguments as the kernel's signature lists them (no
        // symbolic sizes: the model's sizes are constants; the tensor maps
        // point into the buffers, which outlive every launch).
        unsafe { a.launch(cfg) }.map_err(|e| RuntimeError::driver("launching attention", e))?;
        Ok(())
    };
    // The median of 10 timed runs (after 3 warm-up runs) of `ls` in order.
    let median_ms = |ls: &[&Launch]| -> Result<f64, RuntimeError> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let mut times = Vec::new();
        for rep in 0..13 {
            let e0 = gpu
                .stream
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(|e| RuntimeError::driver("timing", e))?;
            for l in ls {
                launch(l)?;
            }
            let e1 = gpu
                .stream
                .record_event(Some(CU_EVENT_DEFAULT))
                .map_err(|e| RuntimeError::driver("timing", e))?;
            let ms = e0
                .elapsed_ms(&e1)
                .map_err(|e| RuntimeError::driver("timing", e))? as f64;
            if rep >= 3 {
                times.push(ms);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    };
    let fwd_ms = median_ms(&[&fwd_launch])?;
    let all: Vec<&Launch> = std::iter::once(&fwd_launch).chain(&bwd_launches).collect();
    let fwd_bwd_ms = median_ms(&all)?;
    // Each backward kernel after the forward and the kernels before it (so
    // it reads what they wrote), timed alone.
    let mut bwd_parts = Vec::new();
    for (i, l) in bwd_launches.iter().enumerate() {
        median_ms(&all[..i + 2])?;
        let ms = median_ms(&[l])?;
        let part = l.name.rsplit('_').next().unwrap_or("backward").to_string();
        bwd_parts.push((part, ms));
    }
    let full = 4.0 * (b * h) as f64 * (t * t) as f64 * d as f64;
    let fl = if causal { full / 2.0 } else { full };
    drop(device);
    drop(scratch);
    Ok(AttnResult {
        head_dim: d,
        seq: t,
        batch: b,
        heads: h,
        causal,
        forward,
        backward,
        fwd_ms,
        fwd_bwd_ms,
        fwd_tflops: fl / fwd_ms / 1e9,
        fwd_bwd_tflops: 3.5 * fl / fwd_bwd_ms / 1e9,
        bwd_parts,
        buffer_bytes,
    })
}
