//! The `kernels/attention/` templates as the emitter instantiates them:
//! for each, the C++ type, the header that defines it, and the launch
//! constants it exposes (threads, rows per block, dynamic shared memory),
//! worked out here as the template works them out. The wrapper
//! `static_assert`s every one of them against the template's own, so a
//! change on one side that the other misses fails to compile.

use crate::ir::types::DType;

/// `x` rounded up to a multiple of `m` (`fs_attn::round_up`).
pub(crate) fn round_up(x: u64, m: u64) -> u64 {
    x.div_ceil(m) * m
}

/// Head dims are padded to whole tensor-core steps inside the tiles.
pub(crate) fn pad16(d: u64) -> u64 {
    round_up(d, 16)
}

/// The Hopper forward's padded head dims (`sm90.cuh`'s `swizzle_pad`):
/// whole 16-feature steps, or the next multiple of 64 where
/// 16 would leave the tiles the 32-byte swizzle and 64 costs at most a
/// seventh more tensor work (112 -> 128, 176 -> 192, 240 -> 256).
pub(crate) fn swizzle_pad(d: u64) -> u64 {
    let (p16, p64) = (pad16(d), round_up(d, 64));
    if !p16.is_multiple_of(32) && p64 * 7 <= d * 8 {
        p64
    } else {
        p16
    }
}

/// Shared memory a block may have on sm_90 (227 KiB).
pub(crate) const SM90_SMEM_LIMIT: u64 = 227 * 1024;

/// One template instantiated: what the wrapper and the launch need.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Instance {
    /// The header under `kernels/` that defines it.
    pub header: &'static str,
    /// The C++ type: `fs_attn::ForwardSm80<fs_attn::Bf16, 64, 64, true, true>`.
    pub ty: String,
    pub threads: u32,
    /// `__launch_bounds__`'s arguments.
    pub bounds: String,
    /// Rows (queries or keys) per block along grid x, and blocks per such
    /// tile (feature parts).
    pub tile: u64,
    pub parts: u64,
    pub smem: u64,
    /// Needs sm_90a.
    pub sm90: bool,
    /// The constants the wrapper checks against the template's:
    /// `(name, value)`.
    pub checks: Vec<(&'static str, u64)>,
}

impl Instance {
    /// The same instance with `DROPOUT = true`, the last template
    /// parameter of the mma.sync forward and backward templates.
    pub(crate) fn with_dropout(mut self) -> Instance {
        if let Some(close) = self.ty.rfind('>') {
            self.ty.insert_str(close, ", true");
        }
        self
    }
}

fn elem(dt: DType) -> &'static str {
    match dt {
        DType::F16 => "fs_attn::F16",
        DType::F32 => "fs_attn::F32",
        _ => "fs_attn::Bf16",
    }
}

/// The template arguments shared by every attention template: element
/// type, then head dims.
fn args(dt: DType, d: u64, dv: u64) -> String {
    format!("{}, {d}, {dv}", elem(dt))
}

/// `forward_sm80.cuh`'s `ForwardSm80`.
pub(crate) fn forward_sm80(
    dt: DType,
    d: u64,
    dv: u64,
    causal: bool,
    scale_in_exp: bool,
) -> Instance {
    let (dp, dvp) = (pad16(d), pad16(dv));
    let q_in_regs = dp <= 128 && dvp <= 128;
    let tile_k = if q_in_regs { 64 } else { 32 };
    let (row, row_v) = (dp + 8, dvp + 8);
    let smem = (tile_k * row + tile_k * row_v + if q_in_regs { 0 } else { 64 * row }) * 2;
    Instance {
        header: "attention/forward_sm80.cuh",
        ty: format!(
            "fs_attn::ForwardSm80<{}, {causal}, {scale_in_exp}>",
            args(dt, d, dv)
        ),
        threads: 128,
        // Two blocks an SM, up to 255 registers a thread: with the bound
        // alone ptxas held one variant to 128 and spilled.
        bounds: "128, 2".into(),
        tile: 64,
        parts: 1,
        smem,
        sm90: false,
        checks: vec![
            ("THREADS", 128),
            ("TILE_Q", 64),
            ("TILE_K", tile_k),
            ("SMEM_BYTES", smem),
        ],
    }
}

/// Shared memory the f32 kernels keep within (the most a block has on
/// sm_86 and sm_89), as their templates assert.
pub(crate) const F32_SMEM_LIMIT: u64 = 99 * 1024;

