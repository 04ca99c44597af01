//! Each op back from its name and the attribute words its `OpDef::attrs`
//! prints (in the same order). What `attrs` leaves out is in the line's
//! result types: a source's type, a constant's dtype, a convolution
//! gradient's spatial sizes.

use super::lex::Cursor;
use super::ParseError;
use crate::ir::types::TensorType;
use crate::ops::*;

pub(super) const BINARY: [BinaryKind; 5] = [
    BinaryKind::Add,
    BinaryKind::Sub,
    BinaryKind::Mul,
    BinaryKind::Div,
    BinaryKind::KeepIf,
];

/// The op `name` with its attributes read from `c`; `outs` are the types
/// the line declares.
pub(super) fn op(
    c: &mut Cursor,
    name: &str,
    col: usize,
    outs: &[TensorType],
) -> Result<Op, ParseError> {
    // The result type carries what the attributes leave out.
    let result = |c: &Cursor, rank: Option<usize>| -> Result<TensorType, ParseError> {
        match outs {
            [t] if rank.is_none_or(|r| t.rank() == r) => Ok(t.clone()),
            [_] => Err(c.error_at(
                col,
                format!("`{name}` gives a tensor of rank {}", rank.expect("checked")),
            )),
            _ => Err(c.error_at(col, format!("`{name}` gives one result"))),
        }
    };
    let op: Op = match name {
        "input" => Input {
            name: c.string_lit("the input's name in quotes")?,
            ty: result(c, None)?,
        }
        .into(),
        "param" => Param {
            name: c.string_lit("the parameter's name in quotes")?,
            ty: result(c, None)?,
        }
        .into(),
        "state" => State {
            name: c.string_lit("the state's name in quotes")?,
            ty: result(c, None)?,
        }
        .into(),
        "const" => Constant {
            value: c.float()?,
            dtype: result(c, None)?.dtype,
        }
        .into(),
        "dim_value" => DimValue {
            dim: c.dim()?,
            dtype: result(c, None)?.dtype,
        }
        .into(),
        "cast" => {
            c.key("to")?;
            Cast { to: c.dtype()? }.into()
        }
        "clip_coef" => {
            c.key("max_norm")?;
            ClipCoef {
                max_norm: c.float()?,
            }
            .into()
        }
        "unscale" => {
            let max_norm = if c.peek()? == Some(super::Tok::Ident("max_norm")) {
                c.key("max_norm")?;
                Some(c.float()?)
            } else {
                None
            };
            Unscale { max_norm }.into()
        }
        "sum" | "mean" => {
            c.key("axes")?;
            let axes = c.usize_list()?;
            let keepdim = c.flag("keepdim")?;
            let kind = if name == "sum" {
                ReduceKind::Sum
            } else {
                ReduceKind::Mean
            };
            Reduce {
                kind,
                axes,
                keepdim,
            }
            .into()
        }
        "reshape" => Reshape { shape: c.shape()? }.into(),
        "broadcast" => Broadcast { shape: c.shape()? }.into(),
        "permute" => Permute {
            perm: c.usize_list()?,
        }
        .into(),
        "slice" => {
            c.key("axis")?;
            let axis = c.usize()?;
            let start = c.dim()?;
            c.punct(':')?;
            Slice {
                axis,
                start,
                end: c.dim()?,
            }
            .into()
        }
        "slice_grad" => {
            c.key("axis")?;
            let axis = c.usize()?;
            c.key("at")?;
            let start = c.dim()?;
            c.key("full")?;
            SliceGrad {
                axis,
                start,
                full: c.dim()?,
            }
            .into()
        }
        "concat" => {
            c.key("axis")?;
            Concat { axis: c.usize()? }.into()
        }
        "matmul" => MatMul.into(),
        "softmax" => {
            c.key("axis")?;
            Softmax { axis: c.usize()? }.into()
        }
        "softmax_grad" => {
            c.key("axis")?;
            SoftmaxGrad { axis: c.usize()? }.into()
        }
        "layernorm" | "layernorm_grad" | "rmsnorm" | "rmsnorm_grad" => {
            c.key("eps")?;
            let eps = c.float()?;
            match name {
                "layernorm" => LayerNorm { eps }.into(),
                "layernorm_grad" => LayerNormGrad { eps }.into(),
                "rmsnorm" => RmsNorm { eps }.into(),
                _ => RmsNormGrad { eps }.into(),
            }
        }
        "embedding" => Embedding.into(),
        "embedding_grad" => {
            c.key("rows")?;
            EmbeddingGrad { rows: c.dim()? }.into()
        }
        "cross_entropy" | "cross_entropy_grad" | "cross_entropy_with_grad" => {
            let classes = if keyed(c, "classes")? {
                Some(c.int()?)
            } else {
                None
            };
            let ignore_index = if keyed(c, "ignore_index")? {
                Some(c.int()?)
            } else {
                None
            };
            let smoothing = if keyed(c, "smoothing")? {
                c.float()?
            } else {
                0.0
            };
            let rule = CeRule {
                ignore_index,
                smoothing,
            };
            match name {
                "cross_entropy" => CrossEntropy { classes, rule }.into(),
                "cross_entropy_grad" => CrossEntropyGrad { classes, rule }.into(),
                _ => CrossEntropyWithGrad { classes, rule }.into(),
            }
        }
        "counted" => {
            c.key("ignore_index")?;
            Counted {
                ignore_index: c.int()?,
            }
            .into()
        }
        "rope" => {
            c.key("theta")?;
            let theta = c.float()?;
            Rope {
                theta,
                inverse: c.flag("inverse")?,
                positions: c.flag("positions")?,
            }
            .into()
        }
        "dropout" => {
            c.key("p")?;
            let p = c.float()?;
            c.key("site")?;
            let site =
                u32::try_from(c.usize()?).map_err(|_| c.error("a dropout site fits in 32 bits"))?;
            Dropout { p, site }.into()
        }
        "causal_mask" => {
            c.key("fill")?;
            CausalMask { fill: c.float()? }.into()
        }
        "kv_write" => KvWrite.into(),
        "cached_attention" => {
            c.key("scale")?;
            CachedAttention { scale: c.float()? }.into()
        }
        "argmax" => {
            c.key("classes")?;
            let classes =
                i64::try_from(c.usize()?).map_err(|_| c.error("a class count fits in 64 bits"))?;
            ArgMax { classes }.into()
        }
        "attention" | "attention_grad" => {
            c.key("causal")?;
            let causal = c.bool()?;
            c.key("scale")?;
            let scale = c.float()?;
            let lengths = c.flag("lengths")?;
            let dropout = if keyed(c, "dropout")? {
                let p = c.float()?;
                c.key("site")?;
                let site = u32::try_from(c.usize()?)
                    .map_err(|_| c.error("a dropout site fits in 32 bits"))?;
                Some(AttnDropout { p, site })
            } else {
                None
            };
            if name == "attention" {
                Attention {
                    causal,
                    scale,
                    lengths,
                    dropout,
                }
                .into()
            } else {
                AttentionGrad {
                    causal,
                    scale,
                    lengths,
                    dropout,
                    packed: c.flag("packed")?,
                }
                .into()
            }
        }
        "conv2d" | "conv2d_grad_input" | "conv2d_grad_weight" => {
            c.key("stride")?;
            let stride = small(c)?;
            c.key("padding")?;
            let padding = small(c)?;
            match name {
                "conv2d" => Conv2d { stride, padding }.into(),
                // dx [B, H, W, Cin]: the input's size is the result's.
                "conv2d_grad_input" => {
                    let t = result(c, Some(4))?;
                    Conv2dGradInput {
                        stride,
                        padding,
                        h: t.shape[1].clone(),
                        w: t.shape[2].clone(),
                    }
                    .into()
                }
                // dw [KH, KW, Cin, Cout].
                _ => {
                    let t = result(c, Some(4))?;
                    Conv2dGradWeight {
                        stride,
                        padding,
                        kh: t.shape[0].clone(),
                        kw: t.shape[1].clone(),
                    }
                    .into()
                }
            }
        }
        "adamw" => {
            c.key("betas")?;
            c.punct('(')?;
            let beta1 = c.float()?;
            c.punct(',')?;
            let beta2 = c.float()?;
            c.punct(')')?;
            c.key("eps")?;
            let eps = c.float()?;
            c.key("wd")?;
            AdamW {
                beta1,
                beta2,
                eps,
                weight_decay: c.float()?,
                range: range(c)?,
                master: c.flag("master")?,
                grad_piece: c.flag("grad_piece")?,
            }
            .into()
        }
        "sgd" => {
            c.key("momentum")?;
            let momentum = c.float()?;
            c.key("wd")?;
            Sgd {
                momentum,
                weight_decay: c.float()?,
                range: range(c)?,
                master: c.flag("master")?,
                grad_piece: c.flag("grad_piece")?,
            }
            .into()
        }
        "store_piece" => {
            let col = c.col();
            let Some(range) = range(c)? else {
                return Err(c.error_at(col, "`store_piece` needs `range=lo..hi`"));
            };
            StorePiece { range }.into()
        }
        "sum_squares" => {
            c.key("chunk")?;
            let chunk = c.int()?;
            let mut pieces = Vec::new();
            while c.peek()? == Some(super::Tok::Ident("piece")) {
                c.key("piece")?;
                let i = c.usize()?;
                c.punct(':')?;
                let (lo, hi) = ends(c)?;
                pieces.push((i, lo, hi));
            }
            SumSquares { chunk, pieces }.into()
        }
        "all_reduce" => {
            c.key("op")?;
            c.word("mean")?;
            c.key("ranks")?;
            let ranks_col = c.col();
            let ranks =
                u32::try_from(c.usize()?).map_err(|_| c.error_at(ranks_col, "too many ranks"))?;
            let group = if c.peek()? == Some(super::Tok::Ident("group")) {
                c.key("group")?;
                let col = c.col();
                u32::try_from(c.usize()?).map_err(|_| c.error_at(col, "too many ranks"))?
            } else {
                ranks
            };
            let every_micro_batch = c.flag("every_micro_batch")?;
            let owners_of = if c.peek()? == Some(super::Tok::Ident("owners_of")) {
                c.key("owners_of")?;
                Some(c.usize()?)
            } else {
                None
            };
            let sharded = c.flag("sharded")?;
            let piece = if c.peek()? == Some(super::Tok::Ident("piece")) {
                c.key("piece")?;
                Some(ends(c)?)
            } else {
                None
            };
            AllReduce {
                ranks,
                group,
                every_micro_batch,
                owners_of,
                sharded,
                piece,
            }
            .into()
        }
        "all_gather" => {
            c.key("rank")?;
            let rank_col = c.col();
            let rank =
                u32::try_from(c.usize()?).map_err(|_| c.error_at(rank_col, "too many ranks"))?;
            c.key("param")?;
            let param = c.usize()?;
            c.key("pieces")?;
            let mut pieces = Vec::new();
            loop {
                pieces.push(ends(c)?);
                if !c.eat(',')? {
                    break;
                }
            }
            AllGather {
                rank,
                param,
                pieces,
                shape: c.shape()?,
            }
            .into()
        }
        _ => {
            let unary = || UnaryKind::ALL.iter().copied();
            if let Some(kind) = unary().find(|k| k.name() == name) {
                Unary { kind }.into()
            } else if let Some(kind) = BINARY.into_iter().find(|k| k.name() == name) {
                Binary { kind }.into()
            } else if let Some(kind) = unary().find(|k| k.grad_name() == name) {
                UnaryGrad { kind }.into()
            } else {
                return Err(c.error_at(col, format!("unknown op `{name}`")));
            }
        }
    };
    Ok(op)
}

