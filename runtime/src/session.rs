//! A training session: the compiled step made ready on a GPU (kernels
//! compiled or taken from the cache, arena allocated, parameters
//! initialised), then stepped with batches.

use crate::cache::{self, CacheStats};
use crate::device::Gpu;
use crate::exec::{decode, encode, Executor};
use crate::gemm_tuning::Tuning;
use crate::stage::HostBuf;
use crate::RuntimeError;
use fusec_compiler::plan::inputs::{APPLY_INPUT, LOSS_SCALE_INPUT, LR_INPUT, STEP_INPUT};
use fusec_compiler::plan::shard::Piece;
use fusec_compiler::plan::{CompiledStep, LaunchKind, Plan, StepParam};
use fusec_compiler::target::{F32Math, Target};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

pub struct Session {
    pub exec: Executor,
    pub plan: Plan,
    /// The step's parameters, in the model's order, with their gradients'
    /// buffers.
    pub params: Vec<StepParam>,
    /// What the step was compiled for.
    pub target: Target,
    /// FLOPs of one step, as the roofline counts them.
    pub flops: f64,
    pub cache: CacheStats,
    /// Seconds spent getting cubins (cache reads or NVRTC).
    pub compile_seconds: f64,
    pub kernels_generated: usize,
    /// Plan kernels run by other kernels (the tensor-core attention): the
    /// plan's name -> the names launched in its place, in order.
    pub replaced: BTreeMap<String, Vec<String>>,
    /// Replay the step as a CUDA graph after the first step (on unless
    /// FUSEC_NO_CUDA_GRAPH is set).
    pub use_graph: bool,
    /// Why the step is not a graph, when capture failed.
    pub graph_note: Option<String>,
    steps_run: u64,
}

/// How the session's GEMMs choose their cuBLASLt algorithms: timed once
/// and kept beside the kernel cache (`gemm_tuning`), except in
/// deterministic runs, which keep cuBLASLt's first choice so that every
/// run takes the same algorithms, or where `FUSEC_GEMM_TUNING=first` asks
/// for that (to compare the two).
fn gemm_tuning(
    deterministic: bool,
    cache_dir: Option<&Path>,
    gpu: String,
) -> Result<Tuning, RuntimeError> {
    let first = match std::env::var("FUSEC_GEMM_TUNING").ok().as_deref() {
        None | Some("") | Some("timed") => false,
        Some("first") => true,
        // A typo would otherwise leave the timing on without a word.
        Some(other) => {
            return Err(RuntimeError::Unsupported(format!(
                "FUSEC_GEMM_TUNING={other}: expected `first` (cuBLASLt's first choice of algorithm) or `timed` (the default); unset it for the default"
            )))
        }
    };
    Ok(if deterministic || first {
        Tuning::First
    } else {
        Tuning::Timed {
            dir: cache_dir.map(Path::to_path_buf),
            gpu,
        }
    })
}

#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    pub loss: f64,
    pub grad_norm: Option<f64>,
}

