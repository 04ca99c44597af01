//! The GEMM epilogues and the norm backward's residual add: elementwise
//! work after a product (bias, residual, GELU with its pre-activation, the
//! GELU backward) that cuBLASLt does as it stores the product, and the
//! residual stream's gradient a norm backward adds as it stores dx, so
//! neither makes a round trip through memory.

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

    pub(super) fn gemm_kernel(&mut self, n: NodeIndex, kernels: &mut Vec<Kernel>) {
        let fold = self.gemm_fold(n).expect("checked by the caller");
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
        };
        let mut nodes = vec![n];
        for &c in &fold.chains {
            nodes.extend(self.chains[c].iter().copied());
            self.absorbed.insert(c);
        }
        let outs = fold
            .outs
            .iter()
            .map(|&v| self.store(v, BufKind::Temp))
            .collect();
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
