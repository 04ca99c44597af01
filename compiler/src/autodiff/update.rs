//! The update phase: optional global-norm clipping, then one optimizer op
//! per parameter. The learning rate and the step number are inputs, so a
//! schedule changes no kernel.

use crate::ir::graph::{Graph, Phase, Role, Value};
use crate::ir::types::{DType, TensorType};
use crate::model::{Optimizer, TrainConfig};
use crate::ops::{
    AdamW, AllReduce, Builder, ClipCoef, Input, OpError, Sgd, State, StorePiece, SumSquares,
    UnaryKind, Unscale,
};

pub use crate::inputs::{APPLY_INPUT, LOSS_SCALE_INPUT, LR_INPUT, STEP_INPUT};

/// Elements per block of the global-norm reduction.
const SUM_SQUARES_CHUNK: i64 = 65536;

/// Most gradients one sum-of-squares kernel reads: its chain of per-tensor
/// branches spills on sm_80 at gpt2-xl's 580 (160 keeps every shipped
/// model's norm in one kernel).
const SUM_SQUARES_TENSORS: usize = 160;

/// The sum of the squares of every element of `gvs` (tensors of constant
/// size; each whole, or under ZeRO the elements [lo, hi) of it), as
/// sum-of-squares kernels of at most SUM_SQUARES_TENSORS gradients each,
/// their partial sums added; `None` if their sizes are not constant.
fn sum_of_squares(
    b: &mut Builder,
    gvs: &[(Value, Option<(i64, i64)>)],
) -> Result<Option<Value>, OpError> {
    let mut total: Option<Value> = None;
    for group in gvs.chunks(SUM_SQUARES_TENSORS) {
        let tys: Vec<TensorType> = group.iter().map(|&(v, _)| b.ty(v).clone()).collect();
        let multi = SumSquares {
            chunk: SUM_SQUARES_CHUNK,
            pieces: group
                .iter()
                .enumerate()
                .filter_map(|(i, &(_, r))| r.map(|(lo, hi)| (i, lo, hi)))
                .collect(),
        };
        if multi.chunks(&tys).is_none() {
            return Ok(None);
        }
        let vals: Vec<Value> = group.iter().map(|&(v, _)| v).collect();
        let partials = b.op1(multi, &vals)?;
        let s = b.sum(partials, vec![0], false)?;
        total = Some(match total {
            Some(acc) => b.add(acc, s)?,
            None => s,
        });
    }
    Ok(total)
}

/// The clipping threshold as built: 1% high under the mutant `ClipScale`
/// (so is the coefficient wherever clipping acts).
fn clip_mutant(max_norm: f64) -> f64 {
    if crate::mutants::is(&crate::mutants::Mutant::ClipScale) {
        max_norm * 1.01
    } else {
        max_norm
    }
}

/// What of a parameter this rank updates: `None` nothing (ZeRO, another
/// rank owns it all), `Some(None)` all of it, `Some(Some((lo, hi)))` its
/// elements [lo, hi).
type RankPiece = Option<Option<(i64, i64)>>;

/// The squared global norm of `grads`: under ZeRO (`zero`, this rank)
/// the sum over the pieces this rank owns (`pieces`, by parameter), added
/// over the ranks (their mean times the ranks of one group: with hybrid
/// sharding every group holds each piece once, so the mean over all ranks
/// counts each `ranks / group` times and divides by `ranks`); else
/// [`sum_of_squares`] of every gradient.
fn owned_sum_of_squares(
    b: &mut Builder,
    grads: &[(usize, Value)],
    pieces: &[RankPiece],
    zero: Option<u32>,
    train: &TrainConfig,
    sharded: bool,
) -> Result<Option<Value>, OpError> {
    // Every gradient, the ones this rank owns nothing of as an empty piece:
    // the ranks' graphs then differ only in the pieces, so every rank runs
    // its collectives in the same order (NCCL's rule, and the CPU
    // reference's peers').
    // Under stage 2 (`sharded`) a gradient this rank owns nothing of is
    // not read at all: its whole tensor dies with its collective.
    let gvs: Vec<(Value, Option<(i64, i64)>)> = grads
        .iter()
        .filter(|&&(i, _)| !sharded || pieces[i].is_some())
        .map(|&(i, gv)| (gv, pieces[i].unwrap_or(Some((0, 0)))))
        .collect();
    if zero.is_none() {
        return sum_of_squares(b, &gvs);
    }
    let Some(local) = sum_of_squares(b, &gvs)? else {
        return Err(OpError::new(
            "ZeRO's gradient norm needs parameters of constant size",
            "a parameter has a symbolic shape",
        ));
    };
    let mean = b.op1(
        AllReduce {
            ranks: train.ranks,
            group: train.shard_group,
            every_micro_batch: false,
            owners_of: None,
            sharded: false,
            piece: None,
        },
        &[local],
    )?;
    let n = b.constant(train.shard_group as f64, DType::F32)?;
    Ok(Some(b.mul(mean, n)?))
}

