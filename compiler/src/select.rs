//! Kernel selection: the stage between fusion and the memory plan. For a
//! target (the GPU architecture compiled for, and whether runs must repeat
//! bit for bit) it decides what runs each kernel of the program: a cuBLASLt
//! call, the kernel generated for it, or instances of the hand-written
//! templates in `kernels/` with launches of their own (the tensor-core
//! attention). The memory plan carries the result, launch by launch
//! (`plan::plan_with`), and the runtime launches what the plan says;
//! `fusec build --device` writes exactly these kernels.

use crate::emit::cuda::emit_program;
use crate::emit::flash::{self, FlashKernel};
use crate::emit::gemm_skinny;
use crate::emit::gemm_split::{split_source, SPLIT_SOURCE};
use crate::emit::launch::KernelLaunch;
use crate::ir::Graph;
use crate::kernel::{Body, Program};
use crate::ops::Op;
use crate::optimisation::Optimisation;
use std::collections::BTreeMap;
use std::fmt::Write;

pub use crate::target::{F32Math, Target};

/// What runs one kernel of the program.
#[derive(Clone, Debug)]
pub enum Choice {
    /// A cuBLASLt call (a GEMM and its epilogue).
    Library,
    /// An f32 GEMM as three TF32 products: its operands split into the
    /// plan's scratch by the [`SPLIT_SOURCE`] kernels, then one cuBLASLt
    /// call over K tripled (`kernels/gemm/split_tf32.cuh`).
    SplitGemm,
    /// The kernel generated for it, under the program kernel's name; the
    /// plan works out its grid.
    Generated,
    /// Instances of `kernels/` templates, launched in this order, each with
    /// its own grid, block, shared memory and tensor maps.
    Templates(Vec<FlashKernel>),
    /// A product of few rows as `kernels/gemm/skinny.cuh` under the
    /// program kernel's name (chosen only where the sizes are known:
    /// `select_at`), with its epilogue.
    Skinny(Box<KernelLaunch>),
    /// A bucket of gradients averaged over the data-parallel ranks: NCCL
    /// calls on the communication stream (kernel::buckets).
    Collective,
    /// Nothing runs it yet (an error when a step is started).
    Missing,
}

/// The selection for a whole program.
#[derive(Clone, Debug)]
pub struct Selection {
    pub target: Target,
    /// One per kernel of the program, in its order.
    pub choices: Vec<Choice>,
    /// Every kernel to compile: (function name, CUDA source), generated
    /// kernels and template instances alike.
    pub sources: Vec<(String, String)>,
    /// Attention kernels left on the simple kernels on a target that has
    /// tensor-core ones: (program kernel, why).
    pub fallbacks: Vec<(String, String)>,
}

/// Chooses the kernels of program `p` (of graph `g`) for `target`; `source`
/// is the model file, for the kernels' comments.
pub fn select(g: &Graph, p: &Program, target: &Target, source: Option<&str>) -> Selection {
    select_at(g, p, target, source, None)
}

