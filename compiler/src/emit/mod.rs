//! Emission: kernels of the kernel IR become CUDA C source.
pub mod attention;
pub mod conv;
pub mod cuda;
pub mod flash;
pub mod flash_bwd;
pub mod flash_bwd_sm90;
pub mod flash_sm90;
pub mod group;
pub mod multi;
pub mod templates;
pub mod tma;

/// The shared device functions every generated kernel includes.
pub const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");
/// The name generated sources include the prelude by.
pub const PRELUDE_NAME: &str = "fusec_prelude.cuh";
