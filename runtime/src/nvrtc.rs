//! NVRTC: generated CUDA C to a cubin for one exact GPU architecture. The
//! library is loaded at run time (PyPI's `nvidia-cuda-nvrtc` wheel or a CUDA
//! install on the loader path), so everything builds without CUDA.

use cudarc::nvrtc::{result, sys};
use fusec_compiler::emit::expand_includes;
use std::ffi::CString;

/// Whether libnvrtc can be loaded.
pub fn available() -> bool {
    // SAFETY: only probes the loader for the library.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Option<(i32, i32)> {
    if !available() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the pointers are valid for writes.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    (r == sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

#[derive(Debug)]
pub struct Cubin {
    pub image: Vec<u8>,
    /// NVRTC's log, with ptxas's resource report.
    pub log: String,
    pub registers: Option<u32>,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    /// Stack frame (local memory) over every function, bytes: an array
    /// indexed by values ptxas cannot resolve lives there without spilling.
    pub stack_frame_bytes: u32,
    /// Static shared memory (`__shared__` arrays), bytes, as ptxas reports it.
    pub static_smem_bytes: u32,
}

impl Cubin {
    /// Whether the kernel keeps an array in local memory: a stack frame of
    /// 64 bytes or more. A fragment indexed by a value ptxas cannot resolve
    /// lives there without a spill (dropout's draws once put Hopper's
    /// attention tiles there, 128 to 256 bytes, 2.6x slower); a call to a
    /// function left out of line takes a few bytes (8: the persistent
    /// Hopper forward's producer), which this does not count.
    pub fn local_arrays(&self) -> bool {
        self.stack_frame_bytes >= 64
    }
}

#[derive(Debug)]
pub struct CompileError {
    pub kernel: String,
    pub message: String,
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVRTC could not compile kernel `{}`:\n{}",
            self.kernel, self.message
        )
    }
}

impl std::error::Error for CompileError {}

/// The source NVRTC sees: the prelude and the `kernels/` headers pasted in
/// place of their includes.
pub fn with_prelude(source: &str) -> String {
    expand_includes(source)
}

fn number_before(log: &str, suffix: &str) -> Option<u32> {
    let at = log.find(suffix)?;
    log[..at].split_whitespace().last()?.parse().ok()
}

/// Compiles one kernel's source for `arch` (e.g. `sm_90`).
pub fn compile(kernel: &str, source: &str, arch: &str) -> Result<Cubin, CompileError> {
    compile_with(
        kernel,
        source,
        arch,
        &["--std=c++17", "--ptxas-options=-v", "-default-device"],
    )
}

/// [`compile`] with `options` after `--gpu-architecture` in place of its
/// own (none: NVRTC's defaults, as a `kernels/` header must compile).
pub fn compile_with(
    kernel: &str,
    source: &str,
    arch: &str,
    options: &[&str],
) -> Result<Cubin, CompileError> {
    let err = |message: String| CompileError {
        kernel: kernel.to_string(),
        message,
    };
    if !available() {
        return Err(err("libnvrtc is not on the loader path (install the nvidia-cuda-nvrtc wheel or CUDA, and set LD_LIBRARY_PATH)".into()));
    }
    let src = CString::new(with_prelude(source))
        .map_err(|_| err("the source contains a NUL byte".into()))?;
    let name = CString::new(format!("{kernel}.cu")).map_err(|_| err("bad kernel name".into()))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| err(format!("{e:?}")))?;
    let options: Vec<String> = std::iter::once(format!("--gpu-architecture={arch}"))
        .chain(options.iter().map(|o| o.to_string()))
        .collect();
    // SAFETY: `prog` was just created and is destroyed below exactly once.
    let compiled = unsafe { result::compile_program(prog, &options) };
    let log = unsafe { result::get_program_log(prog) }
        .map(|chars| {
            let bytes: Vec<u8> = chars
                .iter()
                .map(|&c| c as u8)
                .take_while(|&b| b != 0)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let image = if compiled.is_ok() {
        let mut size = 0usize;
        // SAFETY: compiled successfully; the buffer has the size NVRTC reports.
        unsafe {
            sys::nvrtcGetCUBINSize(prog, &mut size);
            let mut buf = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char);
            buf
        }
    } else {
        Vec::new()
    };
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { result::destroy_program(prog) };
    if compiled.is_err() {
        return Err(err(log));
    }
    Ok(Cubin {
        image,
        registers: number_before(&log, " registers"),
        spill_store_bytes: number_before(&log, " bytes spill stores").unwrap_or(0),
        spill_load_bytes: number_before(&log, " bytes spill loads").unwrap_or(0),
        stack_frame_bytes: log
            .lines()
            .filter_map(|l| number_before(l, " bytes stack frame"))
            .sum(),
        static_smem_bytes: number_before(&log, " bytes smem").unwrap_or(0),
        log,
    })
}
