//! Elementwise ops: broadcasting binary arithmetic, constants and casts
//! (unary math is in unary.rs).

use super::*;
use crate::ir::print::num;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryKind {
    Add,
    Sub,
    Mul,
    Div,
    /// `a` where `b` is not zero, else 0: unlike `a * b`, an infinite or
    /// NaN `a` is dropped (the update clears gradient sums with it after
    /// an fp16 overflow). The update builds it; no model file spells it.
    KeepIf,
}

impl BinaryKind {
    pub fn name(self) -> &'static str {
        match self {
            BinaryKind::Add => "add",
            BinaryKind::Sub => "sub",
            BinaryKind::Mul => "mul",
            BinaryKind::Div => "div",
            BinaryKind::KeepIf => "keep_if",
        }
    }
    /// How the model file writes it, for messages.
    pub fn symbol(self) -> &'static str {
        match self {
            BinaryKind::Add => "+",
            BinaryKind::Sub => "-",
            BinaryKind::Mul => "*",
            BinaryKind::Div => "/",
            BinaryKind::KeepIf => "keep_if",
        }
    }
    pub fn apply(self, a: f64, b: f64) -> f64 {
        match self {
            BinaryKind::Add => a + b,
            BinaryKind::Sub => a - b,
            BinaryKind::Mul => a * b,
            BinaryKind::Div => a / b,
            BinaryKind::KeepIf => {
                if b != 0.0 {
                    a
                } else {
                    0.0
                }
            }
        }
    }
}

/// Broadcasting arithmetic on two tensors of one floating dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct Binary {
    pub kind: BinaryKind,
}

impl OpDef for Binary {
    fn class(&self) -> FusionClass {
        FusionClass::Elementwise
    }
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        let n = self.kind.symbol();
        expect_arity(n, inputs, 2)?;
        expect_float(n, &inputs[0], 0)?;
        expect_float(n, &inputs[1], 1)?;
        expect_same_dtype(n, &inputs[0], &inputs[1])?;
        let shape = broadcast(n, &inputs[0].shape, &inputs[1].shape)?;
        Ok(vec![TensorType::new(inputs[0].dtype, shape)])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![inputs[0].zip(inputs[1], |a, b| self.kind.apply(a, b))]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        outputs: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None, None]);
        };
        let (x, y) = (inputs[0], inputs[1]);
        let (sx, sy) = (b.ty(x).shape, b.ty(y).shape);
        let (gx, gy) = match self.kind {
            BinaryKind::Add => (g, g),
            BinaryKind::Sub => (g, b.neg(g)?),
            BinaryKind::Mul => (b.mul(g, y)?, b.mul(g, x)?),
            BinaryKind::Div => {
                let gx = b.div(g, y)?;
                let t = b.mul(g, outputs[0])?;
                let t = b.div(t, y)?;
                (gx, b.neg(t)?)
            }
            BinaryKind::KeepIf => {
                // Only the kept values' gradient flows; the flag has none.
                let gx = b.binary(BinaryKind::KeepIf, g, y)?;
                return Ok(vec![Some(b.sum_to(gx, &sx)?), None]);
            }
        };
        Ok(vec![Some(b.sum_to(gx, &sx)?), Some(b.sum_to(gy, &sy)?)])
    }
}

/// A scalar constant.
#[derive(Clone, Debug, PartialEq)]
pub struct Constant {
    pub value: f64,
    pub dtype: DType,
}

impl OpDef for Constant {
    fn class(&self) -> FusionClass {
        FusionClass::Scalar
    }
    fn name(&self) -> &'static str {
        "const"
    }
    fn attrs(&self) -> Vec<String> {
        vec![num(self.value)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("const", inputs, 0)?;
        Ok(vec![TensorType::scalar(self.dtype)])
    }
    fn eval(&self, _: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![Tensor::scalar(self.value)]
    }
    fn vjp(
        &self,
        _: &mut Builder,
        _: &[Value],
        _: &[Value],
        _: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        Ok(Vec::new())
    }
}

