//! A memory budget over data-parallel ranks whose steps differ (ZeRO: each
//! rank's update is its own). Every rank must recompute the same values,
//! or their backward passes finish gradients in different orders and the
//! ranks' buckets part (NCCL would hang): the choice is made on the rank
//! whose step needs the most memory and the same values, found by their
//! place among the kept forward values (the ranks' forward and backward
//! passes are one compile's), dropped on every rank; each must then fit,
//! and where one does not (stage 3's ranks hold pieces of the weights of
//! different sizes) the choice is made again for a tighter budget.

use super::{fit_budget, probe, rewrite, BudgetError, Choice};
use crate::ir::graph::Value;
use crate::ir::Graph;
use crate::plan::roofline::Device;
use crate::plan::PlanError;
use crate::select::Target;
use std::collections::{BTreeMap, HashSet};

/// Fits every graph of `ranks` (each rank's step, at the sizes `dims`) to
/// `budget` bytes with one choice: made on the largest, applied to all.
/// `None` where every rank fits as it is.
pub fn fit_ranks(
    ranks: &mut [Graph],
    dims: &BTreeMap<String, i64>,
    budget: u64,
    target: &Target,
    device: Device,
) -> Result<Option<Choice>, BudgetError> {
    let mut peaks = Vec::with_capacity(ranks.len());
    for g in ranks.iter() {
        peaks.push(probe(g, dims, target, device)?.arena_bytes);
    }
    let Some(worst) = (0..ranks.len()).max_by_key(|&r| peaks[r]) else {
        return Ok(None);
    };
    let kept: Vec<Vec<Value>> = ranks.iter().map(rewrite::saved_values).collect();
    // The largest rank is not always the hardest to fit: under ZeRO stage
    // 3 the ranks' own memory (their pieces of the weights) differs by
    // more than their activations do. Where another rank misses the
    // budget after the choice, the choice is made again for a budget
    // tighter by what it missed by (a few rounds).
    let mut aim = budget;
    let mut last = (0, budget);
    for _ in 0..4 {
        let mut fitted = ranks[worst].clone();
        let Some(mut choice) = fit_budget(&mut fitted, dims, aim, target, device)? else {
            return Ok(None);
        };
        let places: Vec<usize> = choice
            .dropped
            .iter()
            .map(|d| {
                kept[worst]
                    .iter()
                    .position(|&v| v == d.value)
                    .ok_or_else(|| {
                        internal("a recomputed value is not one the step keeps".to_string())
                    })
            })
            .collect::<Result<_, _>>()?;
        let mut out = Vec::with_capacity(ranks.len());
        let mut missed = 0u64;
        for (r, g) in ranks.iter().enumerate() {
            if r == worst {
                out.push(fitted.clone());
                continue;
            }
            let same = kept[r].len() == kept[worst].len()
                && kept[r]
                    .iter()
                    .zip(&kept[worst])
                    .all(|(a, b)| g.g[a.node].op.name() == fitted.g[b.node].op.name());
            if !same {
                return Err(internal(format!(
                    "rank {r}'s forward pass keeps other values than rank {worst}'s"
                )));
            }
            let mut g = g.clone();
            let dropped: HashSet<Value> = places.iter().map(|&i| kept[r][i]).collect();
            g.order_by_memory = fitted.order_by_memory;
            rewrite::drop_saved(&mut g, &dropped);
            let after = probe(&g, dims, target, device)?.arena_bytes;
            if after > budget && after - budget > missed {
                missed = after - budget;
                last = (r, after);
            }
            out.push(g);
        }
        if missed == 0 {
            for (g, fitted) in ranks.iter_mut().zip(out) {
                *g = fitted;
            }
            choice.budget = Some(budget);
            return Ok(Some(choice));
        }
        aim = match aim.checked_sub(missed) {
            Some(a) => a,
            None => break,
        };
    }
    Err(BudgetError::BelowFloor {
        budget,
        floor: last.1,
        peak: peaks[last.0],
    })
}

fn internal(m: String) -> BudgetError {
    BudgetError::Plan(PlanError(format!(
        "internal error fitting the ranks to the memory budget: {m}; this is a bug in fusec, please report it with the model file"
    )))
}
