//! The data-parallel collectives in the memory plan: each bucket's
//! all-reduce (kernel::buckets), and under ZeRO stage 3 each parameter's
//! gather (kernel::gathers), runs on a second stream from its launch
//! until the first launch that reads one of its results, which waits for it.
//! Over that span the compute stream keeps going, so the collective's
//! buffers must stay where they are until the wait: their lives stretch to
//! it.

use super::{MemKind, PlannedBuffer};
use crate::ir::Graph;
use crate::kernel::buckets::{every_micro_batch, is_collective};
use crate::kernel::gathers::is_gather;
use crate::kernel::{Body, Program};
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use serde::Serialize;

/// One bucket's collective, as the plan runs it.
#[derive(Clone, Debug, Serialize)]
pub struct PlannedCollective {
    /// Its launch (by position): issued when the compute stream reaches it.
    pub launch: usize,
    /// The launch the compute stream waits for it before (`launches.len()`:
    /// the end of the step).
    pub join: usize,
    /// Bytes it averages over the ranks.
    pub bytes: u64,
    /// (input buffer, output buffer) of each tensor, in order.
    pub tensors: Vec<(usize, usize)>,
    /// Runs on every micro-batch (the loss), not only on the last.
    pub every_micro_batch: bool,
    /// ZeRO: for each tensor, the parameter whose gradient it is where the
    /// mean goes to the owners of its pieces alone (`autodiff::zero`), or
    /// `None` where every rank gets all of it; empty without ZeRO.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub owners_of: Vec<Option<usize>>,
    /// ZeRO stage 2: for each tensor, the elements [lo, hi) of its mean
    /// this rank keeps (its output buffer holds them alone), or `None`
    /// where the output is the whole tensor; empty where no tensor is a
    /// piece. Such a collective is joined at the next one's launch at the
    /// latest, so that the whole gradients it reads die there.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<Option<(u64, u64)>>,
    /// ZeRO stage 3: a parameter gathered whole (its one tensor's input
    /// this rank's piece, its output the whole parameter), with every
    /// rank's elements [lo, hi) of it in rank order; `None` for a bucket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gather: Option<PlannedGather>,
}

/// A parameter's gather as the plan runs it: each rank broadcasts its
/// piece into its place in every rank's whole buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedGather {
    /// The parameter (its index in the model's order).
    pub param: usize,
    /// Each rank's elements [lo, hi) of it, `(0, 0)` where it owns none.
    pub pieces: Vec<(u64, u64)>,
}

impl PlannedCollective {
    /// The type of each tensor it averages, in order (`PlannedBuffer::dtype`:
    /// bf16 where `--reduce-dtype bf16` has the ranks average in bf16).
    pub fn dtypes<'b>(&self, buffers: &'b [PlannedBuffer]) -> Vec<&'b str> {
        self.tensors
            .iter()
            .map(|&(i, _)| buffers[i].dtype.name())
            .collect()
    }
}

