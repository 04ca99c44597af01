//! CUDA C for a tensor-core FlashAttention-2 *backward* (`AttentionGrad`):
//! three kernels, every product on `mma.sync.m16n8k16` (f32 accumulation),
//! in one of two schemes. The session runs the atomic one unless it is
//! built deterministic (`fusec train --deterministic`).
//!
//! # Launch contract
//!
//! [`flash_backward`] returns three [`FlashBwdLaunch`]es, to launch in order
//! on one stream (each reads what the one before wrote). Atomic scheme
//! (`deterministic = false`, 5 tile products, as FlashAttention-2):
//!
//! 1. `<name>_delta`: `delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]`
//!    into the scratch, and the same rows of the f32 dQ sum set to zero;
//!    grid `(ceil(T / 128), Hq, B)`;
//! 2. `<name>_dkdvdq`: dK and dV, one block per (tile of 64 keys, key/value
//!    head, batch), streaming the queries of every query head of the group,
//!    and each tile's `dS K` added into the dQ sum with atomics; grid
//!    `(ceil(S / 64), Hkv, B)`, **dynamic shared memory**
//!    [`FlashBwdLaunch::dynamic_smem_bytes`] (57,600 bytes at D = 128: the
//!    function's `MAX_DYNAMIC_SHARED_SIZE_BYTES` must be raised first);
//! 3. `<name>_dqstore`: dQ = scale * the sum, in dQ's dtype; grid
//!    `(ceil(T / 128), Hq, B)`.
//!
//! The order of the atomic additions varies, so dQ's last bits can differ
//! between runs. Deterministic scheme (7 tile products, no atomics: every
//! output element written by one thread, once): `<name>_delta` (delta
//! only), `<name>_dkdv` (dK and dV; grid `(ceil(S / 64), Hkv, B)`) and
//! `<name>_dq` (dQ, one block per tile of 64 queries, streaming the keys;
//! grid `(ceil(T / 64), Hq, B)`), all in static shared memory.
//!
//! Every kernel is launched with `block = (FlashBwdLaunch::block, 1, 1)`
//! (128 threads; 384 for Hopper's `_dkdvdq`, `flash_bwd_sm90.rs`, which
//! `FlashArch::Sm90a` puts in the atomic scheme with its own grid and
//! shared memory) and the dynamic shared memory its launch names (0 but for
//! `_dkdvdq`). Each is compiled like every generated kernel (the prelude
//! pasted in place of its `#include`), and all three take the same
//! arguments: the kernel's usual ones (`in0..in5` = q, k, v, o, lse, dO as
//! arena addresses, the kernel applying the views itself; `out0..out2` =
//! dQ, dK, dV, contiguous, in the dtypes of q, k, v; every symbolic size in
//! `Graph::dims` order, as `long long`), then **one extra pointer,
//! `scratch`**: an f32 buffer of [`FlashBwdLaunch::scratch_f32_elems`]
//! elements (`B * Hq * T` deterministic: delta; `B * Hq * T * (D + 1)`
//! atomic: the dQ sum, then delta), the same for all three launches,
//! 16-byte aligned, its contents on entry irrelevant (kernel 1 writes what
//! the others read). Every buffer must be 16-byte aligned; `flash_backward`
//! returns `None` unless every row of q, k, v, O and dO is 16-byte aligned
//! and contiguous (view offsets and strides divisible by 8, last stride 1).
//! `gridDim.y/z` above 65535 are refused by [`FlashBwdLaunch::grid`].
//!
//! # Design
//!
//! With `P = exp2(S * scale_log2 - lse * log2 e)` recomputed from the
//! forward's log-sum-exp, `dP = dO V^T`, `dS = P * (dP - delta)`:
//!
//! - `_dkdv` / `_dkdvdq` work key-major: warp `w` owns keys
//!   `16w .. 16w + 15` of the block's 64 and computes the *transposed*
//!   products `S^T = K Q^T` and `dP^T = V dO^T` (A fragments of K and V,
//!   B fragments of Q / dO rows, by ldmatrix), so that `P^T` and `dS^T` come
//!   out in the accumulator layout, which is the A-fragment layout of the
//!   next products `dV += P^T dO` and `dK += dS^T Q` (B fragments by
//!   ldmatrix.trans). No fragment transpose or shuffle is needed. dK and dV
//!   stay in registers across the whole group. Query tiles are 64 rows at
//!   D = 64; at D = 128, 16 (`_dkdv`, static shared memory) or 32
//!   (`_dkdvdq`, dynamic).
//! - `_dkdvdq` then writes dS^T to shared memory and, after a barrier,
//!   computes the tile's `dQ += dS K` (A = dS by ldmatrix.trans from the
//!   transposed tile, B = the key rows), each warp a block of queries and
//!   features, added into the sum with `red.global.add.v2.f32` (two scalar
//!   atomics before sm_90).
//! - `_dq` works query-major like the forward: Q and dO as A fragments in
//!   registers, `S = Q K^T` and `dP = dO V^T` (B from the K / V tile rows),
//!   then `dQ += dS K`. Key tiles are 64 (D = 64) or 32 (D = 128) rows.
//! - Causal: the key-major kernels start at the first query tile that can
//!   see the key tile; `_dq` stops after the last key tile its queries can
//!   see; only tiles crossing the diagonal or the sequence ends are masked.
//! - P and dS are rounded to the input's 16-bit type as mma operands (as
//!   FlashAttention-2 does); everything accumulates in f32; dK and dQ are
//!   scaled once at the end.

use super::attention::Access;
use super::cuda::NEG_INF;
use super::cuda::{float_lit, header, load, store};
use super::flash::{elem_names, grid_c_of, grid_of, Config, FlashArch, HELPERS, PAD};
use super::flash_bwd_sm90 as sm90;
use super::templates::Ctx;
use super::tma::{self, TensorMap};
use crate::ir::{Dim, Graph};
use crate::kernel::{Kernel, Program};
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;

/// Threads per block of every kernel.
pub const THREADS: u32 = 128;
/// Keys per block of `_dkdv` and `_dkdvdq` (4 warps of 16). One block of 8
/// warps and 128 keys (half the atomics per key) ran `_dkdvdq` 2-15% slower
/// on an H100 than two blocks of 4 warps and 64 keys per SM
/// (docs/benchmarks.md, "Attention backward with dQ by atomics").
pub const TILE_KEYS: u64 = 64;
/// Queries per block of `_dq` (4 warps of 16).
pub const TILE_QUERIES: u64 = 64;
/// Rows per block of `_delta` and `_dqstore` (read in 8-feature chunks).
pub const DELTA_ROWS: u64 = 128;

