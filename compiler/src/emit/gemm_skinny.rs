//! The wrappers of `kernels/gemm/skinny.cuh`: a matrix product of few rows
//! (a decode step's, m = B x T) as a kernel of our own instead of a
//! cuBLASLt call. Selection takes it where the plan's sizes are known and
//! m is at most [`MAX_ROWS`] (`select::Choice::Skinny`); this module says
//! whether a product fits and writes its wrapper: the template parameters
//! (element types, B's form, rows a pass, splits of K, the epilogue), the
//! problem's pointers and leading dimensions, and the file-scope counts of
//! finished splits.

use super::cuda::{header_comment, signature};
use super::launch::{GridAxis, KernelLaunch};
use super::templates::element;
use super::PRELUDE_NAME;
use crate::ir::{Dim, Graph};
use crate::kernel::gemm::GemmShape;
use crate::kernel::{Body, Kernel, Program};
use std::fmt::Write;

/// The most rows a product may have to run as a skinny GEMM. At 32 rows a
/// 16-bit weight element takes 32 multiply-adds: on an H100 (67 TFLOP/s
/// f32, 3.35 TB/s) the CUDA cores need about 1.6 times as long as B takes
/// to stream in, so past it the products are bound by arithmetic and
/// cuBLASLt's tensor-core tiles should win. Where the two cross is to be
/// measured (`--disable-pass skinny-gemm`).
pub const MAX_ROWS: u64 = 32;
/// Threads a block (kernels/gemm/skinny.cuh's THREADS).
const THREADS: u32 = 256;
/// Lanes across a KN tile (the template's LANES) and columns of an NK tile
/// (its NK_COLS).
const LANES: u64 = 32;
const NK_COLS: u64 = 16;
/// Rows a pass takes at most: each thread keeps ROWS x 8 sums (KN) in
/// registers.
const MOST_ROWS: u64 = 16;
/// Blocks a launch aims at: enough for every multiprocessor to keep
/// several in flight, as a product this small is bound by latency.
const BLOCKS_PER_MULTIPROCESSOR: u64 = 2;
/// Rows of K a split takes at least: four loads a thread of a block's
/// slices (KN: 8 slices of 32 lanes).
const MIN_SPLIT_K: u64 = 32;

/// How a fitting product runs: the form of B, rows a pass, splits of K.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Skinny {
    /// B stored [N, K] (read transposed).
    pub nk: bool,
    pub rows: u64,
    pub splits: u64,
    pub tiles: u64,
    /// B's rows and D's are whole 16-byte loads.
    pub vec: bool,
}

/// Why kernel `k` (a product at `shape`, the plan's sizes) does not run as
/// a skinny GEMM, or how it does on a GPU of `multiprocessors`.
pub fn fit(
    p: &Program,
    k: &Kernel,
    shape: &GemmShape,
    multiprocessors: u32,
) -> Result<Skinny, &'static str> {
    if shape.m > MAX_ROWS {
        return Err("more rows than a skinny product takes");
    }
    if shape.batch != 1 || shape.a_transposed {
        return Err("a batched product, or A read transposed");
    }
    // Any buffer of the kernel (the epilogue's too) stored with padded rows.
    let padded = k
        .outputs
        .iter()
        .chain(&k.inputs)
        .any(|&b| p.buffers[b].pitch.is_some());
    if padded {
        return Err("padded rows");
    }
    let ki = p.kernels.iter().position(|x| x.name == k.name);
    if ki.is_some_and(|i| p.gemm_pads.contains_key(&i)) {
        return Err("a product run at padded sizes");
    }
    if let Body::Gemm(_, e) = &k.body {
        if e.dgelu.is_some() {
            return Err("the GELU backward's epilogue");
        }
    }
    let (n, kk) = (shape.n, shape.k);
    if n == 0 || kk == 0 || shape.m == 0 {
        return Err("an empty product");
    }
    // The wrapper writes n and k as numbers; rows may be symbolic.
    let fixed = |b: usize| p.buffers[b].ty.shape.iter().all(|d| d.as_const().is_some());
    let last_fixed = p.buffers[k.outputs[0]]
        .ty
        .shape
        .last()
        .is_some_and(|d| d.as_const().is_some());
    if !fixed(k.inputs[1]) || !last_fixed {
        return Err("a product whose n or k is a symbolic size");
    }
    let per_load = 16 / shape.in_type.bytes();
    let nk = shape.b_transposed;
    let vec = if nk {
        kk % per_load == 0
    } else {
        n % per_load == 0
    };
    let width = match (nk, vec) {
        (true, _) => NK_COLS,
        (false, true) => LANES * per_load,
        (false, false) => LANES,
    };
    let tiles = n.div_ceil(width);
    let blocks = BLOCKS_PER_MULTIPROCESSOR * multiprocessors.max(1) as u64;
    // Every split's partials (m x width f32, written and read back through
    // L2) at most twice the bytes of its share of B: at 32 rows, where the
    // products are bound by the multiply-adds, this still fills the GPU.
    let by_traffic = (kk * shape.in_type.bytes() / (2 * shape.m)).max(1);
    let splits = blocks
        .div_ceil(tiles)
        .min((kk / MIN_SPLIT_K).max(1))
        .min(by_traffic)
        .clamp(1, 1024);
    Ok(Skinny {
        nk,
        rows: shape.m.next_power_of_two().min(MOST_ROWS),
        splits,
        tiles,
        vec,
    })
}

