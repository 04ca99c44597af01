//! Bulk tensor copies (TMA, sm_90) for the Hopper attention kernels: one
//! thread copies a whole `[rows][64]` box of a 16-bit tensor from global
//! into shared memory, with the 128-byte swizzle that wgmma's descriptors
//! read without bank conflicts, and the copy signals an mbarrier by the
//! bytes it delivers. It replaces per-thread 16-byte `cp.async` copies,
//! whose instructions bound the producers (docs/benchmarks.md).
//!
//! # Tensor maps
//!
//! A copy names a *tensor map* (`CUtensorMap`, 128 opaque bytes the driver
//! encodes on the host: base address, extents, strides, box, swizzle). The
//! kernel takes one per copied tensor as a `const __grid_constant__`
//! parameter after all its other parameters ([`params`]); the runtime
//! encodes each [`TensorMap`] for the launch's buffers and sizes. A map
//! views a `[B, T, H, D]` attention input with its view's strides, in
//! memory order innermost first: features (64 per box), heads (1), rows
//! (`box_rows`), batch (1). Rows past T (or before 0) read as zeros.
//!
//! # Shared-memory layout
//!
//! A `[rows][D]` tile lands as `D / 64` boxes, box `a` (features `64a ..
//! 64a + 63`) at byte `a * rows * 128` of the tile, row `r` at byte `128 r`
//! of its box, the 16-byte chunk `c` of a row stored at chunk `c ^ (r %
//! 8)`: the 128-byte swizzle, a function of the address bits (chunk bits
//! 4..6 XOR row bits 7..9), so every tile starts 1024-byte aligned. wgmma
//! reads it through swizzled descriptors ([`desc_kmajor`],
//! [`mnmajor_base`], [`desc_mnmajor`]).
//!
//! In a host build a tensor map is a plain struct built inside the kernel
//! from its pointer arguments ([`host_maps`]), a copy a loop that writes the
//! same swizzled bytes, and the emulated wgmma reads through the swizzle.

use super::attention::Access;
use super::templates::Ctx;
use crate::ir::{Dim, Graph};
use petgraph::stable_graph::NodeIndex;

/// Bytes per swizzled row (one box row): 64 16-bit features.
pub const SWIZZLE_BYTES: u64 = 128;
/// 16-bit features per box row.
pub const ATOM: u64 = SWIZZLE_BYTES / 2;
/// Shared-memory alignment of a swizzled tile (8 rows of 128 bytes): a
/// kernel asks for this much more dynamic shared memory and aligns its base.
pub const ALIGN: u64 = 1024;

/// How to encode one kernel parameter's tensor map for a launch: a view of
/// a `[B, T, H, D]` 16-bit attention input, copied in boxes of `ATOM`
/// features by `box_rows` rows.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMap {
    /// The kernel parameter's name.
    pub name: String,
    /// The buffer's position among the kernel's arguments (inputs, then
    /// outputs).
    pub arg: usize,
    /// Element offset of element (0, 0, 0, 0) in the buffer.
    pub offset: Dim,
    /// Extents, innermost first: D, H, T, B.
    pub dims: [Dim; 4],
    /// Strides in elements of H, T and B.
    pub strides: [Dim; 3],
    /// Rows (T) per box.
    pub box_rows: u32,
}

/// A [`TensorMap`] with sizes bound: what `cuTensorMapEncodeTiled` takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMapSizes {
    pub offset_bytes: u64,
    pub dims: [u64; 4],
    pub strides_bytes: [u64; 3],
    pub boxes: [u32; 4],
}

impl TensorMap {
    /// Op input `i` of attention node `n` (a `[B, T, H, D]` view) as map
    /// `name`, `box_rows` rows per copy; `None` for a view that repeats
    /// elements (a stride of 0 on an axis that may be longer than 1), which
    /// a tensor map cannot describe.
    pub(crate) fn of_input(
        g: &Graph,
        c: &Ctx,
        n: NodeIndex,
        i: usize,
        name: &str,
        box_rows: u64,
    ) -> Option<TensorMap> {
        let a = Access::input(g, c, n, i);
        let shape = &g.ty(g.inputs(n)[i]).shape;
        let s = a.strides();
        let repeats =
            |axis: usize| s[axis].as_const() == Some(0) && shape[axis].as_const() != Some(1);
        if (0..3).any(repeats) {
            return None;
        }
        Some(TensorMap {
            name: name.to_string(),
            arg: c.ins[i],
            offset: a.offset().clone(),
            dims: [
                shape[3].clone(),
                shape[2].clone(),
                shape[1].clone(),
                shape[0].clone(),
            ],
            strides: [s[2].clone(), s[1].clone(), s[0].clone()],
            box_rows: box_rows as u32,
        })
    }