/// Which of the three kernels a launch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// delta = rowsum(dO * O) into the scratch buffer.
    Delta,
    /// dK and dV.
    DkDv,
    /// dQ.
    Dq,
    /// dK and dV, and dQ summed with atomics into the scratch buffer.
    DkDvDq,
    /// dQ = scale * the scratch's sum, in dQ's dtype.
    DqStore,
}

/// One kernel of the backward and how to launch it (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct FlashBwdLaunch {
    pub stage: Stage,
    /// The kernel's name (the `Kernel`'s name and a suffix).
    pub name: String,
    /// The complete kernel text (prelude `#include`d, as every kernel).
    pub source: String,
    /// grid axis `a` = `ceil(grid_dims[a] / grid_tiles[a])`.
    pub grid_dims: [Dim; 3],
    pub grid_tiles: [u64; 3],
    /// The grid as C expressions of the kernel's size parameters.
    pub grid_c: [String; 3],
    /// Threads per block (x only).
    pub block: u32,
    /// Static shared memory the kernel declares.
    pub static_smem_bytes: u64,
    /// Dynamic shared memory to pass at launch (0 for most kernels); over
    /// 48 KiB, the runtime must first raise the function's
    /// `MAX_DYNAMIC_SHARED_SIZE_BYTES` to it.
    pub dynamic_smem_bytes: u64,
    /// Input slots (`inN`) it reads and output slots (`outN`) it writes.
    pub reads: Vec<usize>,
    pub writes: Vec<usize>,
    /// Tensor maps to pass by value after the scratch, in order (Hopper's
    /// bulk tensor copies).
    pub tensor_maps: Vec<TensorMap>,
    /// Elements of the f32 scratch buffer passed after the sizes
    /// (`B * Hq * T`, times `D + 1` in the atomic scheme; the same for every
    /// launch of the set).
    pub scratch_f32_elems: Dim,
}

impl FlashBwdLaunch {
    /// Whether this kernel writes the scratch buffer (else it only reads it).
    pub fn writes_scratch(&self) -> bool {
        matches!(self.stage, Stage::Delta | Stage::DkDvDq)
    }

    /// `(grid.x, grid.y, grid.z)` for concrete sizes; `None` for an unbound
    /// symbol or a y/z extent over 65535.
    pub fn grid(&self, env: &dyn Fn(&str) -> Option<i64>) -> Option<[u64; 3]> {
        grid_of(&self.grid_dims, self.grid_tiles, env)
    }
}

