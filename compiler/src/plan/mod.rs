//! The memory plan: every stored buffer of a kernel program gets an offset
//! in one device arena, for concrete sizes of the symbolic dimensions.
//!
//! Parameters, their gradients, the optimizer state and the data inputs live
//! for the whole run and sit first. Every other buffer lives from the kernel
//! that writes it to the last kernel that reads it; those intervals are
//! packed greedily (largest first, lowest free offset), so buffers whose
//! lives do not overlap share memory. The optimizer writes new parameters
//! and state in place.

use crate::emit::flash::tma::TensorMapSizes;
use crate::emit::templates::{grid, shape_of, Shape, BLOCK};
use crate::ir::graph::{Graph, Role};
use crate::ir::{DType, Dim};
use crate::kernel::buckets::is_collective;
use crate::kernel::{Body, BufKind, Program};
use crate::ops::Op;
use crate::select::{Choice, Selection};
use serde::Serialize;

pub mod collectives;
pub mod gemm;
pub mod picture;
pub mod report;
pub mod roofline;
pub mod trace;
pub mod unfused;
mod verify;
use std::collections::{BTreeMap, HashMap};

/// Offsets are multiples of this (cuBLASLt and 16-byte vector loads want it).
pub const ALIGN: u64 = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    Param,
    Grad,
    OptimizerState,
    Input,
    Activation,
}

impl MemKind {
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Param => "parameters (f32 master)",
            MemKind::Grad => "gradients",
            MemKind::OptimizerState => "optimizer state",
            MemKind::Input => "inputs",
            MemKind::Activation => "activations and temporaries",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct PlannedBuffer {
    pub id: usize,
    /// The parameter, input or state name, or the value's type for temporaries.
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub bytes: u64,
    /// Elements between rows where the rows are padded (kernel::pitch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pitch: Option<i64>,
    /// Rows of zeros stored after the last (kernel::pitch::pad_gemm_sizes).
    #[serde(skip_serializing_if = "is_zero")]
    pub zero_rows: i64,
    pub offset: u64,
    pub kind: MemKind,
    /// Written in place over this buffer (an optimizer update).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias_of: Option<usize>,
    /// Stored over this buffer, whose last reader writes it (in place).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shares_with: Option<usize>,
    /// First and last kernel that touches it (temporaries only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<(usize, usize)>,
}

/// What runs a launch. `plan.json` writes it as one string: `generated`,
/// `template`, `all_reduce`, `group`, `matmul` (cuBLASLt), or the name of
/// an op with no kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LaunchKind {
    /// A kernel the emitter wrote (fusion's chains and the ops' own
    /// kernels; `fusec build` writes their CUDA C to its `kernels/` folder).
    Generated,
    /// Instances of `kernels/` templates (the attention's).
    Template,
    /// A bucket's gradients averaged over the data-parallel ranks.
    AllReduce,
    /// A group kernel whose members' sizes do not add up to one count of
    /// elements (so no generated step is planned for it).
    Group,
    /// A matrix product cuBLASLt runs, with its epilogue (`gemm`; none
    /// where cuBLASLt cannot run it).
    Gemm,
    /// An op with no kernel of its own and no library call (an error to
    /// run), by the op's name.
    Op(&'static str),
}

impl LaunchKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            LaunchKind::Generated => "generated",
            LaunchKind::Template => "template",
            LaunchKind::AllReduce => "all_reduce",
            LaunchKind::Group => "group",
            LaunchKind::Gemm => "matmul",
            LaunchKind::Op(name) => name,
        }
    }
}

