//! Running the step launch by launch: the eager path every step takes
//! before it is captured (and whenever a profiler needs each launch to be
//! seen), with the waits on the collectives it joins.

use super::{Executor, Step};
use crate::device::Gpu;
use crate::gemm::Gemm;
use crate::RuntimeError;

impl Executor {
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
        if joins[i] != super::Join::default() {
            if let Some(dp) = dp.as_mut() {
                dp.wait_for(gpu, joins[i], i)?;
            }
        }
        match (&launches[i].step, dp.as_mut()) {
            (Step::Collective(b), _) if !*collectives_on && !b.every_micro_batch => Ok(()),
            (Step::Collective(b), Some(dp)) => dp.issue(gpu, b, i),
            (Step::Collective(..), None) => Err(RuntimeError::Unsupported(format!(
                "kernel {name} averages gradients over several ranks, and this step has no communicator: run it with --gpus or under a launcher"
            ))),
            (step, _) => run(step, &name, gpu, dims, gemm),
        }
    }

    /// Every launch of the step in order, then the wait for the last
    /// collectives.
    pub(super) fn launch_all(&mut self) -> Result<(), RuntimeError> {
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