fn config(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<Config> {
    let Op::AttentionGrad(a) = &g.g[n].op else {
        return None;
    };
    // q, k, v, o and dO are read in 16-byte tiles; lse is f32.
    Config::of(g, c, n, (a.causal, a.scale), &[0, 1, 2, 3, 5], &[4], &[])
}

/// The three kernels of the FlashAttention-2 backward of `AttentionGrad`
/// node `n` in kernel `k` (its inputs q, k, v, o, lse, dO and outputs dq,
/// dk, dv in op order, as `op_kernel` lays them out), in launch order.
/// `None` unless the dtype is bf16 or f16 (lse f32), q, k and v share a head
/// dim of 64 or 128, the head counts are constants, and every row of q, k,
/// v, O and dO is 16-byte aligned and contiguous. Any causal flag,
/// grouped-query ratio, T and S.
///
/// `deterministic` picks the scheme: `true` gives delta, dK/dV and dQ
/// (every product recomputed where it is needed: 7 tile products, no
/// atomics, bit-identical from run to run); `false` gives delta (which also
/// clears an f32 dQ sum), dK/dV with dQ added into that sum by atomics, and
/// a pass that stores dQ (5 tile products, as FlashAttention-2 does; the
/// order of the additions, so dQ's last bits, vary between runs).
pub fn flash_backward(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    n: NodeIndex,
    source: Option<&str>,
    deterministic: bool,
    arch: FlashArch,
) -> Option<Vec<FlashBwdLaunch>> {
    let c = Ctx::for_op(g, p, k, n);
    let cfg = config(g, &c, n)?;
    let head = header(g, p, k, source);
    let rows = cfg
        .batch
        .checked_mul(&cfg.q_heads)?
        .checked_mul(&cfg.q_len)?;
    let d = cfg.head_dim;
    // Deterministic: delta [B, Hq, T]. Atomic: the dQ sum [B, Hq, T, D]
    // first (16-byte aligned rows for the vector reductions), then delta.
    let scratch = if deterministic {
        rows
    } else {
        rows.checked_mul(&Dim::constant(d as i64 + 1))?
    };
    let q_grid = [cfg.q_len.clone(), cfg.q_heads.clone(), cfg.batch.clone()];
    let kv_grid = [cfg.kv_len.clone(), cfg.kv_heads.clone(), cfg.batch.clone()];
    let qt = query_tile(d, deterministic);
    // Hopper's dK/dV/dQ kernel (wgmma) where the atomic scheme runs on sm_90a.
    let hopper = arch == FlashArch::Sm90a && !deterministic;
    let qkdo = vec![0, 1, 2, 4, 5];
    // (stage, suffix, grid extents, tile, reads, writes, static and dynamic
    // shared memory)
    let delta = (
        Stage::Delta,
        "delta",
        q_grid.clone(),
        DELTA_ROWS,
        vec![3, 5],
        vec![],
        DELTA_ROWS * (d / 8) * 4,
        0,
    );
    let stages = if deterministic {
        vec![
            delta,
            (
                Stage::DkDv,
                "dkdv",
                kv_grid,
                TILE_KEYS,
                qkdo.clone(),
                vec![1, 2],
                key_major_smem(d, qt, false),
                0,
            ),
            (
                Stage::Dq,
                "dq",
                q_grid,
                TILE_QUERIES,
                qkdo,
                vec![0],
                2 * key_tile(d) * (d + PAD) * 2,
                0,
            ),
        ]
    } else {
        vec![
            delta,
            (
                Stage::DkDvDq,
                "dkdvdq",
                kv_grid,
                if hopper { sm90::TILE_KEYS } else { TILE_KEYS },
                qkdo,
                vec![1, 2],
                0,
                if hopper {
                    sm90::smem_bytes(d)
                } else {
                    key_major_smem(d, qt, true)
                },
            ),
            (
                Stage::DqStore,
                "dqstore",
                q_grid,
                DELTA_ROWS,
                vec![],
                vec![0],
                0,
                0,
            ),
        ]
    };
    let mut out = Vec::new();
    for (stage, suffix, dims, tile, reads, writes, smem, dynamic) in stages {
        let mut block = THREADS;
        // Two blocks per SM: up to 255 registers each.
        let mut bounds = format!("{THREADS}, 2");
        let mut helpers = String::new();
        let mut maps = Vec::new();
        let body = match stage {
            Stage::Delta => delta_body(g, &c, n, &cfg, deterministic),
            Stage::DkDvDq if hopper => {
                block = sm90::THREADS;
                bounds = format!("{block}, 1");
                helpers = sm90::helpers(d);
                maps = sm90::tensor_maps(g, &c, n)?;
                tma::host_maps(&maps) + &sm90::dkdvdq_body(g, &c, n, &cfg, dynamic)
            }
            Stage::DkDv | Stage::DkDvDq => dkdv_body(g, &c, n, &cfg, deterministic, dynamic),
            Stage::Dq => dq_body(g, &c, n, &cfg),
            Stage::DqStore => dq_store_body(g, &c, n, &cfg),
        };
        let name = format!("{}_{suffix}", k.name);
        let mut s = tma::params(
            &kernel_head(&head, &k.name, &name, deterministic, &bounds)?,
            &maps,
        )?;
        if let Some(at) = s.find("extern \"C\" __global__") {
            s.insert_str(at, &helpers);
        }
        s.push_str(&body);
        s.push_str("}\n");
        out.push(FlashBwdLaunch {
            stage,
            name,
            source: s,
            grid_c: grid_c_of(&dims, tile),
            grid_dims: dims,
            grid_tiles: [tile, 1, 1],
            block,
            static_smem_bytes: smem,
            dynamic_smem_bytes: dynamic,
            reads,
            writes,
            scratch_f32_elems: scratch.clone(),
            tensor_maps: maps,
        });
    }
    Some(out)
}

/// Shared memory of a key-major kernel (`_dkdv`, `_dkdvdq`): the key and
/// value tiles, the query and dO tiles (16-bit rows `d + PAD` apart), dS^T
/// where dQ is summed (`TILE_KEYS` rows `queries + PAD` apart), lse and
/// delta.
fn key_major_smem(d: u64, queries: u64, ds_tile: bool) -> u64 {
    let ds = if ds_tile {
        TILE_KEYS * (queries + PAD) * 2
    } else {
        0
    };
    (2 * TILE_KEYS + 2 * queries) * (d + PAD) * 2 + ds + 2 * queries * 4
}

/// Queries per streamed tile of the key-major kernels: 64 at D = 64; at
/// D = 128, 16 for `_dkdv` (within 48 KiB of static shared memory) and 32
/// for `_dkdvdq` (dynamic shared memory).
fn query_tile(d: u64, deterministic: bool) -> u64 {
    match (d > 64, deterministic) {
        (false, _) => 64,
        (true, true) => 16,
        (true, false) => 32,
    }
}

/// Keys per streamed tile of `_dq`.
fn key_tile(d: u64) -> u64 {
    if d > 64 {
        32
    } else {
        64
    }
}

/// `header`'s text renamed to `name`, with the helpers before the signature,
/// `__launch_bounds__` and the scratch pointer as the last parameter.
pub(crate) fn kernel_head(
    head: &str,
    old: &str,
    name: &str,
    deterministic: bool,
    bounds: &str,
) -> Option<String> {
    let sig = format!("extern \"C\" __global__ void {old}(");
    let at = head.find(&sig)?;
    let close = head.rfind(")\n{")?;
    let mut s = String::new();
    s.push_str(&head[..at].replacen(&format!("// {old}:"), &format!("// {name}:"), 1));
    s.push_str(HELPERS);
    s.push_str(&format!(
        "extern \"C\" __global__ void __launch_bounds__({bounds}) {name}("
    ));
    s.push_str(&head[at + sig.len()..close]);
    s.push_str(if deterministic {
        ",\n    float* scratch /* f32 scratch [B, Hq, T]: delta = rowsum(dO * O) */)\n{\n"
    } else {
        ",\n    float* scratch /* f32 scratch: the dQ sum [B, Hq, T, D], then delta = rowsum(dO * O) [B, Hq, T] */)\n{\n"
    });
    Some(s)
}

/// Replaces every `$key` of `t`: at each `$`, the longest key that follows
/// it; a value is filled the same way first (snippets hold keys too).
pub(crate) fn fill(t: &str, subs: &[(&str, String)]) -> String {
    let mut keys: Vec<&(&str, String)> = subs.iter().collect();
    keys.sort_by_key(|(k, _)| std::cmp::Reverse(k.len()));
    let mut out = String::with_capacity(t.len());
    let mut rest = t;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        match keys.iter().find(|(k, _)| after.starts_with(k)) {
            Some((k, v)) => {
                out.push_str(&fill(v, subs));
                rest = &after[k.len()..];
            }
            None => {
                out.push('$');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Substitutions every body uses.
pub(crate) fn common_subs(
    g: &Graph,
    c: &Ctx,
    n: NodeIndex,
    cfg: &Config,
    deterministic: bool,
) -> Vec<(&'static str, String)> {
    let [q, k, v, o, lse, dout] = [0, 1, 2, 3, 4, 5].map(|i| Access::input(g, c, n, i));
    let (elem, ty) = elem_names(cfg.dt);
    vec![
        ("D", cfg.head_dim.to_string()),
        ("PAD", PAD.to_string()),
        ("T", cfg.q_len.to_c()),
        ("S", cfg.kv_len.to_c()),
        ("HQ", cfg.q_heads.to_c()),
        ("GROUP", cfg.group.to_string()),
        ("CAUSAL", cfg.causal.to_string()),
        (
            "SCALE_LOG2",
            float_lit(cfg.scale * std::f64::consts::LOG2_E),
        ),
        ("SCALE", float_lit(cfg.scale)),
        ("TY", ty.to_string()),
        ("MMA", format!("fs_mma_16816_{elem}")),
        ("PACK", format!("fs_pack_{elem}")),
        ("QP", q.ptr.clone()),
        ("KP", k.ptr.clone()),
        ("VP", v.ptr.clone()),
        ("DOP", dout.ptr.clone()),
        ("Q_AT", q.at(&["b", "i", "h", "0"])),
        ("K_AT", k.at(&["b", "j", "kv_h", "0"])),
        ("V_AT", v.at(&["b", "j", "kv_h", "0"])),
        ("DO_AT", dout.at(&["b", "i", "h", "0"])),
        ("O_AT", o.at(&["b", "i", "h", "0"])),
        (
            "LSE",
            load(
                lse.dt,
                &format!("{}[{}]", lse.ptr, lse.at(&["b", "h", "i"])),
            ),
        ),
        (
            "LOAD_DO",
            load(dout.dt, &format!("{}[do_row + e]", dout.ptr)),
        ),
        ("LOAD_O", load(o.dt, &format!("{}[o_row + e]", o.ptr))),
        ("NEG_INF", NEG_INF.to_string()),
        ("THREADS", THREADS.to_string()),
        // Where delta lies in the scratch: after the dQ sum, if there is one.
        (
            "DELTA",
            if deterministic {
                "scratch".to_string()
            } else {
                format!(
                    "(scratch + (fs_i64)({}) * {} * q_len * {})",
                    cfg.batch.to_c(),
                    cfg.q_heads.to_c(),
                    cfg.head_dim
                )
            },
        ),
    ]
}

fn delta_body(g: &Graph, c: &Ctx, n: NodeIndex, cfg: &Config, deterministic: bool) -> String {
    let mut subs = common_subs(g, c, n, cfg, deterministic);
    subs.push(("ROWS", DELTA_ROWS.to_string()));
    subs.push((
        "CLEAR_DQ_SUM",
        if deterministic {
            String::new()
        } else {
            CLEAR_DQ_SUM.to_string()
        },
    ));
    fill(
        r#"    // FlashAttention-2 backward, kernel 1 of 3: delta_i = rowsum(dO_i * O_i) per
    // (b, h, i), into scratch[(b * Hq + h) * T + i]. The block's $ROWS rows are
    // cut into chunks of 8 features; consecutive threads take consecutive
    // chunks (coalesced reads), then one thread per row adds its chunks'
    // partial sums in order (deterministic).
    const fs_i64 q_len = $T, h = blockIdx.y, b = blockIdx.z;
    constexpr int CHUNKS = $D / 8;
    __shared__ float part[$ROWS * CHUNKS];
    for (int idx = threadIdx.x; idx < $ROWS * CHUNKS; idx += $THREADS) {
        const fs_i64 i = (fs_i64)blockIdx.x * $ROWS + idx / CHUNKS;
        float acc = 0.0f;
        if (i < q_len) {
            const fs_i64 o_row = $O_AT + (idx % CHUNKS) * 8, do_row = $DO_AT + (idx % CHUNKS) * 8;
            for (int e = 0; e < 8; ++e) acc += $LOAD_DO * $LOAD_O;
        }
        part[idx] = acc;
    }
    __syncthreads();
    const fs_i64 i = (fs_i64)blockIdx.x * $ROWS + threadIdx.x;
    if (threadIdx.x < $ROWS && i < q_len) {
        float acc = 0.0f;
        for (int c = 0; c < CHUNKS; ++c) acc += part[threadIdx.x * CHUNKS + c];
        $DELTA[(b * $HQ + h) * q_len + i] = acc;
    }
$CLEAR_DQ_SUM"#,
        &subs,
    )
}

/// The delta kernel's second job when dQ is summed with atomics: its rows
/// of the sum set to zero.
const CLEAR_DQ_SUM: &str = r#"    // The same rows of the dQ sum (scratch [B, Hq, T, D]) set to zero for the
    // dK/dV kernel's atomics, 4 floats per store.
    for (int idx = threadIdx.x; idx < $ROWS * ($D / 4); idx += $THREADS) {
        const fs_i64 i = (fs_i64)blockIdx.x * $ROWS + idx / ($D / 4);
        if (i < q_len) fs_zero16((unsigned short*)&scratch[((b * $HQ + h) * q_len + i) * $D + (idx % ($D / 4)) * 4]);
    }
"#;

fn dq_store_body(g: &Graph, c: &Ctx, n: NodeIndex, cfg: &Config) -> String {
    let dq = Access::output(g, c, n, 0);
    let mut subs = common_subs(g, c, n, cfg, false);
    subs.push(("ROWS", DELTA_ROWS.to_string()));
    subs.push(("DQ_AT", dq.at(&["b", "i", "h", "0"])));
    subs.push(("DQP", dq.ptr.clone()));
    subs.push(("TO_DQ", store(dq.dt, "sum[e] * scale")));
    fill(
        r#"    // FlashAttention-2 backward, kernel 3 of 3: dQ = scale * the f32 sum the
    // dK/dV kernel added up (scratch [B, Hq, T, D]), in dQ's dtype. The block's
    // $ROWS rows are cut into chunks of 8 features, one per thread at a time
    // (16- and 32-byte accesses).
    const fs_i64 q_len = $T, h = blockIdx.y, b = blockIdx.z;
    const float scale = $SCALE;
    constexpr int CHUNKS = $D / 8;
    for (int idx = threadIdx.x; idx < $ROWS * CHUNKS; idx += $THREADS) {
        const fs_i64 i = (fs_i64)blockIdx.x * $ROWS + idx / CHUNKS;
        if (i >= q_len) continue;
        const int e0 = (idx % CHUNKS) * 8;
        float sum[8];
        fs_vload(sum, &scratch[((b * $HQ + h) * q_len + i) * $D + e0]);
        $TY out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = $TO_DQ;
        fs_vstore(&$DQP[$DQ_AT + e0], out);
    }
"#,
        &subs,
    )
}

/// `_dkdv` or `_dkdvdq` (with `dynamic` bytes of dynamic shared memory).
fn dkdv_body(
    g: &Graph,
    c: &Ctx,
    n: NodeIndex,
    cfg: &Config,
    deterministic: bool,
    dynamic: u64,
) -> String {
    let mut subs = common_subs(g, c, n, cfg, deterministic);
    subs.push(p_subs(12));
    let (title, tiles, store_ds, dq_sum) = if deterministic {
        ("kernel 2 of 3: dK and dV", STATIC_TILES, "", "")
    } else {
        (
            "kernel 2 of 3: dK, dV and dQ",
            DYNAMIC_TILES,
            STORE_DS,
            DQ_SUM,
        )
    };
    subs.push(("TITLE", title.to_string()));
    subs.push(("SMEM_BYTES", dynamic.to_string()));
    subs.push(("TILES", tiles.to_string()));
    subs.push(("STORE_DS", store_ds.trim_end().to_string()));
    subs.push(("DQ_SUM", dq_sum.to_string()));
    subs.push((
        "TILE_Q",
        query_tile(cfg.head_dim, deterministic).to_string(),
    ));
    subs.push(("TILE_K", TILE_KEYS.to_string()));
    subs.extend(dkdv_store_subs(g, c, n));
    fill(DKDV, &subs)
}

/// `$P_OF_S`: P^T = exp2(S^T * scale_log2 - lse) in place of the
/// accumulators `s[n][e]` (key row `key_row + 8 * (e / 2)` of the block's
/// `k0 ..`, query column `8n + frag_col + e % 2` of the tile's `i0 ..`),
/// masked (queries past q_len; causal: keys after the query) in a loop of
/// its own on the tiles that can need it, so that the others carry no index
/// arithmetic: one mask rule for the key-major kernels (mma.sync and
/// wgmma), indented `indent` spaces. Written as one loop with a per-element
/// `if (edge)`, ptxas made it 64-bit compares on every tile
/// (`docs/benchmarks.md`).
pub(crate) fn p_subs(indent: usize) -> (&'static str, String) {
    let text = P_OF_S
        .lines()
        .map(|l| {
            if l.starts_with('#') || l.is_empty() {
                l.to_string()
            } else {
                format!("{:indent$}{l}", "")
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    ("P_OF_S", text)
}

const P_OF_S: &str = "const int rows = q_len - i0 < TILE_Q ? (int)(q_len - i0) : TILE_Q;  // queries in the tile
if (rows < TILE_Q || (causal && i0 < k0 + TILE_K)) {
    // Key row kr (of the block) comes after query column qc (of the tile) if kr > qc + diag.
    const int diag = (int)(i0 - k0);
#pragma unroll
    for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qc = n * 8 + frag_col + (e & 1), kr = key_row + 8 * (e >> 1);
            const float p = fs_exp2(s[n][e] * scale_log2 - lse_tile[qc]);
            s[n][e] = qc >= rows || (causal && kr > qc + diag) ? 0.0f : p;
        }
    }
} else {
#pragma unroll
    for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = fs_exp2(s[n][e] * scale_log2 - lse_tile[n * 8 + frag_col + (e & 1)]);
    }
}";

/// How the key-major kernels store dK (scaled) and dV from their
/// accumulators: `$STORE_DKDV`, the last step of both dK/dV kernels (each
/// thread's key rows `key_row` and `key_row + 8` of the block's `k0 ..`),
/// filled from `$DK_AT`/`$DV_AT` (row `j` of kv head `kv_h`) and the four
/// stores of `dk_acc[n][2r + e]`, `dv_acc[n][2r + e]` at `dk_row`/`dv_row`.
pub(crate) fn dkdv_store_subs(g: &Graph, c: &Ctx, n: NodeIndex) -> Vec<(&'static str, String)> {
    let [dk, dv] = [1, 2].map(|o| Access::output(g, c, n, o));
    let mut subs = vec![("STORE_DKDV", STORE_DKDV.to_string())];
    subs.push(("DK_AT", dk.at(&["b", "j", "kv_h", "0"])));
    subs.push((
        "STORE_DK0",
        format!(
            "{}[dk_row + n * 8 + frag_col] = {};",
            dk.ptr,
            store(dk.dt, "dk_acc[n][2 * r] * scale")
        ),
    ));
    subs.push((
        "STORE_DK1",
        format!(
            "{}[dk_row + n * 8 + frag_col + 1] = {};",
            dk.ptr,
            store(dk.dt, "dk_acc[n][2 * r + 1] * scale")
        ),
    ));
    subs.push((
        "STORE_DV0",
        format!(
            "{}[dv_row + n * 8 + frag_col] = {};",
            dv.ptr,
            store(dv.dt, "dv_acc[n][2 * r]")
        ),
    ));
    subs.push((
        "STORE_DV1",
        format!(
            "{}[dv_row + n * 8 + frag_col + 1] = {};",
            dv.ptr,
            store(dv.dt, "dv_acc[n][2 * r + 1]")
        ),
    ));
    subs.push(("DV_AT", dv.at(&["b", "j", "kv_h", "0"])));
    subs
}

const STORE_DKDV: &str = r#"    // Last, each key row once: dK = scale * acc, dV = acc (rows past kv_len dropped).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const fs_i64 j = k0 + key_row + 8 * r;
        if (j < kv_len) {
            const fs_i64 dk_row = $DK_AT, dv_row = $DV_AT;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                $STORE_DK0
                $STORE_DK1
                $STORE_DV0
                $STORE_DV1
            }
        }
    }
"#;

/// `_dq`'s S and dP products for keys 8n .. 8n + 15, fragments by ldmatrix.
const S_DP_BY_LDMATRIX: &str = r#"                unsigned bk[4];
                fs_b_frags(bk, &k_tile[n * 8 * ROW + kk * 16], ROW);
                $MMA(s[n], q_frag[kk], bk[0], bk[1]);
                $MMA(s[n + 1], q_frag[kk], bk[2], bk[3]);
                unsigned bv[4];
                fs_b_frags(bv, &v_tile[n * 8 * ROW + kk * 16], ROW);
                $MMA(dp[n], do_frag[kk], bv[0], bv[1]);
                $MMA(dp[n + 1], do_frag[kk], bv[2], bv[3]);
"#;

/// The same with 32-bit loads (fewer registers live).
const S_DP_BY_WORDS: &str = r#"                for (int m = n; m < n + 2; ++m) {
                    const $TY* key = &k_tile[(m * 8 + frag_row) * ROW + kk * 16 + frag_col];
                    const $TY* value = &v_tile[(m * 8 + frag_row) * ROW + kk * 16 + frag_col];
                    $MMA(s[m], q_frag[kk], fs_ld32(key), fs_ld32(key + 8));
                    $MMA(dp[m], do_frag[kk], fs_ld32(value), fs_ld32(value + 8));
                }
"#;

/// The deterministic scheme's tiles, in static shared memory.
const STATIC_TILES: &str = r#"    alignas(16) __shared__ $TY k_tile[TILE_K * ROW];
    alignas(16) __shared__ $TY v_tile[TILE_K * ROW];
    alignas(16) __shared__ $TY q_tile[TILE_Q * ROW];
    alignas(16) __shared__ $TY do_tile[TILE_Q * ROW];
    __shared__ float lse_tile[TILE_Q];    // lse * log2(e) of the tile's queries
    __shared__ float delta_tile[TILE_Q];  // delta of the tile's queries
"#;

/// The atomic scheme's tiles, over 48 KiB, in dynamic shared memory; dS^T's
/// rows `TILE_Q + 8` apart (conflict-free 32-bit stores and ldmatrix rows).
const DYNAMIC_TILES: &str = r#"    constexpr int DS_ROW = TILE_Q + $PAD;
    FS_DYNAMIC_SMEM(smem, $SMEM_BYTES);
    $TY* const k_tile = reinterpret_cast<$TY*>(smem);
    $TY* const v_tile = k_tile + TILE_K * ROW;
    $TY* const q_tile = v_tile + TILE_K * ROW;
    $TY* const do_tile = q_tile + TILE_Q * ROW;
    $TY* const ds_tile = do_tile + TILE_Q * ROW;  // dS^T of the tile: [key][query]
    float* const lse_tile = reinterpret_cast<float*>(ds_tile + TILE_K * DS_ROW);  // lse * log2(e) of the tile's queries
    float* const delta_tile = lse_tile + TILE_Q;  // delta of the tile's queries
"#;

/// dS^T's A fragment of queries 16kk .. 16kk + 15 into the shared tile.
const STORE_DS: &str = r#"                // dS^T into the shared tile (rows key_row and key_row + 8) for dQ below.
                fs_st32(&ds_tile[key_row * DS_ROW + kk * 16 + frag_col], ds_frag[0]);
                fs_st32(&ds_tile[(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[1]);
                fs_st32(&ds_tile[key_row * DS_ROW + kk * 16 + 8 + frag_col], ds_frag[2]);
                fs_st32(&ds_tile[(key_row + 8) * DS_ROW + kk * 16 + 8 + frag_col], ds_frag[3]);
"#;

/// The atomic scheme's dQ: the tile's part of dS K added into the sum.
const DQ_SUM: &str = r#"
            // 6. dQ += dS K for the tile's queries and the block's keys, added into
            //    the f32 sum in the scratch ([B, Hq, T, D]) by atomics. A: dS from the
            //    shared dS^T tile (ldmatrix.trans); B: the key rows, as in dQ's own
            //    kernel. Warp w takes queries 16 * (w / DQ_SPLIT) .. + 15 and features
            //    DQ_COLS * (w % DQ_SPLIT) .. + DQ_COLS - 1, at most 32 at a time
            //    (fewer registers live).
            __syncthreads();  // dS^T is complete
            constexpr int DQ_SPLIT = ($THREADS / 32) / (TILE_Q / 16), DQ_COLS = HEAD_DIM / DQ_SPLIT;
            constexpr int DQ_CHUNK = DQ_COLS < 32 ? DQ_COLS : 32;
            const int m0 = (warp / DQ_SPLIT) * 16;
#pragma unroll
            for (int c0 = (warp % DQ_SPLIT) * DQ_COLS; c0 < (warp % DQ_SPLIT + 1) * DQ_COLS; c0 += DQ_CHUNK) {
                float dq_acc[DQ_CHUNK / 8][4];
#pragma unroll
                for (int n = 0; n < DQ_CHUNK / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) dq_acc[n][e] = 0.0f;
                }
#pragma unroll
                for (int kk = 0; kk < TILE_K / 16; ++kk) {
                    unsigned ds_a[4];
                    fs_a_frag_t(ds_a, &ds_tile[kk * 16 * DS_ROW + m0], DS_ROW);
#pragma unroll
                    for (int n = 0; n < DQ_CHUNK / 8; n += 2) {
                        unsigned bk[4];
                        fs_b_frags_t(bk, &k_tile[kk * 16 * ROW + c0 + n * 8], ROW);
                        $MMA(dq_acc[n], ds_a, bk[0], bk[1]);
                        $MMA(dq_acc[n + 1], ds_a, bk[2], bk[3]);
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const fs_i64 i = i0 + m0 + frag_row + 8 * r;
                    if (i < q_len) {
                        float* sum = &scratch[((b * $HQ + h) * q_len + i) * HEAD_DIM + c0 + frag_col];
#pragma unroll
                        for (int n = 0; n < DQ_CHUNK / 8; ++n) fs_atomic_add2(sum + n * 8, dq_acc[n][2 * r], dq_acc[n][2 * r + 1]);
                    }
                }
            }
"#;

const DKDV: &str = r#"    // FlashAttention-2 backward, $TITLE on tensor cores
    // (mma.m16n8k16, f32 accumulation). Block = (tile of $TILE_K keys, kv head,
    // batch); warp w owns the tile's keys 16w .. 16w + 15 and computes the
    // transposed products S^T = K Q^T and dP^T = V dO^T, so that P^T and
    // dS^T = P^T * (dP^T - delta) come out in the accumulator layout, which is
    // the A-fragment layout of dV += P^T dO and dK += dS^T Q. Queries of every
    // head of the group stream through shared memory $TILE_Q rows at a time.
    constexpr int TILE_K = $TILE_K, TILE_Q = $TILE_Q, HEAD_DIM = $D;
    constexpr int ROW = HEAD_DIM + $PAD;      // shared row pitch: 16-byte rows, conflict-free fragment reads
    constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
    const fs_i64 q_len = $T, kv_len = $S, group = $GROUP;
    const bool causal = $CAUSAL;  // if so, keys j > query i are masked
    const float scale = $SCALE, scale_log2 = $SCALE_LOG2;  // exp(x * scale) = exp2(x * scale_log2)
    const fs_i64 k0 = (fs_i64)blockIdx.x * TILE_K, kv_h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
$TILES
    // 1. The block's keys and values (rows past kv_len zero; their dK, dV are
    //    never stored). The first barrier of the query loop publishes them.
    for (int c = threadIdx.x; c < TILE_K * CHUNKS; c += $THREADS) {
        const int r = c / CHUNKS, e = (c % CHUNKS) * 8;
        const fs_i64 j = k0 + r;
        if (j < kv_len) {
            fs_copy16(&k_tile[r * ROW + e], &$KP[$K_AT + e]);
            fs_copy16(&v_tile[r * ROW + e], &$VP[$V_AT + e]);
        } else {
            fs_zero16(&k_tile[r * ROW + e]);
            fs_zero16(&v_tile[r * ROW + e]);
        }
    }

    // dk_acc[n][e], dv_acc[n][e]: key row key_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
    const int key_row = warp * 16 + frag_row;
    float dk_acc[HEAD_DIM / 8][4], dv_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
    }
    // Causal: query tiles before the first that can see key k0 are skipped.
    const fs_i64 i_first = causal ? (k0 / TILE_Q) * TILE_Q : 0;
    for (fs_i64 hh = 0; hh < group; ++hh) {
        const fs_i64 h = kv_h * group + hh;
        for (fs_i64 i0 = i_first; i0 < q_len; i0 += TILE_Q) {
            // 2. Queries and dO i0 .. i0 + TILE_Q - 1 of head h (rows past q_len zero),
            //    their lse (log2 units) and delta.
            __syncthreads();  // every warp is done with the previous tile
            for (int c = threadIdx.x; c < TILE_Q * CHUNKS; c += $THREADS) {
                const int r = c / CHUNKS, e = (c % CHUNKS) * 8;
                const fs_i64 i = i0 + r;
                if (i < q_len) {
                    fs_copy16(&q_tile[r * ROW + e], &$QP[$Q_AT + e]);
                    fs_copy16(&do_tile[r * ROW + e], &$DOP[$DO_AT + e]);
                } else {
                    fs_zero16(&q_tile[r * ROW + e]);
                    fs_zero16(&do_tile[r * ROW + e]);
                }
            }
            if (threadIdx.x < TILE_Q) {
                const fs_i64 i = i0 + threadIdx.x;
                lse_tile[threadIdx.x] = i < q_len ? $LSE * 1.4426950408889634f : 0.0f;
                delta_tile[threadIdx.x] = i < q_len ? $DELTA[(b * $HQ + h) * q_len + i] : 0.0f;
            }
            __syncthreads();

            // 3. S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys:
            //    s[n][e], dp[n][e] = key key_row + 8 * (e / 2), query i0 + 8n + frag_col + e % 2.
            //    A: the warp's K / V rows; B: query / dO rows 8n .. 8n + 15, one ldmatrix each.
            float s[TILE_Q / 8][4], dp[TILE_Q / 8][4];
#pragma unroll
            for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
            }
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
                unsigned k_frag[4], v_frag[4];
                fs_a_frag(k_frag, &k_tile[warp * 16 * ROW + kk * 16], ROW);
                fs_a_frag(v_frag, &v_tile[warp * 16 * ROW + kk * 16], ROW);
#pragma unroll
                for (int n = 0; n < TILE_Q / 8; n += 2) {
                    unsigned bq[4], bo[4];
                    fs_b_frags(bq, &q_tile[n * 8 * ROW + kk * 16], ROW);
                    fs_b_frags(bo, &do_tile[n * 8 * ROW + kk * 16], ROW);
                    $MMA(s[n], k_frag, bq[0], bq[1]);
                    $MMA(s[n + 1], k_frag, bq[2], bq[3]);
                    $MMA(dp[n], v_frag, bo[0], bo[1]);
                    $MMA(dp[n + 1], v_frag, bo[2], bo[3]);
                }
            }

            // 4. P^T = exp2(S^T * scale_log2 - lse_log2), masked (queries past q_len;
            //    causal: keys after the query) only on tiles that can need it;
            //    dS^T = P^T * (dP^T - delta), in place of dp.
$P_OF_S
#pragma unroll
            for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);
            }

            // 5. dV += P^T dO and dK += dS^T Q. The accumulators of queries
            //    16kk .. 16kk + 15 are the A fragments; the B fragments of
            //    features 8n .. 8n + 15 come from the dO / Q rows in one
            //    ldmatrix.trans each.