    /// The sizes for `env`; `None` for an unbound symbol or a negative size.
    /// An axis of extent 1 (whose view stride may be 0: it is never stepped)
    /// takes the packed stride, which the driver accepts.
    pub fn sizes(&self, env: &dyn Fn(&str) -> Option<i64>) -> Option<TensorMapSizes> {
        let ev = |d: &Dim| d.eval(env).and_then(|x| u64::try_from(x).ok());
        let mut s = TensorMapSizes {
            offset_bytes: 2 * ev(&self.offset)?,
            dims: [
                ev(&self.dims[0])?,
                ev(&self.dims[1])?,
                ev(&self.dims[2])?,
                ev(&self.dims[3])?,
            ],
            strides_bytes: [
                2 * ev(&self.strides[0])?,
                2 * ev(&self.strides[1])?,
                2 * ev(&self.strides[2])?,
            ],
            boxes: [ATOM as u32, 1, self.box_rows, 1],
        };
        let mut packed = 2 * s.dims[0];
        for i in 0..3 {
            if s.dims[i + 1] == 1 {
                s.strides_bytes[i] = packed.next_multiple_of(16);
            }
            packed = s.strides_bytes[i] * s.dims[i + 1];
        }
        Some(s)
    }

    /// The host build's definition of the map (see [`host_maps`]).
    fn host_def(&self) -> String {
        let c = |d: &Dim| format!("(fs_i64)({})", d.to_c());
        format!(
            "    FS_TMAP_HOST({}, reinterpret_cast<const unsigned short*>(in{}) + {}, {}, {}, {}, {}, {}, {}, {}, {});\n",
            self.name,
            self.arg,
            c(&self.offset),
            c(&self.dims[0]),
            c(&self.dims[1]),
            c(&self.dims[2]),
            c(&self.dims[3]),
            c(&self.strides[0]),
            c(&self.strides[1]),
            c(&self.strides[2]),
            self.box_rows
        )
    }
}

/// `head`'s kernel signature with `maps` as its last parameters (nothing in
/// a host build, which defines them in the body instead).
pub(crate) fn params(head: &str, maps: &[TensorMap]) -> Option<String> {
    let close = head.rfind(")\n{")?;
    let extra: String = maps
        .iter()
        .map(|m| format!("\n    FS_TMAP_PARAM({})", m.name))
        .collect();
    Some(format!("{}{extra}{}", &head[..close], &head[close..]))
}

/// The body's first lines in a host build: each map from the kernel's
/// pointer arguments and size parameters.
pub(crate) fn host_maps(maps: &[TensorMap]) -> String {
    let defs: String = maps.iter().map(TensorMap::host_def).collect();
    format!("#ifndef __CUDA_ARCH__\n{defs}#endif\n")
}

/// The wgmma descriptor of a swizzled tile of `rows` rows read K-major
/// (the features are K) at the 16-feature step `kk` (C): `desc` the
/// tile's descriptor (C, `fs_make_desc_sw128(tile)`), stepped to box `16 kk
/// / ATOM` and 16 features further along the box's rows per step within
/// it. Stepping a descriptor is one add to its address field
/// (`fs_desc_at`), where making one from a pointer took about eight
/// instructions per wgmma.
pub(crate) fn desc_kmajor(desc: &str, rows: u64, kk: &str) -> String {
    format!(
        "fs_desc_at({desc}, ({kk}) / {steps} * {box_bytes} + ({kk}) % {steps} * 32)",
        steps = ATOM / 16,
        box_bytes = rows * SWIZZLE_BYTES
    )
}

/// The descriptor (C) of a swizzled tile of `rows` rows read MN-major (the
/// features are N, the rows K): 64-feature boxes `rows * 128` bytes apart.
pub(crate) fn mnmajor_base(tile: &str, rows: u64) -> String {
    format!(
        "fs_make_desc_sw128_mn({tile}, {lbo})",
        lbo = rows * SWIZZLE_BYTES
    )
}

/// [`mnmajor_base`]'s descriptor `desc` (C) stepped to row `16 kk` (C).
pub(crate) fn desc_mnmajor(desc: &str, kk: &str) -> String {
    format!(
        "fs_desc_at({desc}, ({kk}) * {step})",
        step = 16 * SWIZZLE_BYTES
    )
}

