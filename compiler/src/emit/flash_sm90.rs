//! CUDA C for the Hopper (sm_90a) FlashAttention forward: the same
//! algorithm as `flash.rs`, on warpgroup tensor-core instructions
//! (`wgmma.mma_async`) fed from shared memory by descriptors, with the key
//! and value tiles copied asynchronously (`cp.async`) one tile ahead.
//!
//! # Launch contract
//!
//! As `flash.rs`'s (same arguments, outputs and alignment rules), except:
//! compile for `sm_90a` (wgmma exists only there); `grid = (ceil(T / 128),
//! Hq, B)`, `block = (256, 1, 1)`; and pass [`FlashLaunch::dynamic_smem_bytes`]
//! of dynamic shared memory (above 48 KiB, so the kernel's limit must be
//! raised first).
//!
//! # Design
//!
//! One block of two warpgroups owns 128 query rows of one (batch, query
//! head); warpgroup `wg` owns rows `64wg .. 64wg + 63` and its warp `w` rows
//! `64wg + 16w .. + 15`, the rows of wgmma's accumulator fragments. Q, and
//! two buffers of K and V, live in shared memory in wgmma's canonical
//! layout without swizzling: the tile is cut into *core matrices* of 8 rows
//! by 8 features (128 contiguous bytes), stored row-group by row-group, so
//! element `(r, c)` of a `[rows][D]` tile sits at
//! `((r / 8) * (D / 8) + c / 8) * 64 + (r % 8) * 8 + c % 8`. The copy's
//! 16-byte chunk number `t` is then exactly the byte offset `16 t`, so every
//! store is conflict-free; K (as B of S = Q K^T) and Q read it K-major
//! (core matrices 128 bytes apart along the features, `16 D` bytes along the
//! rows), V (as B of O = P V) MN-major (the same two strides, roles swapped).
//!
//! Per key tile: S = Q K^T by `D / 16` wgmma (the first one overwrites the
//! accumulator), the masks and online softmax of `flash.rs` on the
//! accumulators (whose layout is m16n8's, repeated), P rounded to 16 bits
//! in registers (wgmma's register A fragment is m16n8k16's) and O += P V by
//! `TILE_K / 16` wgmma. The next tile's copy is in flight meanwhile. Causal
//! blocks run the longest query tiles first.
//!
//! In a host build the wgmma, fences and copies are `fs_emu_*` functions
//! and plain copies (`tests/flash_host/mma_emu.h` reads the operands through
//! the descriptors' layout), so the same text runs against the reference.

use super::attention::Access;
use super::cuda::{float_lit, NEG_INF};
use super::flash::{
    epilogue, forward_kernel, masks_and_softmax, Config, FlashLaunch, ForwardShape,
};
use super::templates::Ctx;
use crate::ir::types::DType;
use crate::ir::Graph;
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// Query rows per block (2 warpgroups of 64).
pub const TILE_Q: u64 = 128;
/// Threads per block.
pub const THREADS: u32 = 256;

/// Keys per shared-memory tile. On an H100, 64 keys ran the forward 15-17%
/// faster than 128 at D = 64 and the same at D = 128 (docs/benchmarks.md).
pub const TILE_K: u64 = 64;

/// Shared memory of the kernel at head dim `d`: Q, and two K and V tiles.
pub fn smem_bytes(d: u64) -> u64 {
    (TILE_Q + 4 * TILE_K) * d * 2
}

pub(crate) fn emit(
    g: &Graph,
    c: &Ctx,
    n: NodeIndex,
    cfg: Config,
    source: Option<&str>,
) -> Option<(String, FlashLaunch)> {
    let d = cfg.head_dim;
    let helpers = wgmma_helpers(&[
        (Operand::KMajor, Operand::KMajor, TILE_K),
        (Operand::Regs, Operand::MnMajor, d),
    ]);
    let mut text = String::new();
    body(&mut text, g, c, n, &cfg);
    let shape = ForwardShape {
        tile_q: TILE_Q,
        block: THREADS,
        bounds: format!("{THREADS}, 1"),
        static_smem: 0,
        dynamic_smem: smem_bytes(d),
    };
    forward_kernel(g, c, source, &helpers, &text, &cfg, shape)
}

