//! Optimizer updates, one op per parameter, written as PyTorch defines them
//! (torch.optim.AdamW, torch.optim.SGD with dampening 0) so that losses can
//! be compared step for step.

use super::*;
use crate::ir::print::num;

#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// ZeRO stage 1: only elements [lo, hi) of the parameter are updated
    /// (this rank's piece), and the state holds just those, flat.
    pub range: Option<(i64, i64)>,
    /// ZeRO with a 16-bit compute dtype: input and output 0 are this rank's
    /// f32 master copy of its piece (shaped as the state), not the
    /// parameter, which the ranks keep in the compute dtype alone
    /// ([`StorePiece`] writes the new piece into it); under stage 3,
    /// the rank's piece of the parameter itself, which it keeps alone.
    pub master: bool,
    /// ZeRO stage 2: input 1 is the gradient's piece alone (flat, shaped
    /// as the state: the collective reduced it into a buffer of that
    /// size), not the whole parameter's gradient.
    pub grad_piece: bool,
}

/// The state's shape for parameter type `p` under `range`.
fn state_type(p: &TensorType, range: Option<(i64, i64)>) -> TensorType {
    match range {
        Some((lo, hi)) => TensorType::new(p.dtype, vec![Dim::constant(hi - lo)]),
        None => p.clone(),
    }
}

/// Checks a ranged update's piece against the parameter's size.
fn check_range(op: &str, p: &TensorType, range: Option<(i64, i64)>) -> Result<(), OpError> {
    if let Some((lo, hi)) = range {
        let n = p.numel().as_const();
        if lo < 0 || hi <= lo || n.is_some_and(|n| hi > n) {
            return Err(OpError::new(
                format!("`{op}`'s range is outside its parameter"),
                format!("{lo}..{hi} of {p}"),
            ));
        }
    }
    Ok(())
}

fn range_attr(range: Option<(i64, i64)>, master: bool, grad_piece: bool) -> Vec<String> {
    range
        .map(|(lo, hi)| format!("range={lo}..{hi}"))
        .into_iter()
        .chain(master.then(|| "master".to_string()))
        .chain(grad_piece.then(|| "grad_piece".to_string()))
        .collect()
}

/// What an update's inputs must be: (the gradient's type, the state's).
/// The parameter is input 0, or (`master`) the state's shape is, the
/// parameter's type then read from the gradient's shape; a gradient that
/// is the piece alone (`grad_piece`) is shaped as the state.
fn updated_types(
    op: &str,
    inputs: &[TensorType],
    range: Option<(i64, i64)>,
    master: bool,
    grad_piece: bool,
) -> Result<(TensorType, TensorType), OpError> {
    // The whole parameter's type, where an input has it: input 0, or the
    // gradient when input 0 is a master piece; neither when both are pieces.
    let whole = match (master, grad_piece) {
        (false, _) => Some(inputs[0].clone()),
        (true, false) => Some(TensorType::new(inputs[0].dtype, inputs[1].shape.clone())),
        (true, true) => None,
    };
    let state = match (&whole, range) {
        (Some(p), _) => {
            check_range(op, p, range)?;
            state_type(p, range)
        }
        (None, Some((lo, hi))) if lo >= 0 && hi > lo => {
            TensorType::new(inputs[0].dtype, vec![Dim::constant(hi - lo)])
        }
        (None, _) => {
            return Err(OpError::new(
                format!("`{op}` of a master piece and a gradient piece needs a range"),
                format!("{range:?}"),
            ))
        }
    };
    let first = match (&whole, master) {
        (Some(p), false) => p,
        _ => &state,
    };
    if inputs[0].shape != first.shape {
        return Err(OpError::new(
            format!("shape mismatch in `{op}`"),
            format!("{first} and {}", inputs[0]),
        ));
    }
    let grad = match whole {
        Some(p) if !grad_piece => p,
        _ => state.clone(),
    };
    Ok((grad, state))
}

