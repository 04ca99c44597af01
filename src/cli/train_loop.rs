//! `fusec train`'s step loop: each step's micro-batches fed and run, the
//! optimizer's step count and loss scale, what a step reports, validation,
//! checkpoints, and what the run writes at its end.

use super::checkpoints::save;
use super::common::Loaded;
use super::common::{is_input, json_num};
use super::feed::{feed_random, Feed, Where, SENTENCE_BATCHES_READ};
use super::feed::{RANDOM_STREAM, WINDOWS_READ};
use super::open::runtime_err;
use super::train_args::TrainArgs;
use super::train_steps::StepLine;
use super::validate::Validation;
use super::CliError;
use fusec::backend::Backend;
use fusec_compiler::autodiff::{APPLY_INPUT, LOSS_SCALE_INPUT};
use fusec_compiler::model::{Decay, Schedule};
use fusec_runtime::batch_log::BatchLog;
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::data::Prefetch;
use fusec_runtime::scaler::LossScaler;
use fusec_runtime::session::StepStats;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// What feeds each micro-batch: a token file's windows, or a fresh random
/// batch (`random-stream`); with `--save-data`, the log of what was fed.
pub(super) struct Feeder<'a> {
    batches: Option<Prefetch>,
    record: Option<BatchLog>,
    /// The shape of a batch of `tokens` (and of `targets`).
    window: Vec<usize>,
    data_inputs: &'a [String],
    /// The sizes of the whole batch (all ranks').
    data_dims: &'a BTreeMap<String, i64>,
    stream: bool,
    seed: u64,
    micro: u64,
    first: u64,
    /// Windows each micro-batch reads: the rows of `tokens`.
    rows: u64,
    /// Windows read before this run, where the resumed checkpoint counts them.
    resumed_windows: Option<u64>,
    /// Sentence data: batches read before this run (a resumed run's).
    sentence_batches: Option<u64>,
    /// Tokens of the staged batch that are not padding.
    staged_real: u64,
}

