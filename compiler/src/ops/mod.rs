//! The op set. Each op is declared once, in one of the files below, as a
//! type implementing [`OpDef`]: its shape and dtype rule (`infer`), its CPU
//! reference (`eval`), its gradient rule (`vjp`, written with other ops)
//! and what fusion does with it (`class`). How an op that runs as a kernel
//! of its own is written in CUDA lives in `emit::lower`, so nothing here
//! writes kernels. Adding an op means its `OpDef` impl, one line in `ops!`
//! below, and, if it runs as a kernel, a `Lower` impl (the compiler points
//! at `emit::lower::of` until it has one).

mod attention;
mod builder;
mod collective;
mod conv;
mod decode;
mod dropout;
mod elementwise;
mod linalg;
mod nn;
mod optim;
pub mod philox;
mod shape;
mod source;
mod unary;

pub use attention::{packed_layout, Attention, AttentionGrad, AttnDropout};
pub use builder::Builder;
pub use collective::{AllGather, AllReduce};
pub use conv::{Conv2d, Conv2dGradInput, Conv2dGradWeight};
pub use decode::{ArgMax, CachedAttention, KvWrite};
pub use dropout::{key_type as dropout_key_type, Dropout, KEY_INPUT as DROPOUT_KEY_INPUT};
pub use elementwise::{Binary, BinaryKind, Cast, ClipCoef, Constant, DimValue, Unscale};
pub use linalg::MatMul;
pub use nn::{
    CausalMask, CeRule, Counted, CrossEntropy, CrossEntropyGrad, CrossEntropyWithGrad, Embedding,
    EmbeddingGrad, LayerNorm, LayerNormGrad, RmsNorm, RmsNormGrad, Rope, Softmax, SoftmaxGrad,
    NORM_GROUPS,
};
pub use optim::{AdamW, Sgd, StorePiece, SumSquares};
pub use shape::{Broadcast, Concat, Permute, Reduce, ReduceKind, Reshape, Slice, SliceGrad};
pub use source::{Input, Param, State};
pub use unary::{TorchForm, Unary, UnaryFn, UnaryGrad, UnaryKind};

use crate::ir::dim::Dim;
use crate::ir::graph::Value;
use crate::ir::types::{shape_string, DType, TensorType};
use crate::tensor::Tensor;

/// Why an op rejected its inputs. The elaborator turns it into a diagnostic
/// at the call's span (or at the argument's span when `arg` is set).
#[derive(Clone, Debug, PartialEq)]
pub struct OpError {
    pub message: String,
    pub detail: String,
    pub arg: Option<usize>,
    pub help: Option<String>,
}

impl OpError {
    pub fn new(message: impl Into<String>, detail: impl Into<String>) -> OpError {
        OpError {
            message: message.into(),
            detail: detail.into(),
            arg: None,
            help: None,
        }
    }
    pub fn at(mut self, arg: usize) -> OpError {
        self.arg = Some(arg);
        self
    }
    pub fn help(mut self, h: impl Into<String>) -> OpError {
        self.help = Some(h.into());
        self
    }
}

impl std::fmt::Display for OpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.message, self.detail)
    }
}

/// What `eval` knows beyond its inputs: the concrete output shapes, and the
/// values of the symbolic dimensions.
pub struct EvalCtx<'a> {
    pub out_shapes: &'a [Vec<usize>],
    pub dim: &'a dyn Fn(&Dim) -> usize,
}

/// What fusion does with an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusionClass {
    /// An input, parameter or state: stored before the step.
    Source,
    /// A constant or a symbolic size: folded into the kernels that read it,
    /// never stored.
    Scalar,
    /// Another way of reading its input's elements: read in place as a
    /// strided view, no kernel of its own.
    View,
    /// One output element from the same element of each input: fuses into
    /// chains (a pointwise kernel computes the chain per element).
    Elementwise,
    /// A kernel of its own: a library call, a generated loop or a template
    /// instance (see the methods below), possibly with elementwise work
    /// folded in (GEMM epilogues).
    Kernel,
}