/// [`select`] at the step's sizes where they are known (`dims`): then a
/// product of few rows runs as a skinny GEMM of our own rather than a
/// cuBLASLt call (`emit::gemm_skinny`).
pub fn select_at(
    g: &Graph,
    p: &Program,
    target: &Target,
    source: Option<&str>,
    dims: Option<&BTreeMap<String, i64>>,
) -> Selection {
    let simple = Target {
        arch: None,
        ..target.clone()
    };
    let (tensor_cores, f32_math) = (target.arch.is_some(), target.f32_math);
    let target = match target.lower.on(Optimisation::TensorCoreAttention) {
        true => target,
        false => &simple,
    };
    let mut generated = emit_program(g, p, source);
    // f32 GEMMs take three TF32 products where the GPU has TF32 tensor
    // cores (every target with tensor-core attention: sm_80 on).
    let split = |k: &crate::kernel::Kernel| {
        tensor_cores
            && f32_math == F32Math::ThreeTf32
            && k.inputs[..2]
                .iter()
                .all(|&b| p.buffers[b].ty.dtype == crate::ir::DType::F32)
    };
    // A product of few rows at the plan's sizes: the skinny kernel (plain
    // CUDA, for any GPU; whatever runs the attention).
    let skinny = |k: &crate::kernel::Kernel, n: petgraph::stable_graph::NodeIndex| {
        let dims = dims.filter(|_| target.lower.on(Optimisation::SkinnyGemm))?;
        let shape = crate::kernel::gemm::gemm_shape(g, p, k, n, dims).ok()?;
        let fit = gemm_skinny::fit(p, k, &shape, target.multiprocessors).ok()?;
        Some(gemm_skinny::launch(g, p, k, &shape, &fit, source))
    };
    let mut choices = Vec::with_capacity(p.kernels.len());
    let mut fallbacks = Vec::new();
    let mut templates = Vec::new();
    for k in &p.kernels {
        let has_source = generated.iter().any(|(name, _)| *name == k.name);
        let choice = match &k.body {
            _ if crate::kernel::buckets::is_collective(g, k)
                || crate::kernel::gathers::is_gather(g, k) =>
            {
                Choice::Collective
            }
            Body::Gemm(n, _) | Body::Op(n)
                if matches!(g.g[*n].op, Op::MatMul(_)) && !has_source =>
            {
                match skinny(k, *n) {
                    Some(l) => {
                        templates.push((l.name.clone(), l.source.clone()));
                        Choice::Skinny(Box::new(l))
                    }
                    None if split(k) => Choice::SplitGemm,
                    None => Choice::Library,
                }
            }
            Body::Op(n) if matches!(g.g[*n].op, Op::Attention(_) | Op::AttentionGrad(_)) => {
                let chosen = target.arch.and_then(|arch| match g.g[*n].op {
                    Op::Attention(_) => flash::flash_forward(
                        g,
                        p,
                        k,
                        *n,
                        source,
                        arch,
                        target.multiprocessors,
                        target.f32_math.attention_tf32(),
                    )
                    .map(|f| vec![f]),
                    _ => flash::flash_backward(
                        g,
                        p,
                        k,
                        *n,
                        source,
                        target.deterministic,
                        arch,
                        target.f32_math.attention_tf32(),
                    ),
                });
                match chosen {
                    Some(kernels) => {
                        templates.extend(
                            kernels
                                .iter()
                                .map(|f| (f.launch.name.clone(), f.launch.source.clone())),
                        );
                        Choice::Templates(kernels)
                    }
                    None => {
                        if target.arch.is_some() {
                            let why = flash::why_not(g, p, k, *n)
                                .unwrap_or_else(|| "its sizes do not fit a launch".into());
                            fallbacks.push((k.name.clone(), why));
                        }
                        if has_source {
                            Choice::Generated
                        } else {
                            Choice::Missing
                        }
                    }
                }
            }
            _ if has_source => Choice::Generated,
            _ => Choice::Missing,
        };
        choices.push(choice);
    }
    // What runs, and only that: a kernel a template replaces is not compiled.
    let replaced: Vec<&str> = p
        .kernels
        .iter()
        .zip(&choices)
        .filter(|(_, c)| matches!(c, Choice::Templates(_)))
        .map(|(k, _)| k.name.as_str())
        .collect();
    generated.retain(|(name, _)| !replaced.contains(&name.as_str()));
    generated.extend(templates);
    if choices.iter().any(|c| matches!(c, Choice::SplitGemm)) {
        generated.push((SPLIT_SOURCE.to_string(), split_source()));
    }
    let selection = Selection {
        target: target.clone(),
        choices,
        sources: generated,
        fallbacks,
    };
    // Checked in every build, as fusion's program is: a function without a
    // source would fail only when the step starts on the GPU.
    if let Err(problems) = selection.verify(p) {
        panic!(
            "internal error: the kernel selection is invalid; this is a bug in fusec, \
             please report it with the model file:\n{}",
            problems.join("\n")
        );
    }
    selection
}

