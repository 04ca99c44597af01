//! Data parallelism on the command line: `--gpus N` (every GPU of this
//! machine, one process), a launcher's environment (one process per rank:
//! torchrun, Slurm, mpirun with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
//! and MASTER_PORT set), or `--cpu --gpus N` (N ranks of the CPU reference,
//! for checking). `--batch` is each rank's: N ranks with batch B train on
//! the batches one rank with N x B would.

use super::common::{rank_steps, Loaded};
use super::open::runtime_err;
use super::CliError;
use clap::Args;
use fusec::backend::ranks::{Build, Ranks};
use fusec::backend::GpuOptions;
use fusec::backend::{self, Backend};
use fusec_compiler::autodiff::zero::ZeroStage;
use fusec_compiler::interp::peers::Peers;
use fusec_compiler::interp::Precision;
use fusec_runtime::launcher;
use fusec_runtime::nccl;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

#[derive(Args, Debug, Default, Clone)]
pub struct ParallelArgs {
    /// Data parallel over N GPUs, gradients averaged in buckets by NCCL as
    /// the backward pass runs; --batch is each GPU's. train and bench run on
    /// this machine's --gpu and the next N - 1, one thread each (with --cpu:
    /// N ranks of the CPU reference); build writes the step one rank runs
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus: Option<u32>,
    /// ZeRO stage: 1, the default with several ranks, splits the optimizer
    /// state over them (each gets the averaged gradients of the parameters
    /// it owns, keeps and updates their state, then sends the new values to
    /// the others; with bf16 or fp16 the f32 master weights are split too,
    /// every rank keeping the weights in the compute dtype alone): the same
    /// training, in less memory and time; 2 splits the gradients too (each
    /// is reduced into its owners' pieces as the backward pass finishes it,
    /// and no rank keeps it whole past that); 3 splits the weights too
    /// (each rank keeps its piece of every parameter, gathered whole just
    /// before the forward and the backward pass read it: for models too big
    /// for one device); 0 keeps it all whole on every rank, as PyTorch DDP
    /// does
    #[arg(long, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
    /// Close each bucket of gradients averaged together at this many MiB
    /// (default 100, 50 with --reduce-dtype bf16; PyTorch DDP's is 25): larger buckets mean fewer
    /// collectives, smaller ones start averaging earlier in the backward pass
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub bucket_mib: Option<u64>,
    /// Average gradients over the ranks in this type: f32 (the default) or
    /// bf16, for a bf16 model: half the bytes a collective moves, at the
    /// price of rounding each rank's gradient and the sum to bf16
    #[arg(long, value_name = "DTYPE", value_parser = super::common::parse_reduce_dtype)]
    pub reduce_dtype: Option<fusec_compiler::ir::DType>,
    /// Which ranks ZeRO splits the pieces over: all (the default) splits
    /// them over every rank; host over each host's ranks, every host
    /// holding a whole copy in pieces (FSDP's hybrid sharding: the gathers
    /// and the reduces to the owners stay on the host's links, and only
    /// the owners' pieces of the gradients cross between hosts); N over
    /// groups of N consecutive ranks
    #[arg(long, value_name = "host|all|N", value_parser = parse_shard_within)]
    pub shard_within: Option<ShardWithin>,
}

/// Where ZeRO splits its pieces (`--shard-within`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardWithin {
    /// Over every rank of the job.
    All,
    /// Over each host's ranks (the launcher says how many a host runs).
    Host,
    /// Over groups of this many consecutive ranks.
    Ranks(u32),
}

fn parse_shard_within(s: &str) -> Result<ShardWithin, String> {
    match s {
        "all" => Ok(ShardWithin::All),
        "host" => Ok(ShardWithin::Host),
        n => match n.parse::<u32>() {
            Ok(k) if k >= 2 => Ok(ShardWithin::Ranks(k)),
            _ => Err(format!(
                "`{s}` is not host, all or a number of ranks (2 or more) to split over"
            )),
        },
    }
}