impl std::fmt::Display for LaunchKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for LaunchKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Launch {
    pub kernel: String,
    pub kind: LaunchKind,
    pub ops: Vec<String>,
    pub inputs: Vec<usize>,
    pub outputs: Vec<usize>,
    /// Input slots a GEMM reads transposed, in place.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub transposed_inputs: Vec<usize>,
    /// A GEMM's epilogue (cuBLASLt): what it adds and applies as it stores
    /// the product.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epilogue: Option<GemmEpilogue>,
    /// A GEMM's product at the plan's sizes (none where a size is unbound:
    /// a build without them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm: Option<gemm::GemmShape>,
    /// An f32 GEMM taken as three TF32 products (`select::Choice::
    /// SplitGemm`): the f32 buffer its operands are split into, three
    /// copies of each along K (A's, then B's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_scratch: Option<usize>,
    /// The kernels launched for it, in order: the generated kernel, or the
    /// template instances chosen in its place (none for a library call).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<LaunchStep>,
}

/// One kernel launch of a step.
#[derive(Clone, Debug, Serialize)]
pub struct LaunchStep {
    /// The `extern "C"` function (and the name of its source).
    pub function: String,
    /// The `kernels/` template it instantiates, as C++.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Compiled for the `a` variant of the architecture (sm_90a).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub arch_specific: bool,
    pub grid: [u64; 3],
    pub block: u64,
    pub dynamic_smem_bytes: u64,
    /// The planned f32 buffer passed after the size parameters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scratch: Option<usize>,
    /// Tensor maps passed by value last, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tensor_maps: Vec<PlannedMap>,
}

/// A tensor map of a launch with the plan's sizes bound.
#[derive(Clone, Debug, Serialize)]
pub struct PlannedMap {
    /// The kernel parameter's name.
    pub name: String,
    /// The buffer's position among the launch's arguments (inputs, then outputs).
    pub arg: usize,
    pub sizes: TensorMapSizes,
    /// Bytes per swizzled box row: 128, 64 or 32.
    pub swizzle: u32,
}

