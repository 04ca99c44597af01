//! The optimizer step written again from PyTorch's definitions, apart from
//! the compiler's update graph: `clip_grad_norm_` (coefficient max_norm /
//! (norm + 1e-6), at most 1), then `AdamW` or `SGD` at step 1 from zero
//! state, weight decay on parameters of rank 2 or more (docs/dsl.md), the
//! fp16 loss scale divided out. The step graph's new parameters, run in
//! f64, must equal it to 1e-12 of each tensor's largest value: f64 rounding
//! of a few operations an entry (2^-52 = 2.2e-16 each) is far below that,
//! and a bias correction a step off, a decay on the wrong set, a clip 1%
//! off or a loss scale left in are all 1e-4 or more of the step.

use fusec_compiler::autodiff::{LOSS_SCALE_INPUT, LR_INPUT, STEP_INPUT};
use fusec_compiler::driver::Compiled;
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{run, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::DType;
use fusec_compiler::model::Optimizer;

/// Relative agreement asked of the new parameters (see the module doc).
const TOL: f64 = 1e-12;

/// The loss scale fed to fp16 models here: a power of two, as the runtime's
/// are, far from 1 so that leaving it in the gradients shows.
const LOSS_SCALE: f64 = 1024.0;

/// What the comparison found.
#[derive(Debug)]
pub enum Verdict {
    Matches,
    /// A parameter's update differs: which, and by how much.
    Differs(String),
}

/// Checks model `c`'s step at sizes `dims` against the reference update;
/// `Err` where the comparison cannot be made (the feeds or the interpreter
/// fail, or the step is fed what the reference does not model).
pub fn check(c: &Compiled, dims: &[(&str, i64)]) -> Result<Verdict, String> {
    let g = &c.optimized;
    let train = &c.model.train;
    let mut feeds = random_feeds(g, &super::dims(dims), 29).map_err(|e| format!("feeds: {e}"))?;
    let fp16 = train.precision == DType::F16;
    if fp16 {
        feeds
            .inputs
            .insert(LOSS_SCALE_INPUT.into(), Tensor::scalar(LOSS_SCALE));
    }
    for (name, want) in [(STEP_INPUT, 1.0), (LR_INPUT, 1e-3)] {
        if let Some(t) = feeds.inputs.get(name) {
            if t.data[0] != want {
                return Err(format!(
                    "{name} is fed {}, the reference assumes {want}",
                    t.data[0]
                ));
            }
        }
    }
    if feeds
        .state
        .values()
        .any(|t| t.data.iter().any(|&x| x != 0.0))
    {
        return Err("the reference assumes zero optimizer state".into());
    }
    let vals = run(g, &feeds, Precision::F64).map_err(|e| format!("interpreter: {e}"))?;
    let out = |r: Role| g.output(&r).and_then(|v| vals.get(&v));
    let unscale = if fp16 { LOSS_SCALE } else { 1.0 };
    let grads: Vec<Vec<f64>> = (0..g.params.len())
        .map(|i| {
            out(Role::Grad(i))
                .map(|t| t.data.iter().map(|x| x / unscale).collect())
                .ok_or_else(|| format!("no gradient of {}", g.params[i].name))
        })
        .collect::<Result<_, _>>()?;
    let coef = match train.clip_grad_norm {
        Some(max) => {
            let norm = grads.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
            (max / (norm + 1e-6)).min(1.0)
        }
        None => 1.0,
    };
    let lr = 1e-3;
    for (i, p) in g.params.iter().enumerate() {
        let old = &feeds.params[&p.name].data;
        let decays = p.ty.rank() >= 2;
        let want: Vec<f64> = match train.optimizer {
            Optimizer::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                let wd = if decays { weight_decay } else { 0.0 };
                old.iter()
                    .zip(&grads[i])
                    .map(|(&w, &gr)| {
                        let gr = gr * coef;
                        let m = (1.0 - beta1) * gr / (1.0 - beta1);
                        let v = (1.0 - beta2) * gr * gr / (1.0 - beta2);
                        w * (1.0 - lr * wd) - lr * m / (v.sqrt() + eps)
                    })
                    .collect()
            }
            Optimizer::Sgd { weight_decay, .. } => {
                let wd = if decays { weight_decay } else { 0.0 };
                // torch.optim.SGD's first step: the buffer is the gradient.
                old.iter()
                    .zip(&grads[i])
                    .map(|(&w, &gr)| w - lr * (gr * coef + wd * w))
                    .collect()
            }
        };
        let got = out(Role::NewParam(i)).ok_or_else(|| format!("no new value of {}", p.name))?;
        let size = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-300);
        let worst = got
            .data
            .iter()
            .zip(&want)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f64, f64::max);
        if worst.is_nan() || worst > TOL * size {
            return Ok(Verdict::Differs(format!(
                "the update of `{}` differs from PyTorch's by {:.3e} of its largest value (bound {TOL:e})",
                p.name,
                worst / size
            )));
        }
    }
    Ok(Verdict::Matches)
}
