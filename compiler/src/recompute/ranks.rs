//! A memory budget over data-parallel ranks whose steps differ (ZeRO: each
//! rank's update is its own). Every rank must recompute the same values,
//! or their backward passes finish gradients in different orders and the
//! ranks' buckets part (NCCL would hang): the choice is made on the rank
//! whose step needs the most memory and the same values, found by their
//! place among the kept forward values (the ranks' forward and backward
//! passes are one compile's), dropped on every rank; each must then fit.

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
    let mut fitted = ranks[worst].clone();
    let Some(choice) = fit_budget(&mut fitted, dims, budget, target, device)? else {
        return Ok(None);
    };
    // Each dropped value by its place among the worst rank's kept values.
    let places: Vec<usize> = choice
        .dropped
        .iter()
        .map(|d| {
            kept[worst]
                .iter()
                .position(|&v| v == d.value)
                .ok_or_else(|| internal("a recomputed value is not one the step keeps".to_string()))
        })
        .collect::<Result<_, _>>()?;
    for (r, g) in ranks.iter_mut().enumerate() {
        if r == worst {
            *g = fitted.clone();
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
        let dropped: HashSet<Value> = places.iter().map(|&i| kept[r][i]).collect();
        g.order_by_memory = fitted.order_by_memory;
        rewrite::drop_saved(g, &dropped);
        let after = probe(g, dims, target, device)?.arena_bytes;
        if after > budget {
            return Err(BudgetError::BelowFloor {
                budget,
                floor: after,
                peak: peaks[r],
            });
        }
    }
    Ok(Some(choice))
}

fn internal(m: String) -> BudgetError {
    BudgetError::Plan(PlanError(format!(
        "internal error fitting the ranks to the memory budget: {m}; this is a bug in fusec, please report it with the model file"
    )))
}