/// `forward_f32.cuh`'s `ForwardF32`: 64 queries and 64 keys a tile up to
/// 128 padded features, else 32 and 32. `precise`: 3xTF32 products.
pub(crate) fn forward_f32(
    d: u64,
    dv: u64,
    causal: bool,
    scale_in_exp: bool,
    dropout: bool,
    precise: bool,
) -> Instance {
    let (dp, dvp) = (round_up(d, 8), round_up(dv, 8));
    let tile = if dp > 128 || dvp > 128 { 32 } else { 64 };
    let threads = (tile * 2) as u32;
    let smem = (tile * (dp + 4) + tile * (dp + 4) + tile * (dvp + 4)) * 4;
    Instance {
        header: "attention/forward_f32.cuh",
        ty: format!(
            "fs_attn::ForwardF32<{d}, {dv}, {causal}, {scale_in_exp}, {dropout}, {precise}>"
        ),
        threads,
        bounds: format!("{threads}, 2"),
        tile,
        parts: 1,
        smem,
        sm90: false,
        checks: vec![
            ("THREADS", threads as u64),
            ("TILE_Q", tile),
            ("TILE_K", tile),
            ("SMEM_BYTES", smem),
        ],
    }
}

/// `backward_f32.cuh`'s `dkdv_f32_smem`: `DkDvF32`'s shared memory at a
/// query tile of `tq` rows.
fn dkdv_f32_smem(dp: u64, dvp: u64, tq: u64, atomic: bool) -> u64 {
    let ds = if atomic { 64 * (tq + 4) } else { 0 };
    (64 * (dp + dvp + 8) + tq * (dp + dvp + 8) + ds) * 4 + 2 * tq * 4
}

/// Whether the f32 backward holds head dims `d`, `dv`: dK and dV
/// accumulators for up to 256 padded features in all.
pub(crate) fn f32_backward_fits(d: u64, dv: u64) -> bool {
    round_up(d, 8) + round_up(dv, 8) <= 256
}

/// `backward_f32.cuh`'s `DkDvF32`: 64 keys a block; 64-query tiles up to
/// 64 features each, else 32 or 16, whichever fits [`F32_SMEM_LIMIT`].
pub(crate) fn dkdv_f32(
    d: u64,
    dv: u64,
    causal: bool,
    atomic: bool,
    dropout: bool,
    precise: bool,
) -> Instance {
    let (dp, dvp) = (round_up(d, 8), round_up(dv, 8));
    let tile_q = if dp <= 64 && dvp <= 64 {
        64
    } else if dkdv_f32_smem(dp, dvp, 32, atomic) <= F32_SMEM_LIMIT {
        32
    } else {
        16
    };
    let smem = dkdv_f32_smem(dp, dvp, tile_q, atomic);
    Instance {
        header: "attention/backward_f32.cuh",
        ty: format!("fs_attn::DkDvF32<{d}, {dv}, {causal}, {atomic}, {dropout}, {precise}>"),
        threads: 128,
        bounds: "128, 2".into(),
        tile: 64,
        parts: 1,
        smem,
        sm90: false,
        checks: vec![
            ("THREADS", 128),
            ("TILE_K", 64),
            ("TILE_Q", tile_q),
            ("SMEM_BYTES", smem),
        ],
    }
}

/// `backward_f32.cuh`'s `DqF32`: 64 queries a block; 64-key tiles up to 64
/// features each, else 32 or 16, whichever fits [`F32_SMEM_LIMIT`].
pub(crate) fn dq_f32(d: u64, dv: u64, causal: bool, dropout: bool, precise: bool) -> Instance {
    let (dp, dvp) = (round_up(d, 8), round_up(dv, 8));
    let smem_at = |tk: u64| (64 + tk) * (dp + dvp + 8) * 4;
    let tile_k = if dp <= 64 && dvp <= 64 {
        64
    } else if smem_at(32) <= F32_SMEM_LIMIT {
        32
    } else {
        16
    };
    let smem = smem_at(tile_k);
    Instance {
        header: "attention/backward_f32.cuh",
        ty: format!("fs_attn::DqF32<{d}, {dv}, {causal}, {dropout}, {precise}>"),
        threads: 128,
        bounds: "128, 2".into(),
        tile: 64,
        parts: 1,
        smem,
        sm90: false,
        checks: vec![
            ("THREADS", 128),
            ("TILE_Q", 64),
            ("TILE_K", tile_k),
            ("SMEM_BYTES", smem),
        ],
    }
}

