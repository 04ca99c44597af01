//! ZeRO stage 3's gathers in the launch order: each parameter's
//! `all_gather` (one op kernel, run on the communication stream) is issued
//! ahead of need (FSDP's forward and backward prefetch). The gathers whose
//! first reader is the same kernel form a set; each set is issued just
//! after the kernel that first reads the set [`LOOKAHEAD`] sets before it,
//! so that it moves while the compute stream runs the kernels between, and
//! at most `LOOKAHEAD` sets of gathered weights wait at any time besides
//! those being read. A gather never moves before the kernel that writes
//! its input (the piece's cast).

use super::{Body, Kernel};
use crate::ir::Graph;
use crate::ops::Op;
use std::collections::HashMap;

/// How many sets ahead a set is issued. One would leave no kernel between
/// a set and its reader where readers follow each other (a layer norm's
/// weights after the previous product's): two puts at least one reader's
/// work under every set but the step's first, for two sets' weights
/// waiting (a transformer layer has six readers of weights, so this is a
/// third of a layer's weights).
pub const LOOKAHEAD: usize = 2;

/// A gather with the cast that makes the piece it moves, where it has one.
type Moved = (Option<Kernel>, Kernel);

/// Whether kernel `k` is a parameter's gather.
pub fn is_gather(g: &Graph, k: &Kernel) -> bool {
    matches!(&k.body, Body::Op(n) if matches!(g.g[*n].op, Op::AllGather(_)))
}

/// `kernels` with every gather moved ahead (see the module's doc), each
/// with the cast that makes the piece it moves (a kernel of its own that
/// only the gather reads) just before it.
pub fn prefetch_gathers(g: &Graph, kernels: Vec<Kernel>) -> Vec<Kernel> {
    if !kernels.iter().any(|k| is_gather(g, k)) {
        return kernels;
    }
    // Each gather's feeding cast, by the kernel's position.
    let readers_of = |b: usize| kernels.iter().filter(|k| k.inputs.contains(&b)).count();
    let mut feeder: HashMap<usize, usize> = HashMap::new();
    for (i, k) in kernels.iter().enumerate() {
        if !is_gather(g, k) {
            continue;
        }
        let cast = kernels.iter().position(|c| {
            c.outputs == k.inputs && c.nodes.len() == 1 && matches!(g.g[c.nodes[0]].op, Op::Cast(_))
        });
        if let Some(c) = cast.filter(|_| readers_of(k.inputs[0]) == 1) {
            feeder.insert(i, c);
        }
    }
    let moved: std::collections::HashSet<usize> = feeder.values().copied().collect();
    let mut gathers: Vec<Moved> = Vec::new();
    let mut rest: Vec<Kernel> = Vec::new();
    let mut casts: HashMap<usize, Kernel> = HashMap::new();
    let mut pending: Vec<(usize, Kernel)> = Vec::new();
    for (i, k) in kernels.into_iter().enumerate() {
        if moved.contains(&i) {
            casts.insert(i, k);
        } else if is_gather(g, &k) {
            pending.push((i, k));
        } else {
            rest.push(k);
        }
    }
    for (i, k) in pending {
        gathers.push((feeder.get(&i).and_then(|c| casts.remove(c)), k));
    }
    // Where each buffer is written among `rest`, and first read.
    let mut writers: HashMap<usize, Vec<usize>> = HashMap::new();
    let mut first_reader: HashMap<usize, usize> = HashMap::new();
    for (i, k) in rest.iter().enumerate() {
        for &b in &k.outputs {
            writers.entry(b).or_default().push(i);
        }
        for &b in &k.inputs {
            first_reader.entry(b).or_insert(i);
        }
    }
    // (needed by, ready after, the cast and the gather), in the order they
    // are needed; a gather nothing reads (none after dead-code
    // elimination) goes last. Ready: after the last kernel before the
    // reader that writes what the cast (or the gather) reads: a parameter
    // is written only by the update, after every reader.
    let mut order: Vec<(usize, Option<usize>, Moved)> = gathers
        .into_iter()
        .map(|(cast, k)| {
            let needed = first_reader
                .get(&k.outputs[0])
                .copied()
                .unwrap_or(rest.len());
            let reads = cast.as_ref().map_or(&k.inputs, |c| &c.inputs);
            let ready = reads
                .iter()
                .filter_map(|b| writers.get(b)?.iter().rev().find(|&&w| w < needed).copied())
                .max();
            (needed, ready, (cast, k))
        })
        .collect();
    order.sort_by_key(|(needed, _, _)| *needed);
    // After which kernel of `rest` each gather is issued (`None`: first).
    let mut issue: Vec<(Option<usize>, Moved)> = Vec::with_capacity(order.len());
    // The readers of the sets so far, the latest last.
    let mut readers: Vec<usize> = Vec::new();
    for (needed, ready, k) in order {
        if readers.last() != Some(&needed) {
            readers.push(needed);
        }
        // LOOKAHEAD sets ahead, never before its input exists, never after
        // its reader.
        let before = readers.len().checked_sub(LOOKAHEAD + 1).map(|i| readers[i]);
        let at = before.max(ready);
        let at = match at {
            Some(a) if a >= needed => needed.checked_sub(1),
            a => a,
        };
        issue.push((at, k));
    }
    issue.sort_by_key(|(at, _)| *at);
    let mut out = Vec::with_capacity(rest.len() + 2 * issue.len());
    let mut pending = issue.into_iter().peekable();
    let mut place = |after: Option<usize>, out: &mut Vec<Kernel>| {
        while let Some((at, _)) = pending.peek() {
            if *at != after {
                break;
            }
            let (cast, k) = pending.next().expect("peeked").1;
            out.extend(cast);
            out.push(k);
        }
    };
    place(None, &mut out);
    for (i, k) in rest.into_iter().enumerate() {
        out.push(k);
        place(Some(i), &mut out);
    }
    out
}
