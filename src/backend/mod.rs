//! What `fusec train` drives: the compiled step on a GPU, or the CPU
//! reference interpreter (small models, and checking the GPU and PyTorch
//! against it). Both take inputs, parameters and state by name, so data
//! feeding and checkpoints are written once.

mod cpu;
mod gpu;
pub mod ranks;

pub use cpu::Cpu;
pub use gpu::{Gpu, GpuOptions};

use fusec_compiler::interp::concrete_shape;
use fusec_compiler::interp::random::init_values;
use fusec_compiler::ir::Graph;
use fusec_compiler::ops::Op;
use fusec_compiler::plan::shard::Piece;
use fusec_runtime::checkpoint::{Checkpoint, Tensor as CkTensor};
use fusec_runtime::session::StepStats;
use fusec_runtime::stage::HostBuf;
use fusec_runtime::RuntimeError;
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};

pub trait Backend {
    fn graph(&self) -> &Graph;
    /// Writes a named input, parameter or state tensor.
    fn set(&mut self, name: &str, values: &[f64]) -> Result<(), RuntimeError>;
    /// Elements of a named tensor (0 for an unknown name).
    fn numel(&self, name: &str) -> usize {
        self.shapes()
            .get(name)
            .map_or(0, |s| s.iter().product::<usize>())
    }
    /// Sets a named tensor to zeros (the GPU clears it in place).
    fn zero(&mut self, name: &str) -> Result<(), RuntimeError> {
        let n = self.numel(name);
        self.set(name, &vec![0.0; n])
    }
    fn get(&self, name: &str) -> Result<Vec<f64>, RuntimeError>;
    /// A parameter's values as a forward pass reads them (in the compute
    /// dtype, widened): under ZeRO with master weights the ranks' own
    /// copy, without gathering the masters from their owners; elsewhere
    /// `get`.
    fn get_forward(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        self.get(name)
    }
    /// ZeRO under a launcher: gathers the states other processes' ranks
    /// keep, so that `get` reads them whole until the next step. Every
    /// process of the job calls it at the same points (a checkpoint, a
    /// validation, a sample; once a step however often it is called);
    /// elsewhere it does nothing.
    fn gather_for_checkpoint(&mut self) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// One rank's part of [`Backend::gather_for_checkpoint`]: the whole of
    /// `name`, `numel` f32 elements the job's ranks hold in `pieces`
    /// (this rank its own, if it has one), from their owners.
    fn gather_split(
        &mut self,
        name: &str,
        pieces: &[Piece],
        numel: usize,
    ) -> Result<Vec<f64>, RuntimeError> {
        let _ = (pieces, numel);
        Err(RuntimeError::Unsupported(format!(
            "`{name}` is split over ranks in other processes, and this backend cannot gather it"
        )))
    }
    /// Writes a named tensor from values already encoded as `dtype` stores
    /// them (little-endian), as [`draw_params`] makes them.
    fn set_encoded(
        &mut self,
        name: &str,
        dtype: fusec_compiler::dtype::DType,
        bytes: &[u8],
    ) -> Result<(), RuntimeError> {
        self.set(name, &fusec_runtime::exec::decode(dtype, bytes))
    }
    /// Fills a named parameter from its initialiser: `fill(start, out)`
    /// writes values `start..start + out.len()` (any chunk, any order).
    fn init(
        &mut self,
        name: &str,
        fill: &(dyn Fn(usize, &mut [f64]) + Sync),
    ) -> Result<(), RuntimeError> {
        const CHUNK: usize = 1 << 20;
        let n = self.numel(name);
        let mut data = vec![0.0; n];
        data.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(k, out)| fill(k * CHUNK, out));
        self.set(name, &data)
    }
    /// The dropout key of the next micro-batch: the run's `seed` mixed
    /// with the step, the micro-batch and the data-parallel rank (each
    /// rank of a `Ranks` its own), so that every micro-batch and rank draws
    /// its own masks and a run repeats with its seed. Nothing where the
    /// step has no dropout.
    fn set_dropout_key(
        &mut self,
        seed: u64,
        step: u64,
        micro: u64,
        rank: usize,
    ) -> Result<(), RuntimeError> {
        let name = fusec_compiler::ops::DROPOUT_KEY_INPUT;
        if !self.shapes().contains_key(name) {
            return Ok(());
        }
        let key = fusec_compiler::ops::philox::step_key(seed, step, micro, rank as u64);
        self.set(name, &[key[0] as i32 as f64, key[1] as i32 as f64])
    }
    /// Each parameter's gradient from the micro-batch just finished, by
    /// parameter name: its share of the gradient of the step's mean loss
    /// (the micro-batch's gradient over their count; the shares add up to
    /// the gradient the update reads), before clipping, the fp16 loss
    /// scale divided out (`--save-grads`).
    fn gradients(&self) -> Result<Vec<(String, Vec<f64>)>, RuntimeError> {
        Err(RuntimeError::Unsupported(
            "this backend cannot read the step's gradients".into(),
        ))
    }
    /// The logits of the step just finished (a decode step's output), in
    /// row-major order.
    fn logits(&self) -> Result<Vec<f32>, RuntimeError> {
        Err(RuntimeError::Unsupported(
            "this backend cannot read the step's logits".into(),
        ))
    }
    /// The greedy picks of the step just finished (a greedy decode step's
    /// output), [B, T] token ids in row-major order.
    fn next_tokens(&self) -> Result<Vec<u32>, RuntimeError> {
        Err(RuntimeError::Unsupported(
            "this backend cannot read the step's greedy picks".into(),
        ))
    }
    /// The per-token losses of the step just finished (a scoring step's
    /// output), [B, T] in row-major order.
    fn token_losses(&self) -> Result<Vec<f64>, RuntimeError> {
        Err(RuntimeError::Unsupported(
            "this backend cannot read the step's per-token losses".into(),
        ))
    }
    /// One step; `step` counts from 1.
    fn step(&mut self, lr: f64, step: u64) -> Result<StepStats, RuntimeError> {
        self.launch(lr, step)?;
        self.finish()
    }
    /// Starts a step; `finish` waits for it. Between the two the caller
    /// stages the next batch, which is copied while this step computes.
    fn launch(&mut self, lr: f64, step: u64) -> Result<(), RuntimeError>;
    /// The launched step's loss (and gradient norm).
    fn finish(&mut self) -> Result<StepStats, RuntimeError>;
    /// Host buffers for `count` batches of `len` values each (page-locked
    /// on a GPU, so their copies overlap the step).
    fn batch_buffers(&self, count: usize, len: usize) -> Result<Vec<HostBuf>, RuntimeError> {
        Ok((0..count).map(|_| HostBuf::Plain(vec![0; len])).collect())
    }
    /// Queues `buf` for the named i32 inputs (their values in order), to
    /// be in place when the next step launches.
    fn stage(&mut self, names: &[&str], buf: &HostBuf) -> Result<(), RuntimeError>;
    /// The shape of every named source, with sizes bound.
    fn shapes(&self) -> &BTreeMap<String, Vec<usize>>;
    /// Joins the data-parallel communicator `id` as `rank` of `ranks`;
    /// `zero`: the step updates only this rank's parameters (ZeRO stage 1)
    /// and the others arrive from their owners after it.
    fn join_comm(
        &mut self,
        _id: &fusec_runtime::nccl::UniqueId,
        rank: usize,
        ranks: usize,
        _zero: bool,
    ) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(format!(
            "rank {rank} of {ranks}: NCCL communicators are for GPU ranks; the CPU reference's ranks meet in one process (--cpu --gpus N)"
        )))
    }
    /// Joins the ranks meeting at `place` in host memory as `rank`
    /// (`fusec_runtime::loopback`: several GPU ranks on one GPU, for
    /// checking), as [`Backend::join_comm`] joins NCCL's.
    fn join_loopback(
        &mut self,
        _place: std::sync::Arc<fusec_runtime::loopback::Loopback>,
        rank: usize,
        _zero: bool,
    ) -> Result<(), RuntimeError> {
        Err(RuntimeError::Unsupported(format!(
            "rank {rank}: loopback ranks are GPU sessions sharing one GPU"
        )))
    }
    /// Runs `steps` steps back to back on the inputs as they are and returns
    /// the milliseconds per step (what `fusec bench` reports).
    fn time_steps(&mut self, steps: u64) -> Result<f64, RuntimeError> {
        let t0 = std::time::Instant::now();
        for s in 1..=steps {
            self.launch(1e-4, s)?;
            self.finish()?;
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64)
    }
    /// Takes every parameter's values from `other` (a step of the same
    /// model: a forward-only step from the training one).
    fn copy_params_from(&mut self, other: &dyn Backend) -> Result<(), RuntimeError> {
        copy_params_by_value(self, other)
    }
    /// Takes every state's values from `other` (a decode step's key/value
    /// caches from its prefill).
    fn copy_state_from(&mut self, other: &dyn Backend) -> Result<(), RuntimeError> {
        for name in self.state_names() {
            let v = other.get(&name)?;
            self.set(&name, &v)?;
        }
        Ok(())
    }
    /// This backend as a GPU session, where it is one.
    fn as_gpu(&self) -> Option<&Gpu> {
        None
    }
    /// This backend as a GPU session, mutable (to profile its step).
    fn as_gpu_mut(&mut self) -> Option<&mut Gpu> {
        None
    }
    /// The optimizer state's names (every rank's, for data parallelism
    /// with the state split over the ranks).
    fn state_names(&self) -> Vec<String> {
        state_names(self.graph())
    }
    /// Device memory in use, bytes (`None` off a GPU).
    fn memory_used(&self) -> Result<Option<u64>, RuntimeError> {
        Ok(None)
    }
    /// One step launch by launch with its collectives timed beside it
    /// (`Executor::profile_step_full`); `None` where there is no GPU step.
    fn profile_step_full(
        &mut self,
    ) -> Result<Option<fusec_runtime::exec::StepProfile>, RuntimeError> {
        Ok(None)
    }
    /// Runs the step once before anything is written, so that its one-off
    /// costs (kernels loaded, algorithms chosen, the graph captured) are
    /// paid while the caller is still busy elsewhere; see
    /// `Session::warm_up`. Nothing where there is nothing to warm.
    fn warm_up(&mut self) -> Result<(), RuntimeError> {
        Ok(())
    }
}

