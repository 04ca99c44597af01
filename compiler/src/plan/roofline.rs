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

/// The devices' rates live in the one device table.
pub use crate::device::{device, device_of_gpu, Device, DEVICES};

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

/// FLOPs of one step of `p` at the plan's sizes (what MFU divides by):
/// the same count [`estimate`] sums, with no device to time it on.
pub fn step_flops(g: &Graph, p: &Program, plan: &Plan) -> f64 {
    let env = |s: &str| plan.dims.get(s).copied();
    (0..plan.launches.len())
        .map(|k| flops(g, p, k, &env).0)
        .sum()
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