impl ParallelArgs {
    /// The ZeRO stage that splits a job of `world` ranks training
    /// `params`, if any: asked for with `--zero 1` or `--zero 2`, or stage 1
    /// by default where every rank gets a piece to own (a model of fewer
    /// than 64 elements a rank runs unsplit unless `--zero` asks, which then
    /// says why not).
    pub fn zero_stage(
        &self,
        world: usize,
        group: u32,
        params: &[fusec_compiler::ir::graph::ParamInfo],
    ) -> Option<ZeroStage> {
        if world < 2 {
            return None;
        }
        match self.zero {
            Some(0) => None,
            Some(2) => Some(ZeroStage::Two),
            Some(3) => Some(ZeroStage::Three),
            Some(_) => Some(ZeroStage::One),
            None => fusec_compiler::autodiff::zero::unsplittable(params, group)
                .is_none()
                .then_some(ZeroStage::One),
        }
    }

    /// The stage `--zero` names, for the compile (stage 1 where it names
    /// none, or 0).
    pub fn asked_stage(&self) -> ZeroStage {
        match self.zero {
            Some(2) => ZeroStage::Two,
            Some(3) => ZeroStage::Three,
            _ => ZeroStage::One,
        }
    }

    /// Sets `--bucket-mib` in the options every rank's step is lowered with.
    pub fn shape_buckets(&self, lower: &mut fusec_compiler::optimisation::LowerOptions) {
        lower.bucket_bytes = self.bucket_mib.map(|m| m << 20);
    }
}

impl ParallelArgs {
    /// The flags that mean nothing on one rank, refused there: `world`
    /// ranks from `--gpus`, or a launcher's (`launched`).
    pub fn check_ranks(&self, world: u32, launched: bool) -> Result<(), CliError> {
        let one = !launched && world < 2;
        if let Some(z @ 1..) = self.zero.filter(|_| one) {
            return Err(CliError::usage(format!(
                "error: --zero {z} splits the optimizer state{} over data-parallel ranks: give --gpus N (N >= 2) or start the ranks with a launcher",
                match z {
                    2 => " and the gradients",
                    3 => ", the gradients and the weights",
                    _ => "",
                }
            )));
        }
        if self.bucket_mib.is_some() && one {
            return Err(buckets_need_ranks());
        }
        if let Some(w) = self.shard_within {
            let asked = match w {
                ShardWithin::All => "all".to_string(),
                ShardWithin::Host => "host".to_string(),
                ShardWithin::Ranks(k) => k.to_string(),
            };
            if one {
                return Err(CliError::usage(format!(
                    "error: --shard-within {asked} chooses which data-parallel ranks ZeRO splits over: give --gpus N (N >= 2) or start the ranks with a launcher"
                )));
            }
            if self.zero == Some(0) {
                return Err(CliError::usage(format!(
                    "error: --shard-within {asked} chooses which ranks ZeRO splits over, and --zero 0 splits nothing: give --zero 1, 2 or 3"
                )));
            }
        }
        let narrow = self
            .reduce_dtype
            .is_some_and(|d| d != fusec_compiler::ir::DType::F32);
        if narrow && one {
            return Err(CliError::usage(format!(
                "error: {}",
                fusec_compiler::driver::REDUCE_NEEDS_RANKS
            )));
        }
        Ok(())
    }
}

/// The error for a `--bucket-mib` without data parallelism.
pub fn buckets_need_ranks() -> CliError {
    CliError::usage(
        "error: --bucket-mib sizes the gradient buckets of data parallelism: give --gpus N (N >= 2) or start the ranks with a launcher".to_string(),
    )
}

/// Which ranks this process runs.
pub enum Job {
    /// One rank: the step as always.
    Single,
    /// Every rank, in this process (`--gpus N`).
    Local(usize),
    /// One rank of a job a launcher started (where to meet, the GPU, the
    /// ranks its host runs).
    Launched(launcher::Launched),
}

