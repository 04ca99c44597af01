//! Picking a GPU: the driver is loaded at run time, so a machine without one
//! gets a message (and `fusec build` still works there), never a panic.

use crate::RuntimeError;
use cudarc::driver::{CudaContext, CudaStream};
use fusec_compiler::emit::flash::FlashArch;
use std::sync::Arc;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0).
    pub capability: (i32, i32),
    pub total_bytes: u64,
    /// Device memory in use once the context and its stream exist, before
    /// this process allocates anything (other processes' included): what
    /// the step's own memory is measured from.
    pub used_at_open: u64,
    /// Streaming multiprocessors (132 on an H100 SXM, 114 on the PCIe part).
    pub multiprocessors: u32,
}

impl Gpu {
    /// `sm_86`: what NVRTC compiles for (the exact architecture, so the
    /// driver loads a cubin and never JIT-compiles PTX). Hopper (9.0) is
    /// `sm_90a`, whose cubins may use wgmma; they run on sm_90 alone, which
    /// an exact-architecture cubin does anyway.
    pub fn arch(&self) -> String {
        match self.capability {
            (9, 0) => "sm_90a".to_string(),
            (major, minor) => format!("sm_{major}{minor}"),
        }
    }

    /// The tensor-core attention kernels to use: the best family for this
    /// GPU (wgmma on Hopper, mma.sync on sm_80 and newer), `None` before
    /// sm_80. `FUSEC_ATTENTION=simple` turns them off (`None`), and
    /// `FUSEC_ATTENTION=mma` keeps the mma.sync family on Hopper; any other
    /// value is an error (a typo would otherwise run the default silently).
    pub fn flash_arch(&self) -> Result<Option<FlashArch>, RuntimeError> {
        let best = FlashArch::for_capability(self.capability);
        attention_choice(std::env::var("FUSEC_ATTENTION").ok().as_deref(), best)
    }

    pub fn free_bytes(&self) -> Result<u64, RuntimeError> {
        let (free, _) = self
            .ctx
            .mem_get_info()
            .map_err(|e| RuntimeError::driver("querying free memory", e))?;
        Ok(free as u64)
    }
}

/// The attention kernels `FUSEC_ATTENTION` (`value`) asks for, where `best`
/// is the GPU's tensor-core family.
fn attention_choice(
    value: Option<&str>,
    best: Option<FlashArch>,
) -> Result<Option<FlashArch>, RuntimeError> {
    match value {
        None | Some("") => Ok(best),
        Some("simple") => Ok(None),
        Some("mma") => Ok(best.map(|_| FlashArch::Sm80)),
        Some(other) => Err(RuntimeError::Unsupported(format!(
            "FUSEC_ATTENTION={other}: expected `simple` (the simple attention kernels) or `mma` (the mma.sync ones on Hopper); unset it for the default"
        ))),
    }
}

/// A GPU being opened: on a thread of its own from [`Opening::begin`], so
/// that the driver's start (a few hundred milliseconds) overlaps compiling
/// the model, or where it is needed ([`Opening::here`]).
pub struct Opening {
    ordinal: usize,
    started: std::time::Instant,
    thread: Option<std::thread::JoinHandle<Result<Gpu, RuntimeError>>>,
    /// The GPU's name as the driver reports it, sent by the opening
    /// thread before it creates the context (the slow part).
    name: Option<std::sync::mpsc::Receiver<Option<String>>>,
    name_got: Option<Option<String>>,
}

