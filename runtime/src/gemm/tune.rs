//! Choosing a newly planned product's algorithm (see `gemm_tuning`): kept
//! apart from running products because it alone reads the choices kept on
//! disk and times candidates on the product's own buffers.

use super::{Algo, EpiloguePtrs, Gemm, Key, Plan, Ptrs, WORKSPACE_BYTES};
use crate::gemm_tuning::{self, Tuning};
use cudarc::cublaslt::sys;

impl Gemm {
    /// The algorithm a newly planned product runs (see `gemm_tuning`):
    /// cuBLASLt's first choice, the choice kept on disk, or the fastest of
    /// `candidates` timed here on the product's own buffers.
    pub(super) fn choose(
        &mut self,
        key: &Key,
        plan: &Plan,
        candidates: &[Algo],
        p: Ptrs,
        ep: &EpiloguePtrs,
        beta: f32,
    ) -> Algo {
        let first = candidates[0];
        let Tuning::Timed { dir, gpu } = &self.tuning else {
            return first;
        };
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { sys::cublasLtGetVersion() };
        let path = dir
            .as_deref()
            .map(|d| gemm_tuning::entry_path(d, gpu, version, &format!("{key:?}")));
        if let Some(data) = path.as_deref().and_then(gemm_tuning::load) {
            let algo = Algo { data };
            if self.fits(plan, &algo) {
                self.stats.cached += 1;
                self.stats.changed += usize::from(algo.data != first.data);
                return algo;
            }
        }
        let capturing = !matches!(
            self.stream.capture_status(),
            Ok(cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        if capturing || gemm_tuning::writes_over_inputs(&key.spec, ep, p.b, p.a, p.d) {
            self.stats.untimed += 1;
            return first;
        }
        let times: Vec<Option<f64>> = candidates
            .iter()
            .map(|algo| self.time(plan, algo, p, beta))
            .collect();
        let chosen = candidates[gemm_tuning::pick(&times)];
        self.stats.timed += 1;
        self.stats.changed += usize::from(chosen.data != first.data);
        if let Some(path) = path {
            gemm_tuning::store(&path, &chosen.data);
        }
        chosen
    }

    /// Whether a stored algorithm is one cuBLASLt runs for this plan
    /// within our workspace.
    fn fits(&self, plan: &Plan, algo: &Algo) -> bool {
        let [la, lb, ld] = plan.layouts;
        // SAFETY: zeroed is a valid result struct for cuBLASLt to fill.
        let mut r: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: the descriptor and layouts are live; `algo` and `r` are
        // valid for the call.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(self.handle, plan.desc, la, lb, ld, ld, algo, &mut r)
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && r.workspaceSize <= WORKSPACE_BYTES
    }

    /// Milliseconds one product takes with `algo`: a launch to warm, then
    /// the quickest of 3 rounds of 3 back-to-back launches between events.
    /// `None` where it does not run.
    fn time(&self, plan: &Plan, algo: &Algo, p: Ptrs, beta: f32) -> Option<f64> {
        use cudarc::driver::sys::CUevent_flags;
        // SAFETY: as `run_with`'s launch; the product writes only what it
        // writes anyway, and reads nothing it writes (`writes_over_inputs`).
        let launch = || unsafe { self.enqueue(plan, algo, p, beta) }.is_ok();
        let event = || {
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .ok()
        };
        if !launch() {
            return None;
        }
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let start = event()?;
            for _ in 0..3 {
                if !launch() {
                    return None;
                }
            }
            let end = event()?;
            end.synchronize().ok()?;
            best = best.min(f64::from(start.elapsed_ms(&end).ok()?) / 3.0);
        }
        Some(best)
    }
}