/// Slots refer to the launch's `inputs` and `outputs`; the product's
/// operands are inputs 0 and 1.
#[derive(Clone, Debug, Serialize)]
pub struct GemmEpilogue {
    /// `bias`, `gelu_aux_bias`, `dgelu`, with `+residual` where the product
    /// is added to a tensor of its shape (C with beta = 1).
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub residual: Option<usize>,
    /// Output slot of the stored pre-activation (GELU forward).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pre_activation_out: Option<usize>,
    /// Input slot of the pre-activation a GELU backward reads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pre_activation_in: Option<usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub model: String,
    pub dims: BTreeMap<String, i64>,
    pub arena_bytes: u64,
    pub bytes_by_kind: BTreeMap<MemKind, u64>,
    pub buffers: Vec<PlannedBuffer>,
    pub launches: Vec<Launch>,
    /// What the kernels were chosen for (`select::Target::describe`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Attention kernels left on the simple kernels: (kernel, why).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<(String, String)>,
    /// The data-parallel gradient buckets, in launch order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub collectives: Vec<collectives::PlannedCollective>,
    /// The symbolic sizes in the order every kernel takes them after its
    /// buffers (`dim_B, dim_T, ...`).
    pub size_args: Vec<String>,
    /// The buffer of the loss, and of the gradient norm where the step
    /// clips or reports it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PlanError(pub String);

/// The buffer holding the graph's output of this role, if any.
fn output_buffer(g: &Graph, p: &Program, role: &Role) -> Option<usize> {
    g.outputs
        .iter()
        .find(|(r, _)| r == role)
        .and_then(|(_, v)| p.buffer_of(*v))
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// No buffer, and no arena, is planned past this (sizes stay far from
/// u64 overflow in every offset sum).
const MAX_BYTES: u64 = 1 << 60;

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// The plan of program `p` with the generated kernels only (the simple
/// attention kernels, no tensor-core templates): [`plan_with`] without a
/// selection.
pub fn plan(g: &Graph, p: &Program, dims: &BTreeMap<String, i64>) -> Result<Plan, PlanError> {
    plan_with(g, p, None, dims)
}

/// The plan of program `p` for the kernels `selection` chose (its template
/// launches, with their scratch buffers placed in the arena), at the sizes
/// `dims`.
pub fn plan_with(
    g: &Graph,
    p: &Program,
    selection: Option<&Selection>,
    dims: &BTreeMap<String, i64>,
) -> Result<Plan, PlanError> {
    let missing: Vec<&str> = g
        .dims
        .iter()
        .filter(|d| !dims.contains_key(*d))
        .map(|s| s.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(PlanError(format!(
            "the memory plan needs a size for {}",
            missing.join(", ")
        )));
    }
    crate::ir::sizes::check(g, dims)
        .map_err(|d| PlanError(format!("{} ({})", d.message, d.help.join("; "))))?;
    let env = |s: &str| dims.get(s).copied();
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
                    d.eval(&env)
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
    // The f32 scratch each template set shares (the attention backward's)
    // and each split GEMM's operand copies, alive for its kernel alone.
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
                Choice::Templates(ks) => {
                    let Some(elems) = ks.iter().find_map(|f| f.launch.scratch_f32.as_ref()) else {
                        continue;
                    };
                    let n = elems
                        .eval(&env)
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
    // Lifetimes of temporaries, in kernel positions.
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
    let buckets = collectives::collectives(g, p, &out);
    collectives::place(&buckets, &mut out);
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
    let base = cursor;
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
    let mut bytes_by_kind: BTreeMap<MemKind, u64> = BTreeMap::new();
    for b in out
        .iter()
        .filter(|b| b.alias_of.is_none() && b.kind != MemKind::Activation)
    {
        *bytes_by_kind.entry(b.kind).or_default() += align(b.bytes);
    }
    bytes_by_kind.insert(MemKind::Activation, top - base);
    let launches = p
        .kernels
        .iter()
        .map(|k| {
            let shape = match &k.body {
                Body::Pointwise(pw) => Some(Shape::Elements(pw.n.clone())),
                Body::Op(n) => shape_of(g, *n),
                Body::Gemm(..) => None,
                Body::Group(members) => members
                    .iter()
                    .map(|m| match shape_of(g, m.node) {
                        Some(Shape::Elements(n)) => Some(n),
                        _ => None,
                    })
                    .try_fold(Dim::constant(0), |acc, n| acc.checked_add(&n?))
                    .map(Shape::Elements),
            };
            Launch {
                kernel: k.name.clone(),
                kind: match (&k.body, &shape) {
                    _ if is_collective(g, k) => LaunchKind::AllReduce,
                    (_, Some(_)) => LaunchKind::Generated,
                    (Body::Gemm(..), None) => LaunchKind::Gemm,
                    (Body::Op(n), None) if matches!(g.g[*n].op, Op::MatMul(_)) => LaunchKind::Gemm,
                    (Body::Op(n), None) => LaunchKind::Op(g.g[*n].op.name()),
                    (_, None) => LaunchKind::Group,
                },
                ops: k
                    .nodes
                    .iter()
                    .map(|&n| g.g[n].op.name().to_string())
                    .collect(),
                inputs: k.inputs.clone(),
                outputs: k.outputs.clone(),
                transposed_inputs: (0..k.input_views.len())
                    .filter(|&i| k.input_views[i].is_some())
                    .collect(),
                epilogue: match &k.body {
                    Body::Gemm(_, e) => Some(GemmEpilogue {
                        name: e.name(),
                        bias: e.bias,
                        residual: e.residual,
                        pre_activation_out: e.gelu.then_some(1),
                        pre_activation_in: e.dgelu,
                    }),
                    _ => None,
                },
                gemm: match &k.body {
                    Body::Gemm(n, _) | Body::Op(n) if matches!(g.g[*n].op, Op::MatMul(_)) => {
                        gemm::gemm_shape(g, p, k, *n, dims).ok()
                    }
                    _ => None,
                },
                split_scratch: None,
                steps: Vec::new(),
            }
        })
        .collect::<Vec<Launch>>();
    let mut launches = launches;
    for (ki, (k, l)) in p.kernels.iter().zip(launches.iter_mut()).enumerate() {
        let choice = selection.map(|s| &s.choices[ki]);
        l.steps = match choice {
            Some(Choice::Templates(ks)) => {
                l.kind = LaunchKind::Template;
                ks.iter()
                    .map(|f| template_step(&f.launch, scratch_of.get(&ki).copied(), &env))
                    .collect::<Result<_, _>>()?
            }
            Some(Choice::SplitGemm) => {
                l.split_scratch = scratch_of.get(&ki).copied();
                Vec::new()
            }
            Some(Choice::Library | Choice::Missing | Choice::Collective) => Vec::new(),
            _ if l.kind == LaunchKind::Generated => vec![generated_step(g, p, k, &env)],
            _ => Vec::new(),
        };
    }
    let plan = Plan {
        model: g.name.clone(),
        dims: dims.clone(),
        arena_bytes: top,
        bytes_by_kind,
        buffers: out,
        launches,
        target: selection.map(|s| s.target.describe()),
        fallbacks: selection.map_or(Vec::new(), |s| s.fallbacks.clone()),
        collectives: buckets,
        size_args: g.dims.clone(),
        loss: output_buffer(g, p, &Role::Loss),
        grad_norm: output_buffer(g, p, &Role::GradNorm),
    };
    // Checked in every build: the check is linear in the buffers but for
    // the ones that overlap in the arena, and a clash would corrupt values
    // on the GPU without an error.
    plan.verify().map_err(|problems| {
        PlanError(format!(
            "internal error: the memory plan is invalid:\n  {}\nthis is a bug in fusec; please report it with the model file",
            problems.join("\n  ")
        ))
    })?;
    Ok(plan)
}

/// The launch of generated kernel `k`: one dimension of blocks of `BLOCK`
/// threads, at most 2^20 blocks (the kernels loop over the rest).
fn generated_step(
    g: &Graph,
    p: &Program,
    k: &crate::kernel::Kernel,
    env: &dyn Fn(&str) -> Option<i64>,
) -> LaunchStep {
    let shape = match &k.body {
        Body::Pointwise(pw) => Some(Shape::Elements(pw.n.clone())),
        Body::Op(n) => shape_of(g, *n),
        _ => None,
    };
    let blocks = match (&k.body, &shape) {
        // A block per chunk of a member (see emit::group).
        (Body::Group(members), _) => members
            .iter()
            .map(|m| {
                g.g[m.node].outputs[0]
                    .numel()
                    .eval(env)
                    .map(|n| (n.max(0) as u64).div_ceil(crate::emit::group::GROUP_CHUNK as u64))
            })
            .sum::<Option<u64>>()
            .map(|n| n.clamp(1, 1 << 20)),
        // A tile of columns by a run of rows a block (emit::pointwise_sum).
        (Body::Pointwise(pw), _) if pw.sum.is_some() => {
            crate::emit::pointwise_sum::blocks(p, k, pw, env)
        }
        // Each thread takes a 16-byte vector of elements.
        (Body::Pointwise(pw), Some(Shape::Elements(n))) => n.eval(env).map(|n| {
            let vec = crate::emit::cuda::vector_width(p, k, pw);
            ((n.max(0) as u64).div_ceil(vec).div_ceil(BLOCK)).clamp(1, 1 << 20)
        }),
        _ => shape.as_ref().and_then(|s| grid(s, env)),
    };
    LaunchStep {
        function: k.name.clone(),
        template: None,
        arch_specific: false,
        grid: [blocks.unwrap_or(1), 1, 1],
        block: BLOCK,
        dynamic_smem_bytes: 0,
        scratch: None,
        tensor_maps: Vec::new(),
    }
}

/// The launch of a template instance at the plan's sizes.
fn template_step(
    l: &crate::emit::launch::KernelLaunch,
    scratch: Option<usize>,
    env: &dyn Fn(&str) -> Option<i64>,
) -> Result<LaunchStep, PlanError> {
    let grid = l.grid(env).ok_or_else(|| {
        PlanError(format!(
            "kernel {}: its grid ({}) does not fit the GPU's limits (at most 65535 blocks along y and z)",
            l.name,
            l.grid_c().join(", ")
        ))
    })?;
    let tensor_maps = l
        .tensor_maps
        .iter()
        .map(|m| {
            Ok(PlannedMap {
                name: m.name.clone(),
                arg: m.arg,
                sizes: m.sizes(env).ok_or_else(|| {
                    PlanError(format!(
                        "kernel {}: tensor map {} has no size",
                        l.name, m.name
                    ))
                })?,
                swizzle: m.swizzle,
            })
        })
        .collect::<Result<_, PlanError>>()?;
    Ok(LaunchStep {
        function: l.name.clone(),
        template: l.template.clone(),
        arch_specific: l.arch_specific,
        grid,
        block: l.block as u64,
        dynamic_smem_bytes: l.dynamic_smem_bytes,
        scratch: l.scratch_f32.as_ref().and(scratch),
        tensor_maps,
    })
}

/// Whether `kernel` reads input `slot` only at the element (or row) it
/// writes, after which the output may take that input's storage.
fn in_place_ok(g: &Graph, kernel: &crate::kernel::Kernel, slot: usize) -> bool {
    use crate::kernel::PExpr;
    match &kernel.body {
        Body::Pointwise(pw) => pw.exprs.iter().all(|e| match e {
            PExpr::Load { input, view } => *input != slot || view.is_contiguous(),
            _ => true,
        }),
        // A prologue's inputs are read as its chain reads them.
        Body::Op(_) if kernel.prologue.is_some() => false,
        // The residual is read at the element out0 writes.
        Body::Op(_) if kernel.residual == Some(slot) => true,
        Body::Op(n) => {
            shape_of(g, *n).is_some()
                && match &g.g[*n].op {
                    Op::Softmax(_)
                    | Op::LayerNorm(_)
                    | Op::RmsNorm(_)
                    | Op::CrossEntropyGrad(_)
                    | Op::CrossEntropyWithGrad(_)
                    | Op::CausalMask(_) => slot == 0,
                    Op::SoftmaxGrad(_) => slot <= 1,
                    _ => false,
                }
        }
        Body::Group(_) | Body::Gemm(..) => false,
    }
}

/// The textbook count for mixed-precision training with the plan's
/// optimizer: 4 bytes per parameter each for the f32 master weights and
/// gradients, plus the optimizer state as planned (8 bytes per parameter for
/// AdamW), plus every forward value the backward pass reads (the activations
/// kept for it), at its dtype.
pub fn textbook_bytes(g: &Graph, dims: &BTreeMap<String, i64>) -> Option<u64> {
    use crate::ir::graph::Phase;
    let env = |s: &str| dims.get(s).copied();
    let params = g.param_count()? as u64;
    let state: u64 = g
        .topo_order()
        .into_iter()
        .filter_map(|n| match &g.g[n].op {
            Op::State(st) => Some(st.ty.numel().eval(&env)? as u64 * 4),
            _ => None,
        })
        .sum();
    let mut kept = 0u64;
    for n in g.topo_order() {
        let node = &g.g[n];
        if node.phase != Phase::Forward || node.op.is_source() {
            continue;
        }
        for (port, ty) in node.outputs.iter().enumerate() {
            let v = crate::ir::Value { node: n, port };
            if g.users(v)
                .iter()
                .any(|(u, _)| g.g[*u].phase == Phase::Backward)
            {
                kept += ty.numel().eval(&env)? as u64 * ty.dtype.size_bytes() as u64;
            }
        }
    }
    Some(8 * params + state + kept)
}

impl Plan {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

/// Elements a buffer of `n` values of `shape` takes with its rows `pitch`
/// apart and `zero_rows` more rows after the last (a vector's rows are its
/// elements).
fn padded(n: u64, shape: &[i64], pitch: Option<i64>, zero_rows: i64) -> Option<u64> {
    if shape.len() == 1 {
        return n.checked_add(zero_rows as u64);
    }
    let Some(&last) = shape.last().filter(|&&l| l > 0) else {
        return Some(n);
    };
    let rows = (n / last as u64).checked_add(zero_rows as u64)?;
    rows.checked_mul(pitch.unwrap_or(last) as u64)
}

fn is_zero(x: &i64) -> bool {
    *x == 0
}
