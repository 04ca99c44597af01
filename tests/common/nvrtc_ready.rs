//! Whether NVRTC can be loaded (shared by the root tests and runtime/tests).

use fusec_runtime::nvrtc;

/// True where libnvrtc loads; otherwise prints why the caller skips, and
/// fails instead when FUSEC_REQUIRE_NVRTC is set (as CI sets it after
/// installing NVRTC), so a run meant to compile cannot pass by skipping.
pub fn nvrtc_ready() -> bool {
    if nvrtc::available() {
        println!("NVRTC {:?}", nvrtc::version());
        return true;
    }
    assert!(
        std::env::var("FUSEC_REQUIRE_NVRTC").is_err(),
        "FUSEC_REQUIRE_NVRTC is set but libnvrtc is not on the loader path"
    );
    println!("skipped: libnvrtc not found (install nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH)");
    false
}
