//! Each kernel's launch: what runs it (a generated kernel, template
//! instances, cuBLASLt with its product and epilogue, a collective) and
//! its geometry at the plan's sizes.

use super::{gemm, GemmEpilogue, Launch, LaunchKind, LaunchStep, PlanError, PlannedMap};
use crate::emit::templates::{grid, shape_of, Shape, BLOCK};
use crate::ir::graph::Graph;
use crate::ir::Dim;
use crate::kernel::buckets::is_collective;
use crate::kernel::{Body, Program};
use crate::ops::Op;
use crate::select::{Choice, Selection};
use std::collections::{BTreeMap, HashMap};

/// The launches of program `p` for the kernels `selection` chose, each
/// template set or split GEMM with its scratch buffer from `scratch_of`.
pub(super) fn launches(
    g: &Graph,
    p: &Program,
    selection: Option<&Selection>,
    dims: &BTreeMap<String, i64>,
    scratch_of: &HashMap<usize, usize>,
) -> Result<Vec<Launch>, PlanError> {
    let env = |s: &str| dims.get(s).copied();
    let launches = p
        .kernels
        .iter()
        .map(|k| {
            let shape = match &k.body {
                Body::Pointwise(pw) => Some(Shape::Elements(pw.n.clone())),
                Body::Op(n) => shape_of(g, *n),
                Body::Gemm(..) => None,
                // Sums side by side: a grid of their work items
                // (generated_step counts them).
                Body::Group(members) if sums(g, members) => Some(Shape::Rows(Dim::constant(1))),
                Body::Group(members) => members
                    .iter()
                    .map(|m| match (&m.chain, shape_of(g, m.node)) {
                        (Some(c), _) => Some(c.1.n.clone()),
                        (None, Some(Shape::Elements(n))) => Some(n),
                        _ => None,
                    })
                    .try_fold(Dim::constant(0), |acc, n| acc.checked_add(&n?))
                    .map(Shape::Elements),
            };
            Launch {
                kernel: k.name.clone(),
                kind: match (&k.body, &shape) {
                    _ if is_collective(g, k) => LaunchKind::AllReduce,
                    _ if crate::kernel::gathers::is_gather(g, k) => LaunchKind::AllGather,
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
            Some(Choice::Skinny(launch)) => {
                // Still a product to the report (its shape and epilogue),
                // run by a kernel of ours.
                l.kind = LaunchKind::Template;
                vec![template_step(launch, scratch_of.get(&ki).copied(), &env)?]
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
    Ok(launches)
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
        // Every member's work items (see emit::group).
        (Body::Group(members), _) if sums(g, members) => {
            crate::emit::group::sum_group_blocks(g, members, env)
        }
        // A block per chunk of a member (see emit::group).
        (Body::Group(members), _) => members
            .iter()
            .map(|m| {
                let own = || match shape_of(g, m.node) {
                    Some(Shape::Elements(n)) => n,
                    _ => g.g[m.node].outputs[0].numel(),
                };
                m.chain
                    .as_ref()
                    .map_or_else(own, |c| c.1.n.clone())
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
        // A norm forward a warp a row: blocks of BLOCK / 32 warps for its
        // rows alone, at most FORWARD_BLOCKS (a decode step's few rows
        // launched 2048 blocks, all but one idle).
        (Body::Op(n), _) if crate::kernel::forms::norm_forward_rows(g, *n).is_some() => {
            crate::emit::templates::rows_of(g, *n).eval(env).map(|r| {
                (r.max(1) as u64)
                    .div_ceil(BLOCK / 32)
                    .min(crate::emit::norm_rows::FORWARD_BLOCKS as u64)
            })
        }
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

/// A group kernel of leading-axis sums (kernel::groups::group_adjacent_sums).
fn sums(g: &Graph, members: &[crate::kernel::Member]) -> bool {
    members
        .iter()
        .all(|m| matches!(g.g[m.node].op, Op::Reduce(_)))
}
