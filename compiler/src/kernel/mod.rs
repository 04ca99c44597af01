//! The kernel IR: the training graph cut into kernels. A kernel reads and
//! writes stored buffers (graph values that live in device memory); a
//! pointwise kernel computes a whole chain of elementwise ops per element,
//! reading its inputs through views, so the values inside the chain never
//! touch memory. Ops that are not (yet) generated as loops stay one op per
//! kernel, for a library call or a template.
//!
//! The IR has its own CPU interpreter (`interp`), and the tests check every
//! kernel program against the unfused graph.

pub mod buckets;
pub(crate) mod forms;
pub mod fuse;
pub mod gathers;
pub mod gemm;
mod groups;
pub mod interp;
pub mod pitch;
pub mod print;
pub mod view;

use crate::ir::graph::Value;
use crate::ir::types::{DType, TensorType};
use crate::ir::Dim;
use crate::ops::{BinaryKind, UnaryKind};
use petgraph::stable_graph::NodeIndex;
use view::View;

/// The stages after the graph passes, for `fusec passes`.
pub const STAGES: &[(&str, &str)] = &[
    (
        "layout",
        "transposes, slices, head splits and broadcasts become strided views read in place; a copy only where no view can express it (--dump layout)",
    ),
    (
        "fuse",
        "elementwise chains, GEMM epilogues (bias, residual, GELU and its backward), casts stored by their producer, multi-tensor groups (--dump kernels)",
    ),
    (
        "select",
        "what runs each kernel on the device built for (--device): cuBLASLt, the generated kernel, or kernels/ template instances (the tensor-core attention)",
    ),
    (
        "plan",
        "one arena: offsets from liveness, in-place updates, every launch with its grid (plan.json, report.txt)",
    ),
];

/// What a stored buffer holds, for the memory plan and the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufKind {
    Input,
    Param,
    State,
    /// Computed during the step.
    Temp,
}

#[derive(Clone, Debug)]
pub struct Buffer {
    pub value: Value,
    pub ty: TensorType,
    pub kind: BufKind,
    /// Elements from one row (last axis) to the next where rows are padded
    /// for aligned GEMMs (see `pitch`); `None` when packed.
    pub pitch: Option<i64>,
    /// Rows of zeros stored after the last row, which a GEMM run at a
    /// padded size reads (see `pitch::pad_gemm_sizes`); its writer zeroes
    /// them every step. 0 for none.
    pub zero_rows: i64,
}

/// The sizes a GEMM kernel runs at where they differ from its op's: an
/// awkward `m`, `n` or `k` (GPT-2's 50257) rounded up, over operands whose
/// padding holds zeros (see `pitch::pad_gemm_sizes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmPad {
    pub n: Option<i64>,
    pub k: Option<i64>,
    pub m: Option<i64>,
}

/// One expression of a pointwise kernel; operands are earlier expressions
/// by index. Arithmetic is in f32 (f64 in the interpreter); `Round` is where
/// a value is rounded to a narrower dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum PExpr {
    /// `inputs[input]` read through `view`, indexed by this element's
    /// coordinates in `view.shape` (the flat element index unravelled).
    Load {
        input: usize,
        view: View,
    },
    Const(f64),
    Dim(Dim),
    Unary(UnaryKind, usize),
    /// `f'(x) * dy` for the unary `f`.
    UnaryGrad(UnaryKind, usize, usize),
    Binary(BinaryKind, usize, usize),
    Round(DType, usize),
    /// `dropout` of expression `x`: kept and scaled, or zeroed, by the
    /// Philox draw of this element (its index in the kernel's elements) at
    /// the op's site, keyed by input slot `key` (the step's `i32[2]` key,
    /// read whole, never as an element).
    Dropout {
        op: crate::ops::Dropout,
        x: usize,
        key: usize,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pointwise {
    /// Elements computed: every op of the kernel has this many.
    pub n: Dim,
    pub exprs: Vec<PExpr>,
    /// (output slot, expression): `outputs[slot][i] = exprs[e]`.
    pub stores: Vec<(usize, usize)>,
    /// A sum over the leading axes of one of its values (a bias gradient
    /// summed by the chain that makes its input, so the input is not read
    /// back, or not stored at all where nothing else reads it); `None` for
    /// a plain chain.
    pub sum: Option<ColumnSum>,
}

/// The column sums a pointwise kernel adds up as it computes: its elements
/// seen as `[n / cols, cols]` (element `i` in column `i % cols`; a reshape
/// keeps the row-major order), `outputs[out][j]` the sum (or mean) over
/// column `j` of expression `expr` rounded to `dtype`: the value the
/// leading-axes `sum` op it replaces read from the stored tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnSum {
    /// The expression summed.
    pub expr: usize,
    /// The dtype of the tensor summed, each element rounded to it first.
    pub dtype: DType,
    /// The output slot of the `cols` sums.
    pub out: usize,
    pub cols: i64,
    /// Divided by the rows (a mean over the leading axes).
    pub mean: bool,
}

