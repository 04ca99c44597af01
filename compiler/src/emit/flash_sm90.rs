//! CUDA C for the Hopper (sm_90a) FlashAttention forward: the same
//! algorithm as `flash.rs`, on warpgroup tensor-core instructions
//! (`wgmma.mma_async`) fed from shared memory by descriptors, with the key
//! and value tiles copied by bulk tensor copies (TMA, `tma.rs`) from one
//! producer thread and handed over by shared-memory barriers (`mbarrier`).
//!
//! # Launch contract
//!
//! As `flash.rs`'s (same arguments, outputs and alignment rules), except:
//! compile for `sm_90a` (wgmma exists only there); `grid = (ceil(T /
//! tile_q(D)), Hq, B)`, `block = (threads(D), 1, 1)` (192 rows and 512
//! threads at D <= 64, 128 and 384 above); pass [`FlashLaunch::dynamic_smem_bytes`]
//! of dynamic shared memory (above 48 KiB, so the kernel's limit must be
//! raised first); and after the other arguments the tensor maps of K and V
//! that [`FlashLaunch::tensor_maps`] describes, by value.
//!
//! # Design
//!
//! One block owns [`tile_q`] query rows of one (batch, query head). Its
//! consumer warpgroups compute: warpgroup `wg` owns rows `64wg .. 64wg +
//! 63` and its warp `w` rows `64wg + 16w .. + 15`, the rows of wgmma's
//! accumulator fragments. The last warpgroup gives its registers to the
//! consumers (`setmaxnreg`) and only copies key and value tiles into
//! [`STAGES`] buffers each, from its first thread: it waits on a
//! buffer's "empty" mbarrier (every consumer warp arrives once its wgmma
//! reading it is done), arrives on its "full" mbarrier expecting the tile's
//! bytes, and issues the tile's bulk tensor copies, which complete "full"
//! as they land; the consumers wait on "full" before their wgmma read it.
//!
//! Q lives in shared memory in wgmma's canonical layout without swizzling
//! (every thread copies it once, with `cp.async`): the tile is cut into
//! *core matrices* of 8 rows by 8 features (128 contiguous bytes), stored
//! row-group by row-group, so element `(r, c)` of a `[rows][D]` tile sits
//! at `((r / 8) * (D / 8) + c / 8) * 64 + (r % 8) * 8 + c % 8`; the copy's
//! 16-byte chunk number `t` is then exactly the byte offset `16 t`, so every
//! store is conflict-free. K and V tiles are in `tma.rs`'s swizzled layout:
//! K (as B of S = Q K^T) read K-major, V (as B of O = P V) MN-major.
//!
//! Per key tile t: S = Q K^T by `D / 16` wgmma (the first one overwrites
//! the accumulator) issued together with tile t - 1's O += P V (`TILE_K /
//! 16` wgmma, P rounded to 16 bits in registers: wgmma's register A
//! fragment is m16n8k16's); once S lands, the masks and online softmax of
//! `flash.rs` run on its accumulators (whose layout is m16n8's, repeated)
//! while O += P V still runs, and O takes the softmax's rescale once that
//! lands. Causal blocks run the longest query tiles first.
//!
//! In a host build the wgmma, fences, mbarriers and copies are `fs_emu_*`
//! functions and plain copies (`tests/flash_host/mma_emu.h` reads the
//! operands through the descriptors' layout; every thread of a block is an
//! OS thread), so the same text runs against the reference.

use super::attention::Access;
use super::cuda::{float_lit, NEG_INF};
use super::flash::{
    elem_names, epilogue, forward_kernel, masks_and_softmax, Config, FlashLaunch, ForwardShape,
};
use super::templates::Ctx;
use super::tma::{self, TensorMap};
use crate::ir::Graph;
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// Query rows per block at head dim `d`, 64 per consumer warpgroup: three
/// at D <= 64, so that each key and value tile serves 1.5x the queries (at
/// D = 128 three would not fit in registers).
pub fn tile_q(d: u64) -> u64 {
    if d <= 64 {
        192
    } else {
        128
    }
}

/// The consumer warpgroups' threads at head dim `d`.
pub fn consumers(d: u64) -> u32 {
    (tile_q(d) / 64 * 128) as u32
}

