//! Deliberate breakages of the attention backward's templates
//! (kernels/attention/backward*.cuh) and of the emulator must fail the host
//! runs' comparison with the interpreter (else those runs prove little):
//! causal bounds, dropped delta terms, fragment halves swapped, a dropped
//! scale, wrong descriptor strides and swizzles, the grouped-query split.
//! Skipped, with a message, where no `c++` compiler exists.

mod common;

use common::flash::{build_harness, head_dims_model, reference, Built, Mutation};
use common::flash_bwd::{backward, run_and_compare, SNAPSHOT_MODEL};
use common::host;
use fusec_compiler::emit::flash::FlashArch;

/// The snapshot model with a non-causal twin of its attention.
fn twin_model() -> String {
    SNAPSHOT_MODEL
        .replace(
            "train {",
            "let y2 = merge_heads(attention(heads(q, 4), heads(k, 1), heads(v, 1)))\ntrain {",
        )
        .replace("loss = mean(y * y)", "loss = mean(y * y) + mean(y2 * y2)")
}

/// The set of `b` that is causal or not, in the deterministic scheme or not.
fn find(b: &Built, causal: bool, deterministic: bool) -> usize {
    b.sets
        .iter()
        .position(|f| {
            f.what.contains(&format!("causal={causal}")) && f.deterministic == deterministic
        })
        .unwrap()
}

const SM80: &str = "attention/backward_sm80.cuh";
const BWD: &str = "attention/backward.cuh";
const COMMON: &str = "attention/common.cuh";

/// Plain logic bugs of either scheme's kernels, and wrong fragment halves,
/// must make the comparison fail (else the host runs prove little). Each
/// mutation names the set it breaks: causal or not, deterministic or
/// atomic.
#[test]
fn deliberate_breakages_are_caught() {
    if !host::have_cxx() {
        return;
    }
    let b = backward(&twin_model(), "bf16", FlashArch::Sm80);
    let (causal, plain) = (find(&b, true, true), find(&b, false, true));
    let (causal_atomic, plain_atomic) = (find(&b, true, false), find(&b, false, false));
    let mutations: [(Mutation, usize); 15] = [
        // dK/dV: the causal bound off by one.
        ((COMMON, "kr > qc + diag) ? 0.0f : p;", "kr > qc + diag + 1) ? 0.0f : p;"), causal),
        // dK/dV: query tiles start one tile too late.
        ((SM80, "(k0 / TILE_Q) * TILE_Q", "(k0 / TILE_Q + 1) * TILE_Q"), causal),
        // dQ: the causal bound off by one.
        (
            (
                SM80,
                "if (j >= kv_len || (CAUSAL && j > i)) p = 0.0f;",
                "if (j >= kv_len || (CAUSAL && j >= i)) p = 0.0f;",
            ),
            causal,
        ),
        // dK: the delta term dropped.
        (
            (
                SM80,
                "dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);",
                "dp[n][e] = s[n][e] * dp[n][e];",
            ),
            plain,
        ),
        // dQ: the delta term dropped.
        ((SM80, "dp[n][e] = p * (dp[n][e] - dlt[r]);", "dp[n][e] = p * dp[n][e];"), plain),
        // dQ: K^T's B fragment halves swapped.
        ((SM80, "E::mma(acc[n], fa, bk[0], bk[1]);", "E::mma(acc[n], fa, bk[1], bk[0]);"), plain),
        // dV: dO's B fragments (rows 0-7 and 8-15 of the query tile) swapped.
        ((SM80, "E::mma(dv_acc[n], p_frag, bo[0], bo[1]);", "E::mma(dv_acc[n], p_frag, bo[1], bo[0]);"), plain),
        // ldmatrix.trans: lanes 8-15 and 16-23 give each other's rows.
        (
            (
                COMMON,
                "fs_ldsm_x4_t(b, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8);",
                "fs_ldsm_x4_t(b, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8);",
            ),
            plain,
        ),
        // dK: the scale dropped.
        ((COMMON, "dk_acc[n][2 * r] * a.scale", "dk_acc[n][2 * r]"), plain),
        // Atomic scheme: dS^T's quarters stored in each other's place.
        (
            (
                SM80,
                "(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[1]",
                "(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[2]",
            ),
            plain_atomic,
        ),
        // Atomic scheme: dS read back with a wrong lane-to-row mapping.
        (
            (
                COMMON,
                "fs_ldsm_x4_t(a, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8)",
                "fs_ldsm_x4_t(a, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8)",
            ),
            plain_atomic,
        ),
        // Atomic scheme: the dQ sum not cleared (the scratch starts as NaN).
        ((BWD, "if (i < q_len) fs_zero16(", "if (i < 0) fs_zero16("), plain_atomic),
        // Atomic scheme: dQ added into the next row.
        (
            (
                SM80,
                "const fs_i64 i = i0 + m0 + frag_row + 8 * r;",
                "const fs_i64 i = i0 + m0 + frag_row + 8 * r + 1;",
            ),
            causal_atomic,
        ),
        // Atomic scheme: dQ's scale dropped when stored.
        ((BWD, "from_float(sum[e] * scale)", "from_float(sum[e])"), plain_atomic),
        // Atomic scheme: query tiles start one tile too late (dQ and dK lose them).
        ((SM80, "(k0 / TILE_Q) * TILE_Q", "(k0 / TILE_Q + 1) * TILE_Q"), causal_atomic),
    ];
    expect_caught(
        &b,
        "mutations",
        &[causal, plain, causal_atomic, plain_atomic],
        &mutations,
    );
}

