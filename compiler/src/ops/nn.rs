//! Neural-network ops with hand-written gradients: softmax, the norms,
//! embedding lookup, cross-entropy, rotary embedding and causal masking.
//!
//! Long (some 800 lines) because each op is declared whole in one place
//! (shape rule, f64 reference, gradient), as every op is; their kernels
//! are written in emit/lower/nn.rs.

use super::*;
use crate::ir::print::num;

fn last_dim_matches(op: &str, x: &TensorType, w: &TensorType, arg: usize) -> Result<(), OpError> {
    let c = x.shape.last().cloned().unwrap_or(Dim::constant(1));
    if w.shape != [c.clone()] {
        return Err(OpError::new(
            format!("shape mismatch in `{op}`"),
            format!("the weight must be [{c}] to match the last axis of {x}, found {w}"),
        )
        .at(arg));
    }
    Ok(())
}

/// Iterates over the rows of `x` along its last axis.
fn rows(x: &Tensor) -> impl Iterator<Item = &[f64]> {
    let c = x.shape.last().copied().unwrap_or(1).max(1);
    x.data.chunks(c)
}

#[derive(Clone, Debug, PartialEq)]
pub struct Softmax {
    pub axis: usize,
}

fn softmax_along(x: &Tensor, axis: usize) -> Tensor {
    let (outer, n, inner) = x.around(axis);
    let mut out = x.data.clone();
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * n + k) * inner + i;
            let m = (0..n)
                .map(|k| x.data[at(k)])
                .fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = (0..n).map(|k| (x.data[at(k)] - m).exp()).sum();
            for k in 0..n {
                out[at(k)] = (x.data[at(k)] - m).exp() / s;
            }
        }
    }
    Tensor::new(x.shape.clone(), out)
}

impl OpDef for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("axis={}", self.axis)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("softmax", inputs, 1)?;
        expect_float("softmax", &inputs[0], 0)?;
        norm_axis("softmax", self.axis as i64, inputs[0].rank())?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![softmax_along(inputs[0], self.axis)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        _: &[Value],
        outputs: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None]);
        };
        Ok(vec![Some(
            b.op1(SoftmaxGrad { axis: self.axis }, &[outputs[0], g])?,
        )])
    }
}

/// `y * (dy - sum(dy * y))` along the softmax axis.
#[derive(Clone, Debug, PartialEq)]
pub struct SoftmaxGrad {
    pub axis: usize,
}

impl OpDef for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax_grad"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("axis={}", self.axis)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("softmax_grad", inputs, 2)?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (y, dy) = (inputs[0], inputs[1]);
        let (outer, n, inner) = y.around(self.axis);
        let mut out = vec![0.0; y.len()];
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * n + k) * inner + i;
                let dot: f64 = (0..n).map(|k| y.data[at(k)] * dy.data[at(k)]).sum();
                for k in 0..n {
                    out[at(k)] = y.data[at(k)] * (dy.data[at(k)] - dot);
                }
            }
        }
        vec![Tensor::new(y.shape.clone(), out)]
    }
}

/// LayerNorm over the last axis: `(x - mean) / sqrt(var + eps) * g + b`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNorm {
    pub eps: f64,
}

/// f32 [NORM_GROUPS, C] partial sums for a parameter like `p`.
fn partials_type(p: &TensorType) -> TensorType {
    let mut shape = vec![Dim::constant(NORM_GROUPS as i64)];
    shape.extend(p.shape.iter().cloned());
    TensorType::new(DType::F32, shape)
}

/// The parameter gradient from its group partials: their sum, in the
/// parameter's dtype.
fn finish_partials(b: &mut Builder, partials: Value, param: Value) -> Result<Value, OpError> {
    let total = b.sum(partials, vec![0], false)?;
    let dt = b.ty(param).dtype;
    b.cast(total, dt)
}

