//! How the neural-network ops become kernels, each a call of its
//! `kernels/` template: a block a row for the softmax, the cross-entropy
//! and the norms where norm_rows's one-warp kernels do not run
//! (kernels/norm_block.cuh), a thread an element for the lookups, masks
//! and rotations; the norms' one-warp kernels and the embedding backward
//! through emit/norm_rows.rs and emit/embedding_grad.rs.

use super::*;
use crate::emit::cross_entropy::{self, Stores};
use crate::emit::cuda::float_lit;
use crate::emit::templates::{element, row_length_of, rows_of};
use crate::emit::{embedding_grad, norm_rows};
use crate::ops::*;

/// A block a row where the op runs along the last axis (none otherwise).
fn last_axis_rows(axis: usize, g: &Graph, n: NodeIndex) -> Option<Shape> {
    let rank = g.ty(g.inputs(n)[0]).rank();
    (axis + 1 == rank).then(|| Shape::Rows(rows_of(g, n)))
}

/// A norm's forward: norm_rows's blocks of many short rows where it
/// applies, else a block a row.
fn norm_forward_shape(g: &Graph, n: NodeIndex) -> Shape {
    match crate::kernel::forms::norm_forward_rows(g, n) {
        Some(_) => Shape::Rows(Dim::constant(norm_rows::FORWARD_BLOCKS)),
        None => Shape::Rows(rows_of(g, n)),
    }
}

/// A norm's backward: a block a group of rows (NORM_GROUPS, each summing
/// its rows' parameter gradients) where norm_rows applies, else a block a
/// row.
fn norm_backward_shape(g: &Graph, n: NodeIndex) -> Shape {
    match norm_rows::applies(g, n) {
        Some(_) => Shape::Rows(Dim::constant(NORM_GROUPS as i64)),
        None => Shape::Rows(rows_of(g, n)),
    }
}

/// Along the last axis only: a block a row (kernels/softmax.cuh).
impl Lower for Softmax {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        last_axis_rows(self.axis, g, n)
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some(SOFTMAX_INCLUDE.to_string())
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        Some(format!(
            "        fs_softmax_row<{}, {}>({} + row * C, {} + row * C, C);\n",
            c.in_el(0),
            c.out_el(0),
            c.in_ptr(0),
            c.out_ptr(0)
        ))
    }
}

impl Lower for SoftmaxGrad {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        last_axis_rows(self.axis, g, n)
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some(SOFTMAX_INCLUDE.to_string())
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        Some(format!(
            "        fs_softmax_grad_row<{}, {}, {}>({} + row * C, {} + row * C, {} + row * C, C);\n",
            c.in_el(0),
            c.in_el(1),
            c.out_el(0),
            c.in_ptr(0),
            c.in_ptr(1),
            c.out_ptr(0)
        ))
    }
}

const SOFTMAX_INCLUDE: &str = "#include \"softmax.cuh\"\n\n";

/// Many rows a block where the rows are short (norm_rows), else a block a row.
/// The include of kernels/norm_block.cuh, where a norm runs a block a row.
const NORM_BLOCK_INCLUDE: &str = "#include \"norm_block.cuh\"\n\n";

/// norm_rows's header where its kernel runs, else the block-a-row one's.
fn norm_includes(g: &Graph, c: &Ctx, n: NodeIndex, fallback: bool) -> Option<String> {
    let rows = norm_rows::file_scope(g, c, n).unwrap_or_default();
    let block = if fallback { NORM_BLOCK_INCLUDE } else { "" };
    Some(rows + block).filter(|s| !s.is_empty())
}

