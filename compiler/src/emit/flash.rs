//! CUDA C for a tensor-core FlashAttention-2 forward kernel (Ampere-style
//! `mma.sync.m16n8k16`, runs on sm_80 and sm_90). The session swaps it in
//! for the plan's simple kernel (`attention.rs`) wherever it applies;
//! `FUSEC_ATTENTION=simple` keeps the simple one.
//!
//! # Launch contract
//!
//! [`flash_kernel`] (or `flash_forward` inside the crate) returns the
//! *complete* source of one kernel and its [`FlashLaunch`]. The runtime must:
//!
//! - compile it like every generated kernel (the prelude pasted in place of
//!   its `#include`; no other header); it is `__launch_bounds__(128)`;
//! - pass the usual arguments: `in0` = q, `in1` = k, `in2` = v (the arena
//!   addresses of their buffers; the kernel applies the views itself),
//!   `out0` = O (contiguous `[B, T, Hq, D]`, the input dtype), `out1` = LSE
//!   (contiguous `[B, Hq, T]`, f32), then every symbolic size of the graph in
//!   `Graph::dims` order, as `long long`;
//! - launch `grid = (ceil(T / 64), Hq, B)` ([`FlashLaunch::grid`] evaluates
//!   it; `grid_c` has it as C), `block = (128, 1, 1)`, **no dynamic shared
//!   memory** (the kernel declares [`FlashLaunch::static_smem_bytes`] of
//!   static shared memory, below the 48 KiB that needs no opt-in);
//! - keep every buffer 16-byte aligned (the arena aligns to 256): the kernel
//!   moves q, k and v in 16-byte loads. [`flash_kernel`] returns `None`
//!   unless every row of q, k and v starts on a multiple of 8 elements (view
//!   offsets and strides divisible by 8, the last stride 1), so the buffer
//!   alignment is all the runtime has to guarantee.
//!
//! `gridDim.y` and `gridDim.z` are limited to 65535: Hq and B above that are
//! not supported (`FlashLaunch::grid` returns `None`).
//!
//! # Design
//!
//! One block of 4 warps owns 64 query rows of one (batch, query head); warp
//! `w` owns rows `16w .. 16w + 15`. The queries go through shared memory once
//! into registers (A fragments). Keys and values then stream through shared
//! memory 64 rows at a time (rows padded by 8 elements, so fragment reads
//! are free of bank conflicts): S = Q K^T with `mma.m16n8k16` (f32
//! accumulation), the scale folded into log2 units for `ex2`, an online
//! softmax per row (running max, running sum, accumulator rescale), P
//! rounded to 16 bits in registers (the S accumulator layout *is* the A
//! fragment layout of P, so no shuffle is needed) and O += P V with the mma
//! again. Causal: key tiles after the query tile are never visited, and only
//! tail and diagonal tiles are masked. Keys past S and queries past T are
//! zero-filled on load and masked / not stored.
//!
//! The GPU-only operations are small wrappers: `fs_mma_16816_*`,
//! `fs_shfl_xor` and `fs_exp2` are one PTX instruction each (inline asm,
//! `__shfl_xor_sync`), `fs_ld32`/`fs_copy16`/`fs_zero16` plain 4- and
//! 16-byte accesses. In a host build the last three are `memcpy`s and the
//! warp operations call `fs_emu_*` functions an emulation supplies (`tests/flash_host/mma_emu.h`, which rebuilds each
//! mma's matrices from the 32 lanes' fragments with the PTX ISA's layouts).
//! The same kernel text therefore runs on the host against the reference.

use super::attention::Access;
use super::cuda::{float_lit, header, store, NEG_INF};
use super::templates::Ctx;
use super::tma::{self, TensorMap};
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::{Kernel, Program};
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// Query rows per block (4 warps of 16).
pub const TILE_Q: u64 = 64;
/// Keys per shared-memory tile.
pub const TILE_K: u64 = 64;
/// Threads per block.
pub const THREADS: u32 = 128;
/// Padding of each shared-memory row, in elements (shared with the
/// backward's kernels).
pub(crate) const PAD: u64 = 8;