/// A staged batch (the named i32 inputs' values one after another, as
/// `Backend::stage` takes them) cut into each input's values, each `numel`
/// long; an error names the inputs where the lengths do not add up.
pub(crate) fn split_staged<'a>(
    values: &'a [i32],
    names: &[&str],
    numel: impl Fn(&str) -> usize,
) -> Result<Vec<&'a [i32]>, RuntimeError> {
    let mismatch = |take: String| {
        RuntimeError::Unsupported(format!(
            "a staged batch holds {} values; {} take {take}",
            values.len(),
            names.join(" and ")
        ))
    };
    let mut at = 0;
    let mut parts = Vec::with_capacity(names.len());
    for name in names {
        let n = numel(name);
        parts.push(
            values
                .get(at..at + n)
                .ok_or_else(|| mismatch("more".into()))?,
        );
        at += n;
    }
    if at != values.len() {
        return Err(mismatch(at.to_string()));
    }
    Ok(parts)
}

/// Every parameter of `to` from `from`, through the host.
pub(crate) fn copy_params_by_value<B: Backend + ?Sized>(
    to: &mut B,
    from: &dyn Backend,
) -> Result<(), RuntimeError> {
    let names: Vec<String> = to.graph().params.iter().map(|p| p.name.clone()).collect();
    for name in names {
        if to.shapes().contains_key(&name) {
            let v = from.get_forward(&name)?;
            to.set(&name, &v)?;
        }
    }
    Ok(())
}

