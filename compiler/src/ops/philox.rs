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

/// The 16-bit draw (0 .. 65535) of attention probability (query i, key j)
/// of head row `bh` (batch entry b, query head h: b * Hq + h) at dropout
/// site `site`. A score matrix takes 16 bits an entry, so one Philox
/// block serves 8 entries: queries i, i + 8 by keys j, j + 1, j + 8, j + 9
/// of a 16 x 16 tile (i with bit 3 clear, j with bits 0 and 3 clear), half
/// (i bit 3) * 4 + (j bit 3) * 2 + (j bit 0), half 2k + 1 the high 16 bits
/// of word k. Those are exactly the 8 a tensor-core thread holds of a
/// query-major tile in the m16n8 (and wgmma) accumulator layout, so the
/// forward draws one block for every 8 scores; a key-major tile's thread
/// holds two such blocks' halves and trades them with its neighbour
/// (`kernels/attention/common.cuh`'s `for_each_draw`). The counter's last
/// word is site + 1, apart from every elementwise dropout's (0).
pub fn attention_draw(key: [u32; 2], site: u32, bh: u64, i: u64, j: u64) -> u32 {
    let row = ((i >> 4) << 3 | (i & 7)) as u32;
    let col = ((j >> 4) << 2 | ((j & 7) >> 1)) as u32;
    let half = ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1);
    let word = philox4x32_10([col, row, bh as u32, site.wrapping_add(1)], key)[(half / 2) as usize];
    (word >> (16 * (half % 2))) & 0xffff
}

/// Attention draws below this are dropped: `p` of the 65,536 16-bit draws
/// (so the share kept is 1 - p within 2^-17; kept entries are scaled by
/// 1 / (1 - p) exactly).
pub fn attention_threshold(p: f64) -> u32 {
    (p.clamp(0.0, 1.0) * 65_536.0).round() as u32
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

    /// One block holds the 8 draws of its cell as documented, and the
    /// (head row, query, key) entries of a 40 x 40 tile (not a multiple of
    /// 16) of two heads draw no more repeats than fair 16-bit draws would:
    /// 3,200 draws among 65,536 values give about 78 equal pairs (sd ~9).
    #[test]
    fn attention_draws_fill_their_cells() {
        let key = [7, 11];
        let w = philox4x32_10([3 << 2 | 2, 1 << 3 | 2, 4, 10], key);
        let (i, j) = (16 + 2, 48 + 4);
        let at = |di: u64, dj: u64| attention_draw(key, 9, 4, i + di, j + dj);
        for (k, (di, dj)) in [
            (0, 0),
            (0, 1),
            (0, 8),
            (0, 9),
            (8, 0),
            (8, 1),
            (8, 8),
            (8, 9),
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(
                at(di, dj),
                (w[k / 2] >> (16 * (k % 2))) & 0xffff,
                "half {k}"
            );
        }
        let mut draws = Vec::new();
        for bh in 0..2 {
            for i in 0..40 {
                for j in 0..40 {
                    draws.push(attention_draw(key, 0, bh, i, j));
                }
            }
        }
        let mut counts = std::collections::HashMap::new();
        for d in &draws {
            *counts.entry(*d).or_insert(0u64) += 1;
        }
        let pairs: u64 = counts.values().map(|c| c * (c - 1) / 2).sum();
        assert!(pairs < 78 + 5 * 9, "{pairs} equal pairs: draws repeat");
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