/// How the runtime launches a FlashAttention kernel (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct FlashLaunch {
    /// Query rows per block: `grid.x = ceil(q_len / tile_q)`.
    pub tile_q: u64,
    /// T, Hq, B of the op.
    pub q_len: Dim,
    pub q_heads: Dim,
    pub batch: Dim,
    /// The grid as C expressions of the kernel's size parameters.
    pub grid_c: [String; 3],
    /// Threads per block (x only).
    pub block: u32,
    /// Static shared memory the kernel declares.
    pub static_smem_bytes: u64,
    /// Dynamic shared memory to pass at launch.
    pub dynamic_smem_bytes: u64,
    /// Tensor maps to pass by value after the kernel's other arguments, in
    /// order (Hopper's bulk tensor copies).
    pub tensor_maps: Vec<TensorMap>,
}

impl FlashLaunch {
    /// `(grid.x, grid.y, grid.z)` for concrete sizes; `None` for an unbound
    /// symbol or a y/z extent over 65535.
    pub fn grid(&self, env: &dyn Fn(&str) -> Option<i64>) -> Option<[u64; 3]> {
        let dims = [self.q_len.clone(), self.q_heads.clone(), self.batch.clone()];
        grid_of(&dims, [self.tile_q, 1, 1], env)
    }
}

/// An attention op's sizes when the tensor-core kernels support it (shared
/// by the forward and `flash_bwd.rs`).
pub(crate) struct Config {
    pub(crate) batch: Dim,
    pub(crate) q_len: Dim,
    pub(crate) kv_len: Dim,
    pub(crate) q_heads: Dim,
    pub(crate) kv_heads: Dim,
    pub(crate) head_dim: u64,
    pub(crate) group: i64,
    pub(crate) causal: bool,
    pub(crate) scale: f64,
    pub(crate) dt: DType,
}

impl Config {
    /// For op `n` with q, k, v its inputs 0..3: `None` unless they are bf16
    /// or f16 with a head dim of 64 or 128, the head counts are constants,
    /// the inputs in `tiled` have 16-byte aligned contiguous rows, the
    /// inputs and outputs listed as f32 are f32 and every other one has
    /// q's dtype.
    pub(crate) fn of(
        g: &Graph,
        c: &Ctx,
        n: NodeIndex,
        (causal, scale): (bool, f64),
        tiled: &[usize],
        f32_in: &[usize],
        f32_out: &[usize],
    ) -> Option<Config> {
        let ins = g.inputs(n);
        if c.ins.len() != ins.len() || c.outs.len() != g.g[n].outputs.len() {
            return None;
        }
        let (q, k, v) = (g.ty(ins[0]), g.ty(ins[1]), g.ty(ins[2]));
        let dt = q.dtype;
        let want = |f32: bool| if f32 { DType::F32 } else { dt };
        if !matches!(dt, DType::BF16 | DType::F16)
            || (0..ins.len()).any(|i| c.in_dt(i) != want(f32_in.contains(&i)))
            || (0..c.outs.len()).any(|o| c.out_dt(o) != want(f32_out.contains(&o)))
        {
            return None;
        }
        let d = q.shape[3].as_const()?;
        if !matches!(d, 64 | 128) || k.shape[3].as_const()? != d || v.shape[3].as_const()? != d {
            return None;
        }
        let group = q.shape[2].as_const()? / k.shape[2].as_const().filter(|&h| h > 0)?;
        if group < 1
            || !tiled
                .iter()
                .all(|&i| Access::input(g, c, n, i).rows_aligned())
        {
            return None;
        }
        Some(Config {
            batch: q.shape[0].clone(),
            q_len: q.shape[1].clone(),
            kv_len: k.shape[1].clone(),
            q_heads: q.shape[2].clone(),
            kv_heads: k.shape[2].clone(),
            head_dim: d as u64,
            group,
            causal,
            scale,
            dt,
        })
    }
}