fn norm_stats(row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl OpDef for LayerNorm {
    fn name(&self) -> &'static str {
        "layernorm"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("eps={}", num(self.eps))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("layernorm", inputs, 3)?;
        expect_float("layernorm", &inputs[0], 0)?;
        expect_rank_at_least("layernorm", &inputs[0], 1, 0)?;
        last_dim_matches("layernorm", &inputs[0], &inputs[1], 1)?;
        last_dim_matches("layernorm", &inputs[0], &inputs[2], 2)?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (g, bias) = (&inputs[1].data, &inputs[2].data);
        let mut out = Vec::with_capacity(inputs[0].len());
        for row in rows(inputs[0]) {
            let (mean, rstd) = norm_stats(row, self.eps);
            out.extend(
                row.iter()
                    .enumerate()
                    .map(|(i, v)| (v - mean) * rstd * g[i] + bias[i]),
            );
        }
        vec![Tensor::new(inputs[0].shape.clone(), out)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(dy) = douts[0] else {
            return Ok(vec![None; 3]);
        };
        let r = b.op(LayerNormGrad { eps: self.eps }, &[inputs[0], inputs[1], dy])?;
        let dg = finish_partials(b, r[1], inputs[1])?;
        let db = finish_partials(b, r[2], inputs[2])?;
        Ok(vec![Some(r[0]), Some(dg), Some(db)])
    }
}

/// Row groups of a norm backward's parameter gradients: each group of
/// consecutive rows gives one f32 partial sum per feature, and a `sum` over
/// the groups finishes them. Many groups keep every SM busy; few keep that
/// final sum short. Deterministic: fixed groups, fixed order.
pub const NORM_GROUPS: usize = 256;

/// The group of each row: `rows` split into NORM_GROUPS runs of
/// ceil(rows / NORM_GROUPS) (the kernel's split).
fn group_of(row: usize, rows: usize) -> usize {
    row / rows.div_ceil(NORM_GROUPS).max(1)
}

/// The whole LayerNorm backward: (x, g, dy) -> (dx, dg partials, db
/// partials), the partials f32 [NORM_GROUPS, C].
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormGrad {
    pub eps: f64,
}

impl OpDef for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layernorm_grad"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("eps={}", num(self.eps))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("layernorm_grad", inputs, 3)?;
        let part = partials_type(&inputs[1]);
        Ok(vec![inputs[0].clone(), part.clone(), part])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (x, g, dy) = (inputs[0], &inputs[1].data, inputs[2]);
        let c = g.len();
        let n = x.len() / c.max(1);
        let mut dx = Vec::with_capacity(x.len());
        let mut dg = vec![0.0; NORM_GROUPS * c];
        let mut db = vec![0.0; NORM_GROUPS * c];
        for (r, (row, dyr)) in rows(x).zip(rows(dy)).enumerate() {
            let at = group_of(r, n) * c;
            let (mean, rstd) = norm_stats(row, self.eps);
            let xhat: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
            let dxhat: Vec<f64> = (0..c).map(|i| dyr[i] * g[i]).collect();
            let m1 = dxhat.iter().sum::<f64>() / c as f64;
            let m2 = dxhat.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / c as f64;
            for i in 0..c {
                dx.push(rstd * (dxhat[i] - m1 - xhat[i] * m2));
                dg[at + i] += dyr[i] * xhat[i];
                db[at + i] += dyr[i];
            }
        }
        vec![
            Tensor::new(x.shape.clone(), dx),
            Tensor::new(vec![NORM_GROUPS, c], dg),
            Tensor::new(vec![NORM_GROUPS, c], db),
        ]
    }
}

/// RMSNorm over the last axis: `x / sqrt(mean(x^2) + eps) * g`.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNorm {
    pub eps: f64,
}

fn rms_r(row: &[f64], eps: f64) -> f64 {
    let ms = row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64;
    1.0 / (ms + eps).sqrt()
}