/// Names and shapes of the graph's inputs, parameters and state.
pub(crate) fn source_shapes(
    g: &Graph,
    dims: &HashMap<String, i64>,
) -> Result<BTreeMap<String, Vec<usize>>, RuntimeError> {
    let mut out = BTreeMap::new();
    for n in g.g.node_indices() {
        let (name, ty) = match &g.g[n].op {
            Op::Input(x) => (&x.name, &x.ty),
            Op::Param(x) => (&x.name, &x.ty),
            Op::State(x) => (&x.name, &x.ty),
            _ => continue,
        };
        let shape = concrete_shape(&ty.shape, dims).map_err(|e| RuntimeError::Unsupported(e.0))?;
        out.insert(name.clone(), shape);
    }
    Ok(out)
}

/// Parameters from their initialisers (each from its own stream of the
/// seed, as the CPU reference's `random_feeds` draws them), filled in
/// parallel chunks, and optimizer state zero.
pub fn init_params(b: &mut dyn Backend, seed: u64) -> Result<(), RuntimeError> {
    let params = b.graph().params.clone();
    let shapes = b.shapes().clone();
    for (i, p) in params.iter().enumerate() {
        if !shapes.contains_key(&p.name) {
            continue;
        }
        b.init(&p.name, &|start, out| {
            init_values(&p.init, seed, i as u64, start, out)
        })?;
    }
    let states: Vec<String> = b.state_names();
    for s in states {
        b.zero(&s)?;
    }
    Ok(())
}