fn config(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<Config> {
    let Op::Attention(a) = &g.g[n].op else {
        return None;
    };
    Config::of(g, c, n, (a.causal, a.scale), &[0, 1, 2], &[], &[1])
}

/// The grid as C expressions of the kernel's size parameters: `dims[0]`
/// cut into tiles of `tile`, then `dims[1]` and `dims[2]` whole.
pub(crate) fn grid_c_of(dims: &[Dim; 3], tile: u64) -> [String; 3] {
    [
        format!("({} + {}LL) / {tile}LL", dims[0].to_c(), tile - 1),
        dims[1].to_c(),
        dims[2].to_c(),
    ]
}

/// `ceil(dims[a] / tiles[a])` per grid axis for concrete sizes; `None` for
/// an unbound symbol or a y/z extent over 65535.
pub(crate) fn grid_of(
    dims: &[Dim; 3],
    tiles: [u64; 3],
    env: &dyn Fn(&str) -> Option<i64>,
) -> Option<[u64; 3]> {
    let mut g = [0u64; 3];
    for ((x, dim), tile) in g.iter_mut().zip(dims).zip(tiles) {
        let n = u64::try_from(dim.eval(env)?).ok()?;
        *x = n.div_ceil(tile).max(1);
    }
    (g[1] <= 65535 && g[2] <= 65535).then_some(g)
}

/// Which tensor-core instructions a FlashAttention kernel is written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashArch {
    /// `mma.sync.m16n8k16` and `ldmatrix`: sm_80 and newer (this module).
    Sm80,
    /// `wgmma.mma_async` from shared-memory descriptors and `cp.async`:
    /// sm_90a only, compiled for `sm_90a` (`flash_sm90.rs`).
    Sm90a,
}

impl FlashArch {
    /// The best kernel family for a GPU of compute capability `cap`; `None`
    /// before sm_80 (no bf16 mma).
    pub fn for_capability(cap: (i32, i32)) -> Option<FlashArch> {
        match cap {
            (9, 0) => Some(FlashArch::Sm90a),
            c if c >= (8, 0) => Some(FlashArch::Sm80),
            _ => None,
        }
    }
}

/// The complete source of the FlashAttention forward kernel of attention op
/// `n` in kernel `k` (its inputs and outputs in op order, as `op_kernel`
/// lays them out) for `arch`, with its launch; `None` when the op is not
/// supported (see `flash_forward`).
pub fn flash_kernel(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    n: NodeIndex,
    source: Option<&str>,
    arch: FlashArch,
) -> Option<(String, FlashLaunch)> {
    let c = Ctx::for_op(g, p, k, n);
    match arch {
        FlashArch::Sm80 => emit(g, &c, n, source),
        FlashArch::Sm90a => super::flash_sm90::emit(g, &c, n, config(g, &c, n)?, source),
    }
}

