//! The GEMM epilogues and the norm backward's residual add: elementwise
//! work after a product (bias, residual, GELU with its pre-activation, the
//! GELU backward) that cuBLASLt does as it stores the product, the bias
//! gradient it sums as it reads a weight gradient's operand, and the
//! residual stream's gradient a norm backward adds as it stores dx, so
//! none makes a round trip through memory.

use super::*;

/// Pointwise chains a GEMM performs as it stores its product, as values.
pub(super) struct Fold {
    pub(super) bias: Option<Value>,
    pub(super) residual: Option<Value>,
    pub(super) gelu: bool,
    pub(super) dgelu: Option<Value>,
    pub(super) chains: Vec<usize>,
    /// Values the GEMM kernel stores, in output-slot order.
    pub(super) outs: Vec<Value>,
}

impl Fuser<'_> {
    /// `x` is a stored tensor of exactly `shape`, read as laid out.
    fn stored_as(&self, x: Value, shape: &[crate::ir::Dim]) -> bool {
        let (base, _) = self.base(x);
        self.buffer_of.contains_key(&base)
            && self.class(base.node) != FusionClass::Scalar
            && !self.needs_copy(x)
            && self.view_of(x).is_contiguous()
            && self.g.ty(x).shape == shape
    }

    /// `x` is a stored vector of the last size of `shape`, broadcast over
    /// the other axes: a bias.
    fn is_bias(&self, x: Value, shape: &[crate::ir::Dim]) -> bool {
        let (base, _) = self.base(x);
        if !self.buffer_of.contains_key(&base)
            || self.class(base.node) == FusionClass::Scalar
            || self.needs_copy(x)
            || self.g.ty(base).rank() != 1
            || self.g.ty(base).shape.last() != shape.last()
        {
            return false;
        }
        let v = self.view_of(x).expand_to(shape);
        let r = v.strides.len();
        v.offset.as_const() == Some(0)
            && v.strides[r - 1].is_one()
            && v.strides[..r - 1].iter().all(|s| s.as_const() == Some(0))
    }

    /// `dx + r` after a norm backward `n`, when that add is a chain of its
    /// own, dx's only reader, and `r` a stored tensor of dx's shape and
    /// type: (the add, r).
    pub(super) fn residual_add(&self, n: NodeIndex) -> Option<(NodeIndex, Value)> {
        if !matches!(self.g.g[n].op, Op::LayerNormGrad(_) | Op::RmsNormGrad(_))
            || !self.opts.on(Optimisation::NormResidual)
        {
            return None;
        }
        let dx = Value { node: n, port: 0 };
        let users = self.g.users(dx);
        if self.outputs.contains(&dx) || users.len() != 1 {
            return None;
        }
        let u = users[0].0;
        let is_add = matches!(&self.g.g[u].op, Op::Binary(b) if b.kind == BinaryKind::Add);
        if !is_add
            || self.class(u) != FusionClass::Elementwise
            || self.chains[*self.group.get(&u)?] != [u]
        {
            return None;
        }
        let ins = self.g.inputs(u);
        let other = match (ins[0] == dx, ins[1] == dx) {
            (true, false) => ins[1],
            (false, true) => ins[0],
            _ => return None,
        };
        let t = self.g.ty(dx);
        (self.g.ty(other) == t
            && self.g.ty(Value { node: u, port: 0 }) == t
            && self.stored_as(other, &t.shape))
        .then_some((u, other))
    }

    /// The chains after matmul `n` that cuBLASLt can apply as it stores the
    /// product: `+ bias`, `+ residual`, `gelu` (keeping the pre-activation),
    /// or the GELU backward `gelu'(pre) * product`.
    pub(super) fn gemm_fold(&self, n: NodeIndex) -> Option<Fold> {
        if !self.opts.on(Optimisation::GemmEpilogues) {
            return None;
        }
        let y = Value { node: n, port: 0 };
        let yt = self.g.ty(y);
        let users = self.g.users(y);
        if self.outputs.contains(&y) || users.len() != 1 {
            return None;
        }
        let u = users[0].0;
        if self.class(u) != FusionClass::Elementwise || self.absorbed_cast(u).is_some() {
            return None;
        }
        let ci = self.group[&u];
        let chain = &self.chains[ci];
        if chain[0] != u {
            return None;
        }
        let same_type = |v: Value| self.g.ty(v) == yt;
        let ins = self.g.inputs(u);
        // cuBLASLt's GELU epilogues store the pre-activation with a leading
        // dimension that must be a multiple of 8.
        let aux_ok = yt
            .shape
            .last()
            .and_then(|d| d.as_const())
            .is_some_and(|n| n % 8 == 0);
        if let Op::UnaryGrad(ug) = &self.g.g[u].op {
            let ok = ug.kind == UnaryKind::Gelu
                && aux_ok
                && chain.len() == 1
                && ins[1] == y
                && ins[0] != y
                && same_type(ins[0])
                && self.stored_as(ins[0], &yt.shape);
            return ok.then(|| Fold {
                bias: None,
                residual: None,
                gelu: false,
                dgelu: Some(ins[0]),
                chains: vec![ci],
                outs: vec![Value { node: u, port: 0 }],
            });
        }
        let (mut bias, mut residual, mut prev) = (None, None, y);
        for (i, &a) in chain.iter().enumerate() {
            match &self.g.g[a].op {
                Op::Binary(b) if b.kind == BinaryKind::Add => {}
                // GELU ending the chain of the biased product (its input
                // read by nothing else, as in a forward-only step or where
                // the pre-activation is recomputed): the GELU epilogue,
                // its pre-activation stored beside it and left unread.
                Op::Unary(un)
                    if un.kind == UnaryKind::Gelu
                        && i + 1 == chain.len()
                        && i > 0
                        && bias.is_some()
                        && residual.is_none()
                        && aux_ok
                        && self.g.inputs(a)[0] == prev
                        && same_type(Value { node: a, port: 0 }) =>
                {
                    return Some(Fold {
                        bias,
                        residual,
                        gelu: true,
                        dgelu: None,
                        chains: vec![ci],
                        outs: vec![Value { node: a, port: 0 }, prev],
                    });
                }
                _ => return None,
            }
            let ins = self.g.inputs(a);
            let other = match (ins[0] == prev, ins[1] == prev) {
                (true, false) => ins[1],
                (false, true) => ins[0],
                _ => return None,
            };
            let a_out = Value { node: a, port: 0 };
            if !same_type(a_out) || self.g.ty(other).dtype != yt.dtype {
                return None;
            }
            if bias.is_none() && self.is_bias(other, &yt.shape) {
                bias = Some(other);
            } else if residual.is_none() && same_type(other) && self.stored_as(other, &yt.shape) {
                residual = Some(other);
            } else {
                return None;
            }
            prev = a_out;
        }
        let mut fold = Fold {
            bias,
            residual,
            gelu: false,
            dgelu: None,
            chains: vec![ci],
            outs: vec![prev],
        };
        // GELU of the biased product, stored beside its input.
        if residual.is_none() && aux_ok {
            for (v, _) in self.g.users(prev) {
                let is_gelu =
                    matches!(&self.g.g[v].op, Op::Unary(un) if un.kind == UnaryKind::Gelu);
                if is_gelu
                    && self.class(v) == FusionClass::Elementwise
                    && self.chains[self.group[&v]] == [v]
                {
                    fold.gelu = true;
                    fold.chains.push(self.group[&v]);
                    fold.outs.insert(0, Value { node: v, port: 0 });
                    break;
                }
            }
        }
        Some(fold)
    }

    /// The stored value of `v`: the widening cast that its producer stores
    /// in its place, or `v`.
    fn stored_value(&self, v: Value) -> Value {
        self.cast_into
            .get(&v)
            .map_or(v, |&c| Value { node: c, port: 0 })
    }

    /// The product that can add up sum `r` as it reads its operand: a
    /// later matmul whose `[k, n]` operand (its input 1, read as stored)
    /// holds exactly the elements `r` sums over its leading axes, as in a
    /// weight gradient `x^T @ dy` and its bias's gradient `sum(dy)`. Only
    /// for 16-bit operands (the 3xTF32 f32 products read split copies), a
    /// sum stored in the product's own type (cuBLASLt's default bias
    /// type) and read only after the product. Asked when `r`'s turn comes:
    /// a chain kernel that made the operand has summed it already where it
    /// could (`chain_sum`, for free as it stored it). The product takes
    /// the sum only if it has no other epilogue (`gemm_kernel`).
    pub(super) fn gemm_for_sum(&self, r: NodeIndex) -> Option<NodeIndex> {
        if !self.opts.on(Optimisation::GemmEpilogues)
            || !self.opts.on(Optimisation::SumsIntoGemms)
            || self.summed.contains(&r)
        {
            return None;
        }
        let (cols, false) = crate::kernel::forms::leading_sum(self.g, r)? else {
            return None;
        };
        let x = *self.g.inputs(r).first()?;
        let sum = Value { node: r, port: 0 };
        let stored = self.stored_value(sum);
        let reshapes_only = |views: &[NodeIndex]| {
            views
                .iter()
                .all(|&u| matches!(self.g.g[u].op, Op::Reshape(_)))
        };
        let (base, views) = self.base(x);
        if !reshapes_only(&views)
            || self.outputs.contains(&sum)
            || matches!(
                self.class(base.node),
                FusionClass::Scalar | FusionClass::Source
            )
        {
            return None;
        }
        // The sum's readers, but for the widening cast stored in its place.
        let readers: Vec<NodeIndex> = self
            .readers(sum)
            .into_iter()
            .chain(self.readers(stored))
            .filter(|&u| Value { node: u, port: 0 } != stored)
            .collect();
        let sixteen = |v: Value| matches!(self.g.ty(v).dtype, DType::BF16 | DType::F16);
        self.readers(base).into_iter().find(|&m| {
            if !matches!(self.g.g[m].op, Op::MatMul(_))
                || self.position[&m] <= self.position[&r]
                || self.pending_sums.contains_key(&m)
            {
                return false;
            }
            let ins = self.g.inputs(m);
            let (a, b) = (ins[0], ins[1]);
            let (bb, bv) = self.base(b);
            let d = self.stored_value(Value { node: m, port: 0 });
            bb == base
                && reshapes_only(&bv)
                && self.g.ty(a).rank() == 2
                && self.g.ty(b).rank() == 2
                && sixteen(a)
                && sixteen(b)
                && self.g.ty(b).shape[1].as_const() == Some(cols)
                && self.g.ty(b).numel() == self.g.ty(x).numel()
                && self.g.ty(stored).dtype == self.g.ty(d).dtype
                && readers.iter().all(|u| self.position[u] > self.position[&m])
        })
    }

    /// The kernel of matmul `n`, with the epilogue `gemm_fold` finds and,
    /// where it finds none, the sum `bias_grad` of its operand
    /// (`gemm_for_sum`).
    pub(super) fn gemm_kernel(
        &mut self,
        n: NodeIndex,
        bias_grad: Option<NodeIndex>,
        kernels: &mut Vec<Kernel>,
    ) {
        let y = Value { node: n, port: 0 };
        // A product whose only fold is the sum of its operand: stored as
        // an op kernel stores it (a widening cast included).
        let fold = self.gemm_fold(n).unwrap_or_else(|| Fold {
            bias: None,
            residual: None,
            gelu: false,
            dgelu: None,
            chains: Vec::new(),
            outs: vec![self.stored_value(y)],
        });
        let mut ins = Vec::new();
        let mut views = Vec::new();
        for x in self.g.inputs(n) {
            let (b, v) = self.op_input(x, n, kernels);
            ins.push(b);
            views.push(v);
        }
        let mut slot = |x: Option<Value>, this: &Self| {
            x.map(|x| {
                ins.push(this.buffer_of[&this.base(x).0]);
                ins.len() - 1
            })
        };
        let epilogue = Epilogue {
            bias: slot(fold.bias, self),
            residual: slot(fold.residual, self),
            gelu: fold.gelu,
            dgelu: slot(fold.dgelu, self),
            bias_grad: bias_grad.is_some(),
        };
        let mut nodes = vec![n];
        if let Some(&c) = self.cast_into.get(&y) {
            nodes.push(c);
        }
        for &c in &fold.chains {
            nodes.extend(self.chains[c].iter().copied());
            self.absorbed.insert(c);
        }
        let mut outs: Vec<usize> = fold
            .outs
            .iter()
            .map(|&v| self.store(v, BufKind::Temp))
            .collect();
        if let Some(s) = bias_grad {
            let sum = Value { node: s, port: 0 };
            nodes.push(s);
            if let Some(&c) = self.cast_into.get(&sum) {
                nodes.push(c);
            }
            outs.push(self.store(self.stored_value(sum), BufKind::Temp));
        }
        kernels.push(Kernel {
            name: kernel_name(self.g, kernels.len(), &nodes),
            nodes,
            inputs: ins,
            outputs: outs,
            input_views: views,
            residual: None,
            prologue: None,
            body: Body::Gemm(n, epilogue),
        });
    }
}
