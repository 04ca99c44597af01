//! The Hopper attention kernels' tensor maps (`emit/flash/tma.rs`), encoded by
//! the driver for one launch's buffers and sizes and passed by value after
//! the kernel's other arguments.

use crate::RuntimeError;
use cudarc::driver::sys;
use fusec_compiler::emit::flash::tma::{TensorMap, TensorMapSizes};

/// A `CUtensorMap` as the kernel parameter takes it (128 bytes, 64-byte
/// aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct EncodedMap([u64; 16]);

// SAFETY: plain bytes, laid out as the driver's CUtensorMap.
unsafe impl cudarc::driver::DeviceRepr for EncodedMap {}

/// Encodes `map` of kernel `kernel`, whose arguments point at `args` (inputs,
/// then outputs), for the sizes `env` binds; an error names `without`, what
/// runs without the kernel.
pub fn encode(
    map: &TensorMap,
    args: &[u64],
    env: &dyn Fn(&str) -> Option<i64>,
    kernel: &str,
    without: &str,
) -> Result<EncodedMap, RuntimeError> {
    let sizes = map.sizes(env).ok_or_else(|| {
        RuntimeError::Unsupported(format!(
            "kernel {kernel}: a size of its input {}'s tensor map is not set; run with {without}",
            map.name
        ))
    })?;
    encode_sizes(
        &map.name,
        map.arg,
        &sizes,
        map.swizzle,
        args,
        kernel,
        without,
    )
}

/// Encodes tensor map `name` of kernel `kernel` with its sizes bound (as
/// the plan holds it): argument `arg` of `args` (inputs, then outputs), a
/// `swizzle`-byte swizzle; an error names `without`, what runs without the
/// kernel.
pub fn encode_sizes(
    name: &str,
    arg: usize,
    sizes: &TensorMapSizes,
    swizzle: u32,
    args: &[u64],
    kernel: &str,
    without: &str,
) -> Result<EncodedMap, RuntimeError> {
    let fail = |why: String| {
        RuntimeError::Unsupported(format!(
            "kernel {kernel}: cannot describe its input {name} to the GPU's tensor copies: {why}; run with {without}"
        ))
    };
    let base = args
        .get(arg)
        .ok_or_else(|| fail(format!("it has no argument {arg}")))?
        + sizes.offset_bytes;
    // The driver's own checks, said in words: 16-byte aligned base and strides.
    if !base.is_multiple_of(16)
        || sizes
            .strides_bytes
            .iter()
            .any(|s| !s.is_multiple_of(16) || *s == 0)
    {
        return Err(fail(format!(
            "its base {base:#x} or strides {:?} (bytes) are not positive multiples of 16",
            sizes.strides_bytes
        )));
    }
    if sizes.dims.iter().any(|&d| d == 0 || d > u32::MAX as u64) {
        return Err(fail(format!(
            "its extents {:?} are empty or too large",
            sizes.dims
        )));
    }
    let swizzle = match swizzle {
        128 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        64 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
        32 => sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
        other => {
            return Err(fail(format!(
                "a swizzle of {other} bytes is not one the copies have"
            )))
        }
    };
    let mut out = sys::CUtensorMap { opaque: [0; 16] };
    let element_strides = [1u32; 4];
    // SAFETY: every array holds the rank's entries (strides one fewer), and
    // `out` is a CUtensorMap the call fills.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut out,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            4,
            base as *mut std::ffi::c_void,
            sizes.dims.as_ptr(),
            sizes.strides_bytes.as_ptr(),
            sizes.boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(fail(format!(
            "the driver refused it ({r:?}) for extents {:?}, strides {:?} bytes, box {:?}",
            sizes.dims, sizes.strides_bytes, sizes.boxes
        )));
    }
    Ok(EncodedMap(out.opaque))
}

/// Every map of a launch, in order.
pub fn encode_all(
    maps: &[TensorMap],
    args: &[u64],
    env: &dyn Fn(&str) -> Option<i64>,
    kernel: &str,
    without: &str,
) -> Result<Vec<EncodedMap>, RuntimeError> {
    maps.iter()
        .map(|m| encode(m, args, env, kernel, without))
        .collect()
}
