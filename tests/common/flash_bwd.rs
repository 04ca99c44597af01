//! The attention backward's host runs, shared by `flash_bwd_host.rs` and
//! `flash_bwd_mutations.rs`: the kernel sets of a model, and one set's run
//! compared with the interpreter.

use super::flash::{build, run_set, Built, Which};
use fusec_compiler::emit::flash::FlashArch;
use fusec_compiler::ir::types::DType;
use std::collections::HashMap;
use std::path::Path;

/// The kernel set the snapshots hold (and the mutation tests break): fused
/// projection, 4 query heads on 1, D = 64, causal (and a non-causal twin).
pub const SNAPSHOT_MODEL: &str = "
const d = 16
dim B, T
input x: f32[B, T, d]
param w: [d, 384] = normal(0.3)
let q, k, v = split(x @ w, [256, 64, 64])
let y = merge_heads(attention(heads(q, 4), heads(k, 1), heads(v, 1), causal = true))
train {
    loss = mean(y * y)
    precision = bf16
}
";

/// Both schemes on mma.sync; the atomic one alone (whose dK/dV/dQ kernel
/// is Hopper's own where it fits) on Hopper.
pub fn backward(src: &str, precision: &str, arch: FlashArch) -> Built {
    let which = match arch {
        FlashArch::Sm80 => Which::Backward {
            atomic: true,
            deterministic: true,
        },
        FlashArch::Sm90a => Which::Backward {
            atomic: true,
            deterministic: false,
        },
    };
    build(src, precision, arch, which)
}

/// The widths of dq, dk and dv in the rows of kernel `k`'s output where
/// its op is a packed `attention_grad`.
fn packed_widths(
    b: &Built,
    k: &fusec_compiler::kernel::Kernel,
    dims: &HashMap<String, i64>,
) -> Option<[usize; 3]> {
    let fusec_compiler::kernel::Body::Op(n) = k.body else {
        return None;
    };
    let g = &b.g;
    match &g.g[n].op {
        fusec_compiler::ops::Op::AttentionGrad(a) if a.packed => {}
        _ => return None,
    }
    let ins = g.inputs(n);
    let env = |s: &str| dims.get(s).copied();
    let width = |i: usize| -> Option<usize> {
        let t = g.ty(ins[i]);
        usize::try_from(t.shape[2].eval(&env)? * t.shape[3].eval(&env)?).ok()
    };
    Some([width(0)?, width(1)?, width(2)?])
}

/// Runs set `f` and compares dQ, dK, dV with the interpreter's: the largest
/// error of each relative to its max |ref|, or where they differ.
pub fn run_and_compare(
    exe: &Path,
    dir: &Path,
    b: &Built,
    f: usize,
    bufs: &[fusec_compiler::interp::tensor::Tensor],
    dims: &HashMap<String, i64>,
) -> Result<[f64; 3], String> {
    let k = &b.program.kernels[b.sets[f].kernel];
    let written = run_set(exe, dir, b, f, bufs, dims)?;
    let mut outs = Vec::new();
    for (slot, got) in written.into_iter().enumerate() {
        let want = bufs[k.outputs[slot]].data.clone();
        assert_eq!(got.len(), want.len());
        outs.push((got, want));
    }
    // A packed gradient's rows hold dq, dk and dv side by side: each is
    // judged on its own, as the unpacked ones are.
    if let Some(widths) = packed_widths(b, k, dims) {
        let (got, want) = outs.pop().expect("one packed output");
        let width: usize = widths.iter().sum();
        let mut first = 0;
        for w in widths {
            let part = |x: &[f64]| -> Vec<f64> {
                x.chunks(width)
                    .flat_map(|row| row[first..first + w].to_vec())
                    .collect()
            };
            outs.push((part(&got), part(&want)));
            first += w;
        }
    }
    let outs: Vec<(Vec<f64>, Vec<f64>, f64)> = outs
        .into_iter()
        .map(|(got, want)| {
            let max = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            (got, want, max)
        })
        .collect();
    // With one visible key per query (S = 1), dQ and dK are exactly zero
    // (P = 1, dP = delta): their errors are then measured against max |dV|.
    // An exact zero of the reference is a zero in real arithmetic (a query
    // that sees one key, a padded key, a key no query sees): the kernel must
    // give exactly 0 there too, not rounding noise, which Adam would turn
    // into a step of a sizeable fraction of the learning rate. Not for f16
    // outputs: the reference rounds anything under 2^-25 to 0 there, so its
    // zeros need not be structural; the same kernels' bf16 and f32 runs
    // (the same code, another store type) are held to the rule.
    let largest = outs.iter().fold(0.0f64, |m, o| m.max(o.2));
    if largest == 0.0 {
        return Err("every reference output is all zero: the case tests nothing".into());
    }
    let mut errs = [0.0f64; 3];
    for (slot, (got, want, max)) in outs.iter().enumerate() {
        let name = ["dQ", "dK", "dV"][slot];
        let max = if *max > 0.0 { *max } else { largest };
        let exact_zeros = b.program.buffers[k.outputs[slot.min(k.outputs.len() - 1)]]
            .ty
            .dtype
            != DType::F16;
        for (i, (x, y)) in want.iter().zip(got).enumerate() {
            if exact_zeros && *x == 0.0 && *y != 0.0 {
                return Err(format!(
                    "{name} element {i}: exactly 0 in the reference, kernel {y} (max |{name}| {max})"
                ));
            }
            let err = (x - y).abs() / max;
            if err.is_nan() || err > 3e-2 {
                return Err(format!(
                    "{name} element {i}: reference {x}, kernel {y} (max |{name}| {max})"
                ));
            }
            errs[slot] = errs[slot].max(err);
        }
    }
    Ok(errs)
}
