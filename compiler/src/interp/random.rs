//! Random values for a graph's sources: parameters from their initialisers,
//! data inputs within the range their consumers accept (token ids below the
//! embedding's row count, targets below the number of classes).

use super::tensor::{numel, Tensor};
use super::{concrete_shape, Feeds, InterpError};
use crate::autodiff::{APPLY_INPUT, LOSS_SCALE_INPUT, LR_INPUT, STEP_INPUT};
use crate::ir::graph::{Graph, Init, Value};
use crate::ir::types::DType;
use crate::ops::{Op, DROPOUT_KEY_INPUT};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// Standard normal by Box-Muller (keeps the dependency list short).
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(1e-300);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// 32-bit words of the generator one value of `init` consumes: a normal
/// value takes two f64 draws (Box-Muller), a uniform one draw.
fn words_per_value(init: &Init) -> u128 {
    match init {
        Init::Normal { .. } => 4,
        Init::Uniform { .. } => 2,
        Init::Constant(_) => 0,
    }
}

/// Values `start..start + out.len()` of parameter number `index` drawn from
/// `seed`: the parameter's own ChaCha8 stream, positioned at the value, so a
/// runtime can fill a large tensor in parallel chunks and get exactly what
/// a sequential fill gives.
pub fn init_values(init: &Init, seed: u64, index: u64, start: usize, out: &mut [f64]) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(index);
    rng.set_word_pos(start as u128 * words_per_value(init));
    match init {
        Init::Normal { std } => out.iter_mut().for_each(|x| *x = normal(&mut rng) * std),
        Init::Uniform { bound } => out
            .iter_mut()
            .for_each(|x| *x = rng.random_range(-1.0..1.0) * bound),
        Init::Constant(c) => out.iter_mut().for_each(|x| *x = *c),
    }
}

/// Parameter number `index`'s initial values under `seed`.
pub fn init_param(init: &Init, shape: &[usize], seed: u64, index: u64) -> Tensor {
    let mut data = vec![0.0; numel(shape)];
    init_values(init, seed, index, 0, &mut data);
    Tensor::new(shape.to_vec(), data)
}

pub fn init_tensor(init: &Init, shape: &[usize], rng: &mut ChaCha8Rng) -> Tensor {
    let n = numel(shape);
    let data = match init {
        Init::Normal { std } => (0..n).map(|_| normal(rng) * std).collect(),
        Init::Uniform { bound } => (0..n)
            .map(|_| rng.random_range(-1.0..1.0) * bound)
            .collect(),
        Init::Constant(c) => vec![*c; n],
    };
    Tensor::new(shape.to_vec(), data)
}

/// The exclusive upper bound an integer input must respect, from the ops
/// that read it (an embedding table's rows, cross-entropy's classes).
pub fn index_bound(g: &Graph, input: Value, dims: &HashMap<String, i64>) -> Option<i64> {
    let mut bound: Option<i64> = None;
    for (user, slot) in g.users(input) {
        let ins = g.inputs(user);
        let b = match (&g.g[user].op, slot) {
            (Op::Embedding(_), 1) => g.ty(ins[0]).shape[0].eval(&|s| dims.get(s).copied()),
            // Classes of a cross-entropy, its gradient or both fused (the
            // padded columns of pad-dims' logits are none).
            (Op::CrossEntropy(ce), 1) => classes(g, ins[0], ce.classes, dims),
            (Op::CrossEntropyGrad(ce), 1) => classes(g, ins[0], ce.classes, dims),
            (Op::CrossEntropyWithGrad(ce), 1) => classes(g, ins[0], ce.classes, dims),
            // Key lengths: 0 to S, every one of them.
            (Op::Attention(a), s) if a.extra_slots().0 == Some(s) => key_count(g, ins[1], dims),
            (Op::AttentionGrad(a), s) if a.extra_slots().0 == Some(s) => key_count(g, ins[1], dims),
            // A decode step's positions: rows of its caches.
            (Op::KvWrite(_), 2) => g.ty(ins[0]).shape[1].eval(&|s| dims.get(s).copied()),
            (Op::CachedAttention(_), 3) => g.ty(ins[1]).shape[1].eval(&|s| dims.get(s).copied()),
            // Reshapes and slices pass indices through unchanged.
            (Op::Reshape(_) | Op::Slice(_) | Op::Permute(_), 0) => index_bound(
                g,
                Value {
                    node: user,
                    port: 0,
                },
                dims,
            ),
            _ => None,
        };
        if let Some(b) = b {
            bound = Some(bound.map_or(b, |x: i64| x.min(b)));
        }
    }
    bound
}

