//! Gradient checking: autodiff's gradients against central finite
//! differences of the loss, both evaluated in f64 by the reference
//! interpreter on random inputs.

use crate::interp::random::random_feeds;
use crate::interp::{run, Feeds, InterpError, Precision};
use crate::ir::graph::{Graph, Role};
use crate::model::Model;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// Finite-difference step.
    pub h: f64,
    pub atol: f64,
    pub rtol: f64,
}

impl Default for Tolerance {
    /// In f64 a central difference with h = 1e-6 is accurate to about 1e-9
    /// relative, so 1e-5 leaves a wide margin while still catching any real
    /// error in a gradient rule (those are off by O(1) relative).
    fn default() -> Self {
        Tolerance {
            h: 1e-6,
            atol: 1e-8,
            rtol: 1e-5,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub checked: usize,
    pub max_abs_err: f64,
    pub max_rel_err: f64,
    pub failures: Vec<String>,
}

fn loss_of(g: &Graph, feeds: &Feeds) -> Result<f64, InterpError> {
    let loss = g
        .output(&Role::Loss)
        .ok_or_else(|| InterpError("the graph has no loss".into()))?;
    let vals = run(g, feeds, Precision::F64)?;
    Ok(vals[&loss].data[0])
}

/// Checks up to `samples` entries of every parameter's gradient.
/// `backward` is the forward+backward graph of `model` (autodiff::add_backward).
pub fn check_model(
    model: &Model,
    backward: &Graph,
    dims: &HashMap<String, i64>,
    seed: u64,
    samples: usize,
    tol: Tolerance,
) -> Result<Report, InterpError> {
    let feeds = random_feeds(backward, dims, seed)?;
    let vals = run(backward, &feeds, Precision::F64)?;
    let seed_scale = 1.0 / model.train.micro_batches as f64;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let mut report = Report::default();
    for (i, p) in backward.params.iter().enumerate() {
        let gv = backward
            .output(&Role::Grad(i))
            .ok_or_else(|| InterpError(format!("no gradient for {}", p.name)))?;
        let grad = &vals[&gv];
        let n = grad.len();
        let picks: Vec<usize> = if n <= samples {
            (0..n).collect()
        } else {
            (0..samples).map(|_| rng.random_range(0..n)).collect()
        };
        for k in picks {
            let mut f = feeds.clone();
            let base = f.params[&p.name].data[k];
            f.params.get_mut(&p.name).expect("fed above").data[k] = base + tol.h;
            let up = loss_of(&model.graph, &f)?;
            f.params.get_mut(&p.name).expect("fed above").data[k] = base - tol.h;
            let down = loss_of(&model.graph, &f)?;
            let numeric = (up - down) / (2.0 * tol.h) * seed_scale;
            let analytic = grad.data[k];
            let err = (numeric - analytic).abs();
            let scale = numeric.abs().max(analytic.abs());
            report.checked += 1;
            report.max_abs_err = report.max_abs_err.max(err);
            if scale > tol.atol {
                report.max_rel_err = report.max_rel_err.max(err / scale);
            }
            // Written so that a NaN error counts as a failure.
            let within = err <= tol.atol + tol.rtol * scale;
            if !within {
                report.failures.push(format!(
                    "{}[{k}]: autodiff {analytic:.10e}, finite difference {numeric:.10e} (error {err:.3e})",
                    p.name
                ));
            }
        }
    }
    Ok(report)
}
