//! The compiled step on one GPU as a backend: the graph lowered for the
//! GPU it opens on (its architecture, its multiprocessors), the compiled
//! step handed to a runtime session, and the graph and kernel program kept
//! beside it for what describes the step (trace labels, the roofline).

use super::{copy_params_by_value, source_shapes, Backend};
use fusec_compiler::ir::Graph;
use fusec_compiler::kernel::Program;
use fusec_compiler::lowering;
use fusec_compiler::optimisation::LowerOptions;
use fusec_compiler::plan::shard::Piece;
use fusec_compiler::target::{F32Math, Target};
use fusec_runtime::device;
use fusec_runtime::session::{Session, StepStats};
use fusec_runtime::stage::HostBuf;
use fusec_runtime::RuntimeError;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Choices a GPU step is compiled with.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuOptions {
    /// Runs that repeat bit for bit: the attention backward recomputes its
    /// tiles for dQ instead of summing dQ with atomics (slower; every other
    /// kernel is deterministic either way).
    pub deterministic: bool,
    /// How f32 products run: three TF32 products (the default), one (as
    /// PyTorch's `allow_tf32`), or f32 GEMMs on CUDA cores.
    pub f32_math: F32Math,
}

impl GpuOptions {
    /// The target for `gpu`: the tensor-core attention family its
    /// architecture runs (FUSEC_ATTENTION=simple keeps the simple kernels,
    /// the CPU-checked reference), in the schemes asked for, with the
    /// kernel stages' optimisations `lower` leaves on.
    pub fn target(&self, gpu: &device::Gpu, lower: &LowerOptions) -> Result<Target, RuntimeError> {
        Ok(Target {
            arch: gpu.flash_arch()?,
            deterministic: self.deterministic,
            multiprocessors: gpu.multiprocessors,
            f32_math: self.f32_math,
            lower: lower.clone(),
        })
    }
}

pub struct Gpu {
    pub session: Session,
    /// The graph the step was compiled from.
    pub graph: Graph,
    /// Its kernels, as fusion cut them.
    pub program: Program,
    shapes: BTreeMap<String, Vec<usize>>,
}

impl Gpu {
    /// The ranks ZeRO splits this step's pieces over, of `ranks` in all
    /// (fewer under hybrid sharding: a group's).
    fn shard_group(&self, ranks: usize) -> usize {
        self.graph.shard_group().map_or(ranks, |g| g as usize)
    }

    /// Fuses, selects and plans `graph`'s step for `gpu` at sizes `dims`
    /// with the optimisations `lower` leaves on (the model's
    /// `Compiled::options.lower`), and loads it there (kernels from the cache in
    /// `cache_dir` or compiled, `progress(done, total)` as they are).
    pub fn open(
        gpu: device::Gpu,
        graph: &Graph,
        lower: &LowerOptions,
        dims: &BTreeMap<String, i64>,
        cache_dir: Option<&Path>,
        progress: &(dyn Fn(usize, usize) + Sync),
        options: GpuOptions,
    ) -> Result<Gpu, RuntimeError> {
        let target = options.target(&gpu, lower)?;
        let lowered = lowering::lower(graph, &target, dims, None)
            .map_err(|e| RuntimeError::Unsupported(e.to_string()))?;
        fusec_runtime::startup::mark("kernels chosen, memory planned");
        let (step, program) = lowered.into_step(graph);
        let session = Session::new(gpu, step, cache_dir, progress)?;
        let d: HashMap<String, i64> = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let shapes = source_shapes(graph, &d)?
            .into_iter()
            .filter(|(n, _)| {
                session.exec.inputs.contains_key(n)
                    || session.exec.params.contains_key(n)
                    || session.exec.state.contains_key(n)
            })
            .collect();
        Ok(Gpu {
            session,
            graph: graph.clone(),
            program,
            shapes,
        })
    }
}

