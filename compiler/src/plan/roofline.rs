//! A roofline estimate of one step: each kernel takes the longer of its
//! memory traffic at the device's bandwidth and its arithmetic at the
//! device's peak rate (tensor cores for GEMMs, attention and convolutions in
//! 16-bit precision, the f32 units otherwise). Launch overheads are left out
//! (a CUDA graph hides most of them); a real step is slower, and the ratio
//! of the two says how far the kernels are from their bound.

use super::Plan;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::{Body, PExpr, Program};
use crate::ops::Op;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Device {
    pub name: &'static str,
    pub about: &'static str,
    pub bytes_per_s: f64,
    /// Dense bf16/fp16 tensor-core rate.
    pub tensor_flops: f64,
    /// Non-tensor f32 rate.
    pub f32_flops: f64,
    /// What the GPU's own name (as the driver reports it, lower case)
    /// contains: how a run finds its figures.
    pub gpu_name: &'static str,
}

/// Datasheet figures (dense, no sparsity).
pub const DEVICES: &[Device] = &[
    Device {
        name: "h100",
        about: "H100 SXM: 3.35 TB/s, 989 TFLOP/s bf16, 67 TFLOP/s f32",
        bytes_per_s: 3.35e12,
        tensor_flops: 989e12,
        f32_flops: 67e12,
        gpu_name: "h100",
    },
    Device {
        name: "h200",
        about: "H200 SXM: 4.8 TB/s, 989 TFLOP/s bf16, 67 TFLOP/s f32",
        bytes_per_s: 4.8e12,
        tensor_flops: 989e12,
        f32_flops: 67e12,
        gpu_name: "h200",
    },
    Device {
        name: "a100",
        about: "A100 SXM 80GB: 2.04 TB/s, 312 TFLOP/s bf16, 19.5 TFLOP/s f32",
        bytes_per_s: 2.039e12,
        tensor_flops: 312e12,
        f32_flops: 19.5e12,
        gpu_name: "a100",
    },
    // Consumer and workstation parts: their bf16 tensor rate is the one
    // with f32 accumulation (half the f16-accumulate figure on GeForce).
    Device {
        name: "rtx3090",
        about: "GeForce RTX 3090: 936 GB/s, 71 TFLOP/s bf16, 35.6 TFLOP/s f32",
        bytes_per_s: 936e9,
        tensor_flops: 71e12,
        f32_flops: 35.6e12,
        gpu_name: "rtx 3090",
    },
    Device {
        name: "rtx4090",
        about: "GeForce RTX 4090: 1.01 TB/s, 165 TFLOP/s bf16, 82.6 TFLOP/s f32",
        bytes_per_s: 1008e9,
        tensor_flops: 165.2e12,
        f32_flops: 82.6e12,
        gpu_name: "rtx 4090",
    },
    Device {
        name: "l40s",
        about: "L40S: 864 GB/s, 362 TFLOP/s bf16, 91.6 TFLOP/s f32",
        bytes_per_s: 864e9,
        tensor_flops: 362e12,
        f32_flops: 91.6e12,
        gpu_name: "l40s",
    },
];

pub fn device(name: &str) -> Option<Device> {
    DEVICES.iter().copied().find(|d| d.name == name)
}

/// The figures of a GPU by the name its driver reports ("NVIDIA GeForce
/// RTX 3090"), an H100's where none matches.
pub fn device_of_gpu(gpu: &str) -> Device {
    let n = gpu.to_ascii_lowercase();
    DEVICES
        .iter()
        .copied()
        .find(|d| n.contains(d.gpu_name))
        .unwrap_or(DEVICES[0])
}

#[derive(Clone, Debug)]
pub struct KernelCost {
    pub flops: f64,
    pub bytes: f64,
    pub seconds: f64,
    pub compute_bound: bool,
}

#[derive(Clone, Debug)]
pub struct Estimate {
    pub device: Device,
    pub kernels: Vec<KernelCost>,
    pub seconds: f64,
    pub flops: f64,
    pub bytes: f64,
}

fn eval(d: &Dim, env: &dyn Fn(&str) -> Option<i64>) -> f64 {
    d.eval(env).unwrap_or(0) as f64
}

fn prod(ds: &[Dim], env: &dyn Fn(&str) -> Option<i64>) -> f64 {
    ds.iter().map(|d| eval(d, env)).product()
}

