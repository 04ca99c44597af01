//! The inputs a step takes from the runtime rather than from the user's
//! data: their names, which no model file can spell. The update and the
//! dropout ops create them; the runtime sets them before each step.

/// The learning rate.
pub const LR_INPUT: &str = "update.lr";
/// The step number, from 1.
pub const STEP_INPUT: &str = "update.step";
/// The fp16 loss scale: the backward pass starts from it, the update
/// divides it out; present when precision = fp16.
pub const LOSS_SCALE_INPUT: &str = "update.loss_scale";
/// 1 on the micro-batch that ends an optimizer step, 0 on the ones before
/// it (which only accumulate gradients); present when micro_batches > 1.
pub const APPLY_INPUT: &str = "update.apply";
/// The step's dropout key (two i32 words of a Philox key).
pub const DROPOUT_KEY_INPUT: &str = "dropout.key";

/// Whether the runtime sets input `name` itself before each step or
/// micro-batch (the rate, the step count, the loss scale, the dropout key),
/// as opposed to data the user feeds.
pub fn is_step_input(name: &str) -> bool {
    name.starts_with("update.") || name == DROPOUT_KEY_INPUT
}
