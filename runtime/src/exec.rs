//! One training step on the GPU, as the plan lays it out: one arena, every
//! buffer at its planned offset, the kernels launched in plan order (the
//! generated ones from their cubins, GEMMs through cuBLASLt with their
//! epilogues).

use crate::device::Gpu;
use crate::gemm::{EpiloguePtrs, Gemm, GemmShape};
use crate::gemm_split::SplitKernels;
use crate::nccl;
use crate::stage::Stager;
use crate::tensor_map::{encode_sizes, EncodedMap};
use crate::RuntimeError;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use fusec_compiler::dtype::DType;
use fusec_compiler::emit::gemm_split::SPLIT_SOURCE;

mod arena;
mod codec;
mod data_parallel;
mod gather;
mod profile;
pub use codec::{decode, encode, encode_filled};
pub use data_parallel::{CollectiveTime, DataParallel, StepProfile};
use fusec_compiler::plan::{LaunchKind, MemKind, Plan};
use std::collections::HashMap;

/// One kernel launch, ready: the function, its geometry and its arguments
/// in the order every fusec kernel takes them (buffers, then the size
/// parameters given at launch, then the scratch where it takes one, then
/// its tensor maps by value). The executor, `fusec bench-attention` and the
/// GPU tests all launch through it.
pub struct KernelCall {
    pub func: CudaFunction,
    pub name: String,
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Buffer addresses: the kernel's inputs, then its outputs.
    pub args: Vec<u64>,
    /// A pointer passed after the sizes (the attention backward's scratch).
    pub extra: Option<u64>,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
    /// Tensor maps passed last, by value.
    pub maps: Vec<EncodedMap>,
}

impl KernelCall {
    /// The call of one planned launch step of `func` on the buffers at
    /// `args` (and the scratch `extra`): its dynamic shared memory allowed
    /// (`without` says what to run where the GPU has too little), its
    /// tensor maps encoded, its grid clamped to the hardware's limits.
    pub fn of_step(
        func: CudaFunction,
        st: &fusec_compiler::plan::LaunchStep,
        args: Vec<u64>,
        extra: Option<u64>,
        gpu: &Gpu,
        without: &str,
    ) -> Result<KernelCall, RuntimeError> {
        let smem = st.dynamic_smem_bytes as u32;
        allow_dynamic_smem(&func, &st.function, smem, gpu, without)?;
        let maps = st
            .tensor_maps
            .iter()
            .map(|m| {
                encode_sizes(
                    &m.name,
                    m.arg,
                    &m.sizes,
                    m.swizzle,
                    &args,
                    &st.function,
                    without,
                )
            })
            .collect::<Result<_, _>>()?;
        let [x, y, z] = st.grid;
        Ok(KernelCall {
            func,
            name: st.function.clone(),
            grid: (
                x.clamp(1, u32::MAX as u64) as u32,
                y.clamp(1, 65535) as u32,
                z.clamp(1, 65535) as u32,
            ),
            block: st.block as u32,
            args,
            extra,
            smem,
            maps,
        })
    }

    /// Launches it on `gpu`'s stream with the size parameters `dims`.
    pub fn launch(&self, gpu: &Gpu, dims: &[i64]) -> Result<(), RuntimeError> {
        let mut b = gpu.stream.launch_builder(&self.func);
        for a in &self.args {
            b.arg(a);
        }
        for d in dims {
            b.arg(d);
        }
        if let Some(x) = &self.extra {
            b.arg(x);
        }
        for m in &self.maps {
            b.arg(m);
        }
        let cfg = LaunchConfig {
            grid_dim: self.grid,
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: self.smem,
        };
        // SAFETY: the arguments match the kernel's signature (inputs,
        // outputs, then every symbolic size, as the emitter writes it, then
        // the scratch where it takes one, then its tensor maps), and the
        // caller's pointers (the maps' too) lie inside live device buffers.
        unsafe { b.launch(cfg) }
            .map_err(|e| RuntimeError::driver(&format!("launching {}", self.name), e))?;
        Ok(())
    }
}