impl OpDef for RmsNorm {
    fn name(&self) -> &'static str {
        "rmsnorm"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("eps={}", num(self.eps))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("rmsnorm", inputs, 2)?;
        expect_float("rmsnorm", &inputs[0], 0)?;
        expect_rank_at_least("rmsnorm", &inputs[0], 1, 0)?;
        last_dim_matches("rmsnorm", &inputs[0], &inputs[1], 1)?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let g = &inputs[1].data;
        let mut out = Vec::with_capacity(inputs[0].len());
        for row in rows(inputs[0]) {
            let r = rms_r(row, self.eps);
            out.extend(row.iter().enumerate().map(|(i, v)| v * r * g[i]));
        }
        vec![Tensor::new(inputs[0].shape.clone(), out)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(dy) = douts[0] else {
            return Ok(vec![None; 2]);
        };
        let r = b.op(RmsNormGrad { eps: self.eps }, &[inputs[0], inputs[1], dy])?;
        let dg = finish_partials(b, r[1], inputs[1])?;
        Ok(vec![Some(r[0]), Some(dg)])
    }
}

/// The whole RMSNorm backward: (x, g, dy) -> (dx, dg partials f32
/// [NORM_GROUPS, C]).
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormGrad {
    pub eps: f64,
}

impl OpDef for RmsNormGrad {
    fn name(&self) -> &'static str {
        "rmsnorm_grad"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("eps={}", num(self.eps))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("rmsnorm_grad", inputs, 3)?;
        Ok(vec![inputs[0].clone(), partials_type(&inputs[1])])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (x, g, dy) = (inputs[0], &inputs[1].data, inputs[2]);
        let c = g.len();
        let n = x.len() / c.max(1);
        let mut dx = Vec::with_capacity(x.len());
        let mut dg = vec![0.0; NORM_GROUPS * c];
        for (r, (row, dyr)) in rows(x).zip(rows(dy)).enumerate() {
            let at = group_of(r, n) * c;
            let r = rms_r(row, self.eps);
            let dot: f64 = (0..c).map(|i| dyr[i] * g[i] * row[i]).sum();
            for i in 0..c {
                dx.push(dyr[i] * g[i] * r - row[i] * r * r * r * dot / c as f64);
                dg[at + i] += dyr[i] * row[i] * r;
            }
        }
        vec![
            Tensor::new(x.shape.clone(), dx),
            Tensor::new(vec![NORM_GROUPS, c], dg),
        ]
    }
}

/// Row lookup: `table[idx]`, table [V, C], idx i32[...] -> [..., C].
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding;

impl OpDef for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("embedding", inputs, 2)?;
        let (table, idx) = (&inputs[0], &inputs[1]);
        expect_float("embedding", table, 0)?;
        if table.rank() != 2 {
            return Err(OpError::new(
                "`embedding` needs a table of shape [rows, features]",
                format!("found {table}"),
            )
            .at(0));
        }
        expect_int("embedding", idx, 1)?;
        let mut shape = idx.shape.clone();
        shape.push(table.shape[1].clone());
        Ok(vec![TensorType::new(table.dtype, shape)])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let (table, idx) = (inputs[0], inputs[1]);
        let (v, c) = (table.shape[0], table.shape[1]);
        let mut out = Vec::with_capacity(idx.len() * c);
        for &i in &idx.data {
            // An index outside the table gives NaN rather than a panic.
            if i >= 0.0 && (i as usize) < v {
                let r = i as usize;
                out.extend_from_slice(&table.data[r * c..(r + 1) * c]);
            } else {
                out.extend(std::iter::repeat_n(f64::NAN, c));
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
        let Some(dy) = douts[0] else {
            return Ok(vec![None, None]);
        };
        let rows = b.ty(inputs[0]).shape[0].clone();
        Ok(vec![
            Some(b.op1(EmbeddingGrad { rows }, &[inputs[1], dy])?),
            None,
        ])
    }
}

/// Scatter-add of `dy` rows into a [rows, C] gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingGrad {
    pub rows: Dim,
}

impl OpDef for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "embedding_grad"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("rows={}", self.rows)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("embedding_grad", inputs, 2)?;
        let c = inputs[1].shape.last().cloned().unwrap_or(Dim::constant(1));
        Ok(vec![TensorType::new(
            inputs[1].dtype,
            vec![self.rows.clone(), c],
        )])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let (idx, dy) = (inputs[0], inputs[1]);
        let shape = ctx.out_shapes[0].clone();
        let (v, c) = (shape[0], shape[1]);
        let mut out = vec![0.0; v * c];
        for (k, &i) in idx.data.iter().enumerate() {
            if i >= 0.0 && (i as usize) < v {
                let r = i as usize;
                for j in 0..c {
                    out[r * c + j] += dy.data[k * c + j];
                }
            }
        }
        vec![Tensor::new(shape, out)]
    }
}