/// Floating-point operations of one kernel, and whether tensor cores do them.
fn flops(g: &Graph, p: &Program, k: usize, env: &dyn Fn(&str) -> Option<i64>) -> (f64, bool) {
    let kernel = &p.kernels[k];
    match &kernel.body {
        Body::Pointwise(pw) => {
            let ops = pw
                .exprs
                .iter()
                .filter(|e| !matches!(e, PExpr::Load { .. } | PExpr::Const(_) | PExpr::Dim(_)))
                .count();
            (ops as f64 * eval(&pw.n, env), false)
        }
        // Optimizer updates: a handful of operations per element.
        Body::Group(members) => (
            members
                .iter()
                .map(|m| 12.0 * prod(&g.g[m.node].outputs[0].shape, env))
                .sum(),
            false,
        ),
        Body::Op(n) | Body::Gemm(n, _) => {
            let node = &g.g[*n];
            let ins = g.inputs(*n);
            let t = |i: usize| g.ty(ins[i]).clone();
            let half = |dt: DType| matches!(dt, DType::BF16 | DType::F16);
            let out = &node.outputs[0];
            match &node.op {
                Op::MatMul(_) => {
                    let a = t(0);
                    let kdim = eval(&a.shape[a.rank() - 1], env);
                    (2.0 * prod(&out.shape, env) * kdim, half(out.dtype))
                }
                Op::Attention(at) => {
                    let (q, kk) = (t(0), t(1));
                    let f = 4.0 * prod(&q.shape, env) * eval(&kk.shape[1], env);
                    (if at.causal { f / 2.0 } else { f }, half(q.dtype))
                }
                Op::AttentionGrad(at) => {
                    let (q, kk) = (t(0), t(1));
                    // Five products against two forward: 2.5 times the forward.
                    let f = 10.0 * prod(&q.shape, env) * eval(&kk.shape[1], env);
                    (if at.causal { f / 2.0 } else { f }, half(q.dtype))
                }
                Op::Conv2d(_) => {
                    let w = t(1);
                    (
                        2.0 * prod(&out.shape, env) * prod(&w.shape[..3], env),
                        half(out.dtype),
                    )
                }
                // As many products as the forward: dy [B,Ho,Wo,Co] against
                // the weight (input gradient) or the input (weight gradient).
                Op::Conv2dGradInput(_) => {
                    let (dy, w) = (t(0), t(1));
                    (
                        2.0 * prod(&dy.shape, env) * prod(&w.shape[..3], env),
                        half(out.dtype),
                    )
                }
                Op::Conv2dGradWeight(_) => {
                    let dy = t(1);
                    (
                        2.0 * prod(&dy.shape, env) * prod(&out.shape[..3], env),
                        half(out.dtype),
                    )
                }
                // Norms, softmax and the rest: a handful of operations per element.
                _ => (5.0 * prod(&out.shape, env), false),
            }
        }
    }
}

/// The bytes of buffers `bs`, each once: views of one buffer (q, k and v
/// sliced out of a fused projection) share its bytes. A buffer updated in
/// place is among a launch's inputs and its outputs: read and written.
pub fn distinct_bytes(plan: &Plan, bs: &[usize]) -> u64 {
    let set: std::collections::BTreeSet<usize> = bs.iter().copied().collect();
    set.iter().map(|&b| plan.buffers[b].bytes).sum()
}

pub fn estimate(g: &Graph, p: &Program, plan: &Plan, device: Device) -> Estimate {
    let env = |s: &str| plan.dims.get(s).copied();
    let mut kernels = Vec::with_capacity(p.kernels.len());
    for (k, l) in plan.launches.iter().enumerate() {
        let bytes = distinct_bytes(plan, &l.inputs) + distinct_bytes(plan, &l.outputs);
        let (f, tensor) = flops(g, p, k, &env);
        let rate = if tensor {
            device.tensor_flops
        } else {
            device.f32_flops
        };
        let (tm, tc) = (bytes as f64 / device.bytes_per_s, f / rate);
        kernels.push(KernelCost {
            flops: f,
            bytes: bytes as f64,
            seconds: tm.max(tc),
            compute_bound: tc > tm,
        });
    }
    Estimate {
        device,
        seconds: kernels.iter().map(|k| k.seconds).sum(),
        flops: kernels.iter().map(|k| k.flops).sum(),
        bytes: kernels.iter().map(|k| k.bytes).sum(),
        kernels,
    }
}
