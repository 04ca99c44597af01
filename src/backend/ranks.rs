//! Data-parallel training as one backend: the ranks this process runs
//! (every GPU of `fusec train --gpus N`, or the one rank a launcher gave it),
//! each on a thread of its own that owns its backend, stepped together.
//!
//! Callers see the whole batch: an input whose first axis is the batch `B`
//! has `ranks` times the rows of one rank's, and rank `r` gets rows
//! `r * B .. (r + 1) * B` of it. So N ranks with batch B read the batches
//! one rank with batch N x B would, and their averaged gradients are that
//! rank's. Parameters and state are the same on every rank (the same
//! initialisation, the same averaged updates): they are written to all and
//! read from the first.

use super::{split_staged, Backend, GpuOptions};
use fusec_compiler::autodiff::zero;
use fusec_compiler::ir::Graph;
use fusec_compiler::ops::Op;
use fusec_compiler::optimisation::LowerOptions;
use fusec_runtime::session::StepStats;
use fusec_runtime::stage::HostBuf;
use fusec_runtime::RuntimeError;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce(&mut dyn Backend) + Send>;

/// Builds one rank's backend, on that rank's thread.
pub type Build = Box<dyn FnOnce() -> Result<Box<dyn Backend>, RuntimeError> + Send>;