/// `forward_sm90.cuh`'s `ForwardSm90` (a block a query tile), or up to 64
/// padded features `forward_sm90_persistent.cuh`'s `ForwardSm90Persistent`
/// (a block a multiprocessor walking the work items); its key/value tile
/// rows, and whether it is the persistent one. With dropout: the one a
/// block a query tile, two consumer warpgroups.
pub(crate) fn forward_sm90(
    dt: DType,
    d: u64,
    dv: u64,
    causal: bool,
    scale_in_exp: bool,
    persistent_ok: bool,
    dropout: bool,
) -> (Instance, u64, bool) {
    let (dp, dvp) = (swizzle_pad(d), swizzle_pad(dv));
    let wgs = if dp <= 64 && dvp <= 64 && !dropout {
        3
    } else {
        2
    };
    let persistent = wgs == 3 && persistent_ok;
    let tile_q = 64 * wgs;
    let tile_k = if dp <= 128 && dvp <= 128 { 128 } else { 64 };
    let threads = (128 * wgs + 128) as u32;
    // As the template's SMEM_BYTES: the tiles, the buffers' mbarriers, and
    // for the persistent one the output's staging rows and the item ring's
    // mbarriers and indices; room for alignment.
    let ring = if persistent {
        let staged = if dvp.is_power_of_two() {
            tile_q * dvp * 2
        } else {
            0
        };
        staged + 2 * 2 * 8 + 2 * 16
    } else {
        0
    };
    let smem = tile_q * dp * 2 + 2 * (tile_k * dp * 2 + tile_k * dvp * 2) + 4 * 2 * 8 + ring + 1024;
    let inst = Instance {
        header: if persistent {
            "attention/forward_sm90_persistent.cuh"
        } else {
            "attention/forward_sm90.cuh"
        },
        ty: format!(
            "fs_attn::ForwardSm90{}<{}, {causal}, {scale_in_exp}>",
            if persistent { "Persistent" } else { "" },
            args(dt, d, dv)
        ),
        threads,
        bounds: format!("{threads}, 1"),
        tile: tile_q,
        parts: 1,
        smem,
        sm90: true,
        checks: vec![
            ("THREADS", threads as u64),
            ("TILE_Q", tile_q),
            ("TILE_K", tile_k),
            ("SMEM_BYTES", smem),
        ],
    };
    let inst = if dropout { inst.with_dropout() } else { inst };
    (inst, tile_k, persistent)
}

/// One of `backward.cuh`'s row kernels (`Delta`, `DqStore`, `DkvStore`):
/// 128 threads over 128 rows a block, no dynamic shared memory.
fn row_kernel(ty: String) -> Instance {
    Instance {
        header: "attention/backward.cuh",
        ty,
        threads: 128,
        bounds: "128, 2".into(),
        tile: 128,
        parts: 1,
        smem: 0,
        sm90: false,
        checks: vec![("THREADS", 128), ("ROWS", 128), ("SMEM_BYTES", 0)],
    }
}

/// `backward.cuh`'s `Delta`.
pub(crate) fn delta(dt: DType, d: u64, dv: u64, dq_sum: bool) -> Instance {
    row_kernel(format!("fs_attn::Delta<{}, {dq_sum}>", args(dt, d, dv)))
}

/// `backward.cuh`'s `DqStore`.
pub(crate) fn dq_store(dt: DType, d: u64) -> Instance {
    row_kernel(format!("fs_attn::DqStore<{}, {d}>", elem(dt)))
}

/// `backward.cuh`'s `DkvStore`: dK and dV from the parts of a split
/// `DkDvDqSm90`.
pub(crate) fn dkv_store(dt: DType, d: u64, dv: u64, split: u64) -> Instance {
    row_kernel(format!("fs_attn::DkvStore<{}, {split}>", args(dt, d, dv)))
}

/// How many blocks share a key tile of the Hopper dK/dV/dQ kernels at a
/// group ratio: one up to 4 query heads a key/value head; above, the fewest
/// that divide the group into blocks of at most 4 heads (16 on 1: 4 blocks
/// of 4, 6 on 1: 2 of 3, 5 on 1: 5 of 1), for more blocks where grouped
/// queries leave few, and less causal imbalance among them.
pub(crate) fn dkdvdq_split(group: i64) -> u64 {
    let group = group.max(1) as u64;
    (1..=group)
        .find(|s| group.is_multiple_of(*s) && group / s <= 4)
        .unwrap_or(group)
}

