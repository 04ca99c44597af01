//! Emission: kernels of the kernel IR become CUDA C source.
pub mod access;
pub mod attention;
pub mod conv;
pub mod cross_entropy;
pub mod cuda;
pub mod embedding_grad;
pub mod flash;
pub mod gemm_skinny;
pub mod gemm_split;
pub mod group;
pub mod launch;
pub mod lower;
pub mod multi;
pub mod norm_rows;
pub mod pointwise_sum;
pub mod templates;
pub mod unary;

/// The shared device functions every generated kernel includes.
pub const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");
/// The name generated sources include the prelude by.
pub const PRELUDE_NAME: &str = "fusec_prelude.cuh";

/// The hand-written templates under `kernels/` that generated sources
/// include, by their path there.
pub const HEADERS: &[(&str, &str)] = &[
    (
        "attention/common.cuh",
        include_str!("../../../kernels/attention/common.cuh"),
    ),
    (
        "attention/sm90.cuh",
        include_str!("../../../kernels/attention/sm90.cuh"),
    ),
    (
        "attention/wgmma_ops.cuh",
        include_str!("../../../kernels/attention/wgmma_ops.cuh"),
    ),
    (
        "attention/tf32.cuh",
        include_str!("../../../kernels/attention/tf32.cuh"),
    ),
    (
        "attention/forward_f32.cuh",
        include_str!("../../../kernels/attention/forward_f32.cuh"),
    ),
    (
        "attention/backward_f32.cuh",
        include_str!("../../../kernels/attention/backward_f32.cuh"),
    ),
    (
        "attention/forward_sm80.cuh",
        include_str!("../../../kernels/attention/forward_sm80.cuh"),
    ),
    (
        "attention/forward_sm90.cuh",
        include_str!("../../../kernels/attention/forward_sm90.cuh"),
    ),
    (
        "attention/forward_sm90_persistent.cuh",
        include_str!("../../../kernels/attention/forward_sm90_persistent.cuh"),
    ),
    (
        "attention/backward.cuh",
        include_str!("../../../kernels/attention/backward.cuh"),
    ),
    (
        "attention/backward_sm80.cuh",
        include_str!("../../../kernels/attention/backward_sm80.cuh"),
    ),
    (
        "attention/backward_sm90.cuh",
        include_str!("../../../kernels/attention/backward_sm90.cuh"),
    ),
    (
        "attention/backward_sm90_wide.cuh",
        include_str!("../../../kernels/attention/backward_sm90_wide.cuh"),
    ),
    (
        "attention/simple.cuh",
        include_str!("../../../kernels/attention/simple.cuh"),
    ),
    (
        "attention/decode.cuh",
        include_str!("../../../kernels/attention/decode.cuh"),
    ),
    (
        "kv_cache.cuh",
        include_str!("../../../kernels/kv_cache.cuh"),
    ),
    ("argmax.cuh", include_str!("../../../kernels/argmax.cuh")),
    (
        "elements.cuh",
        include_str!("../../../kernels/elements.cuh"),
    ),
    ("cast.cuh", include_str!("../../../kernels/cast.cuh")),
    ("conv.cuh", include_str!("../../../kernels/conv.cuh")),
    ("mask.cuh", include_str!("../../../kernels/mask.cuh")),
    ("norm.cuh", include_str!("../../../kernels/norm.cuh")),
    (
        "norm_block.cuh",
        include_str!("../../../kernels/norm_block.cuh"),
    ),
    ("rope.cuh", include_str!("../../../kernels/rope.cuh")),
    ("clip.cuh", include_str!("../../../kernels/clip.cuh")),
    ("concat.cuh", include_str!("../../../kernels/concat.cuh")),
    (
        "sum_squares.cuh",
        include_str!("../../../kernels/sum_squares.cuh"),
    ),
    ("optim.cuh", include_str!("../../../kernels/optim.cuh")),
    ("softmax.cuh", include_str!("../../../kernels/softmax.cuh")),
    (
        "cross_entropy.cuh",
        include_str!("../../../kernels/cross_entropy.cuh"),
    ),
    (
        "embedding.cuh",
        include_str!("../../../kernels/embedding.cuh"),
    ),
    (
        "column_sum.cuh",
        include_str!("../../../kernels/column_sum.cuh"),
    ),
    (
        "gemm/sm90.cuh",
        include_str!("../../../kernels/gemm/sm90.cuh"),
    ),
    (
        "gemm/skinny.cuh",
        include_str!("../../../kernels/gemm/skinny.cuh"),
    ),
    (
        "gemm/split_tf32.cuh",
        include_str!("../../../kernels/gemm/split_tf32.cuh"),
    ),
    (
        "random/philox.cuh",
        include_str!("../../../kernels/random/philox.cuh"),
    ),
];

/// `source` as one translation unit: every `#include "..."` of the prelude
/// or of a header in [`HEADERS`] (by its path, or relative to the including
/// header's folder) replaced by its text, each once; what NVRTC compiles and
/// what the kernel cache keys on, so a change to a template recompiles
/// every kernel that includes it.
pub fn expand_includes(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut seen: Vec<&str> = Vec::new();
    expand(source, "", &mut seen, &mut out);
    out
}

fn expand(text: &str, dir: &str, seen: &mut Vec<&str>, out: &mut String) {
    for line in text.split_inclusive('\n') {
        let name = line
            .trim()
            .strip_prefix("#include \"")
            .and_then(|r| r.strip_suffix('"'));
        let Some(name) = name else {
            out.push_str(line);
            continue;
        };
        if name == PRELUDE_NAME {
            if !seen.contains(&PRELUDE_NAME) {
                seen.push(PRELUDE_NAME);
                out.push_str(PRELUDE);
                out.push('\n');
            }
            continue;
        }
        let relative = normalise(&format!("{dir}{name}"));
        match HEADERS
            .iter()
            .find(|(path, _)| *path == name || *path == relative)
        {
            Some((path, text)) => {
                if !seen.contains(path) {
                    seen.push(path);
                    let dir = path.rfind('/').map_or("", |i| &path[..=i]);
                    expand(text, dir, seen, out);
                    if !out.ends_with('\n') {
                        out.push('\n');
                    }
                }
            }
            None => out.push_str(line),
        }
    }
}

/// `a/../b/c` as `b/c`: a header's include of a sibling folder's header.
fn normalise(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            ".." if parts.last().is_some_and(|p| *p != "..") => {
                parts.pop();
            }
            "." => {}
            _ => parts.push(part),
        }
    }
    parts.join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn includes_are_pasted_once_each() {
        let src = "#include \"fusec_prelude.cuh\"\n#include \"attention/forward_sm80.cuh\"\n#include \"attention/backward_sm80.cuh\"\nint x;\n";
        let out = expand_includes(src);
        assert!(!out.contains("#include \""), "{out}");
        assert_eq!(out.matches("#define FS_ATTENTION_COMMON").count(), 1);
        assert_eq!(out.matches("typedef long long fs_i64;").count(), 1);
        assert!(out.ends_with("int x;\n"));
    }

    #[test]
    fn a_sibling_folders_header_is_found() {
        assert_eq!(
            normalise("attention/../random/philox.cuh"),
            "random/philox.cuh"
        );
        let out = expand_includes("#include \"attention/common.cuh\"\n");
        assert_eq!(out.matches("#define FS_PHILOX_CUH").count(), 1, "{out}");
    }

    #[test]
    fn an_unknown_include_stays() {
        let out = expand_includes("#include \"nowhere.cuh\"\n");
        assert_eq!(out, "#include \"nowhere.cuh\"\n");
    }
}
