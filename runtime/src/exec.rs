//! One training step on the GPU, as the plan lays it out: one arena, every
//! buffer at its planned offset, the kernels launched in plan order (the
//! generated ones from their cubins, GEMMs through cuBLASLt with their
//! epilogues).

use crate::device::Gpu;
use crate::gemm::{Elem, EpiloguePtrs, Gemm, GemmSpec};
use crate::gemm_split::SplitKernels;
use crate::nccl;
use crate::stage::{HostBuf, Stager};
use crate::tensor_map::{encode_sizes, EncodedMap};
use crate::RuntimeError;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use fusec_compiler::emit::gemm_split::SPLIT_SOURCE;
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::types::DType;
use fusec_compiler::ir::Graph;
use fusec_compiler::plan::gemm::GemmShape;

mod gather;
use fusec_compiler::kernel::{Body, BufKind, Program};
use fusec_compiler::ops::Op;
use fusec_compiler::plan::Plan;
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
        spec: GemmSpec,
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

/// A rank's share of data parallelism: its communicator and the stream
/// the buckets' collectives run on. A collective starts once the compute
/// stream has finished what it averages; the launch that first reads a
/// result (the plan's `join`) waits for every collective issued so far.
pub struct DataParallel {
    pub comm: nccl::Comm,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    /// Issued and not yet waited for by the compute stream.
    outstanding: bool,
    /// ZeRO stage 1: every parameter buffer and its owner rank, sent from
    /// the owner after the update.
    pub shares: Vec<(nccl::Tensor, usize)>,
    /// ZeRO stage 1: each parameter's pieces (`autodiff::zero::pieces`),
    /// to whose owners its gradient's mean is reduced.
    pub pieces: Vec<Vec<fusec_compiler::autodiff::zero::Piece>>,
    /// While a step is profiled: each collective's launch and the events
    /// recorded on the communication stream around it.
    timing: Option<Vec<(usize, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>>,
}

/// A collective of a profiled step (`Executor::profile_step_full`), in
/// milliseconds after the step's first event.
#[derive(Clone, Debug)]
pub struct CollectiveTime {
    /// The plan's launch it is.
    pub launch: usize,
    pub name: String,
    pub bytes: u64,
    /// When the compute stream had finished what it reads.
    pub ready_ms: f64,
    /// When it started and how long it ran on the communication stream.
    pub start_ms: f64,
    pub ms: f64,
    /// The launch the compute stream waits for it before (the number of
    /// launches: the end of the step), and when the compute stream got there.
    pub join: usize,
    pub join_ms: f64,
}

/// A step profiled launch by launch, with its collectives.
pub struct StepProfile {
    pub launches: Vec<LaunchTime>,
    pub collectives: Vec<CollectiveTime>,
    /// When the step ended (its last launch, and any wait for collectives
    /// after it).
    pub step_end_ms: f64,
}

impl DataParallel {
    pub fn new(gpu: &Gpu, comm: nccl::Comm) -> Result<DataParallel, RuntimeError> {
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| RuntimeError::driver("creating the communication stream", e))?;
        Ok(DataParallel {
            comm,
            stream,
            outstanding: false,
            shares: Vec::new(),
            pieces: Vec::new(),
            timing: None,
        })
    }

    /// The owners' updated parameters to every rank, once the compute
    /// stream has run the update.
    fn share(&mut self, gpu: &Gpu) -> Result<(), RuntimeError> {
        if self.shares.is_empty() {
            return Ok(());
        }
        self.stream.join(&gpu.stream).map_err(|e| {
            RuntimeError::driver("ordering the parameters' broadcast after the update", e)
        })?;
        self.comm.broadcast(&self.stream, &self.shares)?;
        self.outstanding = true;
        Ok(())
    }

