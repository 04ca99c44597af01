//! Ops that move data without arithmetic (reshape, permute, slice, concat,
//! broadcast) and the sum/mean reductions.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Mean,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Reduce {
    pub kind: ReduceKind,
    /// Sorted, distinct, non-negative.
    pub axes: Vec<usize>,
    pub keepdim: bool,
}

impl Reduce {
    fn reduced_shape(&self, shape: &[Dim], keep: bool) -> Vec<Dim> {
        let mut out = Vec::new();
        for (i, d) in shape.iter().enumerate() {
            if self.axes.contains(&i) {
                if keep {
                    out.push(Dim::constant(1));
                }
            } else {
                out.push(d.clone());
            }
        }
        out
    }
}

impl OpDef for Reduce {
    fn name(&self) -> &'static str {
        match self.kind {
            ReduceKind::Sum => "sum",
            ReduceKind::Mean => "mean",
        }
    }
    fn attrs(&self) -> Vec<String> {
        let axes: Vec<String> = self.axes.iter().map(|a| a.to_string()).collect();
        let mut v = vec![format!("axes=[{}]", axes.join(","))];
        if self.keepdim {
            v.push("keepdim".into());
        }
        v
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity(self.name(), inputs, 1)?;
        expect_float(self.name(), &inputs[0], 0)?;
        for &a in &self.axes {
            norm_axis(self.name(), a as i64, inputs[0].rank())?;
        }
        Ok(vec![inputs[0].with_shape(
            self.reduced_shape(&inputs[0].shape, self.keepdim),
        )])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let x = inputs[0];
        let kept: Vec<usize> = x
            .shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if self.axes.contains(&i) { 1 } else { d })
            .collect();
        let mut t = x.sum_to(&kept);
        if self.kind == ReduceKind::Mean {
            let n = (x.len() / t.len().max(1)) as f64;
            t = t.map(|v| v / n);
        }
        let shape: Vec<usize> = x
            .shape
            .iter()
            .enumerate()
            .filter(|(i, _)| self.keepdim || !self.axes.contains(i))
            .map(|(i, &d)| if self.axes.contains(&i) { 1 } else { d })
            .collect();
        vec![Tensor::new(shape, t.data)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None]);
        };
        let xt = b.ty(inputs[0]);
        let kept = self.reduced_shape(&xt.shape, true);
        let g = b.reshape(g, kept)?;
        let mut g = b.broadcast_to(g, xt.shape.clone())?;
        if self.kind == ReduceKind::Mean {
            let count = self
                .axes
                .iter()
                .try_fold(Dim::constant(1), |acc, &a| acc.checked_mul(&xt.shape[a]))
                .ok_or_else(|| OpError::new("dimension overflow", "mean"))?;
            let n = b.op1(
                DimValue {
                    dim: count,
                    dtype: xt.dtype,
                },
                &[],
            )?;
            g = b.div(g, n)?;
        }
        Ok(vec![Some(g)])
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Reshape {
    pub shape: Vec<Dim>,
}

impl OpDef for Reshape {
    fn class(&self) -> FusionClass {
        FusionClass::View
    }
    fn name(&self) -> &'static str {
        "reshape"
    }
    fn attrs(&self) -> Vec<String> {
        vec![shape_string(&self.shape)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("reshape", inputs, 1)?;
        let out = inputs[0].with_shape(self.shape.clone());
        if out.numel() != inputs[0].numel() {
            return Err(OpError::new(
                "reshape changes the number of elements",
                format!(
                    "{} has {} elements, {} has {}",
                    shape_string(&inputs[0].shape),
                    inputs[0].numel(),
                    shape_string(&self.shape),
                    out.numel()
                ),
            ));
        }
        Ok(vec![out])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        vec![Tensor::new(
            ctx.out_shapes[0].clone(),
            inputs[0].data.clone(),
        )]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None]);
        };
        let s = b.ty(inputs[0]).shape;
        Ok(vec![Some(b.reshape(g, s)?)])
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Permute {
    pub perm: Vec<usize>,
}