/// The FlashAttention-2 forward kernel for `Op::Attention` node `n`: the
/// whole kernel source (file-scope helpers, the signature `header` writes,
/// the body) and its launch. `None` unless the dtype is bf16 or f16, q, k
/// and v share a head dim of 64 or 128, the head counts are constants, and
/// every row of q, k and v is 16-byte aligned and contiguous. Any causal
/// flag, grouped-query ratio, T and S. The entry point for
/// `templates::op_kernel` once the runtime switches the kernel on.
#[allow(dead_code)]
pub(crate) fn flash_forward(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<(String, FlashLaunch)> {
    emit(g, c, n, None)
}

fn emit(g: &Graph, c: &Ctx, n: NodeIndex, source: Option<&str>) -> Option<(String, FlashLaunch)> {
    let cfg = config(g, c, n)?;
    let mut text = String::new();
    body(&mut text, g, c, n, &cfg);
    // The key and value tiles, 16-bit elements, in static shared memory.
    let smem = 2 * TILE_K * (cfg.head_dim + PAD) * 2;
    let shape = ForwardShape {
        tile_q: TILE_Q,
        block: THREADS,
        bounds: THREADS.to_string(),
        static_smem: smem,
        dynamic_smem: 0,
        maps: Vec::new(),
    };
    forward_kernel(g, c, source, "", &text, &cfg, shape)
}

/// How a forward kernel is launched and bounded.
pub(crate) struct ForwardShape {
    pub(crate) tile_q: u64,
    pub(crate) block: u32,
    /// `__launch_bounds__`'s arguments.
    pub(crate) bounds: String,
    pub(crate) static_smem: u64,
    pub(crate) dynamic_smem: u64,
    /// Tensor maps the kernel takes after its other parameters.
    pub(crate) maps: Vec<TensorMap>,
}

/// A forward kernel's whole text (the plan kernel's header, `HELPERS`, then
/// `helpers`, the signature with its launch bounds, `body`) and its launch:
/// what both forward families share.
pub(crate) fn forward_kernel(
    g: &Graph,
    c: &Ctx,
    source: Option<&str>,
    helpers: &str,
    body: &str,
    cfg: &Config,
    shape: ForwardShape,
) -> Option<(String, FlashLaunch)> {
    let head = tma::params(&header(g, c.p, c.k, source), &shape.maps)?;
    let sig = "extern \"C\" __global__ void ";
    let at = head.find(sig)?;
    let mut s = String::new();
    s.push_str(&head[..at]);
    s.push_str(HELPERS);
    s.push_str(helpers);
    let bounds = format!("{sig}__launch_bounds__({}) ", shape.bounds);
    s.push_str(&head[at..].replacen(sig, &bounds, 1));
    s.push_str(body);
    s.push_str("}\n");
    let launch = FlashLaunch {
        tile_q: shape.tile_q,
        grid_c: grid_c_of(
            &[cfg.q_len.clone(), cfg.q_heads.clone(), cfg.batch.clone()],
            shape.tile_q,
        ),
        q_len: cfg.q_len.clone(),
        q_heads: cfg.q_heads.clone(),
        batch: cfg.batch.clone(),
        block: shape.block,
        static_smem_bytes: shape.static_smem,
        dynamic_smem_bytes: shape.dynamic_smem,
        tensor_maps: shape.maps,
    };
    Some((s, launch))
}

/// File-scope building blocks, once per translation unit (the backward's
/// kernels include them too).
pub(crate) const HELPERS: &str = r#"// FlashAttention building blocks: single PTX instructions on the GPU; a
// host build supplies fs_emu_* (an emulation of one warp, with the PTX ISA's
// fragment layouts) so that the same kernel runs in tests.
#ifndef FS_FLASH_HELPERS
#define FS_FLASH_HELPERS
#ifdef __CUDA_ARCH__
// d += a * b for one warp, m16n8k16: a is 16x16 row-major (4 registers of two
// 16-bit values), b 16x8 column-major (2 registers), d 16x8 in f32.
__device__ __forceinline__ void fs_mma_16816_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void fs_mma_16816_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float fs_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
// 2^x (2 ulp; 2^-inf = 0).
__device__ __forceinline__ float fs_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Two adjacent 16-bit values (4-byte aligned) as one register, low first.
__device__ __forceinline__ unsigned fs_ld32(const unsigned short* p) { return *reinterpret_cast<const unsigned*>(p); }
// 16 bytes, both addresses 16-byte aligned.
__device__ __forceinline__ void fs_copy16(unsigned short* dst, const unsigned short* src) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void fs_zero16(unsigned short* dst) { *reinterpret_cast<uint4*>(dst) = uint4{0u, 0u, 0u, 0u}; }
// A kernel's dynamic shared memory (past the 48 KiB of static shared memory
// that needs no opt-in), 16-byte aligned, as `unsigned char* name`.
#define FS_DYNAMIC_SMEM(name, bytes) \
    extern __shared__ uint4 name##_words[]; \
    unsigned char* const name = reinterpret_cast<unsigned char*>(name##_words)
// Two adjacent 16-bit values (4-byte aligned) from one register, low first.
__device__ __forceinline__ void fs_st32(unsigned short* p, unsigned v) { *reinterpret_cast<unsigned*>(p) = v; }
// p[0] += a, p[1] += b in global memory, atomically (p 8-byte aligned): one
// vector reduction on sm_90, two scalar ones before.
__device__ __forceinline__ void fs_atomic_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}
// ldmatrix.x4: lanes 8i .. 8i + 7 give the rows of 8x8 matrix i (16-byte
// aligned shared memory); r[i] gets this lane's two elements of matrix i:
// (row lane / 4, col 2 * (lane % 4)) low, the next column high.
__device__ __forceinline__ void fs_ldsm_x4(unsigned (&r)[4], const unsigned short* row) {
    asm volatile("{ .reg .u64 a64; .reg .u32 a; cvta.to.shared.u64 a64, %4; cvt.u32.u64 a, a64;\n"
                 "  ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [a]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(row));
}
// ldmatrix.x4.trans: lanes 8i .. 8i + 7 give the rows of 8x8 matrix i (16-byte
// aligned shared memory); r[i] gets this lane's two elements of matrix i
// transposed: (row 2 * (lane % 4), col lane / 4) low, the next row high.
__device__ __forceinline__ void fs_ldsm_x4_t(unsigned (&r)[4], const unsigned short* row) {
    asm volatile("{ .reg .u64 a64; .reg .u32 a; cvta.to.shared.u64 a64, %4; cvt.u32.u64 a, a64;\n"
                 "  ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [a]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(row));
}
#else
inline void fs_mma_16816_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { fs_emu_mma_16816(d, a, b0, b1, true); }
inline void fs_mma_16816_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { fs_emu_mma_16816(d, a, b0, b1, false); }
inline float fs_shfl_xor(float v, int lane_mask) { return fs_emu_shfl_xor(v, lane_mask); }
inline float fs_exp2(float x) { return exp2f(x); }
inline unsigned fs_ld32(const unsigned short* p) {
    unsigned u;
    memcpy(&u, p, 4);
    return u;
}
inline void fs_copy16(unsigned short* dst, const unsigned short* src) { memcpy(dst, src, 16); }
inline void fs_zero16(unsigned short* dst) { memset(dst, 0, 16); }
inline void fs_st32(unsigned short* p, unsigned v) { memcpy(p, &v, 4); }
// On the host a block's dynamic shared memory is one static array, as its
// `__shared__` arrays are (blocks run one after another).
#define FS_DYNAMIC_SMEM(name, bytes) alignas(16) static unsigned char name[bytes]
// Host blocks run one after another and a block's warps add into disjoint
// elements, so a plain sum is what the atomics compute.
inline void fs_atomic_add2(float* p, float a, float b) {
    p[0] += a;
    p[1] += b;
}
inline void fs_ldsm_x4(unsigned (&r)[4], const unsigned short* row) { fs_emu_ldsm_x4(r, row, false); }
inline void fs_ldsm_x4_t(unsigned (&r)[4], const unsigned short* row) { fs_emu_ldsm_x4(r, row, true); }
#endif
// One m16n8k16 A fragment (rows r0 .. r0 + 15, columns c0 .. c0 + 15) of a
// row-major tile in shared memory whose rows are `row` elements apart, `at`
// pointing at (r0, c0), in one ldmatrix: the four 8x8 quarters are a[0]
// (rows 0-7, columns 0-7), a[1] (rows 8-15), a[2] (columns 8-15), a[3].
__device__ __forceinline__ void fs_a_frag(unsigned (&a)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4(a, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8);
}
// The same A fragment from a tile stored transposed ([column][row]: element
// (r, c) at at[c * row + r]), in one ldmatrix.trans: `at` points at
// (r0, c0), i.e. stored row c0, column r0.
__device__ __forceinline__ void fs_a_frag_t(unsigned (&a)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4_t(a, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8);
}
// The B fragments (column-major) of two m16n8k16 products from a row-major
// [n][k] tile in shared memory (B transposed, as K is for S = Q K^T), `at`
// pointing at (n0, k0): b[0], b[1] for n0 .. n0 + 7 and b[2], b[3] for
// n0 + 8 .. n0 + 15, k0 .. k0 + 15, in one ldmatrix.
__device__ __forceinline__ void fs_b_frags(unsigned (&b)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4(b, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8);
}
// The B fragments (column-major, two 16-bit values per register) of two
// m16n8k16 products from a row-major [k][n] tile in shared memory whose rows
// are `row` elements apart, `at` pointing at (k0, n0): b[0], b[1] for columns
// n0 .. n0 + 7 and b[2], b[3] for n0 + 8 .. n0 + 15, rows k0 .. k0 + 15. One
// ldmatrix.trans instead of eight 16-bit loads: lane l gives row l % 8 (+ 8
// for lanes 8-15 and 24-31) at column + 8 for lanes 16-31.
__device__ __forceinline__ void fs_b_frags_t(unsigned (&b)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4_t(b, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8);
}
// Two floats rounded to 16 bits and packed into one mma operand, lo in the low half.
__device__ __forceinline__ unsigned fs_pack_bf16(float lo, float hi) { return (unsigned)fs_to_bf16(lo) | ((unsigned)fs_to_bf16(hi) << 16); }
__device__ __forceinline__ unsigned fs_pack_f16(float lo, float hi) { return (unsigned)fs_to_f16(lo) | ((unsigned)fs_to_f16(hi) << 16); }
#endif

"#;

fn body(s: &mut String, g: &Graph, c: &Ctx, n: NodeIndex, cfg: &Config) {
    let q = Access::input(g, c, n, 0);
    let k = Access::input(g, c, n, 1);
    let v = Access::input(g, c, n, 2);
    let (elem, ty) = elem_names(cfg.dt);
    let mma = format!("fs_mma_16816_{elem}");
    let pack = format!("fs_pack_{elem}");
    // K^T's fragments by ldmatrix at D = 64; at D = 128 in 32-bit loads
    // (on an H100 that forward ran 26-34% slower with ldmatrix there; see
    // docs/benchmarks.md).
    let s_products = if cfg.head_dim > 64 {
        format!(
            "                for (int m = n; m < n + 2; ++m) {{\n                    const {ty}* key = &k_tile[(m * 8 + frag_row) * ROW + kk * 16 + frag_col];\n                    {mma}(s[m], q_frag[kk], fs_ld32(key), fs_ld32(key + 8));\n                }}"
        )
    } else {
        format!(
            "                unsigned b[4];\n                fs_b_frags(b, &k_tile[n * 8 * ROW + kk * 16], ROW);\n                {mma}(s[n], q_frag[kk], b[0], b[1]);\n                {mma}(s[n + 1], q_frag[kk], b[2], b[3]);"
        )
    };
    let scale_log2 = float_lit(cfg.scale * std::f64::consts::LOG2_E);
    let _ = write!(
        s,
        r#"    // FlashAttention-2 forward on tensor cores (mma.m16n8k16, f32 accumulation).
    // Block (blockIdx.x, blockIdx.y, blockIdx.z) = (tile of {TILE_Q} queries, query head, batch);
    // warp w owns the tile's rows 16w .. 16w + 15. Keys and values stream through
    // shared memory {TILE_K} at a time; scores and probabilities stay in registers.
    constexpr int TILE_Q = {TILE_Q}, TILE_K = {TILE_K}, HEAD_DIM = {d};
    constexpr int ROW = HEAD_DIM + {PAD};      // shared row pitch: 16-byte rows, conflict-free fragment reads
    constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
    const fs_i64 q_len = {t}, kv_len = {s_len}, group = {group};
    const bool causal = {causal};  // if so, keys j > query i are masked
    const float scale_log2 = {scale_log2};  // scale * log2(e): exp(x * scale) = exp2(x * scale_log2)
    const fs_i64 q0 = (fs_i64)blockIdx.x * TILE_Q, h = blockIdx.y, b = blockIdx.z, kv_h = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
    alignas(16) __shared__ {ty} k_tile[TILE_K * ROW];
    alignas(16) __shared__ {ty} v_tile[TILE_K * ROW];

    // 1. The tile's queries into shared memory (v_tile is free until the first
    //    key tile; rows past q_len are zero), then each warp's A fragments:
    //    q_frag[kk] covers features 16kk .. 16kk + 15 of rows q_row and q_row + 8.
    for (int c = threadIdx.x; c < TILE_Q * CHUNKS; c += {THREADS}) {{
        const int r = c / CHUNKS, e = (c % CHUNKS) * 8;
        const fs_i64 i = q0 + r;
        if (i < q_len) fs_copy16(&v_tile[r * ROW + e], &{qp}[{q_at} + e]);
        else fs_zero16(&v_tile[r * ROW + e]);
    }}
    __syncthreads();
    const int q_row = warp * 16 + frag_row;
    unsigned q_frag[HEAD_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) fs_a_frag(q_frag[kk], &v_tile[warp * 16 * ROW + kk * 16], ROW);

    // Running state of this thread's rows q_row (index 0) and q_row + 8 (index 1):
    // the max score in log2 units, this thread's part of the row sum, and the
    // output accumulator o_acc[n][e] = row q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
    float row_max[2] = {{{NEG_INF}, {NEG_INF}}}, row_sum[2] = {{0.0f, 0.0f}};
    float o_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {{
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[n][e] = 0.0f;
    }}
    const fs_i64 i_lo = q0 + q_row, i_hi = i_lo + 8;
    // Causal: key tiles after the query tile's last row are never visited.
    const fs_i64 kv_end = causal && q0 + TILE_Q < kv_len ? q0 + TILE_Q : kv_len;
    for (fs_i64 k0 = 0; k0 < kv_end; k0 += TILE_K) {{
        // 2. Keys and values k0 .. k0 + {last} into shared memory (rows past kv_len zero).
        __syncthreads();  // every warp is done with the previous tile (and the queries)
        for (int c = threadIdx.x; c < TILE_K * CHUNKS; c += {THREADS}) {{
            const int r = c / CHUNKS, e = (c % CHUNKS) * 8;
            const fs_i64 j = k0 + r;
            if (j < kv_len) {{
                fs_copy16(&k_tile[r * ROW + e], &{kp}[{k_at} + e]);
                fs_copy16(&v_tile[r * ROW + e], &{vp}[{v_at} + e]);
            }} else {{
                fs_zero16(&k_tile[r * ROW + e]);
                fs_zero16(&v_tile[r * ROW + e]);
            }}
        }}
        __syncthreads();

        // 3. Scores S = Q K^T of the warp's 16 rows and the tile's keys (not yet
        //    scaled): s[n][e] = row q_row + 8 * (e / 2), key k0 + 8n + frag_col + e % 2.
        //    The B fragments (K^T) of keys 8n .. 8n + 15 in one ldmatrix.
        float s[TILE_K / 8][4];
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) {{
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
        }}
#pragma unroll
        for (int n = 0; n < TILE_K / 8; n += 2) {{
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {{
{s_products}
            }}
        }}

{softmax}        // 6. O += P V. The accumulators of keys 16kk .. 16kk + 15 (s[2kk], s[2kk + 1])
        //    are exactly P's A fragment; the B fragments of features 8n .. 8n + 15
        //    come from the value rows in one ldmatrix.trans.
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; ++kk) {{
            const unsigned p_frag[4] = {{{pack}(s[2 * kk][0], s[2 * kk][1]), {pack}(s[2 * kk][2], s[2 * kk][3]),
                                        {pack}(s[2 * kk + 1][0], s[2 * kk + 1][1]), {pack}(s[2 * kk + 1][2], s[2 * kk + 1][3])}};
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; n += 2) {{
                unsigned b[4];
                fs_b_frags_t(b, &v_tile[kk * 16 * ROW + n * 8], ROW);
                {mma}(o_acc[n], p_frag, b[0], b[1]);
                {mma}(o_acc[n + 1], p_frag, b[2], b[3]);
            }}
        }}
    }}

{epilogue}"#,
        d = cfg.head_dim,
        t = cfg.q_len.to_c(),
        s_len = cfg.kv_len.to_c(),
        group = cfg.group,
        causal = cfg.causal,
        last = TILE_K - 1,
        qp = q.ptr,
        kp = k.ptr,
        vp = v.ptr,
        q_at = q.at(&["b", "i", "h", "0"]),
        k_at = k.at(&["b", "j", "kv_h", "0"]),
        v_at = v.at(&["b", "j", "kv_h", "0"]),
        softmax = masks_and_softmax("q0 + warp * 16", true, cfg.scale),
        epilogue = epilogue(g, c, n),
    );
}