struct Worker {
    rank: usize,
    /// The tensors this rank holds (with ZeRO, only its own optimizer state).
    names: BTreeSet<String>,
    /// Elements of each tensor it holds.
    sizes: BTreeMap<String, usize>,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

pub struct Ranks {
    workers: Vec<Worker>,
    /// Ranks in the whole job (in every process).
    world: usize,
    graph: Graph,
    /// Shapes as callers see them: batch inputs with the whole batch.
    shapes: BTreeMap<String, Vec<usize>>,
    /// Inputs split across the ranks along their first axis.
    batched: BTreeSet<String>,
    /// Every local rank's optimizer state names.
    states: Vec<String>,
    /// ZeRO: the states held in pieces, with their parameter's index.
    split: BTreeMap<String, usize>,
    /// ZeRO: every rank's states of each parameter (its moments, its
    /// master), with the parameter's index, whichever process holds them.
    owned: BTreeMap<String, usize>,
    /// ZeRO: the ranks each piece set is split over (`world`, or a host's
    /// with hybrid sharding: rank r holds group rank r % group's pieces,
    /// and the first group's ranks hold them all).
    group: usize,
    /// Steps launched so far, and the step the `gathered` states are of.
    steps: u64,
    /// ZeRO under a launcher: the states of other processes' ranks,
    /// gathered for a checkpoint (`gather_for_checkpoint`), f32.
    gathered: Option<(u64, BTreeMap<String, Vec<f32>>)>,
}

fn lost(rank: usize) -> RuntimeError {
    RuntimeError::Unsupported(format!(
        "rank {rank} stopped (its thread ended early; the error above, if any, says why)"
    ))
}

impl Ranks {
    /// Starts one thread per entry of `builds` ((global rank, builder)), in
    /// order, each building its backend before the next starts (the first
    /// compiles the kernels, the others find them in the cache). `world`
    /// counts the ranks of every process.
    pub fn new(builds: Vec<(usize, Build)>, world: usize) -> Result<Ranks, RuntimeError> {
        let mut workers = Vec::with_capacity(builds.len());
        let mut first: Option<Graph> = None;
        let mut shapes: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let mut states: BTreeSet<String> = BTreeSet::new();
        for (rank, build) in builds {
            let (jobs, inbox) = channel::<Job>();
            let (ready, built) = channel();
            let thread = std::thread::Builder::new()
                .name(format!("fusec-rank-{rank}"))
                .spawn(move || {
                    let mut backend = match build() {
                        Ok(b) => {
                            let _ = ready.send(Ok((
                                b.graph().clone(),
                                b.shapes().clone(),
                                b.state_names(),
                            )));
                            b
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    for job in inbox {
                        job(backend.as_mut());
                    }
                })
                .map_err(|e| {
                    RuntimeError::Unsupported(format!(
                        "cannot start the thread of rank {rank}: {e}"
                    ))
                })?;
            let result = built.recv().map_err(|_| lost(rank))?;
            let (graph, rank_shapes, rank_states) = result.map_err(|e| match e {
                RuntimeError::Unsupported(m) => {
                    RuntimeError::Unsupported(format!("rank {rank}: {m}"))
                }
                other => other,
            })?;
            workers.push(Worker {
                rank,
                names: rank_shapes.keys().cloned().collect(),
                sizes: rank_shapes
                    .iter()
                    .map(|(k, v)| (k.clone(), v.iter().product()))
                    .collect(),
                jobs: Some(jobs),
                thread: Some(thread),
            });
            shapes.extend(rank_shapes);
            states.extend(rank_states);
            first.get_or_insert(graph);
        }
        let graph = first.ok_or_else(|| {
            RuntimeError::Unsupported("data parallelism with no ranks in this process".into())
        })?;
        // ZeRO: a state of which the ranks hold pieces (flat) is shown, set
        // and read whole, in its parameter's shape; so is a parameter they
        // hold in pieces (stage 3). The whole shape is the model's (a rank's
        // own is its piece's, under stage 3).
        let whole_shape = |i: usize| -> Option<Vec<usize>> {
            graph.params[i]
                .ty
                .shape
                .iter()
                .map(|d| d.as_const().map(|n| n as usize))
                .collect()
        };
        // (Stage 3 holds every weight in pieces, whatever the sizes of
        // this process's own: under a launcher its one rank may own one
        // whole, flat.)
        let gathers = graph.gathers_weights();
        let mut split = BTreeMap::new();
        for (i, p) in graph.params.iter().enumerate() {
            let Some(full) = whole_shape(i) else {
                continue;
            };
            let n: usize = full.iter().product();
            if gathers
                || workers
                    .iter()
                    .any(|w| w.sizes.get(&p.name).is_some_and(|&k| k != n))
            {
                split.insert(p.name.clone(), i);
                shapes.insert(p.name.clone(), full);
            }
        }
        for name in &states {
            let Some((param, _)) = name.rsplit_once('.') else {
                continue;
            };
            let Some(i) = graph.params.iter().position(|p| p.name == param) else {
                continue;
            };
            let Some(full) = shapes.get(param).cloned() else {
                continue;
            };
            let n: usize = full.iter().product();
            let pieces = workers
                .iter()
                .any(|w| w.sizes.get(name).is_some_and(|&k| k != n));
            if pieces {
                split.insert(name.clone(), i);
                shapes.insert(name.clone(), full);
            } else if shapes.get(name).is_some_and(|s| *s != full) {
                // Stage 3 updates a parameter one rank owns whole as a flat
                // piece too: its state is shown in the parameter's shape.
                shapes.insert(name.clone(), full);
            }
        }
        let mut owned = fusec_compiler::autodiff::zero::job_states(&graph, &states);
        // Stage 3: the weights too are held in pieces, each rank its own,
        // and gathered for a checkpoint as the states are. (Every rank's
        // graph gathers its weights, so every process decides alike.)
        if gathers {
            owned.extend(
                graph
                    .params
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (p.name.clone(), i)),
            );
        }
        for (name, &i) in &owned {
            if let Some(full) = shapes.get(&graph.params[i].name).cloned() {
                shapes.entry(name.clone()).or_insert(full);
            }
        }
        let batched = batch_inputs(&graph);
        for name in &batched {
            if let Some(s) = shapes.get_mut(name) {
                if let Some(rows) = s.first_mut() {
                    *rows *= world;
                }
            }
        }
        let group = graph.shard_group().map_or(world, |g| g as usize);
        Ok(Ranks {
            workers,
            world,
            group,
            graph,
            shapes,
            batched,
            states: states.into_iter().collect(),
            split,
            owned,
            steps: 0,
            gathered: None,
        })
    }

    /// ZeRO's f32 master of parameter `name`, where the ranks keep the
    /// parameter in the compute dtype (`autodiff::zero::keeps_master`):
    /// its owners hold it in pieces, as state.
    fn master_of(&self, name: &str) -> Option<String> {
        let i = self.graph.params.iter().position(|p| p.name == name)?;
        zero::has_master(&self.graph, i).then(|| zero::master_name(name))
    }

    /// `name` from the first rank of this process holding it (with ZeRO,
    /// a state's owner).
    fn first_held(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        let n = name.to_string();
        let mut held = self.try_holding(name, move |_, b| b.get(&n))?;
        if held.is_empty() {
            return Err(RuntimeError::Unsupported(format!(
                "no rank in this process holds `{name}`"
            )));
        }
        Ok(held.swap_remove(0))
    }

    /// `name` as gathered for a checkpoint since the last step, if it was.
    fn gathered_now(&self, name: &str) -> Option<Vec<f64>> {
        let (at, all) = self.gathered.as_ref()?;
        (*at == self.steps).then(|| all.get(name).map(|v| v.iter().map(|&x| x as f64).collect()))?
    }

    /// Whether the state `name` is a parameter's master.
    fn is_master(&self, name: &str) -> bool {
        self.graph
            .params
            .iter()
            .any(|p| self.master_of(&p.name).as_deref() == Some(name))
    }

    /// Runs `f` on every rank at once (rank, its backend); the results in
    /// rank order.
    pub fn each<R: Send + 'static>(
        &self,
        f: impl Fn(usize, &mut dyn Backend) -> R + Send + Sync + 'static,
    ) -> Result<Vec<R>, RuntimeError> {
        let f = Arc::new(f);
        let mut replies = Vec::with_capacity(self.workers.len());
        for w in &self.workers {
            let (tx, rx) = channel();
            let f = Arc::clone(&f);
            let rank = w.rank;
            let job: Job = Box::new(move |b| {
                let _ = tx.send(f(rank, b));
            });
            w.jobs
                .as_ref()
                .and_then(|j| j.send(job).ok())
                .ok_or_else(|| lost(rank))?;
            replies.push((rank, rx));
        }
        replies
            .into_iter()
            .map(|(rank, rx)| rx.recv().map_err(|_| lost(rank)))
            .collect()
    }