/// Where a wgmma operand comes from: registers (A only, in m16n8k16's A
/// fragment layout), or shared memory through a descriptor, K-major (the
/// 16-byte rows of a core matrix run along K) or MN-major (along M or N).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operand {
    Regs,
    KMajor,
    MnMajor,
}

impl Operand {
    fn letter(self) -> char {
        match self {
            Operand::Regs => 'r',
            Operand::KMajor => 'k',
            Operand::MnMajor => 'm',
        }
    }
}

/// The C name of one wgmma wrapper: `fs_wgmma_<A><B>_n<N>_<elem>`, A and B
/// each `r`, `k` or `m` (see [`Operand`]).
pub(crate) fn wgmma_name(a: Operand, b: Operand, n: u64, elem: &str) -> String {
    format!("fs_wgmma_{}{}_n{n}_{elem}", a.letter(), b.letter())
}

/// The wgmma building blocks: descriptors, fences, asynchronous copies, and
/// one m64nNk16 wrapper per `(A, B, N)` in `shapes`, for bf16 and f16.
pub(crate) fn wgmma_helpers(shapes: &[(Operand, Operand, u64)]) -> String {
    let mut s = String::from(WGMMA_COMMON);
    for (cuda, guard) in [(true, "#ifdef __CUDA_ARCH__\n"), (false, "#else\n")] {
        s.push_str(guard);
        for &(a, b, n) in shapes {
            for elem in ["bf16", "f16"] {
                s.push_str(&wgmma_fn(a, b, n, elem, cuda));
            }
        }
    }
    s.push_str("#endif\n\n");
    s
}

/// One wgmma wrapper, `name(d, a, b, acc)`: `d = A B + (acc ? d : 0)` for
/// the warpgroup, `d` in the m64nN accumulator layout, `a` four registers
/// or a descriptor, `b` a descriptor.
fn wgmma_fn(a: Operand, b: Operand, n: u64, elem: &str, cuda: bool) -> String {
    let name = wgmma_name(a, b, n, elem);
    let a_param = if a == Operand::Regs {
        "const unsigned (&a)[4]"
    } else {
        "fs_desc a"
    };
    let sig = format!(
        "void {name}(float (&d)[{}][4], {a_param}, fs_desc b, int acc)",
        n / 8
    );
    let def = if cuda {
        wgmma_asm(&sig, a, b, n, elem)
    } else {
        let a_args = if a == Operand::Regs {
            "a, nullptr, 0, 0".to_string()
        } else {
            "nullptr, a.p, a.lbo, a.sbo".to_string()
        };
        format!(
            "inline {sig} {{ fs_emu_wgmma(&d[0][0], {n}, {a_args}, {}, b.p, b.lbo, b.sbo, {}, acc != 0, {}); }}\n",
            a == Operand::MnMajor,
            b == Operand::MnMajor,
            elem == "bf16"
        )
    };
    // Once per translation unit, however many kernels ask for it.
    let guard = name.to_uppercase();
    format!("#ifndef {guard}\n#define {guard}\n{def}#endif\n")
}

