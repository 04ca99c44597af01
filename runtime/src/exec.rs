//! One training step on the GPU, as the plan lays it out: one arena, every
//! buffer at its planned offset, the kernels launched in plan order (the
//! generated ones from their cubins, GEMMs through cuBLASLt with their
//! epilogues).

use crate::device::Gpu;
use crate::gemm::{EpiloguePtrs, Gemm, GemmShape};
use crate::nccl;
use crate::stage::Stager;
use cudarc::driver::CudaSlice;
use fusec_compiler::dtype::DType;

mod arena;
mod capture;
mod codec;
mod data_parallel;
mod gather;
mod kernel_call;
mod launch;
mod load;
mod profile;
pub use codec::{decode, encode, encode_filled};
pub use data_parallel::{CollectiveTime, DataParallel, Join, StepProfile};
pub use kernel_call::{allow_dynamic_smem, KernelCall};
use std::collections::HashMap;

enum Step {
    Kernel(KernelCall),
    /// Several kernels doing one op, in order (the tensor-core attention
    /// backward's three).
    Sequence(Vec<Step>),
    Gemm {
        spec: GemmShape,
        a: u64,
        b: u64,
        d: u64,
        ep: EpiloguePtrs,
        /// f32 operands split for three TF32 products into this scratch
        /// (address, f32 elements) first.
        split: Option<(u64, u64)>,
    },
    /// A bucket averaged over the ranks, on the communication stream (see
    /// `DataParallel`).
    Collective(Bucket),
}

/// A bucket's collective as the executor issues it.
pub(crate) struct Bucket {
    /// Tensors averaged onto every rank.
    pub all: Vec<nccl::Tensor>,
    /// Runs on every micro-batch (the loss; stage 2's gradients), not only
    /// on the one that updates.
    pub every_micro_batch: bool,
    /// ZeRO: gradients whose mean goes to their pieces' owners alone, each
    /// with its parameter.
    pub owned: Vec<(nccl::Tensor, usize)>,
    /// ZeRO stage 2: for each of `owned`, the elements [lo, hi) this rank
    /// keeps, its output a buffer of that piece alone (`None`: in place,
    /// where it owns the parameter whole or nothing of it); empty at
    /// stage 1.
    pub kept: Vec<Option<(u64, u64)>>,
    /// ZeRO stage 3: a parameter gathered whole from its owners' pieces
    /// (then `all`, `owned` and `kept` are empty).
    pub gather: Option<Gather>,
}

/// ZeRO stage 3's gather of a parameter, as the executor issues it: this
/// rank's piece at `input`, the whole at `output`, every rank's elements
/// [lo, hi) of it (`nccl::gather_calls`).
pub(crate) struct Gather {
    pub input: u64,
    pub output: u64,
    pub dtype: DType,
    pub pieces: Vec<(u64, u64)>,
    /// The launch that first reads it (the plan's join).
    pub join: usize,
}

struct Launch {
    name: String,
    step: Step,
}

/// A buffer of the plan as the executor sees it.
#[derive(Clone, Debug)]
pub struct Slot {
    pub offset: u64,
    /// Bytes in the arena (padded rows included).
    pub bytes: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Elements between rows where the rows are padded (kernel::pitch).
    pub pitch: Option<usize>,
}

impl Slot {
    /// Bytes of the values alone, rows packed: what `read` returns and
    /// `write` takes.
    pub fn packed_bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size_bytes() as u64
    }

    /// (row bytes, pitch bytes) of a padded buffer.
    fn rows(&self) -> Option<(usize, usize)> {
        let size = self.dtype.size_bytes();
        let last = *self.shape.last()?;
        self.pitch.map(|p| (last * size, p * size))
    }
}

/// When one launch of a profiled step ran (`Executor::profile_step`).
#[derive(Clone, Debug)]
pub struct LaunchTime {
    pub name: String,
    /// Milliseconds after the step's first event.
    pub start_ms: f64,
    pub ms: f64,
}