/// The producer: a warpgroup (`setmaxnreg` hands registers over by whole
/// warpgroups, and ptxas budgets a wgmma kernel's block in warpgroups
/// anyway), whose first thread issues every key and value tile's bulk
/// tensor copies (`tma.rs`). With per-thread `cp.async` copies instead, the
/// copies bound the forward: on an H100 at D = 128, T = 8192, one warp ran
/// it at 150 TFLOP/s, a warpgroup at 254 (docs/benchmarks.md).
pub const PRODUCERS: u32 = 128;
/// Registers the producer warpgroup keeps (`setmaxnreg`'s least).
const PRODUCER_REGS: u32 = 24;

/// Registers per consumer thread at head dim `d`: what the producer leaves.
fn consumer_regs(d: u64) -> u32 {
    regs_left(threads(d), PRODUCERS, PRODUCER_REGS)
}

/// Registers per thread that `setmaxnreg` can give the other threads of a
/// block of `block` (launched with `__launch_bounds__(block, 1)`: the 64K
/// register file over the block, in ptxas's steps of 8) once `fixed`
/// threads set theirs to `fixed_regs`; in `setmaxnreg`'s steps of 8.
pub(crate) fn regs_left(block: u32, fixed: u32, fixed_regs: u32) -> u32 {
    let start = 65536 / block / 8 * 8;
    (start * block - fixed * fixed_regs) / (block - fixed) / 8 * 8
}
/// Threads per block at head dim `d`.
pub fn threads(d: u64) -> u32 {
    consumers(d) + PRODUCERS
}
/// Buffers of key tiles, and of value tiles. With 128-key tiles on an
/// H100, two ran the forward 3-5% faster than three at D = 64 (three do not
/// fit at D = 128); with 64-key tiles and per-thread copies three had been
/// 4-10% faster (docs/benchmarks.md).
pub const STAGES: u64 = 2;

/// Keys per shared-memory tile. On an H100, with bulk tensor copies and
/// `setmaxnreg`, 128 keys ran the forward 7-15% faster than 64 (fewer,
/// wider wgmma per key; docs/benchmarks.md). With per-thread copies 64 had
/// been faster at D = 64.
pub const TILE_K: u64 = 128;

/// Shared memory of the kernel at head dim `d`: Q, the K and V buffers,
/// their mbarriers, and room to align the tiles for the swizzle.
pub fn smem_bytes(d: u64) -> u64 {
    (tile_q(d) + 2 * STAGES * TILE_K) * d * 2 + 4 * STAGES * 8 + tma::ALIGN
}