impl Opening {
    /// Starts opening GPU `ordinal` now, in the background, and once it
    /// is open, mapping cuBLASLt's library (its first user would otherwise
    /// wait some 150 ms for it) while the caller plans the step. Mapping it
    /// at once, beside the driver's start, slowed that start by as much.
    pub fn begin(ordinal: usize) -> Opening {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fusec-open-gpu".into())
            .spawn(move || {
                let _ = tx.send(gpu_name(ordinal));
                let gpu = open(ordinal);
                crate::startup::mark("GPU opened (in the background)");
                if gpu.is_ok() {
                    let _ = std::thread::Builder::new()
                        .name("fusec-map-cublaslt".into())
                        .spawn(|| {
                            crate::gemm::preload_library();
                            crate::startup::mark("cuBLASLt mapped (in the background)");
                        });
                }
                gpu
            })
            .ok();
        Opening {
            ordinal,
            started: std::time::Instant::now(),
            name: thread.is_some().then_some(rx),
            thread,
            name_got: None,
        }
    }

    /// Opens GPU `ordinal` when [`Opening::wait`] is called.
    pub fn here(ordinal: usize) -> Opening {
        Opening {
            ordinal,
            started: std::time::Instant::now(),
            thread: None,
            name: None,
            name_got: None,
        }
    }

    /// The GPU's name as its driver reports it ("NVIDIA H100 80GB HBM3"),
    /// without waiting for the whole opening: what the compiler plans for
    /// before the GPU is ready. `None` where there is no such GPU.
    pub fn gpu_name(&mut self) -> Option<String> {
        if self.name_got.is_none() {
            let got = match &self.name {
                Some(rx) => rx.recv().ok().flatten(),
                None => gpu_name(self.ordinal),
            };
            self.name_got = Some(got);
        }
        self.name_got.clone().flatten()
    }

    /// When the opening began (for how long it took).
    pub fn started(&self) -> std::time::Instant {
        self.started
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The open GPU, or why it could not be opened.
    pub fn wait(mut self) -> Result<Gpu, RuntimeError> {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(RuntimeError::NoGpu(format!(
                    "opening GPU {} failed inside the CUDA driver",
                    self.ordinal
                )))
            }),
            None => open(self.ordinal),
        }
    }
}

impl Drop for Opening {
    /// An opening never waited for (the model had an error) still ends
    /// before the process does: leaving the driver mid-start at exit can
    /// hang or crash it instead of printing the error.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only probes the dynamic loader.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// GPU `ordinal`'s name as the driver reports it, without creating a
/// context; `None` without a driver or such a GPU.
pub fn gpu_name(ordinal: usize) -> Option<String> {
    if !driver_present() {
        return None;
    }
    use cudarc::driver::result;
    result::init().ok()?;
    let dev = result::device::get(i32::try_from(ordinal).ok()?).ok()?;
    result::device::get_name(dev).ok()
}

/// GPUs the CUDA driver sees (0 without a driver).
pub fn count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
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
    let multiprocessors = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(|e| RuntimeError::driver("reading the multiprocessor count", e))?
        .max(1) as u32;
    let stream = ctx
        .new_stream()
        .map_err(|e| RuntimeError::driver("creating a stream", e))?;
    let (free, _) = ctx
        .mem_get_info()
        .map_err(|e| RuntimeError::driver("querying free memory", e))?;
    let used_at_open = total_bytes.saturating_sub(free as u64);
    Ok(Gpu {
        ctx,
        stream,
        ordinal,
        name,
        capability,
        total_bytes,
        used_at_open,
        multiprocessors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fusec_attention_picks_the_kernels_or_names_the_typo() {
        let hopper = Some(FlashArch::Sm90a);
        assert_eq!(attention_choice(None, hopper).unwrap(), hopper);
        assert_eq!(attention_choice(Some(""), hopper).unwrap(), hopper);
        assert_eq!(attention_choice(Some("simple"), hopper).unwrap(), None);
        assert_eq!(
            attention_choice(Some("mma"), hopper).unwrap(),
            Some(FlashArch::Sm80)
        );
        // Before sm_80 there are no tensor-core kernels to keep.
        assert_eq!(attention_choice(Some("mma"), None).unwrap(), None);
        let e = attention_choice(Some("simpel"), hopper).unwrap_err();
        assert!(e.to_string().contains("FUSEC_ATTENTION=simpel"), "{e}");
    }
}
