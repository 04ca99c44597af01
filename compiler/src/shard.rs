//! How ZeRO splits the parameters over data-parallel ranks: one run of
//! elements (every parameter in order, flattened) cut into equal aligned
//! shares, so that each rank owns a contiguous piece of a few parameters.
//! The compiler builds each rank's update from these pieces and the
//! runtime gathers and scatters by them, so both read this one rule.

/// Pieces start at multiples of this many elements.
pub const ALIGN: u64 = 64;

/// One rank's part of a parameter: elements [lo, hi) of its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Piece {
    pub rank: u32,
    pub lo: u64,
    pub hi: u64,
}

/// Each parameter's pieces (parameters of `numels` elements, in order),
/// in rank order (consecutive ranks).
pub fn pieces(numels: &[u64], ranks: u32) -> Vec<Vec<Piece>> {
    let ranks = ranks.max(1) as u64;
    let total: u64 = numels.iter().sum();
    let per = total.div_ceil(ranks).div_ceil(ALIGN) * ALIGN;
    let mut start = 0u64;
    numels
        .iter()
        .map(|&n| {
            let (a, b) = (start, start + n);
            start = b;
            (0..ranks)
                .filter_map(|r| {
                    let (lo, hi) = ((r * per).max(a), ((r + 1) * per).min(b));
                    // Lazily: a rank past the parameter has hi < a.
                    (lo < hi).then(|| Piece {
                        rank: r as u32,
                        lo: lo - a,
                        hi: hi - a,
                    })
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element has exactly one owner, pieces are aligned where they
    /// start inside the run, and no rank owns more than its share.
    #[test]
    fn pieces_cover_each_parameter_once() {
        let numels = [1000, 3, 4096, 77, 640];
        for ranks in 1..=5u32 {
            let all = pieces(&numels, ranks);
            let mut start = 0;
            let mut owned = vec![0u64; ranks as usize];
            for (n, ps) in numels.iter().zip(&all) {
                let mut next = 0;
                for p in ps {
                    assert_eq!(p.lo, next, "{ranks} ranks: a gap or overlap");
                    assert!(p.hi > p.lo);
                    assert!(p.lo == 0 || (start + p.lo) % ALIGN == 0);
                    owned[p.rank as usize] += p.hi - p.lo;
                    next = p.hi;
                }
                assert_eq!(next, *n, "{ranks} ranks: the parameter is not covered");
                start += n;
            }
            let per = start.div_ceil(ranks as u64).div_ceil(ALIGN) * ALIGN;
            assert!(owned.iter().all(|&o| o <= per), "{owned:?} over {per}");
        }
    }
}

/// What ZeRO splits over the ranks (`--zero`), beyond what every stage
/// splits: the optimizer state and, with a 16-bit compute dtype, the f32
/// master weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ZeroStage {
    /// Stage 1: every rank keeps each gradient whole until the update (the
    /// reduce to the owners lands in place).
    #[default]
    One,
    /// Stage 2: the gradients too. Each is reduced into its owners' pieces
    /// as its bucket closes (a buffer the size of the piece on the owner),
    /// so the whole gradient is a temporary of the backward pass; with
    /// micro-batches each one's gradient is reduced and added to the
    /// owners' pieces.
    Two,
    /// Stage 3: the parameters too. Each rank keeps its piece of every
    /// parameter alone (in the model's dtype: the piece is its own master)
    /// and the pieces are gathered whole, in the compute dtype, just before
    /// the forward pass reads the parameter and again before the backward
    /// pass does (`autodiff::gather`); the gradients are stage 2's, and the
    /// update writes the piece in place, so nothing is sent after it.
    Three,
}

impl ZeroStage {
    /// The stage's number, as `--zero` takes it.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }

    /// Whether the gradients are kept in pieces, each reduced into its
    /// owners' pieces as the backward pass finishes it: stages 2 and 3.
    pub fn shards_gradients(self) -> bool {
        self != ZeroStage::One
    }
}