/// `x` where `v` is `cast(x)` and `x` is of type `dtype`: the value before
/// a widening cast, which a narrower collective can average as it is.
fn narrowed_from(g: &Graph, v: Value, dtype: DType) -> Option<Value> {
    match &g.g[v.node].op {
        crate::ops::Op::Cast(_) => {
            let x = g.inputs(v.node)[0];
            (g.ty(x).dtype == dtype).then_some(x)
        }
        _ => None,
    }
}

pub fn add_update(g: &mut Graph, train: &TrainConfig) -> Result<(), OpError> {
    let grads: Vec<(usize, Value)> = g
        .outputs
        .iter()
        .filter_map(|(r, v)| {
            if let Role::Grad(i) = r {
                Some((*i, *v))
            } else {
                None
            }
        })
        .collect();
    let params: Vec<(String, TensorType, bool, Value)> = g
        .params
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                p.ty.clone(),
                p.decay,
                Value {
                    node: p.node,
                    port: 0,
                },
            )
        })
        .collect();
    // The loss scale the backward pass starts from (fp16 only).
    let loss_scale =
        g.g.node_indices()
            .find(|&n| matches!(&g.g[n].op, crate::ops::Op::Input(i) if i.name == LOSS_SCALE_INPUT))
            .map(|n| Value { node: n, port: 0 });
    let mut new_outputs = Vec::new();
    let mut b = Builder::new(g, None, Phase::Update);
    let scalar = TensorType::scalar(DType::F32);

    // ZeRO: what of each parameter this rank updates. Stage 2 reduces each
    // gradient into its owners' pieces, so a rank's gradient of a parameter
    // it owns a piece of is that piece alone, flat.
    // Stage 3 keeps each parameter as the rank's piece alone, so its
    // update always runs on a piece (all of the parameter, flat, where the
    // rank owns it whole).
    let zero = train.zero_rank.filter(|_| train.ranks > 1);
    let stage2 = zero.is_some() && train.zero_stage.shards_gradients();
    let stage3 = zero.is_some() && train.zero_stage == super::zero::ZeroStage::Three;
    let pieces: Vec<RankPiece> = (0..params.len())
        .map(|i| match zero {
            None => Some(None),
            Some(r) => {
                let all = &b.graph.params;
                super::zero::piece(all, train.shard_group, r, i).map(|pc| {
                    (stage3 || !super::zero::whole(&all[i], pc))
                        .then_some((pc.lo as i64, pc.hi as i64))
                })
            }
        })
        .collect();
    // The elements of each (reduced) gradient the update reads: under
    // stage 2 a piece is all of its own tensor.
    let read: Vec<RankPiece> = pieces
        .iter()
        .map(|&p| match p {
            Some(Some(_)) if stage2 => Some(None),
            p => p,
        })
        .collect();

    // Micro-batches: each run adds its gradient (already scaled by 1/k) to
    // an f32 accumulator; the optimizer reads the sum and applies it only on
    // the last micro-batch, which also clears the accumulator. Stage 2
    // reduces every micro-batch's gradient first and accumulates the
    // owners' pieces alone (DeepSpeed's ZeRO-2), so that no rank keeps a
    // whole gradient across micro-batches.
    let mut apply = None;
    let mut keep = None;
    if train.micro_batches > 1 {
        let a = b.op1(
            Input {
                name: APPLY_INPUT.into(),
                ty: scalar.clone(),
            },
            &[],
        )?;
        apply = Some(a);
        let one = b.constant(1.0, DType::F32)?;
        keep = Some(b.sub(one, a)?);
    }
    let grads = match keep {
        Some(keep) if !stage2 => accumulate(&mut b, &params, grads, keep, &mut new_outputs)?,
        _ => grads,
    };

    // Data parallel: each rank's gradient is of its own slice of the batch;
    // the update (and the norm, and fp16's overflow check) reads their mean
    // over the ranks, which is the gradient of the whole batch, so every
    // rank applies the same update. The loss is averaged the same way, for
    // the log. After the micro-batches' sum: one all-reduce per step.
    // With `reduce_dtype` bf16 the mean is taken of bf16 gradients, which
    // the norm and the optimizer read as they are (in f32 arithmetic): a
    // gradient a bf16 product made and then widened is averaged as it came
    // out of the product, any other is rounded first.
    //
    // ZeRO: a rank reads the mean of a gradient only on the piece of its
    // parameter it owns (the update and the norm), so each piece is
    // reduced to its owner alone; the squares of the pieces are summed on
    // their owners and the sums added over the ranks.
    let grads = if train.ranks > 1 {
        let mut reduced = Vec::with_capacity(grads.len());
        for (i, gv) in grads {
            let mean = AllReduce {
                ranks: train.ranks,
                group: train.shard_group,
                every_micro_batch: stage2 && keep.is_some(),
                owners_of: zero.map(|_| i),
                sharded: stage2,
                piece: pieces[i].flatten().filter(|_| stage2),
            };
            let r = if train.reduce_dtype == DType::F32 || b.ty(gv).dtype != DType::F32 {
                b.op1(mean.clone(), &[gv])?
            } else {
                let narrow = match narrowed_from(b.graph, gv, train.reduce_dtype) {
                    Some(x) => {
                        // The rank's gradient is kept as it came out, not
                        // also widened.
                        for (role, v) in b.graph.outputs.iter_mut() {
                            if *role == Role::Grad(i) && *v == gv {
                                *v = x;
                            }
                        }
                        x
                    }
                    None => b.cast(gv, train.reduce_dtype)?,
                };
                b.op1(mean.clone(), &[narrow])?
            };
            reduced.push((i, r));
        }
        reduced
    } else {
        grads
    };
    let grads = match keep {
        Some(keep) if stage2 => {
            // A parameter this rank owns nothing of keeps no sum.
            let mut all = Vec::with_capacity(grads.len());
            for (i, gv) in grads {
                if pieces[i].is_some() {
                    all.extend(accumulate(
                        &mut b,
                        &params,
                        vec![(i, gv)],
                        keep,
                        &mut new_outputs,
                    )?);
                } else {
                    all.push((i, gv));
                }
            }
            all
        }
        _ => grads,
    };
    let mut loss_mean = None;
    if train.ranks > 1 {
        if let Some(&(_, lv)) = b.graph.outputs.iter().find(|(r, _)| *r == Role::Loss) {
            // Each micro-batch reports its loss: a 4-byte collective each.
            let mean = AllReduce {
                ranks: train.ranks,
                group: train.shard_group,
                every_micro_batch: true,
                owners_of: None,
                sharded: false,
                piece: None,
            };
            loss_mean = Some(b.op1(mean, &[lv])?);
        }
    }

    // Squared global norm and the clip coefficient, which the optimizer ops
    // apply to the gradients as they read them (1 without clipping).
    let mut scale: Option<Value> = None;
    let fp16 = train.precision == DType::F16;
    if fp16 {
        let ls = loss_scale.ok_or_else(|| OpError::new("internal: no loss scale input", "fp16"))?;
        let ls = if crate::mutants::is(&crate::mutants::Mutant::Unscale) {
            b.constant(1.0, DType::F32)?
        } else {
            ls
        };
        let sumsq = owned_sum_of_squares(&mut b, &grads, &read, zero, train, stage2)?;
        if let Some(sumsq) = sumsq {
            let host_apply = match apply {
                Some(a) => a,
                None => b.constant(1.0, DType::F32)?,
            };
            let r = b.op(
                Unscale {
                    max_norm: train.clip_grad_norm.map(clip_mutant),
                },
                &[sumsq, ls, host_apply],
            )?;
            scale = Some(r[0]);
            apply = Some(r[1]);
            new_outputs.push((Role::GradNorm, r[2]));
        }
    } else if let Some(max_norm) = train.clip_grad_norm {
        let mut sumsq = owned_sum_of_squares(&mut b, &grads, &read, zero, train, stage2)?;
        // Tensors of symbolic size: one square-and-sum per gradient.
        let per_tensor = if sumsq.is_none() { &grads[..] } else { &[] };
        for &(_, gv) in per_tensor {
            let gv = if b.ty(gv).dtype == DType::F32 {
                gv
            } else {
                b.cast(gv, DType::F32)?
            };
            let sq = b.mul(gv, gv)?;
            let rank = b.ty(sq).rank();
            let s = b.sum(sq, (0..rank).collect(), false)?;
            sumsq = Some(match sumsq {
                Some(acc) => b.add(acc, s)?,
                None => s,
            });
        }
        if let Some(sumsq) = sumsq {
            let norm = b.unary(UnaryKind::Sqrt, sumsq)?;
            new_outputs.push((Role::GradNorm, norm));
            let max_norm = clip_mutant(max_norm);
            scale = Some(b.op1(ClipCoef { max_norm }, &[sumsq])?);
        }
    }

    let lr = b.op1(
        Input {
            name: LR_INPUT.into(),
            ty: scalar.clone(),
        },
        &[],
    )?;
    let step = match train.optimizer {
        Optimizer::AdamW { .. } => Some(b.op1(
            Input {
                name: STEP_INPUT.into(),
                ty: scalar.clone(),
            },
            &[],
        )?),
        Optimizer::Sgd { .. } => None,
    };
    let step = match step {
        Some(t) if crate::mutants::is(&crate::mutants::Mutant::BiasCorrection) => {
            let one = b.constant(1.0, DType::F32)?;
            Some(b.add(t, one)?)
        }
        _ => step,
    };
    let scale = match scale {
        Some(s) => s,
        None => b.constant(1.0, DType::F32)?,
    };
    // ZeRO stage 1: this rank updates (and keeps the state of) its own
    // piece of each parameter alone; the other pieces' new values arrive
    // from their owners after the step. With a 16-bit compute dtype the
    // ranks keep the parameter in it (the forward pass reads it as it is,
    // no cast) and the owner the f32 master of its piece, as state.
    // Stage 3 keeps no master: the rank's piece, in the model's dtype, is
    // the parameter it updates, and the pieces are gathered in the compute
    // dtype where the passes read them (`gather::gather_params`).
    let masters: Vec<bool> = (0..params.len())
        .map(|i| {
            zero.is_some() && !stage3 && super::zero::keeps_master(b.graph, i, train.precision)
        })
        .collect();
    for (i, &m) in masters.iter().enumerate() {
        if m {
            super::zero::store_param_as(b.graph, i, train.precision);
        }
    }
    if let (true, Some(rank)) = (stage3, zero) {
        super::gather::gather_params(b.graph, train.shard_group, rank, train.precision)?;
    }
    for (i, gv) in grads {
        let Some(range) = pieces[i] else {
            continue;
        };
        let (name, ty, decay, pv) = &params[i];
        let state_ty = match range {
            Some((lo, hi)) => TensorType::new(ty.dtype, vec![crate::ir::Dim::constant(hi - lo)]),
            None => ty.clone(),
        };
        let decay = *decay != crate::mutants::is(&crate::mutants::Mutant::DecaySet);
        let wd = |w: f64| if decay { w } else { 0.0 };
        let master = masters[i];
        // The value the update reads and writes: the parameter, or its
        // master piece.
        let mn = super::zero::master_name(name);
        let first = if master {
            b.op1(
                State {
                    name: mn.clone(),
                    ty: state_ty.clone(),
                },
                &[],
            )?
        } else {
            *pv
        };
        let mut updated = |b: &mut Builder, r: Value| -> Result<(), OpError> {
            if !master {
                new_outputs.push((Role::NewParam(i), r));
                return Ok(());
            }
            let whole = ty.numel().as_const().ok_or_else(|| {
                OpError::new(
                    "ZeRO's master weights need parameters of constant size",
                    format!("`{name}` is {ty}"),
                )
            })?;
            let w = b.op1(
                StorePiece {
                    range: range.unwrap_or((0, whole)),
                },
                &[*pv, r],
            )?;
            new_outputs.push((Role::NewState(mn.clone()), r));
            new_outputs.push((Role::NewParam(i), w));
            Ok(())
        };
        match train.optimizer {
            Optimizer::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                let (mn, vn) = (format!("{name}.adam_m"), format!("{name}.adam_v"));
                let m = b.op1(
                    State {
                        name: mn.clone(),
                        ty: state_ty.clone(),
                    },
                    &[],
                )?;
                let v = b.op1(
                    State {
                        name: vn.clone(),
                        ty: state_ty.clone(),
                    },
                    &[],
                )?;
                let op = AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay: wd(weight_decay),
                    range,
                    master: master || stage3,
                    grad_piece: stage2 && range.is_some(),
                };
                let step = step.expect("AdamW has a step input");
                let mut ins = vec![first, gv, m, v, lr, step, scale];
                ins.extend(apply);
                let r = b.op(op, &ins)?;
                updated(&mut b, r[0])?;
                new_outputs.push((Role::NewState(mn), r[1]));
                new_outputs.push((Role::NewState(vn), r[2]));
            }
            Optimizer::Sgd {
                momentum,
                weight_decay,
                ..
            } => {
                let bn = format!("{name}.momentum");
                let buf = b.op1(
                    State {
                        name: bn.clone(),
                        ty: state_ty.clone(),
                    },
                    &[],
                )?;
                let mut ins = vec![first, gv, buf, lr, scale];
                ins.extend(apply);
                let r = b.op(
                    Sgd {
                        momentum,
                        weight_decay: wd(weight_decay),
                        range,
                        master: master || stage3,
                        grad_piece: stage2 && range.is_some(),
                    },
                    &ins,
                )?;
                updated(&mut b, r[0])?;
                new_outputs.push((Role::NewState(bn), r[1]));
            }
        }
    }
    if let Some(mean) = loss_mean {
        for (role, v) in g.outputs.iter_mut() {
            if *role == Role::Loss {
                *v = mean;
            }
        }
    }
    g.outputs.extend(new_outputs);
    if stage2 {
        // The whole gradients are the backward pass's temporaries: no rank
        // keeps one past its collective.
        g.outputs.retain(|(r, _)| !matches!(r, Role::Grad(_)));
    }
    Ok(())
}

