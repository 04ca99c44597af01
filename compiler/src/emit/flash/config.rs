//! Whether the tensor-core kernels take an attention op, and the sizes
//! they take it with. Apart from the kernel choice because the same checks
//! decide the launches (forward.rs, backward.rs) and the reason the build
//! report gives when an op keeps the simple kernels (`why_not`).

use super::templates::{self, Instance};
use super::FlashArch;
use crate::emit::access::Access;
use crate::emit::templates::Ctx;
use crate::ir::types::DType;
use crate::ir::{Dim, Graph};
use crate::ops::{AttnDropout, Op};
use petgraph::stable_graph::NodeIndex;

/// An attention op's sizes when the tensor-core kernels support it.
pub(crate) struct Config {
    pub(crate) batch: Dim,
    pub(crate) q_len: Dim,
    pub(crate) kv_len: Dim,
    pub(crate) q_heads: Dim,
    pub(crate) kv_heads: Dim,
    pub(crate) d: u64,
    pub(crate) dv: u64,
    pub(crate) group: i64,
    pub(crate) causal: bool,
    pub(crate) scale: f64,
    pub(crate) dt: DType,
    /// The kernel parameter holding each batch entry's key count, where
    /// the op masks padded keys by their lengths.
    pub(crate) lengths: Option<String>,
    /// The op's dropout and the kernel parameter holding the step's key.
    pub(crate) dropout: Option<(AttnDropout, String)>,
}

/// The largest head dim on tensor cores.
pub const MAX_HEAD_DIM: u64 = 256;

impl Config {
    /// For op `n` with q, k, v its inputs 0..3, or why the tensor-core
    /// kernels do not take it: they need bf16 or f16 with head dims that are
    /// multiples of 8 up to 256, constant head counts, the inputs in `tiled`
    /// in 16-byte aligned contiguous rows, the inputs and outputs listed as
    /// f32 in f32 and every other one in q's dtype.
    fn of(
        g: &Graph,
        c: &Ctx,
        n: NodeIndex,
        (causal, scale): (bool, f64),
        tiled: &[usize],
        f32_in: &[usize],
        f32_out: &[usize],
    ) -> Result<Config, String> {
        let ins = g.inputs(n);
        if c.ins.len() != ins.len() || c.outs.len() != g.g[n].outputs.len() {
            return Err("it shares its kernel with other ops".into());
        }
        let ((lengths, key), dropout) = match &g.g[n].op {
            Op::Attention(a) => (a.extra_slots(), a.dropout),
            Op::AttentionGrad(a) => (a.extra_slots(), a.dropout),
            _ => ((None, None), None),
        };
        let key = dropout.zip(key);
        let (q, k, v) = (g.ty(ins[0]), g.ty(ins[1]), g.ty(ins[2]));
        let dt = q.dtype;
        if !matches!(dt, DType::BF16 | DType::F16 | DType::F32) {
            return Err(format!(
                "it computes in {} (tensor cores take bf16, f16 or f32)",
                dt.name()
            ));
        }
        let want = |i: usize| {
            if Some(i) == lengths || Some(i) == key.map(|k| k.1) {
                DType::I32
            } else if f32_in.contains(&i) {
                DType::F32
            } else {
                dt
            }
        };
        let want_out = |f32: bool| if f32 { DType::F32 } else { dt };
        if (0..ins.len()).any(|i| c.in_dt(i) != want(i))
            || (0..c.outs.len()).any(|o| c.out_dt(o) != want_out(f32_out.contains(&o)))
        {
            return Err(
                "an input or output is stored in another type (a cast fused into its kernel)"
                    .into(),
            );
        }
        let size = |t: &crate::ir::TensorType, what: &str| {
            t.shape[3]
                .as_const()
                .and_then(|x| u64::try_from(x).ok())
                .ok_or_else(|| format!("the head dim of {what} is not a constant"))
        };
        let (d, dv) = (size(q, "q")?, size(v, "v")?);
        for (x, what) in [(d, "q and k"), (dv, "v")] {
            if x == 0 || !x.is_multiple_of(8) || x > MAX_HEAD_DIM {
                return Err(format!(
                    "the head dim of {what} is {x} (the tensor-core kernels take multiples of 8 up to {MAX_HEAD_DIM})"
                ));
            }
        }
        if k.shape[3].as_const() != Some(d as i64) {
            return Err("the head dims of q and k differ".into());
        }
        let heads = |t: &crate::ir::TensorType| t.shape[2].as_const().filter(|&h| h > 0);
        let (Some(hq), Some(hk)) = (heads(q), heads(k)) else {
            return Err("its head counts are not constants".into());
        };
        if let Some(&i) = tiled
            .iter()
            .find(|&&i| !Access::input(g, c, n, i).rows_aligned())
        {
            return Err(format!(
                "input {} is not read in contiguous rows starting 16-byte aligned",
                i + 1
            ));
        }
        Ok(Config {
            batch: q.shape[0].clone(),
            q_len: q.shape[1].clone(),
            kv_len: k.shape[1].clone(),
            q_heads: q.shape[2].clone(),
            kv_heads: k.shape[2].clone(),
            d,
            dv,
            group: hq / hk,
            causal,
            scale,
            dt,
            lengths: lengths.map(|i| Access::input(g, c, n, i).ptr),
            dropout: key.map(|(d, i)| (d, Access::input(g, c, n, i).ptr)),
        })
    }