enum Step {
    Kernel(KernelCall),
    /// Several kernels doing one op, in order (the tensor-core attention
    /// backward's three).
    Sequence(Vec<Step>),
    Gemm {
        spec: GemmShape,
        a: u64,
        b: u64,
        d: u64,
        ep: EpiloguePtrs,
        /// f32 operands split for three TF32 products into this scratch
        /// (address, f32 elements) first.
        split: Option<(u64, u64)>,
    },
    /// A bucket averaged over the ranks, on the communication stream (see
    /// `DataParallel`); `true` where it runs on every micro-batch (the
    /// loss), not only on the one that updates. Under ZeRO its gradients
    /// go to their pieces' owners alone: those tensors, each with its
    /// parameter, are the third part.
    Collective(Vec<nccl::Tensor>, bool, Vec<(nccl::Tensor, usize)>),
}

struct Launch {
    name: String,
    step: Step,
}

/// A buffer of the plan as the executor sees it.
#[derive(Clone, Debug)]
pub struct Slot {
    pub offset: u64,
    /// Bytes in the arena (padded rows included).
    pub bytes: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Elements between rows where the rows are padded (kernel::pitch).
    pub pitch: Option<usize>,
}

impl Slot {
    /// Bytes of the values alone, rows packed: what `read` returns and
    /// `write` takes.
    pub fn packed_bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size_bytes() as u64
    }

    /// (row bytes, pitch bytes) of a padded buffer.
    fn rows(&self) -> Option<(usize, usize)> {
        let size = self.dtype.size_bytes();
        let last = *self.shape.last()?;
        self.pitch.map(|p| (last * size, p * size))
    }
}

/// When one launch of a profiled step ran (`Executor::profile_step`).
#[derive(Clone, Debug)]
pub struct LaunchTime {
    pub name: String,
    /// Milliseconds after the step's first event.
    pub start_ms: f64,
    pub ms: f64,
}

