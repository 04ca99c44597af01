//! The subcommands. Each reads its arguments, calls the compiler library and
//! prints for a person; errors carry the exit status they end with.

mod attn_bench;
pub mod bench;
pub mod build;
mod build_decode;
pub mod check;
mod checkpoints;
mod choices;
mod comm_profile;
mod common;
mod decoding;
pub mod eval;
pub mod explain;
pub mod export;
mod f32_math;
mod feed;
pub mod generate;
pub mod open;
pub mod parallel;
mod profile;
mod samples;
mod schedule;
mod sentences;
pub mod tokenize;
pub mod train;
pub mod train_args;
mod train_loop;
mod train_steps;
pub mod validate;

/// A failure to report: the rendered message and the exit status.
#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub code: u8,
}

impl CliError {
    /// The model file is wrong (exit 1).
    pub fn model(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            code: 1,
        }
    }
    /// The command line or the environment is wrong (exit 2).
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            code: 2,
        }
    }
}
