//! The `train { ... }` section: which value is the loss, the optimizer,
//! the learning-rate schedule, clipping, precision and micro-batches.

use super::Elab;
use crate::diag::Diagnostic;
use crate::dsl::ast::{Arg, Expr, ExprKind, Ident, TrainSection};
use crate::ir::DType;
use crate::model::values::Val;
use crate::model::{Decay, Optimizer, Schedule, TrainConfig};

const KEYS: &[&str] = &[
    "loss",
    "optimizer",
    "clip_grad_norm",
    "precision",
    "micro_batches",
    "schedule",
    "memory_budget",
];

fn entry<'a>(t: &'a TrainSection, key: &str) -> Option<&'a Expr> {
    t.entries
        .iter()
        .find(|e| e.key.name == key)
        .map(|e| &e.value)
}

/// Read before anything else: parameters are cast to it as they are declared.
pub fn precision(t: &TrainSection) -> Result<DType, Diagnostic> {
    let Some(e) = entry(t, "precision") else {
        return Ok(DType::F32);
    };
    let bad = |found: String| {
        Diagnostic::new(
            "unknown precision",
            e.span,
            format!("expected fp32, bf16 or fp16, found {found}"),
        )
    };
    let about = "bf16 and fp16 compute with f32 master weights and optimizer state";
    match &e.kind {
        ExprKind::Name(n) => match n.as_str() {
            "fp32" | "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            "fp16" | "f16" => Ok(DType::F16),
            other => {
                // The spellings other frameworks use.
                let meant = match other {
                    "bfloat16" | "bfloat" => Some("bf16".to_string()),
                    "float16" | "half" => Some("fp16".to_string()),
                    "float32" | "float" | "full" => Some("fp32".to_string()),
                    _ => super::suggest(other, ["fp32", "bf16", "fp16"].into_iter()),
                };
                let d = bad(format!("`{other}`"));
                Err(match meant {
                    Some(m) => d.with_help(format!("did you mean `{m}`?")),
                    None => d,
                }
                .with_help(about))
            }
        },
        _ => Err(bad("an expression".into()).with_help(about)),
    }
}