impl Selection {
    /// The selection's own invariants, checked after it in every build:
    /// one choice per kernel, a source for every function that will be
    /// launched (a generated kernel under its kernel's name, each template
    /// instance under its own), and no two sources of one name (the
    /// runtime finds a function by name).
    pub fn verify(&self, p: &Program) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        if self.choices.len() != p.kernels.len() {
            problems.push(format!(
                "{} choices for {} kernels",
                self.choices.len(),
                p.kernels.len()
            ));
        }
        let has = |name: &str| self.sources.iter().any(|(n, _)| n == name);
        for (k, c) in p.kernels.iter().zip(&self.choices) {
            match c {
                Choice::Generated if !has(&k.name) => problems.push(format!(
                    "{} runs its generated kernel, which has no source",
                    k.name
                )),
                Choice::SplitGemm if !has(SPLIT_SOURCE) => problems.push(format!(
                    "{} splits its operands, and {SPLIT_SOURCE} has no source",
                    k.name
                )),
                Choice::Skinny(l) if !has(&l.name) => problems.push(format!(
                    "{} runs a skinny product, which has no source",
                    k.name
                )),
                Choice::Templates(ks) => {
                    for f in ks.iter().filter(|f| !has(&f.launch.name)) {
                        problems.push(format!(
                            "{} runs {}, which has no source",
                            k.name, f.launch.name
                        ));
                    }
                }
                _ => {}
            }
        }
        let mut names: Vec<&str> = self.sources.iter().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        for w in names.windows(2).filter(|w| w[0] == w[1]) {
            problems.push(format!("two kernels are named {}", w[0]));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }

    /// The program kernels that run template instances: kernel name -> the
    /// functions launched in its place, in order.
    pub fn replaced(&self, p: &Program) -> Vec<(String, Vec<String>)> {
        p.kernels
            .iter()
            .zip(&self.choices)
            .filter_map(|(k, c)| match c {
                Choice::Templates(ks) => Some((
                    k.name.clone(),
                    ks.iter().map(|f| f.launch.name.clone()).collect(),
                )),
                _ => None,
            })
            .collect()
    }

    /// The text `--dump-after select` prints: what runs each kernel.
    pub fn print(&self, g: &Graph, p: &Program) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# kernels for {}", self.target.describe());
        for (k, c) in p.kernels.iter().zip(&self.choices) {
            let ops: Vec<&str> = k.nodes.iter().map(|&n| g.g[n].op.name()).collect();
            let what = match c {
                Choice::Library => "cuBLASLt".to_string(),
                Choice::SplitGemm => {
                    format!("cuBLASLt, three TF32 products (operands split by {SPLIT_SOURCE}_*)")
                }
                Choice::Generated => "generated".to_string(),
                Choice::Skinny(l) => format!(
                    "skinny GEMM {}, grid ({}), block {}{}",
                    l.template.as_deref().unwrap_or("?"),
                    l.grid_c()[0],
                    l.block,
                    l.scratch_f32
                        .as_ref()
                        .map_or(String::new(), |e| format!(", f32 scratch [{e}]"))
                ),
                Choice::Missing => "nothing yet".to_string(),
                Choice::Collective => {
                    "NCCL all-reduce (mean over the ranks), on the communication stream".to_string()
                }
                Choice::Templates(ks) => {
                    let mut t = String::from("templates:");
                    for f in ks {
                        let l = &f.launch;
                        let g = l.grid_c();
                        let _ = write!(
                            t,
                            "\n    {} = {}\n      grid ({}, {}, {}), block {}, {} bytes dynamic shared{}{}",
                            l.name,
                            l.template.as_deref().unwrap_or("?"),
                            g[0],
                            g[1],
                            g[2],
                            l.block,
                            l.dynamic_smem_bytes,
                            l.scratch_f32
                                .as_ref()
                                .map_or(String::new(), |e| format!(", f32 scratch [{e}]")),
                            if l.tensor_maps.is_empty() {
                                String::new()
                            } else {
                                let names: Vec<&str> =
                                    l.tensor_maps.iter().map(|m| m.name.as_str()).collect();
                                format!(", tensor maps {}", names.join(", "))
                            }
                        );
                    }
                    t
                }
            };
            let _ = writeln!(s, "{} ({}): {what}", k.name, ops.join(" + "));
        }
        for (k, why) in &self.fallbacks {
            let _ = writeln!(s, "# {k} runs the simple attention kernels: {why}");
        }
        s
    }
}
