//! The plan as the runtime reads it (and `plan.json` writes it): every
//! buffer with its offset, dtype, shape and kind, every launch with what
//! runs it, the collectives, the sizes in kernel-argument order.

use super::collectives;
use super::gemm;
use crate::emit::flash::tma::TensorMapSizes;
use crate::ir::DType;
use serde::Serialize;
use std::collections::BTreeMap;

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
    /// Instances of `kernels/` templates (the attention's; a product of
    /// few rows as `kernels/gemm/skinny.cuh`, its `gemm` and `epilogue`
    /// still said).
    Template,
    /// A bucket's gradients averaged over the data-parallel ranks.
    AllReduce,
    /// A parameter gathered whole from its owners' pieces (ZeRO stage 3),
    /// on the communication stream like an all-reduce.
    AllGather,
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
    /// Whether it runs on the communication stream (a collective).
    pub fn communicates(&self) -> bool {
        matches!(self, LaunchKind::AllReduce | LaunchKind::AllGather)
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            LaunchKind::Generated => "generated",
            LaunchKind::Template => "template",
            LaunchKind::AllReduce => "all_reduce",
            LaunchKind::AllGather => "all_gather",
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
    /// The buffer of the logits, in a step that outputs them (a decode
    /// step's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logits: Option<usize>,
    /// The buffer of the per-token losses, in a step that outputs them (a
    /// scoring step's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_losses: Option<usize>,
    /// The buffer of the greedy picks, in a step that outputs them (a
    /// greedy decode step's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_tokens: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PlanError(pub String);

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Plan {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

fn is_zero(x: &i64) -> bool {
    *x == 0
}
