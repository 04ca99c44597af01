//! Scaled dot-product attention as one op each way. Heads stay in the
//! feature-innermost layout the projections produce: q [B, T, Hq, D],
//! k and v [B, S, Hkv, D] with Hq a multiple of Hkv (grouped-query heads).
//! The forward also returns the per-row log-sum-exp [B, Hq, T] in f32, which
//! the backward uses to recompute probabilities instead of storing them.
//! With `lengths`, an input i32 [B] after those says how many keys each batch entry
//! has: keys at or after it are padding, invisible to every query (a
//! key-padding mask as lengths, the way padded batches are laid out).
//! With `dropout`, the step's dropout key comes last: each probability is
//! kept and scaled by 1 over the share kept (about 1 / (1 - p)), or zeroed, by a Philox draw of its
//! (batch, head, query, key) entry (`philox::attention_draw`), which the
//! backward draws again; the log-sum-exp is that of the undropped row.

use super::philox;
use super::*;
use crate::ir::print::num;
use rayon::prelude::*;

#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    pub causal: bool,
    pub scale: f64,
    /// Input 3 holds each batch entry's number of keys.
    pub lengths: bool,
    /// Dropout on the probabilities; the step's key is the last input.
    pub dropout: Option<AttnDropout>,
}

/// Inputs (q, k, v, o, lse, dO), with `lengths` the key lengths, with
/// `dropout` the step's key. Outputs dq, dk, dv; or, `packed`
/// (self-attention, T = S), one tensor [B, T, Hq D + Hkv D + Hkv Dv] whose
/// rows hold dq's, dk's and dv's features side by side: the gradient of a
/// fused QKV projection's output, which the kernels then write in place
/// of a concatenation (`passes::PackAttentionGrads`).
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionGrad {
    pub causal: bool,
    pub scale: f64,
    pub lengths: bool,
    pub dropout: Option<AttnDropout>,
    pub packed: bool,
}

/// Dropout of attention probabilities: share `p` dropped, masks drawn at
/// dropout site `site` (a site of its own, like every `dropout` call's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDropout {
    pub p: f64,
    pub site: u32,
}

impl AttnDropout {
    /// 8-bit draws below this are dropped.
    pub fn threshold(&self) -> u32 {
        philox::attention_threshold(self.p)
    }
    /// What a kept probability is multiplied by: 1 over the share kept.
    pub fn scale(&self) -> f64 {
        philox::attention_scale(self.p)
    }
}

fn attrs(causal: bool, scale: f64, lengths: bool, dropout: Option<AttnDropout>) -> Vec<String> {
    let mut v = vec![format!("causal={causal}"), format!("scale={}", num(scale))];
    if lengths {
        v.push("lengths".into());
    }
    if let Some(d) = dropout {
        v.push(format!("dropout={}", num(d.p)));
        v.push(format!("site={}", d.site));
    }
    v
}

/// The dropout's probability is in [0, 1).
fn check_p(op: &str, dropout: Option<AttnDropout>) -> Result<(), OpError> {
    match dropout {
        Some(d) if !(0.0..1.0).contains(&d.p) => Err(OpError::new(
            format!("`{op}` needs a dropout probability from 0 up to (not including) 1"),
            format!("found {}", num(d.p)),
        )),
        _ => Ok(()),
    }
}

/// The slots of the optional inputs after the `first` fixed ones: the
/// lengths, then the step's key.
fn slots(
    first: usize,
    lengths: bool,
    dropout: Option<AttnDropout>,
) -> (Option<usize>, Option<usize>) {
    let key = first + lengths as usize;
    (lengths.then_some(first), dropout.map(|_| key))
}

impl Attention {
    /// The input slots of the key lengths and of the step's dropout key.
    pub fn extra_slots(&self) -> (Option<usize>, Option<usize>) {
        slots(3, self.lengths, self.dropout)
    }
}

impl AttentionGrad {
    /// The input slots of the key lengths and of the step's dropout key.
    pub fn extra_slots(&self) -> (Option<usize>, Option<usize>) {
        slots(6, self.lengths, self.dropout)
    }
}

