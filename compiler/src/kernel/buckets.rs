//! Gradient buckets for data parallelism: the `all_reduce` of each
//! gradient, one op kernel each after fusion, become group kernels of about
//! [`BUCKET_BYTES`] each, in the order the backward pass finishes their
//! gradients, each placed right after the kernel that finishes its last
//! gradient. The runtime issues a bucket's collective on a second stream
//! there, so it runs while the rest of the backward pass computes; the
//! first kernel that reads a reduced gradient waits for it.

use super::{Body, Buffer, Kernel, Member};
use crate::ir::Graph;
use crate::ops::Op;
use std::collections::HashMap;

/// A bucket closes once it holds at least this many bytes (`--bucket-mib`
/// sets another, `LowerOptions::bucket_bytes`): large enough that each collective
/// runs near link speed and that few of them start, small enough that the
/// first starts early in the backward pass. PyTorch DDP closes at 25 MB;
/// on 2 and 4 H100s over NVLink, 100 MiB made gpt2-small's data-parallel
/// step 0.5-0.9 ms faster and llama-small's 0.3-0.4 ms (docs/benchmarks.md,
/// 2026-11-27): every collective is a point where a rank's NCCL kernel
/// holds multiprocessors while it waits for the slowest rank, so fewer of
/// them cost less, and the backward pass still hides all but the last. A
/// model with less than this many bytes of gradients gets one bucket, after
/// its backward pass (not measured against smaller buckets).
pub const BUCKET_BYTES: u64 = 100 << 20;

/// Most tensors in one bucket (one NCCL group call each).
const BUCKET_MAX: usize = 256;

/// Whether collective kernel `k` runs on every micro-batch (see
/// `AllReduce::every_micro_batch`); a bucket never mixes the two kinds.
pub fn every_micro_batch(g: &Graph, k: &Kernel) -> bool {
    k.nodes
        .iter()
        .any(|&n| matches!(g.g[n].op, Op::AllReduce(ref a) if a.every_micro_batch))
}

pub fn is_collective(g: &Graph, k: &Kernel) -> bool {
    match &k.body {
        Body::Op(n) => matches!(g.g[*n].op, Op::AllReduce(_)),
        Body::Group(ms) => ms
            .iter()
            .all(|m| matches!(g.g[m.node].op, Op::AllReduce(_))),
        _ => false,
    }
}

/// Bytes of a buffer at its constant size (`None` when it has a symbolic one).
fn bytes(b: &Buffer) -> Option<u64> {
    let mut n: u64 = 1;
    for d in &b.ty.shape {
        n = n.checked_mul(u64::try_from(d.eval(&|_| None)?).ok()?)?;
    }
    n.checked_mul(b.ty.dtype.size_bytes() as u64)
}

/// [`BUCKET_BYTES`] for gradients averaged in f32; half that where they
/// are all averaged in a 2-byte type (`--reduce-dtype bf16`), so that a
/// bucket holds the gradients it would in f32 and the table of a tied
/// embedding (gpt2-small's 74 MiB in bf16) still goes alone, after the
/// rest.
fn default_bucket_bytes(
    g: &Graph,
    buffers: &[Buffer],
    order: &[(Option<usize>, usize, Kernel)],
) -> u64 {
    let narrow = order
        .iter()
        .filter(|(_, _, k)| !every_micro_batch(g, k))
        .all(|(_, _, k)| buffers[k.inputs[0]].ty.dtype.size_bytes() == 2);
    if narrow {
        BUCKET_BYTES / 2
    } else {
        BUCKET_BYTES
    }
}

