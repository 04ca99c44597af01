//! The compile's typed options: what the command line (or a test) asks of
//! one compile. Elaboration reads the model's (`--set`, `--precision`, the
//! ranks); the driver the rest (the passes left out, the kernel stages'
//! options, what to keep for `--dump-after`).

use crate::ir::DType;

#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--set name=value`: replaces a top-level constant.
    pub overrides: Vec<(String, String)>,
    /// `--precision`: replaces the train section's `precision`.
    pub precision: Option<DType>,
    /// Data-parallel ranks the step is built for (`--gpus`): above 1, the
    /// update averages gradients and the loss over them. 0 means 1.
    pub ranks: u32,
    /// ZeRO stage 1: the rank this step is built for, which updates only
    /// the parameters it owns.
    pub zero_rank: Option<u32>,
    /// `--zero 2`: the gradients are split over the ranks too (each
    /// rank's step keeps only its pieces of them).
    pub zero_stage: crate::shard::ZeroStage,
    /// `--shard-within`: ZeRO splits its pieces over groups of this many
    /// consecutive ranks (a host's), each group holding the same pieces as
    /// the others (FSDP's hybrid sharding). 0 means every rank is one group.
    pub shard_group: u32,
    /// `--reduce-dtype`: the type gradients are averaged over the ranks in
    /// (`None`: f32, as they are kept). bf16 halves the bytes a bf16 model's
    /// data-parallel step moves (`TrainConfig::reduce_dtype`).
    pub reduce_dtype: Option<DType>,
    /// `--disable-pass`: graph passes not to run (`fusec passes` lists
    /// them), to see what one changes or to bisect a miscompile.
    pub disabled_passes: Vec<String>,
    /// The optimisations of the kernel stages `--disable-pass` turned off,
    /// and the gradient buckets' size (`--bucket-mib`): what the step is
    /// lowered with (`Target::lower`).
    pub lower: crate::optimisation::LowerOptions,
    /// `--dump-after PASS`: keep the graph as this graph pass leaves it
    /// (`driver::Compiled::dumped`).
    pub dump_after: Option<String>,
    /// `--loss-head-rows`: the logits' rows a chunk of the loss head
    /// (`loss_head::chunk`), applied at the step's sizes to the step and to
    /// each data-parallel rank's.
    pub loss_head_rows: crate::loss_head::Rows,
}

impl Options {
    /// Turns off what `--disable-pass NAME` names: an optimisation of the
    /// kernel stages (typed, into `lower`) or a graph pass (checked against
    /// the pipeline when the model compiles).
    pub fn disable(&mut self, name: &str) {
        match crate::optimisation::Optimisation::from_name(name) {
            Some(o) => {
                self.lower.off.insert(o);
            }
            None => self.disabled_passes.push(name.to_string()),
        }
    }
}