pub fn section(e: &mut Elab, t: &TrainSection) -> Result<TrainConfig, Diagnostic> {
    for (i, en) in t.entries.iter().enumerate() {
        if !KEYS.contains(&en.key.name.as_str()) {
            let mut d = Diagnostic::new(
                format!("unknown setting `{}` in `train`", en.key.name),
                en.key.span,
                "not a training setting",
            );
            if let Some(s) = super::suggest(&en.key.name, KEYS.iter().copied()) {
                d = d.with_help(format!("did you mean `{s}`?"));
            }
            return Err(d.with_help(format!("the settings are: {}", KEYS.join(", "))));
        }
        if let Some(prev) = t.entries[..i].iter().find(|p| p.key.name == en.key.name) {
            return Err(Diagnostic::new(
                format!("`{}` is set twice", en.key.name),
                en.key.span,
                "set again here",
            )
            .with_note(prev.key.span, "first set here"));
        }
    }
    let Some(loss_expr) = entry(t, "loss") else {
        return Err(Diagnostic::new(
            "the `train` section does not say what the loss is",
            t.span,
            "no `loss = ...` here",
        )
        .with_help("add `loss = cross_entropy(logits, targets)` or another scalar"));
    };
    let loss = e.eval(loss_expr)?;
    let Val::Tensor(lv) = loss else {
        return Err(Diagnostic::new(
            "the loss must be a tensor computed from the model",
            loss_expr.span,
            format!(
                "expected a scalar tensor, found {}",
                loss.describe(&e.graph)
            ),
        )
        .with_help("e.g. `loss = cross_entropy(logits, targets)`"));
    };
    let lt = e.graph.ty(lv).clone();
    if lt.rank() != 0 {
        return Err(Diagnostic::new(
            "the loss must be a scalar",
            loss_expr.span,
            format!("expected a scalar (shape []), found {lt}"),
        )
        .with_help("reduce it, e.g. `mean(x)`; `cross_entropy` already returns the mean"));
    }
    if !lt.dtype.is_float() {
        return Err(Diagnostic::new(
            "the loss must be a floating-point scalar",
            loss_expr.span,
            format!("expected a floating-point scalar, found {lt}"),
        )
        .with_help("an i32 value has no gradient; compute the loss from the model's floating-point outputs"));
    }
    e.finish_loss(lv);

    let optimizer = match entry(t, "optimizer") {
        None => Optimizer::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        Some(o) => optimizer(e, o)?,
    };
    let clip_grad_norm = match entry(t, "clip_grad_norm") {
        None => None,
        Some(c) => Some(positive(e, c, "clip_grad_norm")?),
    };
    let micro_batches = match entry(t, "micro_batches") {
        None => 1,
        Some(m) => {
            let v = e.eval(m)?;
            match v.as_i64() {
                Some(n) if (1..=65536).contains(&n) => n as u32,
                _ => {
                    return Err(Diagnostic::new(
                        "`micro_batches` must be an integer from 1 to 65536",
                        m.span,
                        format!(
                            "expected an integer from 1 to 65536, found {}",
                            v.describe(&e.graph)
                        ),
                    ))
                }
            }
        }
    };
    // In GiB: the language has no units; `--memory-budget` takes them.
    let memory_budget = match entry(t, "memory_budget") {
        None => None,
        Some(x) => {
            let gib = positive(e, x, "memory_budget")?;
            if gib >= (1u64 << 30) as f64 {
                return Err(Diagnostic::new(
                    "`memory_budget` is too large",
                    x.span,
                    "a budget in GiB, e.g. `memory_budget = 12`",
                ));
            }
            Some((gib * (1u64 << 30) as f64) as u64)
        }
    };
    let schedule = match entry(t, "schedule") {
        None => Schedule::default(),
        Some(x) => schedule(e, x, optimizer.lr())?,
    };
    Ok(TrainConfig {
        optimizer,
        schedule,
        clip_grad_norm,
        precision: e.precision,
        micro_batches,
        memory_budget,
        ranks: e.ranks,
        zero_rank: e.zero_rank,
        zero_stage: Default::default(),
        shard_group: e.shard_group,
        reduce_dtype: DType::F32,
        loss_span: loss_expr.span,
    })
}

fn positive(e: &mut Elab, x: &Expr, what: &str) -> Result<f64, Diagnostic> {
    let v = e.eval(x)?;
    match v.as_f64() {
        Some(f) if f > 0.0 && f.is_finite() => Ok(f),
        _ => Err(Diagnostic::new(
            format!("`{what}` must be a positive number"),
            x.span,
            format!(
                "expected a number greater than 0, found {}",
                v.describe(&e.graph)
            ),
        )),
    }
}