/// How a cross-entropy counts a row, as PyTorch's `F.cross_entropy`
/// defines it: a row whose target is `ignore_index` has loss 0 and
/// gradient 0 (the `cross_entropy` builtin then divides by the rows that
/// count, not all of them); with `smoothing` e the target distribution is
/// (1 - e) on the target plus e / V on every class.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CeRule {
    pub ignore_index: Option<i64>,
    pub smoothing: f64,
}

impl CeRule {
    /// Whether target `t` (as the interpreter holds it) is ignored.
    fn ignores(&self, t: f64) -> bool {
        self.ignore_index.is_some_and(|i| t == i as f64)
    }
    /// The loss of one row of classes `row` against target `t`.
    fn loss(&self, row: &[f64], t: f64) -> f64 {
        if self.ignores(t) {
            return 0.0;
        }
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        if !(t >= 0.0 && (t as usize) < row.len()) {
            return f64::NAN;
        }
        let e = self.smoothing;
        let mut loss = lse - (1.0 - e) * row[t as usize];
        if e != 0.0 {
            loss -= e * row.iter().sum::<f64>() / row.len() as f64;
        }
        loss
    }
    /// The gradient of one row's loss, times `dl`, pushed onto `out`.
    fn grad(&self, row: &[f64], t: f64, dl: f64, out: &mut Vec<f64>) {
        if self.ignores(t) {
            out.extend(std::iter::repeat_n(0.0, row.len()));
            return;
        }
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        let e = self.smoothing;
        let spread = e / row.len() as f64;
        for (j, v) in row.iter().enumerate() {
            let target = if t >= 0.0 && t as usize == j {
                1.0 - e
            } else {
                0.0
            };
            out.push(((v - m).exp() / s - target - spread) * dl);
        }
    }
    fn attrs(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(i) = self.ignore_index {
            v.push(format!("ignore_index={i}"));
        }
        if self.smoothing != 0.0 {
            v.push(format!("smoothing={}", num(self.smoothing)));
        }
        v
    }
}

/// Cross-entropy of each row of logits [..., V] against i32 targets [...]:
/// f32 losses of the targets' shape (the `cross_entropy` builtin takes their
/// mean). A target outside [0, V) that is not ignored gives NaN.
///
/// `classes`, where set, is V: the logits' rows are longer, padded by the
/// `pad-dims` pass with columns that are not classes; they are left out of
/// the softmax, and the gradient is zero there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CrossEntropy {
    pub classes: Option<i64>,
    pub rule: CeRule,
}

/// The attribute line of a cross-entropy op.
fn ce_attrs(classes: Option<i64>, rule: &CeRule) -> Vec<String> {
    classes
        .map(|c| format!("classes={c}"))
        .into_iter()
        .chain(rule.attrs())
        .collect()
}

/// A row's classes: all of it, or the first `classes` where the row is
/// padded (the cross-entropy's and greedy decoding's `argmax`).
pub(super) fn classes_of(row: &[f64], classes: Option<i64>) -> &[f64] {
    match classes {
        Some(c) => &row[..(c.max(0) as usize).min(row.len())],
        None => row,
    }
}

fn check_ce(op: &str, logits: &TensorType, targets: &TensorType) -> Result<(), OpError> {
    expect_float(op, logits, 0)?;
    expect_rank_at_least(op, logits, 1, 0)?;
    expect_int(op, targets, 1)?;
    if targets.shape[..] != logits.shape[..logits.rank() - 1] {
        return Err(OpError::new(
            format!("shape mismatch in `{op}`"),
            format!(
                "logits {} need targets {}, found {}",
                logits,
                shape_string(&logits.shape[..logits.rank() - 1]),
                targets
            ),
        )
        .at(1));
    }
    Ok(())
}