/// Dropout in the backward: each of dV's P Z, dS's Z dP, the mask's scale
/// and the key-major cell words must matter.
#[test]
fn a_broken_dropout_backward_is_caught() {
    if !host::have_cxx() {
        return;
    }
    let src = twin_model()
        .replace("causal = true))", "causal = true, dropout = 0.3))")
        .replace("heads(v, 1)))\n", "heads(v, 1), dropout = 0.3))\n");
    assert_eq!(src.matches("dropout = 0.3").count(), 2);
    let b = backward(&src, "bf16", FlashArch::Sm80);
    let (causal, plain) = (find(&b, true, true), find(&b, false, true));
    let plain_atomic = find(&b, false, false);
    let mutations: [(Mutation, usize); 6] = [
        // dV from the undropped P.
        ((SM80, "s[n][e] *= z;", ";"), plain),
        // The mask applied to delta as well: dS = P Z (dP - delta).
        (
            (
                SM80,
                "dp[n][e] = s[n][e] * (dp[n][e] * z - delta_tile[n * 8 + frag_col + (e & 1)]);",
                "dp[n][e] = s[n][e] * z * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);",
            ),
            plain_atomic,
        ),
        // dQ: kept entries not scaled by 1 / (1 - p).
        (
            (
                SM80,
                "dp[n][e] *= kept ? a.drop.scale : 0.0f;",
                "dp[n][e] *= kept ? 1.0f : 0.0f;",
            ),
            causal,
        ),
        // Lanes keep the other row parity's half of their block and send their own.
        (
            (
                COMMON,
                "half(w, par, own);\n        half(w, 1 - par, give);",
                "half(w, 1 - par, own);\n        half(w, par, give);",
            ),
            plain,
        ),
        // Key-major lanes draw the transposed cell (query and key exchanged).
        (
            (
                COMMON,
                "? fs_attention_block(d.key, d.site, bh, col, row_even)",
                "? fs_attention_block(d.key, d.site, bh, row_even, col)",
            ),
            causal,
        ),
        // Lanes trade halves with the wrong neighbour.
        (
            (
                COMMON,
                "got[0] = fs_shfl_xor_u32(give[0], 4);",
                "got[0] = fs_shfl_xor_u32(give[0], 8);",
            ),
            plain_atomic,
        ),
    ];
    expect_caught(
        &b,
        "dropout-mutations",
        &[causal, plain, plain_atomic],
        &mutations,
    );
}

/// Dropout in Hopper's backward: the mask's head row following the query
/// tiles from head to head of the group, and dV's P Z.
#[test]
fn a_broken_hopper_dropout_backward_is_caught() {
    if !host::have_cxx() {
        return;
    }
    const SM90: &str = "attention/backward_sm90.cuh";
    let src = twin_model()
        .replace("causal = true))", "causal = true, dropout = 0.3))")
        .replace("heads(v, 1)))\n", "heads(v, 1), dropout = 0.3))\n");
    let b = backward(&src, "bf16", FlashArch::Sm90a);
    let (causal, plain) = (find(&b, true, false), find(&b, false, false));
    let mutations: [(Mutation, usize); 2] = [
        // Every query tile draws its group's first head's mask.
        (
            (
                SM90,
                "if (i0 >= q_len) i0 = i_first, ++h;",
                "if (i0 >= q_len) i0 = i_first;",
            ),
            plain,
        ),
        // dV from the undropped P.
        ((SM90, "s[n][e] *= z;", ";"), causal),
    ];
    expect_caught(&b, "hopper-dropout-mutations", &[causal, plain], &mutations);
}