/// Steps 4 and 5 of both forwards: the masks (keys past kv_len, and when
/// causal keys after the query, only in tiles where the warp whose first
/// row is `first_row` can meet one), then the online softmax over
/// `s[TILE_K / 8][4]` in the accumulator layout of m16n8 (and of wgmma),
/// the raw scores. With a positive `scale` the row max is taken before
/// scaling and the scale goes into the exponent (`exp2(s * scale_log2 -
/// max)`, one fused multiply-add an element where a multiply and a
/// subtraction were); otherwise the scores are scaled first.
pub(crate) fn masks_and_softmax(first_row: &str, rescale_now: bool, scale: f64) -> String {
    // The test is on the f32 factor the kernel uses: one that rounds to 0
    // would make a masked score's -inf * 0 a NaN.
    let (prescale, scaled) = if (scale * std::f64::consts::LOG2_E) as f32 > 0.0 {
        ("", " * scale_log2")
    } else {
        (
            "#pragma unroll\n        for (int n = 0; n < TILE_K / 8; ++n) {\n#pragma unroll\n            \
             for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;\n        }\n\n",
            "",
        )
    };
    // The Hopper forward's O += P V of the previous tile is still in flight
    // here, so it keeps the factor and rescales O once that lands.
    let rescale_o = if rescale_now {
        r#"#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                o_acc[n][2 * r] *= rescale;
                o_acc[n][2 * r + 1] *= rescale;
            }"#
    } else {
        "            o_rescale[r] = rescale;"
    };
    format!(
        r#"{prescale}        // 4. Masks, only where a key can be invisible: keys past kv_len (the
        //    last tile) and, when causal, keys after the query (diagonal tiles).
        if (k0 + TILE_K > kv_len || (causal && k0 + TILE_K - 1 > {first_row})) {{
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) {{
#pragma unroll
                for (int e = 0; e < 4; ++e) {{
                    const fs_i64 j = k0 + n * 8 + frag_col + (e & 1), i = e < 2 ? i_lo : i_hi;
                    if (j >= kv_len || (causal && j > i)) s[n][e] = {NEG_INF};
                }}
            }}
        }}

        // 5. Online softmax per row: the new max (over the row's 4 threads),
        //    the old sum and accumulator rescaled, s becomes P = exp2(s{scaled} - max),
        //    the max in log2 units.