/// Micro-batches: each gradient added to its f32 accumulator (state
/// `{param}.grad_acc`, shaped as the gradient: a piece under ZeRO stage
/// 2), which the last micro-batch (`keep` 0) clears; returns the sums.
fn accumulate(
    b: &mut Builder,
    params: &[(String, TensorType, bool, Value)],
    grads: Vec<(usize, Value)>,
    keep: Value,
    new_outputs: &mut Vec<(Role, Value)>,
) -> Result<Vec<(usize, Value)>, OpError> {
    let mut summed = Vec::with_capacity(grads.len());
    for (i, gv) in grads {
        let name = format!("{}.grad_acc", params[i].0);
        let ty = TensorType::new(DType::F32, b.ty(gv).shape.clone());
        let acc = b.op1(
            State {
                name: name.clone(),
                ty,
            },
            &[],
        )?;
        let gv32 = b.cast(gv, DType::F32)?;
        let total = b.add(acc, gv32)?;
        // Cleared after the last micro-batch, even when an fp16
        // overflow made the sums infinite (inf * 0 would be NaN).
        let next = b.binary(crate::ops::BinaryKind::KeepIf, total, keep)?;
        new_outputs.push((Role::NewState(name), next));
        summed.push((i, total));
    }
    Ok(summed)
}
