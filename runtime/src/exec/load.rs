//! Building an executor from a plan: the arena, the kernels' modules and
//! every launch resolved once to ready addresses, so that a step does no
//! lookups at all.

use super::{Executor, KernelCall, Launch, Slot, Step};
use crate::device::Gpu;
use crate::gemm::{EpiloguePtrs, Gemm};
use crate::gemm_split::SplitKernels;
use crate::nccl;
use crate::RuntimeError;
use cudarc::driver::{CudaFunction, DevicePtr};
use fusec_compiler::emit::gemm_split::SPLIT_SOURCE;
use fusec_compiler::plan::{LaunchKind, MemKind, Plan};
use std::collections::HashMap;

impl Executor {
    /// Allocates the arena and loads every kernel. `cubins[i]` is the image
    /// of `sources[i]` (kernel name, CUDA C).
    pub fn new(
        gpu: Gpu,
        plan: &Plan,
        sources: &[(String, String)],
        cubins: crate::cache::Cubins,
    ) -> Result<Executor, RuntimeError> {
        let free = gpu.free_bytes()?;
        // cuBLASLt's workspace and the context need some room too.
        let need = plan.arena_bytes + (64 << 20);
        if need > free {
            return Err(RuntimeError::OutOfMemory {
                need_gib: need as f64 / (1u64 << 30) as f64,
                free_gib: free as f64 / (1u64 << 30) as f64,
            });
        }
        let arena = gpu
            .stream
            .alloc_zeros::<u8>(plan.arena_bytes.max(256) as usize)
            .map_err(|e| RuntimeError::driver("allocating the arena", e))?;
        let base = {
            let (ptr, _sync) = arena.device_ptr(&gpu.stream);
            ptr
        };
        let slots: Vec<Slot> = plan
            .buffers
            .iter()
            .map(|pb| Slot {
                offset: pb.offset,
                bytes: pb.bytes,
                dtype: pb.dtype,
                shape: pb.shape.iter().map(|&d| d.max(0) as usize).collect(),
                pitch: pb.pitch.map(|x| x.max(0) as usize),
            })
            .collect();
        let (mut inputs, mut params, mut state) = (HashMap::new(), HashMap::new(), HashMap::new());
        for (i, b) in plan.buffers.iter().enumerate() {
            let names = match b.kind {
                MemKind::Input => &mut inputs,
                MemKind::Param => &mut params,
                MemKind::OptimizerState => &mut state,
                _ => continue,
            };
            names.insert(b.name.clone(), i);
        }
        let dims: Vec<i64> = plan
            .size_args
            .iter()
            .map(|d| {
                plan.dims.get(d).copied().ok_or_else(|| {
                    RuntimeError::Unsupported(format!("the size of dimension {d} is not set"))
                })
            })
            .collect::<Result<_, _>>()?;
        let by_name: HashMap<&str, usize> = sources
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.as_str(), i))
            .collect();
        let mut modules: HashMap<usize, std::sync::Arc<cudarc::driver::CudaModule>> =
            HashMap::new();
        // One module per distinct source, shared by the kernels compiled
        // from it (cache::SHARED_NAME).
        let mut function = |si: usize, name: &str| -> Result<CudaFunction, RuntimeError> {
            let image = cubins.of_kernel[si];
            let module = match modules.get(&image) {
                Some(m) => std::sync::Arc::clone(m),
                None => {
                    let m = gpu
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(
                            cubins.images[image].clone(),
                        ))
                        .map_err(|e| RuntimeError::driver(&format!("loading kernel {name}"), e))?;
                    modules.insert(image, std::sync::Arc::clone(&m));
                    m
                }
            };
            module
                .load_function(&crate::cache::shared_function(&sources[si].0, name))
                .map_err(|e| RuntimeError::driver(&format!("finding kernel {name}"), e))
        };
        let ptr = |b: usize| base + slots[b].offset;
        let mut launches = Vec::with_capacity(plan.launches.len());
        let mut gemm = None;
        for (ki, l) in plan.launches.iter().enumerate() {
            let args: Vec<u64> = l.inputs.iter().chain(&l.outputs).map(|&b| ptr(b)).collect();
            let step = if l.kind == fusec_compiler::plan::LaunchKind::AllGather {
                let planned = plan.collectives.iter().find(|c| c.launch == ki);
                let (Some(c), Some(ga)) = (planned, planned.and_then(|c| c.gather.as_ref())) else {
                    return Err(RuntimeError::Unsupported(format!(
                        "internal error: launch {} gathers a parameter the plan has no gather for; this is a bug in fusec",
                        l.kernel
                    )));
                };
                let (i, o) = c.tensors[0];
                if slots[o].pitch.is_some() {
                    return Err(RuntimeError::Unsupported(format!(
                        "internal error: {} gathers into a buffer with padded rows, which a gather does not write; this is a bug in fusec",
                        l.kernel
                    )));
                }
                Step::Collective(super::Bucket {
                    all: Vec::new(),
                    every_micro_batch: true,
                    owned: Vec::new(),
                    kept: Vec::new(),
                    gather: Some(super::Gather {
                        input: ptr(i),
                        output: ptr(o),
                        dtype: slots[o].dtype,
                        pieces: ga.pieces.clone(),
                        join: c.join,
                    }),
                })
            } else if l.kind == fusec_compiler::plan::LaunchKind::AllReduce {
                let planned = plan.collectives.iter().find(|c| c.launch == ki);
                let owners_of = planned.map_or(&[][..], |c| &c.owners_of[..]);
                let pieces = planned.map_or(&[][..], |c| &c.pieces[..]);
                let tensors = l
                    .inputs
                    .iter()
                    .zip(&l.outputs)
                    .map(|(&i, &o)| {
                        let s = &slots[i];
                        nccl::Tensor {
                            input: ptr(i),
                            output: ptr(o),
                            // Padded rows and all: the padding averages to itself.
                            count: (s.bytes / s.dtype.size_bytes() as u64) as usize,
                            dtype: s.dtype,
                        }
                    })
                    .collect::<Vec<_>>();
                // ZeRO's gradients (to their owners) apart from the rest.
                let (mut all, mut owned, mut kept) = (Vec::new(), Vec::new(), Vec::new());
                for (j, t) in tensors.into_iter().enumerate() {
                    match owners_of.get(j).copied().flatten() {
                        Some(p) => {
                            owned.push((t, p));
                            kept.push(pieces.get(j).copied().flatten());
                        }
                        None => all.push(t),
                    }
                }
                if pieces.is_empty() {
                    kept.clear();
                }
                Step::Collective(super::Bucket {
                    all: nccl::coalesce(&all, fusec_compiler::plan::ALIGN),
                    every_micro_batch: planned.is_some_and(|c| c.every_micro_batch),
                    owned,
                    kept,
                    gather: None,
                })
            } else if !l.steps.is_empty() {
                // The kernels the plan launches: the generated one, or the
                // template instances chosen in its place.
                let mut steps = Vec::new();
                for st in &l.steps {
                    let si = *by_name.get(st.function.as_str()).ok_or_else(|| {
                        RuntimeError::Unsupported(format!(
                            "kernel {} has no compiled source",
                            st.function
                        ))
                    })?;
                    let func = function(si, &st.function)?;
                    steps.push(Step::Kernel(KernelCall::of_step(
                        func,
                        st,
                        args.clone(),
                        st.scratch.map(|b| base + plan.buffers[b].offset),
                        &gpu,
                        "FUSEC_ATTENTION=simple",
                    )?));
                }
                match steps.len() {
                    1 => steps.remove(0),
                    _ => Step::Sequence(steps),
                }
            } else {
                match l.kind {
                    LaunchKind::Gemm => {
                        let spec = *l.gemm.as_ref().ok_or_else(|| {
                            RuntimeError::Unsupported(format!(
                                "kernel {}: a matrix product cuBLASLt does not run (integers, or operands that broadcast only some batch axes)",
                                l.kernel
                            ))
                        })?;
                        let mut ep = EpiloguePtrs::default();
                        if let Some(e) = &l.epilogue {
                            ep.bias = e.bias.map(|s| ptr(l.inputs[s]));
                            ep.residual = e.residual.map(|s| ptr(l.inputs[s]));
                            ep.dgelu_aux_in = e.pre_activation_in.map(|s| ptr(l.inputs[s]));
                            ep.gelu_aux_out = e.pre_activation_out.map(|s| ptr(l.outputs[s]));
                        }
                        let g = match &mut gemm {
                            Some(g) => g,
                            None => gemm.insert(
                                Gemm::new(&gpu.stream)
                                    .map_err(|e| RuntimeError::Gemm(e.to_string()))?,
                            ),
                        };
                        let split = l
                            .split_scratch
                            .map(|b| (base + plan.buffers[b].offset, plan.buffers[b].bytes / 4));
                        if split.is_some() && g.split_kernels.is_none() {
                            let si = *by_name.get(SPLIT_SOURCE).ok_or_else(|| {
                                RuntimeError::Unsupported(format!(
                                    "kernel {} splits its operands for TF32, and the step has no {SPLIT_SOURCE}",
                                    l.kernel
                                ))
                            })?;
                            g.split_kernels = Some(SplitKernels::load(|f| function(si, f))?);
                        }
                        Step::Gemm {
                            spec,
                            a: ptr(l.inputs[0]),
                            b: ptr(l.inputs[1]),
                            d: ptr(l.outputs[0]),
                            ep,
                            split,
                        }
                    }
                    _ => {
                        return Err(RuntimeError::Unsupported(format!(
                            "kernel {} ({}) has no generated code and no library call yet",
                            l.kernel,
                            l.ops.join(" + ")
                        )));
                    }
                }
            };
            launches.push(Launch {
                name: l.kernel.clone(),
                step,
            });
        }
        Ok(Executor {
            gpu,
            arena,
            base,
            launches,
            gemm,
            dims,
            slots,
            inputs,
            params,
            state,
            loss: plan.loss,
            grad_norm: plan.grad_norm,
            logits: plan.logits,
            token_losses: plan.token_losses,
            next_tokens: plan.next_tokens,
            arena_bytes: plan.arena_bytes,
            graphs: [None, None],
            ran: [false, false],
            collectives_on: true,
            joins: {
                let mut j = vec![super::Join::default(); plan.launches.len() + 1];
                for c in &plan.collectives {
                    let at = &mut j[c.join.min(plan.launches.len())];
                    match c.gather {
                        Some(_) => at.gathers = true,
                        None => at.reduces = true,
                    }
                }
                j
            },
            dp: None,
            stager: None,
            marks: None,
            written: false,
        })
    }
}