/// The launch of kernel `k` (a product at `shape`) as the skinny GEMM
/// `s`: `tiles x splits` blocks, with an f32 scratch of splits x m x n
/// where there are several splits.
pub fn launch(
    g: &Graph,
    p: &Program,
    k: &Kernel,
    shape: &GemmShape,
    s: &Skinny,
    source: Option<&str>,
) -> KernelLaunch {
    let out = &p.buffers[k.outputs[0]].ty;
    let r = out.shape.len();
    // Every axis but the last is a row of the product (a stack of rows
    // times one matrix, as gemm_shape folds it).
    let m = out.shape[..r - 1]
        .iter()
        .try_fold(Dim::constant(1), |a, d| a.checked_mul(d))
        .unwrap_or(Dim::constant(1));
    let (n_cols, k_len) = (shape.n as i64, shape.k as i64);
    let a_ty = &p.buffers[k.inputs[0]].ty;
    let scratch = (s.splits > 1).then(|| {
        m.checked_mul(&Dim::constant((s.splits as i64) * n_cols))
            .unwrap_or(Dim::constant(0))
    });
    let name = k.name.clone();
    let mut text = header_comment(g, k, &name, source);
    let form = if s.nk {
        "B stored [n, k], read transposed"
    } else {
        "B stored [k, n]"
    };
    let _ = writeln!(
        text,
        "// A skinny product (kernels/gemm/skinny.cuh): m = {} rows, n = {n_cols}, k = {k_len}, {form};\n\
         // {} tiles of columns x {} splits of k, {} rows a pass.",
        m.to_c(),
        s.tiles,
        s.splits,
        s.rows
    );
    let _ = writeln!(text, "#include \"{PRELUDE_NAME}\"");
    let _ = writeln!(text, "#include \"gemm/skinny.cuh\"\n");
    if s.splits > 1 {
        let _ = writeln!(
            text,
            "// Each tile's finished splits (the last puts it back to zero).\n\
             __device__ unsigned {name}_done[{}] = {{0}};\n",
            s.tiles
        );
    }
    let extra = match s.splits {
        1 => vec![],
        _ => vec![",\n    float* scratch".to_string()],
    };
    text.push_str(&signature(g, p, k, &name, Some("256"), &extra));
    let (ei, eo) = (
        element(a_ty.dtype),
        element(p.buffers[k.outputs[0]].ty.dtype),
    );
    let epi = match &k.body {
        Body::Gemm(_, e) => e.clone(),
        _ => Default::default(),
    };
    let slot = |x: Option<usize>| x.map_or("nullptr".to_string(), |i| format!("in{i}"));
    let _ = writeln!(text, "    fs_skinny::Problem<{ei}, {eo}> p;");
    let _ = writeln!(text, "    p.a = in0;\n    p.lda = {k_len};");
    let _ = writeln!(
        text,
        "    p.b = in1;\n    p.ldb = {};",
        if s.nk { k_len } else { n_cols }
    );
    let _ = writeln!(text, "    p.bias = {};", slot(epi.bias));
    let _ = writeln!(
        text,
        "    p.resid = {};\n    p.ldr = {n_cols};",
        slot(epi.residual)
    );
    let _ = writeln!(text, "    p.d = out0;\n    p.ldd = {n_cols};");
    let aux = if epi.gelu { "out1" } else { "nullptr" };
    let _ = writeln!(text, "    p.aux = {aux};\n    p.ldx = {n_cols};");
    let _ = writeln!(
        text,
        "    p.m = {};\n    p.n = {n_cols};\n    p.k = {k_len};",
        m.to_c()
    );
    let (part, done) = match s.splits {
        1 => ("nullptr".to_string(), "nullptr".to_string()),
        _ => ("scratch".to_string(), format!("{name}_done")),
    };
    let _ = writeln!(text, "    p.part = {part};\n    p.done = {done};");
    let template = format!(
        "fs_skinny::{}<{ei}, {eo}, {}, {}, {}, {}, {}, {}>",
        if s.nk { "nk" } else { "kn" },
        s.rows,
        s.splits,
        s.vec,
        epi.bias.is_some(),
        epi.residual.is_some(),
        epi.gelu
    );
    let _ = writeln!(text, "    {template}(p);\n}}");
    KernelLaunch {
        name,
        source: text,
        template: Some(template),
        arch_specific: false,
        grid: [
            GridAxis::new(Dim::constant((s.tiles * s.splits) as i64), 1),
            GridAxis::new(Dim::constant(1), 1),
            GridAxis::new(Dim::constant(1), 1),
        ],
        block: THREADS,
        dynamic_smem_bytes: 0,
        scratch_f32: scratch,
        tensor_maps: Vec::new(),
    }
}