fn optimizer(e: &mut Elab, o: &Expr) -> Result<Optimizer, Diagnostic> {
    let ExprKind::Call { func, args } = &o.kind else {
        return Err(Diagnostic::new("expected an optimizer", o.span, "not `adamw(...)` or `sgd(...)`")
            .with_help("e.g. `optimizer = adamw(lr = 3e-4, betas = (0.9, 0.95), eps = 1e-8, weight_decay = 0.1)`"));
    };
    let allowed: &[&str] = match func.name.as_str() {
        "adamw" => &["lr", "betas", "eps", "weight_decay"],
        "sgd" => &["lr", "momentum", "weight_decay"],
        other => {
            let d = Diagnostic::new(
                format!("unknown optimizer `{other}`"),
                func.span,
                "expected `adamw` or `sgd`",
            );
            return Err(match super::suggest(other, ["adamw", "sgd"].into_iter()) {
                Some(s) => d.with_help(format!("did you mean `{s}`?")),
                None => d,
            });
        }
    };
    let vals: std::collections::HashMap<&str, &Expr> =
        named_settings(func, args, allowed, "optimizer")?
            .into_iter()
            .map(|(n, v)| (n.name.as_str(), v))
            .collect();
    let mut num = |key: &str, default: f64, lo: f64, hi: f64| -> Result<f64, Diagnostic> {
        let Some(x) = vals.get(key) else {
            return Ok(default);
        };
        let v = e.eval(x)?;
        match v.as_f64() {
            Some(f) if f >= lo && f <= hi => Ok(f),
            _ => Err(Diagnostic::new(
                format!("`{key}` must be a number from {lo} to {hi}"),
                x.span,
                format!(
                    "expected a number from {lo} to {hi}, found {}",
                    v.describe(&e.graph)
                ),
            )),
        }
    };
    if func.name == "sgd" {
        if !vals.contains_key("lr") {
            return Err(
                Diagnostic::new("`sgd` needs a learning rate", o.span, "no `lr`")
                    .with_help("e.g. `sgd(lr = 0.1, momentum = 0.9)`"),
            );
        }
        let lr = num("lr", 0.0, 0.0, 1e3)?;
        let momentum = num("momentum", 0.0, 0.0, 1.0)?;
        let weight_decay = num("weight_decay", 0.0, 0.0, 1e3)?;
        return Ok(Optimizer::Sgd {
            lr,
            momentum,
            weight_decay,
        });
    }
    let lr = num("lr", 1e-3, 0.0, 1e3)?;
    let eps = num("eps", 1e-8, 0.0, 1.0)?;
    let weight_decay = num("weight_decay", 0.01, 0.0, 1e3)?;
    let (beta1, beta2) = match vals.get("betas") {
        None => (0.9, 0.999),
        Some(b) => {
            let v = e.eval(b)?;
            let bad = |span, found: String| {
                Diagnostic::new("`betas` must be two numbers in [0, 1)", span, found)
                    .with_help("e.g. `betas = (0.9, 0.95)`")
            };
            let Val::List(items) = &v else {
                return Err(bad(
                    b.span,
                    format!(
                        "expected a pair `(beta1, beta2)`, found {}",
                        v.describe(&e.graph)
                    ),
                ));
            };
            if items.len() != 2 {
                return Err(bad(
                    b.span,
                    format!("expected 2 numbers, found {}", items.len()),
                ));
            }
            let mut pair = [0.0; 2];
            for (k, (item, span)) in items.iter().enumerate() {
                match item.as_f64() {
                    Some(x) if (0.0..1.0).contains(&x) => pair[k] = x,
                    _ => {
                        let which = if k == 0 { "beta1" } else { "beta2" };
                        return Err(bad(
                            *span,
                            format!(
                                "expected {which} in [0, 1), found {}",
                                item.describe(&e.graph)
                            ),
                        ));
                    }
                }
            }
            (pair[0], pair[1])
        }
    };
    Ok(Optimizer::AdamW {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
    })
}