impl OpDef for AdamW {
    fn update_range(&self) -> Option<(i64, i64)> {
        self.range
    }
    fn update_master(&self) -> bool {
        self.master
    }
    fn name(&self) -> &'static str {
        "adamw"
    }
    fn attrs(&self) -> Vec<String> {
        vec![
            format!("betas=({}, {})", num(self.beta1), num(self.beta2)),
            format!("eps={}", num(self.eps)),
            format!("wd={}", num(self.weight_decay)),
        ]
        .into_iter()
        .chain(range_attr(self.range, self.master, self.grad_piece))
        .collect()
    }
    /// (param, grad, m, v, lr, step, grad scale[, apply]) -> (param', m',
    /// v'); `step` counts from 1; the gradient is multiplied by the scale
    /// (the clip coefficient) as it is read. With `apply` 0 (a micro-batch
    /// that only accumulates) the outputs are the inputs. With `master`
    /// the param is the f32 master piece.
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        if inputs.len() != 8 {
            expect_arity("adamw", inputs, 7)?;
        }
        let (g, state) = updated_types("adamw", inputs, self.range, self.master, self.grad_piece)?;
        for (t, want) in inputs[1..4].iter().zip([&g, &state, &state]) {
            if t.shape != want.shape {
                return Err(OpError::new(
                    "shape mismatch in `adamw`",
                    format!("{want} and {t}"),
                ));
            }
        }
        check_grad_dtype("adamw", &inputs[1])?;
        Ok(vec![
            inputs[0].clone(),
            inputs[2].clone(),
            inputs[3].clone(),
        ])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (p, g, m, v) = (inputs[0], inputs[1], inputs[2], inputs[3]);
        if inputs.get(7).is_some_and(|a| a.data[0] == 0.0) {
            return vec![inputs[0].clone(), inputs[2].clone(), inputs[3].clone()];
        }
        let (lr, t, scale) = (inputs[4].data[0], inputs[5].data[0], inputs[6].data[0]);
        let bc1 = 1.0 - self.beta1.powf(t);
        let bc2 = 1.0 - self.beta2.powf(t);
        let (lo, hi) = self
            .range
            .map_or((0, g.len()), |(a, b)| (a as usize, b as usize));
        let mut po = p.data.clone();
        let (mut mo, mut vo) = (vec![0.0; hi - lo], vec![0.0; hi - lo]);
        for (k, i) in (lo..hi).enumerate() {
            let pi = if self.master { k } else { i };
            let gi = g.data[if self.grad_piece { k } else { i }] * scale;
            mo[k] = self.beta1 * m.data[k] + (1.0 - self.beta1) * gi;
            vo[k] = self.beta2 * v.data[k] + (1.0 - self.beta2) * gi * gi;
            let decayed = p.data[pi] * (1.0 - lr * self.weight_decay);
            po[pi] = decayed - lr * (mo[k] / bc1) / ((vo[k] / bc2).sqrt() + self.eps);
        }
        vec![
            Tensor::new(p.shape.clone(), po),
            Tensor::new(m.shape.clone(), mo),
            Tensor::new(v.shape.clone(), vo),
        ]
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    pub momentum: f64,
    pub weight_decay: f64,
    /// As `AdamW::range`.
    pub range: Option<(i64, i64)>,
    /// As `AdamW::master`.
    pub master: bool,
    /// As `AdamW::grad_piece`.
    pub grad_piece: bool,
}

impl OpDef for Sgd {
    fn update_range(&self) -> Option<(i64, i64)> {
        self.range
    }
    fn update_master(&self) -> bool {
        self.master
    }
    fn name(&self) -> &'static str {
        "sgd"
    }
    fn attrs(&self) -> Vec<String> {
        vec![
            format!("momentum={}", num(self.momentum)),
            format!("wd={}", num(self.weight_decay)),
        ]
        .into_iter()
        .chain(range_attr(self.range, self.master, self.grad_piece))
        .collect()
    }
    /// (param, grad, momentum buffer, lr, grad scale[, apply]) -> (param',
    /// buffer'); with `apply` 0 the outputs are the inputs.
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        if inputs.len() != 6 {
            expect_arity("sgd", inputs, 5)?;
        }
        let (g, state) = updated_types("sgd", inputs, self.range, self.master, self.grad_piece)?;
        for (t, want) in inputs[1..3].iter().zip([&g, &state]) {
            if t.shape != want.shape {
                return Err(OpError::new(
                    "shape mismatch in `sgd`",
                    format!("{want} and {t}"),
                ));
            }
        }
        check_grad_dtype("sgd", &inputs[1])?;
        Ok(vec![inputs[0].clone(), inputs[2].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        if inputs.get(5).is_some_and(|a| a.data[0] == 0.0) {
            return vec![inputs[0].clone(), inputs[2].clone()];
        }
        let (p, g, buf, lr, scale) = (
            inputs[0],
            inputs[1],
            inputs[2],
            inputs[3].data[0],
            inputs[4].data[0],
        );
        let (lo, hi) = self
            .range
            .map_or((0, g.len()), |(a, b)| (a as usize, b as usize));
        let mut po = p.data.clone();
        let mut bo = vec![0.0; hi - lo];
        for (k, i) in (lo..hi).enumerate() {
            let pi = if self.master { k } else { i };
            let gi = g.data[if self.grad_piece { k } else { i }] * scale
                + self.weight_decay * p.data[pi];
            bo[k] = self.momentum * buf.data[k] + gi;
            po[pi] = p.data[pi] - lr * bo[k];
        }
        vec![
            Tensor::new(p.shape.clone(), po),
            Tensor::new(buf.shape.clone(), bo),
        ]
    }
}

/// ZeRO with a 16-bit compute dtype: an owner's updated f32 master piece
/// stored into the parameter the ranks keep in the compute dtype
/// (input 0, whole): the output is input 0 with elements [lo, hi)
/// replaced by input 1 (the piece, `hi - lo` elements) in input 0's
/// dtype. In place, as the update; the owner then sends the piece to the
/// other ranks in that dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct StorePiece {
    pub range: (i64, i64),
}

