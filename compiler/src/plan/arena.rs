//! Where every buffer lives: its size at the plan's sizes, its lifetime in
//! kernel positions, and its offset in the one arena (whole-run buffers
//! first, then temporaries packed greedily, an output written over an input
//! it reads for the last time sharing its storage).

use super::collectives::PlannedCollective;
use super::{align, in_place_ok, padded, MemKind, PlanError, PlannedBuffer, MAX_BYTES};
use crate::ir::graph::{Graph, Role};
use crate::ir::DType;
use crate::kernel::{Body, BufKind, Program};
use crate::ops::Op;
use crate::select::{Choice, Selection};
use std::collections::{BTreeMap, HashMap};

/// The sizes of the symbolic dimensions.
type Env<'a> = &'a dyn Fn(&str) -> Option<i64>;

/// Every buffer of the program at the plan's sizes: shape, bytes, kind,
/// name, and the parameter or state an update writes it over.
pub(super) fn buffers(g: &Graph, p: &Program, env: Env) -> Result<Vec<PlannedBuffer>, PlanError> {
    let grads: HashMap<_, _> = g
        .outputs
        .iter()
        .filter_map(|(r, v)| matches!(r, Role::Grad(_)).then_some((*v, ())))
        .collect();
    // In-place updates: the new value of a parameter or state overwrites it.
    let mut alias: HashMap<usize, usize> = HashMap::new();
    for (role, v) in &g.outputs {
        let target = match role {
            Role::NewParam(i) => p.buffer_of(crate::ir::Value {
                node: g.params[*i].node,
                port: 0,
            }),
            Role::NewState(name) => p
                .buffers
                .iter()
                .position(|b| matches!(&g.g[b.value.node].op, Op::State(s) if &s.name == name)),
            _ => None,
        };
        if let (Some(b), Some(t)) = (p.buffer_of(*v), target) {
            alias.insert(b, t);
        }
    }
    let mut out = Vec::with_capacity(p.buffers.len());
    for (id, b) in p.buffers.iter().enumerate() {
        let shape: Vec<i64> =
            b.ty.shape
                .iter()
                .map(|d| {
                    d.eval(env)
                        .filter(|v| *v >= 0)
                        .ok_or_else(|| PlanError(format!("dimension {d} has no size")))
                })
                .collect::<Result<_, _>>()?;
        let n: i64 = shape
            .iter()
            .try_fold(1i64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                PlanError("a buffer's element count overflows 64 bits: check the sizes".into())
            })?;
        let kind = match b.kind {
            BufKind::Param => MemKind::Param,
            BufKind::State => MemKind::OptimizerState,
            BufKind::Input => MemKind::Input,
            BufKind::Temp if grads.contains_key(&b.value) => MemKind::Grad,
            BufKind::Temp => MemKind::Activation,
        };
        let name = match &g.g[b.value.node].op {
            Op::Param(x) => x.name.clone(),
            Op::Input(x) => x.name.clone(),
            Op::State(x) => x.name.clone(),
            _ => format!("{} ({})", b.ty, g.g[b.value.node].op.name()),
        };
        let bytes = padded(n as u64, &shape, b.pitch, b.zero_rows)
            .and_then(|e| e.checked_mul(b.ty.dtype.size_bytes() as u64))
            .filter(|&x| x <= MAX_BYTES)
            .ok_or_else(|| {
                PlanError(format!(
                    "{name} takes more than 2^60 bytes: check the sizes"
                ))
            })?;
        out.push(PlannedBuffer {
            id,
            name,
            dtype: b.ty.dtype,
            shape,
            bytes,
            pitch: b.pitch,
            zero_rows: b.zero_rows,
            offset: 0,
            kind,
            alias_of: alias.get(&id).copied(),
            shares_with: None,
            live: None,
        });
    }
    Ok(out)
}