/// `backward_sm80.cuh`'s `DkDvSm80`: 64 keys a block, in one or two
/// feature parts.
pub(crate) fn dkdv_sm80(dt: DType, d: u64, dv: u64, causal: bool, atomic: bool) -> Instance {
    let parts = if pad16(d) + pad16(dv) > 256 { 2 } else { 1 };
    let (dp, dvp) = (round_up(d, 16 * parts), round_up(dv, 16 * parts));
    let tile_q = if parts > 1 {
        16
    } else if dp <= 64 && dvp <= 64 {
        64
    } else if atomic {
        32
    } else {
        16
    };
    let (row, row_v, ds_row) = (dp + 8, dvp + 8, tile_q + 8);
    let smem = (64 * (row + row_v) + tile_q * (row + row_v) + if atomic { 64 * ds_row } else { 0 })
        * 2
        + 2 * tile_q * 4;
    Instance {
        header: "attention/backward_sm80.cuh",
        ty: format!("fs_attn::DkDvSm80<{}, {causal}, {atomic}>", args(dt, d, dv)),
        threads: 128,
        bounds: "128, 2".into(),
        tile: 64,
        parts,
        smem,
        sm90: false,
        checks: vec![
            ("THREADS", 128),
            ("TILE_K", 64),
            ("TILE_Q", tile_q),
            ("PARTS", parts),
            ("SMEM_BYTES", smem),
        ],
    }
}

/// `backward_sm80.cuh`'s `DqSm80`: 64 queries a block; with dropout, half
/// the keys a tile (at least 16).
pub(crate) fn dq_sm80(dt: DType, d: u64, dv: u64, causal: bool, dropout: bool) -> Instance {
    let (dp, dvp) = (pad16(d), pad16(dv));
    let in_regs = dp <= 128 && dvp <= 128;
    let tile_k = if dp <= 64 && dvp <= 64 {
        64
    } else if dp <= 192 {
        32
    } else {
        16
    };
    let tile_k = if dropout {
        (tile_k / 2).max(16)
    } else {
        tile_k
    };
    let (row, row_v) = (dp + 8, dvp + 8);
    let (kv, qd) = (tile_k * (row + row_v), 64 * (row + row_v));
    let smem = if in_regs { kv.max(qd) } else { kv + qd } * 2;
    Instance {
        header: "attention/backward_sm80.cuh",
        ty: if dropout {
            format!("fs_attn::DqSm80<{}, {causal}, true>", args(dt, d, dv))
        } else {
            format!("fs_attn::DqSm80<{}, {causal}>", args(dt, d, dv))
        },
        threads: 128,
        bounds: "128, 2".into(),
        tile: 64,
        parts: 1,
        smem,
        sm90: false,
        checks: vec![
            ("THREADS", 128),
            ("TILE_Q", 64),
            ("TILE_K", tile_k),
            ("SMEM_BYTES", smem),
        ],
    }
}

/// Whether `backward_sm90.cuh`'s `DkDvDqSm90` holds head dims `d`, `dv`:
/// dK and dV accumulators for up to 128 padded features each.
pub(crate) fn dkdvdq_sm90_fits(d: u64, dv: u64) -> bool {
    pad16(d) <= 128 && pad16(dv) <= 128
}

/// Whether `DkDvDqSm90` takes dropout at head dims `d`, `dv`: up to 192
/// padded features in all (D = Dv = 96; wider, the draws' registers
/// spilled its consumers' 232 a thread).
pub(crate) fn dkdvdq_sm90_drops(d: u64, dv: u64) -> bool {
    dkdvdq_sm90_fits(d, dv) && pad16(d) + pad16(dv) <= 192
}

/// `DkDvDqSm90`'s query tile rows: 128 where both head dims pad to at most
/// 64 features (without dropout), else 64.
pub(crate) fn dkdvdq_sm90_tile_q(d: u64, dv: u64, dropout: bool) -> u64 {
    if pad16(d) <= 64 && pad16(dv) <= 64 && !dropout {
        128
    } else {
        64
    }
}

/// `backward_sm90.cuh`'s `DkDvDqSm90`: 128 keys a block; its query tiles
/// are [`dkdvdq_sm90_tile_q`] rows; `split` blocks a key tile (each a share
/// of the group's query heads, its dK/dV part summed by [`dkv_store`]).
pub(crate) fn dkdvdq_sm90(
    dt: DType,
    d: u64,
    dv: u64,
    causal: bool,
    split: u64,
    dropout: bool,
) -> Instance {
    let (dp, dvp) = (pad16(d), pad16(dv));
    let tq = dkdvdq_sm90_tile_q(d, dv, dropout);
    let smem_with = |stages: u64| {
        128 * (dp + dvp) * 2
            + stages * (tq * dp * 2 + tq * dvp * 2)
            + 128 * tq * 2
            + 2 * tq * (dp + 8) * 4
            + 2 * stages * tq * 4
            + (2 * stages + 4) * 8
            + 1024
    };
    let stages = if smem_with(3) <= SM90_SMEM_LIMIT {
        3
    } else {
        2
    };
    let smem = smem_with(stages);
    Instance {
        header: "attention/backward_sm90.cuh",
        ty: if dropout {
            format!(
                "fs_attn::DkDvDqSm90<{}, {causal}, {split}, true>",
                args(dt, d, dv)
            )
        } else if split > 1 {
            format!(
                "fs_attn::DkDvDqSm90<{}, {causal}, {split}>",
                args(dt, d, dv)
            )
        } else {
            format!("fs_attn::DkDvDqSm90<{}, {causal}>", args(dt, d, dv))
        },
        threads: 384,
        bounds: "384, 1".into(),
        tile: 128,
        parts: 1,
        smem,
        sm90: true,
        checks: vec![
            ("THREADS", 384),
            ("TILE_K", 128),
            ("TILE_Q", tq),
            ("STAGES", stages),
            ("SMEM_BYTES", smem),
        ],
    }
}

