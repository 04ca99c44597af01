//! CUDA C for attention forward and backward: the simple, exact version
//! (one block per query row, and per key row for the backward), which never
//! stores a score matrix, where the tensor-core kernels (`emit/flash`,
//! whose module comment says what they take) do not apply: head dims that
//! are not multiples of 8 or are over 256, rows that are not contiguous and
//! 16-byte aligned, an f32 backward past 256 features in D + Dv; and under
//! `FUSEC_ATTENTION=simple`.
//!
//! Both kernels stream over keys (or queries) in chunks of `blockDim.x`:
//! each thread scores one entry of the chunk, the chunk's weights go to
//! shared memory, then every thread accumulates the output features it
//! owns. Accumulators live in registers, `FEATS` features per thread per
//! pass; a head wider than `FEATS * blockDim.x` takes more passes (each
//! recomputes the scores), so any head size works with any block size,
//! including the host shim's single thread.

use super::cuda::{float_lit, load, store, NEG_INF};
use super::lower::Lower;
use super::templates::{Ctx, Shape, BLOCK};
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::kernel::view::contiguous_strides;
use crate::ops::{AttnDropout, Op};
use petgraph::stable_graph::NodeIndex;
use std::fmt::Write;

/// Output features each thread accumulates per pass (a register array).
const FEATS: usize = 4;

/// How a kernel addresses one of its tensors: the buffer it reads or writes
/// and the strides and offset of the op's view of it. Inputs may be strided
/// views (heads sliced out of a fused QKV projection); outputs are
/// contiguous.
pub(crate) struct Access {
    pub(crate) ptr: String,
    pub(crate) dt: DType,
    strides: Vec<Dim>,
    offset: Dim,
}

impl Access {
    /// Op input `i`, through its view when the kernel has one.
    pub(crate) fn input(g: &Graph, c: &Ctx, n: NodeIndex, i: usize) -> Access {
        let slot = c.ins[i];
        let dt = c.p.buffers[c.k.inputs[slot]].ty.dtype;
        let ptr = format!("in{slot}");
        match c.k.input_views.get(slot).and_then(|v| v.as_ref()) {
            Some(v) => Access {
                ptr,
                dt,
                strides: v.strides.clone(),
                offset: v.offset.clone(),
            },
            None => Access {
                ptr,
                dt,
                strides: contiguous_strides(&g.ty(g.inputs(n)[i]).shape),
                offset: Dim::constant(0),
            },
        }
    }

    /// Op output `o`, row-major; of a packed `attention_grad`, gradient `o`
    /// (dq, dk, dv) as a `[B, T, H, D]` view of the one packed output.
    pub(crate) fn output(g: &Graph, c: &Ctx, n: NodeIndex, o: usize) -> Access {
        if let Op::AttentionGrad(a) = &g.g[n].op {
            if a.packed {
                return Access::packed_grad(g, c, n, o);
            }
        }
        let slot = c.outs[o];
        Access {
            ptr: format!("out{slot}"),
            dt: c.p.buffers[c.k.outputs[slot]].ty.dtype,
            strides: contiguous_strides(&g.g[n].outputs[o].shape),
            offset: Dim::constant(0),
        }
    }

    /// Gradient `o` of packed `attention_grad` `n`: input `o`'s shape
    /// `[B, T, H, D]` laid over rows of the packed output's width, from its
    /// first feature there (`ops::attention::packed_layout`).
    fn packed_grad(g: &Graph, c: &Ctx, n: NodeIndex, o: usize) -> Access {
        let ins = g.inputs(n);
        let (q, k, v) = (g.ty(ins[0]), g.ty(ins[1]), g.ty(ins[2]));
        let (firsts, width) = crate::ops::packed_layout(q, k, v)
            .expect("a packed gradient's layout (its op's infer checked it)");
        let shape = &g.ty(ins[o]).shape;
        let slot = c.outs[0];
        Access {
            ptr: format!("out{slot}"),
            dt: c.p.buffers[c.k.outputs[slot]].ty.dtype,
            strides: vec![
                shape[1].checked_mul(&width).unwrap_or_default(),
                width,
                shape[3].clone(),
                Dim::constant(1),
            ],
            offset: firsts[o].clone(),
        }
    }