impl Job {
    /// Ranks in the whole job.
    pub fn world(&self) -> usize {
        match self {
            Job::Single => 1,
            Job::Local(n) => *n,
            Job::Launched(l) => l.rendezvous.world,
        }
    }

    /// Whether this process writes logs, checkpoints and the progress
    /// lines (rank 0's does; the others stay quiet).
    pub fn writes(&self) -> bool {
        match self {
            Job::Launched(l) => l.rendezvous.rank == 0,
            _ => true,
        }
    }

    /// The GPU of this process's first rank (`gpu` is `--gpu`): where the
    /// validation step and the sampler run beside it.
    pub fn first_gpu(&self, gpu: usize) -> usize {
        match self {
            Job::Launched(l) => l.local,
            _ => gpu,
        }
    }
}

/// The job from `--gpus` and the launcher's variables.
pub fn job(args: &ParallelArgs) -> Result<Job, CliError> {
    let launched = launcher::from_env(|k| std::env::var(k).ok())
        .map_err(|e| CliError::usage(format!("error: {e}")))?;
    args.check_ranks(args.gpus.unwrap_or(1), launched.is_some())?;
    match (launched, args.gpus) {
        (Some(l), Some(n)) if n > 1 => Err(CliError::usage(format!(
            "error: --gpus {n} and {}'s {}={} both ask for ranks: under a launcher, start one process per GPU without --gpus",
            l.launcher.name(),
            l.launcher.world_var(),
            l.rendezvous.world
        ))),
        (Some(l), _) => Ok(Job::Launched(l)),
        (None, Some(n)) if n > 1 => Ok(Job::Local(n as usize)),
        (None, _) => Ok(Job::Single),
    }
}

/// The ranks ZeRO splits each parameter over in `job` (`--shard-within`):
/// all of them, a host's, or a group's of the size asked; checked against
/// the job (groups of one size, of consecutive ranks).
pub fn shard_group(args: &ParallelArgs, job: &Job) -> Result<u32, CliError> {
    let world = job.world() as u32;
    let group = match args.shard_within {
        None | Some(ShardWithin::All) => world,
        Some(ShardWithin::Ranks(k)) => k,
        Some(ShardWithin::Host) => match job {
            Job::Single | Job::Local(_) => world,
            Job::Launched(l) => {
                let Some(n) = l.local_size else {
                    return Err(CliError::usage(format!(
                        "error: --shard-within host needs the number of ranks on each host, and {} did not say it: set LOCAL_WORLD_SIZE (torchrun sets it), or give --shard-within N with N the ranks of one host",
                        l.launcher.name()
                    )));
                };
                if l.local != l.rendezvous.rank % n {
                    return Err(CliError::usage(format!(
                        "error: --shard-within host needs the ranks numbered host by host ({n} a host), and rank {} is local rank {} on its host: start the ranks in blocks (srun --distribution=block, mpirun --map-by slot)",
                        l.rendezvous.rank, l.local
                    )));
                }
                n as u32
            }
        },
    };
    if group < 2 || group > world || !world.is_multiple_of(group) {
        return Err(CliError::usage(format!(
            "error: --shard-within splits over groups of {group} ranks, which do not divide the job's {world} into groups of 2 or more"
        )));
    }
    Ok(group)
}

/// ZeRO as a job runs it: the stage, and the ranks each parameter is split
/// over (the job's, or a group's under `--shard-within`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Zero {
    pub stage: ZeroStage,
    pub group: u32,
}

impl ParallelArgs {
    /// ZeRO as `job` runs it training `params`, if at all
    /// ([`ParallelArgs::zero_stage`] over [`shard_group`]'s ranks).
    pub fn zero(
        &self,
        job: &Job,
        params: &[fusec_compiler::ir::graph::ParamInfo],
    ) -> Result<Option<Zero>, CliError> {
        if job.world() < 2 {
            return Ok(None);
        }
        let group = shard_group(self, job)?;
        Ok(self
            .zero_stage(job.world(), group, params)
            .map(|stage| Zero { stage, group }))
    }
}