/// The f32 scratch each template set shares (the attention backward's)
/// and each split GEMM's operand copies, alive for its kernel alone,
/// appended to `out`; returns each such kernel's scratch buffer.
pub(super) fn add_scratch(
    p: &Program,
    selection: Option<&Selection>,
    env: Env,
    out: &mut Vec<PlannedBuffer>,
) -> Result<HashMap<usize, usize>, PlanError> {
    let mut scratch_of: HashMap<usize, usize> = HashMap::new();
    if let Some(sel) = selection {
        for (k, c) in sel.choices.iter().enumerate() {
            let name = &p.kernels[k].name;
            let (n, what) = match c {
                Choice::SplitGemm => {
                    // Three copies of each operand, packed: at most three
                    // times its buffer (a view reads no more than it holds).
                    let ins = &p.kernels[k].inputs;
                    let n = 3 * (out[ins[0]].bytes + out[ins[1]].bytes) / 4;
                    (n, format!("operands of {name} split for TF32"))
                }
                Choice::Templates(_) | Choice::Skinny(_) => {
                    let scratch = match c {
                        Choice::Skinny(l) => l.scratch_f32.as_ref(),
                        Choice::Templates(ks) => {
                            ks.iter().find_map(|f| f.launch.scratch_f32.as_ref())
                        }
                        _ => None,
                    };
                    let Some(elems) = scratch else {
                        continue;
                    };
                    let n = elems
                        .eval(env)
                        .and_then(|n| u64::try_from(n).ok())
                        .filter(|n| *n <= MAX_BYTES / 4)
                        .ok_or_else(|| PlanError(format!("the scratch of {name} has no size")))?;
                    (n, format!("scratch of {name}"))
                }
                _ => continue,
            };
            scratch_of.insert(k, out.len());
            out.push(PlannedBuffer {
                id: out.len(),
                name: format!("f32[{n}] ({what})"),
                dtype: DType::F32,
                shape: vec![n as i64],
                bytes: 4 * n,
                pitch: None,
                zero_rows: 0,
                offset: 0,
                kind: MemKind::Activation,
                alias_of: None,
                shares_with: None,
                live: Some((k, k)),
            });
        }
    }
    Ok(scratch_of)
}

/// Each temporary's first and last kernel; the graph's outputs live to the
/// end. Returns the outputs' buffers.
pub(super) fn lifetimes(g: &Graph, p: &Program, out: &mut [PlannedBuffer]) -> Vec<usize> {
    let last = p.kernels.len();
    let outputs: Vec<usize> = g
        .outputs
        .iter()
        .filter_map(|(_, v)| p.buffer_of(*v))
        .collect();
    for (k, kernel) in p.kernels.iter().enumerate() {
        for &b in kernel.inputs.iter().chain(&kernel.outputs) {
            let l = out[b].live.get_or_insert((k, k));
            l.0 = l.0.min(k);
            l.1 = l.1.max(k);
        }
    }
    for &b in &outputs {
        if let Some(l) = out[b].live.as_mut() {
            l.1 = last;
        }
    }
    outputs
}

/// Places the whole-run buffers (parameters, gradients, optimizer state,
/// inputs) from offset 0; returns where the temporaries start.
pub(super) fn place_whole_run(
    out: &mut [PlannedBuffer],
    buckets: &[PlannedCollective],
) -> Result<u64, PlanError> {
    // Whole-run buffers first, in a fixed order of kinds.
    let mut cursor = 0u64;
    // Every offset below is at most the sum of all sizes.
    if out
        .iter()
        .try_fold(0u64, |t, b| t.checked_add(align(b.bytes)))
        .is_none_or(|t| t > MAX_BYTES)
    {
        return Err(PlanError(
            "the buffers take more than 2^60 bytes in all: check the sizes".into(),
        ));
    }
    // Each bucket's gradients side by side in the bucket's order, so that
    // the runtime averages a bucket as one run of memory (one NCCL call at
    // full bandwidth, not one per tensor). With micro-batches a bucket
    // averages the accumulated sums instead, temporaries placed one by one
    // below, and goes as a call per tensor.
    let mut bucket_order: HashMap<usize, usize> = HashMap::new();
    for (n, i) in buckets
        .iter()
        .flat_map(|c| c.tensors.iter().map(|&(i, _)| i))
        .enumerate()
    {
        bucket_order.entry(i).or_insert(n);
    }
    for kind in [
        MemKind::Param,
        MemKind::Grad,
        MemKind::OptimizerState,
        MemKind::Input,
    ] {
        let mut order: Vec<usize> = (0..out.len())
            .filter(|&i| out[i].kind == kind && out[i].alias_of.is_none())
            .collect();
        order.sort_by_key(|i| (bucket_order.get(i).copied().unwrap_or(usize::MAX), *i));
        for i in order {
            let b = &mut out[i];
            b.offset = cursor;
            b.live = None;
            cursor += align(b.bytes);
        }
    }
    Ok(cursor)
}

