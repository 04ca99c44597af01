//! Inputs copied while the GPU computes.
//!
//! The data thread writes a batch into page-locked host memory
//! ([`HostBuf::Pinned`]); `Executor::stage` copies it, on a second stream,
//! into a device staging area while the current step runs; the next step's
//! stream copies it from there into the input buffers (device to device,
//! a few microseconds) before its first kernel. The step's CUDA graph
//! holds only kernels, so this works the same with and without it.
//!
//! cudarc's event tracking orders the two streams: the staging copy waits
//! until the previous batch has been read out of the staging area, the step
//! waits for the staging copy, and a pinned buffer is written again only
//! after its copy has finished (`write` waits for it).

use crate::device::Gpu;
use crate::RuntimeError;
use cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};
use std::sync::Arc;

/// Host memory for one batch.
pub enum HostBuf {
    /// Ordinary memory (the CPU backend; copies from it are synchronous).
    Plain(Vec<i32>),
    /// Page-locked memory the GPU copies from asynchronously.
    Pinned(PinnedHostSlice<i32>),
}

impl HostBuf {
    /// The values to write, once any copy still reading them has finished.
    pub fn write(&mut self) -> Result<&mut [i32], RuntimeError> {
        match self {
            HostBuf::Plain(v) => Ok(v),
            HostBuf::Pinned(p) => p
                .as_mut_slice()
                .map_err(|e| RuntimeError::driver("waiting for a copy from pinned memory", e)),
        }
    }

    /// The values, once any copy still reading them has finished.
    pub fn read(&self) -> Result<&[i32], RuntimeError> {
        match self {
            HostBuf::Plain(v) => Ok(v),
            HostBuf::Pinned(p) => p
                .as_slice()
                .map_err(|e| RuntimeError::driver("waiting for a copy from pinned memory", e)),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostBuf::Plain(v) => v.len(),
            HostBuf::Pinned(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `count` page-locked buffers of `len` values each.
pub fn pinned(gpu: &Gpu, count: usize, len: usize) -> Result<Vec<HostBuf>, RuntimeError> {
    (0..count)
        .map(|_| {
            // SAFETY: the memory is uninitialised, and every bit pattern is
            // a valid i32; the data thread writes all of it before a copy.
            // Plain page-locked (not write-combined) memory, so tests can
            // read it back at normal speed.
            unsafe { gpu.ctx.alloc_pinned_with_flags::<i32>(len.max(1), 0) }
                .map(HostBuf::Pinned)
                .map_err(|e| RuntimeError::driver("allocating page-locked host memory", e))
        })
        .collect()
}

/// The second stream and the device staging area.
pub(crate) struct Stager {
    copy: Arc<CudaStream>,
    pub(crate) area: CudaSlice<i32>,
    /// (buffer, first value in the area, values) of each staged input.
    pub(crate) parts: Vec<(usize, usize, usize)>,
    /// Whether a staged batch waits to be copied in by the next step.
    pub(crate) pending: bool,
}

impl Stager {
    pub(crate) fn new(gpu: &Gpu, len: usize) -> Result<Stager, RuntimeError> {
        let copy = gpu
            .ctx
            .new_stream()
            .map_err(|e| RuntimeError::driver("creating the copy stream", e))?;
        let area = copy
            .alloc_zeros::<i32>(len.max(1))
            .map_err(|e| RuntimeError::driver("allocating the input staging area", e))?;
        Ok(Stager {
            copy,
            area,
            parts: Vec::new(),
            pending: false,
        })
    }

    /// Starts the copy of `buf` into the staging area on the copy stream.
    pub(crate) fn upload(&mut self, buf: &HostBuf) -> Result<(), RuntimeError> {
        let err = |e| RuntimeError::driver("copying a batch to the GPU", e);
        let mut dst = self.area.slice_mut(..);
        match buf {
            HostBuf::Plain(v) => self.copy.memcpy_htod(v, &mut dst).map_err(err),
            HostBuf::Pinned(p) => self.copy.memcpy_htod(p, &mut dst).map_err(err),
        }
    }
}