pub trait OpDef {
    fn name(&self) -> &'static str;
    /// What fusion does with the op: a kernel of its own unless it says
    /// otherwise.
    fn class(&self) -> FusionClass {
        FusionClass::Kernel
    }
    /// The piece of its parameter an update runs on (ZeRO stage 1; `None`:
    /// all of it, and for every op that is not an update).
    fn update_range(&self) -> Option<(i64, i64)> {
        None
    }
    /// Whether an update reads and writes its f32 master piece (indexed as
    /// its state) rather than the parameter (ZeRO with a 16-bit compute
    /// dtype; `false` for every op that is not such an update).
    fn update_master(&self) -> bool {
        false
    }
    /// Attributes as `key=value` words for the text form of the graph.
    fn attrs(&self) -> Vec<String> {
        Vec::new()
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError>;
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor>;
    /// Given the gradients of the outputs (None where no gradient flows),
    /// returns the gradients of the inputs (None where none is needed).
    /// Gradient ops and optimizer updates keep this default: the training
    /// graph is differentiated once.
    fn vjp(
        &self,
        _b: &mut Builder,
        _inputs: &[Value],
        _outputs: &[Value],
        _douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        Err(OpError::new(
            "this op has no gradient rule (second derivatives are not supported)",
            self.name(),
        ))
    }
}

macro_rules! ops {
    ($($variant:ident),* $(,)?) => {
        /// Every op in the IR.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Op {
            $($variant($variant)),*
        }

        impl Op {
            fn def(&self) -> &dyn OpDef {
                match self {
                    $(Op::$variant(o) => o),*
                }
            }

        }

        $(impl From<$variant> for Op {
            fn from(o: $variant) -> Op {
                Op::$variant(o)
            }
        })*
    };
}

ops!(
    Input,
    Param,
    State,
    Constant,
    DimValue,
    Cast,
    Unary,
    UnaryGrad,
    Binary,
    ClipCoef,
    Unscale,
    Reduce,
    Reshape,
    Permute,
    Slice,
    SliceGrad,
    Concat,
    Broadcast,
    MatMul,
    Softmax,
    SoftmaxGrad,
    LayerNorm,
    LayerNormGrad,
    RmsNorm,
    RmsNormGrad,
    Embedding,
    EmbeddingGrad,
    CrossEntropy,
    CrossEntropyGrad,
    CrossEntropyWithGrad,
    Counted,
    Rope,
    CausalMask,
    Dropout,
    Attention,
    AttentionGrad,
    KvWrite,
    CachedAttention,
    ArgMax,
    Conv2d,
    Conv2dGradInput,
    Conv2dGradWeight,
    AdamW,
    Sgd,
    SumSquares,
    AllReduce,
    AllGather,
    StorePiece,
);

impl Op {
    pub fn name(&self) -> &'static str {
        self.def().name()
    }
    pub fn attrs(&self) -> Vec<String> {
        self.def().attrs()
    }
    pub fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        self.def().infer(inputs)
    }
    pub fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        self.def().eval(inputs, ctx)
    }
    pub fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        outputs: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        self.def().vjp(b, inputs, outputs, douts)
    }
    pub fn class(&self) -> FusionClass {
        self.def().class()
    }
    pub fn update_range(&self) -> Option<(i64, i64)> {
        self.def().update_range()
    }
    pub fn update_master(&self) -> bool {
        self.def().update_master()
    }
    pub fn is_source(&self) -> bool {
        self.class() == FusionClass::Source
    }
    /// A constant or a symbolic size: folded into the kernels that read it,
    /// never stored.
    pub fn is_scalar(&self) -> bool {
        self.class() == FusionClass::Scalar
    }
    /// Another way of reading its input's elements (read in place as a
    /// strided view, no kernel of its own).
    pub fn is_view(&self) -> bool {
        self.class() == FusionClass::View
    }
    /// One output element from the same element of each input: fuses into
    /// chains.
    pub fn is_elementwise(&self) -> bool {
        self.class() == FusionClass::Elementwise
    }
}

