//! A step launched with a timing event between launches (`fusec bench
//! --profile` and `--trace`), each collective's time on the communication
//! stream beside the compute stream's launches.

use super::{CollectiveTime, Executor, LaunchTime, Step, StepProfile};
use crate::RuntimeError;

impl Executor {
    /// Every launch in order, the first time (`FUSEC_STARTUP_TIMES`): the
    /// host's time in each call, where the driver loads a kernel at its
    /// first launch and cuBLASLt plans a product at its first run; prints
    /// the sums by kind and the slowest launches.
    pub(super) fn launch_all_timed(&mut self) -> Result<(), RuntimeError> {
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
                Step::Collective(b) => match &b.gather {
                    Some(ga) => ga
                        .pieces
                        .iter()
                        .map(|(lo, hi)| (hi - lo) * ga.dtype.size_bytes() as u64)
                        .sum(),
                    None => b
                        .all
                        .iter()
                        .chain(b.owned.iter().map(|(t, _)| t))
                        .map(|t| (t.count * t.dtype.size_bytes()) as u64)
                        .sum(),
                },
                _ => 0,
            };
            let gather =
                matches!(&self.launches[i].step, Step::Collective(b) if b.gather.is_some());
            let join = (i + 1..self.launches.len())
                .find(|&j| {
                    let w = self.joins[j];
                    if gather {
                        w.gathers
                    } else {
                        w.reduces
                    }
                })
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
}