impl<'a> Feeder<'a> {
    /// The data source as `feed::prepare` sets it up, and where a resumed
    /// run's count of windows read starts.
    pub(super) fn prepare(
        args: &TrainArgs,
        b: &mut dyn Backend,
        at: &Where<'a>,
    ) -> Result<Feeder<'a>, CliError> {
        let Feed {
            batches,
            record,
            sentences,
        } = super::feed::prepare(args, b, at)?;
        let sentence_batches = sentences.then(|| {
            at.resumed
                .and_then(|ck| ck.extra.get(SENTENCE_BATCHES_READ))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        });
        let resumed_windows: Option<u64> = at
            .resumed
            .and_then(|ck| ck.extra.get(WINDOWS_READ))
            .and_then(|v| v.parse().ok());
        Ok(Feeder {
            batches,
            record,
            window: at.tokens_shape.map(<[usize]>::to_vec).unwrap_or_default(),
            data_inputs: at.data_inputs,
            data_dims: at.data_dims,
            stream: args.data == RANDOM_STREAM,
            seed: args.seed,
            micro: at.micro,
            first: at.first,
            rows: at
                .tokens_shape
                .and_then(|s| s.first().copied())
                .unwrap_or(0) as u64,
            resumed_windows,
            sentence_batches,
            staged_real: at.tokens_shape.map_or(0, |s| s.iter().product::<usize>()) as u64,
        })
    }

    /// The next batch into `tokens` and `targets`: copied to the GPU while
    /// the current step computes, in place when the next one launches.
    /// Random data has nothing to stage.
    pub(super) fn stage_next(&mut self, b: &mut dyn Backend) -> Result<(), CliError> {
        let Some(pf) = &self.batches else {
            return Ok(());
        };
        let filled = pf.next().map_err(|e| CliError {
            message: format!("error: {e}"),
            code: 3,
        })?;
        let buf = filled.buf;
        self.staged_real = filled.real;
        if let Some(log) = &mut self.record {
            let ids = buf.read().map_err(runtime_err)?;
            let mut at = 0;
            for name in &pf.names {
                let shape = match *name {
                    "tokens" | "targets" if !self.window.is_empty() => self.window.clone(),
                    _ => b.shapes().get(*name).cloned().unwrap_or_default(),
                };
                let n: usize = shape.iter().product();
                log.push_i32(name, &shape, &ids[at..at + n])
                    .map_err(|e| CliError::usage(format!("error: --save-data: {e}")))?;
                at += n;
            }
        }
        b.stage(&pf.names, &buf).map_err(runtime_err)?;
        pf.give_back(buf);
        Ok(())
    }

    /// `random-stream`: micro-batch `mb` of step `step` gets a random batch
    /// of its own.
    fn feed_stream(&mut self, b: &mut dyn Backend, step: u64, mb: u64) -> Result<(), CliError> {
        if self.stream {
            let k = (step - 1) * self.micro + mb;
            feed_random(
                b,
                self.data_inputs,
                self.data_dims,
                self.seed,
                k,
                &mut self.record,
            )?;
        }
        Ok(())
    }

    /// Windows of the token file read by the end of `step` (all ranks'),
    /// for a checkpoint; none where the data is random.
    fn windows_read(&self, step: u64) -> Option<u64> {
        self.batches.as_ref()?;
        if self.sentence_batches.is_some() {
            return None;
        }
        Some(match self.resumed_windows {
            Some(w) => w + (step + 1 - self.first) * self.micro * self.rows,
            None => step * self.micro * self.rows,
        })
    }

    /// Sentence batches read by the end of `step`, for a checkpoint.
    fn sentence_batches_read(&self, step: u64) -> Option<u64> {
        let before = self.sentence_batches?;
        Some(before + (step + 1 - self.first) * self.micro)
    }

    /// `--save-data`: the batches fed, written to `path`.
    fn save_record(&self, path: Option<&Path>) -> Result<(), CliError> {
        if let (Some(path), Some(log)) = (path, &self.record) {
            log.save(path).map_err(|e| CliError {
                message: format!("error: --save-data: {e}"),
                code: 3,
            })?;
            eprintln!("saved the batches fed to {}", path.display());
        }
        Ok(())
    }
}

/// The optimizer's own step count and, with fp16, the dynamic loss scale:
/// an overflowing step is skipped (the count does not advance) and the
/// scale halves.
pub(super) struct OptimizerSteps {
    fp16: bool,
    scaler: LossScaler,
    count: u64,
}

impl OptimizerSteps {
    /// Before step `first`: none counted yet, or as many as the resumed
    /// checkpoint counted, at its loss scale.
    pub(super) fn resume(b: &dyn Backend, first: u64, resumed: Option<&Checkpoint>) -> Self {
        let fp16 = is_input(b.graph(), LOSS_SCALE_INPUT);
        let mut scaler = LossScaler::default();
        let mut count = first - 1;
        if let Some(ck) = resumed {
            if let Some(v) = ck.extra.get("loss_scale").and_then(|v| v.parse().ok()) {
                scaler.scale = v;
            }
            if let Some(v) = ck.extra.get("optimizer_step").and_then(|v| v.parse().ok()) {
                count = v;
            }
        }
        OptimizerSteps {
            fp16,
            scaler,
            count,
        }
    }

    /// fp16: the next step's loss scale.
    fn set_scale(&self, b: &mut dyn Backend) -> Result<(), CliError> {
        if self.fp16 {
            b.set(LOSS_SCALE_INPUT, &[self.scaler.scale])
                .map_err(runtime_err)?;
        }
        Ok(())
    }