/// What a data-parallel run says of its optimizer state, and of where it
/// splits it.
fn zero_line(zero: Option<Zero>, world: usize) -> String {
    let within = match zero {
        Some(z) if (z.group as usize) < world => format!(
            "; split over groups of {} ranks, {} groups holding the same pieces (--shard-within)",
            z.group,
            world / z.group as usize
        ),
        _ => String::new(),
    };
    let line = match zero.map(|z| z.stage) {
        Some(ZeroStage::One) => "ZeRO stage 1: each rank keeps and updates its piece of the optimizer state (and of the f32 master weights) (--zero 0 keeps them whole)",
        Some(ZeroStage::Two) => "ZeRO stage 2: each rank keeps its piece of the gradients, the optimizer state (and the f32 master weights), and updates it (--zero 1 keeps the gradients whole)",
        Some(ZeroStage::Three) => "ZeRO stage 3: each rank keeps its piece of the weights, the gradients and the optimizer state, and gathers each weight whole just before a pass reads it (--zero 2 keeps the weights whole)",
        None => "every rank keeps the whole optimizer state",
    };
    format!("{line}{within}")
}

/// `dims` with the batch of every rank together (what callers of a
/// data-parallel backend feed).
pub fn whole_batch(dims: &BTreeMap<String, i64>, world: usize) -> BTreeMap<String, i64> {
    let mut d = dims.clone();
    if let Some(b) = d.get_mut(fusec_compiler::ir::dim::BATCH) {
        *b *= world as i64;
    }
    d
}

/// What every rank must agree on: the plan (model, sizes, precision, the
/// ranks it was built for) and the data it reads.
pub fn plan_hash(loaded: &Loaded, dims: &BTreeMap<String, i64>, data: &str) -> u64 {
    let g = &loaded.compiled.optimized;
    let program = fusec_compiler::kernel::fuse::fuse_with(g, &loaded.compiled.options.lower);
    let mut h = std::hash::DefaultHasher::new();
    match fusec_compiler::plan::plan(g, &program, dims) {
        Ok(p) => p.to_json().hash(&mut h),
        Err(e) => e.to_string().hash(&mut h),
    }
    data.hash(&mut h);
    // A token file: its size and its first and last MiB.
    if let Ok(bytes) = std::fs::metadata(data).map(|m| m.len()) {
        bytes.hash(&mut h);
        if let Ok(mut f) = std::fs::File::open(data) {
            use std::io::{Read, Seek, SeekFrom};
            let mut buf = vec![0u8; 1 << 20];
            let n = f.read(&mut buf).unwrap_or(0);
            buf[..n].hash(&mut h);
            if bytes > 1 << 20 && f.seek(SeekFrom::End(-(1 << 20))).is_ok() {
                let n = f.read(&mut buf).unwrap_or(0);
                buf[..n].hash(&mut h);
            }
        }
    }
    h.finish()
}

