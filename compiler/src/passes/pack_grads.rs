//! The gradient of a fused QKV projection's output. After autodiff and
//! `simplify` a step whose q, k and v are split out of one projection holds
//! `concat(reshape(dq), reshape(dk), reshape(dv))` along the features,
//! where dq, dk and dv are one `attention_grad`'s outputs and nothing else
//! reads them: a copy of the three gradients into one tensor (GPT-2 small
//! at B = 8: 36 MiB read and written a layer). A packed `attention_grad`
//! (`ops::AttentionGrad::packed`) computes that tensor itself: its kernels
//! store dq, dk and dv where the concatenation would have put them.

use super::{replace_uses, Pass};
use crate::ir::{Graph, Value};
use crate::ops::{AttentionGrad, Op};
use petgraph::stable_graph::NodeIndex;

pub struct PackAttentionGrads;

/// The `attention_grad` whose outputs 0, 1, 2 `concat` `n` joins, each
/// through a reshape that only it reads, each read by nothing else.
fn packable(g: &Graph, n: NodeIndex) -> Option<(NodeIndex, AttentionGrad)> {
    let Op::Concat(cat) = &g.g[n].op else {
        return None;
    };
    let ins = g.inputs(n);
    let out = &g.g[n].outputs[0];
    if ins.len() != 3 || out.rank() != 3 || cat.axis != 2 {
        return None;
    }
    let mut grad = None;
    for (i, part) in ins.iter().enumerate() {
        if !matches!(g.g[part.node].op, Op::Reshape(_)) || g.users(*part) != [(n, i)] {
            return None;
        }
        let x = g.inputs(part.node)[0];
        let Op::AttentionGrad(a) = &g.g[x.node].op else {
            return None;
        };
        if x.port != i || a.packed || g.users(x) != [(part.node, 0)] {
            return None;
        }
        if grad.is_some_and(|(node, _)| node != x.node) {
            return None;
        }
        grad = Some((x.node, a.clone()));
    }
    grad
}

impl Pass for PackAttentionGrads {
    fn name(&self) -> &'static str {
        "pack-attention-grads"
    }
    fn about(&self) -> &'static str {
        "the gradients attention returns for a fused QKV projection are stored side by side by its kernels, where their concatenation would copy them"
    }
    fn run(&self, g: &mut Graph) -> usize {
        let cats: Vec<NodeIndex> = g
            .topo_order()
            .into_iter()
            .filter(|&n| matches!(g.g[n].op, Op::Concat(_)))
            .collect();
        let mut rewrites = 0;
        for n in cats {
            let Some((ag, a)) = packable(g, n) else {
                continue;
            };
            let packed = AttentionGrad { packed: true, ..a };
            let types: Vec<_> = g.inputs(ag).iter().map(|v| g.ty(*v).clone()).collect();
            let cat = Value { node: n, port: 0 };
            // Cross-attention (S != T) does not pack.
            let types_out = match crate::ops::OpDef::infer(&packed, &types) {
                Ok(out) if out.len() == 1 && out[0] == *g.ty(cat) => out,
                _ => continue,
            };
            // The op is changed where it stands, so the step's order (which
            // follows the nodes' indices) keeps it where it was.
            let parts: Vec<NodeIndex> = g.inputs(n).iter().map(|v| v.node).collect();
            replace_uses(g, cat, Value { node: ag, port: 0 });
            g.g.remove_node(n);
            for p in parts {
                g.g.remove_node(p);
            }
            g.g[ag].op = packed.into();
            g.g[ag].outputs = types_out;
            rewrites += 1;
        }
        rewrites
    }
}