    /// Counts a step that ended with `grad_norm`, unless its fp16 gradients
    /// overflowed; says when the loss scale changes.
    fn count(&mut self, grad_norm: Option<f64>) {
        let applied = !self.fp16 || grad_norm.is_some_and(f64::is_finite);
        if applied {
            self.count += 1;
        }
        if self.fp16 && self.scaler.update(applied) {
            eprintln!(
                "{}loss scale now {}",
                if applied {
                    ""
                } else {
                    "gradients overflowed, step skipped; "
                },
                self.scaler.scale
            );
        }
    }

    /// What a checkpoint records of them.
    fn state(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::from([("optimizer_step".to_string(), self.count.to_string())]);
        if self.fp16 {
            m.insert("loss_scale".into(), self.scaler.scale.to_string());
        }
        m
    }
}

/// Each step's learning rate.
pub(super) struct Rates {
    lr: f64,
    schedule: Schedule,
    /// The step the decay ends at.
    horizon: u64,
    /// Whether the rate changes (then the progress lines show it).
    scheduled: bool,
}

impl Rates {
    /// The schedule from the model file and the command line, for a run
    /// ending at `last`, said where there is one. The decay ends at the
    /// model's or the command line's step, else at the run's last; a
    /// resumed run keeps the first run's end.
    pub(super) fn plan(
        args: &TrainArgs,
        loaded: &Loaded,
        lr: f64,
        resumed: Option<&Checkpoint>,
        last: u64,
    ) -> Result<Rates, CliError> {
        let schedule = args
            .schedule
            .resolve(loaded.compiled.model.train.schedule, lr)?;
        let horizon = resumed
            .and_then(|ck| ck.extra.get("schedule_end"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(last);
        let scheduled = schedule != Default::default();
        let rates = Rates {
            lr,
            schedule,
            horizon,
            scheduled,
        };
        if scheduled {
            eprintln!(
                "learning rate: {} from {lr}{}",
                schedule.describe(),
                if rates.ends_with_the_run() {
                    format!(", ending at step {horizon}")
                } else {
                    String::new()
                }
            );
        }
        Ok(rates)
    }

    fn rate(&self, step: u64) -> f64 {
        self.schedule.rate(self.lr, step, self.horizon)
    }

    /// Whether the schedule's end is the run's (and so recorded for a resume).
    fn ends_with_the_run(&self) -> bool {
        self.schedule.steps.is_none()
            && matches!(self.schedule.decay, Decay::Cosine | Decay::Linear)
    }
}

/// The step loop: what it runs with, and what it carries from one step to
/// the next. Its fields drop in the order declared: the log, the data
/// thread and its page-locked buffers, then the validation step, all before
/// the backend the run holds.
pub(super) struct StepLoop<'a> {
    pub(super) log: Option<std::fs::File>,
    pub(super) feed: Feeder<'a>,
    pub(super) validation: Option<Validation>,
    pub(super) sampler: Option<super::samples::Sampler>,
    pub(super) args: &'a TrainArgs,
    /// Only rank 0 of a launched job prints progress.
    pub(super) quiet: bool,
    pub(super) last: u64,
    /// Micro-batches per optimizer step.
    pub(super) micro: u64,
    pub(super) tokens_per_step: i64,
    pub(super) rates: Rates,
    pub(super) optimizer: OptimizerSteps,
    /// `--save-grads`: the last step's gradients, summed over its
    /// micro-batches (each reports its own, already over their count).
    pub(super) grads: Option<Vec<(String, Vec<f64>)>>,
}

impl StepLoop<'_> {
    /// Step `step` run, its optimizer step counted; returns what it reports.
    pub(super) fn step(&mut self, b: &mut dyn Backend, step: u64) -> Result<StepLine, CliError> {
        let rate = self.rates.rate(step);
        self.optimizer.set_scale(b)?;
        let t0 = Instant::now();
        let (st, real) = self.micro_batches(b, step, rate)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        fusec_runtime::startup::mark(&format!("step {step} done"));
        self.optimizer.count(st.grad_norm);
        Ok(StepLine {
            step,
            last: self.last,
            rate,
            scheduled: self.rates.scheduled,
            loss: st.loss,
            grad_norm: st.grad_norm,
            ms,
            tokens_per_s: real.unwrap_or(self.tokens_per_step as u64) as f64 / (ms / 1e3),
            padded: real.is_some(),
        })
    }