impl Session {
    /// Loads `step` on `gpu`: its kernels compiled (or taken from the
    /// cache in `cache_dir`; `progress(done, total)` as they are), its
    /// arena allocated, its GEMMs ready to tune.
    pub fn new(
        gpu: Gpu,
        step: CompiledStep,
        cache_dir: Option<&Path>,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Session, RuntimeError> {
        let CompiledStep {
            plan,
            sources,
            params,
            target,
            flops,
        } = step;
        let t0 = Instant::now();
        let (cubins, stats) = cache::cubins(&sources, &gpu.arch(), cache_dir, progress)?;
        let compile_seconds = t0.elapsed().as_secs_f64();
        crate::startup::mark("cubins ready");
        let replaced = plan
            .launches
            .iter()
            .filter(|l| l.kind == LaunchKind::Template)
            .map(|l| {
                let names = l.steps.iter().map(|s| s.function.clone()).collect();
                (l.kernel.clone(), names)
            })
            .collect();
        let gpu_name = gpu.name.clone();
        let mut exec = Executor::new(gpu, &plan, &sources, cubins)?;
        exec.allow_tf32(target.f32_math == F32Math::Tf32);
        exec.tune_gemms(gemm_tuning(target.deterministic, cache_dir, gpu_name)?);
        crate::startup::mark("modules loaded, arena allocated");
        Ok(Session {
            exec,
            plan,
            params,
            target,
            flops,
            cache: stats,
            compile_seconds,
            kernels_generated: sources.len(),
            replaced,
            use_graph: std::env::var_os("FUSEC_NO_CUDA_GRAPH").is_none(),
            graph_note: None,
            steps_run: 0,
        })
    }

    /// The buffer of a named input, parameter or optimizer state.
    fn buffer(&self, name: &str) -> Result<usize, RuntimeError> {
        let e = &self.exec;
        e.inputs
            .get(name)
            .or_else(|| e.params.get(name))
            .or_else(|| e.state.get(name))
            .copied()
            .ok_or_else(|| {
                RuntimeError::Unsupported(format!("the step has no buffer named `{name}`"))
            })
    }

    /// Writes `values` into the named input, parameter or state buffer.
    pub fn set(&mut self, name: &str, values: &[f64]) -> Result<(), RuntimeError> {
        let b = self.buffer(name)?;
        let slot = &self.exec.slots[b];
        let n: usize = slot.shape.iter().product();
        if values.len() != n {
            return Err(RuntimeError::Unsupported(format!(
                "`{name}` holds {n} values of shape {:?}, given {}",
                slot.shape,
                values.len()
            )));
        }
        let bytes = encode(slot.dtype, values);
        // A micro-batch that only accumulates runs no collective.
        if name == APPLY_INPUT && self.exec.has_collectives() {
            self.exec.set_collectives(values.iter().any(|&v| v != 0.0));
        }
        self.exec.write(b, &bytes)
    }

    /// Joins the data-parallel communicator this rank's collectives run
    /// through; the step must have been built for `comm.ranks` ranks, and
    /// with ZeRO (`zero`) for pieces split over groups of that many ranks
    /// (all of them, or fewer for hybrid sharding).
    pub fn attach(
        &mut self,
        comm: crate::nccl::Comm,
        zero: Option<usize>,
    ) -> Result<(), RuntimeError> {
        if !self.exec.has_collectives() {
            return Err(RuntimeError::Unsupported(format!(
                "rank {} of {}: the step was built for one rank (it averages nothing); build it with --gpus {}",
                comm.rank, comm.ranks, comm.ranks
            )));
        }
        let all = comm.ranks;
        let mut dp = crate::exec::DataParallel::new(&self.exec.gpu, comm)?;
        let ranks = zero.unwrap_or(all) as u32;
        if zero.is_some_and(|g| g < all) {
            dp.shard_within(ranks as usize)?;
        }
        let zero = zero.is_some();
        if zero && self.exec.gathers_weights() {
            // Stage 3: the gradients reduce into pieces like stage 2's; no
            // parameter is sent after the update; the gathers run beside
            // the buckets.
            dp.pieces = fusec_compiler::plan::pieces(&self.params, ranks);
            dp.split_gathers(&self.exec.gpu)?;
        } else if zero {
            // Every piece of every parameter from its owner, after the
            // owner's update.
            let pieces = fusec_compiler::plan::pieces(&self.params, ranks);
            let tensors: BTreeMap<String, crate::nccl::Tensor> =
                self.exec.param_tensors().into_iter().collect();
            let params: Vec<(crate::nccl::Tensor, usize)> = self
                .params
                .iter()
                .enumerate()
                .filter_map(|(i, p)| tensors.get(&p.name).map(|&t| (t, i)))
                .collect();
            dp.shares = crate::nccl::owned_pieces(&params, &pieces, fusec_compiler::plan::ALIGN);
            dp.pieces = pieces;
        }
        self.exec.attach(dp);
        Ok(())
    }

    /// Fills the named buffer from `fill(start, out)` (values
    /// `start..start + out.len()`), encoding each chunk straight into the
    /// bytes that go to the GPU: no whole-tensor f64 copy, all cores busy.
    pub fn init(
        &mut self,
        name: &str,
        fill: &(dyn Fn(usize, &mut [f64]) + Sync),
    ) -> Result<(), RuntimeError> {
        let b = self.buffer(name)?;
        let slot = &self.exec.slots[b];
        let dt = slot.dtype;
        let n = slot.packed_bytes() as usize / dt.size_bytes();
        let bytes = crate::exec::encode_filled(dt, n, fill);
        self.exec.write(b, &bytes)
    }

    /// Writes the named buffer from values encoded as `dtype` (converted
    /// where its buffer stores another type).
    pub fn set_encoded(
        &mut self,
        name: &str,
        dtype: fusec_compiler::dtype::DType,
        bytes: &[u8],
    ) -> Result<(), RuntimeError> {
        let b = self.buffer(name)?;
        if self.exec.slots[b].dtype == dtype {
            self.exec.write(b, bytes)
        } else {
            self.set(name, &decode(dtype, bytes))
        }
    }

    /// Zeros the named buffer (on the device: no host values to make).
    pub fn zero(&mut self, name: &str) -> Result<(), RuntimeError> {
        let b = self.buffer(name)?;
        self.exec.zero(b)
    }

    /// ZeRO across processes: the whole of `name` (f32, `numel`
    /// elements), which the job's ranks hold in `pieces`, this rank its
    /// own (where it has one), gathered from the owners
    /// (`Executor::gather`).
    pub fn gather_split(
        &mut self,
        name: &str,
        pieces: &[Piece],
        numel: usize,
    ) -> Result<Vec<f64>, RuntimeError> {
        let mine = self.buffer(name).ok();
        Ok(decode(
            fusec_compiler::dtype::DType::F32,
            &self.exec.gather(mine, pieces, numel)?,
        ))
    }

    /// Each parameter's gradient output of the last step, by name, the
    /// fp16 loss scale divided out (`Backend::gradients`). Outputs live to
    /// the step's end, so they are still there after it.
    pub fn gradients(&self) -> Result<Vec<(String, Vec<f64>)>, RuntimeError> {
        let unscale = match self.exec.inputs.get(LOSS_SCALE_INPUT) {
            Some(_) => self.get(LOSS_SCALE_INPUT)?[0],
            None => 1.0,
        };
        let mut out = Vec::new();
        for p in &self.params {
            let b = p.grad.ok_or_else(|| {
                RuntimeError::Unsupported(format!(
                    "the step keeps no gradient of `{}` (this rank does not own it)",
                    p.name
                ))
            })?;
            let values = decode(self.exec.slots[b].dtype, &self.exec.read(b)?);
            let numel = self.exec.slots[b].shape.iter().product::<usize>();
            if values.len() != numel {
                return Err(RuntimeError::Unsupported(format!(
                    "the gradient of `{}` is stored with padded rows ({} values for {numel}); --save-grads cannot write it",
                    p.name,
                    values.len()
                )));
            }
            out.push((p.name.clone(), values.iter().map(|x| x / unscale).collect()));
        }
        Ok(out)
    }

    /// The named buffer's values.
    pub fn get(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        let b = self.buffer(name)?;
        Ok(decode(self.exec.slots[b].dtype, &self.exec.read(b)?))
    }

    /// One step with learning rate `lr`; `step` counts from 1. Inputs must
    /// have been set or staged.
    pub fn step(&mut self, lr: f64, step: u64) -> Result<StepStats, RuntimeError> {
        self.launch(lr, step)?;
        self.finish()
    }

    /// Starts a step (returns once its kernels are queued, except for the
    /// first, which is also captured as a CUDA graph); `finish` waits for it.
    pub fn launch(&mut self, lr: f64, step: u64) -> Result<(), RuntimeError> {
        if self.exec.inputs.contains_key(LR_INPUT) {
            self.set(LR_INPUT, &[lr])?;
        }
        if self.exec.inputs.contains_key(STEP_INPUT) {
            self.set(STEP_INPUT, &[step as f64])?;
        }
        self.exec.run_step()?;
        self.steps_run += 1;
        if self.steps_run == 1 {
            crate::startup::mark("step 1 queued");
        }
        self.capture_when_ready();
        Ok(())
    }

    /// After the first (eager) step, the step becomes one CUDA graph (one
    /// for the micro-batches that accumulate and one for the step that
    /// updates, where they differ in their collectives); a step that
    /// cannot be captured keeps running launch by launch.
    fn capture_when_ready(&mut self) {
        if self.use_graph && self.graph_note.is_none() && self.exec.ready_to_capture() {
            match self.exec.capture() {
                Ok(()) => crate::startup::mark("step captured as a CUDA graph"),
                Err(e) => {
                    self.graph_note = Some(format!(
                        "CUDA graph capture failed, launching kernel by kernel: {e}"
                    ))
                }
            }
        }
    }

    /// Runs the step once on the arena as it was allocated (all zeros:
    /// token 0 everywhere, zero weights, a learning rate of 0), captures
    /// it as a CUDA graph, and zeros the arena again, so nothing of that
    /// step remains but the loaded kernels, cuBLASLt's chosen algorithms
    /// and the graph. A step's first run costs a few hundred milliseconds
    /// more than the next (the driver loads each kernel at its first
    /// launch, cuBLASLt picks an algorithm per product, the capture); run
    /// while the host still draws the initial weights, that is off the
    /// path to the first step. Does nothing once anything has been written
    /// or a step has run, with NVTX ranges on (a profiler would see it as a
    /// step), or with FUSEC_NO_WARM_UP=1; returns whether it ran.
    pub fn warm_up(&mut self) -> Result<bool, RuntimeError> {
        if self.steps_run > 0
            || !self.exec.untouched()
            || self.exec.marked()
            || std::env::var_os("FUSEC_NO_WARM_UP").is_some_and(|v| v != "0")
        {
            return Ok(false);
        }
        self.exec.run_step()?;
        self.capture_when_ready();
        self.exec.synchronize()?;
        self.exec.clear()?;
        self.exec.synchronize()?;
        crate::startup::mark("step warmed up on zeros");
        Ok(true)
    }

    /// Waits for the launched step and reads its loss (and gradient norm).
    pub fn finish(&mut self) -> Result<StepStats, RuntimeError> {
        let read = |b: Option<usize>| -> Result<Option<f64>, RuntimeError> {
            match b {
                Some(b) => {
                    // The loss and norm take the model's dtype (bf16 in a bf16 model).
                    let dt = self.exec.slots[b].dtype;
                    Ok(decode(dt, &self.exec.read(b)?).first().copied())
                }
                None => Ok(None),
            }
        };
        let loss = read(self.exec.loss)?.unwrap_or(f64::NAN);
        Ok(StepStats {
            loss,
            grad_norm: read(self.exec.grad_norm)?,
        })
    }

    /// The logits of the finished step (a decode step's output).
    /// In f32, which holds every bf16, f16 or f32 logit exactly, decoded
    /// on every core (a batch of 32 rows of 50K logits each step).
    pub fn logits(&self) -> Result<Vec<f32>, RuntimeError> {
        let b = self
            .exec
            .logits
            .ok_or_else(|| RuntimeError::Unsupported("the step outputs no logits".into()))?;
        let dt = self.exec.slots[b].dtype;
        Ok(logits_f32(dt, &self.exec.read(b)?))
    }

    /// The greedy picks of the finished step (a greedy decode step's
    /// output): B x T token ids.
    pub fn next_tokens(&self) -> Result<Vec<u32>, RuntimeError> {
        let picks = self.read_out(self.exec.next_tokens, "greedy picks")?;
        Ok(picks.into_iter().map(|x| x as u32).collect())
    }

    /// The per-token losses of the finished step (a scoring step's output).
    pub fn token_losses(&self) -> Result<Vec<f64>, RuntimeError> {
        self.read_out(self.exec.token_losses, "per-token losses")
    }

    fn read_out(&self, b: Option<usize>, what: &str) -> Result<Vec<f64>, RuntimeError> {
        let b =
            b.ok_or_else(|| RuntimeError::Unsupported(format!("the step outputs no {what}")))?;
        Ok(decode(self.exec.slots[b].dtype, &self.exec.read(b)?))
    }

    /// Starts copying `buf` into the named i32 inputs (their values in
    /// order) for the next step, while the current one computes.
    pub fn stage(&mut self, names: &[&str], buf: &HostBuf) -> Result<(), RuntimeError> {
        let targets = names
            .iter()
            .map(|&n| Ok((n, self.buffer(n)?)))
            .collect::<Result<Vec<_>, RuntimeError>>()?;
        self.exec.stage(&targets, buf)
    }
}

/// Stored values of `dt` as f32 (which holds every bf16, f16 or f32
/// exactly), decoded on every core: bf16 and f32 straight into place (a
/// bf16 is an f32's high half), other dtypes through the general decoder.
fn logits_f32(dt: fusec_compiler::dtype::DType, bytes: &[u8]) -> Vec<f32> {
    use fusec_compiler::dtype::DType;
    use rayon::prelude::*;
    const CHUNK: usize = 4096;
    let size = dt.size_bytes();
    let mut out = vec![0f32; bytes.len() / size];
    out.par_chunks_mut(CHUNK)
        .zip(bytes.par_chunks(size * CHUNK))
        .for_each(|(o, c)| match dt {
            DType::BF16 => {
                for (x, b) in o.iter_mut().zip(c.chunks_exact(2)) {
                    *x = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
            DType::F32 => {
                for (x, b) in o.iter_mut().zip(c.chunks_exact(4)) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            _ => {
                for (x, v) in o.iter_mut().zip(decode(dt, c)) {
                    *x = v as f32;
                }
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast paths decode what the general decoder does, across more
    /// than one chunk and a chunk's end.
    #[test]
    fn logits_decode_as_the_general_decoder_does() {
        use fusec_compiler::dtype::DType;
        let values: Vec<f64> = (0..9000)
            .map(|i| ((i * 37 % 1001) as f64 - 500.0) / 7.0)
            .chain([f64::INFINITY, -0.0, 1e-40])
            .collect();
        for dt in [DType::BF16, DType::F16, DType::F32] {
            let bytes = encode(dt, &values);
            let want: Vec<f32> = decode(dt, &bytes).into_iter().map(|x| x as f32).collect();
            let got = logits_f32(dt, &bytes);
            assert_eq!(got.len(), values.len());
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{dt:?} value {i}");
            }
        }
    }

    /// The variable's two values pick the scheme; anything else is named
    /// as an error rather than read as the default.
    #[test]
    fn fusec_gemm_tuning_takes_two_values_and_names_a_typo() {
        let (opts, det) = (false, true);
        let with = |v: Option<&str>, o: &bool| {
            match v {
                Some(v) => std::env::set_var("FUSEC_GEMM_TUNING", v),
                None => std::env::remove_var("FUSEC_GEMM_TUNING"),
            }
            let t = gemm_tuning(*o, None, "gpu".into());
            std::env::remove_var("FUSEC_GEMM_TUNING");
            t
        };
        let timed = Tuning::Timed {
            dir: None,
            gpu: "gpu".into(),
        };
        assert_eq!(with(None, &opts).unwrap(), timed);
        assert_eq!(with(Some("timed"), &opts).unwrap(), timed);
        assert_eq!(with(Some("first"), &opts).unwrap(), Tuning::First);
        assert_eq!(with(None, &det).unwrap(), Tuning::First);
        let e = with(Some("off"), &opts).unwrap_err().to_string();
        assert!(
            e.contains("FUSEC_GEMM_TUNING=off") && e.contains("`first`"),
            "{e}"
        );
    }
}
