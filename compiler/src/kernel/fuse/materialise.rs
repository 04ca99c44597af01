//! How a kernel reads a value that is not stored as it is read: through a
//! view of its base's buffer (reshapes, permutes, slices, broadcasts), as a
//! scalar folded into the expression, or, where neither can say it, from
//! a copy or fill kernel run first. Apart because every kernel builder
//! (chains, op kernels, GEMM epilogues, norm prologues) reads its inputs
//! through these same rules.

use super::*;

impl Fuser<'_> {
    /// The buffer an op kernel reads for `x`: a stored value, or a view of
    /// one copied out by a small pointwise kernel.
    pub(super) fn materialise(&mut self, x: Value, kernels: &mut Vec<Kernel>) -> usize {
        if let Some(&b) = self.buffer_of.get(&x) {
            return b;
        }
        if self.scalar_expr(x).is_some() && self.class(x.node) == FusionClass::Scalar {
            return self.materialise_scalar(x, kernels);
        }
        // A view of a scalar no kernel stores (a constant broadcast to a
        // shape: the loss's seed, a key bias's zero gradient): one fill of
        // the whole tensor, not a one-element fill and a copy of it.
        let (base, _) = self.base(x);
        if base != x
            && self.class(base.node) == FusionClass::Scalar
            && !self.buffer_of.contains_key(&base)
        {
            if let Some(e) = self.scalar_expr(base) {
                return self.fill(x, e, kernels);
            }
        }
        let shape = self.g.ty(x).shape.clone();
        let (src, view) = if let Some(view) = self.flat_view(x, &shape) {
            // A reshape of a strided view, copied in one pass: element i of
            // the reshape is element i of its input's view.
            let (base, _) = self.base(x);
            let src = match self.buffer_of.get(&base) {
                Some(&b) => b,
                None => self.materialise_scalar(base, kernels),
            };
            (src, view)
        } else if self.needs_copy(x) {
            // Anything else no view says: copy the inner view out first,
            // then the reshape reads it contiguously.
            let inner = self.g.inputs(x.node)[0];
            let src = self.materialise(inner, kernels);
            let v = View::contiguous(&self.g.ty(inner).shape);
            let v = v.apply(&self.g.g[x.node].op).unwrap_or(v);
            (src, v)
        } else {
            let (base, _) = self.base(x);
            let src = match self.buffer_of.get(&base) {
                Some(&b) => b,
                None => self.materialise_scalar(base, kernels),
            };
            (src, self.view_of(x))
        };
        let out = self.store(x, BufKind::Temp);
        let n = self.g.ty(x).numel();
        kernels.push(Kernel {
            name: format!("k{}_copy", kernels.len()),
            nodes: vec![x.node],
            inputs: vec![src],
            outputs: vec![out],
            input_views: Vec::new(),
            residual: None,
            prologue: None,
            body: Body::Pointwise(Pointwise {
                n,
                exprs: vec![PExpr::Load { input: 0, view }],
                stores: vec![(0, 0)],
                sum: None,
            }),
        });
        out
    }

    /// How `x` reads its base value's buffer, when a view can say it.
    fn try_view(&self, x: Value) -> Option<View> {
        let (base, chain) = self.base(x);
        chain
            .iter()
            .try_fold(View::contiguous(&self.g.ty(base).shape), |v, &n| {
                v.apply(&self.g.g[n].op)
            })
    }

    /// How `x` reads its base value's buffer (callers first check
    /// `needs_copy`).
    pub(super) fn view_of(&self, x: Value) -> View {
        self.try_view(x)
            .unwrap_or_else(|| View::contiguous(&self.g.ty(x).shape))
    }

    /// A view chain a load cannot express (a reshape of a permuted view).
    pub(super) fn needs_copy(&self, x: Value) -> bool {
        self.try_view(x).is_none()
    }

    /// Where no view of `x` exists because it reshapes a strided view, a
    /// pointwise kernel of `x`'s shape can still read it in place: a
    /// reshape keeps the row-major order, so element `i` of `x` is element
    /// `i` of the reshape's input, which a load reads through the input's
    /// own view (its shape unravels `i`). `None` where `x` has a view, or
    /// is read broadcast.
    pub(super) fn flat_view(&self, x: Value, out_shape: &[Dim]) -> Option<View> {
        if !self.needs_copy(x) || self.g.ty(x).shape != out_shape {
            return None;
        }
        let mut v = x;
        while matches!(self.g.g[v.node].op, Op::Reshape(_)) {
            v = self.g.inputs(v.node)[0];
            if let Some(view) = self.try_view(v) {
                return Some(view);
            }
        }
        None
    }

    pub(super) fn scalar_expr(&self, x: Value) -> Option<PExpr> {
        let (b, _) = self.base(x);
        match &self.g.g[b.node].op {
            Op::Constant(c) => Some(PExpr::Const(c.value)),
            Op::DimValue(d) => Some(PExpr::Dim(d.dim.clone())),
            _ => None,
        }
    }

    pub(super) fn materialise_scalar(&mut self, x: Value, kernels: &mut Vec<Kernel>) -> usize {
        let e = self.scalar_expr(x).expect("a scalar");
        self.fill(x, e, kernels)
    }

    /// A kernel storing `e` into every element of `x`.
    fn fill(&mut self, x: Value, e: PExpr, kernels: &mut Vec<Kernel>) -> usize {
        let out = self.store(x, BufKind::Temp);
        kernels.push(Kernel {
            name: format!("k{}_fill", kernels.len()),
            nodes: vec![x.node],
            inputs: vec![],
            outputs: vec![out],
            input_views: Vec::new(),
            residual: None,
            prologue: None,
            body: Body::Pointwise(Pointwise {
                n: self.g.ty(x).numel(),
                exprs: vec![e],
                stores: vec![(0, 0)],
                sum: None,
            }),
        });
        out
    }
}
