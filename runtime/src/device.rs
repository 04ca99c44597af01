//! Picking a GPU: the driver is loaded at run time, so a machine without one
//! gets a message (and `fusec build` still works there), never a panic.

use crate::RuntimeError;
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::Arc;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0).
    pub capability: (i32, i32),
    pub total_bytes: u64,
}

impl Gpu {
    /// `sm_90`: what NVRTC compiles for (the exact architecture, so the
    /// driver loads a cubin and never JIT-compiles PTX).
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.capability.0, self.capability.1)
    }

    pub fn free_bytes(&self) -> Result<u64, RuntimeError> {
        let (free, _) = self
            .ctx
            .mem_get_info()
            .map_err(|e| RuntimeError::driver("querying free memory", e))?;
        Ok(free as u64)
    }
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only probes the dynamic loader.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Opens GPU `ordinal` with one stream for everything.
pub fn open(ordinal: usize) -> Result<Gpu, RuntimeError> {
    if !driver_present() {
        return Err(RuntimeError::NoGpu(
            "the CUDA driver (libcuda.so) is not installed or not on the loader path".into(),
        ));
    }
    let count = CudaContext::device_count().map_err(|e| {
        RuntimeError::NoGpu(format!("the CUDA driver reports no usable GPU ({e:?})"))
    })?;
    if count <= 0 {
        return Err(RuntimeError::NoGpu("the CUDA driver sees no GPU".into()));
    }
    if ordinal >= count as usize {
        return Err(RuntimeError::NoGpu(format!(
            "there is no GPU {ordinal}; this machine has {count} (0..{})",
            count - 1
        )));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| RuntimeError::NoGpu(format!("cannot open GPU {ordinal}: {e:?}")))?;
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let capability = ctx
        .compute_capability()
        .map_err(|e| RuntimeError::driver("reading the compute capability", e))?;
    let total_bytes =
        ctx.total_mem()
            .map_err(|e| RuntimeError::driver("reading the memory size", e))? as u64;
    let stream = ctx
        .new_stream()
        .map_err(|e| RuntimeError::driver("creating a stream", e))?;
    Ok(Gpu {
        ctx,
        stream,
        ordinal,
        name,
        capability,
        total_bytes,
    })
}
