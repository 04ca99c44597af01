//! Data parallelism's one op: the mean of a tensor over every rank (each
//! rank a GPU holding a replica of the model and its own slice of the
//! batch). The update phase applies it to each gradient, and to the loss,
//! when the step is built for more than one rank; on the GPU it is an NCCL
//! all-reduce, on the CPU reference it meets the other ranks through
//! `interp::Peers`. Under ZeRO a gradient's mean is needed only by the
//! owners of its pieces (`autodiff::zero`): it is reduced to each owner
//! alone (NCCL reduces rooted at the owners, together a reduce-scatter),
//! and every other element of the result is left undefined. Under ZeRO
//! stage 2 the owner's result is its piece alone (`piece`), a buffer of
//! that size, so the whole gradient is a temporary that dies with the
//! collective.

use super::*;

#[derive(Clone, Debug, PartialEq)]
pub struct AllReduce {
    /// Ranks taking part (the mean divides by it).
    pub ranks: u32,
    /// Run on every micro-batch (the loss, which each one reports), not
    /// only on the one that ends the step (the gradients' sums).
    pub every_micro_batch: bool,
    /// ZeRO: the gradient of parameter `i`, whose mean each rank needs only
    /// on the piece it owns; elsewhere the result is undefined (the CPU
    /// reference fills it with NaN, so that a reader shows).
    pub owners_of: Option<usize>,
    /// ZeRO stage 2: the gradient is the backward pass's temporary (no
    /// rank keeps it whole past this collective); the rank keeps its piece
    /// of the mean (`piece`), all of it where it owns it whole, else none.
    pub sharded: bool,
    /// Stage 2: the result is elements [lo, hi) of the mean alone, flat
    /// (this rank's piece of parameter `owners_of`).
    pub piece: Option<(i64, i64)>,
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
        if let Some(i) = self.owners_of {
            a.push(format!("owners_of={i}"));
        }
        if self.sharded {
            a.push("sharded".into());
        }
        if let Some((lo, hi)) = self.piece {
            a.push(format!("piece={lo}..{hi}"));
        }
        a
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("all_reduce", inputs, 1)?;
        let Some((lo, hi)) = self.piece else {
            return Ok(vec![inputs[0].clone()]);
        };
        let n = inputs[0].numel().as_const();
        if lo < 0 || hi <= lo || n.is_none_or(|n| hi > n) {
            return Err(OpError::new(
                "`all_reduce`'s piece is outside its tensor",
                format!("{lo}..{hi} of {}", inputs[0]),
            ));
        }
        Ok(vec![TensorType::new(
            inputs[0].dtype,
            vec![Dim::constant(hi - lo)],
        )])
    }
    /// Alone (no other ranks to meet): every rank holds what this one does,
    /// so the mean is the tensor itself. The interpreter evaluates the op
    /// with its peers where it has them.
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![self.own(inputs[0].clone())]
    }
}

impl AllReduce {
    /// The result as this rank keeps it: all of `mean`, or its piece.
    pub fn own(&self, mean: Tensor) -> Tensor {
        match self.piece {
            Some((lo, hi)) => Tensor::new(
                vec![(hi - lo) as usize],
                mean.data[lo as usize..hi as usize].to_vec(),
            ),
            None => mean,
        }
    }
}