/// Every parameter's initial values as `init_params` gives them, encoded
/// as the parameter's dtype stores them: drawn on the host before a GPU is
/// ready, so that drawing (about half a second for GPT-2 small on 16 cores)
/// overlaps opening the GPU and loading the kernels. None if a parameter's
/// size is not a constant.
pub fn draw_params(g: &Graph, seed: u64) -> Option<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::with_capacity(g.params.len());
    draw_params_each(g, seed, &mut |name, bytes| out.push((name, bytes)))?;
    Some(out)
}

/// [`draw_params`], handing each parameter to `each` as soon as it is
/// drawn (in the graph's order), so that its copy to the GPU overlaps the
/// drawing of the next. None, before anything is drawn, if a parameter's
/// size is not a constant.
pub fn draw_params_each(g: &Graph, seed: u64, each: &mut dyn FnMut(String, Vec<u8>)) -> Option<()> {
    let sizes = g
        .params
        .iter()
        .map(|p| {
            p.ty.shape
                .iter()
                .map(|d| d.as_const().and_then(|x| usize::try_from(x).ok()))
                .product::<Option<usize>>()
        })
        .collect::<Option<Vec<usize>>>()?;
    for (i, (p, n)) in g.params.iter().zip(sizes).enumerate() {
        let bytes = fusec_runtime::exec::encode_filled(p.ty.dtype, n, &|start, values| {
            init_values(&p.init, seed, i as u64, start, values)
        });
        each(p.name.clone(), bytes);
    }
    Some(())
}

/// [`draw_params_each`] on all but three of the machine's cores, leaving
/// those to the threads that open the GPU, map cuBLASLt and run the step's
/// first launches meanwhile (each mostly one thread's work, slower when
/// drawing takes every core).
pub fn draw_params_beside(
    g: &Graph,
    seed: u64,
    each: &mut (dyn FnMut(String, Vec<u8>) + Send),
) -> Option<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match rayon::ThreadPoolBuilder::new()
        .num_threads(cores.saturating_sub(3).max(1))
        .thread_name(|i| format!("fusec-draw-{i}"))
        .build()
    {
        Ok(pool) => pool.install(|| draw_params_each(g, seed, each)),
        Err(_) => draw_params_each(g, seed, each),
    }
}

