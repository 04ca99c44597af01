//! ZeRO stage 1: the optimizer state split over the data-parallel ranks.
//! Each parameter has one owner rank, which alone keeps its optimizer
//! state and updates it; after the update the owner sends the new values
//! to the other ranks (an NCCL broadcast per parameter, or
//! `interp::peers::Peers::share` on the CPU reference). Parameters are
//! dealt whole, largest first, each to the rank holding the fewest
//! elements so far (PyTorch's ZeroRedundancyOptimizer does the same), so
//! every rank computes the same owners from the model alone.

use crate::ir::graph::ParamInfo;

/// The owner rank of each parameter of `params`, for `ranks` ranks.
pub fn owners(params: &[ParamInfo], ranks: u32) -> Vec<u32> {
    let ranks = ranks.max(1) as usize;
    let size = |p: &ParamInfo| {
        p.ty.shape
            .iter()
            .map(|d| d.as_const().unwrap_or(1).max(1) as u64)
            .product::<u64>()
    };
    let mut order: Vec<usize> = (0..params.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(size(&params[i])), i));
    let mut load = vec![0u64; ranks];
    let mut owner = vec![0u32; params.len()];
    for i in order {
        let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += size(&params[i]);
        owner[i] = r as u32;
    }
    owner
}