    /// The view's strides, in elements, one per axis.
    pub(crate) fn strides(&self) -> &[Dim] {
        &self.strides
    }

    /// The view's first element within the buffer.
    pub(crate) fn offset(&self) -> &Dim {
        &self.offset
    }

    /// The C offset of the element at `coords` (one C expression per axis;
    /// `"0"` drops the axis).
    pub(crate) fn at(&self, coords: &[&str]) -> String {
        let mut terms = Vec::new();
        if self.offset.as_const() != Some(0) {
            terms.push(self.offset.to_c());
        }
        for (x, s) in coords.iter().zip(&self.strides) {
            if *x == "0" || s.as_const() == Some(0) {
                continue;
            }
            terms.push(if s.is_one() {
                x.to_string()
            } else {
                format!("{x} * {}", s.to_c())
            });
        }
        if terms.is_empty() {
            "0".into()
        } else {
            terms.join(" + ")
        }
    }

    /// Every row (the last axis) starts 16-byte aligned for 16-bit elements
    /// and is contiguous: what 16-byte tile loads need.
    pub(crate) fn rows_aligned(&self) -> bool {
        let div8 = |d: &Dim| d.checked_div(&Dim::constant(8)).is_some();
        matches!(self.strides.split_last(), Some((last, rest))
            if last.is_one() && rest.iter().all(div8) && div8(&self.offset))
    }

    /// The stride of `axis` as C.
    pub(crate) fn stride(&self, axis: usize) -> String {
        self.strides[axis].to_c()
    }

    /// The element `d` of the last axis after the row base `row`, as a
    /// float (the last stride is 1 for every view attention reads).
    fn elem(&self, row: &str, d: &str) -> String {
        match self.strides.last() {
            Some(s) if !s.is_one() => self.load(&format!("{row} + {d} * {}", s.to_c())),
            _ => self.load(&format!("{row} + {d}")),
        }
    }

    /// Loads `ptr[idx]` as a float.
    pub(crate) fn load(&self, idx: &str) -> String {
        load(self.dt, &format!("{}[{idx}]", self.ptr))
    }

    /// Stores the float `v` at `ptr[idx]`.
    pub(crate) fn store(&self, idx: &str, v: &str) -> String {
        format!("{}[{idx}] = {};", self.ptr, store(self.dt, v))
    }
}

fn product(ds: &[&Dim]) -> Dim {
    ds.iter()
        .try_fold(Dim::constant(1), |a, d| a.checked_mul(d))
        .unwrap_or_default()
}

/// Sizes of one attention op: q [B, T, Hq, D], k [B, S, Hkv, D],
/// v [B, S, Hkv, Dv].
struct Sizes {
    b: Dim,
    t: Dim,
    s: Dim,
    hq: Dim,
    hkv: Dim,
    d: Dim,
    dv: Dim,
}

fn sizes(g: &Graph, n: NodeIndex) -> Option<(Sizes, bool, f64)> {
    let (causal, scale) = match &g.g[n].op {
        Op::Attention(a) => (a.causal, a.scale),
        Op::AttentionGrad(a) => (a.causal, a.scale),
        _ => return None,
    };
    let ins = g.inputs(n);
    let (q, k, v) = (
        &g.ty(ins[0]).shape,
        &g.ty(ins[1]).shape,
        &g.ty(ins[2]).shape,
    );
    let s = Sizes {
        b: q[0].clone(),
        t: q[1].clone(),
        s: k[1].clone(),
        hq: q[2].clone(),
        hkv: k[2].clone(),
        d: q[3].clone(),
        dv: v[3].clone(),
    };
    Some((s, causal, scale))
}

/// Launch shape of an attention kernel; `None` for other ops.
pub fn shape_of(g: &Graph, n: NodeIndex) -> Option<Shape> {
    let (s, _, _) = sizes(g, n)?;
    let q_rows = product(&[&s.b, &s.hq, &s.t]);
    Some(Shape::Rows(match &g.g[n].op {
        Op::Attention(_) => q_rows,
        // Query rows (dq), then key rows (dk, dv).
        _ => q_rows.checked_add(&product(&[&s.b, &s.hkv, &s.s]))?,
    }))
}