    /// The step's micro-batches, each fed, launched (with the next batch
    /// staged while it computes) and finished, adding up their gradients;
    /// the update applies on the last. The loss is their mean. Sentence
    /// data also counts the tokens fed that are not padding.
    fn micro_batches(
        &mut self,
        b: &mut dyn Backend,
        step: u64,
        rate: f64,
    ) -> Result<(StepStats, Option<u64>), CliError> {
        let micro = self.micro;
        let mut st = StepStats {
            loss: 0.0,
            grad_norm: None,
        };
        let mut real = 0;
        for mb in 0..micro {
            real += self.feed.staged_real;
            if micro > 1 {
                let apply = if mb + 1 == micro { 1.0 } else { 0.0 };
                b.set(APPLY_INPUT, &[apply]).map_err(runtime_err)?;
            }
            self.feed.feed_stream(b, step, mb)?;
            b.set_dropout_key(self.args.seed, step, mb, 0)
                .map_err(runtime_err)?;
            b.launch(rate, self.optimizer.count + 1)
                .map_err(runtime_err)?;
            if step < self.last || mb + 1 < micro {
                self.feed.stage_next(b)?;
            }
            let one = b.finish().map_err(runtime_err)?;
            if step == self.last && self.args.save_grads.is_some() {
                let g = b
                    .gradients()
                    .map_err(|e| CliError::usage(format!("error: --save-grads: {e}")))?;
                self.grads = Some(match self.grads.take() {
                    Some(mut sum) => {
                        for ((_, s), (_, v)) in sum.iter_mut().zip(&g) {
                            s.iter_mut().zip(v).for_each(|(a, x)| *a += x);
                        }
                        sum
                    }
                    None => g,
                });
            }
            st.loss += one.loss / micro as f64;
            st.grad_norm = one.grad_norm;
        }
        Ok((st, self.feed.sentence_batches.map(|_| real)))
    }

    /// The step's progress line and `--log` line; a loss that is not
    /// finite ends the run.
    pub(super) fn report(&mut self, line: &StepLine) -> Result<(), CliError> {
        if !self.quiet {
            eprintln!("{}", line.progress());
        }
        if let Some(f) = &mut self.log {
            let _ = writeln!(f, "{}", line.json());
        }
        if !line.loss.is_finite() {
            return Err(CliError {
                message: format!(
                    "error: the loss is {} at step {}; lower the learning rate",
                    line.loss, line.step
                ),
                code: 3,
            });
        }
        Ok(())
    }

    /// Under ZeRO across processes, the weights other processes' ranks
    /// keep, gathered where a validation or a sample is due after `step`
    /// (every process calls this at the same steps; elsewhere it does
    /// nothing).
    pub(super) fn gather_if_evaluating(
        &mut self,
        b: &mut dyn Backend,
        step: u64,
    ) -> Result<(), CliError> {
        let last = self.last;
        if super::validate::due(&self.args.validation, step, last)
            || super::samples::due(&self.args.samples, step, last)
        {
            b.gather_for_checkpoint().map_err(runtime_err)?;
        }
        Ok(())
    }

    /// `--val-data`: the validation loss after `step`, where one is due.
    pub(super) fn validate(&mut self, b: &dyn Backend, step: u64) -> Result<(), CliError> {
        let last = self.last;
        let due = super::validate::due(&self.args.validation, step, last);
        if let Some(v) = self.validation.as_mut().filter(|_| due) {
            let val = v.loss(b)?;
            if !self.quiet {
                eprintln!(
                    "step {step:>5}/{last}  val loss {val:.4}  ({} batches, {} tokens)",
                    v.batches(),
                    v.tokens
                );
            }
            if let Some(f) = &mut self.log {
                let _ = writeln!(f, "{{\"step\":{step},\"val_loss\":{}}}", json_num(val));
            }
        }
        Ok(())
    }