#pragma unroll
        for (int r = 0; r < 2; ++r) {{
            float tile_max = {NEG_INF};
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) tile_max = fmaxf(tile_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            tile_max = fmaxf(tile_max, fs_shfl_xor(tile_max, 1));
            tile_max = fmaxf(tile_max, fs_shfl_xor(tile_max, 2));
            const float new_max = fmaxf(row_max[r], tile_max{scaled});
            // No visible key yet: subtract 0, not -inf, so masked scores give 0 and not NaN.
            const float base = new_max == {NEG_INF} ? 0.0f : new_max;
            const float rescale = fs_exp2(row_max[r] - base);
            row_max[r] = new_max;
            float tile_sum = 0.0f;
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) {{
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {{
                    s[n][e] = fs_exp2(s[n][e]{scaled} - base);
                    tile_sum += s[n][e];
                }}
            }}
            row_sum[r] = row_sum[r] * rescale + tile_sum;
{rescale_o}
        }}

"#
    )
}

/// The 16-bit element's PTX name (`bf16`, `f16`, as in `fs_pack_<elem>`
/// and the mma / wgmma type suffixes) and its C type (`fs_bf16`, `fs_f16`):
/// f16 for f16, bf16 otherwise.
pub(crate) fn elem_names(dt: DType) -> (&'static str, &'static str) {
    match dt {
        DType::F16 => ("f16", "fs_f16"),
        _ => ("bf16", "fs_bf16"),
    }
}