/// One op of a group kernel, with its inputs and outputs as kernel slots.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    pub node: NodeIndex,
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
    /// A chain of elementwise ops run as its own kernel would run it (its
    /// ops and expressions, their loads and stores by the member's slots in
    /// order), where the member is a whole chain kernel
    /// (`groups::group_elementwise`); `None`: the op `node` alone.
    pub chain: Option<Box<(Vec<NodeIndex>, Pointwise)>>,
}

/// Elementwise work a GEMM does as it stores the product (cuBLASLt
/// epilogues), so the product never makes a round trip through memory.
/// Slots are the kernel's input and output slots; the product's operands are
/// inputs 0 and 1.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Epilogue {
    /// A vector of the output's last size, added to every row.
    pub bias: Option<usize>,
    /// A tensor of the output's shape added (the residual stream: C with
    /// beta = 1).
    pub residual: Option<usize>,
    /// Output 0 is gelu(pre) and output 1 the pre-activation `pre`, which
    /// the backward pass reads.
    pub gelu: bool,
    /// Input slot of a stored pre-activation: output 0 is gelu'(pre) times
    /// the product (the backward of a GELU).
    pub dgelu: Option<usize>,
}

impl Epilogue {
    pub fn is_empty(&self) -> bool {
        *self == Epilogue::default()
    }

