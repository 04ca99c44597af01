//! The decode step: a language model's forward pass rewritten to run T new
//! positions at a time against a key/value cache, which is what generation
//! runs once a token (T = 1), with the prompt's tokens first.
//!
//! From the logits graph (`driver::logits_graph`), each causal
//! self-attention becomes a write of its keys and values into the layer's
//! caches (`kv_write`, states `kv_cache.<layer>.k` and `.v` of
//! [B, KV, Hkv, D], KV the cache's positions) and attention over them
//! (`cached_attention`); the positions the step's rows stand at come in as
//! the input `decode.positions` (i32 [T]), which a position table's slice
//! (`wpe[0:T]`, now a lookup of those rows) and `rope` read. The caches are
//! states whose new values are the writes' outputs, so the plan gives the
//! two the same storage: a step writes T rows of each and reads the rest.
//!
//! What cannot be decoded this way is refused at its place in the model
//! file: attention that is not causal self-attention, attention written by
//! hand (a `causal_mask`), a slice along the positions of anything but a
//! parameter table.

use crate::diag::{Diagnostic, Span};
use crate::driver::Failure;
use crate::ir::dim::{self, Dim};
use crate::ir::graph::{Phase, Role, Value};
use crate::ir::types::TensorType;
use crate::ir::Graph;
use crate::ops::{CachedAttention, Embedding, KvWrite, Op, Rope, State};
use petgraph::stable_graph::NodeIndex;
use petgraph::Direction;

/// The input holding each row's position (i32 [T]).
pub const POSITIONS_INPUT: &str = "decode.positions";
/// The widest head (keys' or values' features) a decode step takes: the
/// cached attention's warps keep a head's features in registers and their
/// partial sums in shared memory (emit/lower/decode.rs).
pub const MAX_HEAD_DIM: i64 = 1024;
/// The symbolic size of the caches: positions they hold.
pub const CACHE_DIM: &str = "KV";

/// The name of layer `layer`'s key (`"k"`) or value (`"v"`) cache.
pub fn cache_name(layer: usize, which: &str) -> String {
    format!("kv_cache.{layer}.{which}")
}

fn refuse(g: &Graph, n: NodeIndex, message: &str, label: &str, help: &str) -> Failure {
    let span = g.g[n].span.unwrap_or_default();
    Failure::Model(Diagnostic::new(message, span, label).with_help(help).into())
}

/// Whether `v` is computed from parameters and constants alone (a table,
/// not an activation).
fn is_table(g: &Graph, v: Value) -> bool {
    let mut stack = vec![v.node];
    let mut seen = std::collections::HashSet::new();
    while let Some(n) = stack.pop() {
        if !seen.insert(n) {
            continue;
        }
        if matches!(g.g[n].op, Op::Input(_) | Op::State(_)) {
            return false;
        }
        stack.extend(g.g.neighbors_directed(n, Direction::Incoming));
    }
    true
}

fn mentions_seq(d: &Dim) -> bool {
    d.symbols().any(|s| s == dim::SEQ)
}

