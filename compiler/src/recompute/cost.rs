//! The roofline price of one op run on its own, for ordering the
//! candidates (the report's figures come from whole plans instead).

use crate::ir::graph::Value;
use crate::ir::types::DType;
use crate::ir::Graph;
use crate::ops::Op;
use crate::plan::roofline::Device;
use petgraph::stable_graph::NodeIndex;

fn numel(g: &Graph, v: Value, env: &dyn Fn(&str) -> Option<i64>) -> f64 {
    g.ty(v).numel().eval(env).unwrap_or(0).max(0) as f64
}

/// Bytes a value takes stored at its dtype.
pub fn value_bytes(g: &Graph, v: Value, env: &dyn Fn(&str) -> Option<i64>) -> u64 {
    numel(g, v, env) as u64 * g.ty(v).dtype.size_bytes() as u64
}

/// Predicted seconds of node `n` run as a kernel of its own: the larger of
/// moving its inputs and outputs and doing its arithmetic.
pub fn node_seconds(g: &Graph, n: NodeIndex, env: &dyn Fn(&str) -> Option<i64>, d: Device) -> f64 {
    let node = &g.g[n];
    let ins = g.inputs(n);
    let bytes: u64 = ins
        .iter()
        .map(|&x| value_bytes(g, x, env))
        .chain((0..node.outputs.len()).map(|port| value_bytes(g, Value { node: n, port }, env)))
        .sum();
    let shape_len = |v: Value, axis: usize| -> f64 {
        let t = g.ty(v);
        t.shape
            .get(axis)
            .and_then(|s| s.eval(env))
            .unwrap_or(0)
            .max(0) as f64
    };
    let out = Value { node: n, port: 0 };
    let half = |v: Value| matches!(g.ty(v).dtype, DType::BF16 | DType::F16);
    let (flops, tensor) = match &node.op {
        Op::MatMul(_) => {
            let a = ins[0];
            let k = shape_len(a, g.ty(a).rank().saturating_sub(1));
            (2.0 * numel(g, out, env) * k, half(out))
        }
        Op::Attention(at) => {
            let f = 4.0 * numel(g, ins[0], env) * shape_len(ins[1], 1);
            (if at.causal { f / 2.0 } else { f }, half(ins[0]))
        }
        Op::Conv2d(_) => {
            let w = g.ty(ins[1]);
            let taps: f64 = w.shape[..3.min(w.rank())]
                .iter()
                .map(|s| s.eval(env).unwrap_or(0).max(0) as f64)
                .product();
            (2.0 * numel(g, out, env) * taps, half(out))
        }
        _ => (5.0 * numel(g, out, env), false),
    };
    let rate = if tensor { d.tensor_flops } else { d.f32_flops };
    (bytes as f64 / d.bytes_per_s).max(flops / rate)
}