impl OpDef for Permute {
    fn class(&self) -> FusionClass {
        FusionClass::View
    }
    fn name(&self) -> &'static str {
        "permute"
    }
    fn attrs(&self) -> Vec<String> {
        let p: Vec<String> = self.perm.iter().map(|a| a.to_string()).collect();
        vec![format!("[{}]", p.join(","))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("permute", inputs, 1)?;
        let r = inputs[0].rank();
        let mut seen = vec![false; r];
        let ok = self.perm.len() == r
            && self
                .perm
                .iter()
                .all(|&p| p < r && !std::mem::replace(&mut seen[p], true));
        if !ok {
            return Err(OpError::new(
                "invalid permutation",
                format!(
                    "{:?} is not a permutation of the {r} axes of {}",
                    self.perm, inputs[0]
                ),
            ));
        }
        let shape = self
            .perm
            .iter()
            .map(|&p| inputs[0].shape[p].clone())
            .collect();
        Ok(vec![inputs[0].with_shape(shape)])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![inputs[0].permute(&self.perm)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        _: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None]);
        };
        let mut inv = vec![0; self.perm.len()];
        for (i, &p) in self.perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(vec![Some(b.permute(g, inv)?)])
    }
}

/// `x[start:end]` along one axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub axis: usize,
    pub start: Dim,
    pub end: Dim,
}

impl OpDef for Slice {
    fn class(&self) -> FusionClass {
        FusionClass::View
    }
    fn name(&self) -> &'static str {
        "slice"
    }
    fn attrs(&self) -> Vec<String> {
        vec![
            format!("axis={}", self.axis),
            format!("{}:{}", self.start, self.end),
        ]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("slice", inputs, 1)?;
        let t = &inputs[0];
        if self.axis >= t.rank() {
            return Err(OpError::new(
                "too many indices",
                format!("{t} has {} axes", t.rank()),
            ));
        }
        let size = &t.shape[self.axis];
        let len = self
            .end
            .checked_sub(&self.start)
            .ok_or_else(|| OpError::new("dimension overflow", "slice"))?;
        let past_end = size
            .checked_sub(&self.end)
            .and_then(|d| d.as_const())
            .is_some_and(|d| d < 0);
        let negative_start = self.start.as_const().is_some_and(|s| s < 0);
        if len.as_const().is_some_and(|l| l <= 0) || past_end || negative_start {
            return Err(OpError::new(
                "slice out of range",
                format!("{}:{} on an axis of size {size}", self.start, self.end),
            ));
        }
        let mut shape = t.shape.clone();
        shape[self.axis] = len;
        Ok(vec![t.with_shape(shape)])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let x = inputs[0];
        let (outer, n, inner) = x.around(self.axis);
        let s = (ctx.dim)(&self.start);
        let e = (ctx.dim)(&self.end);
        let mut out = Vec::with_capacity(outer * (e - s) * inner);
        for o in 0..outer {
            out.extend_from_slice(&x.data[(o * n + s) * inner..(o * n + e) * inner]);
        }
        vec![Tensor::new(ctx.out_shapes[0].clone(), out)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None]);
        };
        let full = b.ty(inputs[0]).shape[self.axis].clone();
        let op = SliceGrad {
            axis: self.axis,
            start: self.start.clone(),
            full,
        };
        Ok(vec![Some(b.op1(op, &[g])?)])
    }
}

/// The gradient of a slice: places `dy` at `start` along `axis` in zeros of size `full`.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceGrad {
    pub axis: usize,
    pub start: Dim,
    pub full: Dim,
}

