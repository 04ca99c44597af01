//! Where start-up time goes. With `FUSEC_STARTUP_TIMES=1` each phase of
//! getting to the first step (model compiled, GPU open, kernels loaded,
//! weights in place, first step queued and finished) prints its moment,
//! counted from the process's start, to standard error. Off, a mark costs
//! one check of a cached flag.

use std::sync::OnceLock;
use std::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();
static ON: OnceLock<bool> = OnceLock::new();

/// Sets the clock's zero; call it first thing in `main` (later calls keep
/// the first moment).
pub fn begin() {
    START.get_or_init(Instant::now);
}

pub fn enabled() -> bool {
    *ON.get_or_init(|| std::env::var_os("FUSEC_STARTUP_TIMES").is_some_and(|v| v != "0"))
}

/// Seconds since [`begin`] (or since the first mark, where `begin` was not called).
pub fn seconds() -> f64 {
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// Prints `what` with its moment when start-up times are asked for.
pub fn mark(what: &str) {
    if enabled() {
        eprintln!("[start-up {:7.3} s] {what}", seconds());
    }
}
