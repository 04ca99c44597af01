//! `fusec bench-attention`: the attention kernels alone, timed the way
//! `torch_reference.py --attn-sweep` times PyTorch's: B = 16384 / T
//! sequences of H = 2048 / D heads (and S keys, and H / group key/value
//! heads), forward and forward + backward, the forward counted as 4·D FLOPs
//! per visible (query, key) pair and head (4·B·H·T²·D / 2 causal at S = T)
//! and forward + backward as 3.5 times that.

use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use fusec_compiler::ir::types::DType;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::{Body, Program};
use fusec_compiler::ops::Op;
use fusec_compiler::plan::plan_with;
use fusec_compiler::select::{select, Target};
use fusec_runtime::alone::{load_function, median_ms, DeviceBuffer};
use fusec_runtime::device::Gpu;
use fusec_runtime::exec::{encode, KernelCall};
use fusec_runtime::RuntimeError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
pub struct AttnResult {
    pub head_dim: usize,
    pub seq: usize,
    /// Keys per sequence (S; T for self-attention).
    pub kv_seq: usize,
    pub batch: usize,
    pub heads: usize,
    /// Query heads per key/value head.
    pub group: usize,
    pub causal: bool,
    pub dtype: DType,
    /// Which forward kernel ran: "flash" (mma.sync tensor cores),
    /// "flash-wgmma" (Hopper's), "flash-tf32" (f32 on TF32 tensor cores) or
    /// "simple".
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
            "{{\"bench\":\"attention\",\"impl\":\"fusec-{}-fwd-{}-bwd\",\"dtype\":\"{}\",\"head_dim\":{},\"seq\":{},\"kv_seq\":{},\"batch\":{},\"heads\":{},\"group\":{},\"causal\":{},\"fwd_ms\":{:.3},\"fwd_tflops\":{:.1},\"fwd_bwd_ms\":{:.3},\"fwd_bwd_tflops\":{:.1},\"bwd_ms\":{{{}}},\"buffer_mib\":{:.1}}}",
            self.forward,
            self.backward,
            self.dtype.name(),
            self.head_dim,
            self.seq,
            self.kv_seq,
            self.batch,
            self.heads,
            self.group,
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

/// The model: one attention over activations q [B, T, H, D] and k, v
/// [B, S, H / group, D] in `dtype` (bf16 or f32). q, k and v are sums of
/// parameters (not the parameters themselves) so that the attention's
/// gradients are activations as in a model, not fused with the casts into
/// the f32 parameter gradients (which the tensor-core backward does not
/// write).
fn model(c: &Config) -> String {
    let (b, t, s, h, d) = (c.batch, c.seq, c.kv_seq, c.heads, c.head_dim);
    let kv = h / c.group;
    format!(
        "const B = {b}\nconst T = {t}\nconst S = {s}\nparam q: [B, T, {h}, {d}] = normal(1.0)\nparam k: [B, S, {kv}, {d}] = normal(1.0)\n\
         param v: [B, S, {kv}, {d}] = normal(1.0)\nlet y = attention(q + q, k + k, v + v, causal = {})\n\
         train {{\n loss = mean(y * y)\n precision = {}\n}}\n",
        c.causal,
        c.dtype.name()
    )
}

/// One configuration of the benchmark.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub head_dim: usize,
    pub seq: usize,
    pub kv_seq: usize,
    pub batch: usize,
    pub heads: usize,
    pub group: usize,
    pub causal: bool,
    /// What q, k, v and the gradients are: bf16, or f32 (the TF32 kernels).
    pub dtype: DType,
}

impl Config {
    /// The sweep's sizes, as `torch_reference.py --attn-sweep` takes them:
    /// B = 16384 / T sequences (or `batch`), H = 2048 / D heads rounded down
    /// to a multiple of `group`, S = `kv_seq` or T.
    pub fn sweep(
        d: usize,
        t: usize,
        kv_seq: Option<usize>,
        batch: Option<usize>,
        group: usize,
        causal: bool,
        dtype: DType,
    ) -> Config {
        let group = group.max(1);
        let heads = ((2048 / d.max(1)) / group * group).max(group);
        Config {
            head_dim: d,
            seq: t,
            kv_seq: kv_seq.unwrap_or(t),
            batch: batch.unwrap_or((16384 / t.max(1)).max(1)),
            heads,
            group,
            causal,
            dtype,
        }
    }

    /// FLOPs of the forward: 4 D per visible (query, key) pair and head.
    pub fn forward_flops(&self) -> f64 {
        let (t, s) = (self.seq as f64, self.kv_seq as f64);
        let pairs = if self.causal {
            // Query i sees keys 0 ..= i (those that exist).
            let full = (self.seq.min(self.kv_seq)) as f64;
            full * (full + 1.0) / 2.0 + (t - full).max(0.0) * s
        } else {
            t * s
        };
        4.0 * (self.batch * self.heads) as f64 * pairs * self.head_dim as f64
    }
}

fn find(g: &fusec_compiler::ir::Graph, p: &Program, grad: bool) -> Option<usize> {
    p.kernels.iter().position(|k| {
        matches!(k.body, Body::Op(n) if matches!(
            (&g.g[n].op, grad),
            (Op::Attention(_), false) | (Op::AttentionGrad(_), true)
        ))
    })
}

