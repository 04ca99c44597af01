//! Choosing among cuBLASLt's algorithms by timing them on the GPU at hand.
//!
//! cuBLASLt's heuristic ranks the algorithms it has for a product, and its
//! first choice is not always the fastest: on an H100 (cuBLASLt 13.1),
//! timed one by one on BERT-large's and gpt2-small's products
//! (`tools/cublaslt_tuning_probe.cu`), another of the up to 8 it offers was
//! up to 15.6% faster (the feed-forward's input gradient, 16384 x 4096 x
//! 1024: 213 against 180 us), gpt2-small's LM head 7-13%, and 2.2 of
//! 48.9 ms over both models' products a step. So the first time a product is
//! planned, every algorithm the heuristic offers is timed on the step's own
//! buffers, and the fastest is kept where it beats the first choice by at
//! least [`MARGIN`]. Choices are kept on disk beside the kernel cache, keyed
//! by GPU, cuBLASLt version and product, so a warm start times nothing and
//! later runs take the same algorithms.

use crate::gemm::{EpiloguePtrs, GemmElem, GemmShape};
use std::path::{Path, PathBuf};

/// How many algorithms the heuristic is asked for (it offered 7-8 for
/// every product of the probe when asked for 16).
pub const CANDIDATES: usize = 8;

/// Another algorithm replaces cuBLASLt's first choice only when it is at
/// least this much faster: the rounds of one algorithm vary by about 1% on
/// an idle GPU, and a near-tie decided by noise would pick differently from
/// run to run for nothing.
pub const MARGIN: f64 = 0.03;

/// How a product's algorithm is chosen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Tuning {
    /// cuBLASLt's first choice, never timed (deterministic runs: the same
    /// algorithm on every run and every machine with this cuBLASLt).
    #[default]
    First,
    /// Timed once per product, the choice kept in `dir` (no folder: timed
    /// in every run); `gpu` names the GPU in the cache's keys.
    Timed { dir: Option<PathBuf>, gpu: String },
}

/// What the choices of a run came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TuningStats {
    /// Products whose algorithms were timed in this run.
    pub timed: usize,
    /// Products whose choice was read from the cache.
    pub cached: usize,
    /// Products (timed or cached) running another algorithm than
    /// cuBLASLt's first choice.
    pub changed: usize,
    /// Products left on the first choice untimed because the product
    /// writes over one of its own inputs (timing it again would change
    /// what it reads) or a graph was being captured.
    pub untimed: usize,
}

/// The index of the algorithm to keep, given each candidate's time
/// (`None`: it failed to run): the fastest, where it beats the first by at
/// least [`MARGIN`]; the first otherwise, or the fastest that ran where the
/// first did not.
pub fn pick(times: &[Option<f64>]) -> usize {
    let fastest = times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.map(|t| (i, t)))
        .min_by(|x, y| x.1.total_cmp(&y.1));
    match (times.first().copied().flatten(), fastest) {
        (Some(first), Some((i, t))) if t <= first * (1.0 - MARGIN) => i,
        (Some(_), _) => 0,
        (None, Some((i, _))) => i,
        (None, None) => 0,
    }
}

/// The file holding the choice for one product (`what`: the product and
/// everything its algorithms depend on, as text).
pub fn entry_path(dir: &Path, gpu: &str, cublaslt_version: usize, what: &str) -> PathBuf {
    let version = cublaslt_version.to_string();
    let key = crate::cache::stable_key(&["gemm-algo 1", gpu, &version, what]);
    dir.join("gemm").join(format!("{key}.algo"))
}

const MAGIC: &[u8; 8] = b"fsgemm1\n";

/// A stored algorithm: cuBLASLt's opaque 64 bytes, which its documentation
/// allows to be saved and restored for the same library version (the key
/// holds the version). `None` for a missing or malformed entry.
pub fn load(path: &Path) -> Option<[u64; 8]> {
    let bytes = std::fs::read(path).ok()?;
    let body = bytes.strip_prefix(MAGIC)?;
    if body.len() != 64 {
        return None;
    }
    let mut data = [0u64; 8];
    for (d, c) in data.iter_mut().zip(body.chunks_exact(8)) {
        *d = u64::from_le_bytes(c.try_into().ok()?);
    }
    Some(data)
}

/// Stores a choice; a cache that cannot be written only costs the timing
/// again next run, so failures are ignored.
pub fn store(path: &Path, data: &[u64; 8]) {
    let mut bytes = MAGIC.to_vec();
    for d in data {
        bytes.extend_from_slice(&d.to_le_bytes());
    }
    let _ = crate::cache::write_atomic(path, &bytes);
}

/// Bytes from a matrix's first element to past its last: `rows` stored rows
/// of `len` elements, `pitch` apart (0: packed), `batch` of them `stride`
/// elements apart.
fn span(rows: u64, len: u64, pitch: u64, batch: u64, stride: u64, t: GemmElem) -> u64 {
    let ld = if pitch == 0 { len } else { pitch };
    ((rows - 1) * ld + len + (batch - 1) * stride) * t.bytes()
}

