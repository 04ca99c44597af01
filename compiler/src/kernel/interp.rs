//! The kernel IR's CPU interpreter: runs a program kernel by kernel,
//! element by element, with the index arithmetic the CUDA code uses, so
//! that a fused program can be checked against the unfused graph.

use super::view::View;
use super::{Body, BufKind, Kernel, PExpr, Program};
use crate::interp::{concrete_shape, round_to, Feeds, InterpError, Precision};
use crate::ir::{Dim, Graph};
use crate::ops::{EvalCtx, Op, UnaryKind};
use crate::tensor::Tensor;
use petgraph::stable_graph::NodeIndex;

/// A view's shape, strides and offset with every size bound.
type BoundView = (Vec<usize>, Vec<usize>, usize);

fn dim(d: &Dim, feeds: &Feeds) -> usize {
    crate::interp::dim_size(d, &feeds.dims)
}

/// The element of the viewed buffer for flat element `i` of the view's shape.
fn offset(view: &View, shape: &[usize], strides: &[usize], base: usize, mut i: usize) -> usize {
    let mut at = base;
    for k in (0..view.shape.len()).rev() {
        let c = i % shape[k].max(1);
        i /= shape[k].max(1);
        at += c * strides[k];
    }
    at
}

/// The tensor a view shows of a stored buffer, element by element.
fn gather(t: &Tensor, view: &View, feeds: &Feeds) -> Tensor {
    let shape: Vec<usize> = view.shape.iter().map(|d| dim(d, feeds)).collect();
    let strides: Vec<usize> = view.strides.iter().map(|d| dim(d, feeds)).collect();
    let base = dim(&view.offset, feeds);
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|i| {
            t.data
                .get(offset(view, &shape, &strides, base, i))
                .copied()
                .unwrap_or(f64::NAN)
        })
        .collect();
    Tensor::new(shape, data)
}