/// Lets a kernel's output take the storage of an input it reads for the
/// last time, where the kernel reads it element for element.
pub(super) fn share_in_place(g: &Graph, p: &Program, out: &mut [PlannedBuffer], outputs: &[usize]) {
    // A kernel may write its result over an input it reads for the last
    // time, element for element (softmax over its logits, an add over its
    // operand): the two share storage, and their lifetimes join.
    for (k, kernel) in p.kernels.iter().enumerate() {
        // One output, or the first of cross-entropy-with-gradient (dlogits
        // over the logits; the per-row losses are separate).
        let fused_ce = matches!(&kernel.body, Body::Op(n) if matches!(g.g[*n].op, Op::CrossEntropyWithGrad(_)));
        // Or the elements a chain stores beside its column sums (which are
        // written by a tile's last block, while other tiles still read).
        let sums = match &kernel.body {
            Body::Pointwise(pw) => pw.sum.as_ref().map(|s| s.out),
            _ => None,
        };
        let o = match (&kernel.outputs[..], sums) {
            (&[o, _], Some(1)) => o,
            (_, Some(_)) => continue,
            (&[o], None) => o,
            (&[o, _], None) if fused_ce => o,
            _ => continue,
        };
        if out[o].kind != MemKind::Activation || out[o].alias_of.is_some() || outputs.contains(&o) {
            continue;
        }
        for (slot, &b) in kernel.inputs.iter().enumerate() {
            let root = out[b].shares_with.unwrap_or(b);
            let ok = out[b].kind == MemKind::Activation
                && out[b].alias_of.is_none()
                && !outputs.contains(&b)
                && out[root].live.is_some_and(|l| l.1 == k && l.0 < k)
                && out[root].bytes >= out[o].bytes
                && p.buffers[b].ty.dtype.size_bytes() == p.buffers[o].ty.dtype.size_bytes()
                && p.buffers[b].pitch == p.buffers[o].pitch
                && in_place_ok(g, kernel, slot);
            if ok {
                let end = out[o].live.map_or(k, |l| l.1);
                if let Some(l) = out[root].live.as_mut() {
                    l.1 = l.1.max(end);
                }
                out[o].shares_with = Some(root);
                break;
            }
        }
    }
}

/// Packs the temporaries above `base`, largest first at the lowest offset
/// free over their lifetime; every alias takes its target's offset.
/// Returns the arena's end.
pub(super) fn place_temps(out: &mut [PlannedBuffer], base: u64, last: usize) -> u64 {
    let mut temps: Vec<usize> = (0..out.len())
        .filter(|&i| {
            out[i].kind == MemKind::Activation
                && out[i].alias_of.is_none()
                && out[i].shares_with.is_none()
        })
        .collect();
    temps.sort_by(|&a, &b| out[b].bytes.cmp(&out[a].bytes).then(a.cmp(&b)));
    let mut placed: Vec<(u64, u64, (usize, usize))> = Vec::new();
    let mut top = base;
    for i in temps {
        let life = out[i].live.unwrap_or((0, last));
        let size = align(out[i].bytes);
        let mut clashes: Vec<(u64, u64)> = placed
            .iter()
            .filter(|(_, _, l)| l.0 <= life.1 && life.0 <= l.1)
            .map(|(o, s, _)| (*o, *s))
            .collect();
        clashes.sort();
        let mut at = base;
        for (o, s) in clashes {
            if at + size <= o {
                break;
            }
            at = at.max(o + s);
        }
        out[i].offset = at;
        placed.push((at, size, life));
        top = top.max(at + size);
    }
    for i in 0..out.len() {
        if let Some(t) = out[i].alias_of.or(out[i].shares_with) {
            out[i].offset = out[t].offset;
        }
    }
    top
}

/// Bytes of each kind of buffer (the temporaries: the arena above `base`).
pub(super) fn bytes_by_kind(out: &[PlannedBuffer], base: u64, top: u64) -> BTreeMap<MemKind, u64> {
    let mut bytes_by_kind: BTreeMap<MemKind, u64> = BTreeMap::new();
    for b in out
        .iter()
        .filter(|b| b.alias_of.is_none() && b.kind != MemKind::Activation)
    {
        *bytes_by_kind.entry(b.kind).or_default() += align(b.bytes);
    }
    bytes_by_kind.insert(MemKind::Activation, top - base);
    bytes_by_kind
}
