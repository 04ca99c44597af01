//! Generated kernels to cubins: NVRTC in parallel, with an on-disk cache
//! keyed by the source, the architecture and NVRTC's version. Entries are
//! written to a temporary file and renamed into place, so a crash never
//! leaves a half-written entry; an entry that is not a valid image (wrong
//! magic, truncated) is rebuilt rather than trusted.

use crate::nvrtc;
use crate::RuntimeError;
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// Where cubins are kept: `$FUSEC_CACHE_DIR`, else `$XDG_CACHE_HOME/fusec`,
/// else `~/.cache/fusec`, else a folder under the system's temp dir.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FUSEC_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("fusec");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache").join("fusec");
    }
    std::env::temp_dir().join("fusec-cache")
}

/// 64-bit FNV-1a, twice with different seeds: a stable key across runs and
/// machines (std's hasher is randomly seeded).
fn key(parts: &[&str]) -> String {
    let mut out = String::new();
    for seed in [0xcbf2_9ce4_8422_2325u64, 0x8422_2325_cbf2_9ce4u64] {
        let mut h = seed;
        for p in parts {
            for b in p.bytes().chain(std::iter::once(0xff)) {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out.push_str(&format!("{h:016x}"));
    }
    out
}

/// A cubin is an ELF file.
fn looks_valid(image: &[u8]) -> bool {
    image.len() > 64 && image.starts_with(b"\x7fELF")
}

/// Writes `bytes` to `path` atomically: a temporary file in the same
/// folder, then a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[derive(Debug, Default, Clone, Copy)]
pub struct CacheStats {
    pub hits: usize,
    pub compiled: usize,
    /// Entries that were present but corrupt, and were rebuilt.
    pub rebuilt: usize,
}

/// Cubins for every kernel, in order: from the cache where present, else
/// compiled (in parallel) and stored. `progress` is called after each
/// kernel with (done, total).
pub fn cubins(
    kernels: &[(String, String)],
    arch: &str,
    dir: Option<&Path>,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<(Vec<Vec<u8>>, CacheStats), RuntimeError> {
    let version = nvrtc::version()
        .map(|(a, b)| format!("{a}.{b}"))
        .ok_or_else(|| {
            RuntimeError::Compile(
                "NVRTC (libnvrtc.so) cannot be loaded: install CUDA or PyPI's nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH".into(),
            )
        })?;
    let done = std::sync::atomic::AtomicUsize::new(0);
    let total = kernels.len();
    let results: Vec<Result<(Vec<u8>, u8), RuntimeError>> = kernels
        .par_iter()
        .map(|(name, src)| {
            let full = nvrtc::with_prelude(src);
            let path = dir.map(|d| d.join(format!("{}.cubin", key(&[&full, arch, &version]))));
            let mut state = 1u8; // compiled
            if let Some(p) = &path {
                match std::fs::read(p) {
                    Ok(image) if looks_valid(&image) => {
                        let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                        progress(n, total);
                        return Ok((image, 0));
                    }
                    Ok(_) => state = 2, // present but corrupt
                    Err(_) => {}
                }
            }
            let cubin = nvrtc::compile(name, src, arch).map_err(|e| {
                RuntimeError::Compile(format!(
                    "{e}\n(`fusec build` writes the plan's kernels to kernels/{name}.cu; the tensor-core attention kernels are made at run time, and FUSEC_ATTENTION=simple runs without them)"
                ))
            })?;
            if let Some(p) = &path {
                // A cache that cannot be written only costs time next run.
                let _ = write_atomic(p, &cubin.image);
            }
            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            progress(n, total);
            Ok((cubin.image, state))
        })
        .collect();
    let mut stats = CacheStats::default();
    let mut images = Vec::with_capacity(total);
    for r in results {
        let (image, state) = r?;
        match state {
            0 => stats.hits += 1,
            2 => {
                stats.compiled += 1;
                stats.rebuilt += 1
            }
            _ => stats.compiled += 1,
        }
        images.push(image);
    }
    Ok((images, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_and_separate_inputs() {
        assert_eq!(key(&["a", "sm_90"]), key(&["a", "sm_90"]));
        assert_ne!(key(&["a", "sm_90"]), key(&["a", "sm_80"]));
        assert_ne!(key(&["ab", "c"]), key(&["a", "bc"]));
        assert_eq!(key(&["x"]).len(), 32);
    }

    #[test]
    fn atomic_writes_leave_no_temporary_and_bad_entries_are_not_trusted() {
        let dir = std::env::temp_dir().join(format!("fusec-cache-test-{}", std::process::id()));
        let p = dir.join("k.cubin");
        let mut image = b"\x7fELF".to_vec();
        image.resize(200, 7);
        write_atomic(&p, &image).unwrap();
        assert!(looks_valid(&std::fs::read(&p).unwrap()));
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert!(!looks_valid(b"\x7fELF truncated"));
        assert!(!looks_valid(&[0u8; 100]));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