/// Runs one kernel on its input tensors; returns its outputs, each rounded
/// to its buffer's dtype when `precision` asks for stored values.
pub fn run_kernel(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    ins: &[&Tensor],
    feeds: &Feeds,
    precision: Precision,
) -> Result<Vec<Tensor>, InterpError> {
    let outs: Vec<Tensor> = match &k.body {
        Body::Group(members) => {
            let mut outs: Vec<Option<Tensor>> = vec![None; k.outputs.len()];
            for m in members {
                // A chain as its own kernel computes it; a lone op exactly,
                // rounded with the group's outputs below.
                let (nodes, body, exact) = match &m.chain {
                    Some(c) => (c.0.clone(), Body::Pointwise(c.1.clone()), precision),
                    None => (vec![m.node], Body::Op(m.node), Precision::F64),
                };
                let one = Kernel {
                    name: k.name.clone(),
                    nodes,
                    inputs: m.inputs.iter().map(|&i| k.inputs[i]).collect(),
                    outputs: m.outputs.iter().map(|&o| k.outputs[o]).collect(),
                    input_views: Vec::new(),
                    residual: None,
                    prologue: None,
                    body,
                };
                let mins: Vec<&Tensor> = m.inputs.iter().map(|&i| ins[i]).collect();
                for (&o, t) in m
                    .outputs
                    .iter()
                    .zip(run_kernel(g, p, &one, &mins, feeds, exact)?)
                {
                    outs[o] = Some(t);
                }
            }
            outs.into_iter()
                .map(|t| {
                    t.ok_or_else(|| {
                        InterpError(format!("kernel {} leaves an output unwritten", k.name))
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Body::Gemm(n, ep) => {
            let prod = run_op(g, k, *n, ins, feeds)?.remove(0);
            let cols = prod.shape.last().copied().unwrap_or(1).max(1);
            let gelu = UnaryKind::Gelu;
            let mut pre = prod;
            for (i, x) in pre.data.iter_mut().enumerate() {
                if let Some(r) = ep.residual {
                    *x += ins[r].data[i];
                }
                if let Some(b) = ep.bias {
                    *x += ins[b].data[i % cols];
                }
                if let Some(a) = ep.dgelu {
                    *x *= gelu.derivative(ins[a].data[i]);
                }
            }
            if ep.gelu {
                vec![pre.map(|x| gelu.apply(x)), pre]
            } else {
                vec![pre]
            }
        }
        Body::Op(n) if k.prologue.is_some() => {
            let pro = k.prologue.as_ref().expect("matched");
            let (data, x) = eval_pointwise(
                k,
                &pro.chain,
                ins,
                feeds,
                precision,
                Some((pro.value, pro.dtype)),
            )?;
            // The op reads the chain's value as its input 0, the kernel's
            // first inputs as its others.
            let x = Tensor::new(
                concrete_shape(&g.ty(g.inputs(*n)[0]).shape, &feeds.dims)?,
                x,
            );
            let op_ins: Vec<&Tensor> = std::iter::once(&x).chain(ins.iter().copied()).collect();
            let mut outs = run_op(g, k, *n, &op_ins, feeds)?;
            for (slot, d) in data.into_iter().enumerate().skip(outs.len()) {
                let shape = concrete_shape(&p.buffers[k.outputs[slot]].ty.shape, &feeds.dims)?;
                outs.push(Tensor::new(shape, d));
            }
            outs
        }
        Body::Op(n) => {
            let mut outs = run_op(g, k, *n, ins, feeds)?;
            if let Some(r) = k.residual {
                for (x, y) in outs[0].data.iter_mut().zip(&ins[r].data) {
                    *x += y;
                }
            }
            outs
        }
        Body::Pointwise(pw) => {
            let (data, _) = eval_pointwise(k, pw, ins, feeds, precision, None)?;
            k.outputs
                .iter()
                .zip(data)
                .map(|(&b, d)| {
                    Ok(Tensor::new(
                        concrete_shape(&p.buffers[b].ty.shape, &feeds.dims)?,
                        d,
                    ))
                })
                .collect::<Result<_, InterpError>>()?
        }
    };
    Ok(k.outputs
        .iter()
        .zip(outs)
        .map(|(&b, t)| match precision {
            Precision::AsStored => {
                let dt = p.buffers[b].ty.dtype;
                t.map(|x| round_to(dt, x))
            }
            Precision::F64 => t,
        })
        .collect())
}

/// A pointwise chain over its `n` elements: each output slot's stored
/// values (a slot no store names stays zeros), its column sums into their
/// slot, and, where `value` names an expression, that expression's values
/// rounded to `dtype` as stored (what a prologue hands its op).
fn eval_pointwise(
    k: &Kernel,
    pw: &super::Pointwise,
    ins: &[&Tensor],
    feeds: &Feeds,
    precision: Precision,
    value: Option<(usize, crate::ir::DType)>,
) -> Result<(Vec<Vec<f64>>, Vec<f64>), InterpError> {
    let n = dim(&pw.n, feeds);
    // Views with their sizes bound, once per kernel.
    let bound: Vec<Option<BoundView>> = pw
        .exprs
        .iter()
        .map(|e| match e {
            PExpr::Load { view, .. } => Some((
                view.shape.iter().map(|d| dim(d, feeds)).collect(),
                view.strides.iter().map(|d| dim(d, feeds)).collect(),
                dim(&view.offset, feeds),
            )),
            _ => None,
        })
        .collect();
    let mut data: Vec<Vec<f64>> = vec![vec![0.0; n]; k.outputs.len()];
    let mut vals = vec![0.0; pw.exprs.len()];
    // A column sum adds each element as the tensor it replaces
    // stored it (rounded to its dtype), in row order.
    let cols = pw.sum.as_ref().map_or(1, |s| s.cols.max(1) as usize);
    let mut sums = vec![0.0; cols];
    let mut kept = Vec::new();
    // `i` is the element index the loads unravel, not just a position in `data`.
    #[allow(clippy::needless_range_loop)]
    for i in 0..n {
        for (j, e) in pw.exprs.iter().enumerate() {
            vals[j] = match e {
                PExpr::Load { input, view } => {
                    let (shape, strides, base) = bound[j].as_ref().expect("bound above");
                    let t = ins[*input];
                    t.data
                        .get(offset(view, shape, strides, *base, i))
                        .copied()
                        .ok_or_else(|| {
                            InterpError(format!(
                                "kernel {} reads past the end of input {input}",
                                k.name
                            ))
                        })?
                }
                PExpr::Const(c) => *c,
                PExpr::Dim(d) => dim(d, feeds) as f64,
                PExpr::Unary(u, a) => u.apply(vals[*a]),
                PExpr::UnaryGrad(u, x, dy) => u.derivative(vals[*x]) * vals[*dy],
                PExpr::Binary(b, x, y) => b.apply(vals[*x], vals[*y]),
                PExpr::Dropout { op, x, key } => {
                    let k = &ins[*key].data;
                    let key = [k[0] as i32 as u32, k[1] as i32 as u32];
                    if crate::ops::philox::keeps(key, op.site, i as u64, op.threshold()) {
                        vals[*x] * op.scale()
                    } else {
                        0.0
                    }
                }
                PExpr::Round(dt, a) => match precision {
                    Precision::F64 => vals[*a],
                    Precision::AsStored => round_to(*dt, vals[*a]),
                },
            };
        }
        for &(slot, e) in &pw.stores {
            data[slot][i] = vals[e];
        }
        let as_stored = |dt, x| match precision {
            Precision::AsStored => round_to(dt, x),
            Precision::F64 => x,
        };
        if let Some(sum) = &pw.sum {
            sums[i % cols] += as_stored(sum.dtype, vals[sum.expr]);
        }
        if let Some((e, dt)) = value {
            kept.push(as_stored(dt, vals[e]));
        }
    }
    if let Some(sum) = &pw.sum {
        let rows = (n / cols) as f64;
        if sum.mean {
            sums.iter_mut().for_each(|x| *x /= rows);
        }
        data[sum.out] = sums;
    }
    Ok((data, kept))
}

/// Runs every kernel in order; returns the contents of every buffer.
pub fn run_program(
    g: &Graph,
    p: &Program,
    feeds: &Feeds,
    precision: Precision,
) -> Result<Vec<Tensor>, InterpError> {
    let mut bufs: Vec<Option<Tensor>> = vec![None; p.buffers.len()];
    for (i, b) in p.buffers.iter().enumerate() {
        let fed = match (&g.g[b.value.node].op, b.kind) {
            (Op::Input(x), BufKind::Input) => feeds.inputs.get(&x.name),
            (Op::Param(x), BufKind::Param) => feeds.params.get(&x.name),
            (Op::State(x), BufKind::State) => feeds.state.get(&x.name),
            _ => continue,
        };
        let t = fed.ok_or_else(|| InterpError(format!("no value for buffer {i}")))?;
        bufs[i] = Some(t.clone());
    }
    for k in &p.kernels {
        let ins: Vec<&Tensor> = k
            .inputs
            .iter()
            .map(|&b| {
                bufs[b].as_ref().ok_or_else(|| {
                    InterpError(format!(
                        "kernel {} reads buffer {b} before it is written",
                        k.name
                    ))
                })
            })
            .collect::<Result<_, _>>()?;
        let outs = run_kernel(g, p, k, &ins, feeds, precision)?;
        for (&b, t) in k.outputs.iter().zip(outs) {
            bufs[b] = Some(t);
        }
    }
    Ok(bufs
        .into_iter()
        .map(|b| b.unwrap_or_else(|| Tensor::zeros(&[])))
        .collect())
}

/// One graph op on the kernel's inputs.
fn run_op(
    g: &Graph,
    k: &Kernel,
    n: NodeIndex,
    ins: &[&Tensor],
    feeds: &Feeds,
) -> Result<Vec<Tensor>, InterpError> {
    let node = &g.g[n];
    let out_shapes: Vec<Vec<usize>> = node
        .outputs
        .iter()
        .map(|t| concrete_shape(&t.shape, &feeds.dims))
        .collect::<Result<_, _>>()?;
    let env = |d: &Dim| dim(d, feeds);
    // Each input as the op sees it: through its view, or the stored
    // buffer in the op's shape (a reshape reads it unchanged).
    let mut shaped = Vec::with_capacity(ins.len());
    for (slot, (x, t)) in g.inputs(n).into_iter().zip(ins).enumerate() {
        let want = concrete_shape(&g.ty(x).shape, &feeds.dims)?;
        shaped.push(match k.input_views.get(slot).and_then(|v| v.as_ref()) {
            Some(view) => gather(t, view, feeds),
            None => Tensor::new(want, t.data.clone()),
        });
    }
    let ins: Vec<&Tensor> = shaped.iter().collect();
    Ok(node.op.eval(
        &ins,
        &EvalCtx {
            out_shapes: &out_shapes,
            dim: &env,
        },
    ))
}
