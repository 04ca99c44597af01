//! Dropout: each element kept with probability 1 - p and scaled by
//! 1 / (1 - p), or zeroed, by a mask drawn from Philox (`philox.rs`, and
//! `kernels/random/philox.cuh` on the GPU) keyed by the step's key (an i32
//! [2] input the runtime sets before each micro-batch) and counted by the
//! element's index and the op's `site`. The mask is never stored: the
//! gradient is the same op applied to the output's gradient (same key, same
//! site, same indices, so the same mask), and a forward op copied into the
//! backward pass by recomputation draws it again.

use super::philox;
use super::*;
use crate::ir::print::num;

pub use crate::inputs::DROPOUT_KEY_INPUT as KEY_INPUT;

/// `dropout(x, p)`: inputs (x, key). Each call in a model file is its own
/// `site`, so two dropouts of the same tensor draw independent masks.
#[derive(Clone, Debug, PartialEq)]
pub struct Dropout {
    pub p: f64,
    pub site: u32,
}

impl Dropout {
    /// Draws below this are dropped (p of 2^32).
    pub fn threshold(&self) -> u32 {
        philox::threshold(self.p)
    }
    /// What a kept element is multiplied by.
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - self.p)
    }
}

/// The key input's type: two 32-bit words, as i32.
pub fn key_type() -> TensorType {
    TensorType::new(DType::I32, vec![Dim::constant(2)])
}

/// That input `arg` of op `op` is the step's key.
pub(super) fn check_key(op: &str, key: &TensorType, arg: usize) -> Result<(), OpError> {
    if *key != key_type() {
        return Err(OpError::new(
            format!("`{op}` draws its mask from the step's key"),
            format!("expected {} as its key, found {key}", key_type()),
        )
        .at(arg));
    }
    Ok(())
}

/// The key's two words as the generator takes them.
pub(super) fn key_words(key: &Tensor) -> [u32; 2] {
    [key.data[0] as i32 as u32, key.data[1] as i32 as u32]
}

impl OpDef for Dropout {
    /// Elementwise: dropout fuses into the chain of the ops around it (the
    /// residual add after it, the scale before it), where each element
    /// draws its word of the Philox block (`kernels/random/philox.cuh`) in
    /// the kernel's registers. A vectorised pointwise kernel draws one block
    /// for every four elements it holds (`emit::cuda`). As a kernel of its
    /// own it cost a read and a write of the tensor: on an H200 the
    /// translator's step with dropout 0.1 took 21% longer than without.
    fn class(&self) -> FusionClass {
        FusionClass::Elementwise
    }
    fn name(&self) -> &'static str {
        "dropout"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("p={}", num(self.p)), format!("site={}", self.site)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("dropout", inputs, 2)?;
        expect_float("dropout", &inputs[0], 0)?;
        check_key("dropout", &inputs[1], 1)?;
        if !(0.0..1.0).contains(&self.p) {
            return Err(OpError::new(
                "`dropout` needs a probability from 0 up to (not including) 1",
                format!("found p = {}", num(self.p)),
            ));
        }
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (x, key) = (inputs[0], inputs[1]);
        let key = key_words(key);
        let (t, scale) = (self.threshold(), self.scale());
        let data = x
            .data
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                if philox::keeps(key, self.site, i as u64, t) {
                    v * scale
                } else {
                    0.0
                }
            })
            .collect();
        vec![Tensor::new(x.shape.clone(), data)]
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
        // The same mask and scale on the gradient: dx = dy * mask / (1 - p).
        Ok(vec![Some(b.op1(self.clone(), &[g, inputs[1]])?), None])
    }
}