pub struct Executor {
    pub gpu: Gpu,
    arena: CudaSlice<u8>,
    base: u64,
    launches: Vec<Launch>,
    gemm: Option<Gemm>,
    dims: Vec<i64>,
    pub slots: Vec<Slot>,
    /// Buffers of named sources: inputs, parameters, optimizer state.
    pub inputs: HashMap<String, usize>,
    pub params: HashMap<String, usize>,
    pub state: HashMap<String, usize>,
    pub loss: Option<usize>,
    pub grad_norm: Option<usize>,
    /// The logits a decode step outputs.
    pub logits: Option<usize>,
    /// The per-token losses a scoring step outputs.
    pub token_losses: Option<usize>,
    /// The greedy picks a greedy decode step outputs.
    pub next_tokens: Option<usize>,
    pub arena_bytes: u64,
    /// The whole step captured once and replayed (see `capture`): with
    /// the collectives (index 1) and without (index 0, the micro-batches
    /// that only accumulate).
    graphs: [Option<cudarc::driver::CudaGraph>; 2],
    /// Whether each of those two forms has run launch by launch yet.
    ran: [bool; 2],
    /// Whether this step runs its collectives (see `set_collectives`).
    collectives_on: bool,
    /// What the compute stream waits for before each launch (and at the
    /// step's end, one past the last): the buckets, the gathers.
    joins: Vec<Join>,
    /// The communicator, for a step built for several ranks.
    dp: Option<DataParallel>,
    /// Inputs copied in on a second stream (see `stage`).
    stager: Option<Stager>,
    /// NVTX ranges to mark each launch with (a profiler is attached).
    marks: Option<crate::marks::StepMarks>,
    /// Whether anything has been written into the arena since it was
    /// allocated (zeros) or cleared: what `Session::warm_up` must not lose.
    written: bool,
}

impl Executor {
    /// Lets f32 GEMMs compute on TF32 tensor cores (before the first step:
    /// the plans are made then).
    pub fn allow_tf32(&mut self, on: bool) {
        if let Some(g) = self.gemm.as_mut() {
            g.allow_tf32 = on;
        }
    }

    /// How the GEMMs' cuBLASLt algorithms are chosen (before the first
    /// step: they are chosen then).
    pub fn tune_gemms(&mut self, tuning: crate::gemm_tuning::Tuning) {
        if let Some(g) = self.gemm.as_mut() {
            g.tuning = tuning;
        }
    }

    /// How the algorithms of the GEMMs run so far were chosen; `None` for
    /// a step without GEMMs.
    pub fn gemm_tuning_stats(&self) -> Option<crate::gemm_tuning::TuningStats> {
        self.gemm.as_ref().map(|g| g.tuning_stats())
    }

    pub fn kernel_count(&self) -> usize {
        self.launches.len()
    }

    pub fn kernel_name(&self, i: usize) -> &str {
        &self.launches[i].name
    }

    /// The buffer address and elements of every named parameter.
    pub fn param_tensors(&self) -> Vec<(String, nccl::Tensor)> {
        self.params
            .iter()
            .map(|(name, &b)| {
                let s = &self.slots[b];
                let at = self.base + s.offset;
                (
                    name.clone(),
                    nccl::Tensor {
                        input: at,
                        output: at,
                        count: (s.bytes / s.dtype.size_bytes() as u64) as usize,
                        dtype: s.dtype,
                    },
                )
            })
            .collect()
    }

    /// Joins a communicator: the step's collectives run through it.
    pub fn attach(&mut self, dp: DataParallel) {
        self.dp = Some(dp);
    }

    /// Whether the step has collectives to run (it was built for several ranks).
    pub fn has_collectives(&self) -> bool {
        self.launches
            .iter()
            .any(|l| matches!(l.step, Step::Collective(..)))
    }

    /// Whether the step gathers its weights from the ranks' pieces (ZeRO
    /// stage 3): its update writes this rank's pieces, all it keeps, so
    /// nothing is sent after it.
    pub fn gathers_weights(&self) -> bool {
        self.launches
            .iter()
            .any(|l| matches!(&l.step, Step::Collective(b) if b.gather.is_some()))
    }

    /// Whether the next steps run their collectives: off for micro-batches
    /// that only accumulate (no communication until the one that updates).
    pub fn set_collectives(&mut self, on: bool) {
        self.collectives_on = on;
    }
}