pub struct Executor {
    pub gpu: Gpu,
    arena: CudaSlice<u8>,
    base: u64,
    launches: Vec<Launch>,
    gemm: Option<Gemm>,
    dims: Vec<i64>,
    pub slots: Vec<Slot>,
    /// Buffers of named sources: inputs, parameters, optimizer state.
    pub inputs: HashMap<String, usize>,
    pub params: HashMap<String, usize>,
    pub state: HashMap<String, usize>,
    pub loss: Option<usize>,
    pub grad_norm: Option<usize>,
    pub arena_bytes: u64,
    /// The whole step captured once and replayed (see `capture`): with
    /// the collectives (index 1) and without (index 0, the micro-batches
    /// that only accumulate).
    graphs: [Option<cudarc::driver::CudaGraph>; 2],
    /// Whether each of those two forms has run launch by launch yet.
    ran: [bool; 2],
    /// Whether this step runs its collectives (see `set_collectives`).
    collectives_on: bool,
    /// Launch positions the compute stream waits for the collectives at.
    joins: Vec<bool>,
    /// The communicator, for a step built for several ranks.
    dp: Option<DataParallel>,
    /// Inputs copied in on a second stream (see `stage`).
    stager: Option<Stager>,
    /// NVTX ranges to mark each launch with (a profiler is attached).
    marks: Option<crate::marks::StepMarks>,
    /// Whether anything has been written into the arena since it was
    /// allocated (zeros) or cleared: what `Session::warm_up` must not lose.
    written: bool,
}

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
            let step = if l.kind == fusec_compiler::plan::LaunchKind::AllReduce {
                let planned = plan.collectives.iter().find(|c| c.launch == ki);
                let owners_of = planned.map_or(&[][..], |c| &c.owners_of[..]);
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
                let (mut all, mut owned) = (Vec::new(), Vec::new());
                for (j, t) in tensors.into_iter().enumerate() {
                    match owners_of.get(j).copied().flatten() {
                        Some(p) => owned.push((t, p)),
                        None => all.push(t),
                    }
                }
                let all = nccl::coalesce(&all, fusec_compiler::plan::ALIGN);
                let every = planned.is_some_and(|c| c.every_micro_batch);
                Step::Collective(all, every, owned)
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
            arena_bytes: plan.arena_bytes,
            graphs: [None, None],
            ran: [false, false],
            collectives_on: true,
            joins: {
                let mut j = vec![false; plan.launches.len() + 1];
                for c in &plan.collectives {
                    j[c.join.min(plan.launches.len())] = true;
                }
                j
            },
            dp: None,
            stager: None,
            marks: None,
            written: false,
        })
    }

    /// Lets f32 GEMMs compute on TF32 tensor cores (before the first step:
    /// the plans are made then).
    pub fn allow_tf32(&mut self, on: bool) {
        if let Some(g) = self.gemm.as_mut() {
            g.allow_tf32 = on;
        }
    }

    /// How the GEMMs' cuBLASLt algorithms are chosen (before the first
    /// step: they are chosen then).
    pub fn tune_gemms(&mut self, tuning: crate::gemm_tuning::Tuning) {
        if let Some(g) = self.gemm.as_mut() {
            g.tuning = tuning;
        }
    }

    /// How the algorithms of the GEMMs run so far were chosen; `None` for
    /// a step without GEMMs.
    pub fn gemm_tuning_stats(&self) -> Option<crate::gemm_tuning::TuningStats> {
        self.gemm.as_ref().map(|g| g.tuning_stats())
    }

    pub fn kernel_count(&self) -> usize {
        self.launches.len()
    }

    pub fn kernel_name(&self, i: usize) -> &str {
        &self.launches[i].name
    }

    /// Launches kernel `i` (asynchronously, on the executor's stream; a
    /// collective on the communication stream).
    pub fn launch(&mut self, i: usize) -> Result<(), RuntimeError> {
        let name = self.launches[i].name.clone();
        let Executor {
            launches,
            gpu,
            dims,
            gemm,
            dp,
            joins,
            collectives_on,
            ..
        } = self;
        if joins[i] {
            if let Some(dp) = dp.as_mut() {
                dp.wait(gpu)?;
            }
        }
        match (&launches[i].step, dp.as_mut()) {
            (Step::Collective(_, every, _), _) if !*collectives_on && !every => Ok(()),
            (Step::Collective(tensors, _, owned), Some(dp)) => dp.issue(gpu, tensors, owned, i),
            (Step::Collective(..), None) => Err(RuntimeError::Unsupported(format!(
                "kernel {name} averages gradients over several ranks, and this step has no communicator: run it with --gpus or under a launcher"
            ))),
            (step, _) => run(step, &name, gpu, dims, gemm),
        }
    }

    /// Every launch of the step in order, then the wait for the last
    /// collectives.
    fn launch_all(&mut self) -> Result<(), RuntimeError> {
        match self.marks.take() {
            Some(marks) => {
                let done = self.launch_marked(&marks);
                self.marks = Some(marks);
                done?;
            }
            None if crate::startup::enabled() && !self.ran.iter().any(|r| *r) => {
                self.launch_all_timed()?;
            }
            None => {
                for i in 0..self.launches.len() {
                    self.launch(i)?;
                }
            }
        }
        if let Some(dp) = self.dp.as_mut() {
            // An accumulating micro-batch changed no parameter.
            if self.collectives_on {
                dp.share(&self.gpu)?;
            }
            dp.wait(&self.gpu)?;
        }
        Ok(())
    }

    /// The launches inside NVTX ranges: the step, each run of one phase,
    /// each launch.
    fn launch_marked(&mut self, marks: &crate::marks::StepMarks) -> Result<(), RuntimeError> {
        use crate::marks::Range;
        let _step = Range::new("fusec step");
        let mut phase: Option<(&str, Range)> = None;
        for i in 0..self.launches.len() {
            let (ph, label) = marks
                .launches
                .get(i)
                .map_or(("step", self.launches[i].name.as_str()), |(p, l)| {
                    (*p, l.as_str())
                });
            if phase.as_ref().map(|p| p.0) != Some(ph) {
                // The last phase's range closes before the next opens
                // (NVTX pops the innermost range).
                drop(phase.take());
                phase = Some((ph, Range::new(ph)));
            }
            let _launch = Range::new(label);
            self.launch(i)?;
        }
        Ok(())
    }

    /// Marks every later step with NVTX ranges (and runs it launch by
    /// launch: a replayed graph is one launch to a profiler).
    pub fn set_marks(&mut self, marks: crate::marks::StepMarks) {
        self.marks = Some(marks);
        self.graphs = [None, None];
    }

    pub fn marked(&self) -> bool {
        self.marks.is_some()
    }

    /// The buffer address and elements of every named parameter.
    pub fn param_tensors(&self) -> Vec<(String, nccl::Tensor)> {
        self.params
            .iter()
            .map(|(name, &b)| {
                let s = &self.slots[b];
                let at = self.base + s.offset;
                (
                    name.clone(),
                    nccl::Tensor {
                        input: at,
                        output: at,
                        count: (s.bytes / s.dtype.size_bytes() as u64) as usize,
                        dtype: s.dtype,
                    },
                )
            })
            .collect()
    }

    /// Joins a communicator: the step's collectives run through it.
    pub fn attach(&mut self, dp: DataParallel) {
        self.dp = Some(dp);
    }

    /// Whether the step has collectives to run (it was built for several ranks).
    pub fn has_collectives(&self) -> bool {
        self.launches
            .iter()
            .any(|l| matches!(l.step, Step::Collective(..)))
    }

    /// Whether the next steps run their collectives: off for micro-batches
    /// that only accumulate (no communication until the one that updates).
    pub fn set_collectives(&mut self, on: bool) {
        self.collectives_on = on;
    }

    /// Every kernel of the step, in plan order: the captured graph where
    /// there is one, else launch by launch.
    pub fn run_step(&mut self) -> Result<(), RuntimeError> {
        self.copy_staged()?;
        let mode = usize::from(self.collectives_on);
        if let Some(g) = &self.graphs[mode] {
            return g
                .launch()
                .map_err(|e| RuntimeError::driver("replaying the step's CUDA graph", e));
        }
        self.launch_all()?;
        self.ran[mode] = true;
        Ok(())
    }

    /// Whether the step in its current form has run launch by launch and
    /// has no graph yet: the moment to capture one.
    pub fn ready_to_capture(&self) -> bool {
        let mode = usize::from(self.collectives_on);
        self.ran[mode] && self.graphs[mode].is_none() && self.marks.is_none()
    }

    /// Captures the whole step as a CUDA graph, replayed by every later
    /// `run_step`: one launch instead of hundreds. Call it after a step has
    /// run eagerly (so cuBLASLt has chosen its algorithms). Inputs are
    /// copied before each replay; the graph holds only kernels.
    pub fn capture(&mut self) -> Result<(), RuntimeError> {
        use cudarc::driver::sys;
        self.synchronize()?;
        self.gpu
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| RuntimeError::driver("starting a CUDA graph capture", e))?;
        let launched = self.launch_all();
        let graph = self
            .gpu
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(|e| RuntimeError::driver("finishing the CUDA graph capture", e));
        launched?;
        self.graphs[usize::from(self.collectives_on)] = graph?;
        Ok(())
    }

    pub fn has_graph(&self) -> bool {
        self.graphs[usize::from(self.collectives_on)].is_some()
    }

    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| RuntimeError::driver("running the step", e))
    }
}