/// Where a packed gradient's rows hold dq, dk and dv (`AttentionGrad`'s
/// `packed`) for q, k, v of these types: each one's first feature, and the
/// row's width Hq D + Hkv D + Hkv Dv. `None` where the sizes do not
/// multiply out (never for types `check` accepts).
pub fn packed_layout(q: &TensorType, k: &TensorType, v: &TensorType) -> Option<([Dim; 3], Dim)> {
    let dq = q.shape[2].checked_mul(&q.shape[3])?;
    let dk = k.shape[2].checked_mul(&k.shape[3])?;
    let dv = v.shape[2].checked_mul(&v.shape[3])?;
    let kv = dq.checked_add(&dk)?;
    let width = kv.checked_add(&dv)?;
    Some(([Dim::constant(0), dq, kv], width))
}

/// The mask of one attention op, or none: keeps(b, h, i, j) for query
/// row i and key j of head h of batch entry b.
struct Mask {
    key: [u32; 2],
    drop: AttnDropout,
    hq: usize,
}

impl Mask {
    fn of(drop: Option<AttnDropout>, key: Option<&Tensor>, hq: usize) -> Option<Mask> {
        let (drop, key) = (drop?, key?);
        Some(Mask {
            key: super::dropout::key_words(key),
            drop,
            hq,
        })
    }
    /// The factor on probability (b, h, i, j): 0 or 1 over the share kept.
    fn factor(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        let bh = (b * self.hq + h) as u64;
        if philox::attention_draw(self.key, self.drop.site, bh, i as u64, j as u64)
            >= self.drop.threshold()
        {
            self.drop.scale()
        } else {
            0.0
        }
    }
}

fn factor(mask: Option<&Mask>, b: usize, h: usize, i: usize, j: usize) -> f64 {
    mask.map_or(1.0, |m| m.factor(b, h, i, j))
}

/// The key lengths' type: i32 [B], B the batch of q.
fn check_lengths(op: &str, q: &TensorType, lens: &TensorType, arg: usize) -> Result<(), OpError> {
    if lens.dtype != DType::I32 || lens.rank() != 1 || lens.shape[0] != q.shape[0] {
        return Err(OpError::new(
            format!("`{op}` takes the keys' lengths as i32 [B], one per batch entry"),
            format!("q is {q}, the lengths {lens}"),
        )
        .at(arg));
    }
    Ok(())
}

/// Batch entry b's visible keys: all `s`, or its length (clamped to 0..s).
fn keys_of(lens: Option<&Tensor>, b: usize, s: usize) -> usize {
    lens.map_or(s, |l| (l.data[b].max(0.0) as usize).min(s))
}

fn check(op: &str, q: &TensorType, k: &TensorType, v: &TensorType) -> Result<(), OpError> {
    for (i, t) in [q, k, v].into_iter().enumerate() {
        expect_float(op, t, i)?;
        if t.rank() != 4 {
            return Err(OpError::new(
                format!("`{op}` needs heads laid out as [B, T, H, D]"),
                format!("argument {} is {t}", i + 1),
            )
            .at(i)
            .help("split the features into heads first: heads(x, H)"));
        }
    }
    expect_same_dtype(op, q, k)?;
    expect_same_dtype(op, q, v)?;
    dims_equal(op, "batch of q and k", &q.shape[0], &k.shape[0])?;
    dims_equal(op, "batch of k and v", &k.shape[0], &v.shape[0])?;
    dims_equal(op, "sequence of k and v", &k.shape[1], &v.shape[1])?;
    dims_equal(op, "heads of k and v", &k.shape[2], &v.shape[2])?;
    dims_equal(op, "head dim of q and k", &q.shape[3], &k.shape[3])?;
    let (hq, hk) = (&q.shape[2], &k.shape[2]);
    match (hq.as_const(), hk.as_const()) {
        (Some(a), Some(b)) if b > 0 && a % b == 0 => Ok(()),
        _ => Err(OpError::new(
            format!("`{op}`: query heads must be a multiple of key/value heads"),
            format!("{hq} query heads, {hk} key/value heads"),
        )),
    }
}

struct Dims {
    b: usize,
    t: usize,
    s: usize,
    hq: usize,
    hk: usize,
    d: usize,
    dv: usize,
}

