//! The ops of a decode step (`driver::decode_graph`): a language model run
//! a few positions at a time against a key/value cache, as generation
//! does. `positions` (i32 [S]) holds the position of each of the step's
//! S rows; the cache [B, C, H, D] holds every key (or value) written so
//! far, at its position. Neither op has a gradient: a decode step is
//! never differentiated.

use super::*;
use crate::ir::print::num;
use rayon::prelude::*;

fn expect_heads(op: &str, t: &TensorType, arg: usize) -> Result<(), OpError> {
    if t.rank() != 4 {
        return Err(OpError::new(
            format!("`{op}` needs heads laid out as [B, T, H, D]"),
            format!("found {t}"),
        )
        .at(arg));
    }
    Ok(())
}

/// Positions: i32 [S], S the rows of the tensor at `arg`'s axis 1.
fn expect_positions(op: &str, p: &TensorType, rows: &Dim, arg: usize) -> Result<(), OpError> {
    expect_int(op, p, arg)?;
    if p.rank() != 1 || &p.shape[0] != rows {
        return Err(OpError::new(
            format!("`{op}` needs one position a row, i32 [{rows}]"),
            format!("found {p}"),
        )
        .at(arg));
    }
    Ok(())
}

/// Writes `new` [B, S, H, D] into rows `positions[s]` of `cache`
/// [B, C, H, D]; its output is the cache after the write. A step's plan
/// gives that output the cache's own storage (it is the cache state's new
/// value), so the kernel writes the S new rows alone. A position outside
/// 0..C writes nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct KvWrite;

impl OpDef for KvWrite {
    fn name(&self) -> &'static str {
        "kv_write"
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("kv_write", inputs, 3)?;
        let (cache, new, pos) = (&inputs[0], &inputs[1], &inputs[2]);
        expect_float("kv_write", cache, 0)?;
        expect_heads("kv_write", cache, 0)?;
        expect_heads("kv_write", new, 1)?;
        expect_same_dtype("kv_write", cache, new)?;
        for axis in [0, 2, 3] {
            dims_equal(
                "kv_write",
                "the cache and the new rows",
                &cache.shape[axis],
                &new.shape[axis],
            )?;
        }
        expect_positions("kv_write", pos, &new.shape[1], 2)?;
        Ok(vec![cache.clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (cache, new, pos) = (inputs[0], inputs[1], inputs[2]);
        let [b, c, h, d] = cache.shape[..] else {
            unreachable!("kv_write's shape rule checked the rank")
        };
        let s = new.shape[1];
        let mut out = cache.data.clone();
        for bi in 0..b {
            for (si, &p) in pos.data.iter().enumerate() {
                if p < 0.0 || p as usize >= c {
                    continue;
                }
                let row = h * d;
                let to = (bi * c + p as usize) * row;
                let from = (bi * s + si) * row;
                out[to..to + row].copy_from_slice(&new.data[from..from + row]);
            }
        }
        vec![Tensor::new(cache.shape.clone(), out)]
    }
}

/// Attention of the step's queries q [B, S, Hq, D] over the cache's keys
/// [B, C, Hkv, D] and values [B, C, Hkv, Dv]: row s sees the keys at
/// positions 0 to `positions[s]` (causal attention, S rows at a time).
/// Query head h reads cache head h / (Hq / Hkv).
#[derive(Clone, Debug, PartialEq)]
pub struct CachedAttention {
    pub scale: f64,
}

impl OpDef for CachedAttention {
    fn name(&self) -> &'static str {
        "cached_attention"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("scale={}", num(self.scale))]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        let op = "cached_attention";
        expect_arity(op, inputs, 4)?;
        let (q, k, v, pos) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3]);
        for (i, t) in [q, k, v].into_iter().enumerate() {
            expect_float(op, t, i)?;
            expect_heads(op, t, i)?;
        }
        expect_same_dtype(op, q, k)?;
        expect_same_dtype(op, k, v)?;
        dims_equal(op, "the batch of q and the cache", &q.shape[0], &k.shape[0])?;
        dims_equal(op, "the head size of q and k", &q.shape[3], &k.shape[3])?;
        for axis in [0, 1, 2] {
            dims_equal(
                op,
                "the key and value caches",
                &k.shape[axis],
                &v.shape[axis],
            )?;
        }
        let grouped = match (q.shape[2].as_const(), k.shape[2].as_const()) {
            (Some(hq), Some(hk)) => hk > 0 && hq % hk == 0,
            _ => q.shape[2] == k.shape[2],
        };
        if !grouped {
            return Err(OpError::new(
                "`cached_attention` needs the query heads to be a multiple of the cache's heads",
                format!("{} query heads, {} cache heads", q.shape[2], k.shape[2]),
            ));
        }
        expect_positions(op, pos, &q.shape[1], 3)?;
        let mut shape = q.shape.clone();
        shape[3] = v.shape[3].clone();
        Ok(vec![TensorType::new(q.dtype, shape)])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (q, k, v, pos) = (inputs[0], inputs[1], inputs[2], inputs[3]);
        let [b, s, hq, d] = q.shape[..] else {
            unreachable!("the shape rule checked the rank")
        };
        let [_, c, hk, _] = k.shape[..] else {
            unreachable!("the shape rule checked the rank")
        };
        let dv = v.shape[3];
        let group = hq / hk;
        let rows: Vec<Vec<f64>> = (0..b * s * hq)
            .into_par_iter()
            .map(|r| {
                let (bi, si, h) = (r / (s * hq), r / hq % s, r % hq);
                let p = pos.data[si];
                let keys = if p < 0.0 { 0 } else { (p as usize + 1).min(c) };
                let qr = &q.data[r * d..(r + 1) * d];
                let at = |j: usize| (bi * c + j) * hk + h / group;
                let scores: Vec<f64> = (0..keys)
                    .map(|j| {
                        let kr = &k.data[at(j) * d..(at(j) + 1) * d];
                        qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() * self.scale
                    })
                    .collect();
                let mut o = vec![0.0; dv];
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if keys == 0 {
                    return o;
                }
                let sum: f64 = scores.iter().map(|x| (x - mx).exp()).sum();
                for (j, sj) in scores.iter().enumerate() {
                    let p = (sj - mx).exp() / sum;
                    let vr = &v.data[at(j) * dv..(at(j) + 1) * dv];
                    for (x, y) in o.iter_mut().zip(vr) {
                        *x += p * y;
                    }
                }
                o
            })
            .collect();
        let mut shape = q.shape.clone();
        shape[3] = dv;
        vec![Tensor::new(shape, rows.concat())]
    }
}