/// The collectives of program `p`, with the launch each one's results are
/// first read by.
pub fn collectives(g: &Graph, p: &Program, buffers: &[PlannedBuffer]) -> Vec<PlannedCollective> {
    let mut out = Vec::new();
    for (c, k) in p.kernels.iter().enumerate() {
        if is_gather(g, k) {
            out.push(gathered(g, p, buffers, c));
            continue;
        }
        if !is_collective(g, k) {
            continue;
        }
        let first_read = p.kernels[c + 1..]
            .iter()
            .position(|r| r.inputs.iter().any(|b| k.outputs.contains(b)))
            .map_or(p.kernels.len(), |i| c + 1 + i);
        let tensors: Vec<(usize, usize)> = k
            .inputs
            .iter()
            .copied()
            .zip(k.outputs.iter().copied())
            .collect();
        let reduce = |n: NodeIndex| match &g.g[n].op {
            Op::AllReduce(a) => (a.owners_of, a.piece),
            _ => (None, None),
        };
        let sharded = k
            .nodes
            .iter()
            .any(|&n| matches!(&g.g[n].op, Op::AllReduce(a) if a.sharded));
        let (owners_of, pieces): (Vec<_>, Vec<_>) = match &k.body {
            Body::Group(ms) => ms.iter().map(|m| reduce(m.node)).unzip(),
            _ => k.nodes.iter().map(|&n| reduce(n)).unzip(),
        };
        let pieced = pieces.iter().any(Option::is_some);
        // Stage 2 waits for a bucket where the next one is issued (the
        // backward pass has run a bucket's worth of kernels meanwhile), not
        // where the update first reads it: its whole gradients can go.
        let join = match p.kernels[c + 1..].iter().position(|r| is_collective(g, r)) {
            Some(i) if sharded => first_read.min(c + 1 + i),
            _ => first_read,
        };
        out.push(PlannedCollective {
            launch: c,
            join,
            bytes: tensors.iter().map(|&(i, _)| buffers[i].bytes).sum(),
            tensors,
            every_micro_batch: every_micro_batch(g, k),
            owners_of: if owners_of.iter().any(Option::is_some) {
                owners_of
            } else {
                Vec::new()
            },
            pieces: if pieced {
                pieces
                    .into_iter()
                    .map(|p| p.map(|(lo, hi)| (lo as u64, hi as u64)))
                    .collect()
            } else {
                Vec::new()
            },
            gather: None,
        });
    }
    out
}

/// Launch `c`'s gather (a parameter's, ZeRO stage 3): joined where its
/// result is first read, on every micro-batch (each one's forward and
/// backward passes read the weights).
fn gathered(g: &Graph, p: &Program, buffers: &[PlannedBuffer], c: usize) -> PlannedCollective {
    let k = &p.kernels[c];
    let Body::Op(n) = k.body else {
        unreachable!("a gather is an op kernel");
    };
    let Op::AllGather(a) = &g.g[n].op else {
        unreachable!("a gather kernel runs all_gather");
    };
    let first_read = p.kernels[c + 1..]
        .iter()
        .position(|r| r.inputs.contains(&k.outputs[0]))
        .map_or(p.kernels.len(), |i| c + 1 + i);
    PlannedCollective {
        launch: c,
        join: first_read,
        bytes: buffers[k.outputs[0]].bytes,
        tensors: vec![(k.inputs[0], k.outputs[0])],
        every_micro_batch: true,
        owners_of: Vec::new(),
        pieces: Vec::new(),
        gather: Some(PlannedGather {
            param: a.param,
            pieces: a
                .pieces
                .iter()
                .map(|&(lo, hi)| (lo as u64, hi as u64))
                .collect(),
        }),
    }
}

/// Lives of what the collectives read and write, stretched over the span
/// they run beside the compute stream; and each result stored over its
/// input (NCCL reduces in place) where nothing else reads that input
/// later: a whole-run gradient, or a temporary whose last reader this is.
pub fn place(collectives: &[PlannedCollective], out: &mut [PlannedBuffer]) {
    for c in collectives {
        for &(i, o) in &c.tensors {
            let last_use = out[i].live.map(|l| l.1);
            if out[i].kind == MemKind::Grad && out[i].alias_of.is_none() {
                out[o].alias_of = Some(i);
                continue;
            }
            if out[i].kind == MemKind::Activation
                && out[i].alias_of.is_none()
                && out[i].shares_with.is_none()
                && last_use == Some(c.launch)
                && out[i].bytes == out[o].bytes
            {
                let end = out[o].live.map_or(c.join, |l| l.1.max(c.join));
                if let Some(l) = out[i].live.as_mut() {
                    l.1 = end;
                }
                out[o].shares_with = Some(i);
                continue;
            }
            for b in [i, o] {
                if let Some(l) = out[b].live.as_mut() {
                    l.1 = l.1.max(c.join);
                }
            }
        }
    }
}