#pragma unroll
            for (int kk = 0; kk < TILE_Q / 16; ++kk) {
                const unsigned p_frag[4] = {$PACK(s[2 * kk][0], s[2 * kk][1]), $PACK(s[2 * kk][2], s[2 * kk][3]),
                                            $PACK(s[2 * kk + 1][0], s[2 * kk + 1][1]), $PACK(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                const unsigned ds_frag[4] = {$PACK(dp[2 * kk][0], dp[2 * kk][1]), $PACK(dp[2 * kk][2], dp[2 * kk][3]),
                                             $PACK(dp[2 * kk + 1][0], dp[2 * kk + 1][1]), $PACK(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
$STORE_DS
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; n += 2) {
                    unsigned bo[4], bq[4];
                    fs_b_frags_t(bo, &do_tile[kk * 16 * ROW + n * 8], ROW);
                    fs_b_frags_t(bq, &q_tile[kk * 16 * ROW + n * 8], ROW);
                    $MMA(dv_acc[n], p_frag, bo[0], bo[1]);
                    $MMA(dv_acc[n + 1], p_frag, bo[2], bo[3]);
                    $MMA(dk_acc[n], ds_frag, bq[0], bq[1]);
                    $MMA(dk_acc[n + 1], ds_frag, bq[2], bq[3]);
                }
            }
$DQ_SUM        }
    }

$STORE_DKDV"#;

fn dq_body(g: &Graph, c: &Ctx, n: NodeIndex, cfg: &Config) -> String {
    let dq = Access::output(g, c, n, 0);
    let mut subs = common_subs(g, c, n, cfg, true);
    subs.push(("TILE_Q", TILE_QUERIES.to_string()));
    subs.push(("TILE_K", key_tile(cfg.head_dim).to_string()));
    subs.push(("DQ_AT", dq.at(&["b", "i", "h", "0"])));
    subs.push((
        "STORE_DQ0",
        format!(
            "{}[dq_row + n * 8 + frag_col] = {};",
            dq.ptr,
            store(dq.dt, "dq_acc[n][2 * r] * scale")
        ),
    ));
    subs.push((
        "STORE_DQ1",
        format!(
            "{}[dq_row + n * 8 + frag_col + 1] = {};",
            dq.ptr,
            store(dq.dt, "dq_acc[n][2 * r + 1] * scale")
        ),
    ));
    // At D = 128 the registers are nearly all taken (Q, dO and dQ stay in
    // them): four fragments at once spill, so K and V are read 32 bits at a
    // time there.
    let products = if cfg.head_dim > 64 {
        S_DP_BY_WORDS
    } else {
        S_DP_BY_LDMATRIX
    };
    subs.push(("S_DP_PRODUCTS", products.trim_end().to_string()));
    fill(DQ, &subs)
}

const DQ: &str = r#"    // FlashAttention-2 backward, kernel 3 of 3: dQ on tensor cores. Block =
    // (tile of $TILE_Q queries, query head, batch); warp w owns rows 16w .. 16w + 15.
    // Q and dO are A fragments in registers; keys and values stream through
    // shared memory $TILE_K rows at a time: S = Q K^T, dP = dO V^T,
    // dS = P * (dP - delta), dQ += dS K.
    constexpr int TILE_Q = $TILE_Q, TILE_K = $TILE_K, HEAD_DIM = $D;
    constexpr int ROW = HEAD_DIM + $PAD;      // shared row pitch: 16-byte rows, conflict-free fragment reads
    constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
    const fs_i64 q_len = $T, kv_len = $S, group = $GROUP;
    const bool causal = $CAUSAL;  // if so, keys j > query i are masked
    const float scale = $SCALE, scale_log2 = $SCALE_LOG2;  // exp(x * scale) = exp2(x * scale_log2)
    const fs_i64 q0 = (fs_i64)blockIdx.x * TILE_Q, h = blockIdx.y, b = blockIdx.z, kv_h = h / group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
    // The key tile, then the value tile; before the first key tile, the
    // staging area of Q and dO (2 * TILE_K >= TILE_Q rows).
    alignas(16) __shared__ $TY kv_tiles[2 * TILE_K * ROW];
    $TY* const k_tile = kv_tiles;
    $TY* const v_tile = kv_tiles + TILE_K * ROW;
    static_assert(2 * TILE_K >= TILE_Q, "the staging area holds a query tile");

    // 1. Q and dO of the tile into registers as A fragments (through shared
    //    memory, rows past q_len zero): frag[kk] covers features 16kk .. 16kk + 15
    //    of rows q_row and q_row + 8.
    const int q_row = warp * 16 + frag_row;
    unsigned q_frag[HEAD_DIM / 16][4], do_frag[HEAD_DIM / 16][4];
    for (int c = threadIdx.x; c < TILE_Q * CHUNKS; c += $THREADS) {
        const int r = c / CHUNKS, e = (c % CHUNKS) * 8;
        const fs_i64 i = q0 + r;
        if (i < q_len) fs_copy16(&kv_tiles[r * ROW + e], &$QP[$Q_AT + e]);
        else fs_zero16(&kv_tiles[r * ROW + e]);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) fs_a_frag(q_frag[kk], &kv_tiles[warp * 16 * ROW + kk * 16], ROW);
    __syncthreads();
    for (int c = threadIdx.x; c < TILE_Q * CHUNKS; c += $THREADS) {
        const int r = c / CHUNKS, e = (c % CHUNKS) * 8;
        const fs_i64 i = q0 + r;
        if (i < q_len) fs_copy16(&kv_tiles[r * ROW + e], &$DOP[$DO_AT + e]);
        else fs_zero16(&kv_tiles[r * ROW + e]);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) fs_a_frag(do_frag[kk], &kv_tiles[warp * 16 * ROW + kk * 16], ROW);
    // lse (log2 units) and delta of rows q_row (index 0) and q_row + 8 (index 1).
    const fs_i64 i_lo = q0 + q_row, i_hi = i_lo + 8;
    float lse2[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const fs_i64 i = r == 0 ? i_lo : i_hi;
        lse2[r] = i < q_len ? $LSE * 1.4426950408889634f : 0.0f;
        delta[r] = i < q_len ? $DELTA[(b * $HQ + h) * q_len + i] : 0.0f;
    }

    // dq_acc[n][e] = row q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
    float dq_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dq_acc[n][e] = 0.0f;
    }
    // Causal: key tiles after the query tile's last row are never visited.
    const fs_i64 kv_end = causal && q0 + TILE_Q < kv_len ? q0 + TILE_Q : kv_len;
    for (fs_i64 k0 = 0; k0 < kv_end; k0 += TILE_K) {
        // 2. Keys and values k0 .. k0 + TILE_K - 1 (rows past kv_len zero).
        __syncthreads();  // every warp is done with the previous tile (and the staging)
        for (int c = threadIdx.x; c < TILE_K * CHUNKS; c += $THREADS) {
            const int r = c / CHUNKS, e = (c % CHUNKS) * 8;
            const fs_i64 j = k0 + r;
            if (j < kv_len) {
                fs_copy16(&k_tile[r * ROW + e], &$KP[$K_AT + e]);
                fs_copy16(&v_tile[r * ROW + e], &$VP[$V_AT + e]);
            } else {
                fs_zero16(&k_tile[r * ROW + e]);
                fs_zero16(&v_tile[r * ROW + e]);
            }
        }
        __syncthreads();

        // 3. S = Q K^T and dP = dO V^T: s[n][e], dp[n][e] = row q_row + 8 * (e / 2),
        //    key k0 + 8n + frag_col + e % 2; the B fragments of keys 8n .. 8n + 15 in one ldmatrix.
        float s[TILE_K / 8][4], dp[TILE_K / 8][4];
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
        }