/// `schedule = cosine(warmup = 100, steps = 5000, min_lr = 6e-5)`,
/// `linear(...)` or `constant(warmup = 100)`.
fn schedule(e: &mut Elab, x: &Expr, lr: f64) -> Result<Schedule, Diagnostic> {
    let example = "e.g. `schedule = cosine(warmup = 100, steps = 5000, min_lr = 6e-5)`";
    let ExprKind::Call { func, args } = &x.kind else {
        return Err(Diagnostic::new(
            "expected a learning-rate schedule",
            x.span,
            "not `cosine(...)`, `linear(...)`, `constant(...)` or `inverse_sqrt(...)`",
        )
        .with_help(example));
    };
    let (decay, allowed): (Decay, &[&str]) = match func.name.as_str() {
        "cosine" => (Decay::Cosine, &["warmup", "steps", "min_lr"]),
        "linear" => (Decay::Linear, &["warmup", "steps", "min_lr"]),
        "constant" => (Decay::Constant, &["warmup"]),
        "inverse_sqrt" => (Decay::InverseSqrt, &["warmup"]),
        other => {
            let d = Diagnostic::new(
                format!("unknown schedule `{other}`"),
                func.span,
                "expected `cosine`, `linear`, `constant` or `inverse_sqrt`",
            );
            return Err(
                match super::suggest(
                    other,
                    ["cosine", "linear", "constant", "inverse_sqrt"].into_iter(),
                ) {
                    Some(s) => d.with_help(format!("did you mean `{s}`?")),
                    None => d.with_help(example),
                },
            );
        }
    };
    let mut out = Schedule {
        decay,
        ..Schedule::default()
    };
    let mut steps_span = None;
    for (n, value) in named_settings(func, args, allowed, "schedule")? {
        let v = e.eval(value)?;
        match n.name.as_str() {
            "min_lr" => match v.as_f64() {
                Some(f) if f >= 0.0 && f <= lr => out.min_lr = f,
                _ => {
                    return Err(Diagnostic::new(
                        format!("`min_lr` must be a number from 0 to the optimizer's lr ({lr})"),
                        value.span,
                        format!("found {}", v.describe(&e.graph)),
                    ))
                }
            },
            key => match v.as_i64() {
                Some(k) if k >= 0 && (key == "warmup" || k >= 1) => {
                    if key == "warmup" {
                        out.warmup = k as u64;
                    } else {
                        out.steps = Some(k as u64);
                        steps_span = Some(value.span);
                    }
                }
                _ => {
                    return Err(Diagnostic::new(
                        format!("`{key}` must be a whole number of steps"),
                        value.span,
                        format!("found {}", v.describe(&e.graph)),
                    ))
                }
            },
        }
    }
    if let (Some(steps), Some(span)) = (out.steps, steps_span) {
        if steps <= out.warmup {
            return Err(Diagnostic::new(
                "the decay must end after the warmup",
                span,
                format!("`steps = {steps}` is not after `warmup = {}`", out.warmup),
            )
            .with_help("`steps` is the step the decay ends at, counted from the first step, warmup included"));
        }
    }
    if out.decay == Decay::InverseSqrt && out.warmup == 0 {
        return Err(Diagnostic::new(
            "`inverse_sqrt` needs a warmup of at least one step",
            x.span,
            "its rate after the warmup is lr * sqrt(warmup / step)",
        )
        .with_help("e.g. `schedule = inverse_sqrt(warmup = 4000)` (the Annotated Transformer's)"));
    }
    Ok(out)
}

/// The `name = value` settings of an optimizer or schedule call, in order,
/// each named, known (`allowed`) and given once.
fn named_settings<'a>(
    func: &Ident,
    args: &'a [Arg],
    allowed: &[&str],
    what: &str,
) -> Result<Vec<(&'a Ident, &'a Expr)>, Diagnostic> {
    let takes = || format!("`{}` takes: {}", func.name, allowed.join(", "));
    let mut out: Vec<(&Ident, &Expr)> = Vec::new();
    for a in args {
        let Some(n) = &a.name else {
            return Err(Diagnostic::new(
                format!("{what} settings are given by name"),
                a.value.span,
                "expected `name = value`, found a value by position",
            )
            .with_help(format!("e.g. `{}({} = ...)`", func.name, allowed[0]))
            .with_help(takes()));
        };
        if !allowed.contains(&n.name.as_str()) {
            let mut d = Diagnostic::new(
                format!("`{}` has no setting `{}`", func.name, n.name),
                n.span,
                "unknown setting",
            );
            if let Some(s) = super::suggest(&n.name, allowed.iter().copied()) {
                d = d.with_help(format!("did you mean `{s}`?"));
            }
            return Err(d.with_help(takes()));
        }
        if out.iter().any(|(m, _)| m.name == n.name) {
            return Err(Diagnostic::new(
                format!("`{}` is given twice", n.name),
                n.span,
                "given again",
            ));
        }
        out.push((n, &a.value));
    }
    Ok(out)
}