/// The kernel body (everything after the signature, before the closing
/// brace); `None` for other ops.
pub(crate) fn kernel_body(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    let (s, causal, scale) = sizes(g, n)?;
    let Shape::Rows(rows) = shape_of(g, n)? else {
        return None;
    };
    let group = s.hq.as_const()? / s.hkv.as_const().filter(|&h| h > 0)?;
    let forward_op = matches!(g.g[n].op, Op::Attention(_));
    let mut b = String::from(if forward_op { FORWARD } else { BACKWARD });
    let _ = writeln!(
        b,
        "    const fs_i64 q_len = {}, kv_len = {}, q_heads = {}, kv_heads = {}, group = {group};",
        s.t.to_c(),
        s.s.to_c(),
        s.hq.to_c(),
        s.hkv.to_c()
    );
    let _ = writeln!(
        b,
        "    const fs_i64 head_dim = {}, v_dim = {}, rows = {};",
        s.d.to_c(),
        s.dv.to_c(),
        rows.to_c()
    );
    let _ = writeln!(b, "    const float scale = {};", float_lit(scale));
    let _ = writeln!(
        b,
        "    const bool causal = {causal};  // if so, keys j > query i are masked"
    );
    if forward_op {
        forward(&mut b, g, c, n);
    } else {
        backward(&mut b, g, c, n, &s);
    }
    // With lengths (the op's last input), batch entry b's keys end at its
    // length: the rest are padding, which no query row visits and whose
    // dK, dV rows are zero.
    let lens_slot = match &g.g[n].op {
        Op::Attention(a) => a.extra_slots().0.map(|l| c.ins[l]),
        Op::AttentionGrad(a) => a.extra_slots().0.map(|l| c.ins[l]),
        _ => None,
    };
    if let Some(l) = lens_slot {
        let own = format!("(in{l}[b] < 0 ? 0 : in{l}[b] < kv_len ? (fs_i64)in{l}[b] : kv_len)");
        b = with_lengths(&b, &own)?;
    }
    if let Some((drop, key)) = dropout_of(g, c, n) {
        b = with_dropout(&b, &drop, key, forward_op)?;
    }
    Some(b)
}