// ---- shared checks used by the shape rules ----

pub(crate) fn expect_arity(op: &str, inputs: &[TensorType], n: usize) -> Result<(), OpError> {
    if inputs.len() != n {
        return Err(OpError::new(
            format!(
                "`{op}` takes {n} tensor argument{}",
                if n == 1 { "" } else { "s" }
            ),
            format!("found {}", inputs.len()),
        ));
    }
    Ok(())
}

pub(crate) fn expect_float(op: &str, t: &TensorType, arg: usize) -> Result<(), OpError> {
    if !t.dtype.is_float() {
        return Err(OpError::new(
            format!("`{op}` needs a floating-point tensor"),
            format!("found {t}"),
        )
        .at(arg));
    }
    Ok(())
}

pub(crate) fn expect_int(op: &str, t: &TensorType, arg: usize) -> Result<(), OpError> {
    if t.dtype != DType::I32 {
        return Err(OpError::new(
            format!("`{op}` needs an i32 tensor of indices"),
            format!("found {t}"),
        )
        .at(arg));
    }
    Ok(())
}

pub(crate) fn expect_same_dtype(op: &str, a: &TensorType, b: &TensorType) -> Result<(), OpError> {
    if a.dtype != b.dtype {
        return Err(OpError::new(
            format!("dtype mismatch in `{op}`"),
            format!("{a} and {b}"),
        ));
    }
    Ok(())
}

pub(crate) fn expect_rank_at_least(
    op: &str,
    t: &TensorType,
    r: usize,
    arg: usize,
) -> Result<(), OpError> {
    if t.rank() < r {
        return Err(OpError::new(
            format!("`{op}` needs a tensor of rank {r} or more"),
            format!("found {t}"),
        )
        .at(arg));
    }
    Ok(())
}

pub(crate) fn dims_equal(op: &str, what: &str, a: &Dim, b: &Dim) -> Result<(), OpError> {
    if a != b {
        return Err(OpError::new(
            format!("shape mismatch in `{op}`"),
            format!("{what}: {a} vs {b}"),
        ));
    }
    Ok(())
}

/// Symbolic numpy broadcasting: equal dims, or one of them is the constant 1.
pub(crate) fn broadcast(op: &str, a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>, OpError> {
    let r = a.len().max(b.len());
    let one = Dim::constant(1);
    let mut out = Vec::with_capacity(r);
    for i in 0..r {
        let da = if i + a.len() >= r {
            &a[i + a.len() - r]
        } else {
            &one
        };
        let db = if i + b.len() >= r {
            &b[i + b.len() - r]
        } else {
            &one
        };
        out.push(if da == db || db.is_one() {
            da.clone()
        } else if da.is_one() {
            db.clone()
        } else {
            return Err(OpError::new(
                format!("shapes do not broadcast in `{op}`"),
                format!(
                    "{} and {}: axis {} is {} on the left and {} on the right",
                    shape_string(a),
                    shape_string(b),
                    i as i64 - r as i64,
                    da,
                    db
                ),
            )
            .help("broadcasting matches axes from the right; each pair must be equal or one of them 1"));
        });
    }
    Ok(out)
}

/// Normalises a possibly negative axis against a rank.
pub(crate) fn norm_axis(op: &str, axis: i64, rank: usize) -> Result<usize, OpError> {
    let r = rank as i64;
    if axis < -r || axis >= r {
        return Err(OpError::new(
            format!("axis out of range in `{op}`"),
            format!("axis {axis} for a tensor of rank {rank}"),
        )
        .help(format!("valid axes are -{r}..{}", r - 1)));
    }
    Ok(if axis < 0 {
        (axis + r) as usize
    } else {
        axis as usize
    })
}