fn classes(
    g: &Graph,
    logits: Value,
    classes: Option<i64>,
    dims: &HashMap<String, i64>,
) -> Option<i64> {
    classes.or_else(|| g.ty(logits).shape.last()?.eval(&|s| dims.get(s).copied()))
}

/// S + 1 for keys `k` [B, S, H, D]: the bound of their lengths, 0 to S.
fn key_count(g: &Graph, k: Value, dims: &HashMap<String, i64>) -> Option<i64> {
    g.ty(k).shape[1]
        .eval(&|s| dims.get(s).copied())
        .map(|s| s + 1)
}

/// Sets every attention `lengths` input in `feeds` to its full key count
/// (random lengths skip random amounts of attention work; a benchmark of
/// unpadded sequences wants them all full).
pub fn fill_lengths_full(g: &Graph, feeds: &mut Feeds) {
    for n in g.g.node_indices() {
        let Op::Input(i) = &g.g[n].op else { continue };
        let value = Value { node: n, port: 0 };
        let feeds_lengths = g
            .users(value)
            .into_iter()
            .any(|(u, slot)| match &g.g[u].op {
                Op::Attention(a) => a.extra_slots().0 == Some(slot),
                Op::AttentionGrad(a) => a.extra_slots().0 == Some(slot),
                _ => false,
            });
        if !feeds_lengths {
            continue;
        }
        if let (Some(keys), Some(t)) = (
            index_bound(g, value, &feeds.dims),
            feeds.inputs.get_mut(&i.name),
        ) {
            // The bound is S + 1: lengths run from 0 to S.
            t.data.iter_mut().for_each(|x| *x = (keys - 1) as f64);
        }
    }
}

/// Parameters from their initialisers and data inputs at random, all from one seed.
pub fn random_feeds(
    g: &Graph,
    dims: &HashMap<String, i64>,
    seed: u64,
) -> Result<Feeds, InterpError> {
    let mut feeds = Feeds {
        dims: dims.clone(),
        ..Feeds::default()
    };
    for (i, p) in g.params.iter().enumerate() {
        let shape = concrete_shape(&p.ty.shape, dims)?;
        feeds
            .params
            .insert(p.name.clone(), init_param(&p.init, &shape, seed, i as u64));
    }
    random_inputs_into(g, dims, seed, 0, &mut feeds)?;
    Ok(feeds)
}

/// The data inputs alone (and zero optimizer state), batch number `batch`
/// of `seed`: batch 0 is the one [`random_feeds`] draws, and each later
/// batch comes from a stream of its own (a fresh batch every step).
pub fn random_inputs(
    g: &Graph,
    dims: &HashMap<String, i64>,
    seed: u64,
    batch: u64,
) -> Result<Feeds, InterpError> {
    let mut feeds = Feeds {
        dims: dims.clone(),
        ..Feeds::default()
    };
    random_inputs_into(g, dims, seed, batch, &mut feeds)?;
    Ok(feeds)
}

fn random_inputs_into(
    g: &Graph,
    dims: &HashMap<String, i64>,
    seed: u64,
    batch: u64,
    feeds: &mut Feeds,
) -> Result<(), InterpError> {
    // Data inputs draw from streams of their own, after every parameter's.
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(u64::MAX - batch);
    for n in g.topo_order() {
        let node = &g.g[n];
        match &node.op {
            Op::Input(i) => {
                let shape = concrete_shape(&i.ty.shape, dims)?;
                let t = if i.name == LR_INPUT {
                    Tensor::scalar(1e-3)
                } else if i.name == STEP_INPUT
                    || i.name == APPLY_INPUT
                    || i.name == LOSS_SCALE_INPUT
                {
                    Tensor::scalar(1.0)
                } else if i.name == DROPOUT_KEY_INPUT {
                    // A key anywhere in the 64 bits (i32 words as stored).
                    Tensor::new(
                        shape.clone(),
                        (0..numel(&shape))
                            .map(|_| rng.random::<i32>() as f64)
                            .collect(),
                    )
                } else if i.ty.dtype == DType::I32 {
                    let hi = index_bound(g, Value { node: n, port: 0 }, dims)
                        .unwrap_or(2)
                        .max(1);
                    Tensor::new(
                        shape.clone(),
                        (0..numel(&shape))
                            .map(|_| rng.random_range(0..hi) as f64)
                            .collect(),
                    )
                } else {
                    init_tensor(&Init::Normal { std: 1.0 }, &shape, &mut rng)
                };
                feeds.inputs.insert(i.name.clone(), t);
            }
            Op::State(s) => {
                let shape = concrete_shape(&s.ty.shape, dims)?;
                feeds.state.insert(s.name.clone(), Tensor::zeros(&shape));
            }
            _ => {}
        }
    }
    Ok(())
}