/// A convolution's stride or padding: bounded, as the shape rule computes
/// with it in i64.
fn small(c: &mut Cursor) -> Result<usize, ParseError> {
    let col = c.col();
    let n = c.usize()?;
    if n > 1 << 20 {
        return Err(c.error_at(col, format!("{n} is too large here")));
    }
    Ok(n)
}

/// An optimizer update's optional `range=LO..HI`.
fn range(c: &mut Cursor) -> Result<Option<(i64, i64)>, ParseError> {
    if c.peek()? != Some(super::Tok::Ident("range")) {
        return Ok(None);
    }
    c.key("range")?;
    ends(c).map(Some)
}

/// `LO..HI`: a range's, or a piece's, ends.
fn ends(c: &mut Cursor) -> Result<(i64, i64), ParseError> {
    let lo = c.int()?;
    if c.peek()? != Some(super::Tok::DotDot) {
        return Err(c.expected("`..` between the ends"));
    }
    c.next()?;
    Ok((lo, c.int()?))
}

/// Reads `key=` where the next word is `key` (an attribute that may be
/// left out); says whether it was there.
fn keyed(c: &mut Cursor, key: &str) -> Result<bool, ParseError> {
    if c.peek()? == Some(super::Tok::Ident(key)) {
        c.key(key)?;
        return Ok(true);
    }
    Ok(false)
}