/// A scalar equal to a (possibly symbolic) dimension, e.g. `B*T` for a mean.
#[derive(Clone, Debug, PartialEq)]
pub struct DimValue {
    pub dim: Dim,
    pub dtype: DType,
}

impl OpDef for DimValue {
    fn class(&self) -> FusionClass {
        FusionClass::Scalar
    }
    fn name(&self) -> &'static str {
        "dim_value"
    }
    fn attrs(&self) -> Vec<String> {
        vec![self.dim.to_string()]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("dim_value", inputs, 0)?;
        Ok(vec![TensorType::scalar(self.dtype)])
    }
    fn eval(&self, _: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        vec![Tensor::scalar((ctx.dim)(&self.dim) as f64)]
    }
    fn vjp(
        &self,
        _: &mut Builder,
        _: &[Value],
        _: &[Value],
        _: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        Ok(Vec::new())
    }
}

/// A dtype conversion (fp32 master weights to bf16 compute copies, and back for gradients).
#[derive(Clone, Debug, PartialEq)]
pub struct Cast {
    pub to: DType,
}

impl OpDef for Cast {
    fn class(&self) -> FusionClass {
        FusionClass::Elementwise
    }
    fn name(&self) -> &'static str {
        "cast"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("to={}", self.to)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("cast", inputs, 1)?;
        Ok(vec![inputs[0].with_dtype(self.to)])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        // Rounding to the target precision is applied by the interpreter to
        // every output according to its dtype.
        vec![inputs[0].clone()]
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
        let from = b.ty(inputs[0]).dtype;
        if !from.is_float() {
            return Ok(vec![None]);
        }
        Ok(vec![Some(b.cast(g, from)?)])
    }
}

/// The global-norm clipping coefficient from the sum of squared gradients:
/// `min(1, max_norm / (sqrt(sumsq) + 1e-6))`, as torch.nn.utils.clip_grad_norm_.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipCoef {
    pub max_norm: f64,
}

impl OpDef for ClipCoef {
    fn name(&self) -> &'static str {
        "clip_coef"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("max_norm={}", num(self.max_norm))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("clip_coef", inputs, 1)?;
        Ok(vec![TensorType::scalar(DType::F32)])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let norm = inputs[0].data[0].sqrt();
        vec![Tensor::scalar((self.max_norm / (norm + 1e-6)).min(1.0))]
    }
}

/// The fp16 update's control scalars from the squared norm of the scaled
/// gradients: (sumsq, loss scale S, apply) -> (gradient multiplier, apply,
/// true norm). The multiplier is the clip coefficient of the true norm
/// sqrt(sumsq) / S, divided by S; a non-finite sumsq (an overflow) turns
/// apply to 0, so the step is skipped and the runtime lowers S.
#[derive(Clone, Debug, PartialEq)]
pub struct Unscale {
    pub max_norm: Option<f64>,
}

impl OpDef for Unscale {
    fn name(&self) -> &'static str {
        "unscale"
    }
    fn attrs(&self) -> Vec<String> {
        match self.max_norm {
            Some(m) => vec![format!("max_norm={}", num(m))],
            None => vec![],
        }
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("unscale", inputs, 3)?;
        let s = TensorType::scalar(DType::F32);
        Ok(vec![s.clone(), s.clone(), s])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (sumsq, scale, apply) = (inputs[0].data[0], inputs[1].data[0], inputs[2].data[0]);
        let norm = sumsq.sqrt() / scale;
        let finite = sumsq.is_finite();
        let coef = match self.max_norm {
            Some(m) if finite => (m / (norm + 1e-6)).min(1.0),
            _ => 1.0,
        };
        vec![
            Tensor::scalar(coef / scale),
            Tensor::scalar(if finite { apply } else { 0.0 }),
            Tensor::scalar(norm),
        ]
    }
}