    /// [`Ranks::try_each`] on the ranks that hold tensor `name` only.
    fn try_holding<R: Send + 'static>(
        &self,
        name: &str,
        f: impl Fn(usize, &mut dyn Backend) -> Result<R, RuntimeError> + Send + Sync + 'static,
    ) -> Result<Vec<R>, RuntimeError> {
        let holders: BTreeSet<usize> = self
            .workers
            .iter()
            .filter(|w| w.names.contains(name))
            .map(|w| w.rank)
            .collect();
        let out = self.try_each(move |rank, b| {
            if holders.contains(&rank) {
                f(rank, b).map(Some)
            } else {
                Ok(None)
            }
        })?;
        Ok(out.into_iter().flatten().collect())
    }

    /// [`Ranks::each`] for calls that can fail: the first error, naming its rank.
    pub fn try_each<R: Send + 'static>(
        &self,
        f: impl Fn(usize, &mut dyn Backend) -> Result<R, RuntimeError> + Send + Sync + 'static,
    ) -> Result<Vec<R>, RuntimeError> {
        let world = self.world;
        self.each(f)?
            .into_iter()
            .zip(self.workers.iter().map(|w| w.rank))
            .map(|(r, rank)| r.map_err(|e| name_rank(e, rank, world)))
            .collect()
    }

    /// Ranks in the whole job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The global ranks this process runs.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.workers.iter().map(|w| w.rank).collect()
    }

    /// Rank `rank`'s rows of a whole-batch tensor (`values` in order).
    fn part(&self, values: &[f64], rank: usize) -> Vec<f64> {
        let n = values.len() / self.world;
        values[rank * n..(rank + 1) * n].to_vec()
    }
}

