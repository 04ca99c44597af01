//! Data parallelism's one op: the mean of a tensor over every rank (each
//! rank a GPU holding a replica of the model and its own slice of the
//! batch). The update phase applies it to each gradient, and to the loss,
//! when the step is built for more than one rank; on the GPU it is an NCCL
//! all-reduce, on the CPU reference it meets the other ranks through
//! `interp::Peers`.

use super::*;

#[derive(Clone, Debug, PartialEq)]
pub struct AllReduce {
    /// Ranks taking part (the mean divides by it).
    pub ranks: u32,
    /// Run on every micro-batch (the loss, which each one reports), not
    /// only on the one that ends the step (the gradients' sums).
    pub every_micro_batch: bool,
}

impl OpDef for AllReduce {
    fn name(&self) -> &'static str {
        "all_reduce"
    }
    fn attrs(&self) -> Vec<String> {
        let mut a = vec!["op=mean".into(), format!("ranks={}", self.ranks)];
        if self.every_micro_batch {
            a.push("every_micro_batch".into());
        }
        a
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("all_reduce", inputs, 1)?;
        Ok(vec![inputs[0].clone()])
    }
    /// Alone (no other ranks to meet): every rank holds what this one does,
    /// so the mean is the tensor itself. The interpreter evaluates the op
    /// with its peers where it has them.
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![inputs[0].clone()]
    }
}

/// A collective (NCCL), launched on the communication stream.
impl Lower for AllReduce {}
