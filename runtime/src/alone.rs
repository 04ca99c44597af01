//! Kernels run alone, outside a step: compiled from their sources, on
//! buffers of their own, timed with events. What `fusec bench-attention`
//! times the attention kernels with (the plan's launches of a model made
//! of one attention), so that it needs nothing of CUDA's own.

use crate::device::Gpu;
use crate::exec::KernelCall;
use crate::RuntimeError;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr};

/// Bytes on the device, freed when dropped.
pub struct DeviceBuffer(CudaSlice<u8>);

impl DeviceBuffer {
    /// A copy of `bytes` on `gpu`.
    pub fn upload(gpu: &Gpu, bytes: &[u8]) -> Result<DeviceBuffer, RuntimeError> {
        gpu.stream
            .clone_htod(bytes)
            .map(DeviceBuffer)
            .map_err(|e| RuntimeError::driver("allocating a kernel's buffers", e))
    }

    /// Its device address, as a kernel's argument.
    pub fn ptr(&self, gpu: &Gpu) -> u64 {
        self.0.device_ptr(&gpu.stream).0
    }
}

/// Compiles `name`'s `source` for `gpu` (NVRTC, not cached) and finds the
/// function.
pub fn load_function(gpu: &Gpu, name: &str, source: &str) -> Result<CudaFunction, RuntimeError> {
    let cubin = crate::nvrtc::compile(name, source, &gpu.arch())
        .map_err(|e| RuntimeError::Compile(e.to_string()))?;
    let m = gpu
        .ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.image))
        .map_err(|e| RuntimeError::driver("loading a kernel", e))?;
    m.load_function(name)
        .map_err(|e| RuntimeError::driver("finding a kernel", e))
}

/// The median time in ms of `timed` runs of `calls` in order, launched
/// back to back between two events each run, after `warm` untimed runs.
/// The calls take no size parameters (their sizes are constants).
pub fn median_ms(
    gpu: &Gpu,
    calls: &[&KernelCall],
    warm: usize,
    timed: usize,
) -> Result<f64, RuntimeError> {
    use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    let event = || {
        gpu.stream
            .record_event(Some(CU_EVENT_DEFAULT))
            .map_err(|e| RuntimeError::driver("timing", e))
    };
    let mut times = Vec::new();
    for rep in 0..warm + timed.max(1) {
        let e0 = event()?;
        for c in calls {
            c.launch(gpu, &[])?;
        }
        let e1 = event()?;
        let ms = e0
            .elapsed_ms(&e1)
            .map_err(|e| RuntimeError::driver("timing", e))? as f64;
        if rep >= warm {
            times.push(ms);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