/// The ranks of `job` as one backend, ready to step: sessions built (the
/// first compiles, the rest read the cache), communicators joined.
#[allow(clippy::too_many_arguments)]
pub fn start(
    loaded: &Loaded,
    dims: &BTreeMap<String, i64>,
    job: &Job,
    first_gpu: usize,
    cpu: bool,
    options: GpuOptions,
    data: &str,
    zero: Option<Zero>,
) -> Result<Ranks, CliError> {
    let world = job.world();
    // With ZeRO, each rank's step updates its own parameters only: every
    // local rank's step from one compile. A rank's step is its place's in
    // its group (the groups of hybrid sharding run the same steps).
    let graphs_for = |ranks: &[usize]| -> Result<Vec<fusec_compiler::ir::Graph>, CliError> {
        let Some(z) = zero else {
            return Ok(vec![loaded.compiled.optimized.clone(); ranks.len()]);
        };
        let group = z.group as usize;
        let rows = loaded.compiled.options.loss_head_rows;
        // With a memory budget every place of a group, so that each
        // process makes the one choice (`RankBudget::fit`); else these
        // ranks' places alone.
        let compiled: Vec<u32> = match &loaded.rank_budget {
            Some(_) => (0..z.group).collect(),
            None => ranks
                .iter()
                .map(|&r| (r % group) as u32)
                .collect::<std::collections::BTreeSet<u32>>()
                .into_iter()
                .collect(),
        };
        let mut graphs = rank_steps(loaded, world as u32, z, &compiled)?
            .into_iter()
            .map(|l| {
                let mut g = l.compiled.optimized;
                super::common::chunk_loss_head(&mut g, dims, rows)?;
                Ok(g)
            })
            .collect::<Result<Vec<_>, CliError>>()?;
        if let Some(budget) = &loaded.rank_budget {
            let chosen = budget.fit(&mut graphs, dims, &loaded.compiled.options.lower)?;
            if let Some(choice) = chosen {
                let file = loaded.path.display().to_string();
                eprint!(
                    "each rank's step, {}",
                    choice.describe(&graphs[0], Some((&file, &loaded.source)))
                );
            }
        }
        let step_of = |r: usize| compiled.iter().position(|&c| c as usize == r % group);
        ranks
            .iter()
            .map(|&r| {
                step_of(r).map(|i| graphs[i].clone()).ok_or_else(|| {
                    CliError::usage(format!("error: no step was compiled for rank {r}"))
                })
            })
            .collect()
    };
    let usage = |m: String| CliError::usage(format!("error: {m}"));
    if cpu {
        let Job::Local(n) = job else {
            return Err(usage(
                "--cpu runs its ranks in one process: use --cpu --gpus N, not a launcher".into(),
            ));
        };
        eprintln!(
            "CPU reference interpreter, {n} ranks meeting at each all-reduce: slow, for small models; {}",
            zero_line(zero, world)
        );
        let graphs = graphs_for(&(0..*n).collect::<Vec<_>>())?;
        let builds = Peers::group(*n)
            .into_iter()
            .zip(graphs)
            .enumerate()
            .map(|(r, (peers, g))| {
                let dims = dims.clone();
                let build: Build = Box::new(move || {
                    let mut cpu = backend::Cpu::new(&g, &dims, Precision::AsStored)?;
                    cpu.join(peers);
                    if let Some(z) = zero {
                        cpu.share_updates(z.group);
                    }
                    Ok(Box::new(cpu) as Box<dyn Backend>)
                });
                Ok((r, build))
            })
            .collect::<Result<Vec<_>, CliError>>()?;
        return Ranks::new(builds, *n).map_err(runtime_err);
    }
    if zero.is_some_and(|z| z.stage == ZeroStage::Three) {
        eprintln!(
            "note: ZeRO stage 3 on GPUs has been checked against one GPU through ranks sharing one GPU (tests/dp_gpu.rs's loopback), not yet over NCCL on several; --zero 2 keeps the weights whole"
        );
    }
    nccl::need_nccl().map_err(runtime_err)?;
    // (global rank, GPU ordinal) of each rank here.
    let here: Vec<(usize, usize)> = match job {
        Job::Single => vec![(0, first_gpu)],
        Job::Local(n) => (0..*n).map(|r| (r, first_gpu + r)).collect(),
        Job::Launched(l) => vec![(l.rendezvous.rank, l.local)],
    };
    // A launched job meets before the GPUs are set up, so a mismatch or a
    // missing rank is reported before minutes of compiling.
    let id = match job {
        Job::Launched(l) => {
            let rv = &l.rendezvous;
            if rv.rank == 0 {
                eprintln!(
                    "rank 0 of {world}: waiting for the other ranks on port {}",
                    rv.port
                );
            }
            rv.exchange(plan_hash(loaded, dims, data), nccl::unique_id)
                .map_err(runtime_err)?
        }
        _ => nccl::unique_id().map_err(runtime_err)?,
    };
    let name = loaded.compiled.model.graph.name.clone();
    let ready: fusec::backend::ranks::Ready = std::sync::Arc::new(move |rank, ordinal, s| {
        eprintln!(
            "  rank {rank} on GPU {ordinal}, {} ({}): {} kernels of {name} ready ({} distinct, {} from the cache); arena {:.2} GiB",
            s.session.exec.gpu.name,
            s.session.exec.gpu.arch(),
            s.session.kernels_generated,
            s.session.cache.hits + s.session.cache.compiled,
            s.session.cache.hits,
            s.session.plan.arena_bytes as f64 / (1u64 << 30) as f64
        );
    });
    let graphs = graphs_for(&here.iter().map(|&(rank, _)| rank).collect::<Vec<_>>())?;
    let ranks = fusec::backend::ranks::start_gpus(
        graphs,
        &loaded.compiled.options.lower,
        dims,
        &here,
        world,
        id,
        options,
        Some(fusec_runtime::cache::default_dir()),
        ready,
        zero.is_some(),
    )
    .map_err(runtime_err)?;
    eprintln!(
        "data parallel: {world} ranks joined (NCCL {}), {} of them in this process; {}",
        nccl::version(),
        here.len(),
        zero_line(zero, world)
    );
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launched job's rank `rank` of `world`, `local` on its host, with
    /// `LOCAL_WORLD_SIZE` where given.
    fn launched(world: usize, rank: usize, local: usize, size: Option<usize>) -> Job {
        let vars: Vec<(String, String)> = [
            ("WORLD_SIZE", Some(world)),
            ("RANK", Some(rank)),
            ("LOCAL_RANK", Some(local)),
            ("LOCAL_WORLD_SIZE", size),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k.to_string(), v.to_string())))
        .collect();
        let var = |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        Job::Launched(launcher::from_env(var).unwrap().expect("a job"))
    }

    fn within(w: ShardWithin) -> ParallelArgs {
        ParallelArgs {
            shard_within: Some(w),
            ..Default::default()
        }
    }

    /// `--shard-within host` groups by the launcher's ranks a host, and
    /// only where the ranks are numbered host by host; one process's ranks
    /// are one host's; a group must divide the job.
    #[test]
    fn the_group_is_the_hosts_ranks_where_the_launcher_says() {
        let host = within(ShardWithin::Host);
        assert_eq!(shard_group(&host, &launched(8, 5, 1, Some(4))).unwrap(), 4);
        let e = shard_group(&host, &launched(8, 5, 1, None)).unwrap_err();
        assert!(e.message.contains("set LOCAL_WORLD_SIZE"), "{}", e.message);
        // Rank 5 as local rank 0 of 4: round-robin over hosts.
        let e = shard_group(&host, &launched(8, 5, 0, Some(4))).unwrap_err();
        assert!(e.message.contains("numbered host by host"), "{}", e.message);
        assert_eq!(shard_group(&host, &Job::Local(4)).unwrap(), 4);
        let all = within(ShardWithin::All);
        assert_eq!(shard_group(&all, &launched(8, 5, 1, Some(4))).unwrap(), 8);
        assert_eq!(
            shard_group(&ParallelArgs::default(), &Job::Local(3)).unwrap(),
            3
        );
        let three = within(ShardWithin::Ranks(3));
        assert!(shard_group(&three, &Job::Local(4)).is_err());
        assert_eq!(shard_group(&three, &Job::Local(6)).unwrap(), 3);
        assert_eq!(parse_shard_within("host"), Ok(ShardWithin::Host));
        assert_eq!(parse_shard_within("2"), Ok(ShardWithin::Ranks(2)));
        assert!(parse_shard_within("1").is_err());
        assert!(parse_shard_within("hosts").is_err());
    }
}
