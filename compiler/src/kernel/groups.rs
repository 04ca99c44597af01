//! Group kernels: independent single-op kernels of one kind in one launch
//! (the casts of the master weights to the compute dtype, every
//! parameter's optimizer update), made after fusion has cut the graph into
//! kernels. Each member keeps its own buffers; the group kernel runs each
//! member's loop body over its chunks (emit/group.rs).

use super::{Body, BufKind, Buffer, Kernel, Member, PExpr};
use crate::ir::Graph;
use crate::ops::Op;
use petgraph::stable_graph::NodeIndex;

/// The casts of the f32 master weights to the compute dtype, one kernel
/// each after fusion, become one launch at the place of the first: they read
/// only parameters, which nothing writes before the update. Not ZeRO stage
/// 3's casts of the pieces a gather moves: each is made just before its
/// gather, so that the pieces of a pass's weights are not all kept in the
/// compute dtype from the step's start (for a 7B model on two ranks, 6.7
/// GB).
pub(super) fn group_param_casts(
    g: &Graph,
    buffers: &[Buffer],
    kernels: Vec<Kernel>,
) -> Vec<Kernel> {
    let is_cast = |k: &Kernel| {
        k.nodes.len() == 1
            && matches!(g.g[k.nodes[0]].op, Op::Cast(_))
            && !g.only_gathered(k.nodes[0])
            && k.inputs.len() == 1
            && buffers[k.inputs[0]].kind == BufKind::Param
            && matches!(&k.body, Body::Pointwise(pw) if pw.sum.is_none() && pw.exprs.iter().all(|e| match e {
                PExpr::Load { view, .. } => view.is_contiguous(),
                _ => true,
            }))
    };
    let casts: Vec<usize> = (0..kernels.len())
        .filter(|&i| is_cast(&kernels[i]))
        .collect();
    if casts.len() < 2 {
        return kernels;
    }
    regroup(g, kernels, &casts, casts[0])
}

/// Leading-axis sums launched one after another (a norm backward's two
/// parameter-gradient second stages and the bias gradient of the residual
/// stream's gradient it stores) become one launch at the place of the
/// first: each is a few microseconds of work that fills the GPU poorly
/// alone. Only sums that read no other's result, each of a stored input
/// read as laid out; nothing moves, so no buffer lives longer.
pub(super) fn group_adjacent_sums(g: &Graph, kernels: Vec<Kernel>) -> Vec<Kernel> {
    let is_sum = |k: &Kernel| {
        matches!(k.body, Body::Op(n) if matches!(g.g[n].op, Op::Reduce(_))
            && super::forms::leading_sum(g, n).is_some())
            && k.inputs.len() == 1
            && k.outputs.len() == 1
            && k.input_views.iter().all(Option::is_none)
            && k.residual.is_none()
            && k.prologue.is_none()
    };
    let kernels = defer_sums(kernels, &is_sum);
    let mut runs: Vec<Vec<usize>> = Vec::new();
    let mut run: Vec<usize> = Vec::new();
    for (i, k) in kernels.iter().enumerate() {
        let reads_run = run
            .iter()
            .any(|&j| kernels[j].outputs.iter().any(|b| k.inputs.contains(b)));
        if is_sum(k) && !reads_run && run.len() < GROUP_MAX {
            run.push(i);
            continue;
        }
        if run.len() > 1 {
            runs.push(std::mem::take(&mut run));
        }
        run.clear();
        if is_sum(k) {
            run.push(i);
        }
    }
    if run.len() > 1 {
        runs.push(run);
    }
    if runs.is_empty() {
        return kernels;
    }
    // Each run's group at its first member's place; the rest keep order.
    let mut groups: Vec<Option<Kernel>> = runs
        .iter()
        .map(|r| {
            let nodes: Vec<_> = r.iter().flat_map(|&i| kernels[i].nodes.clone()).collect();
            let mut k = regroup(
                g,
                r.iter().map(|&i| kernels[i].clone()).collect(),
                &(0..r.len()).collect::<Vec<_>>(),
                0,
            )
            .pop()
            .expect("one group");
            k.nodes = nodes;
            // Named for what it holds (a mean is a sum too).
            k.name = format!("sums_x{}", r.len());
            Some(k)
        })
        .collect();
    let mut out = Vec::with_capacity(kernels.len());
    for (i, k) in kernels.into_iter().enumerate() {
        match runs.iter().position(|r| r.contains(&i)) {
            Some(ri) if runs[ri][0] == i => out.push(groups[ri].take().expect("placed once")),
            Some(_) => {}
            None => out.push(k),
        }
    }
    out
}