/// Times one configuration (`batch` sequences, by default 16384 / T);
/// `flash` asks for the tensor-core kernels where they apply,
/// `deterministic` for their backward without atomics, and `tf32` for f32
/// in one TF32 product. The kernels are the
/// ones a training step of the model would run: chosen by the selection
/// stage, launched as the plan says.
pub fn run(
    gpu: &Gpu,
    cfg: Config,
    flash: bool,
    deterministic: bool,
    tf32: bool,
) -> Result<AttnResult, RuntimeError> {
    let src = model(&cfg);
    let c = compile(&src, "attention", &Options::default())
        .map_err(|f| err(f.render("attention.dsl", &src)))?;
    let g = &c.optimized;
    let p = fuse(g);
    let target = Target {
        arch: if flash { gpu.flash_arch()? } else { None },
        deterministic,
        multiprocessors: gpu.multiprocessors,
        f32_math: match tf32 {
            true => fusec_compiler::select::F32Math::Tf32,
            false => fusec_compiler::select::F32Math::ThreeTf32,
        },
        lower: c.options.lower.clone(),
    };
    let selection = select(g, &p, &target, None);
    let plan =
        plan_with(g, &p, Some(&selection), &BTreeMap::new()).map_err(|e| err(e.to_string()))?;
    let fwd = find(g, &p, false).ok_or_else(|| err("no attention kernel"))?;
    let bwd = find(g, &p, true).ok_or_else(|| err("no attention_grad kernel"))?;
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
    // Device buffers of the two kernels alone (random values), by plan buffer.
    let mut device: Vec<(usize, DeviceBuffer)> = Vec::new();
    let mut ptr_of =
        |buf: usize, device: &mut Vec<(usize, DeviceBuffer)>| -> Result<u64, RuntimeError> {
            if let Some((_, s)) = device.iter().find(|(b2, _)| *b2 == buf) {
                return Ok(s.ptr(gpu));
            }
            let bytes = if buf < p.buffers.len() {
                let vals: Vec<f64> = (0..numel(buf))
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                encode(p.buffers[buf].ty.dtype, &vals)
            } else {
                vec![0u8; plan.buffers[buf].bytes.max(4) as usize]
            };
            let s = DeviceBuffer::upload(gpu, &bytes)?;
            let ptr = s.ptr(gpu);
            device.push((buf, s));
            Ok(ptr)
        };
    // The plan's launches of kernel `ki`, ready to run on these buffers.
    let mut calls = |ki: usize,
                     device: &mut Vec<(usize, DeviceBuffer)>|
     -> Result<Vec<KernelCall>, RuntimeError> {
        let k = &p.kernels[ki];
        let args: Vec<u64> = k
            .inputs
            .iter()
            .chain(&k.outputs)
            .map(|&b2| ptr_of(b2, device))
            .collect::<Result<_, _>>()?;
        let mut out = Vec::new();
        for st in &plan.launches[ki].steps {
            let text = &selection
                .sources
                .iter()
                .find(|(n2, _)| *n2 == st.function)
                .ok_or_else(|| err("no source"))?
                .1;
            let func = load_function(gpu, &st.function, text)?;
            let extra = match st.scratch {
                Some(s) => Some(ptr_of(s, device)?),
                None => None,
            };
            out.push(KernelCall::of_step(
                func,
                st,
                args.clone(),
                extra,
                gpu,
                "--simple",
            )?);
        }
        Ok(out)
    };
    let fwd_calls = calls(fwd, &mut device)?;
    let bwd_calls = calls(bwd, &mut device)?;
    let family = |ki: usize| match &plan.launches[ki].steps[..] {
        [] => "none",
        s if s.iter().any(|x| x.arch_specific) => "flash-wgmma",
        s if cfg.dtype == DType::F32 && s.iter().any(|x| x.template.is_some()) => "flash-tf32",
        s if s.iter().any(|x| x.template.is_some()) && deterministic && ki == bwd => {
            "flash-deterministic"
        }
        s if s.iter().any(|x| x.template.is_some()) => "flash",
        _ => "simple",
    };
    let (forward, backward) = (family(fwd), family(bwd));
    let buffer_bytes = before.saturating_sub(gpu.free_bytes()?);
    // The median of 10 timed runs (after 3 warm-up runs) of `ls` in order.
    let median_ms = |ls: &[&KernelCall]| median_ms(gpu, ls, 3, 10);
    let fwd_only: Vec<&KernelCall> = fwd_calls.iter().collect();
    let fwd_ms = median_ms(&fwd_only)?;
    let all: Vec<&KernelCall> = fwd_calls.iter().chain(&bwd_calls).collect();
    let fwd_bwd_ms = median_ms(&all)?;
    // Each backward kernel after the forward and the kernels before it (so
    // it reads what they wrote), timed alone.
    let mut bwd_parts = Vec::new();
    for (i, l) in bwd_calls.iter().enumerate() {
        median_ms(&all[..fwd_calls.len() + i + 1])?;
        let ms = median_ms(&[l])?;
        let part = l.name.rsplit('_').next().unwrap_or("backward").to_string();
        bwd_parts.push((part, ms));
    }
    let fl = cfg.forward_flops();
    drop(device);
    Ok(AttnResult {
        head_dim: cfg.head_dim,
        seq: cfg.seq,
        kv_seq: cfg.kv_seq,
        batch: cfg.batch,
        heads: cfg.heads,
        group: cfg.group,
        causal: cfg.causal,
        dtype: cfg.dtype,
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
