//! Matrix multiplication, batched with numpy broadcasting of leading axes.

use super::*;
use crate::tensor::matmul;

#[derive(Clone, Debug, PartialEq)]
pub struct MatMul;

impl OpDef for MatMul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("@", inputs, 2)?;
        let (a, b) = (&inputs[0], &inputs[1]);
        expect_float("@", a, 0)?;
        expect_float("@", b, 1)?;
        expect_same_dtype("@", a, b)?;
        for (i, t) in [a, b].into_iter().enumerate() {
            if t.rank() < 2 {
                return Err(OpError::new(
                    "`@` needs matrices (rank 2 or more)",
                    format!("found {t}"),
                )
                .at(i)
                .help("reshape a vector to [1, n] or [n, 1] first"));
            }
        }
        let (ra, rb) = (a.rank(), b.rank());
        if a.shape[ra - 1] != b.shape[rb - 2] {
            return Err(OpError::new(
                "shape mismatch in `@`",
                format!(
                    "{} @ {}: inner dimensions {} and {} differ",
                    shape_string(&a.shape),
                    shape_string(&b.shape),
                    a.shape[ra - 1],
                    b.shape[rb - 2]
                ),
            )
            .help("`a @ b` contracts the last axis of a with the second-to-last axis of b"));
        }
        let mut shape = broadcast("@", &a.shape[..ra - 2], &b.shape[..rb - 2])?;
        shape.push(a.shape[ra - 2].clone());
        shape.push(b.shape[rb - 1].clone());
        Ok(vec![TensorType::new(a.dtype, shape)])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![matmul(inputs[0], inputs[1])]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(g) = douts[0] else {
            return Ok(vec![None, None]);
        };
        let (x, w) = (inputs[0], inputs[1]);
        let (sx, sw) = (b.ty(x).shape, b.ty(w).shape);
        let wt = b.transpose_last2(w)?;
        let dx = b.matmul(g, wt)?;
        let xt = b.transpose_last2(x)?;
        let dw = b.matmul(xt, g)?;
        Ok(vec![Some(b.sum_to(dx, &sx)?), Some(b.sum_to(dw, &sw)?)])
    }
}
