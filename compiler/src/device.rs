//! The GPUs fusec builds for, in one table: what each compiles for, the
//! attention family it runs, its size (multiprocessors, shared memory a
//! block) and its datasheet rates for the roofline. `fusec build --device`
//! names one; a run finds its GPU's row by the name the driver reports.

use crate::optimisation::LowerOptions;
use crate::target::{F32Math, FlashArch, Target};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Device {
    /// What `--device` takes.
    pub name: &'static str,
    pub about: &'static str,
    /// The architecture NVRTC compiles for.
    pub arch: &'static str,
    /// The tensor-core attention family.
    pub flash: Option<FlashArch>,
    /// The SXM part's count; the runtime uses the GPU's own.
    pub multiprocessors: u32,
    /// The most shared memory a block may take (bytes, opted in): every
    /// kernel built for the device must fit it.
    pub max_shared_per_block: u64,
    pub bytes_per_s: f64,
    /// Dense bf16/fp16 tensor-core rate.
    pub tensor_flops: f64,
    /// Non-tensor f32 rate.
    pub f32_flops: f64,
    /// What the GPU's own name (as the driver reports it, lower case)
    /// contains.
    pub gpu_name: &'static str,
}

/// What a build is for where nothing says (`fusec build`'s default, and
/// the estimate a run reports before it knows its GPU).
pub const DEFAULT: &str = "h100";

/// Datasheet figures (dense, no sparsity). sm_86 and sm_89 give a block
/// 99 KiB of shared memory where an A100 gives 163 KiB: the mma.sync
/// attention kernels take at most 86 KiB there, the f32 ones 99 KiB.
pub const DEVICES: &[Device] = &[
    Device {
        name: "h100",
        about: "H100 SXM: 3.35 TB/s, 989 TFLOP/s bf16, 67 TFLOP/s f32",
        arch: "sm_90a",
        flash: Some(FlashArch::Sm90a),
        multiprocessors: 132,
        max_shared_per_block: 227 << 10,
        bytes_per_s: 3.35e12,
        tensor_flops: 989e12,
        f32_flops: 67e12,
        gpu_name: "h100",
    },
    Device {
        name: "h200",
        about: "H200 SXM: 4.8 TB/s, 989 TFLOP/s bf16, 67 TFLOP/s f32",
        arch: "sm_90a",
        flash: Some(FlashArch::Sm90a),
        multiprocessors: 132,
        max_shared_per_block: 227 << 10,
        bytes_per_s: 4.8e12,
        tensor_flops: 989e12,
        f32_flops: 67e12,
        gpu_name: "h200",
    },
    Device {
        name: "a100",
        about: "A100 SXM 80GB: 2.04 TB/s, 312 TFLOP/s bf16, 19.5 TFLOP/s f32",
        arch: "sm_80",
        flash: Some(FlashArch::Sm80),
        multiprocessors: 108,
        max_shared_per_block: 163 << 10,
        bytes_per_s: 2.039e12,
        tensor_flops: 312e12,
        f32_flops: 19.5e12,
        gpu_name: "a100",
    },
    // Consumer and workstation parts: their bf16 tensor rate is the one
    // with f32 accumulation (half the f16-accumulate figure on GeForce).
    Device {
        name: "rtx3090",
        about: "GeForce RTX 3090: 936 GB/s, 71 TFLOP/s bf16, 35.6 TFLOP/s f32",
        arch: "sm_86",
        flash: Some(FlashArch::Sm80),
        multiprocessors: 82,
        max_shared_per_block: 99 << 10,
        bytes_per_s: 936e9,
        tensor_flops: 71e12,
        f32_flops: 35.6e12,
        gpu_name: "rtx 3090",
    },
    Device {
        name: "rtx4090",
        about: "GeForce RTX 4090: 1.01 TB/s, 165 TFLOP/s bf16, 82.6 TFLOP/s f32",
        arch: "sm_89",
        flash: Some(FlashArch::Sm80),
        multiprocessors: 128,
        max_shared_per_block: 99 << 10,
        bytes_per_s: 1008e9,
        tensor_flops: 165.2e12,
        f32_flops: 82.6e12,
        gpu_name: "rtx 4090",
    },
    Device {
        name: "l40s",
        about: "L40S: 864 GB/s, 362 TFLOP/s bf16, 91.6 TFLOP/s f32",
        arch: "sm_89",
        flash: Some(FlashArch::Sm80),
        multiprocessors: 142,
        max_shared_per_block: 99 << 10,
        bytes_per_s: 864e9,
        tensor_flops: 362e12,
        f32_flops: 91.6e12,
        gpu_name: "l40s",
    },
];

pub fn device(name: &str) -> Option<Device> {
    DEVICES.iter().copied().find(|d| d.name == name)
}

/// The default device's row.
pub fn default_device() -> Device {
    device(DEFAULT).expect("the default device is in the table")
}

/// The row of a GPU by the name its driver reports ("NVIDIA GeForce RTX
/// 3090").
pub fn find_gpu(gpu: &str) -> Option<Device> {
    let n = gpu.to_ascii_lowercase();
    DEVICES.iter().copied().find(|d| n.contains(d.gpu_name))
}

/// [`find_gpu`], the default device's row where none matches.
pub fn device_of_gpu(gpu: &str) -> Device {
    find_gpu(gpu).unwrap_or_else(default_device)
}

// Here rather than in `target.rs`, which stays a leaf the runtime reads.
impl Target {
    /// The target of a device in [`DEVICES`].
    pub fn for_device(name: &str, deterministic: bool) -> Option<Target> {
        device(name).map(|d| Target {
            arch: d.flash,
            deterministic,
            multiprocessors: d.multiprocessors,
            f32_math: F32Math::default(),
            lower: LowerOptions::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drivers_names_find_their_rows() {
        assert_eq!(device_of_gpu("NVIDIA GeForce RTX 3090").name, "rtx3090");
        assert_eq!(device_of_gpu("NVIDIA H200").name, "h200");
        assert_eq!(device_of_gpu("NVIDIA H100 80GB HBM3").name, "h100");
        assert_eq!(device_of_gpu("Tesla V100").name, DEFAULT);
        assert!(find_gpu("Tesla V100").is_none());
        // Names are unique, and each architecture's limit is the same.
        for d in DEVICES {
            assert_eq!(DEVICES.iter().filter(|e| e.name == d.name).count(), 1);
            for e in DEVICES.iter().filter(|e| e.arch == d.arch) {
                assert_eq!(e.max_shared_per_block, d.max_shared_per_block, "{}", d.name);
            }
        }
    }
}