impl Dims {
    fn of(q: &Tensor, k: &Tensor, v: &Tensor) -> Dims {
        Dims {
            b: q.shape[0],
            t: q.shape[1],
            s: k.shape[1],
            hq: q.shape[2],
            hk: k.shape[2],
            d: q.shape[3],
            dv: v.shape[3],
        }
    }
    fn q(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.t + i) * self.hq + h) * self.d
    }
    fn k(&self, b: usize, j: usize, h: usize) -> usize {
        ((b * self.s + j) * self.hk + h / (self.hq / self.hk)) * self.d
    }
    fn v(&self, b: usize, j: usize, h: usize) -> usize {
        ((b * self.s + j) * self.hk + h / (self.hq / self.hk)) * self.dv
    }
    fn o(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.t + i) * self.hq + h) * self.dv
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Scores of one query row against every key (masked entries are -inf).
#[allow(clippy::too_many_arguments)]
fn scores(
    a: &Attention,
    m: &Dims,
    q: &Tensor,
    k: &Tensor,
    lens: Option<&Tensor>,
    b: usize,
    i: usize,
    h: usize,
) -> Vec<f64> {
    let qr = &q.data[m.q(b, i, h)..m.q(b, i, h) + m.d];
    let keys = keys_of(lens, b, m.s);
    (0..m.s)
        .map(|j| {
            if (a.causal && j > i) || j >= keys {
                f64::NEG_INFINITY
            } else {
                a.scale * dot(qr, &k.data[m.k(b, j, h)..m.k(b, j, h) + m.d])
            }
        })
        .collect()
}

impl OpDef for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }
    fn attrs(&self) -> Vec<String> {
        attrs(self.causal, self.scale, self.lengths, self.dropout)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        let (lengths, key) = self.extra_slots();
        expect_arity(
            "attention",
            inputs,
            3 + self.lengths as usize + key.is_some() as usize,
        )?;
        let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
        check("attention", q, k, v)?;
        if let Some(l) = lengths {
            check_lengths("attention", q, &inputs[l], l)?;
        }
        if let Some(k) = key {
            super::dropout::check_key("attention", &inputs[k], k)?;
        }
        check_p("attention", self.dropout)?;
        let out = vec![
            q.shape[0].clone(),
            q.shape[1].clone(),
            q.shape[2].clone(),
            v.shape[3].clone(),
        ];
        let lse = vec![q.shape[0].clone(), q.shape[2].clone(), q.shape[1].clone()];
        Ok(vec![
            TensorType::new(q.dtype, out),
            TensorType::new(DType::F32, lse),
        ])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let (lengths, key) = self.extra_slots();
        let lens = lengths.map(|l| inputs[l]);
        let m = Dims::of(q, k, v);
        let mask = Mask::of(self.dropout, key.map(|k| inputs[k]), m.hq);
        // Every (batch, head, query) row on its own, on every core.
        let rows: Vec<(Vec<f64>, f64)> = (0..m.b * m.hq * m.t)
            .into_par_iter()
            .map(|r| {
                let (b, h, i) = (r / (m.hq * m.t), r / m.t % m.hq, r % m.t);
                let s = scores(self, &m, q, k, lens, b, i, h);
                let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if mx == f64::NEG_INFINITY {
                    // No visible key: output 0 and lse -inf, as the kernels give.
                    return (vec![0.0; m.dv], f64::NEG_INFINITY);
                }
                let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                let mut o = vec![0.0; m.dv];
                for (j, sj) in s.iter().enumerate() {
                    let p = (sj - mx).exp() / sum * factor(mask.as_ref(), b, h, i, j);
                    if p == 0.0 {
                        continue;
                    }
                    let vr = m.v(b, j, h);
                    for (c, x) in o.iter_mut().enumerate() {
                        *x += p * v.data[vr + c];
                    }
                }
                (o, mx + sum.ln())
            })
            .collect();
        let mut out = vec![0.0; m.b * m.t * m.hq * m.dv];
        let mut lse = vec![0.0; m.b * m.hq * m.t];
        for (r, (o, l)) in rows.into_iter().enumerate() {
            let (b, h, i) = (r / (m.hq * m.t), r / m.t % m.hq, r % m.t);
            lse[r] = l;
            out[m.o(b, i, h)..m.o(b, i, h) + m.dv].copy_from_slice(&o);
        }
        vec![
            Tensor::new(vec![m.b, m.t, m.hq, m.dv], out),
            Tensor::new(vec![m.b, m.hq, m.t], lse),
        ]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        outputs: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(dout) = douts[0] else {
            return Ok(vec![None; inputs.len()]);
        };
        let grad = AttentionGrad {
            causal: self.causal,
            scale: self.scale,
            lengths: self.lengths,
            dropout: self.dropout,
            packed: false,
        };
        let mut ins = vec![
            inputs[0], inputs[1], inputs[2], outputs[0], outputs[1], dout,
        ];
        // The lengths and the key, as the forward has them.
        ins.extend(&inputs[3..]);
        let r = b.op(grad, &ins)?;
        let mut out = vec![Some(r[0]), Some(r[1]), Some(r[2])];
        // The lengths and the key take no gradient.
        out.extend(inputs[3..].iter().map(|_| None));
        Ok(out)
    }
}

