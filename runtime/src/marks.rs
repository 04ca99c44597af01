//! NVTX ranges for Nsight Systems and Nsight Compute: a step, its phases
//! (forward, backward, update) and every launch, named by its kernel and the
//! model file's lines (`k12_matmul_add gpt2-small.dsl:27`).
//!
//! NVTX costs nothing until a tool injects itself: the profilers set
//! `NVTX_INJECTION64_PATH` in the process they start, and that is when fusec
//! turns the ranges on. A CUDA graph replays a whole step as one launch, so
//! with ranges on the step runs launch by launch instead.

/// Whether to mark steps: a profiler is attached, or `FUSEC_NVTX=1`
/// (`FUSEC_NVTX=0` keeps them off under a profiler).
pub fn wanted() -> bool {
    match std::env::var("FUSEC_NVTX").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => std::env::var_os("NVTX_INJECTION64_PATH").is_some(),
    }
}

/// A range open until dropped.
pub struct Range(());

impl Range {
    pub fn new(name: &str) -> Range {
        nvtx::range_push!("{name}");
        Range(())
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        nvtx::range_pop!();
    }
}

/// The ranges of one step's launches: the phase and label of each.
#[derive(Clone, Debug)]
pub struct StepMarks {
    pub launches: Vec<(&'static str, String)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_follow_the_profiler_and_cost_nothing_without_one() {
        // One test touches these variables, so no other reads them meanwhile.
        std::env::remove_var("FUSEC_NVTX");
        std::env::remove_var("NVTX_INJECTION64_PATH");
        assert!(!wanted(), "no profiler, no ranges");
        std::env::set_var(
            "NVTX_INJECTION64_PATH",
            "/nonexistent/libToolsInjection64.so",
        );
        assert!(wanted(), "a profiler injected itself");
        std::env::set_var("FUSEC_NVTX", "0");
        assert!(!wanted(), "FUSEC_NVTX=0 wins");
        std::env::remove_var("NVTX_INJECTION64_PATH");
        std::env::set_var("FUSEC_NVTX", "1");
        assert!(wanted());
        std::env::remove_var("FUSEC_NVTX");
        // Without an injected tool, NVTX's calls return at once.
        let outer = Range::new("fusec step");
        drop(Range::new("k0_matmul gpt2-small.dsl:27"));
        drop(outer);
    }
}