/// The index of the largest of the first `classes` entries along the last
/// axis of x [..., N] (i32 [...]): greedy decoding's pick, made on the
/// device so that a step returns B token ids instead of B x N logits. The
/// first index wins a tie and a NaN is never the largest (0 where all
/// are), as the host's greedy pick has them.
#[derive(Clone, Debug, PartialEq)]
pub struct ArgMax {
    pub classes: i64,
}

impl OpDef for ArgMax {
    fn name(&self) -> &'static str {
        "argmax"
    }
    fn attrs(&self) -> Vec<String> {
        vec![format!("classes={}", self.classes)]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("argmax", inputs, 1)?;
        let x = &inputs[0];
        expect_float("argmax", x, 0)?;
        let Some(n) = x.shape.last() else {
            return Err(OpError::new(
                "`argmax` picks along the last axis, and a scalar has none",
                format!("found {x}"),
            ));
        };
        if self.classes < 1 || n.as_const().is_some_and(|n| self.classes > n) {
            return Err(OpError::new(
                "`argmax` picks among 1 to N classes of the last axis",
                format!("classes={} of {x}", self.classes),
            ));
        }
        let shape = x.shape[..x.rank() - 1].to_vec();
        Ok(vec![TensorType::new(DType::I32, shape)])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let x = inputs[0];
        let n = *x
            .shape
            .last()
            .expect("argmax's shape rule checked the rank");
        let picks = x
            .data
            .chunks(n.max(1))
            .map(|row| {
                // Strictly larger: the first of equals stays.
                let mut best: Option<(usize, f64)> = None;
                for (j, &v) in super::nn::classes_of(row, Some(self.classes))
                    .iter()
                    .enumerate()
                {
                    if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                        best = Some((j, v));
                    }
                }
                best.map_or(0.0, |(j, _)| j as f64)
            })
            .collect();
        vec![Tensor::new(x.shape[..x.shape.len() - 1].to_vec(), picks)]
    }
}