impl OpDef for StorePiece {
    fn update_range(&self) -> Option<(i64, i64)> {
        Some(self.range)
    }
    fn name(&self) -> &'static str {
        "store_piece"
    }
    fn attrs(&self) -> Vec<String> {
        range_attr(Some(self.range), false, false)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("store_piece", inputs, 2)?;
        let (whole, piece) = (&inputs[0], &inputs[1]);
        check_range("store_piece", whole, Some(self.range))?;
        expect_float("store_piece", whole, 0)?;
        expect_float("store_piece", piece, 1)?;
        let (lo, hi) = self.range;
        if piece.numel().as_const() != Some(hi - lo) {
            return Err(OpError::new(
                "`store_piece`'s piece is not the range's size",
                format!("{piece} for elements {lo}..{hi}"),
            ));
        }
        Ok(vec![whole.clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let (lo, hi) = (self.range.0 as usize, self.range.1 as usize);
        let mut out = inputs[0].clone();
        out.data[lo..hi].copy_from_slice(&inputs[1].data);
        vec![out]
    }
}

/// Sums of squares of many tensors in fixed chunks (the global gradient
/// norm): output `i` is the sum over chunk `i`, chunks numbered tensor by
/// tensor, `chunk` elements each (the last of a tensor may be shorter).
/// One launch for every gradient of the model, one block per chunk, and a
/// deterministic result; a `sum` of the partials gives the total.
/// Under ZeRO an input may be summed over a piece of its elements alone
/// (`pieces`: input index, elements [lo, hi)), the piece of its parameter's
/// gradient whose mean this rank holds.
#[derive(Clone, Debug, PartialEq)]
pub struct SumSquares {
    pub chunk: i64,
    pub pieces: Vec<(usize, i64, i64)>,
}

impl SumSquares {
    /// The elements [lo, hi) of input `i` that are summed.
    pub fn span(&self, i: usize, numel: i64) -> (i64, i64) {
        self.pieces
            .iter()
            .find(|p| p.0 == i)
            .map_or((0, numel), |&(_, lo, hi)| (lo, hi))
    }

    /// Chunks of each input, in order; `None` when a size is symbolic.
    pub fn chunks(&self, inputs: &[TensorType]) -> Option<Vec<i64>> {
        inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let (lo, hi) = self.span(i, t.numel().as_const()?);
                let n = hi - lo;
                // ceil(n / chunk) without n + chunk - 1, which can overflow.
                Some((n / self.chunk + i64::from(n % self.chunk != 0)).max(1))
            })
            .collect()
    }
}

impl OpDef for SumSquares {
    fn name(&self) -> &'static str {
        "sum_squares"
    }
    fn attrs(&self) -> Vec<String> {
        let mut a = vec![format!("chunk={}", self.chunk)];
        a.extend(
            self.pieces
                .iter()
                .map(|(i, lo, hi)| format!("piece={i}:{lo}..{hi}")),
        );
        a
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        for &(i, lo, hi) in &self.pieces {
            let n = inputs.get(i).and_then(|t| t.numel().as_const());
            if n.is_none_or(|n| lo < 0 || lo > hi || hi > n) {
                return Err(OpError::new(
                    "a `sum_squares` piece lies outside its tensor",
                    format!("input {i}, elements {lo}..{hi}"),
                ));
            }
        }
        if inputs.is_empty() || self.chunk < 1 {
            return Err(OpError::new(
                "`sum_squares` needs at least one tensor and a positive chunk",
                format!("{} tensors, chunk {}", inputs.len(), self.chunk),
            ));
        }
        for (i, t) in inputs.iter().enumerate() {
            expect_float("sum_squares", t, i)?;
        }
        let chunks = self.chunks(inputs).ok_or_else(|| {
            OpError::new(
                "`sum_squares` needs tensors of known size",
                "a tensor has a symbolic shape",
            )
        })?;
        let total: i64 = chunks.iter().sum();
        Ok(vec![TensorType::new(
            DType::F32,
            vec![Dim::constant(total)],
        )])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let mut out = Vec::new();
        for (i, t) in inputs.iter().enumerate() {
            let (lo, hi) = self.span(i, t.data.len() as i64);
            let data = &t.data[lo as usize..hi as usize];
            if data.is_empty() {
                out.push(0.0);
            }
            for c in data.chunks(self.chunk as usize) {
                out.push(c.iter().map(|x| x * x).sum());
            }
        }
        vec![Tensor::new(vec![out.len()], out)]
    }
}

/// An update reads its gradient in f32, or in bf16 where the ranks average
/// in bf16 (the prelude's `fs_grad` decodes those two; an f16 gradient
/// would be read as bf16 bits).
fn check_grad_dtype(op: &str, g: &TensorType) -> Result<(), OpError> {
    match g.dtype {
        DType::F32 | DType::BF16 => Ok(()),
        other => Err(OpError::new(
            format!("`{op}` reads an f32 or bf16 gradient"),
            format!("given {other}"),
        )),
    }
}