    /// `--sample-every`: a greedy continuation of the prompt after `step`,
    /// where one is due.
    pub(super) fn sample(&mut self, b: &dyn Backend, step: u64) -> Result<(), CliError> {
        let last = self.last;
        let due = super::samples::due(&self.args.samples, step, last);
        if let Some(s) = self.sampler.as_mut().filter(|_| due) {
            let text = s.sample(b)?;
            if !self.quiet {
                eprintln!("step {step:>5}/{last}  sample: {}", text.escape_debug());
            }
            if let Some(f) = &mut self.log {
                let _ = writeln!(f, "{}", serde_json::json!({"step": step, "sample": text}));
            }
        }
        Ok(())
    }

    /// `--save-every`: a checkpoint after every N steps but the last (which
    /// `finish` writes).
    pub(super) fn save_every(&self, b: &mut dyn Backend, step: u64) -> Result<(), CliError> {
        if let (Some(path), Some(every)) = (&self.args.save, self.args.save_every) {
            if step.is_multiple_of(every) && step != self.last {
                save(b, path, step, &self.state(step), !self.quiet)?;
            }
        }
        Ok(())
    }

    /// The run's end: `--save`'s checkpoint, `--save-grads`' gradients,
    /// then `--save-data`'s batches.
    pub(super) fn finish(self, b: &mut dyn Backend) -> Result<(), CliError> {
        let last = self.last;
        if let (Some(path), Some(grads)) = (&self.args.save_grads, &self.grads) {
            save_grads(b, grads, path, last)?;
            if !self.quiet {
                eprintln!("saved the gradients of step {last} to {}", path.display());
            }
        }
        if let Some(path) = &self.args.save {
            save(b, path, last, &self.state(last), !self.quiet)?;
            if !self.quiet {
                eprintln!("saved {} (step {last})", path.display());
            }
        }
        self.feed.save_record(self.args.save_data.as_deref())
    }

    /// What a checkpoint after `step` records beyond the tensors.
    fn state(&self, step: u64) -> BTreeMap<String, String> {
        let mut m = self.optimizer.state();
        if let Some(windows) = self.feed.windows_read(step) {
            m.insert(WINDOWS_READ.into(), windows.to_string());
        }
        if let Some(n) = self.feed.sentence_batches_read(step) {
            m.insert(SENTENCE_BATCHES_READ.into(), n.to_string());
        }
        if self.rates.ends_with_the_run() {
            m.insert("schedule_end".into(), self.rates.horizon.to_string());
        }
        m
    }
}

/// `--save-grads`: the last step's gradients as a safetensors file, under
/// the parameters' names (f32, their shapes), the step in the metadata.
fn save_grads(
    b: &dyn Backend,
    grads: &[(String, Vec<f64>)],
    path: &std::path::Path,
    step: u64,
) -> Result<(), CliError> {
    let tensors = grads
        .iter()
        .map(|(name, values)| {
            let shape = b
                .shapes()
                .get(name)
                .cloned()
                .unwrap_or_else(|| vec![values.len()]);
            fusec_runtime::checkpoint::Tensor {
                name: name.clone(),
                shape,
                data: values.iter().map(|&x| x as f32).collect(),
            }
        })
        .collect();
    let ck = fusec_runtime::checkpoint::Checkpoint {
        model: b.graph().name.clone(),
        step,
        tensors,
        extra: [("contents".to_string(), "gradients".to_string())].into(),
    };
    fusec_runtime::checkpoint::save(path, &ck)
        .map_err(|e| CliError::usage(format!("error: --save-grads: {e}")))
}
