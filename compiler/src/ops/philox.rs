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
pub fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
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

/// The 32-bit draw of attention probability (query i, key j) of head row
/// `bh` (batch entry b, query head h: b * Hq + h) at dropout site `site`.
/// One Philox block serves the four entries (i, j), (i, j + 8), (i + 8, j)
/// and (i + 8, j + 8) of a 16 x 16 tile (i and j with bit 3 clear), words
/// 0, 1, 2, 3: exactly the four a tensor-core thread holds of such a tile
/// in the m16n8 (and wgmma) accumulator layout, whether the tile is laid
/// out query-major (forward) or key-major (backward), so each kernel draws
/// one block for every four scores and none is drawn twice in a pass. The
/// counter's last word is site + 1, apart from every elementwise dropout's
/// (whose last word is 0).
pub fn attention_draw(key: [u32; 2], site: u32, bh: u64, i: u64, j: u64) -> u32 {
    let cell = |x: u64| ((x >> 4) << 3 | (x & 7)) as u32;
    let word = ((i >> 3) & 1) * 2 + ((j >> 3) & 1);
    philox4x32_10([cell(j), cell(i), bh as u32, site.wrapping_add(1)], key)[word as usize]
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

    /// Every (head row, query, key) entry has a draw of its own: the four
    /// entries of a cell share a block and take its four words, and no two
    /// entries of a 40 x 40 tile (not a multiple of 16) of two heads
    /// repeat one (a collision among 3,200 fair 32-bit draws has a chance
    /// of about 1 in 840,000).
    #[test]
    fn attention_draws_are_distinct_per_entry() {
        let key = [7, 11];
        let block = philox4x32_10([3 << 3 | 5, 1 << 3 | 2, 4, 10], key);
        let (i, j) = (16 + 2, 48 + 5);
        assert_eq!(attention_draw(key, 9, 4, i, j), block[0]);
        assert_eq!(attention_draw(key, 9, 4, i, j + 8), block[1]);
        assert_eq!(attention_draw(key, 9, 4, i + 8, j), block[2]);
        assert_eq!(attention_draw(key, 9, 4, i + 8, j + 8), block[3]);
        let mut seen = std::collections::HashSet::new();
        for bh in 0..2 {
            for i in 0..40 {
                for j in 0..40 {
                    assert!(
                        seen.insert(attention_draw(key, 0, bh, i, j)),
                        "({bh}, {i}, {j})"
                    );
                }
            }
        }
        // Sites draw apart, and from the elementwise dropout at the same site.
        assert_ne!(
            attention_draw(key, 0, 0, 0, 0),
            attention_draw(key, 1, 0, 0, 0)
        );
        assert_ne!(attention_draw(key, 0, 0, 0, 0), draw(key, 0, 0));
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