impl OpDef for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }
    fn attrs(&self) -> Vec<String> {
        ce_attrs(self.classes, &self.rule)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("cross_entropy", inputs, 2)?;
        check_ce("cross_entropy", &inputs[0], &inputs[1])?;
        Ok(vec![TensorType::new(DType::F32, inputs[1].shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (logits, targets) = (inputs[0], inputs[1]);
        let losses = rows(logits)
            .zip(&targets.data)
            .map(|(row, &t)| self.rule.loss(classes_of(row, self.classes), t))
            .collect();
        vec![Tensor::new(targets.shape.clone(), losses)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(dl) = douts[0] else {
            return Ok(vec![None, None]);
        };
        Ok(vec![
            Some(b.op1(
                CrossEntropyGrad {
                    classes: self.classes,
                    rule: self.rule,
                },
                &[inputs[0], inputs[1], dl],
            )?),
            None,
        ])
    }
}

/// `(softmax(logits) - target distribution) * dloss[row]`, never storing
/// the probabilities.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CrossEntropyGrad {
    pub classes: Option<i64>,
    pub rule: CeRule,
}

impl OpDef for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "cross_entropy_grad"
    }
    fn attrs(&self) -> Vec<String> {
        ce_attrs(self.classes, &self.rule)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("cross_entropy_grad", inputs, 3)?;
        check_ce("cross_entropy_grad", &inputs[0], &inputs[1])?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (logits, targets, dl) = (inputs[0], inputs[1], inputs[2]);
        let mut out = Vec::with_capacity(logits.len());
        for ((full, &t), &dl) in rows(logits).zip(&targets.data).zip(&dl.data) {
            let row = classes_of(full, self.classes);
            self.rule.grad(row, t, dl, &mut out);
            // Padded columns are no class: their gradient is zero.
            out.extend(std::iter::repeat_n(0.0, full.len() - row.len()));
        }
        vec![Tensor::new(logits.shape.clone(), out)]
    }
}

/// Cross-entropy and its gradient in one pass over the logits, after
/// autodiff (the `fuse-cross-entropy` pass): (logits, targets, dloss per
/// row) -> (dlogits, loss per row). The logits are read once; the
/// probabilities are never stored.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CrossEntropyWithGrad {
    pub classes: Option<i64>,
    pub rule: CeRule,
}

impl OpDef for CrossEntropyWithGrad {
    fn name(&self) -> &'static str {
        "cross_entropy_with_grad"
    }
    fn attrs(&self) -> Vec<String> {
        ce_attrs(self.classes, &self.rule)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("cross_entropy_with_grad", inputs, 3)?;
        check_ce("cross_entropy_with_grad", &inputs[0], &inputs[1])?;
        Ok(vec![
            inputs[0].clone(),
            TensorType::new(DType::F32, inputs[1].shape.clone()),
        ])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let (classes, rule) = (self.classes, self.rule);
        let grad = CrossEntropyGrad { classes, rule }.eval(inputs, ctx);
        let loss = CrossEntropy { classes, rule }.eval(&inputs[..2], ctx);
        vec![grad[0].clone(), loss[0].clone()]
    }
}

/// 1 where a target counts, 0 where it is `ignore_index` (f32, the
/// targets' shape): what a cross-entropy with ignored targets divides its
/// summed losses by, summed.
#[derive(Clone, Debug, PartialEq)]
pub struct Counted {
    pub ignore_index: i64,
}

impl OpDef for Counted {
    fn name(&self) -> &'static str {
        "counted"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("ignore_index={}", self.ignore_index)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("counted", inputs, 1)?;
        expect_int("counted", &inputs[0], 0)?;
        Ok(vec![TensorType::new(DType::F32, inputs[0].shape.clone())])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let t = inputs[0];
        let ignored = self.ignore_index as f64;
        let data = t
            .data
            .iter()
            .map(|&x| if x == ignored { 0.0 } else { 1.0 })
            .collect();
        vec![Tensor::new(t.shape.clone(), data)]
    }
    fn vjp(
        &self,
        _: &mut Builder,
        _: &[Value],
        _: &[Value],
        _: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        // Integer targets take no gradient.
        Ok(vec![None])
    }
}