/// `e` with the rank it happened on, when the job has several.
fn name_rank(e: RuntimeError, rank: usize, world: usize) -> RuntimeError {
    if world < 2 {
        return e;
    }
    match e {
        RuntimeError::Unsupported(m) => RuntimeError::Unsupported(format!("rank {rank}: {m}")),
        RuntimeError::Driver { what, detail } => RuntimeError::Driver {
            what: format!("{what} (rank {rank})"),
            detail,
        },
        RuntimeError::Compile(m) => RuntimeError::Compile(format!("rank {rank}: {m}")),
        RuntimeError::Gemm(m) => RuntimeError::Gemm(format!("rank {rank}: {m}")),
        other => other,
    }
}

/// The model's inputs whose first axis is the batch `B`.
pub fn batch_inputs(g: &Graph) -> BTreeSet<String> {
    g.g.node_indices()
        .filter_map(|n| match &g.g[n].op {
            Op::Input(i)
                if i.ty
                    .shape
                    .first()
                    .is_some_and(|d| d.to_string() == fusec_compiler::ir::dim::BATCH) =>
            {
                Some(i.name.clone())
            }
            _ => None,
        })
        .collect()
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.jobs = None;
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Backend for Ranks {
    fn graph(&self) -> &Graph {
        &self.graph
    }
    /// Each rank its own key, from its global rank.
    fn set_dropout_key(
        &mut self,
        seed: u64,
        step: u64,
        micro: u64,
        _: usize,
    ) -> Result<(), RuntimeError> {
        self.try_each(move |rank, b| b.set_dropout_key(seed, step, micro, rank))?;
        Ok(())
    }
    fn set(&mut self, name: &str, values: &[f64]) -> Result<(), RuntimeError> {
        let whole = self.numel(name);
        if whole != values.len() {
            return Err(RuntimeError::Unsupported(format!(
                "`{name}` holds {whole} values (all ranks), given {}",
                values.len()
            )));
        }
        let name = name.to_string();
        let held_name = name.clone();
        if self.batched.contains(&name) {
            let parts: Arc<Vec<Vec<f64>>> =
                Arc::new((0..self.world).map(|r| self.part(values, r)).collect());
            self.try_each(move |rank, b| b.set(&name, &parts[rank]))?;
        } else if let Some(&i) = self.split.get(&name) {
            // Each holder its own piece of the whole.
            let pieces =
                fusec_compiler::autodiff::zero::pieces(&self.graph.params, self.group as u32)
                    .swap_remove(i);
            let parts: Arc<BTreeMap<usize, Vec<f64>>> = Arc::new(
                pieces
                    .iter()
                    .map(|pc| {
                        (
                            pc.rank as usize,
                            values[pc.lo as usize..pc.hi as usize].to_vec(),
                        )
                    })
                    .collect(),
            );
            let held = name.clone();
            let group = self.group;
            self.try_holding(&held, move |rank, b| match parts.get(&(rank % group)) {
                Some(v) => b.set(&name, v),
                None => Ok(()),
            })?;
        } else {
            let values = Arc::new(values.to_vec());
            let held = name.clone();
            self.try_holding(&held, move |_, b| b.set(&name, &values))?;
        }
        // ZeRO's masters: the owners keep the values unrounded, the
        // parameter holds them in the compute dtype.
        if let Some(master) = self.master_of(&held_name) {
            if self.states.contains(&master) {
                self.set(&master, values)?;
            }
        }
        Ok(())
    }
    fn zero(&mut self, name: &str) -> Result<(), RuntimeError> {
        let n = name.to_string();
        self.try_holding(name, move |_, b| b.zero(&n))?;
        Ok(())
    }
    fn state_names(&self) -> Vec<String> {
        // A master is its parameter: set, read and saved as it. Under a
        // launcher, the states other processes' ranks keep too (and under
        // stage 3 their pieces of the weights, which are no states).
        let all: BTreeSet<&String> = self.states.iter().chain(self.owned.keys()).collect();
        all.into_iter()
            .filter(|s| !self.is_master(s) && !self.graph.params.iter().any(|p| &p.name == *s))
            .cloned()
            .collect()
    }
    fn get_forward(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        // Stage 3 keeps no rank's weights whole: they are read as a
        // checkpoint reads them (gathered first under a launcher).
        if self.master_of(name).is_none() || self.owned.contains_key(name) {
            return self.get(name);
        }
        // The parameter as every rank keeps it, in the compute dtype: what
        // a forward pass reads of it (its cast of the master), with no
        // gather from the owners.
        self.first_held(name)
    }
    fn gather_for_checkpoint(&mut self) -> Result<(), RuntimeError> {
        let local = self.workers.len();
        let done = matches!(&self.gathered, Some((at, _)) if *at == self.steps);
        if self.owned.is_empty() || local == self.world || done {
            return Ok(());
        }
        // The pieces' owners are the first group's ranks (every group holds
        // the same pieces): they send, every other rank receives.
        let all = fusec_compiler::autodiff::zero::pieces(&self.graph.params, self.group as u32);
        let mut gathered = BTreeMap::new();
        for (name, &i) in &self.owned {
            let pieces = Arc::new(all[i].clone());
            let numel = self.numel(&self.graph.params[i].name);
            let n = name.clone();
            let mut parts = self.try_each(move |_, b| b.gather_split(&n, &pieces, numel))?;
            let whole = parts.swap_remove(0);
            gathered.insert(name.clone(), whole.into_iter().map(|x| x as f32).collect());
        }
        self.gathered = Some((self.steps, gathered));
        Ok(())
    }
    fn get(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        if let Some(master) = self.master_of(name) {
            return self.get(&master);
        }
        let n = name.to_string();
        let parts = if self.batched.contains(name) {
            // Only this process's rows: another process holds the rest.
            self.try_each(move |_, b| b.get(&n))?
        } else if let Some(whole) = self.gathered_now(name) {
            vec![whole]
        } else if self.split.contains_key(name) || self.owned.contains_key(name) {
            // The pieces in rank order make the whole, where every rank
            // holding one is in this process (the first group's: the
            // other groups hold the same pieces again).
            let group = self.group;
            let parts = self.try_holding(name, move |rank, b| match rank < group {
                true => b.get(&n).map(Some),
                false => Ok(None),
            })?;
            let whole: Vec<f64> = parts.into_iter().flatten().collect::<Vec<_>>().concat();
            if whole.len() != self.numel(name) {
                return Err(RuntimeError::Unsupported(format!(
                    "`{name}` is split over ranks in other processes (ZeRO); it is read whole only as a checkpoint gathers it"
                )));
            }
            vec![whole]
        } else {
            vec![self.first_held(name)?]
        };
        Ok(parts.concat())
    }
    fn launch(&mut self, lr: f64, step: u64) -> Result<(), RuntimeError> {
        self.steps += 1;
        self.try_each(move |_, b| b.launch(lr, step))?;
        Ok(())
    }
    fn finish(&mut self) -> Result<StepStats, RuntimeError> {
        // The loss and the norm are averaged over the ranks: any rank's will do.
        let stats = self.try_each(|_, b| b.finish())?;
        stats
            .into_iter()
            .next()
            .ok_or_else(|| RuntimeError::Unsupported("no ranks".into()))
    }
    fn stage(&mut self, names: &[&str], buf: &HostBuf) -> Result<(), RuntimeError> {
        let values = buf.read()?;
        let wholes = split_staged(values, names, |n| self.numel(n))?;
        // Rank r's values: its rows of each input, the inputs in order.
        let mut parts: Vec<Vec<i32>> = vec![Vec::new(); self.world];
        for (name, whole) in names.iter().zip(wholes) {
            let split = self.batched.contains(*name);
            let k = whole.len() / self.world;
            for (r, part) in parts.iter_mut().enumerate() {
                match split {
                    true => part.extend_from_slice(&whole[r * k..(r + 1) * k]),
                    false => part.extend_from_slice(whole),
                }
            }
        }
        let parts = Arc::new(parts);
        let names: Arc<Vec<String>> = Arc::new(names.iter().map(|s| s.to_string()).collect());
        self.try_each(move |rank, b| {
            let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
            b.stage(&names, &HostBuf::Plain(parts[rank].clone()))
        })?;
        Ok(())
    }
    fn shapes(&self) -> &BTreeMap<String, Vec<usize>> {
        &self.shapes
    }
}

/// Told about each GPU rank once its step is loaded: (rank, GPU ordinal,
/// the backend).
pub type Ready = Arc<dyn Fn(usize, usize, &super::Gpu) + Send + Sync>;

/// GPU ranks `here` ((global rank, GPU ordinal)), running `graphs` (one
/// each: with ZeRO (`zero`), each rank's own update), of a job of `world`
/// ranks as one backend: each rank's session built on its thread (one after
/// another: the first compiles the kernels, the rest find them in the
/// cache), then every rank joins communicator `id` at once.
#[allow(clippy::too_many_arguments)]
pub fn start_gpus(
    graphs: Vec<Graph>,
    lower: &LowerOptions,
    dims: &BTreeMap<String, i64>,
    here: &[(usize, usize)],
    world: usize,
    id: fusec_runtime::nccl::UniqueId,
    options: GpuOptions,
    cache_dir: Option<std::path::PathBuf>,
    ready: Ready,
    zero: bool,
) -> Result<Ranks, RuntimeError> {
    let builds = gpu_builds(graphs, lower, dims, here, options, cache_dir, ready);
    let ranks = Ranks::new(builds, world)?;
    ranks.try_each(move |rank, b| b.join_comm(&id, rank, world, zero))?;
    Ok(ranks)
}

/// `graphs.len()` GPU ranks all on GPU `ordinal`, meeting through host
/// memory (`fusec_runtime::loopback`) instead of NCCL, which refuses two
/// ranks on one device: the data-parallel step checked on a machine with
/// one GPU. Slow, launch by launch; never a measurement.
pub fn start_loopback(
    graphs: Vec<Graph>,
    lower: &LowerOptions,
    dims: &BTreeMap<String, i64>,
    ordinal: usize,
    options: GpuOptions,
    zero: bool,
) -> Result<Ranks, RuntimeError> {
    let world = graphs.len();
    let here: Vec<(usize, usize)> = (0..world).map(|rank| (rank, ordinal)).collect();
    let ready: Ready = Arc::new(|_, _, _| {});
    let builds = gpu_builds(graphs, lower, dims, &here, options, None, ready);
    let ranks = Ranks::new(builds, world)?;
    let place = Arc::new(fusec_runtime::loopback::Loopback::new(world));
    ranks.try_each(move |rank, b| b.join_loopback(Arc::clone(&place), rank, zero))?;
    Ok(ranks)
}

/// Each GPU rank's builder: (global rank, GPU ordinal) of `here` with its
/// graph, its session opened on its own thread and announced to `ready`.
fn gpu_builds(
    graphs: Vec<Graph>,
    lower: &LowerOptions,
    dims: &BTreeMap<String, i64>,
    here: &[(usize, usize)],
    options: GpuOptions,
    cache_dir: Option<std::path::PathBuf>,
    ready: Ready,
) -> Vec<(usize, Build)> {
    here.iter()
        .zip(graphs)
        .map(|(&(rank, ordinal), g)| {
            let (dims, cache_dir, ready, lower) = (
                dims.clone(),
                cache_dir.clone(),
                Arc::clone(&ready),
                lower.clone(),
            );
            let build: Build = Box::new(move || {
                let gpu = fusec_runtime::device::open(ordinal)?;
                let b = super::Gpu::open(
                    gpu,
                    &g,
                    &lower,
                    &dims,
                    cache_dir.as_deref(),
                    &|_, _| {},
                    options,
                )?;
                ready(rank, ordinal, &b);
                Ok(Box::new(b) as Box<dyn Backend>)
            });
            (rank, build)
        })
        .collect()
}