/// The op's dropout and the kernel slot of the step's key (its last input).
pub(crate) fn dropout_of(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<(AttnDropout, usize)> {
    let (drop, key) = match &g.g[n].op {
        Op::Attention(a) => (a.dropout?, a.extra_slots().1?),
        Op::AttentionGrad(a) => (a.dropout?, a.extra_slots().1?),
        _ => return None,
    };
    Some((drop, c.ins[key]))
}

/// The philox header, before the kernel, where the op drops.
pub(crate) fn file_scope(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
    dropout_of(g, c, n).map(|_| "#include \"random/philox.cuh\"\n\n".to_string())
}

/// `body` (a kernel above, written without dropout) with each probability
/// that meets V or dO kept and scaled, or zeroed, by its Philox draw
/// (`fs_attention_draw`): the forward's weights of V; the backward's
/// dS = P (Z dP - delta) and dV's P Z. `None` if the body has not the
/// lines this rewrites.
fn with_dropout(body: &str, drop: &AttnDropout, key: usize, forward: bool) -> Option<String> {
    const FWD: &str = "probs[threadIdx.x] = p;";
    const BWD_Q: &str = "ds = expf(qk * scale - row_lse) * (dp - delta) * scale;";
    const BWD_K: &str = "ds = p * (dp - delta) * scale;";
    let keep = format!(
        "    // Dropout p = {}: the factor of probability (query i, key j) of head row bh.
             auto keep = [&](fs_i64 bh, fs_i64 i, fs_i64 j) {{ return fs_attention_draw(in{key}, {}u, bh, i, j) >= {}u ? {} : 0.0f; }};
",
        drop.p,
        drop.site,
        drop.threshold(),
        float_lit(drop.scale())
    );
    let z = "keep(b * q_heads + h, i, j)";
    let out = if forward && body.contains(FWD) {
        body.replace(
            FWD,
            &format!("probs[threadIdx.x] = j < keys ? p * {z} : 0.0f;"),
        )
    } else if !forward && body.contains(BWD_Q) && body.contains(BWD_K) {
        body.replace(
            BWD_Q,
            &format!("ds = expf(qk * scale - row_lse) * (dp * {z} - delta) * scale;"),
        )
        .replace(
            BWD_K,
            &format!(
                "const float z = {z};\n{:28}ds = p * (dp * z - delta) * scale;\n{:28}p *= z;",
                "", ""
            ),
        )
    } else {
        return None;
    };
    Some(format!("{keep}{out}"))
}

/// `body` (a kernel above, written for every key visible) with batch entry
/// b's keys ending at `own`: the query rows' visible keys, and the key rows
/// past it visiting no query. `None` if the body has not the lines this
/// rewrites (a change above that this must follow).
fn with_lengths(body: &str, own: &str) -> Option<String> {
    const KEYS: &str = "const fs_i64 keys = (causal && i + 1 < kv_len) ? i + 1 : kv_len;";
    const FIRST: &str = "const fs_i64 first = causal ? j : 0;";
    const ENTRY: &str = "const fs_i64 entry_keys = kv_len;";
    if !body.contains(KEYS) {
        return None;
    }
    let mut out = body.replace(
        KEYS,
        &format!("const fs_i64 own = {own}, keys = (causal && i + 1 < own) ? i + 1 : own;"),
    );
    if out.contains(FIRST) && out.contains(ENTRY) {
        out = out
            .replace(ENTRY, &format!("const fs_i64 entry_keys = {own};"))
            .replace(
                FIRST,
                "const fs_i64 first = j >= entry_keys ? q_len : causal ? j : 0;",
            );
    } else if body.contains("dk_row") {
        return None;
    }
    Some(out)
}

const FORWARD: &str = "    \
    // Attention forward: one block per (batch, query head, query row).
    // Keys stream by in chunks of blockDim with an online softmax (running
    // max and sum, accumulators rescaled when the max grows), so no score
    // matrix is stored; lse = max + log(sum) is kept for the backward.
";

const BACKWARD: &str = "    \
    // Attention backward, deterministic (no atomics). Rows below q_rows are
    // query rows (b, h, i) writing dq_i = scale * sum_j p_ij (dp_ij - D_i) k_j;
    // the rest are key rows (b, kv head, j) writing dv_j = sum p_ij dO_i and
    // dk_j = scale * sum p_ij (dp_ij - D_i) q_i over the query heads of the
    // group. p_ij = exp(scale q_i.k_j - lse_i), dp_ij = dO_i.v_j, D_i = dO_i.O_i.
";

/// One register accumulator per owned feature: `for r` over the `FEATS`
/// features `d = d0 + threadIdx.x + r * blockDim.x` of this pass.
fn each_feat(body: &str, indent: &str) -> String {
    format!(
        "{indent}#pragma unroll\n{indent}for (int r = 0; r < {FEATS}; ++r) {{\n\
         {indent}    const fs_i64 d = d0 + threadIdx.x + (fs_i64)r * blockDim.x;\n\
         {body}{indent}}}\n"
    )
}

fn zeros() -> String {
    ["0.0f"; FEATS].join(", ")
}

fn forward(b: &mut String, g: &Graph, c: &Ctx, n: NodeIndex) {
    let q = Access::input(g, c, n, 0);
    let k = Access::input(g, c, n, 1);
    let v = Access::input(g, c, n, 2);
    let (out, lse) = (Access::output(g, c, n, 0), Access::output(g, c, n, 1));
    let _ = writeln!(
        b,
        "    __shared__ float probs[{BLOCK}];\n\
         \x20   for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {{\n\
         \x20       // Rows in lse's order: (b, h, i).\n\
         \x20       const fs_i64 i = row % q_len, h = (row / q_len) % q_heads, b = row / (q_len * q_heads);\n\
         \x20       const fs_i64 q_row = {}, k_head = {}, v_head = {};\n\
         \x20       // Causal: chunks past the diagonal are never visited.\n\
         \x20       const fs_i64 keys = (causal && i + 1 < kv_len) ? i + 1 : kv_len;\n\
         \x20       for (fs_i64 d0 = 0; d0 < v_dim; d0 += {FEATS} * (fs_i64)blockDim.x) {{\n\
         \x20           float acc[{FEATS}] = {{{}}};\n\
         \x20           float row_max = {NEG_INF}, row_sum = 0.0f;\n\
         \x20           for (fs_i64 j0 = 0; j0 < keys; j0 += blockDim.x) {{\n\
         \x20               const fs_i64 j = j0 + threadIdx.x;\n\
         \x20               float score = {NEG_INF};\n\
         \x20               if (j < keys) {{\n\
         \x20                   const fs_i64 k_row = k_head + j * {};\n\
         \x20                   float dot = 0.0f;\n\
         \x20                   for (fs_i64 d = 0; d < head_dim; ++d) dot += {} * {};\n\
         \x20                   score = dot * scale;\n\
         \x20               }}\n\
         \x20               // Every visited chunk holds a visible key: new_max is finite.\n\
         \x20               const float new_max = fmaxf(row_max, fs_block_max(score));\n\
         \x20               const float p = expf(score - new_max), rescale = expf(row_max - new_max);\n\
         \x20               row_sum = row_sum * rescale + fs_block_sum(p);\n\
         \x20               row_max = new_max;\n\
         \x20               __syncthreads();  // the last chunk's readers are done with probs\n\
         \x20               probs[threadIdx.x] = p;\n\
         \x20               __syncthreads();\n\
         \x20               const fs_i64 chunk = keys - j0 < blockDim.x ? keys - j0 : blockDim.x;\n\
         \x20               #pragma unroll\n\
         \x20               for (int r = 0; r < {FEATS}; ++r) acc[r] *= rescale;\n\
         \x20               for (fs_i64 jj = 0; jj < chunk; ++jj) {{\n\
         \x20                   const float pj = probs[jj];\n\
         \x20                   const fs_i64 v_row = v_head + (j0 + jj) * {};\n\
         {}\
         \x20               }}\n\
         \x20           }}\n\
         \x20           // No visible key (kv_len = 0): output 0, lse -inf, no NaN.\n\
         \x20           const float inv_sum = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;\n\
         \x20           const fs_i64 o_row = {};\n\
         {}\
         \x20           if (d0 == 0 && threadIdx.x == 0) {}\n\
         \x20       }}\n\
         \x20   }}",
        q.at(&["b", "i", "h", "0"]),
        k.at(&["b", "0", "(h / group)", "0"]),
        v.at(&["b", "0", "(h / group)", "0"]),
        zeros(),
        k.stride(1),
        q.elem("q_row", "d"),
        k.elem("k_row", "d"),
        v.stride(1),
        each_feat(
            &format!(
                "                        if (d < v_dim) acc[r] += pj * {};\n",
                v.elem("v_row", "d")
            ),
            "                    "
        ),
        out.at(&["b", "i", "h", "0"]),
        each_feat(
            &format!(
                "                if (d < v_dim) {}\n",
                out.store("o_row + d", "acc[r] * inv_sum")
            ),
            "            "
        ),
        lse.store(
            &lse.at(&["b", "h", "i"]),
            &format!("row_sum > 0.0f ? row_max + logf(row_sum) : {NEG_INF}")
        ),
    );
}

fn backward(b: &mut String, g: &Graph, c: &Ctx, n: NodeIndex, s: &Sizes) {
    let [q, k, v, o, lse, dout] = [0, 1, 2, 3, 4, 5].map(|i| Access::input(g, c, n, i));
    let [dq, dk, dv] = [0, 1, 2].map(|i| Access::output(g, c, n, i));
    let _ = writeln!(
        b,
        "    __shared__ float probs[{BLOCK}], dscores[{BLOCK}];\n\
         \x20   const fs_i64 q_rows = {};\n\
         \x20   for (fs_i64 row = blockIdx.x; row < rows; row += gridDim.x) {{\n\
         \x20       if (row < q_rows) {{\n\
         \x20           const fs_i64 i = row % q_len, h = (row / q_len) % q_heads, b = row / (q_len * q_heads);\n\
         \x20           const fs_i64 q_row = {}, o_row = {}, do_row = {};\n\
         \x20           const fs_i64 k_head = {}, v_head = {};\n\
         \x20           float part = 0.0f;\n\
         \x20           for (fs_i64 d = threadIdx.x; d < v_dim; d += blockDim.x) part += {} * {};\n\
         \x20           const float delta = fs_block_sum(part);\n\
         \x20           const float row_lse = {};\n\
         \x20           const fs_i64 keys = (causal && i + 1 < kv_len) ? i + 1 : kv_len;\n\
         \x20           for (fs_i64 d0 = 0; d0 < head_dim; d0 += {FEATS} * (fs_i64)blockDim.x) {{\n\
         \x20               float acc[{FEATS}] = {{{}}};\n\
         \x20               for (fs_i64 j0 = 0; j0 < keys; j0 += blockDim.x) {{\n\
         \x20                   const fs_i64 j = j0 + threadIdx.x;\n\
         \x20                   float ds = 0.0f;\n\
         \x20                   // One visible key: a constant softmax, dS = 0 exactly (not\n\
         \x20                   // dp - delta, two sums of the same terms in different orders).\n\
         \x20                   if (j < keys && keys > 1) {{\n\
         \x20                       const fs_i64 k_row = k_head + j * {}, v_row = v_head + j * {};\n\
         \x20                       float qk = 0.0f, dp = 0.0f;\n\
         \x20                       for (fs_i64 d = 0; d < head_dim; ++d) qk += {} * {};\n\
         \x20                       for (fs_i64 d = 0; d < v_dim; ++d) dp += {} * {};\n\
         \x20                       ds = expf(qk * scale - row_lse) * (dp - delta) * scale;\n\
         \x20                   }}\n\
         \x20                   __syncthreads();  // the last chunk's readers are done\n\
         \x20                   dscores[threadIdx.x] = ds;\n\
         \x20                   __syncthreads();\n\
         \x20                   const fs_i64 chunk = keys - j0 < blockDim.x ? keys - j0 : blockDim.x;\n\
         \x20                   for (fs_i64 jj = 0; jj < chunk; ++jj) {{\n\
         \x20                       const float dsj = dscores[jj];\n\
         \x20                       const fs_i64 k_row = k_head + (j0 + jj) * {};\n\
         {}\
         \x20                   }}\n\
         \x20               }}\n\
         \x20               const fs_i64 dq_row = {};\n\
         {}\
         \x20           }}\n\
         \x20       }} else {{\n\
         \x20           const fs_i64 key = row - q_rows;\n\
         \x20           const fs_i64 j = key % kv_len, kv_h = (key / kv_len) % kv_heads, b = key / (kv_len * kv_heads);\n\
         \x20           const fs_i64 k_row = {}, v_row = {};\n\
         \x20           const fs_i64 entry_keys = kv_len;  // the batch entry's keys\n\
         \x20           // Causal: queries before key j do not see it.\n\
         \x20           const fs_i64 first = causal ? j : 0;\n\
         \x20           // A key row owns head_dim features of dk and v_dim of dv.\n\
         \x20           const fs_i64 feats = head_dim > v_dim ? head_dim : v_dim;\n\
         \x20           for (fs_i64 d0 = 0; d0 < feats; d0 += {FEATS} * (fs_i64)blockDim.x) {{\n\
         \x20               float dk[{FEATS}] = {{{}}}, dv[{FEATS}] = {{{}}};\n\
         \x20               for (fs_i64 hh = 0; hh < group; ++hh) {{\n\
         \x20                   const fs_i64 h = kv_h * group + hh;\n\
         \x20                   const fs_i64 q_head = {}, o_head = {}, do_head = {};\n\
         \x20                   for (fs_i64 i0 = first; i0 < q_len; i0 += blockDim.x) {{\n\
         \x20                       const fs_i64 i = i0 + threadIdx.x;\n\
         \x20                       float p = 0.0f, ds = 0.0f;\n\
         \x20                       if (i < q_len) {{\n\
         \x20                           const fs_i64 q_row = q_head + i * {}, o_row = o_head + i * {}, do_row = do_head + i * {};\n\
         \x20                           float qk = 0.0f, dp = 0.0f, delta = 0.0f;\n\
         \x20                           for (fs_i64 d = 0; d < head_dim; ++d) qk += {} * {};\n\
         \x20                           for (fs_i64 d = 0; d < v_dim; ++d) {{\n\
         \x20                               const float dout_d = {};\n\
         \x20                               dp += dout_d * {};\n\
         \x20                               delta += dout_d * {};\n\
         \x20                           }}\n\
         \x20                           p = expf(qk * scale - {});\n\
         \x20                           ds = p * (dp - delta) * scale;\n\
         \x20                           // A query that sees one key: dS = 0 exactly, as above.\n\
         \x20                           if (entry_keys <= 1 || (causal && i == 0)) ds = 0.0f;\n\
         \x20                       }}\n\
         \x20                       __syncthreads();  // the last chunk's readers are done\n\
         \x20                       probs[threadIdx.x] = p;\n\
         \x20                       dscores[threadIdx.x] = ds;\n\
         \x20                       __syncthreads();\n\
         \x20                       const fs_i64 chunk = q_len - i0 < blockDim.x ? q_len - i0 : blockDim.x;\n\
         \x20                       for (fs_i64 ii = 0; ii < chunk; ++ii) {{\n\
         \x20                           const float p_i = probs[ii], ds_i = dscores[ii];\n\
         \x20                           const fs_i64 q_row = q_head + (i0 + ii) * {}, do_row = do_head + (i0 + ii) * {};\n\
         {}\
         \x20                       }}\n\
         \x20                   }}\n\
         \x20               }}\n\
         \x20               const fs_i64 dk_row = {}, dv_row = {};\n\
         {}\
         \x20           }}\n\
         \x20       }}\n\
         \x20   }}",
        product(&[&s.b, &s.hq, &s.t]).to_c(),
        // Query rows.
        q.at(&["b", "i", "h", "0"]),
        o.at(&["b", "i", "h", "0"]),
        dout.at(&["b", "i", "h", "0"]),
        k.at(&["b", "0", "(h / group)", "0"]),
        v.at(&["b", "0", "(h / group)", "0"]),
        dout.elem("do_row", "d"),
        o.elem("o_row", "d"),
        lse.load(&lse.at(&["b", "h", "i"])),
        zeros(),
        k.stride(1),
        v.stride(1),
        q.elem("q_row", "d"),
        k.elem("k_row", "d"),
        dout.elem("do_row", "d"),
        v.elem("v_row", "d"),
        k.stride(1),
        each_feat(
            &format!(
                "                            if (d < head_dim) acc[r] += dsj * {};\n",
                k.elem("k_row", "d")
            ),
            "                        "
        ),
        dq.at(&["b", "i", "h", "0"]),
        each_feat(
            &format!(
                "                    if (d < head_dim) {}\n",
                dq.store("dq_row + d", "acc[r]")
            ),
            "                "
        ),
        // Key rows.
        k.at(&["b", "j", "kv_h", "0"]),
        v.at(&["b", "j", "kv_h", "0"]),
        zeros(),
        zeros(),
        q.at(&["b", "0", "h", "0"]),
        o.at(&["b", "0", "h", "0"]),
        dout.at(&["b", "0", "h", "0"]),
        q.stride(1),
        o.stride(1),
        dout.stride(1),
        q.elem("q_row", "d"),
        k.elem("k_row", "d"),
        dout.elem("do_row", "d"),
        v.elem("v_row", "d"),
        o.elem("o_row", "d"),
        lse.load(&lse.at(&["b", "h", "i"])),
        q.stride(1),
        dout.stride(1),
        each_feat(
            &format!(
                "                                if (d < v_dim) dv[r] += p_i * {};\n\
                 \x20                               if (d < head_dim) dk[r] += ds_i * {};\n",
                dout.elem("do_row", "d"),
                q.elem("q_row", "d")
            ),
            "                            "
        ),
        dk.at(&["b", "j", "kv_h", "0"]),
        dv.at(&["b", "j", "kv_h", "0"]),
        each_feat(
            &format!(
                "                    if (d < head_dim) {}\n\
                 \x20                   if (d < v_dim) {}\n",
                dk.store("dk_row + d", "dk[r]"),
                dv.store("dv_row + d", "dv[r]")
            ),
            "                "
        ),
    );
}

/// The tensor-core kernels instantiate `kernels/attention/` templates
/// (emit/flash); the generated kernel here is the simple one that runs
/// where they do not apply.
macro_rules! attention_lowering {
    ($($op:ident),*) => {$(
        impl Lower for crate::ops::$op {
            fn shape(&self, g: &Graph, n: NodeIndex) -> Option<Shape> {
                shape_of(g, n)
            }
            fn kernel_body(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                kernel_body(g, c, n)
            }
            fn file_scope(&self, g: &Graph, c: &Ctx, n: NodeIndex) -> Option<String> {
                file_scope(g, c, n)
            }
        }
    )*};
}

attention_lowering!(Attention, AttentionGrad);
