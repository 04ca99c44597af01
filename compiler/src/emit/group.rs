//! Group kernels: several independent ops of one kind in one launch (every
//! parameter's optimizer update).

use super::cuda::{float_lit, header};
use super::templates::{op_loop, Ctx};
use crate::ir::types::DType;
use crate::ir::Graph;
use crate::kernel::{Kernel, Program};
use crate::ops::Op;

/// One kernel running several independent ops of one kind (every
/// parameter's optimizer update), each over its own elements in turn.
pub fn group_kernel(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    members: &[crate::kernel::Member],
    source: Option<&str>,
) -> Option<String> {
    let mut s = header(g, p, k, source);
    // Updates of f32 parameters call the prelude's one copy of the update,
    // so compile time stays flat in the number of parameters.
    let f32_only = |m: &crate::kernel::Member| {
        m.inputs
            .iter()
            .map(|&i| k.inputs[i])
            .chain(m.outputs.iter().map(|&o| k.outputs[o]))
            .all(|b| p.buffers[b].ty.dtype == DType::F32)
    };
    if members.iter().all(f32_only) {
        if let Some(calls) = members
            .iter()
            .map(|m| update_call(g, m))
            .collect::<Option<String>>()
        {
            s.push_str(&calls);
            s.push_str("}\n");
            return Some(s);
        }
    }
    for m in members {
        let c = Ctx {
            p,
            k,
            ins: m.inputs.clone(),
            outs: m.outputs.clone(),
        };
        s.push_str("  {\n");
        s.push_str(&op_loop(g, &c, m.node)?);
        s.push_str("  }\n");
    }
    s.push_str("}\n");
    Some(s)
}

/// The `apply` argument: the micro-batch flag, or 1 without micro-batches.
fn apply(slot: Option<&usize>) -> String {
    slot.map_or("1.0f".to_string(), |s| format!("*in{s}"))
}

/// `fs_adamw(...)` or `fs_sgd(...)` for one member; `None` for other ops.
fn update_call(g: &Graph, m: &crate::kernel::Member) -> Option<String> {
    let (i, o) = (&m.inputs, &m.outputs);
    let n = g.g[m.node].outputs[0].numel().to_c();
    Some(match &g.g[m.node].op {
        Op::AdamW(a) => format!(
            "    fs_adamw(out{}, out{}, out{}, in{}, in{}, in{}, in{}, *in{}, *in{}, *in{}, {}, {n}, {}, {}, {}, {});\n",
            o[0],
            o[1],
            o[2],
            i[0],
            i[1],
            i[2],
            i[3],
            i[4],
            i[5],
            i[6],
            apply(i.get(7)),
            float_lit(a.beta1),
            float_lit(a.beta2),
            float_lit(a.eps),
            float_lit(a.weight_decay)
        ),
        Op::Sgd(sg) => format!(
            "    fs_sgd(out{}, out{}, in{}, in{}, in{}, *in{}, *in{}, {}, {n}, {}, {});\n",
            o[0],
            o[1],
            i[0],
            i[1],
            i[2],
            i[3],
            i[4],
            apply(i.get(5)),
            float_lit(sg.momentum),
            float_lit(sg.weight_decay)
        ),
        _ => return None,
    })
}