impl Backend for Gpu {
    fn graph(&self) -> &Graph {
        &self.graph
    }
    fn set(&mut self, name: &str, values: &[f64]) -> Result<(), RuntimeError> {
        self.session.set(name, values)
    }
    fn set_encoded(
        &mut self,
        name: &str,
        dtype: fusec_compiler::dtype::DType,
        bytes: &[u8],
    ) -> Result<(), RuntimeError> {
        self.session.set_encoded(name, dtype, bytes)
    }
    fn zero(&mut self, name: &str) -> Result<(), RuntimeError> {
        self.session.zero(name)
    }
    fn init(
        &mut self,
        name: &str,
        fill: &(dyn Fn(usize, &mut [f64]) + Sync),
    ) -> Result<(), RuntimeError> {
        self.session.init(name, fill)
    }
    fn warm_up(&mut self) -> Result<(), RuntimeError> {
        self.session.warm_up().map(|_| ())
    }
    fn profile_step_full(
        &mut self,
    ) -> Result<Option<fusec_runtime::exec::StepProfile>, RuntimeError> {
        self.session.exec.profile_step_full().map(Some)
    }
    fn gather_split(
        &mut self,
        name: &str,
        pieces: &[Piece],
        numel: usize,
    ) -> Result<Vec<f64>, RuntimeError> {
        self.session.gather_split(name, pieces, numel)
    }
    fn get(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        self.session.get(name)
    }
    fn gradients(&self) -> Result<Vec<(String, Vec<f64>)>, RuntimeError> {
        self.session.gradients()
    }
    fn logits(&self) -> Result<Vec<f32>, RuntimeError> {
        self.session.logits()
    }
    fn token_losses(&self) -> Result<Vec<f64>, RuntimeError> {
        self.session.token_losses()
    }
    fn next_tokens(&self) -> Result<Vec<u32>, RuntimeError> {
        self.session.next_tokens()
    }
    fn launch(&mut self, lr: f64, step: u64) -> Result<(), RuntimeError> {
        self.session.launch(lr, step)
    }
    fn finish(&mut self) -> Result<StepStats, RuntimeError> {
        self.session.finish()
    }
    fn batch_buffers(&self, count: usize, len: usize) -> Result<Vec<HostBuf>, RuntimeError> {
        fusec_runtime::stage::pinned(&self.session.exec.gpu, count, len)
    }
    fn as_gpu(&self) -> Option<&Gpu> {
        Some(self)
    }
    fn as_gpu_mut(&mut self) -> Option<&mut Gpu> {
        Some(self)
    }
    fn copy_state_from(&mut self, other: &dyn Backend) -> Result<(), RuntimeError> {
        // Device to device where both are sessions on this GPU.
        let Some(src) = other.as_gpu() else {
            for name in self.state_names() {
                let v = other.get(&name)?;
                self.set(&name, &v)?;
            }
            return Ok(());
        };
        let from = &src.session.exec;
        let pairs: Vec<(usize, usize)> = self
            .session
            .exec
            .state
            .iter()
            .filter_map(|(name, &dst)| from.state.get(name).map(|&s| (s, dst)))
            .collect();
        for (s, d) in pairs {
            self.session.exec.copy_from(from, s, d)?;
        }
        Ok(())
    }
    fn copy_params_from(&mut self, other: &dyn Backend) -> Result<(), RuntimeError> {
        // Device to device where both are sessions on this GPU.
        let Some(src) = other.as_gpu() else {
            return copy_params_by_value(self, other);
        };
        let from = &src.session.exec;
        let pairs: Vec<(String, usize, usize)> = self
            .session
            .exec
            .params
            .iter()
            .filter_map(|(name, &dst)| from.params.get(name).map(|&s| (name.clone(), s, dst)))
            .collect();
        for (name, s, d) in pairs {
            if from.slots[s].dtype == self.session.exec.slots[d].dtype {
                self.session.exec.copy_from(from, s, d)?;
            } else {
                // A step that keeps the weights in the dtype its passes
                // read (bf16, `decode::weights_as_read`) from one that
                // keeps f32 masters: through the host, rounded as the
                // cast rounds.
                let v = other.get_forward(&name)?;
                self.set(&name, &v)?;
            }
        }
        Ok(())
    }
    fn join_comm(
        &mut self,
        id: &fusec_runtime::nccl::UniqueId,
        rank: usize,
        ranks: usize,
        zero: bool,
    ) -> Result<(), RuntimeError> {
        let comm = fusec_runtime::nccl::Comm::join(&self.session.exec.gpu, id, rank, ranks)?;
        let group = zero.then(|| self.shard_group(ranks));
        self.session.attach(comm, group)
    }
    fn join_loopback(
        &mut self,
        place: std::sync::Arc<fusec_runtime::loopback::Loopback>,
        rank: usize,
        zero: bool,
    ) -> Result<(), RuntimeError> {
        let comm = fusec_runtime::nccl::Comm::loopback(place, rank);
        let group = zero.then(|| self.shard_group(comm.ranks));
        // Its collectives wait on the host: not capturable.
        self.session.use_graph = false;
        self.session.attach(comm, group)
    }
    fn time_steps(&mut self, steps: u64) -> Result<f64, RuntimeError> {
        // Replays back to back (the CUDA graph where there is one), one wait at the end.
        let exec = &mut self.session.exec;
        let t0 = std::time::Instant::now();
        for _ in 0..steps {
            exec.run_step()?;
        }
        exec.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64)
    }
    fn memory_used(&self) -> Result<Option<u64>, RuntimeError> {
        let gpu = &self.session.exec.gpu;
        Ok(Some(gpu.total_bytes - gpu.free_bytes()?))
    }
    fn stage(&mut self, names: &[&str], buf: &HostBuf) -> Result<(), RuntimeError> {
        self.session.stage(names, buf)
    }
    fn shapes(&self) -> &BTreeMap<String, Vec<usize>> {
        &self.shapes
    }
}