/// The CUDA building blocks: the map type and parameter, the copy, the
/// mbarrier's byte count, swizzled descriptors and the aligned base; their
/// host versions. After `WGMMA_COMMON` (fs_desc, fs_mbar, fs_smem_addr).
pub(crate) const HELPERS: &str = r#"// Bulk tensor copies (TMA) with the 128-byte swizzle; a host build copies
// the same bytes with a loop.
#ifndef FS_TMA_HELPERS
#define FS_TMA_HELPERS
#ifdef __CUDA_ARCH__
// The driver's CUtensorMap: 128 opaque bytes, passed by value.
struct alignas(64) fs_tmap {
    unsigned long long opaque[16];
};
#define FS_TMAP_PARAM(name) , const __grid_constant__ fs_tmap name
#define FS_TMAP_HOST(...)
// The box at coordinates (feature, head, row, batch) into dst (1024-byte
// aligned); its bytes complete a transaction of mbarrier `bar`.
__device__ __forceinline__ void fs_tma_load(void* dst, const fs_tmap& map, int c0, int c1, int c2, int c3, fs_mbar* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(fs_smem_addr(dst)), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                 "r"(fs_smem_addr(bar))
                 : "memory");
}
// Arrives on `m` and expects `bytes` more of copies before its phase completes.
__device__ __forceinline__ void fs_mbar_expect_tx(fs_mbar* m, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(fs_smem_addr(m)), "r"(bytes) : "memory");
}
// After a thread's copies: the GPU counts their bytes (nothing to do).
__device__ __forceinline__ void fs_mbar_tma_issued(fs_mbar*) {}
// Descriptors of a 128-byte-swizzled tile (layout type 1): K-major, 8-row
// groups 1024 bytes apart; MN-major, also 64-feature boxes `lbo` bytes apart.
__device__ __forceinline__ fs_desc fs_make_desc_sw128(const void* p) { return fs_make_desc(p, 16, 1024) | (1ull << 62); }
__device__ __forceinline__ fs_desc fs_make_desc_sw128_mn(const void* p, unsigned lbo) { return fs_make_desc(p, lbo, 1024) | (1ull << 62); }
__device__ __forceinline__ unsigned char* fs_align1024(unsigned char* p) { return p + ((1024u - (fs_smem_addr(p) & 1023u)) & 1023u); }
#else
struct fs_tmap {
    const unsigned short* base;
    fs_i64 dim[4], stride[3];
    int rows;
};
#define FS_TMAP_PARAM(name)
#define FS_TMAP_HOST(name, base, d0, d1, d2, d3, s1, s2, s3, rows) const fs_tmap name = {base, {d0, d1, d2, d3}, {s1, s2, s3}, rows}
inline unsigned char* fs_swizzle128(unsigned char* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return reinterpret_cast<unsigned char*>(a ^ (((a >> 7) & 7) << 4));
}
inline void fs_tma_load(void* dst, const fs_tmap& m, int c0, int c1, int c2, int c3, fs_mbar*) {
    unsigned char* const out = static_cast<unsigned char*>(dst);
    if (reinterpret_cast<uintptr_t>(out) % 1024 != 0) {
        fprintf(stderr, "tma: a swizzled box does not start 1024-byte aligned\n");
        exit(5);
    }
    for (int r = 0; r < m.rows; ++r)
        for (int e = 0; e < 64; ++e) {
            const fs_i64 x[4] = {(fs_i64)c0 + e, c1, (fs_i64)c2 + r, c3};
            unsigned short v = 0;
            bool in = true;
            for (int i = 0; i < 4; ++i) in = in && x[i] >= 0 && x[i] < m.dim[i];
            if (in) v = m.base[x[0] + x[1] * m.stride[0] + x[2] * m.stride[1] + x[3] * m.stride[2]];
            memcpy(fs_swizzle128(out + r * 128 + e * 2), &v, 2);
        }
}
// Host copies land at once: the expected bytes are in when the issuing
// thread arrives after them.
inline void fs_mbar_expect_tx(fs_mbar*, unsigned) {}
inline void fs_mbar_tma_issued(fs_mbar* m) { fs_emu_mbar_arrive(m); }
inline fs_desc fs_make_desc_sw128(const void* p) { return {static_cast<const unsigned char*>(p), 16, 1024, 128}; }
inline fs_desc fs_make_desc_sw128_mn(const void* p, unsigned lbo) { return {static_cast<const unsigned char*>(p), lbo, 1024, 128}; }
inline unsigned char* fs_align1024(unsigned char* p) { return p + ((1024 - reinterpret_cast<uintptr_t>(p) % 1024) % 1024); }
#endif
#endif

"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn map(heads: i64, stride_h: i64) -> TensorMap {
        TensorMap {
            name: "tm_k".into(),
            arg: 1,
            offset: Dim::constant(64),
            dims: [64, heads, 1000, 2].map(Dim::constant),
            strides: [stride_h, 3 * 64 * heads, 1000 * 3 * 64 * heads].map(Dim::constant),
            box_rows: 64,
        }
    }

    #[test]
    fn sizes_are_bytes_in_memory_order() {
        let s = map(4, 64).sizes(&|_| None).unwrap();
        assert_eq!(s.offset_bytes, 128);
        assert_eq!(s.dims, [64, 4, 1000, 2]);
        assert_eq!(s.strides_bytes, [128, 1536, 1_536_000]);
        assert_eq!(s.boxes, [64, 1, 64, 1]);
    }

    /// One kv head: the view's head stride is 0, which the driver refuses;
    /// the axis is never stepped, so the packed stride stands in.
    #[test]
    fn a_single_head_takes_the_packed_stride() {
        let s = map(1, 0).sizes(&|_| None).unwrap();
        assert_eq!(s.strides_bytes, [128, 384, 384_000]);
    }

    #[test]
    fn unbound_sizes_give_none() {
        let mut m = map(4, 64);
        m.dims[2] = Dim::symbol("T");
        assert!(m.sizes(&|_| None).is_none());
        assert_eq!(m.sizes(&|s| (s == "T").then_some(10)).unwrap().dims[2], 10);
    }
}
