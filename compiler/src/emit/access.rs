//! How a generated kernel addresses one of its tensors through the op's
//! view of it (strides and offset), as the attention and convolution
//! kernels and the tensor-core attention wrappers take their operands.

use super::templates::Ctx;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::view::contiguous_strides;
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;

/// How a kernel addresses one of its tensors: the buffer it reads or writes
/// and the strides and offset of the op's view of it. Inputs may be strided
/// views (heads sliced out of a fused QKV projection); outputs are
/// contiguous.
pub(crate) struct Access {
    pub(crate) ptr: String,
    pub(crate) dt: DType,
    strides: Vec<Dim>,
    offset: Dim,
}

impl Access {
    /// Op input `i`, through its view when the kernel has one.
    pub(crate) fn input(g: &Graph, c: &Ctx, n: NodeIndex, i: usize) -> Access {
        let slot = c.ins[i];
        let dt = c.p.buffers[c.k.inputs[slot]].ty.dtype;
        let ptr = format!("in{slot}");
        match c.k.input_views.get(slot).and_then(|v| v.as_ref()) {
            Some(v) => Access {
                ptr,
                dt,
                strides: v.strides.clone(),
                offset: v.offset.clone(),
            },
            None => Access {
                ptr,
                dt,
                strides: contiguous_strides(&g.ty(g.inputs(n)[i]).shape),
                offset: Dim::constant(0),
            },
        }
    }

    /// Op output `o`, row-major; of a packed `attention_grad`, gradient `o`
    /// (dq, dk, dv) as a `[B, T, H, D]` view of the one packed output.
    pub(crate) fn output(g: &Graph, c: &Ctx, n: NodeIndex, o: usize) -> Access {
        if let Op::AttentionGrad(a) = &g.g[n].op {
            if a.packed {
                return Access::packed_grad(g, c, n, o);
            }
        }
        let slot = c.outs[o];
        Access {
            ptr: format!("out{slot}"),
            dt: c.p.buffers[c.k.outputs[slot]].ty.dtype,
            strides: contiguous_strides(&g.g[n].outputs[o].shape),
            offset: Dim::constant(0),
        }
    }

    /// Gradient `o` of packed `attention_grad` `n`: input `o`'s shape
    /// `[B, T, H, D]` laid over rows of the packed output's width, from its
    /// first feature there (`ops::attention::packed_layout`).
    fn packed_grad(g: &Graph, c: &Ctx, n: NodeIndex, o: usize) -> Access {
        let ins = g.inputs(n);
        let (q, k, v) = (g.ty(ins[0]), g.ty(ins[1]), g.ty(ins[2]));
        let (firsts, width) = crate::ops::packed_layout(q, k, v)
            .expect("a packed gradient's layout (its op's infer checked it)");
        let shape = &g.ty(ins[o]).shape;
        let slot = c.outs[0];
        Access {
            ptr: format!("out{slot}"),
            dt: c.p.buffers[c.k.outputs[slot]].ty.dtype,
            strides: vec![
                shape[1].checked_mul(&width).unwrap_or_default(),
                width,
                shape[3].clone(),
                Dim::constant(1),
            ],
            offset: firsts[o].clone(),
        }
    }

    /// The view's strides, in elements, one per axis.
    pub(crate) fn strides(&self) -> &[Dim] {
        &self.strides
    }

    /// The view's first element within the buffer.
    pub(crate) fn offset(&self) -> &Dim {
        &self.offset
    }

    /// Every row (the last axis) starts 16-byte aligned for 16-bit elements
    /// and is contiguous: what 16-byte tile loads need.
    pub(crate) fn rows_aligned(&self) -> bool {
        let div8 = |d: &Dim| d.checked_div(&Dim::constant(8)).is_some();
        matches!(self.strides.split_last(), Some((last, rest))
            if last.is_one() && rest.iter().all(div8) && div8(&self.offset))
    }

    /// The view as a template's view struct initialiser: the pointer at
    /// the view's first element, then each axis's stride (in elements).
    pub(crate) fn init(&self) -> String {
        let mut parts = vec![match self.offset.as_const() {
            Some(0) => self.ptr.clone(),
            _ => format!("{} + {}", self.ptr, self.offset.to_c()),
        }];
        parts.extend(self.strides.iter().map(Dim::to_c));
        format!("{{{}}}", parts.join(", "))
    }
}