/// Rotary position embedding on x [..., T, H, D], positions 0..T along axis -3,
/// rotating the pairs (i, i + D/2) as LLaMA's reference code does. `inverse`
/// rotates the other way (the gradient). With `positions`, input 1 (i32
/// [T]) holds each row's position instead (a decode step's rows, which
/// start where the cache ends).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub inverse: bool,
    pub positions: bool,
}

impl OpDef for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }
    fn attrs(&self) -> Vec<String> {
        let mut v = vec![format!("theta={}", num(self.theta))];
        if self.inverse {
            v.push("inverse".into());
        }
        if self.positions {
            v.push("positions".into());
        }
        v
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("rope", inputs, 1 + self.positions as usize)?;
        let x = &inputs[0];
        expect_float("rope", x, 0)?;
        if x.rank() < 3 {
            return Err(OpError::new(
                "`rope` needs heads laid out as [..., T, H, D]",
                format!("found {x}"),
            )
            .at(0));
        }
        let d = &x.shape[x.rank() - 1];
        if d.as_const().is_none_or(|d| d % 2 != 0) {
            return Err(OpError::new(
                "`rope` needs an even head dimension",
                format!("found D = {d} in {x}"),
            )
            .at(0));
        }
        if self.positions {
            let p = &inputs[1];
            expect_int("rope", p, 1)?;
            if p.rank() != 1 || p.shape[0] != x.shape[x.rank() - 3] {
                return Err(OpError::new(
                    "`rope` needs one position a row",
                    format!("found {p} for {x}"),
                )
                .at(1));
            }
        }
        Ok(vec![x.clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let x = inputs[0];
        let positions = self.positions.then(|| inputs[1]);
        let r = x.shape.len();
        let (t, h, d) = (x.shape[r - 3], x.shape[r - 2], x.shape[r - 1]);
        let half = d / 2;
        let sign = if self.inverse { -1.0 } else { 1.0 };
        let mut out = x.data.clone();
        for (k, chunk) in out.chunks_mut(d).enumerate() {
            let row = (k / h) % t;
            let pos = positions.map_or(row as f64, |p| p.data[row]);
            let src = &x.data[k * d..(k + 1) * d];
            for i in 0..half {
                let freq = self.theta.powf(-2.0 * i as f64 / d as f64);
                let (s, c) = (pos * freq).sin_cos();
                let s = s * sign;
                chunk[i] = src[i] * c - src[i + half] * s;
                chunk[i + half] = src[i] * s + src[i + half] * c;
            }
        }
        vec![Tensor::new(x.shape.clone(), out)]
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
        if self.positions {
            return Err(OpError::new(
                "`rope` with given positions has no gradient rule",
                "it runs in decode steps only",
            ));
        }
        let inv = Rope {
            theta: self.theta,
            inverse: !self.inverse,
            positions: false,
        };
        Ok(vec![Some(b.op1(inv, &[g])?)])
    }
}

/// Sets the entries above the diagonal of the last two axes ([..., T, S],
/// key j > query i) to `fill`: -inf for scores, 0 for their gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct CausalMask {
    pub fill: f64,
}

impl OpDef for CausalMask {
    fn name(&self) -> &'static str {
        "causal_mask"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("fill={}", num(self.fill))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("causal_mask", inputs, 1)?;
        expect_float("causal_mask", &inputs[0], 0)?;
        expect_rank_at_least("causal_mask", &inputs[0], 2, 0)?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let x = inputs[0];
        let r = x.shape.len();
        let (t, s) = (x.shape[r - 2], x.shape[r - 1]);
        let mut out = x.data.clone();
        for (k, v) in out.iter_mut().enumerate() {
            let (i, j) = ((k / s) % t, k % s);
            if j > i {
                *v = self.fill;
            }
        }
        vec![Tensor::new(x.shape.clone(), out)]
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
        Ok(vec![Some(b.op1(CausalMask { fill: 0.0 }, &[g])?)])
    }
}
