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
    super::skip(
        "libnvrtc not found (install nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH)",
    );
    false
}

/// Writes a compiled kernel's cubin into the folder FUSEC_CUBIN_DIR names,
/// if set, as `<kernel>_<what>.cubin` (`what` with every character but
/// letters and digits made `_`): the machine code to read (`nvdisasm`)
/// when tuning a kernel.
pub fn keep_cubin(kernel: &str, what: &str, image: &[u8]) {
    let Some(dir) = std::env::var_os("FUSEC_CUBIN_DIR") else {
        return;
    };
    let what: String = what
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let path = std::path::Path::new(&dir).join(format!("{kernel}_{what}.cubin"));
    std::fs::write(&path, image).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}
