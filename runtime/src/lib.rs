//! fusec's runtime: runs compiled training steps on NVIDIA GPUs. CUDA's
//! libraries are loaded at run time, so the crate builds and its non-GPU
//! tests run on machines without them.

pub mod alone;
pub mod batch_log;
pub mod cache;
pub mod ceilings;
pub mod checkpoint;
pub mod data;
pub mod device;
pub mod exec;
pub mod gemm;
pub mod gemm_split;
pub mod gemm_tuning;
pub mod launcher;
pub mod loopback;
pub mod marks;
pub mod name_map;
pub mod nccl;
pub mod nvrtc;
pub mod rendezvous;
pub mod scaler;
pub mod sentences;
pub mod session;
pub mod stage;
pub mod startup;
pub mod tensor_map;

use cudarc::driver::DriverError;

/// Everything that can go wrong running a step; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("no GPU: {0}\n(`fusec build` works without one: it writes the kernels and the plan)")]
    NoGpu(String),
    #[error("CUDA driver error while {what}: {detail}")]
    Driver { what: String, detail: String },
    #[error("{0}")]
    Compile(String),
    #[error(
        "out of memory: the step needs {need_gib:.2} GiB of device memory (the plan's arena) and the GPU has {free_gib:.2} GiB free; give a --memory-budget under that (activations are recomputed to fit), lower --batch or --seq, or use more micro_batches"
    )]
    OutOfMemory { need_gib: f64, free_gib: f64 },
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Gemm(String),
}

impl RuntimeError {
    pub(crate) fn driver(what: &str, e: DriverError) -> RuntimeError {
        RuntimeError::Driver {
            what: what.to_string(),
            detail: format!("{e:?}"),
        }
    }
}
