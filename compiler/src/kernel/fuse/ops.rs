//! Kernels of a single op (every op that fuses with no chain) and how an
//! op kernel reads its inputs. Apart from the chain kernels because these
//! run an op's own body rather than pointwise expressions, and the GEMM
//! epilogues and norm prologues read their inputs the same way
//! (`op_input`).

use super::*;

impl Fuser<'_> {
    /// A kernel of op `n` alone (with a norm backward's residual add, and
    /// widening casts of its results stored as it stores them).
    pub(super) fn op_kernel(&mut self, n: NodeIndex, kernels: &mut Vec<Kernel>) {
        let mut ins = Vec::new();
        let mut views = Vec::new();
        for x in self.g.inputs(n) {
            let (b, v) = self.op_input(x, n, kernels);
            ins.push(b);
            views.push(v);
        }
        let mut nodes = vec![n];
        // A norm backward's dx plus the residual stream's gradient.
        let residual = self.residual_add(n);
        let outs: Vec<usize> = (0..self.g.g[n].outputs.len())
            .map(|port| {
                let v = Value { node: n, port };
                if let (0, Some((add, _))) = (port, residual) {
                    nodes.push(add);
                    return self.store(Value { node: add, port: 0 }, BufKind::Temp);
                }
                match self.cast_into.get(&v) {
                    Some(&c) => {
                        nodes.push(c);
                        self.store(Value { node: c, port: 0 }, BufKind::Temp)
                    }
                    None => self.store(v, BufKind::Temp),
                }
            })
            .collect();
        let mut residual_slot = None;
        if let Some((add, other)) = residual {
            self.absorbed.insert(self.group[&add]);
            ins.push(self.buffer_of[&self.base(other).0]);
            views.push(None);
            residual_slot = Some(ins.len() - 1);
        }
        kernels.push(Kernel {
            name: kernel_name(self.g, kernels.len(), &nodes),
            nodes,
            inputs: ins,
            outputs: outs,
            input_views: views,
            residual: residual_slot,
            prologue: None,
            body: Body::Op(n),
        });
    }

    /// How an op kernel reads `x`: a reshape of a stored buffer is the
    /// buffer itself (same elements, same order); a GEMM reads a transposed
    /// matrix in place; anything else is copied out first.
    pub(super) fn op_input(
        &mut self,
        x: Value,
        n: NodeIndex,
        kernels: &mut Vec<Kernel>,
    ) -> (usize, Option<View>) {
        if let Some(&b) = self.buffer_of.get(&x) {
            return (b, None);
        }
        let (base, _) = self.base(x);
        if self.class(base.node) != FusionClass::Scalar && !self.needs_copy(x) {
            if let Some(&b) = self.buffer_of.get(&base) {
                let view = self.view_of(x);
                if view.is_contiguous() {
                    return (b, None);
                }
                if matches!(self.g.g[n].op, Op::MatMul(_)) && is_transposed_matrix(&view) {
                    return (b, Some(view));
                }
                // Attention reads q, k, v, o and dO with any strides: heads
                // straight out of the fused QKV projection, no copies.
                // So do a decode step's cache writes and cached attention.
                if matches!(
                    self.g.g[n].op,
                    Op::Attention(_)
                        | Op::AttentionGrad(_)
                        | Op::KvWrite(_)
                        | Op::CachedAttention(_)
                ) && view.strides.last().is_some_and(|s| s.is_one())
                {
                    return (b, Some(view));
                }
            }
        }
        (self.materialise(x, kernels), None)
    }
}

/// A view that is a row-major buffer with its last two axes swapped: what a
/// GEMM reads as a transposed operand.
fn is_transposed_matrix(v: &View) -> bool {
    let r = v.shape.len();
    if r < 2 {
        return false;
    }
    let mut t = v.clone();
    t.shape.swap(r - 2, r - 1);
    t.strides.swap(r - 2, r - 1);
    t.is_contiguous()
}
