//! The optimisations of the kernel stages that `--disable-pass` can turn
//! off, to find which one a wrong result or a slow step comes from. Each is
//! read where it applies (`LowerOptions::on`); turned off, the step
//! computes the same values with more kernels or simpler ones. An enum, so
//! that a misspelt optimisation is a compile error, not one silently left on.

/// One optimisation of the kernel stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Optimisation {
    /// An elementwise op joins its producer's kernel when it is the value's only reader (off: a kernel per op)
    ElementwiseChains,
    /// Bias, residual, GELU and GELU-backward after a product run in cuBLASLt's epilogue (off: kernels of their own)
    GemmEpilogues,
    /// A widening cast is stored by the kernel that makes its input (off: a cast kernel)
    CastsIntoProducers,
    /// A sum over the leading axes (a bias gradient) is added up by the elementwise kernel that stores its input (off: a sum kernel reading it back)
    SumsIntoChains,
    /// A norm forward computes the elementwise chain that makes its input as it loads its rows, storing it once where its backward reads it (off: the chain's kernel, then the norm's)
    ChainsIntoNorms,
    /// A norm backward adds the residual stream's gradient as it stores dx (off: an add kernel)
    NormResidual,
    /// The casts of the master weights and the optimizer updates of every parameter run as one launch each (off: a launch per tensor)
    GroupKernels,
    /// Attention runs the kernels/attention templates for the device (off: the simple kernels, as FUSEC_ATTENTION=simple)
    TensorCoreAttention,
    /// A product of 32 rows or fewer at the step's sizes (a decode step's) runs as kernels/gemm/skinny.cuh (off: cuBLASLt)
    SkinnyGemm,
}

impl Optimisation {
    /// Every optimisation, in the order `fusec passes` lists them.
    pub const ALL: &'static [Optimisation] = &[
        Optimisation::ElementwiseChains,
        Optimisation::GemmEpilogues,
        Optimisation::CastsIntoProducers,
        Optimisation::SumsIntoChains,
        Optimisation::ChainsIntoNorms,
        Optimisation::NormResidual,
        Optimisation::GroupKernels,
        Optimisation::TensorCoreAttention,
        Optimisation::SkinnyGemm,
    ];

    /// Its name on the command line (`--disable-pass NAME`) and in filetests.
    pub fn name(self) -> &'static str {
        match self {
            Optimisation::ElementwiseChains => "elementwise-chains",
            Optimisation::GemmEpilogues => "gemm-epilogues",
            Optimisation::CastsIntoProducers => "casts-into-producers",
            Optimisation::SumsIntoChains => "sums-into-chains",
            Optimisation::ChainsIntoNorms => "chains-into-norms",
            Optimisation::NormResidual => "norm-residual",
            Optimisation::GroupKernels => "group-kernels",
            Optimisation::TensorCoreAttention => "tensor-core-attention",
            Optimisation::SkinnyGemm => "skinny-gemm",
        }
    }

    /// The stage it belongs to.
    pub fn stage(self) -> &'static str {
        match self {
            Optimisation::ElementwiseChains => "fuse",
            Optimisation::GemmEpilogues => "fuse",
            Optimisation::CastsIntoProducers => "fuse",
            Optimisation::SumsIntoChains => "fuse",
            Optimisation::ChainsIntoNorms => "fuse",
            Optimisation::NormResidual => "fuse",
            Optimisation::GroupKernels => "fuse",
            Optimisation::TensorCoreAttention => "select",
            Optimisation::SkinnyGemm => "select",
        }
    }

    /// What it does, and what the step does without it.
    pub fn about(self) -> &'static str {
        match self {
            Optimisation::ElementwiseChains => "an elementwise op joins its producer's kernel when it is the value's only reader (off: a kernel per op)",
            Optimisation::GemmEpilogues => "bias, residual, GELU and GELU-backward after a product run in cuBLASLt's epilogue (off: kernels of their own)",
            Optimisation::CastsIntoProducers => "a widening cast is stored by the kernel that makes its input (off: a cast kernel)",
            Optimisation::SumsIntoChains => "a sum over the leading axes (a bias gradient) is added up by the elementwise kernel that stores its input (off: a sum kernel reading it back)",
            Optimisation::ChainsIntoNorms => "a norm forward computes the elementwise chain that makes its input as it loads its rows, storing it once where its backward reads it (off: the chain's kernel, then the norm's)",
            Optimisation::NormResidual => "a norm backward adds the residual stream's gradient as it stores dx (off: an add kernel)",
            Optimisation::GroupKernels => "the casts of the master weights and the optimizer updates of every parameter run as one launch each (off: a launch per tensor)",
            Optimisation::TensorCoreAttention => "attention runs the kernels/attention templates for the device (off: the simple kernels, as FUSEC_ATTENTION=simple)",
            Optimisation::SkinnyGemm => "a product of 32 rows or fewer at the step's sizes (a decode step's) runs as kernels/gemm/skinny.cuh, its epilogue inside (off: cuBLASLt)",
        }
    }

    /// The optimisation of that name, if there is one.
    pub fn from_name(name: &str) -> Option<Optimisation> {
        Optimisation::ALL.iter().copied().find(|o| o.name() == name)
    }
}

impl std::fmt::Display for Optimisation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the kernel stages take besides the graph: the optimisations
/// turned off and the size of the data-parallel gradient buckets. Passed to
/// fusion, selection and the plan (`lowering::lower`), never carried on the
/// graph, so a graph prints, parses and compares the same whatever it will
/// be lowered with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    pub off: std::collections::BTreeSet<Optimisation>,
    /// Bytes a gradient bucket holds before it closes; `None`: the rule in
    /// `kernel::buckets` (by the gradients' total, the step's count of
    /// layers and the GPU's bandwidth).
    pub bucket_bytes: Option<u64>,
}

impl LowerOptions {
    /// Whether `optimisation` is on.
    pub fn on(&self, optimisation: Optimisation) -> bool {
        !self.off.contains(&optimisation)
    }
}

#[cfg(test)]
mod tests {
    use super::Optimisation;

    #[test]
    fn names_are_distinct_and_round_trip() {
        for (i, o) in Optimisation::ALL.iter().enumerate() {
            assert_eq!(Optimisation::from_name(o.name()), Some(*o));
            assert!(Optimisation::ALL[..i].iter().all(|p| p.name() != o.name()));
        }
        assert_eq!(Optimisation::from_name("gemm-epilogue"), None);
    }
}