/// Whether the product writes (D, or the GELU aux it stores) over a byte
/// it reads (A, B, the residual, the bias or the DGELU aux): run again, it
/// would read its own output. Timing runs it several times, so such a
/// product is not timed. `a`, `b` and `d` are the addresses of our A, B
/// and D (row-major, as `GemmShape` has them).
pub(crate) fn writes_over_inputs(
    s: &GemmShape,
    ep: &EpiloguePtrs,
    a_at: u64,
    b_at: u64,
    d_at: u64,
) -> bool {
    let (rows_a, len_a) = if s.a_transposed {
        (s.k, s.m)
    } else {
        (s.m, s.k)
    };
    let (rows_b, len_b) = if s.b_transposed {
        (s.n, s.k)
    } else {
        (s.k, s.n)
    };
    let a = span(
        rows_a,
        len_a,
        s.pitch_a,
        s.batch,
        s.batch_stride_a,
        s.in_type,
    );
    let b = span(
        rows_b,
        len_b,
        s.pitch_b,
        s.batch,
        s.batch_stride_b,
        s.in_type,
    );
    let d = span(s.m, s.n, s.pitch_d, s.batch, s.batch_stride_d, s.out_type);
    let at = |x: u64, bytes: u64| (x, x + bytes);
    let mut reads = vec![at(a_at, a), at(b_at, b)];
    reads.extend(ep.residual.map(|r| at(r, d)));
    reads.extend(ep.bias.map(|x| at(x, s.n * s.out_type.bytes())));
    reads.extend(ep.dgelu_aux_in.map(|x| at(x, d)));
    let mut writes = vec![at(d_at, d)];
    writes.extend(ep.gelu_aux_out.map(|x| at(x, d)));
    writes.iter().any(|w| reads.iter().any(|r| overlap(*w, *r)))
}

/// Half-open byte ranges that share a byte.
pub fn overlap(x: (u64, u64), y: (u64, u64)) -> bool {
    x.0 < y.1 && y.0 < x.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_choice_stays_unless_another_is_clearly_faster() {
        // 2% faster: within the margin, the first stays.
        assert_eq!(pick(&[Some(100.0), Some(98.0), Some(99.0)]), 0);
        // 3% and 15% faster: the fastest wins.
        assert_eq!(pick(&[Some(100.0), Some(97.0)]), 1);
        assert_eq!(pick(&[Some(100.0), Some(97.0), Some(85.0)]), 2);
        // Failed candidates are ignored; a failed first gives way.
        assert_eq!(pick(&[Some(100.0), None, Some(90.0)]), 2);
        assert_eq!(pick(&[None, Some(120.0), Some(110.0)]), 2);
        assert_eq!(pick(&[None, None]), 0);
        assert_eq!(pick(&[Some(5.0)]), 0);
        assert_eq!(pick(&[]), 0);
    }

    #[test]
    fn choices_round_trip_and_bad_entries_are_ignored() {
        let dir = std::env::temp_dir().join(format!("fusec-gemm-tuning-{}", std::process::id()));
        let p = entry_path(&dir, "NVIDIA H100 80GB HBM3", 130100, "m=1 n=2 k=3");
        let data = [1u64, 2, 3, u64::MAX, 0, 7, 8, 1 << 40];
        assert_eq!(load(&p), None);
        store(&p, &data);
        assert_eq!(load(&p), Some(data));
        // Keys differ by GPU, library version and product.
        let others = [
            entry_path(&dir, "NVIDIA H200", 130100, "m=1 n=2 k=3"),
            entry_path(&dir, "NVIDIA H100 80GB HBM3", 130000, "m=1 n=2 k=3"),
            entry_path(&dir, "NVIDIA H100 80GB HBM3", 130100, "m=1 n=2 k=4"),
        ];
        for o in &others {
            assert_ne!(o, &p);
            assert_eq!(load(o), None);
        }
        // Truncated, or another file's bytes: not trusted.
        std::fs::write(&p, &MAGIC[..]).unwrap();
        assert_eq!(load(&p), None);
        std::fs::write(&p, [0u8; 72]).unwrap();
        assert_eq!(load(&p), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Timing reruns a product; one that reads what it writes must be
    /// found, one that does not must not be (or nothing would be timed).
    #[test]
    fn products_writing_over_their_inputs_are_found() {
        // D [4, 8] bf16 = 64 bytes; A [4, 16], B [16, 8] bf16.
        let s = GemmShape::plain(4, 8, 16, GemmElem::BF16, GemmElem::BF16);
        // Our A at 2000 (128 bytes), our B at 1000 (256 bytes).
        let w = |s: &GemmShape, ep: &EpiloguePtrs, d: u64| writes_over_inputs(s, ep, 2000, 1000, d);
        let none = EpiloguePtrs::default();
        assert!(!w(&s, &none, 5000));
        // D over the end of our A, over our B's first byte.
        assert!(w(&s, &none, 2127));
        assert!(!w(&s, &none, 2128));
        assert!(w(&s, &none, 1000 - 63));
        assert!(!w(&s, &none, 1000 - 64));
        // The residual in place, or beside D.
        let res = |r| EpiloguePtrs {
            residual: Some(r),
            ..none
        };
        assert!(w(&s, &res(5000), 5000));
        assert!(!w(&s, &res(5064), 5000));
        // DGELU's aux in place; GELU's aux out over the bias.
        let dgelu = EpiloguePtrs {
            dgelu_aux_in: Some(5000),
            ..none
        };
        assert!(w(&s, &dgelu, 5000));
        let gelu = EpiloguePtrs {
            bias: Some(9000),
            gelu_aux_out: Some(8990),
            ..none
        };
        assert!(w(&s, &gelu, 5000));
        // Batches reach further: 3 batches of D 100 elements apart.
        let batched = GemmShape {
            batch: 3,
            batch_stride_a: 64,
            batch_stride_b: 0,
            batch_stride_d: 100,
            ..s
        };
        // D spans (2 * 100 + 32) * 2 = 464 bytes from 5000.
        assert!(w(&batched, &res(5463), 5000));
        assert!(!w(&batched, &res(5464), 5000));
    }

    #[test]
    fn ranges_overlap_only_when_they_share_a_byte() {
        assert!(overlap((0, 10), (9, 20)));
        assert!(overlap((5, 6), (0, 100)));
        assert!(!overlap((0, 10), (10, 20)));
        assert!(!overlap((10, 20), (0, 10)));
    }
}
