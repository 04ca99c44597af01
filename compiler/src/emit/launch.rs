//! How a kernel the compiler chose is launched: its grid as a function of
//! the sizes, its block, dynamic shared memory and the arguments it takes
//! after the usual ones. Every generated kernel and every instantiation of
//! a `kernels/` template is described by one [`KernelLaunch`]; the runtime
//! launches what it says and nothing else.

use super::flash::tma::TensorMap;
use crate::ir::Dim;

/// One grid axis: `ceil(extent / per_block) * copies * times` blocks
/// (copies: blocks that split one tile's work, such as feature halves;
/// times: further work items folded onto the axis), at most `cap` (a
/// persistent kernel's one block a multiprocessor, which walks the items
/// itself).
#[derive(Clone, Debug, PartialEq)]
pub struct GridAxis {
    pub extent: Dim,
    pub per_block: u64,
    pub copies: u64,
    pub times: Dim,
    pub cap: Option<u64>,
}

impl GridAxis {
    pub fn new(extent: Dim, per_block: u64) -> GridAxis {
        GridAxis {
            extent,
            per_block,
            copies: 1,
            times: Dim::constant(1),
            cap: None,
        }
    }

    /// One block per work item (`ceil(extent / per_block) * times` of
    /// them), at most `cap`.
    pub fn persistent(extent: Dim, per_block: u64, times: Dim, cap: u64) -> GridAxis {
        GridAxis {
            times,
            cap: Some(cap.max(1)),
            ..GridAxis::new(extent, per_block)
        }
    }

    /// The axis as a C expression of the kernel's size parameters.
    pub fn to_c(&self) -> String {
        let mut blocks = if self.per_block == 1 {
            self.extent.to_c()
        } else {
            format!(
                "({} + {}LL) / {}LL",
                self.extent.to_c(),
                self.per_block - 1,
                self.per_block
            )
        };
        if self.copies != 1 {
            blocks = format!("{blocks} * {}", self.copies);
        }
        if !self.times.is_one() {
            blocks = format!("{blocks} * {}", self.times.to_c());
        }
        match self.cap {
            Some(cap) => format!("min({blocks}, {cap})"),
            None => blocks,
        }
    }

    /// Blocks for concrete sizes; `None` for an unbound symbol or a
    /// negative size. An empty extent still launches one block.
    pub fn blocks(&self, env: &dyn Fn(&str) -> Option<i64>) -> Option<u64> {
        let n = u64::try_from(self.extent.eval(env)?).ok()?;
        let times = u64::try_from(self.times.eval(env)?).ok()?.max(1);
        let blocks = n.div_ceil(self.per_block).max(1) * self.copies * times;
        Some(self.cap.map_or(blocks, |cap| blocks.min(cap)))
    }
}

/// A kernel and how to launch it.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelLaunch {
    /// The `extern "C"` function's name.
    pub name: String,
    /// Its whole CUDA source (the prelude and `kernels/` headers included
    /// by name; `emit::expand_includes` pastes them).
    pub source: String,
    /// The `kernels/` template it instantiates, as C++, if any.
    pub template: Option<String>,
    /// Compile for the `a` variant of the architecture (wgmma exists only
    /// on sm_90a).
    pub arch_specific: bool,
    pub grid: [GridAxis; 3],
    /// Threads per block (x only).
    pub block: u32,
    /// Dynamic shared memory, bytes (over 48 KiB the function's limit must
    /// be raised first).
    pub dynamic_smem_bytes: u64,
    /// Elements of an f32 scratch buffer passed after the size parameters,
    /// shared by every launch of one op (the attention backward's), if it
    /// takes one.
    pub scratch_f32: Option<Dim>,
    /// Tensor maps passed by value after everything else, in order.
    pub tensor_maps: Vec<TensorMap>,
}

impl KernelLaunch {
    /// `(x, y, z)` blocks for concrete sizes; `None` for an unbound symbol
    /// or a y/z extent over 65535.
    pub fn grid(&self, env: &dyn Fn(&str) -> Option<i64>) -> Option<[u64; 3]> {
        let g = [
            self.grid[0].blocks(env)?,
            self.grid[1].blocks(env)?,
            self.grid[2].blocks(env)?,
        ];
        (g[0] <= u32::MAX as u64 && g[1] <= 65535 && g[2] <= 65535).then_some(g)
    }

    /// The grid as C expressions of the kernel's size parameters.
    pub fn grid_c(&self) -> [String; 3] {
        [
            self.grid[0].to_c(),
            self.grid[1].to_c(),
            self.grid[2].to_c(),
        ]
    }
}
