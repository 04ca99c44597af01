//! The step the compiler hands the runtime: the memory plan and what runs
//! each launch, the CUDA sources to compile, the parameters with their
//! gradients' buffers, the target it was built for and its FLOPs. The
//! runtime reads this alone (never the graph or the kernel program), so a
//! step can be compiled in one place and run in another.

use super::Plan;
use crate::shard::{self, Piece};
use crate::target::Target;

/// A parameter of the step, as the runtime addresses it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepParam {
    pub name: String,
    /// Elements (every dimension bound).
    pub numel: u64,
    /// The buffer the step leaves its gradient in (before clipping, scaled
    /// by the fp16 loss scale where there is one); `None` where this rank
    /// keeps none (ZeRO ranks that do not own it).
    pub grad: Option<usize>,
}

/// One compiled training (or forward) step.
#[derive(Clone, Debug)]
pub struct CompiledStep {
    pub plan: Plan,
    /// Every kernel to compile: (function name, CUDA source).
    pub sources: Vec<(String, String)>,
    /// In the model's order (the order ZeRO's pieces follow).
    pub params: Vec<StepParam>,
    pub target: Target,
    /// FLOPs of one step, as the roofline counts them.
    pub flops: f64,
}

/// How ZeRO splits a step's parameters over `ranks` (each parameter's
/// pieces, in rank order).
pub fn pieces(params: &[StepParam], ranks: u32) -> Vec<Vec<Piece>> {
    let numels: Vec<u64> = params.iter().map(|p| p.numel).collect();
    shard::pieces(&numels, ranks)
}