/// The forward's tensor maps: key and value tiles of [`TILE_K`] rows.
fn tensor_maps(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<Vec<TensorMap>> {
    Some(vec![
        TensorMap::of_input(g, c, n, 1, "tm_k", TILE_K)?,
        TensorMap::of_input(g, c, n, 2, "tm_v", TILE_K)?,
    ])
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
    ]) + tma::HELPERS
        + WS_HELPERS;
    let maps = tensor_maps(g, c, n)?;
    let mut text = tma::host_maps(&maps);
    body(&mut text, g, c, n, &cfg);
    let shape = ForwardShape {
        tile_q: tile_q(d),
        block: threads(d),
        bounds: format!("{}, 1", threads(d)),
        static_smem: 0,
        dynamic_smem: smem_bytes(d),
        maps,
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
            "a, nullptr, 0, 0, 0".to_string()
        } else {
            "nullptr, a.p, a.lbo, a.sbo, a.sw".to_string()
        };
        format!(
            "inline {sig} {{ fs_emu_wgmma(&d[0][0], {n}, {a_args}, {}, b.p, b.lbo, b.sbo, b.sw, {}, acc != 0, {}); }}\n",
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

/// Warp-specialization building blocks both Hopper kernels use: register
/// hand-over, named barriers, `__syncwarp`, 16-byte reductions; their host
/// versions.
pub(crate) const WS_HELPERS: &str = r#"#ifndef FS_WS_HELPERS
#define FS_WS_HELPERS
#ifdef __CUDA_ARCH__
// Registers handed between warpgroups (the whole warpgroup executes it).
template <unsigned N>
__device__ __forceinline__ void fs_setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <unsigned N>
__device__ __forceinline__ void fs_setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
// Barrier `id` (1 .. 15; 0 is __syncthreads) for `count` threads.
__device__ __forceinline__ void fs_bar_sync(unsigned id, unsigned count) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory"); }
// Counts the calling threads towards barrier `id` without waiting for it.
__device__ __forceinline__ void fs_bar_arrive(unsigned id, unsigned count) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory"); }
__device__ __forceinline__ void fs_syncwarp() { __syncwarp(); }
// p[0 .. 3] += s[0 .. 3] in global memory, atomically (both 16-byte aligned, s in shared memory).
__device__ __forceinline__ void fs_atomic_add4(float* p, const float* s) {
    const float4 v = *reinterpret_cast<const float4*>(s);
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
// p[0], p[1] = a, b (p 8-byte aligned).
__device__ __forceinline__ void fs_st_f32x2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
#else
template <unsigned N>
inline void fs_setmaxnreg_inc() {}
template <unsigned N>
inline void fs_setmaxnreg_dec() {}
inline void fs_bar_sync(unsigned id, unsigned count) { fs_emu_bar_sync(id, count); }
inline void fs_bar_arrive(unsigned id, unsigned count) { fs_emu_bar_arrive(id, count); }
inline void fs_syncwarp() { fs_emu_syncwarp(); }
// A plain sum, as fs_atomic_add2's host version says.
inline void fs_atomic_add4(float* p, const float* s) {
    for (int i = 0; i < 4; ++i) p[i] += s[i];
}
inline void fs_st_f32x2(float* p, float a, float b) {
    p[0] = a;
    p[1] = b;
}
#endif
#endif

"#;

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
// `d` moved `bytes` (a multiple of 16) further: one add to the address field
// in the low word (shared addresses stay below 2^18, so it cannot carry out).
__device__ __forceinline__ fs_desc fs_desc_at(fs_desc d, unsigned bytes) {
    return (d & 0xFFFFFFFF00000000ull) | (unsigned)((unsigned)d + (bytes >> 4));
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
// Shared-memory barriers (mbarrier) with phases: a phase completes when its
// count of arrivals is in; waiting names the parity of the phase awaited.
typedef unsigned long long fs_mbar;
__device__ __forceinline__ void fs_mbar_init(fs_mbar* m, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(fs_smem_addr(m)), "r"(count) : "memory");
}
__device__ __forceinline__ void fs_mbar_arrive(fs_mbar* m) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(fs_smem_addr(m)) : "memory");
}
__device__ __forceinline__ void fs_mbar_wait(fs_mbar* m, unsigned parity) {
    asm volatile("{ .reg .pred done;\nFS_MBAR_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra FS_MBAR_WAIT; }" ::"r"(fs_smem_addr(m)), "r"(parity) : "memory");
}
#else
// `sw`: the swizzle's bytes per row (0: none).
struct fs_desc {
    const unsigned char* p;
    unsigned lbo, sbo, sw;
};
inline fs_desc fs_make_desc(const void* p, unsigned lbo, unsigned sbo) { return {static_cast<const unsigned char*>(p), lbo, sbo, 0}; }
inline fs_desc fs_desc_at(fs_desc d, unsigned bytes) {
    d.p += bytes;
    return d;
}
inline void fs_wgmma_fence() {}
inline void fs_wgmma_commit() {}
// A wait is where a warp's lanes have all read their operands (each lane's
// emulated wgmma reads them itself), so that one lane may then hand the
// operands' buffer on.
inline void fs_wgmma_wait_all() { fs_emu_wgmma_wait(); }
inline void fs_wgmma_wait_all_but_1() { fs_emu_wgmma_wait(); }
template <int N>
inline void fs_wgmma_hold(float (&)[N][4]) {}
inline void fs_fence_async_smem() {}
inline void fs_copy16_async(unsigned short* dst, const unsigned short* src) { memcpy(dst, src, 16); }
inline void fs_copy_async_commit() {}
inline void fs_copy_async_wait_all() {}
typedef fs_emu_mbar fs_mbar;
inline void fs_mbar_init(fs_mbar* m, unsigned count) { fs_emu_mbar_init(m, count); }
inline void fs_mbar_arrive(fs_mbar* m) { fs_emu_mbar_arrive(m); }
inline void fs_mbar_wait(fs_mbar* m, unsigned parity) { fs_emu_mbar_wait(m, parity); }
#endif
#endif
"#;