/// The device definition: one `wgmma.mma_async` in inline PTX.
fn wgmma_asm(sig: &str, a: Operand, b: Operand, n: u64, elem: &str) -> String {
    let regs = n / 2;
    let d_list: Vec<String> = (0..regs).map(|i| format!("%{i}")).collect();
    let (a_ops, a_in, next) = if a == Operand::Regs {
        (
            format!("{{%{}, %{}, %{}, %{}}}", regs, regs + 1, regs + 2, regs + 3),
            "\"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3])".to_string(),
            regs + 4,
        )
    } else {
        (format!("%{regs}"), "\"l\"(a)".to_string(), regs + 1)
    };
    // After A: b, acc, then the immediates: scale A, scale B, [transpose
    // A (shared-memory A only),] transpose B (1 = MN-major).
    let mut imm_in = vec!["\"n\"(1)".to_string(), "\"n\"(1)".to_string()];
    if a != Operand::Regs {
        imm_in.push(format!("\"n\"({})", (a == Operand::MnMajor) as u8));
    }
    imm_in.push(format!("\"n\"({})", (b == Operand::MnMajor) as u8));
    let imm: Vec<String> = (0..imm_in.len())
        .map(|i| format!("%{}", next + 2 + i as u64))
        .collect();
    let outs: Vec<String> = (0..regs)
        .map(|i| format!("\"+f\"(d[{}][{}])", i / 4, i % 4))
        .collect();
    format!(
        "__device__ __forceinline__ {sig} {{\n    asm volatile(\"{{ .reg .pred p; setp.ne.b32 p, %{acc}, 0;\\n\"\n                 \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{elem}.{elem} {{{d}}}, {a_ops}, %{b}, p, {imm}; }}\"\n                 : {outs}\n                 : {a_in}, \"l\"(b), \"r\"(acc), {imm_in});\n}}\n",
        acc = next + 1,
        d = d_list.join(", "),
        b = next,
        imm = imm.join(", "),
        outs = outs.join(", "),
        imm_in = imm_in.join(", "),
    )
}