/// `kernels` with every all-reduce op kernel gathered into buckets.
pub fn bucket_collectives(
    g: &Graph,
    buffers: &[Buffer],
    kernels: Vec<Kernel>,
    bucket_bytes: Option<u64>,
) -> Vec<Kernel> {
    if !kernels.iter().any(|k| is_collective(g, k)) {
        return kernels;
    }
    let (collectives, rest): (Vec<Kernel>, Vec<Kernel>) =
        kernels.into_iter().partition(|k| is_collective(g, k));
    // Positions among the other kernels: after which one each gradient is
    // ready, and before which one its mean is first needed.
    let mut writer: HashMap<usize, usize> = HashMap::new();
    let mut first_reader: HashMap<usize, usize> = HashMap::new();
    for (i, k) in rest.iter().enumerate() {
        for &b in &k.outputs {
            writer.insert(b, i);
        }
        for &b in &k.inputs {
            first_reader.entry(b).or_insert(i);
        }
    }
    // (ready after, needed before, kernel), in the order gradients finish.
    let mut order: Vec<(Option<usize>, usize, Kernel)> = collectives
        .into_iter()
        .map(|k| {
            let ready = writer.get(&k.inputs[0]).copied();
            let needed = k
                .outputs
                .iter()
                .filter_map(|b| first_reader.get(b))
                .min()
                .copied()
                .unwrap_or(rest.len());
            (ready, needed, k)
        })
        .collect();
    order.sort_by_key(|(ready, _, _)| *ready);
    // Cut into buckets; a bucket also closes where waiting for its next
    // gradient would hold up a kernel that needs one already in it.
    // Open buckets: one for the gradients, one for what every micro-batch
    // averages (the loss); a tensor of a bucket's size or more goes alone,
    // so the gradients before it do not wait for it.
    let bucket_bytes = bucket_bytes
        .unwrap_or_else(|| default_bucket_bytes(g, buffers, &order))
        .max(1);
    let mut buckets: Vec<(Option<usize>, usize, u64, Vec<Kernel>)> = Vec::new();
    let mut open: [Option<usize>; 2] = [None, None];
    for (ready, needed, k) in order {
        let size = bytes(&buffers[k.inputs[0]]).unwrap_or(bucket_bytes);
        let kind = usize::from(every_micro_batch(g, &k));
        let fits = open[kind].is_some_and(|i| {
            let (_, need, total, ks) = &buckets[i];
            ks.len() < BUCKET_MAX
                && *total < bucket_bytes
                && size < bucket_bytes
                && ready.map_or(0, |r| r + 1) <= *need
        });
        if fits {
            let b = &mut buckets[open[kind].expect("an open bucket")];
            b.0 = b.0.max(ready);
            b.1 = b.1.min(needed);
            b.2 += size;
            b.3.push(k);
        } else {
            open[kind] = (size < bucket_bytes).then_some(buckets.len());
            buckets.push((ready, needed, size, vec![k]));
        }
    }
    // Launched in the order they become ready.
    buckets.sort_by_key(|b| b.0);
    let mut out = Vec::with_capacity(rest.len() + buckets.len());
    let mut pending = buckets.into_iter().peekable();
    let mut place = |after: Option<usize>, out: &mut Vec<Kernel>| {
        while let Some((ready, ..)) = pending.peek() {
            if *ready != after {
                break;
            }
            let (_, _, _, ks) = pending.next().expect("peeked");
            out.push(group(ks));
        }
    };
    place(None, &mut out);
    for (i, k) in rest.into_iter().enumerate() {
        out.push(k);
        place(Some(i), &mut out);
    }
    out
}

/// One bucket's kernels as a group kernel (its members keep their order).
fn group(ks: Vec<Kernel>) -> Kernel {
    let (mut inputs, mut outputs, mut members) = (Vec::new(), Vec::new(), Vec::new());
    for k in ks {
        members.push(Member {
            node: k.nodes[0],
            inputs: vec![inputs.len()],
            outputs: vec![outputs.len()],
            chain: None,
        });
        inputs.push(k.inputs[0]);
        outputs.push(k.outputs[0]);
    }
    Kernel::group("all_reduce", members, inputs, outputs)
}
