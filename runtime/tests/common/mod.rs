//! Helpers shared by the runtime's tests.
#![allow(dead_code)]

#[path = "../../../tests/common/nvrtc_ready.rs"]
mod nvrtc_ready;
#[path = "../../../tests/common/skip.rs"]
mod skip;
#[path = "../../../tests/common/tiny.rs"]
mod tiny;

#[allow(unused_imports)]
pub use nvrtc_ready::nvrtc_ready;

#[allow(unused_imports)]
pub use skip::skip;
#[allow(unused_imports)]
pub use tiny::{tiny_models, TinyModel};

#[path = "../../../tests/common/on_gpu.rs"]
mod on_gpu;
#[allow(unused_imports)]
pub use on_gpu::*;

use std::path::PathBuf;

/// The repository as built, or (a test binary carried to another machine)
/// as named by FUSEC_ROOT or the working directory.
pub fn root() -> PathBuf {
    std::env::var_os("FUSEC_ROOT")
        .map(PathBuf::from)
        .or_else(|| {
            let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            built.join("dsl-examples").exists().then_some(built)
        })
        .unwrap_or_else(|| std::env::current_dir().unwrap())
}
