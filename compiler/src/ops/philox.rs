//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
//! 3", SC 2011), the counter-based generator cuRAND and PyTorch draw
//! dropout masks from. A draw is a pure function of a key and a counter, so
//! the backward pass, a recomputed forward op and the CPU reference all
//! regenerate the same mask from its element's index instead of storing it.
//! `kernels/random/philox.cuh` is the same function in CUDA C; the two agree
//! bit for bit (tests here hold the published answers, and the host-run
//! kernel tests compare the CUDA side with this one).

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Four 32-bit words from counter `ctr` under `key`.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    philox4x32(ctr, key, 10)
}

/// Philox4x32 with `rounds` rounds (10 is Random123's and cuRAND's
/// default; the attention draws take 7, as FlashAttention's do).
pub fn philox4x32(mut ctr: [u32; 4], mut key: [u32; 2], rounds: u32) -> [u32; 4] {
    for round in 0..rounds {
        if round > 0 {
            key[0] = key[0].wrapping_add(W0);
            key[1] = key[1].wrapping_add(W1);
        }
        let p0 = u64::from(M0) * u64::from(ctr[0]);
        let p1 = u64::from(M1) * u64::from(ctr[2]);
        ctr = [
            (p1 >> 32) as u32 ^ ctr[1] ^ key[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ ctr[3] ^ key[1],
            p0 as u32,
        ];
    }
    ctr
}

/// The 32-bit draw of element `index` of dropout site `site`: word
/// `index % 4` of the block at counter (index / 4, site), so one Philox
/// call serves four neighbouring elements.
pub fn draw(key: [u32; 2], site: u32, index: u64) -> u32 {
    let block = index / 4;
    philox4x32_10([block as u32, (block >> 32) as u32, site, 0], key)[(index % 4) as usize]
}

/// Rounds of the attention draws' Philox: 10, as every other draw's
/// (FlashAttention takes 7, which measured 0.5 ms less of BERT-large's
/// 83 ms step with 16-bit draws; with 7, the tiny translator's masks made
/// the fused program's bf16 gradients part from the graph's by 6.8% of the
/// largest in tests/fusion.rs, against 2% with every other mask drawn).
pub const ATTENTION_ROUNDS: u32 = 10;

/// The 8-bit draw (0 .. 255) of attention probability (query i, key j) of
/// head row `bh` (batch entry b, query head h: b * Hq + h) at dropout site
/// `site`. One Philox block serves 16 entries: queries i, i + 1, i + 8,
/// i + 9 by keys j, j + 1, j + 8, j + 9 (i and j with bits 0 and 3 clear),
/// word (i bit 0) + 2 (i bit 3), byte (j bit 0) + 2 (j bit 3). A
/// tensor-core thread holds half of such a block in the m16n8 (and wgmma)
/// accumulator layout, query-major or key-major, and the lane 4 apart the
/// other half; so each lane of the pair draws one of two neighbouring
/// blocks and they trade halves (`kernels/attention/common.cuh`'s
/// `for_each_draw`): one block for every 16 entries. The counter's last
/// word is site + 1, apart from every elementwise dropout's (0).
pub fn attention_draw(key: [u32; 2], site: u32, bh: u64, i: u64, j: u64) -> u32 {
    let row = ((i >> 4) << 2 | ((i & 7) >> 1)) as u32;
    let col = ((j >> 4) << 2 | ((j & 7) >> 1)) as u32;
    let word = (i & 1) + 2 * ((i >> 3) & 1);
    let byte = (j & 1) + 2 * ((j >> 3) & 1);
    let w = philox4x32(
        [col, row, bh as u32, site.wrapping_add(1)],
        key,
        ATTENTION_ROUNDS,
    )[word as usize];
    (w >> (8 * byte)) & 0xff
}

/// Attention draws below this are dropped: `p` of the 256 8-bit draws,
/// rounded (so the share dropped is t / 256, within 1/512 of p, as
/// FlashAttention's 8-bit draws round it).
pub fn attention_threshold(p: f64) -> u32 {
    (p.clamp(0.0, 1.0) * 256.0).round() as u32
}

/// What a kept attention probability is multiplied by: 1 over the share
/// kept, 256 / (256 - t), so the expectation is the undropped value
/// exactly (1 / (1 - p) would be off by up to 1/512 relative).
pub fn attention_scale(p: f64) -> f64 {
    let t = attention_threshold(p);
    if t >= 256 {
        0.0
    } else {
        256.0 / f64::from(256 - t)
    }
}

/// Draws below this are dropped: `p` of the 2^32 possible draws, so that
/// the comparison is exact integer arithmetic on every side.
pub fn threshold(p: f64) -> u32 {
    (p.clamp(0.0, 1.0) * 4_294_967_296.0)
        .round()
        .min(u32::MAX as f64) as u32
}

/// Whether dropout with drop threshold `threshold` keeps element `index`.
pub fn keeps(key: [u32; 2], site: u32, index: u64, threshold: u32) -> bool {
    draw(key, site, index) >= threshold
}

/// The key of one step's masks: the run's seed mixed with the step, the
/// micro-batch and the data-parallel rank (splitmix64's finaliser), so that
/// every micro-batch and every rank draws its own masks and a run with the
/// same seed draws the same ones.
pub fn step_key(seed: u64, step: u64, micro: u64, rank: u64) -> [u32; 2] {
    let mut z = seed;
    for part in [step, micro, rank] {
        z = mix(z ^ mix(part.wrapping_add(0x9E37_79B9_7F4A_7C15)));
    }
    [z as u32, (z >> 32) as u32]
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known answers Random123 publishes for Philox4x32-10
    /// (kat_vectors): a single wrong rotation, constant or word order
    /// changes every one of them.
    #[test]
    fn known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn thresholds_are_exact_at_the_ends() {
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(0.5), 1 << 31);
        assert_eq!(threshold(1.0), u32::MAX);
        // p = 0 keeps every element, whatever it draws.
        assert!((0..1000).all(|i| keeps([1, 2], 3, i, threshold(0.0))));
    }

    /// The share of dropped elements is p within five standard deviations
    /// of a binomial count (sigma = sqrt(p (1 - p) / n): 6.7e-4 at p = 0.1
    /// over 200,000 draws), which a fair generator misses about once in
    /// 1.7 million runs; a threshold off by one percentage point misses it.
    #[test]
    fn drop_rate_is_p() {
        for &(p, site) in &[(0.1, 0u32), (0.5, 7), (0.9, 1 << 20)] {
            let n = 200_000u64;
            let t = threshold(p);
            let dropped = (0..n).filter(|&i| !keeps([42, 7], site, i, t)).count();
            let rate = dropped as f64 / n as f64;
            let sigma = (p * (1.0 - p) / n as f64).sqrt();
            assert!(
                (rate - p).abs() < 5.0 * sigma,
                "p {p}: dropped {rate} (5 sigma = {})",
                5.0 * sigma
            );
        }
    }

    /// One block holds the 16 draws of its cell as documented, and the
    /// (head row, query, key) entries of a 40 x 40 tile (not a multiple of
    /// 16) of two heads draw about as many repeats as fair 8-bit draws
    /// would: 3,200 draws among 256 values give 3200 * 3199 / 512 = 19,994
    /// equal pairs in expectation (sd about 100 for a fair generator; 5 sd
    /// either way, where draws that repeat a block's or a constant byte
    /// give far more).
    #[test]
    fn attention_draws_fill_their_cells() {
        let key = [7, 11];
        // Query 16 + 2 (row block 4 + 1), key 48 + 4 (column block 12 + 2).
        let w = philox4x32([12 + 2, 4 + 1, 4, 10], key, ATTENTION_ROUNDS);
        let (i, j) = (16 + 2, 48 + 4);
        for (word, di) in [0, 1, 8, 9].into_iter().enumerate() {
            for (byte, dj) in [0, 1, 8, 9].into_iter().enumerate() {
                assert_eq!(
                    attention_draw(key, 9, 4, i + di, j + dj),
                    (w[word] >> (8 * byte)) & 0xff,
                    "word {word} byte {byte}"
                );
            }
        }
        let mut counts = [0u64; 256];
        for bh in 0..2 {
            for i in 0..40 {
                for j in 0..40 {
                    counts[attention_draw(key, 0, bh, i, j) as usize] += 1;
                }
            }
        }
        let pairs: u64 = counts.iter().map(|c| c * c.saturating_sub(1) / 2).sum();
        assert!(
            (19_994 - 500..19_994 + 500).contains(&pairs),
            "{pairs} equal pairs among 3,200 8-bit draws"
        );
        // Sites draw apart.
        assert_ne!(
            (0..16)
                .map(|j| attention_draw(key, 0, 0, 0, j))
                .collect::<Vec<_>>(),
            (0..16)
                .map(|j| attention_draw(key, 1, 0, 0, j))
                .collect::<Vec<_>>()
        );
    }

    /// Rounds compose (seven, then three more, are ten: the counter and key
    /// schedule are the same), so Random123's ten-round answers pin down
    /// any count; and the attention threshold and scale keep the
    /// expectation: share kept times scale is 1.
    #[test]
    fn attention_rounds_and_scale() {
        let (c, k) = (
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0],
        );
        let mut seven = philox4x32(c, k, 7);
        let mut key = k;
        for _ in 0..7 {
            key[0] = key[0].wrapping_add(W0);
            key[1] = key[1].wrapping_add(W1);
        }
        for _ in 0..3 {
            seven = philox4x32(seven, key, 1);
            key[0] = key[0].wrapping_add(W0);
            key[1] = key[1].wrapping_add(W1);
        }
        assert_eq!(seven, philox4x32_10(c, k));
        for p in [0.0, 0.1, 0.25, 0.37, 0.9] {
            let t = attention_threshold(p);
            assert!((f64::from(t) / 256.0 - p).abs() <= 1.0 / 512.0);
            let kept = f64::from(256 - t) / 256.0;
            assert!((kept * attention_scale(p) - 1.0).abs() < 1e-15, "p {p}");
        }
        assert_eq!(attention_threshold(0.1), 26);
    }

    #[test]
    fn keys_differ_by_step_micro_batch_and_rank() {
        let base = step_key(1234, 5, 0, 0);
        assert_eq!(base, step_key(1234, 5, 0, 0));
        for other in [
            step_key(1235, 5, 0, 0),
            step_key(1234, 6, 0, 0),
            step_key(1234, 5, 1, 0),
            step_key(1234, 5, 0, 1),
        ] {
            assert_ne!(base, other);
        }
        // Sites and elements draw independently under one key.
        assert_ne!(draw(base, 0, 0), draw(base, 1, 0));
        assert_ne!(draw(base, 0, 0), draw(base, 0, 1));
    }
}