/// The unbroken sets `all` of `b` pass at B = 1, T = 100; then each
/// mutation, applied to the set it names, must fail.
fn expect_caught(b: &Built, label: &str, all: &[usize], mutations: &[(Mutation, usize)]) {
    let dims = common::dims(&[("B", 1), ("T", 100)]);
    let bufs = reference(b, &dims);
    let work = host::work_dir(&format!("flash-bwd-{label}"));
    // The unbroken build passes, so each failure below is the mutation's.
    let exe = build_harness(b, all, &work, "good", None);
    for &f in all {
        run_and_compare(&exe, &work.join(format!("good-{f}")), b, f, &bufs, &dims)
            .expect("the unbroken kernels");
    }
    for (i, &(m, f)) in mutations.iter().enumerate() {
        let stem = format!("broken{i}");
        let exe = build_harness(b, &[f], &work, &stem, Some(m));
        let got = run_and_compare(&exe, &work.join(format!("{stem}-run")), b, f, &bufs, &dims);
        let e = got.expect_err(&format!("mutation {i} ({}: `{}`) went unnoticed", m.0, m.1));
        println!("mutation {i} caught: {e}");
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// Hopper's dK/dV/dQ kernel: its descriptors' strides, dS^T's layout, the
/// warpgroups' halves of dQ and the mask must each matter.
#[test]
fn a_broken_hopper_backward_is_caught() {
    if !host::have_cxx() {
        return;
    }
    const SM90: &str = "attention/backward_sm90.cuh";
    const TILES: &str = "attention/sm90.cuh";
    let b = backward(&twin_model(), "bf16", FlashArch::Sm90a);
    let (causal, plain) = (find(&b, true, false), find(&b, false, false));
    let mutations: [(Mutation, usize); 8] = [
        // dQ's A (dS, MN-major core matrices) read with its strides exchanged.
        (
            (
                TILES,
                "mnmajor(const void* tile) { return fs_make_desc(tile, ROW8, CORE, 0); }",
                "mnmajor(const void* tile) { return fs_make_desc(tile, CORE, ROW8, 0); }",
            ),
            plain,
        ),
        // dV's B (the swizzled dO tile, MN-major) stepping 8 queries, not 16.
        ((TILES, "return kk * 16 * SW; }", "return kk * 8 * SW; }"), plain),
        // S^T's B (the swizzled Q tile, K-major) stepping 8 features, not 16.
        ((TILES, "(kk * 16) % ATOM * 2; }", "(kk * 16) % ATOM * 1; }"), causal),
        // The dO tiles copied from the next query on.
        ((SM90, "x * DOT::ATOM, h, i0, (int)b", "x * DOT::ATOM, h, i0 + 1, (int)b"), plain),
        // dS^T stored with its key halves swapped.
        (
            (
                SM90,
                "fs_st32(&ds_tile[DST::at(key_row, 16 * kk + frag_col)], ds_frag[kk][0]);\n                fs_st32(&ds_tile[DST::at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][1]);",
                "fs_st32(&ds_tile[DST::at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][0]);\n                fs_st32(&ds_tile[DST::at(key_row, 16 * kk + frag_col)], ds_frag[kk][1]);",
            ),
            plain,
        ),
        // 128-query tiles at D = 64: both warpgroups take dQ's first 64
        // queries.
        (
            (
                SM90,
                "DST::mnmajor_n(wg * (TILE_Q - 64))",
                "DST::mnmajor_n(0 * (TILE_Q - 64))",
            ),
            plain,
        ),
        // The causal mask off by one.
        ((COMMON, "kr > qc + diag) ? 0.0f : p;", "kr > qc + diag + 1) ? 0.0f : p;"), causal),
        // The writers adding all rows of a tile but the last.
        (
            (
                SM90,
                "for (int r = w; r < rows; r += WRITERS)",
                "for (int r = w; r < rows - 1; r += WRITERS)",
            ),
            plain,
        ),
    ];
    expect_caught(&b, "hopper-mutations", &[causal, plain], &mutations);
    // D = 80 (the 32-byte swizzle, rows of 320 bytes).
    let d80 = backward(
        &head_dims_model(&[(80, 80, 2, 1, true, true), (80, 80, 2, 1, false, true)]),
        "bf16",
        FlashArch::Sm90a,
    );
    let (causal, plain) = (find(&d80, true, false), find(&d80, false, false));
    let d80_mutations: [(Mutation, usize); 4] = [
        // Diagonal tiles taken for unmasked ones (here, where the query
        // tiles are 64 rows: at T = 100 the first is whole and crosses the
        // diagonal; at D = 64 the 128-row tiles are all partial and masked).
        (
            (
                COMMON,
                "if (rows < TILE_Q || key_rows < TILE_K || (CAUSAL && i0 < k0 + TILE_K)) {",
                "if (rows < TILE_Q || key_rows < TILE_K) {",
            ),
            causal,
        ),
        // 64-query tiles: both warpgroups take the first half of dQ's
        // features.
        (
            (
                SM90,
                "KT::mnmajor_n(wg * (DP - DQ_N))",
                "KT::mnmajor_n(0 * (DP - DQ_N))",
            ),
            plain,
        ),
        // The writers' bulk reductions leave out each row's last 16 bytes.
        (
            (
                SM90,
                "fs_bulk_add_f32(&sum[r * D], &dqt[r * DQ_ROW], D * 4);",
                "fs_bulk_add_f32(&sum[r * D], &dqt[r * DQ_ROW], (D - 4) * 4);",
            ),
            causal,
        ),
        // dQ's second part (N = 40 as 32 + 8) read from the first core matrix.
        (
            (TILES, "return n0 / 8 * CORE; }", "return 0 * CORE; }"),
            plain,
        ),
    ];
    expect_caught(
        &d80,
        "hopper-mutations-d80",
        &[causal, plain],
        &d80_mutations,
    );
    // 8 query heads a key/value head: two blocks a key tile, each taking
    // 4 of the group's heads and leaving its dK/dV part for DkvStore.
    let gqa = backward(
        &head_dims_model(&[(64, 64, 16, 2, true, false)]),
        "bf16",
        FlashArch::Sm90a,
    );
    let split = find(&gqa, true, false);
    let split_mutations: [(Mutation, usize); 2] = [
        // Both blocks take the group's first heads.
        (
            (
                "attention/backward_sm90.cuh",
                "int h = (int)(kv_h * a.group + part * heads)",
                "int h = (int)(kv_h * a.group + 0 * heads)",
            ),
            split,
        ),
        // The store sums only the first part.
        (
            (
                "attention/backward.cuh",
                "for (int s = 1; s < SPLIT; ++s) {",
                "for (int s = 1; s < 1; ++s) {",
            ),
            split,
        ),
    ];
    expect_caught(&gqa, "hopper-mutations-split", &[split], &split_mutations);
    // D = 160, the wide kernel: 64 keys a block, the warpgroups splitting the
    // queries of S^T and dP^T and the features of dK, dV and dQ.
    const WIDE: &str = "attention/backward_sm90_wide.cuh";
    let d160 = backward(
        &head_dims_model(&[
            (160, 160, 2, 1, true, false),
            (160, 160, 2, 1, false, false),
        ]),
        "bf16",
        FlashArch::Sm90a,
    );
    let (causal, plain) = (find(&d160, true, false), find(&d160, false, false));
    let wide_mutations: [(Mutation, usize); 4] = [
        // Both warpgroups take the first half of dV's features.
        ((WIDE, "DOT::mnmajor_n(fv0))", "DOT::mnmajor_n(0))"), plain),
        // The second warpgroup's S^T from the first half of the queries.
        (
            (
                WIDE,
                "QT::kmajor_n(wg * HALF_Q))",
                "QT::kmajor_n(0 * HALF_Q))",
            ),
            causal,
        ),
        // P^T stored without the warpgroup's query offset.
        (
            (
                WIDE,
                "const int qc = wg * HALF_Q + 16 * kk + frag_col;",
                "const int qc = 16 * kk + frag_col;",
            ),
            plain,
        ),
        // dQ's staged rows read back without the swizzle they were stored with.
        (
            (
                WIDE,
                "&stage[row * SW + (c ^ (row % CPR)) * 4]",
                "&stage[row * SW + c * 4]",
            ),
            causal,
        ),
    ];
    expect_caught(
        &d160,
        "hopper-mutations-d160",
        &[causal, plain],
        &wide_mutations,
    );
    // The wide kernel split: 6 query heads a key/value head in two blocks
    // of 3 a key tile, their dK/dV parts summed by DkvStore.
    let wide_gqa = backward(
        &head_dims_model(&[(160, 160, 12, 2, true, false)]),
        "bf16",
        FlashArch::Sm90a,
    );
    let split = find(&wide_gqa, true, false);
    let wide_split_mutations: [(Mutation, usize); 1] = [
        // The loader of both blocks copies the group's first heads.
        (
            (
                WIDE,
                "int h = (int)(kv_h * a.group + part * heads)",
                "int h = (int)(kv_h * a.group + 0 * heads)",
            ),
            split,
        ),
    ];
    expect_caught(
        &wide_gqa,
        "hopper-mutations-wide-split",
        &[split],
        &wide_split_mutations,
    );
}