/// A norm's forward a block a row (kernels/norm_block.cuh), where
/// norm_rows's kernel does not run.
fn norm_forward_row(c: &Ctx, layer: bool, eps: f64) -> String {
    let (x, y) = (c.in_ptr(0), c.out_ptr(0));
    let eps = float_lit(eps);
    if layer {
        format!(
            "        fs_layer_norm_block_row<{}, {}, {}, {}>({x} + row * C, {}, {}, {y} + row * C, C, {eps});\n",
            c.in_el(0),
            c.in_el(1),
            c.in_el(2),
            c.out_el(0),
            c.in_ptr(1),
            c.in_ptr(2)
        )
    } else {
        format!(
            "        fs_rms_norm_block_row<{}, {}, {}>({x} + row * C, {}, {y} + row * C, C, {eps});\n",
            c.in_el(0),
            c.in_el(1),
            c.out_el(0),
            c.in_ptr(1)
        )
    }
}

/// A norm's whole backward kernel a block a row (kernels/norm_block.cuh),
/// where norm_rows's kernel does not run: dx by rows, then the parameter
/// gradients' partials by NORM_GROUPS groups of rows.
fn norm_backward_block(g: &Graph, c: &Ctx, n: NodeIndex, layer: bool, eps: f64) -> String {
    let (rows, cols) = (rows_of(g, n).to_c(), row_length_of(g, n).to_c());
    let (res_el, res_ptr, has_res) = match c.k.residual {
        Some(slot) => (
            element(c.p.buffers[c.k.inputs[slot]].ty.dtype),
            format!("in{slot}"),
            true,
        ),
        None => ("fs_el::F32", "(const float*)nullptr".to_string(), false),
    };
    let types = format!(
        "{}, {}, {}, {}, {res_el}, {has_res}",
        c.in_el(0),
        c.in_el(1),
        c.in_el(2),
        c.out_el(0)
    );
    let ins = format!(
        "{}, {}, {}, {res_ptr}",
        c.in_ptr(0),
        c.in_ptr(1),
        c.in_ptr(2)
    );
    let eps = float_lit(eps);
    let (call, partials) = if layer {
        (
            "fs_layer_norm_backward_block",
            format!("{}, {}", c.out_ptr(1), c.out_ptr(2)),
        )
    } else {
        ("fs_rms_norm_backward_block", c.out_ptr(1))
    };
    format!(
        "    // A block a row (kernels/norm_block.cuh): dx, then the parameter gradients' partials by {NORM_GROUPS} groups of rows.\n    {call}<{types}>({ins}, {}, {partials}, {rows}, {cols}, {eps}, {NORM_GROUPS});\n",
        c.out_ptr(0)
    )
}

/// A norm's forward: norm_rows's one-warp kernel where it applies, else a
/// block a row (`layer`: LayerNorm, else RMSNorm).
macro_rules! norm_forward_lowering {
    ($($op:ident: $layer:expr;)*) => {$(
        impl Lower for $op {
            fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
                Some(norm_forward_shape(g, n))
            }
            fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                norm_rows::forward_body(g, c, n)
            }
            fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                norm_includes(g, c, n, norm_rows::forward_body(g, c, n).is_none())
            }
            fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
                Some(norm_forward_row(c, $layer, self.eps))
            }
        }
    )*};
}

norm_forward_lowering! {
    LayerNorm: true;
    RmsNorm: false;
}

/// A norm's backward: dx by rows, then the parameter gradients by groups
/// of rows, in one kernel: norm_rows's where it applies, else a block a
/// row.
macro_rules! norm_backward_lowering {
    ($($op:ident: $layer:expr;)*) => {$(
        impl Lower for $op {
            fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
                Some(norm_backward_shape(g, n))
            }
            fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                norm_rows::kernel_body(g, c, n)
                    .or_else(|| Some(norm_backward_block(g, c, n, $layer, self.eps)))
            }
            fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                norm_includes(g, c, n, norm_rows::kernel_body(g, c, n).is_none())
            }
            fn launch_bounds(&self, g: &Graph, n: NodeIndex) -> Option<String> {
                norm_rows::backward_bounds(g, n)
            }
        }
    )*};
}

norm_backward_lowering! {
    LayerNormGrad: true;
    RmsNormGrad: false;
}

