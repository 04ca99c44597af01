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
pub(crate) fn stable_key(parts: &[&str]) -> String {
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

/// The name every kernel's source is compiled under: kernels whose
/// sources differ only in their names (GPT-2's twelve layers give the same
/// layernorm, attention and bias-gradient kernels twelve times: 223
/// kernels, 27 distinct) share one compilation, one cache entry and one
/// loaded module.
pub const SHARED_NAME: &str = "fusec_kernel";

/// `source` with its kernel's name (and the names of its functions, which
/// start with it) as [`SHARED_NAME`].
pub fn shared_source(name: &str, source: &str) -> String {
    source.replace(name, SHARED_NAME)
}

/// A function of kernel `kernel` as it is named in the shared compilation.
pub fn shared_function(kernel: &str, function: &str) -> String {
    function.replacen(kernel, SHARED_NAME, 1)
}

/// The compiled kernels: one image per distinct source, and which image
/// each kernel (in order) runs from; functions are named as
/// [`shared_function`] says.
pub struct Cubins {
    pub images: Vec<Vec<u8>>,
    pub of_kernel: Vec<usize>,
}

/// Cubins for every kernel: from the cache where present, else compiled
/// (in parallel, each distinct source once) and stored. `progress` is
/// called after each distinct source with (done, total).
pub fn cubins(
    kernels: &[(String, String)],
    arch: &str,
    dir: Option<&Path>,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<(Cubins, CacheStats), RuntimeError> {
    let version = nvrtc::version()
        .map(|(a, b)| format!("{a}.{b}"))
        .ok_or_else(|| {
            RuntimeError::Compile(
                "NVRTC (libnvrtc.so) cannot be loaded: install CUDA or PyPI's nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH".into(),
            )
        })?;
    // Distinct sources, in first-seen order, with the first kernel of each
    // (named in compile errors).
    let mut distinct: Vec<(&str, String)> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut of_kernel = Vec::with_capacity(kernels.len());
    for (name, src) in kernels {
        let shared = shared_source(name, src);
        let i = *index.entry(shared.clone()).or_insert_with(|| {
            distinct.push((name.as_str(), shared));
            distinct.len() - 1
        });
        of_kernel.push(i);
    }
    let done = std::sync::atomic::AtomicUsize::new(0);
    let total = distinct.len();
    // The longest sources first: the attention templates and the
    // multi-tensor groups take the longest to compile, and started last
    // they would finish alone.
    let mut order: Vec<usize> = (0..total).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(distinct[i].1.len()));
    // (distinct source, its image and whether it came from the cache (0),
    // was compiled (1) or rebuilt over a corrupt entry (2)).
    type Built = (usize, Result<(Vec<u8>, u8), RuntimeError>);
    let results: Vec<Built> = order
        .par_iter()
        .with_max_len(1)
        .map(|&i| {
            let (name, src) = (distinct[i].0, &distinct[i].1);
            let full = nvrtc::with_prelude(src);
            let path = dir.map(|d| d.join(format!("{}.cubin", stable_key(&[&full, arch, &version]))));
            let mut state = 1u8; // compiled
            if let Some(p) = &path {
                match std::fs::read(p) {
                    Ok(image) if looks_valid(&image) => {
                        let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                        progress(n, total);
                        return (i, Ok((image, 0)));
                    }
                    Ok(_) => state = 2, // present but corrupt
                    Err(_) => {}
                }
            }
            let cubin = match nvrtc::compile(SHARED_NAME, src, arch) {
                Ok(c) => c,
                Err(e) => {
                    return (
                        i,
                        Err(RuntimeError::Compile(format!(
                            "{name}: {e}\n(`fusec build` writes the plan's kernels to kernels/{name}.cu; the tensor-core attention kernels are made at run time, and FUSEC_ATTENTION=simple runs without them)"
                        ))),
                    )
                }
            };
            if let Some(p) = &path {
                // A cache that cannot be written only costs time next run.
                let _ = write_atomic(p, &cubin.image);
            }
            let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            progress(n, total);
            (i, Ok((cubin.image, state)))
        })
        .collect();
    let mut stats = CacheStats::default();
    let mut images = vec![Vec::new(); total];
    for (i, r) in results {
        let (image, state) = r?;
        match state {
            0 => stats.hits += 1,
            2 => {
                stats.compiled += 1;
                stats.rebuilt += 1
            }
            _ => stats.compiled += 1,
        }
        images[i] = image;
    }
    Ok((Cubins { images, of_kernel }, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_and_separate_inputs() {
        assert_eq!(stable_key(&["a", "sm_90"]), stable_key(&["a", "sm_90"]));
        assert_ne!(stable_key(&["a", "sm_90"]), stable_key(&["a", "sm_80"]));
        assert_ne!(stable_key(&["ab", "c"]), stable_key(&["a", "bc"]));
        assert_eq!(stable_key(&["x"]).len(), 32);
    }

    /// Kernels that differ only in their names compile once, into one
    /// cache entry, and each finds its function under the shared name.
    #[test]
    fn kernels_that_differ_only_in_name_compile_once() {
        if !nvrtc::available() {
            assert!(
                std::env::var("FUSEC_REQUIRE_NVRTC").is_err(),
                "FUSEC_REQUIRE_NVRTC is set but libnvrtc is not on the loader path"
            );
            println!("NVRTC not on the loader path: skipped");
            return;
        }
        let body = |name: &str, scale: &str| {
            format!(
                "// {name}\nextern \"C\" __global__ void {name}(float* x) {{ x[threadIdx.x] *= {scale}; }}\n"
            )
        };
        let kernels = vec![
            ("k3_scale".to_string(), body("k3_scale", "2.0f")),
            ("k9_scale".to_string(), body("k9_scale", "2.0f")),
            ("k12_scale".to_string(), body("k12_scale", "3.0f")),
        ];
        let dir = std::env::temp_dir().join(format!("fusec-cache-dedup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (c, stats) = cubins(&kernels, "sm_80", Some(&dir), &|_, _| {}).unwrap();
        assert_eq!(c.of_kernel, [0, 0, 1]);
        assert_eq!(c.images.len(), 2);
        assert_eq!((stats.compiled, stats.hits), (2, 0));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        assert_eq!(shared_function("k9_scale", "k9_scale"), SHARED_NAME);
        // A second run reads both from the cache.
        let (_, again) = cubins(&kernels, "sm_80", Some(&dir), &|_, _| {}).unwrap();
        assert_eq!((again.compiled, again.hits), (0, 2));
        let _ = std::fs::remove_dir_all(&dir);
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