    fn issue(
        &mut self,
        gpu: &Gpu,
        tensors: &[nccl::Tensor],
        owned: &[(nccl::Tensor, usize)],
        launch: usize,
    ) -> Result<(), RuntimeError> {
        if !owned.is_empty() && self.pieces.is_empty() {
            return Err(RuntimeError::Unsupported(
                "the step was built with --zero 1 (gradients reduced to their owners), and this run does not shard the optimizer state: run it with --zero 1".into(),
            ));
        }
        let rooted = nccl::owned_pieces(owned, &self.pieces, fusec_compiler::plan::ALIGN);
        self.stream
            .join(&gpu.stream)
            .map_err(|e| RuntimeError::driver("ordering a collective after its gradients", e))?;
        let ev = |s: &Self| {
            s.stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| RuntimeError::driver("recording a timing event", e))
        };
        let start = match self.timing {
            Some(_) => Some(ev(self)?),
            None => None,
        };
        self.comm.average(&self.stream, tensors, &rooted)?;
        if let Some(start) = start {
            let end = ev(self)?;
            if let Some(t) = self.timing.as_mut() {
                t.push((launch, start, end));
            }
        }
        self.outstanding = true;
        Ok(())
    }

    fn wait(&mut self, gpu: &Gpu) -> Result<(), RuntimeError> {
        if self.outstanding {
            gpu.stream
                .join(&self.stream)
                .map_err(|e| RuntimeError::driver("waiting for the averaged gradients", e))?;
            self.outstanding = false;
        }
        Ok(())
    }
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
    pub kind: BufKind,
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

fn elem(dt: DType) -> Elem {
    match dt {
        DType::F32 => Elem::F32,
        DType::BF16 => Elem::BF16,
        DType::F16 => Elem::F16,
        // plan::gemm gives no integer products.
        DType::I32 => unreachable!("an integer GEMM in the plan"),
    }
}

/// The product the plan worked out for a GEMM launch, as cuBLASLt's
/// request.
pub fn gemm_spec(s: &GemmShape) -> GemmSpec {
    GemmSpec {
        m: s.m,
        n: s.n,
        k: s.k,
        batch: s.batch,
        a_transposed: s.a_transposed,
        b_transposed: s.b_transposed,
        batch_stride_a: s.batch_stride_a,
        batch_stride_b: s.batch_stride_b,
        batch_stride_d: s.batch_stride_d,
        pitch_a: s.pitch_a,
        pitch_b: s.pitch_b,
        pitch_d: s.pitch_d,
        in_type: elem(s.in_type),
        out_type: elem(s.out_type),
    }
}