/// Step 7 of both forwards: the row sums over each row's 4 threads, then O
/// and the log-sum-exp stored (rows `i_lo`, `i_hi` of this thread).
pub(crate) fn epilogue(g: &Graph, c: &Ctx, n: NodeIndex) -> String {
    let (out, lse) = (Access::output(g, c, n, 0), Access::output(g, c, n, 1));
    let store_o = |idx: &str, val: &str| format!("{}[{idx}] = {};", out.ptr, store(out.dt, val));
    let lse_value =
        format!("sum > 0.0f ? row_max[r] * 0.6931471805599453f + logf(sum) : {NEG_INF}");
    let lse_store = format!(
        "{}[{}] = {};",
        lse.ptr,
        lse.at(&["b", "h", "i"]),
        store(lse.dt, &lse_value)
    );
    format!(
        r#"    // 7. Row sums over the row's 4 threads; O = acc / sum, lse = max * ln 2 + ln(sum)
    //    (output 0 and lse -inf for a row without a visible key, kv_len = 0).
#pragma unroll
    for (int r = 0; r < 2; ++r) {{
        float sum = row_sum[r];
        sum += fs_shfl_xor(sum, 1);
        sum += fs_shfl_xor(sum, 2);
        const fs_i64 i = r == 0 ? i_lo : i_hi;
        if (i < q_len) {{
            const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
            const fs_i64 o_row = {o_at};
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {{
                {store0}
                {store1}
            }}
            if (frag_col == 0) {lse_store}
        }}
    }}
"#,
        o_at = out.at(&["b", "i", "h", "0"]),
        store0 = store_o("o_row + n * 8 + frag_col", "o_acc[n][2 * r] * inv_sum"),
        store1 = store_o(
            "o_row + n * 8 + frag_col + 1",
            "o_acc[n][2 * r + 1] * inv_sum"
        ),
    )
}