/// A thread an element (kernels/embedding.cuh's `fs_embedding_lookup`).
impl Lower for Embedding {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"embedding.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let table = &g.ty(g.inputs(n)[0]).shape;
        let (v, cols) = (table[0].to_c(), table.last()?.to_c());
        Some(format!(
            "        fs_embedding_lookup<{}, {}>(i, {cols}, {v}, {}, {}, {});\n",
            c.in_el(0),
            c.out_el(0),
            c.in_ptr(1),
            c.in_ptr(0),
            c.out_ptr(0)
        ))
    }
}

/// Groups of table rows with their sums in shared memory, times runs of
/// the tokens (emit/embedding_grad.rs).
impl Lower for EmbeddingGrad {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        embedding_grad::blocks(g, n).map(Shape::Rows)
    }
    fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        embedding_grad::kernel_body(g, c, n)
    }
    fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        embedding_grad::file_scope(g, c, n)
    }
}

/// The three cross-entropy ops share one row kernel (emit::cross_entropy,
/// kernels/cross_entropy.cuh); they differ in what it stores (Stores).
macro_rules! cross_entropy_lowering {
    ($($op:ident: $stores:expr;)*) => {$(
        impl Lower for $op {
            fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
                Some(Shape::Rows(rows_of(g, n)))
            }
            /// A cross-entropy over padded logits counts its classes only.
            fn row_length(&self, g: &Graph, n: NodeIndex) -> Dim {
                match self.classes {
                    Some(c) => Dim::constant(c),
                    None => row_length_of(g, n),
                }
            }
            fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
                Some(cross_entropy::INCLUDE.to_string())
            }
            fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
                Some(cross_entropy::row(c, $stores, self.classes, &self.rule))
            }
        }
    )*};
}

// logsumexp(row) - row[target] (NaN for a target outside the row); its
// gradient; and both from one pass over the logits.
cross_entropy_lowering! {
    CrossEntropy: Stores::Loss(0);
    CrossEntropyGrad: Stores::Grad(0);
    CrossEntropyWithGrad: Stores::Both { loss: 1, grad: 0 };
}

/// A thread a target (kernels/cross_entropy.cuh's `fs_counted`).
impl Lower for Counted {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"cross_entropy.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, _: &Graph, c: &Ctx, _: NodeIndex) -> Option<String> {
        let v = format!("fs_counted(in{}[i], {}LL)", c.ins[0], self.ignore_index);
        Some(format!("        {}\n", c.st(0, "i", &v)))
    }
}

/// A thread a rotated pair (kernels/rope.cuh).
impl Lower for Rope {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(Shape::Elements(
            g.g[n].outputs[0].numel().checked_div(&Dim::constant(2))?,
        ))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"rope.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let sh = &g.ty(g.inputs(n)[0]).shape;
        let rk = sh.len();
        let positions = if self.positions {
            c.in_ptr(1)
        } else {
            "nullptr".to_string()
        };
        Some(format!(
            "        fs_rope_pair<{}, {}>(i, {}, {}, {}, {}, {}, {}, {}, {});\n",
            c.in_el(0),
            c.out_el(0),
            sh[rk - 3].to_c(),
            sh[rk - 2].to_c(),
            sh[rk - 1].to_c(),
            float_lit(self.theta.log2()),
            self.inverse,
            positions,
            c.in_ptr(0),
            c.out_ptr(0)
        ))
    }
}

/// A thread an element (kernels/mask.cuh).
impl Lower for CausalMask {
    fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
        Some(per_element(g, n))
    }
    fn file_scope(&self, _: &Graph, _: &Ctx, _: NodeIndex) -> Option<String> {
        Some("#include \"mask.cuh\"\n\n".to_string())
    }
    fn loop_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
        let sh = &g.ty(g.inputs(n)[0]).shape;
        Some(format!(
            "        fs_causal_mask<{}, {}>(i, {}, {}, {}, {}, {});\n",
            c.in_el(0),
            c.out_el(0),
            sh[sh.len() - 2].to_c(),
            sh[sh.len() - 1].to_c(),
            float_lit(self.fill),
            c.in_ptr(0),
            c.out_ptr(0)
        ))
    }
}
