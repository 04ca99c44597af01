//! The one way a generated kernel is launched: the executor, `fusec
//! bench-attention` and the GPU tests share it, so the argument order every
//! fusec kernel expects and the shared-memory opt-in live in one place.

use crate::device::Gpu;
use crate::tensor_map::{encode_sizes, EncodedMap};
use crate::RuntimeError;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

/// One kernel launch, ready: the function, its geometry and its arguments
/// in the order every fusec kernel takes them (buffers, then the size
/// parameters given at launch, then the scratch where it takes one, then
/// its tensor maps by value). The executor, `fusec bench-attention` and the
/// GPU tests all launch through it.
pub struct KernelCall {
    pub func: CudaFunction,
    pub name: String,
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Buffer addresses: the kernel's inputs, then its outputs.
    pub args: Vec<u64>,
    /// A pointer passed after the sizes (the attention backward's scratch).
    pub extra: Option<u64>,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
    /// Tensor maps passed last, by value.
    pub maps: Vec<EncodedMap>,
}

impl KernelCall {
    /// The call of one planned launch step of `func` on the buffers at
    /// `args` (and the scratch `extra`): its dynamic shared memory allowed
    /// (`without` says what to run where the GPU has too little), its
    /// tensor maps encoded, its grid clamped to the hardware's limits.
    pub fn of_step(
        func: CudaFunction,
        st: &fusec_compiler::plan::LaunchStep,
        args: Vec<u64>,
        extra: Option<u64>,
        gpu: &Gpu,
        without: &str,
    ) -> Result<KernelCall, RuntimeError> {
        let smem = st.dynamic_smem_bytes as u32;
        allow_dynamic_smem(&func, &st.function, smem, gpu, without)?;
        let maps = st
            .tensor_maps
            .iter()
            .map(|m| {
                encode_sizes(
                    &m.name,
                    m.arg,
                    &m.sizes,
                    m.swizzle,
                    &args,
                    &st.function,
                    without,
                )
            })
            .collect::<Result<_, _>>()?;
        let [x, y, z] = st.grid;
        Ok(KernelCall {
            func,
            name: st.function.clone(),
            grid: (
                x.clamp(1, u32::MAX as u64) as u32,
                y.clamp(1, 65535) as u32,
                z.clamp(1, 65535) as u32,
            ),
            block: st.block as u32,
            args,
            extra,
            smem,
            maps,
        })
    }

    /// Launches it on `gpu`'s stream with the size parameters `dims`.
    pub fn launch(&self, gpu: &Gpu, dims: &[i64]) -> Result<(), RuntimeError> {
        let mut b = gpu.stream.launch_builder(&self.func);
        for a in &self.args {
            b.arg(a);
        }
        for d in dims {
            b.arg(d);
        }
        if let Some(x) = &self.extra {
            b.arg(x);
        }
        for m in &self.maps {
            b.arg(m);
        }
        let cfg = LaunchConfig {
            grid_dim: self.grid,
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: self.smem,
        };
        // SAFETY: the arguments match the kernel's signature (inputs,
        // outputs, then every symbolic size, as the emitter writes it, then
        // the scratch where it takes one, then its tensor maps), and the
        // caller's pointers (the maps' too) lie inside live device buffers.
        unsafe { b.launch(cfg) }
            .map_err(|e| RuntimeError::driver(&format!("launching {}", self.name), e))?;
        Ok(())
    }
}

/// Lets `func` launch with `bytes` of dynamic shared memory (over 48 KiB
/// that needs the function's limit raised first), or says that the GPU
/// has too little and what runs without the kernel (`without`).
pub fn allow_dynamic_smem(
    func: &CudaFunction,
    name: &str,
    bytes: u32,
    gpu: &Gpu,
    without: &str,
) -> Result<(), RuntimeError> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    if bytes <= 48 * 1024 {
        return Ok(());
    }
    let limit = gpu
        .ctx
        .attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|e| RuntimeError::driver("reading the shared memory limit", e))?;
    if bytes as i64 > limit as i64 {
        return Err(RuntimeError::Unsupported(format!(
            "kernel {name} needs {bytes} bytes of shared memory per block; {} allows {limit}: run with {without}",
            gpu.name
        )));
    }
    func.set_attribute(
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| RuntimeError::driver(&format!("raising {name}'s shared memory limit"), e))
}