/// The decode step of `logits` (a graph `driver::logits_graph` made).
pub fn decode_graph(logits: &Graph) -> Result<Graph, Failure> {
    let mut g = logits.clone();
    if g.dims.iter().any(|d| d == CACHE_DIM) {
        return Err(Failure::Usage(format!(
            "the model declares a dimension named {CACHE_DIM}, which the decode step keeps for its cache's positions; rename it to generate"
        )));
    }
    g.dims.push(CACHE_DIM.to_string());
    let positions_ty = TensorType::new(crate::ir::DType::I32, vec![Dim::symbol(dim::SEQ)]);
    let positions = g
        .add(
            crate::ops::Input {
                name: POSITIONS_INPUT.into(),
                ty: positions_ty.clone(),
            }
            .into(),
            &[],
            None,
            Phase::Forward,
        )
        .map_err(|e| Failure::Usage(e.to_string()))?[0];
    let order = g.topo_order();
    let mut layer = 0;
    for n in order {
        let ins = g.inputs(n);
        let span = g.g[n].span;
        let made = match g.g[n].op.clone() {
            Op::CausalMask(_) => {
                return Err(refuse(
                    &g,
                    n,
                    "this attention is written by hand, and generation needs `attention(...)` to keep a key/value cache",
                    "masked by hand here",
                    "write it as attention(q, k, v, causal = true)",
                ))
            }
            Op::Attention(a) => {
                if !a.causal {
                    return Err(refuse(
                        &g,
                        n,
                        "generation decodes causal attention, and this attention is not causal",
                        "not causal",
                        "a language model that generates text attends with causal = true",
                    ));
                }
                if a.lengths || a.dropout.is_some() {
                    return Err(refuse(
                        &g,
                        n,
                        "generation decodes attention without key lengths",
                        "attention with key lengths",
                        "generation feeds one sequence a row, with no padding",
                    ));
                }
                let (q, k, v) = (ins[0], ins[1], ins[2]);
                let widest = [k, v]
                    .iter()
                    .map(|x| g.ty(*x).shape[3].as_const())
                    .collect::<Option<Vec<_>>>()
                    .and_then(|w| w.into_iter().max());
                if widest.is_none_or(|w| w > MAX_HEAD_DIM) {
                    return Err(refuse(
                        &g,
                        n,
                        &format!("generation decodes heads of up to {MAX_HEAD_DIM} features"),
                        "heads wider than that, or of no fixed size",
                        "the cached attention keeps a head's features in a warp's registers; wider heads are not built",
                    ));
                }
                if g.ty(k).shape[1] != Dim::symbol(dim::SEQ) || g.ty(q).shape[1] != Dim::symbol(dim::SEQ)
                {
                    return Err(refuse(
                        &g,
                        n,
                        "generation decodes self-attention, and this attention reads keys of another length",
                        "cross-attention",
                        "the keys and values must come from the same positions as the queries",
                    ));
                }
                let mut caches = Vec::new();
                for (which, x) in [("k", k), ("v", v)] {
                    let mut ty = g.ty(x).clone();
                    ty.shape[1] = Dim::symbol(CACHE_DIM);
                    let name = cache_name(layer, which);
                    let state = g
                        .add(State { name: name.clone(), ty }.into(), &[], span, Phase::Forward)
                        .map_err(|e| Failure::Usage(e.to_string()))?[0];
                    let written = g
                        .add(KvWrite.into(), &[state, x, positions], span, Phase::Forward)
                        .map_err(|e| Failure::Usage(e.to_string()))?[0];
                    g.outputs.push((Role::NewState(name), written));
                    caches.push(written);
                }
                layer += 1;
                g.add(
                    CachedAttention { scale: a.scale }.into(),
                    &[q, caches[0], caches[1], positions],
                    span,
                    Phase::Forward,
                )
                .map_err(|e| Failure::Usage(e.to_string()))?
            }
            Op::Rope(r) if !r.positions => {
                let rope = Rope {
                    positions: true,
                    ..r
                };
                g.add(rope.into(), &[ins[0], positions], span, Phase::Forward)
                    .map_err(|e| Failure::Usage(e.to_string()))?
            }
            Op::Slice(s) if mentions_seq(&s.start) || mentions_seq(&s.end) => {
                let table = ins[0];
                let rows = s.axis == 0
                    && g.ty(table).rank() == 2
                    && s.start.as_const() == Some(0)
                    && s.end == Dim::symbol(dim::SEQ);
                if !rows || !is_table(&g, table) {
                    return Err(refuse(
                        &g,
                        n,
                        "generation runs a few positions at a time, and this slice reads along the positions",
                        "sliced by the sequence length here",
                        "a position table is read as table[0:T] (the rows of the positions); other slices along T cannot be decoded with a key/value cache",
                    ));
                }
                g.add(Embedding.into(), &[table, positions], span, Phase::Forward)
                    .map_err(|e| Failure::Usage(e.to_string()))?
            }
            _ => continue,
        };
        crate::passes::replace_uses(&mut g, Value { node: n, port: 0 }, made[0]);
    }
    // A model without attention (a bigram) keeps no cache: each position
    // on its own, and the step reads no positions unless a table or rope
    // does.
    run_dce(&mut g)?;
    Ok(g)
}