    /// Whether the scale can go into the exponent after the row max: the
    /// test is on the f32 factor the kernel uses, as one that rounds to 0
    /// would make a masked score's -inf * 0 a NaN.
    pub(super) fn scale_in_exp(&self) -> bool {
        (self.scale * std::f64::consts::LOG2_E) as f32 > 0.0
    }

    fn elem_name(&self) -> &'static str {
        match self.dt {
            DType::F16 => "f16",
            DType::F32 => "f32 (3xTF32 products)",
            _ => "bf16",
        }
    }

    /// Why the f32 backward does not run on tensor cores, where it does not.
    pub(super) fn f32_backward_problem(&self) -> Option<String> {
        if self.dt != DType::F32 {
            None
        } else if !templates::f32_backward_fits(self.d, self.dv) {
            Some(format!(
                "its head dims {} and {} add up to more than the 256 features the f32 backward holds",
                self.d, self.dv
            ))
        } else {
            None
        }
    }

    /// One line on what the kernel computes, for its source's comment.
    pub(super) fn about(&self) -> String {
        let mut s = format!(
            "{}, head dims {} (q, k) and {} (v), {}, {} query head{} per key/value head",
            self.elem_name(),
            self.d,
            self.dv,
            if self.causal { "causal" } else { "not causal" },
            self.group,
            if self.group == 1 { "" } else { "s" }
        );
        if let Some((d, _)) = &self.dropout {
            s += &format!(", dropout {} on the probabilities", d.p);
        }
        s
    }

    /// The family the backward runs on: Hopper's kernels drop only up to
    /// 192 features in all (D = Dv = 96), so wider heads drop on the
    /// mma.sync templates, which run on every GPU from sm_80.
    pub(super) fn backward_arch(&self, arch: FlashArch) -> FlashArch {
        if self.dropout.is_some() && !templates::dkdvdq_sm90_drops(self.d, self.dv) {
            FlashArch::Sm80
        } else {
            arch
        }
    }

    /// `inst` with the dropout its op has (the last parameter, `DROPOUT`,
    /// of both forwards and the mma.sync backward, defaults to false).
    pub(super) fn drop(&self, inst: Instance) -> Instance {
        if self.dropout.is_some() {
            inst.with_dropout()
        } else {
            inst
        }
    }
}

pub(super) fn forward_config(g: &Graph, c: &Ctx, n: NodeIndex) -> Result<Config, String> {
    let Op::Attention(op) = &g.g[n].op else {
        return Err("it is not an attention".into());
    };
    Config::of(g, c, n, (op.causal, op.scale), &[0, 1, 2], &[], &[1])
}

pub(super) fn backward_config(g: &Graph, c: &Ctx, n: NodeIndex) -> Result<Config, String> {
    let Op::AttentionGrad(op) = &g.g[n].op else {
        return Err("it is not an attention gradient".into());
    };
    // q, k, v, o and dO are read in 16-byte tiles; lse is f32.
    Config::of(g, c, n, (op.causal, op.scale), &[0, 1, 2, 3, 5], &[4], &[])
}
