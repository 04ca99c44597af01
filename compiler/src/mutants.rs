//! Deliberate errors, for tests to show that their checks catch a wrong
//! program. Only the `mutants` feature (which the test build of the `fusec`
//! package turns on) can select one: a test for its own thread
//! ([`with`]), or `FUSEC_MUTANT` for a whole process of a test build (the
//! PyTorch twin's checks, run by hand against a mutated `fusec`). Without
//! the feature [`current`] is always `None` and every hook is dead code.
//!
//! Each hook sits where the real rule is built, so a mutant is the program
//! a bug there would give: the interpreter and the kernels both run it.

/// One deliberate error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// Every gradient the backward rule of ops of this name (`Op::name`)
    /// makes, 1% too large.
    Backward(String),
    /// The gradients of the first two parameters of one type, swapped.
    SwapGradients,
    /// Adam's bias correction a step ahead (t + 1 for t).
    BiasCorrection,
    /// Weight decay on the parameters that should not decay (vectors) and
    /// not on those that should (matrices).
    DecaySet,
    /// The clipping coefficient 1% too large.
    ClipScale,
    /// fp16: the loss scale left in the gradients the optimizer reads.
    Unscale,
}

impl Mutant {
    /// `FUSEC_MUTANT`'s spelling: `backward:OP`, `swap-gradients`,
    /// `bias-correction`, `decay-set`, `clip-scale`, `unscale`.
    pub fn parse(s: &str) -> Option<Mutant> {
        Some(match s {
            "swap-gradients" => Mutant::SwapGradients,
            "bias-correction" => Mutant::BiasCorrection,
            "decay-set" => Mutant::DecaySet,
            "clip-scale" => Mutant::ClipScale,
            "unscale" => Mutant::Unscale,
            _ => Mutant::Backward(s.strip_prefix("backward:")?.to_string()),
        })
    }
}

#[cfg(feature = "mutants")]
thread_local! {
    static CURRENT: std::cell::RefCell<Option<Mutant>> = const { std::cell::RefCell::new(None) };
}

/// The mutant this thread builds with.
pub fn current() -> Option<Mutant> {
    #[cfg(feature = "mutants")]
    {
        CURRENT.with(|c| c.borrow().clone()).or_else(|| {
            std::env::var("FUSEC_MUTANT")
                .ok()
                .and_then(|v| Mutant::parse(&v))
        })
    }
    #[cfg(not(feature = "mutants"))]
    {
        None
    }
}

/// Runs `f` with `m` selected on this thread (and none after).
#[cfg(feature = "mutants")]
pub fn with<R>(m: Mutant, f: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            CURRENT.with(|c| *c.borrow_mut() = None);
        }
    }
    CURRENT.with(|c| *c.borrow_mut() = Some(m));
    let _reset = Reset;
    f()
}

/// Whether `m` is selected.
pub fn is(m: &Mutant) -> bool {
    current().as_ref() == Some(m)
}