/// [`init_params`] from values [`draw_params`] drew (or `draw_params_each`
/// is still drawing: each is written as it arrives), then the optimizer
/// state zero.
pub fn init_params_drawn(
    b: &mut dyn Backend,
    drawn: impl IntoIterator<Item = (String, Vec<u8>)>,
) -> Result<(), RuntimeError> {
    let dtypes: HashMap<String, fusec_compiler::dtype::DType> = b
        .graph()
        .params
        .iter()
        .map(|p| (p.name.clone(), p.ty.dtype))
        .collect();
    for (name, bytes) in drawn {
        if !b.shapes().contains_key(&name) {
            continue;
        }
        let dt = dtypes[&name];
        b.set_encoded(&name, dt, &bytes)?;
    }
    for s in b.state_names() {
        b.zero(&s)?;
    }
    Ok(())
}

pub fn state_names(g: &Graph) -> Vec<String> {
    let mut v: Vec<String> =
        g.g.node_indices()
            .filter_map(|n| match &g.g[n].op {
                Op::State(s) => Some(s.name.clone()),
                _ => None,
            })
            .collect();
    v.sort();
    v
}

/// Parameters and optimizer state, as a checkpoint after `step` steps.
pub fn checkpoint(b: &dyn Backend, step: u64) -> Result<Checkpoint, RuntimeError> {
    let g = b.graph();
    let mut names: Vec<String> = g.params.iter().map(|p| p.name.clone()).collect();
    names.extend(b.state_names());
    let mut tensors = Vec::new();
    for name in names {
        let Some(shape) = b.shapes().get(&name) else {
            continue;
        };
        let data = b.get(&name)?.into_iter().map(|x| x as f32).collect();
        tensors.push(CkTensor {
            name,
            shape: shape.clone(),
            data,
        });
    }
    Ok(Checkpoint {
        model: g.name.clone(),
        step,
        tensors,
        extra: Default::default(),
    })
}

/// The tensors a checkpoint must hold for this run: (name, shape).
pub fn needed(b: &dyn Backend) -> Vec<(String, Vec<usize>)> {
    let g = b.graph();
    let mut names: Vec<String> = g.params.iter().map(|p| p.name.clone()).collect();
    names.extend(b.state_names());
    names
        .into_iter()
        .filter_map(|n| b.shapes().get(&n).map(|s| (n, s.clone())))
        .collect()
}

/// The parameters alone, by name with their shapes (what `--init-from` needs).
pub fn needed_params(b: &dyn Backend) -> Vec<(String, Vec<usize>)> {
    let g = b.graph();
    g.params
        .iter()
        .filter_map(|p| b.shapes().get(&p.name).map(|s| (p.name.clone(), s.clone())))
        .collect()
}

/// Writes the parameters of a weights file (checked against `needed_params`);
/// the optimizer state stays as a fresh run has it.
pub fn restore_params(b: &mut dyn Backend, ck: &Checkpoint) -> Result<(), RuntimeError> {
    let names = needed_params(b);
    write_back(b, ck, names)
}

/// Writes a checkpoint's tensors back (checked with `checkpoint::check_against` first).
pub fn restore(b: &mut dyn Backend, ck: &Checkpoint) -> Result<(), RuntimeError> {
    let names = needed(b);
    write_back(b, ck, names)
}

fn write_back(
    b: &mut dyn Backend,
    ck: &Checkpoint,
    names: Vec<(String, Vec<usize>)>,
) -> Result<(), RuntimeError> {
    for (name, _) in names {
        let t = ck.get(&name).expect("checked against the run");
        let v: Vec<f64> = t.data.iter().map(|&x| x as f64).collect();
        b.set(&name, &v)?;
    }
    Ok(())
}