/// A decode step (or any forward-only step) that keeps each parameter
/// only ever read cast to one dtype (a mixed-precision model's f32
/// weights, cast to bf16 for the forward pass) in that dtype, so that a
/// step does not cast every weight again for each token: gpt2-small's cast
/// of its 124M weights was 0.28 ms of a 1.4 ms step at batch 1 (H100),
/// moving 712 MiB. Its values are the cast's: the weights written into the
/// step are rounded as they are stored, as the cast rounded them. (A step
/// that takes a training step's f32 weights often, `--sample-every`'s,
/// keeps them f32: copied device to device, not through the host.)
pub fn weights_as_read(step: &Graph) -> Result<Graph, Failure> {
    let mut g = step.clone();
    cast_weights_once(&mut g);
    run_dce(&mut g)?;
    Ok(g)
}

fn cast_weights_once(g: &mut Graph) {
    for i in 0..g.params.len() {
        let node = g.params[i].node;
        let read = Value { node, port: 0 };
        let users = g.users(read);
        let casts: Option<Vec<(NodeIndex, crate::ir::DType)>> = users
            .iter()
            .map(|&(u, _)| match &g.g[u].op {
                Op::Cast(c) => Some((u, c.to)),
                _ => None,
            })
            .collect();
        let Some(casts) = casts.filter(|c| !c.is_empty()) else {
            continue;
        };
        let to = casts[0].1;
        if casts.iter().any(|&(_, d)| d != to) || to == g.params[i].ty.dtype {
            continue;
        }
        g.params[i].ty.dtype = to;
        g.g[node].outputs[0].dtype = to;
        if let Op::Param(p) = &mut g.g[node].op {
            p.ty.dtype = to;
        }
        for (cast, _) in casts {
            crate::passes::replace_uses(
                g,
                Value {
                    node: cast,
                    port: 0,
                },
                read,
            );
        }
    }
}

/// The greedy decode step of a decode step: the index of each position's
/// largest logit among the first `classes` (the vocabulary, where the
/// logits are wider), picked on the device (`argmax`), in place of the
/// logits.
pub fn greedy_graph(step: &Graph, classes: i64) -> Result<Graph, Failure> {
    let mut g = step.clone();
    let logits = g.output(&Role::Logits).ok_or_else(|| {
        Failure::Usage("the decode step outputs no logits to pick from".to_string())
    })?;
    let span = g.g[logits.node].span;
    let picks = g
        .add(
            crate::ops::ArgMax { classes }.into(),
            &[logits],
            span,
            Phase::Forward,
        )
        .map_err(|e| Failure::Usage(e.to_string()))?[0];
    g.outputs.retain(|(r, _)| matches!(r, Role::NewState(_)));
    g.outputs.push((Role::NextTokens, picks));
    run_dce(&mut g)?;
    Ok(g)
}

/// The prefill of a decode step: the same step without its logits, so
/// that it only fills the caches (run at T = the prompt's length less one,
/// its logits would be the prompt's every position, which nothing reads).
pub fn prefill_graph(step: &Graph) -> Result<Graph, Failure> {
    let mut g = step.clone();
    g.outputs.retain(|(r, _)| matches!(r, Role::NewState(_)));
    run_dce(&mut g)?;
    Ok(g)
}

fn run_dce(g: &mut Graph) -> Result<(), Failure> {
    use crate::passes::Pass;
    crate::passes::Dce.run(g);
    crate::ir::verify::verify(g).map_err(|problems| {
        Failure::Model(
            Diagnostic::new(
                "internal error: the decode step is invalid",
                Span::default(),
                "",
            )
            .with_help(problems.join("\n"))
            .with_help("this is a bug in fusec; please report it with the model file")
            .into(),
        )
    })
}