/// A decode step's cache writes launched one after another (a layer's keys
/// and values) become one launch at the place of the first: each moves a
/// few kilobytes, so its launch is most of its time. Only writes that read
/// no other's result; each keeps its own cache, written in place.
pub(super) fn group_cache_writes(g: &Graph, kernels: Vec<Kernel>) -> Vec<Kernel> {
    let is_write = |k: &Kernel| {
        matches!(k.body, Body::Op(n) if matches!(g.g[n].op, Op::KvWrite(_)))
            && k.prologue.is_none()
            && k.residual.is_none()
    };
    let mut out: Vec<Kernel> = Vec::with_capacity(kernels.len());
    let mut run: Vec<Kernel> = Vec::new();
    let flush = |run: &mut Vec<Kernel>, out: &mut Vec<Kernel>| {
        if run.len() < 2 {
            out.append(run);
            return;
        }
        // Named by Kernel::group: kv_write_x2 for a layer's two.
        let nodes: Vec<_> = run.iter().flat_map(|k| k.nodes.clone()).collect();
        let all: Vec<usize> = (0..run.len()).collect();
        let mut grp = regroup(g, std::mem::take(run), &all, 0)
            .pop()
            .expect("one group");
        grp.nodes = nodes;
        out.push(grp);
    };
    for k in kernels {
        let reads_run = run
            .iter()
            .any(|r| r.outputs.iter().any(|b| k.inputs.contains(b)));
        if is_write(&k) && !reads_run && run.len() < GROUP_MAX {
            run.push(k);
            continue;
        }
        flush(&mut run, &mut out);
        if is_write(&k) {
            run.push(k);
        } else {
            out.push(k);
        }
    }
    flush(&mut run, &mut out);
    out
}

/// Runs of elementwise chain kernels launched one after another (a
/// micro-batch's gradient accumulation: every parameter's gradient scaled,
/// added to its accumulator, the accumulator kept or cleared, a launch
/// each, 333 for llama-small) become group kernels, one for each kind of
/// chain at each depth of the run's dependences, launched at the run's
/// place in depth order. Each member runs its chain as its own kernel
/// would (emit/group.rs). Only where moving them keeps every read after
/// its write: no kernel of the run writes what another of the run reads
/// or writes, but for a chain reading what an earlier one made.
pub(super) fn group_elementwise(g: &Graph, kernels: Vec<Kernel>) -> Vec<Kernel> {
    let simple = |k: &Kernel| {
        matches!(&k.body, Body::Pointwise(pw) if pw.sum.is_none()
            && !pw.exprs.iter().any(|e| matches!(e, PExpr::Dropout { .. })))
            && k.prologue.is_none()
            && k.residual.is_none()
            && !k.outputs.is_empty()
    };
    let mut out: Vec<Kernel> = Vec::with_capacity(kernels.len());
    let mut run: Vec<Kernel> = Vec::new();
    for k in kernels {
        if simple(&k) {
            run.push(k);
            continue;
        }
        out.extend(group_run(g, std::mem::take(&mut run)));
        out.push(k);
    }
    out.extend(group_run(g, run));
    out
}