    /// The cuBLASLt epilogue this is, plus a residual where there is one:
    /// `bias`, `gelu_aux_bias`, `dgelu`, `bias+residual`.
    pub fn name(&self) -> String {
        let base = match (self.bias.is_some(), self.gelu, self.dgelu.is_some()) {
            (_, _, true) => "dgelu",
            (true, true, _) => "gelu_aux_bias",
            (false, true, _) => "gelu_aux",
            (true, false, _) => "bias",
            (false, false, _) => "default",
        };
        match self.residual {
            Some(_) => format!("{base}+residual"),
            None => base.to_string(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    Pointwise(Pointwise),
    /// One graph op, run by a library call or a kernel template.
    Op(NodeIndex),
    /// A matmul (library call) with the elementwise ops after it folded in.
    Gemm(NodeIndex, Epilogue),
    /// Independent ops of one kind in one launch (the optimizer update of
    /// every parameter), each reading and writing its own buffers.
    Group(Vec<Member>),
}

#[derive(Clone, Debug)]
pub struct Kernel {
    /// `k12_add_gelu`: position and the ops it holds.
    pub name: String,
    /// The graph ops this kernel computes.
    pub nodes: Vec<NodeIndex>,
    /// Buffers read and written, by index into `Program::buffers`.
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
    /// Op kernels only: an input read through a view of its buffer (a GEMM
    /// reading a transposed operand); `None` reads the buffer as stored.
    pub input_views: Vec<Option<View>>,
    pub body: Body,
    /// Op kernels only: an input slot added, element for element, to
    /// output 0 as it is stored (a norm backward's dx plus the residual
    /// stream's gradient), so the sum needs no kernel of its own.
    pub residual: Option<usize>,
    /// Op kernels only: the elementwise chain that computes the op's input
    /// 0 as the op loads it. The kernel's inputs are then the op's other
    /// inputs, in order, and after them the chain's; its outputs the op's,
    /// then what the chain stores.
    pub prologue: Option<Prologue>,
}

/// The chain a norm computes its rows with as it loads them (a post-LN
/// transformer's `layernorm(x + dropout(y + b))`), so they are never read
/// back from memory; stored once where anything else reads them (the
/// norm's backward).
#[derive(Clone, Debug, PartialEq)]
pub struct Prologue {
    /// The chain over every element of the op's input 0; its loads read
    /// the kernel's inputs, its stores write the kernel's outputs.
    pub chain: Pointwise,
    /// The expression that is the op's input 0, read rounded to `dtype`
    /// as the tensor it replaces was stored.
    pub value: usize,
    pub dtype: DType,
}

impl Kernel {
    /// The key/value cache writes this kernel makes, as (input slot of the
    /// cache, output slot of its new value): its own op's, or its group
    /// members' (groups::group_cache_writes). The plan stores each output
    /// over its cache.
    pub fn cache_writes(&self, g: &crate::ir::Graph) -> Vec<(usize, usize)> {
        let is_write = |n: NodeIndex| matches!(g.g[n].op, crate::ops::Op::KvWrite(_));
        match &self.body {
            Body::Op(n) if is_write(*n) => vec![(0, 0)],
            Body::Group(ms) => ms
                .iter()
                .filter(|m| is_write(m.node))
                .map(|m| (m.inputs[0], m.outputs[0]))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// A group kernel of `members` over the buffers `inputs` and `outputs`
    /// their slots index, named `{op}_x{count}`.
    pub fn group(
        op: &str,
        members: Vec<Member>,
        inputs: Vec<usize>,
        outputs: Vec<usize>,
    ) -> Kernel {
        Kernel {
            name: format!("{op}_x{}", members.len()),
            nodes: members.iter().map(|m| m.node).collect(),
            inputs,
            outputs,
            input_views: Vec::new(),
            residual: None,
            prologue: None,
            body: Body::Group(members),
        }
    }
}

/// The training step as kernels, in launch order.
#[derive(Clone, Debug)]
pub struct Program {
    pub buffers: Vec<Buffer>,
    pub kernels: Vec<Kernel>,
    /// GEMM kernels (by index) run at padded sizes.
    pub gemm_pads: std::collections::BTreeMap<usize, GemmPad>,
}

impl Program {
    pub fn buffer_of(&self, v: Value) -> Option<usize> {
        self.buffers.iter().position(|b| b.value == v)
    }

    /// The program's own invariants, checked after fusion as the graph
    /// verifier checks passes: every buffer a kernel reads is a source or
    /// written by an earlier kernel, computed buffers are written exactly
    /// once, group members and epilogues name slots that exist.
    pub fn verify(&self) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        let mut written: Vec<bool> = self
            .buffers
            .iter()
            .map(|b| b.kind != BufKind::Temp)
            .collect();
        let mut writes = vec![0usize; self.buffers.len()];
        for k in &self.kernels {
            for &b in k.inputs.iter().chain(&k.outputs) {
                if b >= self.buffers.len() {
                    problems.push(format!("{}: buffer {b} does not exist", k.name));
                }
            }
            if !problems.is_empty() {
                return Err(problems);
            }
            for &b in &k.inputs {
                if !written[b] {
                    problems.push(format!(
                        "{} reads buffer {b} before anything writes it",
                        k.name
                    ));
                }
            }
            for &b in &k.outputs {
                writes[b] += 1;
                written[b] = true;
            }
            let slot_ok = |s: &usize, n: usize| *s < n;
            match &k.body {
                Body::Group(members) => {
                    for m in members {
                        if !m.inputs.iter().all(|s| slot_ok(s, k.inputs.len()))
                            || !m.outputs.iter().all(|s| slot_ok(s, k.outputs.len()))
                        {
                            problems.push(format!(
                                "{}: a member names a slot that does not exist",
                                k.name
                            ));
                        }
                    }
                }
                Body::Gemm(_, e) => {
                    let ins = [e.bias, e.residual, e.dgelu];
                    if !ins.iter().flatten().all(|s| slot_ok(s, k.inputs.len()))
                        || k.outputs.len() != 1 + usize::from(e.gelu)
                    {
                        problems.push(format!(
                            "{}: the epilogue names a slot that does not exist",
                            k.name
                        ));
                    }
                }
                Body::Pointwise(pw) => {
                    if let Some(sum) = &pw.sum {
                        let stored = pw.stores.iter().any(|&(slot, _)| slot == sum.out);
                        if stored
                            || sum.out >= k.outputs.len()
                            || sum.expr >= pw.exprs.len()
                            || sum.cols < 1
                        {
                            problems.push(format!(
                                "{}: the column sum names a slot that does not exist",
                                k.name
                            ));
                        }
                    }
                    for e in &pw.exprs {
                        if let PExpr::Load { input, .. } | PExpr::Dropout { key: input, .. } = e {
                            if *input >= k.inputs.len() {
                                problems.push(format!(
                                    "{}: a load reads input {input} of {}",
                                    k.name,
                                    k.inputs.len()
                                ));
                            }
                        }
                    }
                }
                Body::Op(_) => {}
            }
            if let Some(r) = k.residual {
                if r >= k.inputs.len() || !matches!(k.body, Body::Op(_)) {
                    problems.push(format!("{}: the residual input does not exist", k.name));
                }
            }
            if let Some(pro) = &k.prologue {
                let loads_ok = pro.chain.exprs.iter().all(|e| match e {
                    PExpr::Load { input, .. } | PExpr::Dropout { key: input, .. } => {
                        *input < k.inputs.len()
                    }
                    _ => true,
                });
                let stores_ok = pro
                    .chain
                    .stores
                    .iter()
                    .all(|&(s, _)| s > 0 && s < k.outputs.len());
                if !matches!(k.body, Body::Op(_))
                    || !loads_ok
                    || !stores_ok
                    || pro.value >= pro.chain.exprs.len()
                {
                    problems.push(format!(
                        "{}: the prologue names a slot that does not exist",
                        k.name
                    ));
                }
            }
        }
        for (b, &n) in writes.iter().enumerate() {
            if self.buffers[b].kind == BufKind::Temp && n != 1 {
                problems.push(format!("buffer {b} is written {n} times"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }
}