const WGMMA_COMMON: &str = r#"// wgmma (sm_90a) building blocks; a host build emulates them (fs_emu_wgmma)
// and makes the fences and asynchronous copies plain or empty.
#ifndef FS_WGMMA_COMMON
#define FS_WGMMA_COMMON
#ifdef __CUDA_ARCH__
typedef unsigned long long fs_desc;
__device__ __forceinline__ unsigned fs_smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 a64; cvta.to.shared.u64 a64, %1; cvt.u32.u64 %0, a64; }" : "=r"(a) : "l"(p));
    return a;
}
// A shared-memory matrix descriptor without swizzling: `p` at the first core
// matrix (8 rows of 16 bytes, contiguous), `lbo` bytes between core matrices
// along K, `sbo` along M or N.
__device__ __forceinline__ fs_desc fs_make_desc(const void* p, unsigned lbo, unsigned sbo) {
    return (fs_desc)((fs_smem_addr(p) & 0x3FFFFu) >> 4) | ((fs_desc)(lbo >> 4) << 16) | ((fs_desc)(sbo >> 4) << 32);
}
// Orders register writes before the next wgmma reads them.
__device__ __forceinline__ void fs_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void fs_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void fs_wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Waits for all but the newest committed group.
__device__ __forceinline__ void fs_wgmma_wait_all_but_1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// Keeps the compiler from touching accumulators across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fs_wgmma_hold(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}
// Makes this thread's shared-memory writes visible to wgmma (the async proxy).
__device__ __forceinline__ void fs_fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// 16 bytes from global to shared memory, asynchronously (both 16-byte aligned).
__device__ __forceinline__ void fs_copy16_async(unsigned short* dst, const unsigned short* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(fs_smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void fs_copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void fs_copy_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
#else
struct fs_desc {
    const unsigned char* p;
    unsigned lbo, sbo;
};
inline fs_desc fs_make_desc(const void* p, unsigned lbo, unsigned sbo) { return {static_cast<const unsigned char*>(p), lbo, sbo}; }
inline void fs_wgmma_fence() {}
inline void fs_wgmma_commit() {}
inline void fs_wgmma_wait_all() {}
inline void fs_wgmma_wait_all_but_1() {}
template <int N>
inline void fs_wgmma_hold(float (&)[N][4]) {}
inline void fs_fence_async_smem() {}
inline void fs_copy16_async(unsigned short* dst, const unsigned short* src) { memcpy(dst, src, 16); }
inline void fs_copy_async_commit() {}
inline void fs_copy_async_wait_all() {}
#endif
#endif
"#;

fn body(s: &mut String, g: &Graph, c: &Ctx, n: NodeIndex, cfg: &Config) {
    let q = Access::input(g, c, n, 0);
    let k = Access::input(g, c, n, 1);
    let v = Access::input(g, c, n, 2);
    let (elem, ty) = match cfg.dt {
        DType::F16 => ("f16", "fs_f16"),
        _ => ("bf16", "fs_bf16"),
    };
    let d = cfg.head_dim;
    let tk = TILE_K;
    let _ = write!(
        s,
        r#"    // FlashAttention-2 forward on Hopper tensor cores (wgmma, f32 accumulation).
    // Block (blockIdx.x, blockIdx.y, blockIdx.z) = (tile of {TILE_Q} queries, query head, batch);
    // warpgroup wg owns the tile's rows 64wg .. 64wg + 63, its warp w rows 64wg + 16w .. + 15.
    // Keys and values stream through shared memory {tk} at a time, one tile ahead.
    constexpr int TILE_Q = {TILE_Q}, TILE_K = {tk}, HEAD_DIM = {d};
    constexpr int CHUNKS = HEAD_DIM / 8;         // 16-byte chunks per row
    // Tiles in wgmma's core-matrix layout (see emit/flash_sm90.rs): core matrices
    // (8 rows x 16 bytes) are CORE bytes apart along the features, ROW8 bytes
    // apart along the rows.
    constexpr unsigned CORE = 128, ROW8 = CHUNKS * CORE;
    const fs_i64 q_len = {t}, kv_len = {s_len}, group = {group};
    const bool causal = {causal};  // if so, keys j > query i are masked
    const float scale_log2 = {scale_log2};  // scale * log2(e): exp(x * scale) = exp2(x * scale_log2)
    // Causal blocks take the longest query tiles first.
    const fs_i64 q0 = (fs_i64)(causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * TILE_Q;
    const fs_i64 h = blockIdx.y, b = blockIdx.z, kv_h = h / group;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
    FS_DYNAMIC_SMEM(smem, {smem});
    {ty}* const q_tile = reinterpret_cast<{ty}*>(smem);      // [TILE_Q][HEAD_DIM]
    {ty}* const k_tiles = q_tile + TILE_Q * HEAD_DIM;         // 2 x [TILE_K][HEAD_DIM]
    {ty}* const v_tiles = k_tiles + 2 * TILE_K * HEAD_DIM;    // 2 x [TILE_K][HEAD_DIM]

    // 1. The tile's queries (rows past q_len zero), then keys and values
    //    k0 .. k0 + {last} into buffer `buf` (rows past kv_len zero). Chunk c is
    //    row (c / (8 * CHUNKS)) * 8 + c % 8, features ((c / 8) % CHUNKS) * 8 ..,
    //    stored at element 8c.
    for (int c = threadIdx.x; c < TILE_Q * CHUNKS; c += {THREADS}) {{
        const int r = (c / (8 * CHUNKS)) * 8 + (c & 7), e = ((c >> 3) % CHUNKS) * 8;
        const fs_i64 i = q0 + r;
        if (i < q_len) fs_copy16_async(&q_tile[c * 8], &{qp}[{q_at} + e]);
        else fs_zero16(&q_tile[c * 8]);
    }}
    auto load_kv = [&](int buf, fs_i64 k0) {{
        {ty}* const kt = k_tiles + buf * TILE_K * HEAD_DIM;
        {ty}* const vt = v_tiles + buf * TILE_K * HEAD_DIM;
        for (int c = threadIdx.x; c < TILE_K * CHUNKS; c += {THREADS}) {{
            const int r = (c / (8 * CHUNKS)) * 8 + (c & 7), e = ((c >> 3) % CHUNKS) * 8;
            const fs_i64 j = k0 + r;
            if (j < kv_len) {{
                fs_copy16_async(&kt[c * 8], &{kp}[{k_at} + e]);
                fs_copy16_async(&vt[c * 8], &{vp}[{v_at} + e]);
            }} else {{
                fs_zero16(&kt[c * 8]);
                fs_zero16(&vt[c * 8]);
            }}
        }}
        fs_copy_async_commit();
    }};

    // Running state of this thread's rows q_row (index 0) and q_row + 8 (index 1):
    // the max score in log2 units, this thread's part of the row sum, and the
    // output accumulator o_acc[n][e] = row q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
    const int q_row = wg * 64 + warp * 16 + frag_row;
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
    const {ty}* const q_wg = q_tile + wg * 64 * HEAD_DIM;
    if (kv_end > 0) load_kv(0, 0);
    for (fs_i64 k0 = 0, t = 0; k0 < kv_end; k0 += TILE_K, ++t) {{
        // 2. Wait for this tile (and the queries); every warp is then done with
        //    the other buffer, which takes the next tile meanwhile.
        fs_copy_async_wait_all();
        fs_fence_async_smem();
        __syncthreads();
        if (k0 + TILE_K < kv_end) load_kv((t + 1) & 1, k0 + TILE_K);
        const {ty}* const kt = k_tiles + (t & 1) * TILE_K * HEAD_DIM;
        const {ty}* const vt = v_tiles + (t & 1) * TILE_K * HEAD_DIM;

        // 3. Scores S = Q K^T of the warpgroup's 64 rows and the tile's keys, in
        //    log2 units: s[n][e] = row q_row + 8 * (e / 2), key k0 + 8n + frag_col + e % 2.
        //    Features 16kk .. 16kk + 15 start at element 128kk of a row group.
        float s[TILE_K / 8][4];
        fs_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            {s_mma}(s, fs_make_desc(q_wg + kk * 128, CORE, ROW8), fs_make_desc(kt + kk * 128, CORE, ROW8), kk);
        fs_wgmma_commit();
        fs_wgmma_wait_all();
        fs_wgmma_hold(s);
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) {{
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
        }}

{softmax}        // 6. O += P V. The accumulators of keys 16kk .. 16kk + 15 (s[2kk], s[2kk + 1])
        //    are exactly P's register A fragment; V is B, MN-major: keys 16kk ..
        //    start at row group 2kk.
        unsigned p_frag[TILE_K / 16][4];
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; ++kk) {{
            p_frag[kk][0] = fs_pack_{elem}(s[2 * kk][0], s[2 * kk][1]);
            p_frag[kk][1] = fs_pack_{elem}(s[2 * kk][2], s[2 * kk][3]);
            p_frag[kk][2] = fs_pack_{elem}(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            p_frag[kk][3] = fs_pack_{elem}(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }}
        fs_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; ++kk)
            {o_mma}(o_acc, p_frag[kk], fs_make_desc(vt + kk * 16 * HEAD_DIM, ROW8, CORE), 1);
        fs_wgmma_commit();
        fs_wgmma_wait_all();
        fs_wgmma_hold(o_acc);
    }}

{epilogue}"#,
        t = cfg.q_len.to_c(),
        s_len = cfg.kv_len.to_c(),
        group = cfg.group,
        causal = cfg.causal,
        scale_log2 = float_lit(cfg.scale * std::f64::consts::LOG2_E),
        smem = smem_bytes(d),
        last = tk - 1,
        qp = q.ptr,
        kp = k.ptr,
        vp = v.ptr,
        q_at = q.at(&["b", "i", "h", "0"]),
        k_at = k.at(&["b", "j", "kv_h", "0"]),
        v_at = v.at(&["b", "j", "kv_h", "0"]),
        softmax = masks_and_softmax("q0 + wg * 64 + warp * 16"),
        s_mma = wgmma_name(Operand::KMajor, Operand::KMajor, tk, elem),
        o_mma = wgmma_name(Operand::Regs, Operand::MnMajor, d, elem),
        epilogue = epilogue(g, c, n),
    );
}