impl OpDef for SliceGrad {
    fn name(&self) -> &'static str {
        "slice_grad"
    }
    fn attrs(&self) -> Vec<String> {
        vec![
            format!("axis={}", self.axis),
            format!("at={}", self.start),
            format!("full={}", self.full),
        ]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("slice_grad", inputs, 1)?;
        if self.axis >= inputs[0].rank() {
            return Err(OpError::new(
                "axis out of range in `slice_grad`",
                format!("axis {} for {}", self.axis, inputs[0]),
            ));
        }
        let mut shape = inputs[0].shape.clone();
        shape[self.axis] = self.full.clone();
        Ok(vec![inputs[0].with_shape(shape)])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let g = inputs[0];
        let (outer, n, inner) = g.around(self.axis);
        let full = (ctx.dim)(&self.full);
        let s = (ctx.dim)(&self.start);
        let mut out = vec![0.0; outer * full * inner];
        for o in 0..outer {
            let src = &g.data[o * n * inner..(o + 1) * n * inner];
            out[(o * full + s) * inner..(o * full + s + n) * inner].copy_from_slice(src);
        }
        vec![Tensor::new(ctx.out_shapes[0].clone(), out)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None]);
        };
        // The input's extent along the axis, not the padded output's.
        let end = self
            .start
            .checked_add(&b.ty(inputs[0]).shape[self.axis])
            .unwrap_or_else(|| self.full.clone());
        let op = Slice {
            axis: self.axis,
            start: self.start.clone(),
            end,
        };
        Ok(vec![Some(b.op1(op, &[g])?)])
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Concat {
    pub axis: usize,
}

impl OpDef for Concat {
    fn name(&self) -> &'static str {
        "concat"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("axis={}", self.axis)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        if inputs.is_empty() {
            return Err(OpError::new(
                "`concat` needs at least one tensor",
                "found none",
            ));
        }
        let first = &inputs[0];
        if self.axis >= first.rank() {
            return Err(OpError::new(
                "axis out of range in `concat`",
                format!("axis {} for {first}", self.axis),
            ));
        }
        let mut total = Dim::constant(0);
        for (i, t) in inputs.iter().enumerate() {
            expect_same_dtype("concat", first, t).map_err(|e| e.at(i))?;
            let same_rest = t.rank() == first.rank()
                && (0..t.rank()).all(|a| a == self.axis || t.shape[a] == first.shape[a]);
            if !same_rest {
                return Err(OpError::new(
                    "shape mismatch in `concat`",
                    format!("{first} and {t} differ outside axis {}", self.axis),
                )
                .at(i));
            }
            total = total
                .checked_add(&t.shape[self.axis])
                .ok_or_else(|| OpError::new("dimension overflow", "concat"))?;
        }
        let mut shape = first.shape.clone();
        shape[self.axis] = total;
        Ok(vec![first.with_shape(shape)])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let (outer, _, inner) = inputs[0].around(self.axis);
        let mut out = Vec::new();
        for o in 0..outer {
            for t in inputs {
                let n = t.shape[self.axis];
                out.extend_from_slice(&t.data[o * n * inner..(o + 1) * n * inner]);
            }
        }
        vec![Tensor::new(ctx.out_shapes[0].clone(), out)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None; inputs.len()]);
        };
        let mut start = Dim::constant(0);
        let mut grads = Vec::new();
        for &x in inputs {
            let end = start
                .checked_add(&b.ty(x).shape[self.axis])
                .ok_or_else(|| OpError::new("dimension overflow", "concat"))?;
            let s = Slice {
                axis: self.axis,
                start: start.clone(),
                end: end.clone(),
            };
            grads.push(Some(b.op1(s, &[g])?));
            start = end;
        }
        Ok(grads)
    }
}

/// numpy's broadcast_to.
#[derive(Clone, Debug, PartialEq)]
pub struct Broadcast {
    pub shape: Vec<Dim>,
}

impl OpDef for Broadcast {
    fn class(&self) -> FusionClass {
        FusionClass::View
    }
    fn name(&self) -> &'static str {
        "broadcast"
    }
    fn attrs(&self) -> Vec<String> {
        vec![shape_string(&self.shape)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("broadcast", inputs, 1)?;
        let out = broadcast("broadcast", &inputs[0].shape, &self.shape)?;
        if out != self.shape {
            return Err(OpError::new(
                "cannot broadcast",
                format!(
                    "{} to {}",
                    shape_string(&inputs[0].shape),
                    shape_string(&self.shape)
                ),
            ));
        }
        Ok(vec![inputs[0].with_shape(out)])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        vec![inputs[0].broadcast_to(&ctx.out_shapes[0])]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None]);
        };
        let s = b.ty(inputs[0]).shape;
        Ok(vec![Some(b.sum_to(g, &s)?)])
    }
}