/// One run of [`group_elementwise`]: its kernels, grouped where that is
/// safe and gains a launch, else as they were.
fn group_run(g: &Graph, run: Vec<Kernel>) -> Vec<Kernel> {
    if run.len() < 2 {
        return run;
    }
    // Each kernel's depth: one more than the deepest kernel of the run
    // whose output it reads.
    let mut depth = vec![0usize; run.len()];
    for i in 0..run.len() {
        for j in 0..i {
            if run[j].outputs.iter().any(|b| run[i].inputs.contains(b)) {
                depth[i] = depth[i].max(depth[j] + 1);
            }
        }
    }
    // Safe to reorder by depth: every buffer of the run written once, and
    // read only by kernels after its writer.
    let mut written = std::collections::HashSet::new();
    for (i, k) in run.iter().enumerate() {
        for b in &k.outputs {
            if !written.insert(*b) || run[..i].iter().any(|e| e.inputs.contains(b)) {
                return run;
            }
        }
    }
    let kind = |k: &Kernel| {
        k.nodes
            .iter()
            .map(|&n| g.g[n].op.name())
            .collect::<Vec<_>>()
    };
    // (depth, kind) in order of first appearance within each depth.
    let mut keys: Vec<(usize, Vec<&'static str>)> = Vec::new();
    for (i, k) in run.iter().enumerate() {
        let key = (depth[i], kind(k));
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys.sort_by_key(|(d, _)| *d);
    if keys.len() == run.len() {
        return run;
    }
    let mut slots: Vec<Option<Kernel>> = run.into_iter().map(Some).collect();
    let mut out = Vec::new();
    for key in &keys {
        let chosen: Vec<usize> = (0..slots.len())
            .filter(|&i| {
                slots[i]
                    .as_ref()
                    .is_some_and(|k| depth[i] == key.0 && kind(k) == key.1)
            })
            .collect();
        let ks: Vec<Kernel> = chosen
            .iter()
            .map(|&i| slots[i].take().expect("once"))
            .collect();
        if ks.len() == 1 {
            out.extend(ks);
            continue;
        }
        let chains: Vec<(Vec<NodeIndex>, crate::kernel::Pointwise)> = ks
            .iter()
            .map(|k| match &k.body {
                Body::Pointwise(pw) => (k.nodes.clone(), pw.clone()),
                _ => unreachable!("simple kernels are chains"),
            })
            .collect();
        let all: Vec<usize> = (0..ks.len()).collect();
        for mut grp in regroup(g, ks, &all, 0) {
            let Body::Group(members) = &mut grp.body else {
                unreachable!("regroup makes groups")
            };
            for m in members.iter_mut() {
                let at = chains
                    .iter()
                    .position(|(nodes, _)| nodes[0] == m.node)
                    .expect("a member of the run");
                m.chain = Some(Box::new(chains[at].clone()));
            }
            grp.nodes = members
                .iter()
                .flat_map(|m| m.chain.as_ref().map_or(vec![m.node], |c| c.0.clone()))
                .collect();
            out.push(grp);
        }
    }
    out
}

/// Launches a sum may move later to join the next sums: its input lives
/// that much longer (GPT-2's bias gradient of the MLP's first product, past
/// two products and a norm backward to the next norm's sums).
const DEFER_MAX: usize = 4;

/// Each sum followed within DEFER_MAX launches by another sum moves to just
/// before it, where nothing in between reads or writes what it writes or
/// writes what it reads, so the grouping finds them side by side.
fn defer_sums(mut kernels: Vec<Kernel>, is_sum: &dyn Fn(&Kernel) -> bool) -> Vec<Kernel> {
    let mut i = kernels.len();
    while i > 0 {
        i -= 1;
        if !is_sum(&kernels[i]) || kernels.get(i + 1).is_some_and(is_sum) {
            continue;
        }
        let Some(j) = (i + 1..kernels.len().min(i + 2 + DEFER_MAX)).find(|&j| is_sum(&kernels[j]))
        else {
            continue;
        };
        let k = &kernels[i];
        let clear = kernels[i + 1..j].iter().all(|m| {
            !m.outputs
                .iter()
                .any(|b| k.inputs.contains(b) || k.outputs.contains(b))
                && !m.inputs.iter().any(|b| k.outputs.contains(b))
        });
        if clear {
            let k = kernels.remove(i);
            kernels.insert(j - 1, k);
        }
    }
    kernels
}

/// Most ops in one group kernel: their pointers must fit the 32 KiB of
/// kernel parameters (seven pointers for an AdamW update), and ptxas
/// spills a cast group of 256 members on sm_80 (gpt2-xl's 580 parameters);
/// 160 keeps every shipped model's groups whole below that.
const GROUP_MAX: usize = 160;

/// Kernels `chosen` (independent single-op kernels of one kind, in launch
/// order) as group kernels of at most GROUP_MAX members each, launched
/// where kernel `at` (one of them) was; the other kernels keep their order.
fn regroup(g: &Graph, kernels: Vec<Kernel>, chosen: &[usize], at: usize) -> Vec<Kernel> {
    regroup_each(g, kernels, &[chosen], at)
}

/// [`regroup`] for several sets, each a kind of its own, their groups
/// launched one set after the other where kernel `at` was.
fn regroup_each(g: &Graph, kernels: Vec<Kernel>, sets: &[&[usize]], at: usize) -> Vec<Kernel> {
    let mut groups: Vec<Kernel> = Vec::new();
    for chunk in sets.iter().flat_map(|chosen| chosen.chunks(GROUP_MAX)) {
        let (mut inputs, mut outputs): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        let mut members = Vec::new();
        for &i in chunk {
            let k = &kernels[i];
            let ins = k
                .inputs
                .iter()
                .map(|b| match inputs.iter().position(|x| x == b) {
                    Some(s) => s,
                    None => {
                        inputs.push(*b);
                        inputs.len() - 1
                    }
                })
                .collect();
            let outs = k
                .outputs
                .iter()
                .map(|b| {
                    outputs.push(*b);
                    outputs.len() - 1
                })
                .collect();
            members.push(Member {
                node: k.nodes[0],
                inputs: ins,
                outputs: outs,
                chain: None,
            });
        }
        let op = g.g[members[0].node].op.name();
        groups.push(Kernel::group(op, members, inputs, outputs));
    }
    let mut out = Vec::with_capacity(kernels.len());
    for (i, k) in kernels.into_iter().enumerate() {
        if i == at {
            out.append(&mut groups);
        }
        if !sets.iter().any(|chosen| chosen.contains(&i)) {
            out.push(k);
        }
    }
    out
}

/// Every parameter's optimizer update in one launch (or a few): the ops
/// are independent and nothing in the step reads their results, so they
/// move to the position of the last of them. Under ZeRO with master
/// weights, the stores of the new pieces into the 16-bit parameters (which
/// read the updates' results and nothing else does) follow as groups of
/// their own.
pub(super) fn group_optimizer_updates(g: &Graph, kernels: Vec<Kernel>) -> Vec<Kernel> {
    let is_op =
        |k: &Kernel, f: &dyn Fn(&Op) -> bool| matches!(k.body, Body::Op(n) if f(&g.g[n].op));
    let is_update = |k: &Kernel| is_op(k, &|op| matches!(op, Op::AdamW(_) | Op::Sgd(_)));
    let is_store = |k: &Kernel| is_op(k, &|op| matches!(op, Op::StorePiece(_)));
    let updates: Vec<usize> = (0..kernels.len())
        .filter(|&i| is_update(&kernels[i]))
        .collect();
    let stores: Vec<usize> = (0..kernels.len())
        .filter(|&i| is_store(&kernels[i]))
        .collect();
    if updates.len() < 2 {
        return kernels;
    }
    // Only when no other kernel reads what an update or a store writes.
    let written: std::collections::HashSet<usize> = updates
        .iter()
        .chain(&stores)
        .flat_map(|&i| kernels[i].outputs.iter().copied())
        .collect();
    if kernels
        .iter()
        .any(|k| !is_update(k) && !is_store(k) && k.inputs.iter().any(|b| written.contains(b)))
    {
        return kernels;
    }
    let last = updates
        .iter()
        .chain(&stores)
        .copied()
        .max()
        .expect("updates");
    regroup_each(g, kernels, &[&updates, &stores], last)
}
