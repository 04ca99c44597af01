//! fusec's runtime: runs compiled training steps on NVIDIA GPUs. CUDA's
//! libraries are loaded at run time, so the crate builds and its non-GPU
//! tests run on machines without them.

pub mod nvrtc;
