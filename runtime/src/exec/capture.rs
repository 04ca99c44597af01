//! The step as a CUDA graph: captured once after an eager run, then
//! replayed as one launch, in the two forms a step with collectives takes
//! (with them, and without for the micro-batches that only accumulate).

use super::Executor;
use crate::RuntimeError;

impl Executor {
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