fn body(s: &mut String, g: &Graph, c: &Ctx, n: NodeIndex, cfg: &Config) {
    let q = Access::input(g, c, n, 0);
    let (elem, ty) = elem_names(cfg.dt);
    let d = cfg.head_dim;
    let tk = TILE_K;
    let softmax = masks_and_softmax("q0 + wg * 64 + warp * 16", false, cfg.scale);
    let s_mma = wgmma_name(Operand::KMajor, Operand::KMajor, tk, elem);
    let o_mma = wgmma_name(Operand::Regs, Operand::MnMajor, d, elem);
    let issue_s = format!(
        "        fs_wgmma_fence();\n#pragma unroll\n        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)\n            \
         {s_mma}(s, fs_desc_at(q_desc, kk * 256), {}, kk);\n",
        tma::desc_kmajor("kt_desc", tk, "kk")
    );
    let issue_pv = format!(
        "#pragma unroll\n        for (int kk = 0; kk < TILE_K / 16; ++kk)\n            \
         {o_mma}(o_acc, p_frag[kk], {}, 1);\n",
        tma::desc_mnmajor("vt_desc", "kk")
    );
    let pack = format!(
        "#pragma unroll\n        for (int kk = 0; kk < TILE_K / 16; ++kk) {{\n{}        }}\n",
        (0..4)
            .map(|i| format!(
                "            p_frag[kk][{i}] = fs_pack_{elem}(s[2 * kk{hi}][{lo}], s[2 * kk{hi}][{lo1}]);\n",
                hi = if i >= 2 { " + 1" } else { "" },
                lo = (i % 2) * 2,
                lo1 = (i % 2) * 2 + 1
            ))
            .collect::<String>()
    );
    let _ = write!(
        s,
        r#"    // FlashAttention-2 forward on Hopper tensor cores (wgmma, f32 accumulation).
    // Block (blockIdx.x, blockIdx.y, blockIdx.z) = (tile of {tq} queries, query head, batch):
    // consumer warpgroups (wg owns the tile's rows 64wg .. 64wg + 63, its warp w
    // rows 64wg + 16w .. + 15) and a producer warpgroup whose first thread copies key
    // and value tiles of {tk} into STAGES buffers each (bulk tensor copies with the
    // 128-byte swizzle, emit/tma.rs), handed over by mbarriers. Each
    // consumer warpgroup issues tile t's scores together with tile t - 1's
    // O += P V, so that its softmax runs while the tensor cores do the product,
    // and the warpgroups take turns issuing them (FlashAttention-3's ping-pong),
    // so that one's softmax also runs while the others' products do.
    constexpr int TILE_Q = {tq}, TILE_K = {tk}, HEAD_DIM = {d};
    constexpr int CONSUMERS = {consumers}, PRODUCERS = {PRODUCERS}, BLOCK = CONSUMERS + PRODUCERS;
    constexpr int STAGES = {STAGES};  // buffers of key tiles, and of value tiles
    constexpr int CHUNKS = HEAD_DIM / 8;         // 16-byte chunks per row
    constexpr unsigned TILE_BYTES = TILE_K * HEAD_DIM * 2;  // a key or value tile
    // The query tile in wgmma's core-matrix layout (see emit/flash_sm90.rs): core
    // matrices (8 rows x 16 bytes) are CORE bytes apart along the features, ROW8
    // bytes apart along the rows. Key and value tiles: 64-feature boxes of
    // 128-byte swizzled rows (emit/tma.rs).
    constexpr unsigned CORE = 128, ROW8 = CHUNKS * CORE;
    const fs_i64 q_len = {t}, kv_len = {s_len}, group = {group};
    const bool causal = {causal};  // if so, keys j > query i are masked
    const float scale_log2 = {scale_log2};  // scale * log2(e): exp(x * scale) = exp2(x * scale_log2)
    // Causal blocks take the longest query tiles first.
    const fs_i64 q0 = (fs_i64)(causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * TILE_Q;
    const fs_i64 h = blockIdx.y, b = blockIdx.z, kv_h = h / group;
    const int lane = threadIdx.x & 31;
    FS_DYNAMIC_SMEM(smem_raw, {smem});
    unsigned char* const smem = fs_align1024(smem_raw);  // for the swizzle
    {ty}* const q_tile = reinterpret_cast<{ty}*>(smem);      // [TILE_Q][HEAD_DIM]
    {ty}* const k_tiles = q_tile + TILE_Q * HEAD_DIM;              // STAGES x [TILE_K][HEAD_DIM]
    {ty}* const v_tiles = k_tiles + STAGES * TILE_K * HEAD_DIM;    // STAGES x [TILE_K][HEAD_DIM]
    // Buffer b's k_full[b] / v_full[b] complete when its copies' bytes have landed,
    // k_empty[b] / v_empty[b] when every consumer warp is done reading it.
    fs_mbar* const k_full = reinterpret_cast<fs_mbar*>(v_tiles + STAGES * TILE_K * HEAD_DIM);
    fs_mbar* const v_full = k_full + STAGES;
    fs_mbar* const k_empty = k_full + 2 * STAGES;
    fs_mbar* const v_empty = k_full + 3 * STAGES;

    // 1. The tile's queries, by every thread (rows past q_len zero). Chunk c is
    //    row (c / (8 * CHUNKS)) * 8 + c % 8, features ((c / 8) % CHUNKS) * 8 ..,
    //    stored at element 8c; likewise for key and value tiles.
    for (int c = threadIdx.x; c < TILE_Q * CHUNKS; c += BLOCK) {{
        const int r = (c / (8 * CHUNKS)) * 8 + (c & 7), e = ((c >> 3) % CHUNKS) * 8;
        const fs_i64 i = q0 + r;
        if (i < q_len) fs_copy16_async(&q_tile[c * 8], &{qp}[{q_at} + e]);
        else fs_zero16(&q_tile[c * 8]);
    }}
    if (threadIdx.x == 0) {{
        for (int i = 0; i < 2 * STAGES; ++i) fs_mbar_init(&k_full[i], 1);
        for (int i = 2 * STAGES; i < 4 * STAGES; ++i) fs_mbar_init(&k_full[i], CONSUMERS / 32);
    }}
    fs_copy_async_commit();
    fs_copy_async_wait_all();
    fs_fence_async_smem();
    __syncthreads();
    // Causal: key tiles after the query tile's last row are never visited.
    const fs_i64 kv_end = causal && q0 + TILE_Q < kv_len ? q0 + TILE_Q : kv_len;
    const fs_i64 tiles = (kv_end + TILE_K - 1) / TILE_K;

    if (threadIdx.x >= CONSUMERS) {{
        // 2. The producer: key tile t into buffer t % STAGES once the consumers
        //    are done with tile t - STAGES, then its value tile likewise, each as
        //    HEAD_DIM / 64 boxes of TILE_K rows (rows past kv_len zero).
        fs_setmaxnreg_dec<{producer_regs}>();
        if (threadIdx.x != CONSUMERS) return;
        for (fs_i64 t = 0; t < tiles; ++t) {{
            const int buf = t % STAGES;
            const unsigned released = (t / STAGES + 1) & 1;  // parity of tile t - STAGES's release
            const int k0 = t * TILE_K;
            {ty}* const kt = k_tiles + buf * TILE_K * HEAD_DIM;
            {ty}* const vt = v_tiles + buf * TILE_K * HEAD_DIM;
            if (t >= STAGES) fs_mbar_wait(&k_empty[buf], released);
            fs_mbar_expect_tx(&k_full[buf], TILE_BYTES);
#pragma unroll
            for (int a = 0; a < HEAD_DIM / 64; ++a) fs_tma_load(kt + a * TILE_K * 64, tm_k, a * 64, (int)kv_h, k0, (int)b, &k_full[buf]);
            fs_mbar_tma_issued(&k_full[buf]);
            if (t >= STAGES) fs_mbar_wait(&v_empty[buf], released);
            fs_mbar_expect_tx(&v_full[buf], TILE_BYTES);
#pragma unroll
            for (int a = 0; a < HEAD_DIM / 64; ++a) fs_tma_load(vt + a * TILE_K * 64, tm_v, a * 64, (int)kv_h, k0, (int)b, &v_full[buf]);
            fs_mbar_tma_issued(&v_full[buf]);
        }}
        return;
    }}

    fs_setmaxnreg_inc<{consumer_regs}>();
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
    // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
    // Running state of this thread's rows q_row (index 0) and q_row + 8 (index 1):
    // the max score in log2 units, this thread's part of the row sum, and the
    // output accumulator o_acc[n][e] = row q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
    const int q_row = wg * 64 + warp * 16 + frag_row;
    float row_max[2] = {{{NEG_INF}, {NEG_INF}}}, row_sum[2] = {{0.0f, 0.0f}}, o_rescale[2];
    float o_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {{
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[n][e] = 0.0f;
    }}
    const fs_i64 i_lo = q0 + q_row, i_hi = i_lo + 8;
    // wgmma descriptors of the warpgroup's queries and of the first key and
    // value buffers; a buffer's and a step's are these moved on (fs_desc_at).
    const fs_desc q_desc = fs_make_desc(q_tile + wg * 64 * HEAD_DIM, CORE, ROW8);
    const fs_desc k_desc = fs_make_desc_sw128(k_tiles), v_desc = {v_base};
    // s[n][e]: tile t's scores, row q_row + 8 * (e / 2), key k0 + 8n + frag_col + e % 2;
    // p_frag: tile t - 1's P as wgmma's register A fragments (keys 16kk .. 16kk + 15).
    float s[TILE_K / 8][4];
    unsigned p_frag[TILE_K / 16][4];
    // Turns at the tensor cores: warpgroup wg issues its products once it has
    // passed named barrier 1 + wg, to which the warpgroup before it (cyclically)
    // arrives once it has issued its own; the last warpgroup lets the first
    // start. Every warpgroup issues tiles + 1 times, the last one's final
    // arrival left out so that no barrier is left half-passed.
    constexpr int WGS = CONSUMERS / 128;
    constexpr int TURN = 2 * 128;  // a turn barrier's threads: the warpgroup waiting, the one arriving
    const int next_wg = wg + 1 == WGS ? 0 : wg + 1;
    if (tiles > 0 && wg == WGS - 1) fs_bar_arrive(1, TURN);
    // 3. Tile 0's scores alone (no P V yet): S = Q K^T
    //    of its 64 rows and the tile's keys (features 16kk .. 16kk + 15 start at
    //    element 128kk of a row group); steps 4 and 5 as in the loop below.
    if (tiles > 0) {{
        const fs_i64 k0 = 0;
        const fs_desc kt_desc = k_desc;
        fs_mbar_wait(&k_full[0], 0);
        fs_bar_sync(1 + wg, TURN);
{issue_s}        fs_wgmma_commit();
        fs_bar_arrive(1 + next_wg, TURN);
        fs_wgmma_wait_all();
        fs_wgmma_hold(s);
        if (lane == 0) fs_mbar_arrive(&k_empty[0]);
{softmax}{pack}    }}
    for (fs_i64 t = 1; t < tiles; ++t) {{
        const int buf = t % STAGES, prev = (t - 1) % STAGES;
        const fs_i64 k0 = t * TILE_K;
        const fs_desc kt_desc = fs_desc_at(k_desc, buf * TILE_BYTES);
        const fs_desc vt_desc = fs_desc_at(v_desc, prev * TILE_BYTES);  // tile t - 1
        fs_mbar_wait(&k_full[buf], (t / STAGES) & 1);
        fs_mbar_wait(&v_full[prev], ((t - 1) / STAGES) & 1);

        // 3. Tile t's scores, then O += P V for tile t - 1
        //    (P's register fragments; V as B read MN-major, keys 16kk .. at row
        //    group 2kk), as two commit groups.
        fs_bar_sync(1 + wg, TURN);
{issue_s}        fs_wgmma_commit();
{issue_pv}        fs_wgmma_commit();
        fs_bar_arrive(1 + next_wg, TURN);

        //    The scores land first (O += P V may still run): key tile t is free.
        fs_wgmma_wait_all_but_1();
        fs_wgmma_hold(s);
        if (lane == 0) fs_mbar_arrive(&k_empty[buf]);
{softmax}        // 6. O += P V of tile t - 1 has landed (value tile t - 1 is free): O takes
        //    this tile's rescale, and P becomes the next product's A fragments.
        fs_wgmma_wait_all();
        fs_wgmma_hold(o_acc);
        if (lane == 0) fs_mbar_arrive(&v_empty[prev]);
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; ++n) {{
            o_acc[n][0] *= o_rescale[0];
            o_acc[n][1] *= o_rescale[0];
            o_acc[n][2] *= o_rescale[1];
            o_acc[n][3] *= o_rescale[1];
        }}
{pack}    }}
    // 6. The last tile's O += P V.
    if (tiles > 0) {{
        const fs_i64 t = tiles - 1;
        fs_mbar_wait(&v_full[t % STAGES], (t / STAGES) & 1);
        const fs_desc vt_desc = fs_desc_at(v_desc, (t % STAGES) * TILE_BYTES);
        fs_bar_sync(1 + wg, TURN);
        fs_wgmma_fence();
{issue_pv}        fs_wgmma_commit();
        if (wg + 1 < WGS) fs_bar_arrive(1 + next_wg, TURN);
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
        tq = tile_q(d),
        consumers = consumers(d),
        producer_regs = PRODUCER_REGS,
        consumer_regs = consumer_regs(d),
        qp = q.ptr,
        q_at = q.at(&["b", "i", "h", "0"]),
        epilogue = epilogue(g, c, n),
        v_base = tma::mnmajor_base("v_tiles", tk),
    );
}