/// One step of the plan: a kernel, a GEMM or a sequence of kernels.
fn run(
    step: &Step,
    name: &str,
    gpu: &Gpu,
    dims: &[i64],
    gemm: &mut Option<Gemm>,
) -> Result<(), RuntimeError> {
    match step {
        Step::Kernel(call) => call.launch(gpu, dims)?,
        Step::Sequence(steps) => {
            for s in steps {
                run(s, name, gpu, dims, gemm)?;
            }
        }
        Step::Gemm {
            spec,
            a,
            b,
            d,
            ep,
            split,
        } => {
            let gemm = gemm.as_mut().expect("created with the first GEMM");
            match split {
                Some(scratch) => gemm.run_split(spec, *a, *b, *d, ep, *scratch),
                None => gemm.run(spec, *a, *b, *d, ep),
            }
            .map_err(|e| RuntimeError::Gemm(format!("kernel {name}: {e}")))?;
        }
        Step::Collective(..) => unreachable!("the executor runs collectives itself"),
    }
    Ok(())
}

/// Lets `func` launch with `bytes` of dynamic shared memory (over 48 KiB
/// that needs the function's limit raised first), or says that the GPU
/// has too little and what runs without the kernel (`without`).
pub fn allow_dynamic_smem(
    func: &CudaFunction,
    name: &str,
    bytes: u32,
    gpu: &Gpu,
    without: &str,
) -> Result<(), RuntimeError> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    if bytes <= 48 * 1024 {
        return Ok(());
    }
    let limit = gpu
        .ctx
        .attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|e| RuntimeError::driver("reading the shared memory limit", e))?;
    if bytes as i64 > limit as i64 {
        return Err(RuntimeError::Unsupported(format!(
            "kernel {name} needs {bytes} bytes of shared memory per block; {} allows {limit}: run with {without}",
            gpu.name
        )));
    }
    func.set_attribute(
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| RuntimeError::driver(&format!("raising {name}'s shared memory limit"), e))
}