impl Executor {
    /// Allocates the arena and loads every kernel. `cubins[i]` is the image
    /// of `sources[i]` (kernel name, CUDA C).
    pub fn new(
        gpu: Gpu,
        g: &Graph,
        p: &Program,
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
        let mut slots = Vec::with_capacity(p.buffers.len());
        for (i, b) in p.buffers.iter().enumerate() {
            let pb = &plan.buffers[i];
            slots.push(Slot {
                offset: pb.offset,
                bytes: pb.bytes,
                dtype: b.ty.dtype,
                shape: pb.shape.iter().map(|&d| d.max(0) as usize).collect(),
                kind: b.kind,
                pitch: pb.pitch.map(|x| x.max(0) as usize),
            });
        }
        let (mut inputs, mut params, mut state) = (HashMap::new(), HashMap::new(), HashMap::new());
        for (i, b) in p.buffers.iter().enumerate() {
            match (&g.g[b.value.node].op, b.kind) {
                (Op::Input(x), BufKind::Input) => {
                    inputs.insert(x.name.clone(), i);
                }
                (Op::Param(x), BufKind::Param) => {
                    params.insert(x.name.clone(), i);
                }
                (Op::State(x), BufKind::State) => {
                    state.insert(x.name.clone(), i);
                }
                _ => {}
            }
        }
        let find = |role: &Role| {
            g.outputs
                .iter()
                .find(|(r, _)| r == role)
                .and_then(|(_, v)| p.buffer_of(*v))
        };
        let dims: Vec<i64> = g
            .dims
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
        let mut launches = Vec::with_capacity(p.kernels.len());
        let mut gemm = None;
        for (ki, k) in p.kernels.iter().enumerate() {
            let l = &plan.launches[ki];
            let args: Vec<u64> = k.inputs.iter().chain(&k.outputs).map(|&b| ptr(b)).collect();
            let step = if l.kind == fusec_compiler::plan::LaunchKind::AllReduce {
                let planned = plan.collectives.iter().find(|c| c.launch == ki);
                let owners_of = planned.map_or(&[][..], |c| &c.owners_of[..]);
                let tensors = k
                    .inputs
                    .iter()
                    .zip(&k.outputs)
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
                    let smem = st.dynamic_smem_bytes as u32;
                    allow_dynamic_smem(&func, &st.function, smem, &gpu, "FUSEC_ATTENTION=simple")?;
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
                                "FUSEC_ATTENTION=simple",
                            )
                        })
                        .collect::<Result<_, _>>()?;
                    let [x, y, z] = st.grid;
                    steps.push(Step::Kernel(KernelCall {
                        func,
                        name: st.function.clone(),
                        grid: (
                            x.clamp(1, u32::MAX as u64) as u32,
                            y.clamp(1, 65535) as u32,
                            z.clamp(1, 65535) as u32,
                        ),
                        block: st.block as u32,
                        args: args.clone(),
                        extra: st.scratch.map(|b| base + plan.buffers[b].offset),
                        smem,
                        maps,
                    }));
                }
                match steps.len() {
                    1 => steps.remove(0),
                    _ => Step::Sequence(steps),
                }
            } else {
                match &k.body {
                    Body::Gemm(n, _) | Body::Op(n) if matches!(g.g[*n].op, Op::MatMul(_)) => {
                        let spec = gemm_spec(l.gemm.as_ref().ok_or_else(|| {
                            RuntimeError::Unsupported(format!(
                                "kernel {}: a matrix product cuBLASLt does not run (integers, or operands that broadcast only some batch axes)",
                                k.name
                            ))
                        })?);
                        let mut ep = EpiloguePtrs::default();
                        if let Body::Gemm(_, e) = &k.body {
                            ep.bias = e.bias.map(|s| ptr(k.inputs[s]));
                            ep.residual = e.residual.map(|s| ptr(k.inputs[s]));
                            ep.dgelu_aux_in = e.dgelu.map(|s| ptr(k.inputs[s]));
                            if e.gelu {
                                ep.gelu_aux_out = Some(ptr(k.outputs[1]));
                            }
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
                                    k.name
                                ))
                            })?;
                            g.split_kernels = Some(SplitKernels::load(|f| function(si, f))?);
                        }
                        Step::Gemm {
                            spec,
                            a: ptr(k.inputs[0]),
                            b: ptr(k.inputs[1]),
                            d: ptr(k.outputs[0]),
                            ep,
                            split,
                        }
                    }
                    _ => {
                        let what: Vec<&str> = k.nodes.iter().map(|&n| g.g[n].op.name()).collect();
                        return Err(RuntimeError::Unsupported(format!(
                            "kernel {} ({}) has no generated code and no library call yet",
                            k.name,
                            what.join(" + ")
                        )));
                    }
                }
            };
            launches.push(Launch {
                name: k.name.clone(),
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
            loss: find(&Role::Loss),
            grad_norm: find(&Role::GradNorm),
            arena_bytes: plan.arena_bytes,
            graphs: [None, None],
            ran: [false, false],
            collectives_on: true,
            joins: {
                let mut j = vec![false; p.kernels.len() + 1];
                for c in &plan.collectives {
                    j[c.join.min(p.kernels.len())] = true;
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

    /// Every launch in order, the first time (`FUSEC_STARTUP_TIMES`): the
    /// host's time in each call, where the driver loads a kernel at its
    /// first launch and cuBLASLt plans a product at its first run; prints
    /// the sums by kind and the slowest launches.
    fn launch_all_timed(&mut self) -> Result<(), RuntimeError> {
        let mut times = Vec::with_capacity(self.launches.len());
        for i in 0..self.launches.len() {
            let t = std::time::Instant::now();
            self.launch(i)?;
            let kind = match self.launches[i].step {
                Step::Gemm { .. } => "cuBLASLt",
                Step::Collective(..) => "collective",
                _ => "kernel",
            };
            times.push((t.elapsed().as_secs_f64(), kind, i));
        }
        for kind in ["kernel", "cuBLASLt", "collective"] {
            let (n, sum) = times
                .iter()
                .filter(|t| t.1 == kind)
                .fold((0, 0.0), |(n, s), t| (n + 1, s + t.0));
            if n > 0 {
                crate::startup::mark(&format!(
                    "  first launches: {n} {kind} calls, {:.3} s on the host",
                    sum
                ));
            }
        }
        times.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (secs, kind, i) in times.iter().take(6) {
            crate::startup::mark(&format!(
                "  slowest first launch: {} ({kind}) {:.1} ms",
                self.launches[*i].name,
                secs * 1e3
            ));
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

    /// One step launch by launch with a timing event between launches,
    /// in launch order: each launch's start (milliseconds after the first
    /// event) and duration. Events cost a little, so the sum is slightly
    /// above a replayed step.
    pub fn profile_step(&mut self) -> Result<Vec<LaunchTime>, RuntimeError> {
        Ok(self.profile_step_full()?.launches)
    }

    /// [`Executor::profile_step`], with each collective's time on the
    /// communication stream beside the compute stream's launches: whether
    /// the buckets' all-reduces hide under the backward pass, and how long
    /// the step waits for them at its end.
    pub fn profile_step_full(&mut self) -> Result<StepProfile, RuntimeError> {
        use cudarc::driver::sys::CUevent_flags;
        let ev = |s: &Self| {
            s.gpu
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| RuntimeError::driver("recording a timing event", e))
        };
        let mut marks = vec![ev(self)?];
        if let Some(dp) = self.dp.as_mut() {
            dp.timing = Some(Vec::new());
        }
        let launched = (|| {
            for i in 0..self.launches.len() {
                self.launch(i)?;
                marks.push(ev(self)?);
            }
            if let Some(dp) = self.dp.as_mut() {
                // As every step: ZeRO's owners send their updated pieces.
                if self.collectives_on {
                    dp.share(&self.gpu)?;
                }
                dp.wait(&self.gpu)?;
            }
            Ok::<_, RuntimeError>(())
        })();
        let timing = self.dp.as_mut().and_then(|dp| dp.timing.take());
        launched?;
        let end = ev(self)?;
        self.synchronize()?;
        let read = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| {
            a.elapsed_ms(b)
                .map(f64::from)
                .map_err(|e| RuntimeError::driver("reading a timing event", e))
        };
        let mut launches = Vec::with_capacity(self.launches.len());
        for (i, l) in self.launches.iter().enumerate() {
            launches.push(LaunchTime {
                name: l.name.clone(),
                start_ms: read(&marks[0], &marks[i])?,
                ms: read(&marks[i], &marks[i + 1])?,
            });
        }
        let mut collectives = Vec::new();
        for (i, start, stop) in timing.unwrap_or_default() {
            let bytes = match &self.launches[i].step {
                Step::Collective(tensors, _, owned) => tensors
                    .iter()
                    .chain(owned.iter().map(|(t, _)| t))
                    .map(|t| (t.count * t.dtype.size_bytes()) as u64)
                    .sum(),
                _ => 0,
            };
            let join = (i + 1..self.launches.len())
                .find(|&j| self.joins[j])
                .unwrap_or(self.launches.len());
            collectives.push(CollectiveTime {
                launch: i,
                name: self.launches[i].name.clone(),
                bytes,
                ready_ms: read(&marks[0], &marks[i])?,
                start_ms: read(&marks[0], &start)?,
                ms: read(&start, &stop)?,
                join,
                join_ms: read(&marks[0], &marks[join])?,
            });
        }
        Ok(StepProfile {
            launches,
            collectives,
            step_end_ms: read(&marks[0], &end)?,
        })
    }

    pub fn synchronize(&self) -> Result<(), RuntimeError> {
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| RuntimeError::driver("running the step", e))
    }

    /// Copies host bytes into buffer `b` (exactly its size).
    pub fn write(&mut self, b: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.written = true;
        let s = &self.slots[b];
        if bytes.len() as u64 != s.packed_bytes() {
            return Err(RuntimeError::Unsupported(format!(
                "buffer {b} holds {} bytes, given {}",
                s.packed_bytes(),
                bytes.len()
            )));
        }
        let (lo, hi) = (s.offset as usize, (s.offset + s.bytes) as usize);
        // Padded rows: each row at its pitch, zeros between.
        let padded;
        let bytes = match s.rows() {
            Some((row, pitch)) if row > 0 => {
                let mut out = vec![0u8; s.bytes as usize];
                for (r, chunk) in bytes.chunks(row).enumerate() {
                    out[r * pitch..r * pitch + row].copy_from_slice(chunk);
                }
                padded = out;
                &padded[..]
            }
            // Zero rows after the last (kernel::pitch::pad_gemm_sizes).
            _ if (bytes.len() as u64) < s.bytes => {
                let mut out = vec![0u8; s.bytes as usize];
                out[..bytes.len()].copy_from_slice(bytes);
                padded = out;
                &padded[..]
            }
            _ => bytes,
        };
        let mut view = self.arena.slice_mut(lo..hi);
        self.gpu
            .stream
            .memcpy_htod(bytes, &mut view)
            .map_err(|e| RuntimeError::driver("copying to the GPU", e))
    }

    /// Starts copying `buf` to the GPU for the i32 buffers `targets` (their
    /// values in order, each whole), on a second stream, so the copy runs
    /// while the current step computes; the next `run_step` copies it in
    /// before its first kernel.
    pub fn stage(&mut self, targets: &[(&str, usize)], buf: &HostBuf) -> Result<(), RuntimeError> {
        self.written = true;
        let mut parts = Vec::with_capacity(targets.len());
        let mut at = 0;
        for &(name, b) in targets {
            let s = &self.slots[b];
            if s.dtype != DType::I32 || s.rows().is_some() {
                return Err(RuntimeError::Unsupported(format!(
                    "`{name}` ({:?}, shape {:?}) cannot take a staged batch: only unpadded i32 inputs can; declare it i32",
                    s.dtype, s.shape
                )));
            }
            let n: usize = s.shape.iter().product();
            parts.push((b, at, n));
            at += n;
        }
        let len = buf.len();
        if len != at {
            let names: Vec<&str> = targets.iter().map(|t| t.0).collect();
            return Err(RuntimeError::Unsupported(format!(
                "a staged batch holds {len} values; {} take {at}",
                names.join(" and ")
            )));
        }
        if self
            .stager
            .as_ref()
            .is_none_or(|st| st.area.len() != at.max(1))
        {
            self.stager = Some(Stager::new(&self.gpu, at)?);
        }
        let st = self.stager.as_mut().expect("made above");
        st.upload(buf)?;
        st.parts = parts;
        st.pending = true;
        Ok(())
    }

    /// The staged batch into its input buffers (on the step's stream, after
    /// the staging copy).
    fn copy_staged(&mut self) -> Result<(), RuntimeError> {
        let Executor {
            stager,
            arena,
            slots,
            gpu,
            ..
        } = self;
        let Some(st) = stager.as_mut().filter(|st| st.pending) else {
            return Ok(());
        };
        for &(b, at, n) in &st.parts {
            let s = &slots[b];
            let mut bytes = arena.slice_mut(s.offset as usize..(s.offset + s.bytes) as usize);
            // SAFETY: the buffer is an unpadded i32 tensor of n values
            // (checked by `stage`), and the arena is 256-byte aligned.
            let mut dst = unsafe { bytes.transmute_mut::<i32>(n) }.ok_or_else(|| {
                RuntimeError::Unsupported(format!("buffer {b} is smaller than its {n} values"))
            })?;
            gpu.stream
                .memcpy_dtod(&st.area.slice(at..at + n), &mut dst)
                .map_err(|e| RuntimeError::driver("copying a staged batch in", e))?;
        }
        st.pending = false;
        Ok(())
    }

    /// Copies buffer `src` of `other` (an executor on the same GPU) into
    /// buffer `dst` of this one, device to device; both hold the same
    /// bytes (unpadded, one dtype and shape).
    pub fn copy_from(
        &mut self,
        other: &Executor,
        src: usize,
        dst: usize,
    ) -> Result<(), RuntimeError> {
        self.written = true;
        let (a, b) = (&other.slots[src], &self.slots[dst]);
        if a.bytes != b.bytes || a.dtype != b.dtype {
            return Err(RuntimeError::Unsupported(format!(
                "cannot copy a buffer of {} bytes ({:?}) into one of {} ({:?})",
                a.bytes, a.dtype, b.bytes, b.dtype
            )));
        }
        let from = other
            .arena
            .slice(a.offset as usize..(a.offset + a.bytes) as usize);
        let mut to = self
            .arena
            .slice_mut(b.offset as usize..(b.offset + b.bytes) as usize);
        // The source's stream has finished its step (`finish` waited).
        self.gpu
            .stream
            .memcpy_dtod(&from, &mut to)
            .map_err(|e| RuntimeError::driver("copying the weights for validation", e))
    }

    /// Sets every byte of buffer `b` to zero, on the device.
    pub fn zero(&mut self, b: usize) -> Result<(), RuntimeError> {
        self.written = true;
        let s = &self.slots[b];
        let (lo, hi) = (s.offset as usize, (s.offset + s.bytes) as usize);
        let mut view = self.arena.slice_mut(lo..hi);
        self.gpu
            .stream
            .memset_zeros(&mut view)
            .map_err(|e| RuntimeError::driver("clearing a buffer", e))
    }

    /// Buffer `b`'s bytes (waits for the stream).
    pub fn read(&self, b: usize) -> Result<Vec<u8>, RuntimeError> {
        let s = &self.slots[b];
        let (lo, hi) = (s.offset as usize, (s.offset + s.bytes) as usize);
        let mut out = vec![0u8; s.bytes as usize];
        let view = self.arena.slice(lo..hi);
        self.gpu
            .stream
            .memcpy_dtoh(&view, &mut out)
            .map_err(|e| RuntimeError::driver("copying from the GPU", e))?;
        self.synchronize()?;
        // Padded rows: the rows alone, packed.
        if let Some((row, pitch)) = s.rows() {
            let n = s.packed_bytes() as usize;
            let mut packed = Vec::with_capacity(n);
            for r in 0..n.checked_div(row).unwrap_or(0) {
                packed.extend_from_slice(&out[r * pitch..r * pitch + row]);
            }
            return Ok(packed);
        }
        out.truncate(s.packed_bytes() as usize);
        Ok(out)
    }

    /// Fills every byte of the arena with `byte` (tests poison it).
    pub fn fill(&mut self, byte: u8) -> Result<(), RuntimeError> {
        self.written = true;
        let host = vec![byte; self.arena.len()];
        self.gpu
            .stream
            .memcpy_htod(&host, &mut self.arena)
            .map_err(|e| RuntimeError::driver("filling the arena", e))
    }

    /// Whether the arena is still all zeros as allocated (or cleared):
    /// nothing written into it since.
    pub fn untouched(&self) -> bool {
        !self.written
    }

    /// Zeros the whole arena on the device.
    pub fn clear(&mut self) -> Result<(), RuntimeError> {
        self.gpu
            .stream
            .memset_zeros(&mut self.arena)
            .map_err(|e| RuntimeError::driver("clearing the arena", e))?;
        self.written = false;
        Ok(())
    }

    /// The arena's device address (for diagnostics).
    pub fn base(&self) -> u64 {
        self.base
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

/// `n` values encoded as `dt` stores them, drawn by `fill(start, out)`
/// (values `start..start + out.len()`, any chunk, any order) in parallel
/// chunks: how a parameter's initial values are made. The chunks are
/// small, so that a parameter of a few hundred thousand values still keeps
/// every thread busy.
pub fn encode_filled(dt: DType, n: usize, fill: &(dyn Fn(usize, &mut [f64]) + Sync)) -> Vec<u8> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 13;
    let size = dt.size_bytes();
    let mut bytes = vec![0u8; n * size];
    bytes
        .par_chunks_mut(CHUNK * size)
        .enumerate()
        .for_each(|(k, out)| {
            let mut values = vec![0.0; out.len() / size];
            fill(k * CHUNK, &mut values);
            encode_into(dt, &values, out);
        });
    bytes
}

pub fn encode(dt: DType, values: &[f64]) -> Vec<u8> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20;
    if values.len() > CHUNK {
        return values
            .par_chunks(CHUNK)
            .map(|c| encode_serial(dt, c))
            .collect::<Vec<_>>()
            .concat();
    }
    encode_serial(dt, values)
}

/// `values` encoded into `out` (exactly `values.len()` elements of `dt`).
fn encode_into(dt: DType, values: &[f64], out: &mut [u8]) {
    let size = dt.size_bytes();
    debug_assert_eq!(out.len(), values.len() * size);
    for (&v, o) in values.iter().zip(out.chunks_exact_mut(size)) {
        match dt {
            DType::F32 => o.copy_from_slice(&(v as f32).to_le_bytes()),
            DType::BF16 => o.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
            DType::F16 => o.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            DType::I32 => o.copy_from_slice(&(v as i32).to_le_bytes()),
        }
    }
}

fn encode_serial(dt: DType, values: &[f64]) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * dt.size_bytes()];
    encode_into(dt, values, &mut out);
    out
}

/// A buffer's bytes as host values.
pub fn decode(dt: DType, bytes: &[u8]) -> Vec<f64> {
    match dt {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::I32 => bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
    }
}