/// `backward_sm90_wide.cuh`'s `DkDvDqSm90Wide` (head dims over 128 padded
/// features): 64 keys a block, 64-query tiles, a staging tile of dQ for
/// each warpgroup; its head dims padded to a
/// multiple of 32 (each warpgroup takes half the features), and the padded
/// widths whose halves its query and dO tiles' swizzle divides.
pub(crate) fn dkdvdq_sm90_wide(
    dt: DType,
    d: u64,
    dv: u64,
    causal: bool,
    split: u64,
) -> (Instance, u64, u64) {
    let (dp, dvp) = (round_up(d, 32), round_up(dv, 32));
    // dQ's chunk (a power of two dividing half of dp, at most 64) and the
    // features of it staged at a time, at most 32.
    let fk = dp / 2;
    let qc = if fk % 64 == 0 {
        64
    } else if fk % 32 == 0 {
        32
    } else {
        16
    };
    let staged = qc.min(32);
    let smem_with = |stages: u64| {
        64 * (dp + dvp) * 2
            + stages * (64 * dp * 2 + 64 * dvp * 2)
            + 2 * 64 * 64 * 2
            + 2 * 64 * staged * 4
            + 2 * stages * 64 * 4
            + 2 * stages * 8
            + 1024
    };
    let stages = if smem_with(3) <= SM90_SMEM_LIMIT {
        3
    } else {
        2
    };
    let smem = smem_with(stages);
    let inst = Instance {
        header: "attention/backward_sm90_wide.cuh",
        ty: if split > 1 {
            format!(
                "fs_attn::DkDvDqSm90Wide<{}, {causal}, {split}>",
                args(dt, d, dv)
            )
        } else {
            format!("fs_attn::DkDvDqSm90Wide<{}, {causal}>", args(dt, d, dv))
        },
        threads: 384,
        bounds: "384, 1".into(),
        tile: 64,
        parts: 1,
        smem,
        sm90: true,
        checks: vec![
            ("THREADS", 384),
            ("TILE_K", 64),
            ("TILE_Q", 64),
            ("STAGES", stages),
            ("SMEM_BYTES", smem),
        ],
    };
    (inst, dp / 2, dvp / 2)
}

#[cfg(test)]
mod split_tests {
    use super::dkdvdq_split;

    #[test]
    fn groups_split_into_blocks_of_at_most_four_heads() {
        let got: Vec<(i64, u64)> = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32]
            .iter()
            .map(|&g| (g, dkdvdq_split(g)))
            .collect();
        assert_eq!(
            got,
            [
                (1, 1),
                (2, 1),
                (3, 1),
                (4, 1),
                (5, 5),
                (6, 2),
                (7, 7),
                (8, 2),
                (9, 3),
                (12, 3),
                (16, 4),
                (24, 6),
                (32, 8)
            ]
        );
    }
}

#[cfg(test)]
mod pad_tests {
    use super::swizzle_pad;

    #[test]
    fn the_hopper_forward_pads_to_64_only_where_16_leaves_the_narrowest_swizzle() {
        let got: Vec<(u64, u64)> = [
            8, 48, 64, 80, 96, 104, 112, 120, 144, 176, 208, 224, 240, 256,
        ]
        .iter()
        .map(|&d| (d, swizzle_pad(d)))
        .collect();
        assert_eq!(
            got,
            [
                (8, 16),
                (48, 48),
                (64, 64),
                (80, 80),
                (96, 96),
                (104, 112),
                (112, 128),
                (120, 128),
                (144, 144),
                (176, 192),
                (208, 208),
                (224, 224),
                (240, 256),
                (256, 256)
            ]
        );
    }
}