#pragma unroll
        for (int n = 0; n < TILE_K / 8; n += 2) {
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
$S_DP_PRODUCTS
            }
        }

        // 4. P = exp2(S * scale_log2 - lse_log2), masked (keys past kv_len; causal:
        //    keys after the query) only on tiles that can need it;
        //    dS = P * (dP - delta), in place of dp.
        const bool edge = k0 + TILE_K > kv_len || (causal && k0 + TILE_K - 1 > q0 + warp * 16);
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                float p = fs_exp2(s[n][e] * scale_log2 - lse2[r]);
                if (edge) {
                    const fs_i64 j = k0 + n * 8 + frag_col + (e & 1), i = r == 0 ? i_lo : i_hi;
                    if (j >= kv_len || (causal && j > i)) p = 0.0f;
                }
                dp[n][e] = p * (dp[n][e] - delta[r]);
            }
        }

        // 5. dQ += dS K: the accumulators of keys 16kk .. 16kk + 15 are dS's A
        //    fragment; the B fragments of features 8n .. 8n + 15 come from the key
        //    rows in one ldmatrix.trans.
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; ++kk) {
            const unsigned ds_frag[4] = {$PACK(dp[2 * kk][0], dp[2 * kk][1]), $PACK(dp[2 * kk][2], dp[2 * kk][3]),
                                         $PACK(dp[2 * kk + 1][0], dp[2 * kk + 1][1]), $PACK(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; n += 2) {
                unsigned b[4];
                fs_b_frags_t(b, &k_tile[kk * 16 * ROW + n * 8], ROW);
                $MMA(dq_acc[n], ds_frag, b[0], b[1]);
                $MMA(dq_acc[n + 1], ds_frag, b[2], b[3]);
            }
        }
    }

    // 6. dQ = scale * acc, each row once (rows past q_len dropped).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const fs_i64 i = r == 0 ? i_lo : i_hi;
        if (i < q_len) {
            const fs_i64 dq_row = $DQ_AT;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; ++n) {
                $STORE_DQ0
                $STORE_DQ1
            }
        }
    }
"#;