impl OpDef for AttentionGrad {
    fn name(&self) -> &'static str {
        "attention_grad"
    }
    fn attrs(&self) -> Vec<String> {
        let mut v = attrs(self.causal, self.scale, self.lengths, self.dropout);
        if self.packed {
            v.push("packed".into());
        }
        v
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        let (lengths, key) = self.extra_slots();
        expect_arity(
            "attention_grad",
            inputs,
            6 + self.lengths as usize + key.is_some() as usize,
        )?;
        check("attention_grad", &inputs[0], &inputs[1], &inputs[2])?;
        if let Some(l) = lengths {
            check_lengths("attention_grad", &inputs[0], &inputs[l], l)?;
        }
        if let Some(k) = key {
            super::dropout::check_key("attention_grad", &inputs[k], k)?;
        }
        check_p("attention_grad", self.dropout)?;
        let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
        if !self.packed {
            return Ok(vec![q.clone(), k.clone(), v.clone()]);
        }
        dims_equal(
            "attention_grad",
            "sequence of q and k (packed)",
            &q.shape[1],
            &k.shape[1],
        )?;
        let (_, width) = packed_layout(q, k, v).ok_or_else(|| {
            OpError::new(
                "`attention_grad`: a packed gradient's width does not multiply out",
                format!("q {q}, k {k}, v {v}"),
            )
        })?;
        Ok(vec![TensorType::new(
            q.dtype,
            vec![q.shape[0].clone(), q.shape[1].clone(), width],
        )])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (q, k, v, o, lse, dout) = (
            inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
        );
        let (lengths, key) = self.extra_slots();
        let lens = lengths.map(|l| inputs[l]);
        let m = Dims::of(q, k, v);
        let mask = Mask::of(self.dropout, key.map(|k| inputs[k]), m.hq);
        let fwd = Attention {
            causal: self.causal,
            scale: self.scale,
            lengths: self.lengths,
            dropout: None,
        };
        // With P = exp(S - lse), delta_i = rowsum(dO_i * O_i) (the
        // FlashAttention-2 shortcut) and dS = P (dO V^T - delta) scale: dQ row
        // by row over the keys, then dK and dV row by row over the queries of
        // the key's group, each row on its own, on every core. With dropout
        // (Z the mask's factors, O = (P Z) V): dV = (P Z)^T dO and
        // dS = P (Z dO V^T - delta) scale, delta still rowsum(dO * O).
        let delta: Vec<f64> = (0..m.b * m.hq * m.t)
            .into_par_iter()
            .map(|r| {
                let (b, h, i) = (r / (m.hq * m.t), r / m.t % m.hq, r % m.t);
                let oi = m.o(b, i, h);
                dot(&dout.data[oi..oi + m.dv], &o.data[oi..oi + m.dv])
            })
            .collect();
        let row = |b: usize, h: usize, i: usize| (b * m.hq + h) * m.t + i;
        // (p z, ds) of query i of head h and key j.
        let p_ds = |b: usize, h: usize, i: usize, j: usize, s: f64| -> (f64, f64) {
            let p = (s - lse.data[row(b, h, i)]).exp();
            let z = factor(mask.as_ref(), b, h, i, j);
            let oi = m.o(b, i, h);
            let vj = m.v(b, j, h);
            let dp = dot(&dout.data[oi..oi + m.dv], &v.data[vj..vj + m.dv]);
            (p * z, p * (z * dp - delta[row(b, h, i)]) * self.scale)
        };
        let dq_rows: Vec<Vec<f64>> = (0..m.b * m.hq * m.t)
            .into_par_iter()
            .map(|r| {
                let (b, h, i) = (r / (m.hq * m.t), r / m.t % m.hq, r % m.t);
                let mut dqi = vec![0.0; m.d];
                for (j, sj) in scores(&fwd, &m, q, k, lens, b, i, h)
                    .into_iter()
                    .enumerate()
                {
                    // A masked key (a row with no visible key has lse -inf:
                    // its p would be NaN) takes no part.
                    if sj == f64::NEG_INFINITY {
                        continue;
                    }
                    let (_, ds) = p_ds(b, h, i, j, sj);
                    if ds == 0.0 {
                        continue;
                    }
                    let kj = m.k(b, j, h);
                    for (c, x) in dqi.iter_mut().enumerate() {
                        *x += ds * k.data[kj + c];
                    }
                }
                dqi
            })
            .collect();
        let group = m.hq / m.hk;
        let kv_rows: Vec<(Vec<f64>, Vec<f64>)> = (0..m.b * m.hk * m.s)
            .into_par_iter()
            .map(|r| {
                let (b, hk, j) = (r / (m.hk * m.s), r / m.s % m.hk, r % m.s);
                let (mut dkj, mut dvj) = (vec![0.0; m.d], vec![0.0; m.dv]);
                if j >= keys_of(lens, b, m.s) {
                    // A padded key: no query sees it.
                    return (dkj, dvj);
                }
                for h in hk * group..(hk + 1) * group {
                    let kj = m.k(b, j, h);
                    for i in 0..m.t {
                        if self.causal && j > i {
                            continue;
                        }
                        let qi = m.q(b, i, h);
                        let s = self.scale * dot(&q.data[qi..qi + m.d], &k.data[kj..kj + m.d]);
                        // A dropped probability adds nothing to dV but
                        // still takes part in dS (through delta).
                        let (p, ds) = p_ds(b, h, i, j, s);
                        if p == 0.0 && ds == 0.0 {
                            continue;
                        }
                        let oi = m.o(b, i, h);
                        for (c, x) in dvj.iter_mut().enumerate() {
                            *x += p * dout.data[oi + c];
                        }
                        for (c, x) in dkj.iter_mut().enumerate() {
                            *x += ds * q.data[qi + c];
                        }
                    }
                }
                (dkj, dvj)
            })
            .collect();
        let mut dq = vec![0.0; q.len()];
        for (r, x) in dq_rows.into_iter().enumerate() {
            let (b, h, i) = (r / (m.hq * m.t), r / m.t % m.hq, r % m.t);
            dq[m.q(b, i, h)..m.q(b, i, h) + m.d].copy_from_slice(&x);
        }
        let (mut dk, mut dv) = (vec![0.0; k.len()], vec![0.0; v.len()]);
        for (r, (x, y)) in kv_rows.into_iter().enumerate() {
            let (b, hk, j) = (r / (m.hk * m.s), r / m.s % m.hk, r % m.s);
            let (kj, vj) = (m.k(b, j, hk * group), m.v(b, j, hk * group));
            dk[kj..kj + m.d].copy_from_slice(&x);
            dv[vj..vj + m.dv].copy_from_slice(&y);
        }
        if !self.packed {
            return vec![
                Tensor::new(q.shape.clone(), dq),
                Tensor::new(k.shape.clone(), dk),
                Tensor::new(v.shape.clone(), dv),
            ];
        }
        // Row (b, t): dq's Hq D features, then dk's Hkv D, then dv's Hkv Dv.
        let (wq, wk, wv) = (m.hq * m.d, m.hk * m.d, m.hk * m.dv);
        let width = wq + wk + wv;
        let mut out = Vec::with_capacity(m.b * m.t * width);
        for r in 0..m.b * m.t {
            out.extend_from_slice(&dq[r * wq..(r + 1) * wq]);
            out.extend_from_slice(&dk[r * wk..(r + 1) * wk]);
            out.extend_from_slice(&dv[r * wv..(r + 1) * wv]);
        }
        vec![Tensor::new(vec![m.b, m.t, width], out)]
    }
}
