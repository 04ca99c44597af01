//! The CPU reference interpreter: evaluates any graph, fused or not, in f64
//! (exact enough for finite differences) or rounding every value to its
//! dtype (f32, bf16, f16) as a GPU would store it. It is the oracle that
//! autodiff, passes and GPU kernels are checked against.

pub mod peers;
pub mod random;
pub mod step;
// The f64 tensors every op's reference computes on (`crate::tensor`),
// where the interpreter's callers have always found them.
pub use crate::tensor;

use crate::ir::graph::{Graph, Value};
use crate::ir::types::DType;
use crate::ir::Dim;
use crate::ops::{EvalCtx, Op};
use std::collections::HashMap;
use tensor::Tensor;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Every value in f64; dtypes are ignored.
    F64,
    /// Every value rounded to its dtype after each op.
    AsStored,
}

/// Values for the graph's sources, by the names the model file gives them.
#[derive(Clone, Debug, Default)]
pub struct Feeds {
    pub dims: HashMap<String, i64>,
    pub inputs: HashMap<String, Tensor>,
    pub params: HashMap<String, Tensor>,
    pub state: HashMap<String, Tensor>,
    /// The other ranks of a data-parallel step (`all_reduce` meets them);
    /// `None` runs the step as the only rank.
    pub peers: Option<peers::Peers>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct InterpError(pub String);

impl std::fmt::Display for InterpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InterpError {}

pub fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        DType::F16 => half::f16::from_f64(x).to_f64(),
        DType::I32 => x,
    }
}

/// Binds every symbolic dimension; errors name the ones missing.
pub fn concrete_shape(
    shape: &[Dim],
    dims: &HashMap<String, i64>,
) -> Result<Vec<usize>, InterpError> {
    shape
        .iter()
        .map(|d| {
            let v = d.eval(&|s| dims.get(s).copied()).ok_or_else(|| {
                let missing: Vec<&str> = d.symbols().filter(|s| !dims.contains_key(*s)).collect();
                InterpError(format!(
                    "no size given for dimension {}",
                    missing.join(", ")
                ))
            })?;
            usize::try_from(v)
                .map_err(|_| InterpError(format!("dimension {d} is {v}, which is negative")))
        })
        .collect()
}

/// A size with every symbol bound (0 where one is not, or it is negative:
/// the feeds' own checks report those).
pub(crate) fn dim_size(d: &Dim, dims: &HashMap<String, i64>) -> usize {
    d.eval(&|s| dims.get(s).copied())
        .and_then(|v| usize::try_from(v).ok())
        .unwrap_or(0)
}

/// Evaluates the whole graph; returns every value it computed.
pub fn run(
    g: &Graph,
    feeds: &Feeds,
    precision: Precision,
) -> Result<HashMap<Value, Tensor>, InterpError> {
    let mut vals: HashMap<Value, Tensor> = HashMap::new();
    let dim_env = |d: &Dim| dim_size(d, &feeds.dims);
    for n in g.topo_order() {
        let node = &g.g[n];
        let out_shapes: Vec<Vec<usize>> = node
            .outputs
            .iter()
            .map(|t| concrete_shape(&t.shape, &feeds.dims))
            .collect::<Result<_, _>>()?;
        let fed = |kind: &str,
                   map: &HashMap<String, Tensor>,
                   name: &str|
         -> Result<Tensor, InterpError> {
            let t = map
                .get(name)
                .ok_or_else(|| InterpError(format!("no value given for {kind} `{name}`")))?;
            if t.shape != out_shapes[0] {
                return Err(InterpError(format!(
                    "{kind} `{name}` should have shape {:?}, the value given has {:?}",
                    out_shapes[0], t.shape
                )));
            }
            Ok(t.clone())
        };
        let outs = match &node.op {
            Op::Input(i) => vec![fed("input", &feeds.inputs, &i.name)?],
            Op::Param(p) => vec![fed("parameter", &feeds.params, &p.name)?],
            Op::State(s) => vec![fed("optimizer state", &feeds.state, &s.name)?],
            op => {
                let ins: Vec<Value> = g.inputs(n);
                if let Op::Slice(s) = op {
                    let size = vals[&ins[0]].shape[s.axis];
                    let (a, b) = (dim_env(&s.start), dim_env(&s.end));
                    if a > b || b > size {
                        return Err(InterpError(format!(
                            "slice {}:{} is out of range for an axis of size {size} (at these sizes: {:?})",
                            s.start, s.end, feeds.dims
                        )));
                    }
                }
                let args: Vec<&Tensor> = ins.iter().map(|v| &vals[v]).collect();
                let ctx = EvalCtx {
                    out_shapes: &out_shapes,
                    dim: &dim_env,
                };
                match (op, &feeds.peers) {
                    (Op::AllReduce(a), Some(peers)) => {
                        let mut mean = peers.mean(args[0]);
                        if a.piece.is_some() {
                            vec![a.own(mean)]
                        } else if let Some(i) = a.owners_of {
                            // Only the owner's piece is defined (NCCL reduces
                            // to it alone): NaN elsewhere shows any reader.
                            let own = crate::autodiff::zero::piece(
                                &g.params,
                                a.group,
                                peers.rank() as u32 % a.group,
                                i,
                            );
                            let (lo, hi) = own.map_or((0, 0), |p| (p.lo as usize, p.hi as usize));
                            for (k, x) in mean.data.iter_mut().enumerate() {
                                if k < lo || k >= hi {
                                    *x = f64::NAN;
                                }
                            }
                            vec![mean]
                        } else {
                            vec![mean]
                        }
                    }
                    (Op::AllGather(a), Some(peers)) => {
                        // The pieces of this rank's group (its host's,
                        // with hybrid sharding: every group holds the same).
                        let all = peers.gather(args[0]);
                        let group = a.pieces.len().max(1);
                        let first = peers.rank() / group * group;
                        let parts: Vec<Option<&[f64]>> = all
                            .iter()
                            .skip(first)
                            .take(group)
                            .map(|p| Some(p.as_slice()))
                            .collect();
                        vec![a.assemble(&parts)]
                    }
                    _ => op.eval(&args, &ctx),
                }
            }
        };
        for (port, mut t) in outs.into_iter().enumerate() {
            if precision == Precision::AsStored {
                let dt = node.outputs[port].dtype;
                t = t.map(|x| round_to(dt, x));
            }
            vals.insert(Value { node: n, port }, t);
        }
    }
    Ok(vals)
}
