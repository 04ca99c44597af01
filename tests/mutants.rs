//! The checks bite: each deliberate error (`fusec_compiler::mutants`,
//! selected for this thread alone, and kernels made 1% wrong in the
//! host-step harness) must be caught by a named check, on a model that has
//! what it breaks (the shipped models at tiny sizes and the drawn ones of
//! tests/common/zoo.rs). The table of what caught what is docs/testing.md's;
//! this test fails if that table is out of date (`FUSEC_UPDATE_DOCS=1`
//! rewrites it).

mod common;

use common::{host, step_host, update_reference, zoo};
use fusec_compiler::driver::{compile, Compiled};
use fusec_compiler::elaborate::Options;
use fusec_compiler::ir::DType;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::model::Optimizer;
use fusec_compiler::mutants::{self, Mutant};
use std::collections::BTreeMap;

/// A model to break: name, source, `--set` overrides, sizes.
struct Subject {
    name: String,
    source: String,
    sets: Vec<(String, String)>,
    dims: Vec<(String, i64)>,
}

impl Subject {
    fn dims(&self) -> Vec<(&str, i64)> {
        self.dims.iter().map(|(k, v)| (k.as_str(), *v)).collect()
    }

    fn compile(&self) -> Compiled {
        self.compile_in(None)
    }

    /// In f32, where the host step's comparison is exact enough to see a
    /// 1% error (in 16-bit models the kernels round in other places than
    /// the interpreter, by up to 3% of a tensor's largest value).
    fn compile_f32(&self) -> Compiled {
        self.compile_in(Some(DType::F32))
    }

    fn compile_in(&self, precision: Option<DType>) -> Compiled {
        let o = Options {
            overrides: self.sets.clone(),
            precision,
            ..Options::default()
        };
        compile(&self.source, &self.name, &o)
            .unwrap_or_else(|f| panic!("{}", f.render(&self.name, &self.source)))
    }
}

/// The shipped models at tiny sizes, then 50 drawn.
fn subjects() -> Vec<Subject> {
    let mut all = Vec::new();
    for (file, sets, dims) in common::tiny_models() {
        let (name, source) = common::example(file);
        all.push(Subject {
            name,
            source,
            sets: sets
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            dims: dims.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        });
    }
    for seed in 0..50 {
        let m = zoo::draw(seed);
        all.push(Subject {
            name: m.name,
            source: m.source,
            sets: Vec::new(),
            dims: m.dims,
        });
    }
    all
}

/// What the graph-level checks say of subject `s` as it compiles now:
/// (check, whether it failed). A check that cannot run (the interpreter
/// stops) is a broken test, not a catch: it panics.
fn graph_verdicts(s: &Subject) -> Vec<(&'static str, bool)> {
    let c = s.compile();
    let dims = s.dims();
    let grads = common::gradcheck(&c, &dims, 7, 4)
        .unwrap_or_else(|e| panic!("{}: the gradient check cannot run: {e}", s.name));
    let update = update_reference::check(&c, &dims)
        .unwrap_or_else(|e| panic!("{}: the update reference cannot run: {e}", s.name));
    vec![
        (
            "gradient check (f64 finite differences)",
            !grads.failures.is_empty(),
        ),
        (
            "update against PyTorch's optimizers",
            matches!(update, update_reference::Verdict::Differs(_)),
        ),
    ]
}

/// The checks that ran on a mutant and what each said: (check, caught).
/// Unmutated, the subject must pass them all, or a catch would mean
/// nothing.
fn graph_checks(s: &Subject, m: &Mutant) -> Vec<(&'static str, bool)> {
    for (check, failed) in graph_verdicts(s) {
        assert!(!failed, "{}: {check} fails without a mutant", s.name);
    }
    mutants::with(m.clone(), || graph_verdicts(s))
}

/// The first subject `pick` accepts.
fn first(all: &[Subject], pick: impl Fn(&Compiled) -> bool) -> &Subject {
    all.iter()
        .find(|s| pick(&s.compile()))
        .expect("a subject with what the mutant breaks")
}

/// Op names whose backward rule a model's gradient passes through, with the
/// first subject that has each: a rule the mutant changes nothing in (an
/// op without one) builds the same backward graph and is left out.
fn backward_ops(all: &[Subject]) -> BTreeMap<String, usize> {
    let mut found = BTreeMap::new();
    for (i, s) in all.iter().enumerate() {
        let c = s.compile();
        let plain = fusec_compiler::autodiff::add_backward(&c.model)
            .unwrap()
            .g
            .node_count();
        for n in c.model.graph.g.node_indices() {
            let op = &c.model.graph.g[n].op;
            if op.is_source() || found.contains_key(op.name()) {
                continue;
            }
            let name = op.name().to_string();
            let mutated = mutants::with(Mutant::Backward(name.clone()), || {
                fusec_compiler::autodiff::add_backward(&c.model)
                    .unwrap()
                    .g
                    .node_count()
            });
            if mutated != plain {
                found.insert(name, i);
            }
        }
    }
    found
}

/// The table docs/testing.md holds between these markers.
const START: &str = "<!-- mutants:start -->";
const END: &str = "<!-- mutants:end -->";

#[test]
fn every_mutant_is_caught_by_a_named_check() {
    let all = subjects();
    let mut rows: Vec<String> = Vec::new();
    let mut escaped: Vec<String> = Vec::new();
    // One row: the checks that caught the mutant, or "nothing" (a failure).
    let record = |rows: &mut Vec<String>,
                  escaped: &mut Vec<String>,
                  what: String,
                  model: &str,
                  checks: Vec<(&str, bool)>| {
        let caught: Vec<&str> = checks.iter().filter(|c| c.1).map(|c| c.0).collect();
        if caught.is_empty() {
            escaped.push(format!("{what} on {model}"));
        }
        rows.push(format!(
            "| {what} | {model} | {} |",
            if caught.is_empty() {
                "**nothing**".to_string()
            } else {
                caught.join(", ")
            }
        ));
    };

    // Every op's backward rule, 1% off.
    for (op, i) in backward_ops(&all) {
        let s = &all[i];
        let checks = graph_checks(s, &Mutant::Backward(op.clone()));
        record(
            &mut rows,
            &mut escaped,
            format!("`{op}`'s backward 1% large"),
            &s.name,
            checks,
        );
    }
    // The update, clipping and gradient routing.
    let adam = |c: &Compiled| matches!(c.model.train.optimizer, Optimizer::AdamW { .. });
    let decaying = |c: &Compiled| match c.model.train.optimizer {
        Optimizer::AdamW { weight_decay, .. } | Optimizer::Sgd { weight_decay, .. } => {
            weight_decay > 0.0
        }
    };
    let swappable = |c: &Compiled| {
        let p = &c.model.graph.params;
        (0..p.len()).any(|i| (i + 1..p.len()).any(|j| p[i].ty == p[j].ty))
    };
    let clipped = |c: &Compiled| c.model.train.clip_grad_norm.is_some();
    // Adam is blind to a gradient's scale but for eps: the loss scale left
    // in shows through SGD or clipping.
    let fp16 = |c: &Compiled| {
        c.model.train.precision == DType::F16
            && (c.model.train.clip_grad_norm.is_some() || !adam(c))
    };
    type Pick<'a> = &'a dyn Fn(&Compiled) -> bool;
    let cases: Vec<(Mutant, &str, Pick)> = vec![
        (
            Mutant::SwapGradients,
            "two same-shaped parameters' gradients swapped",
            &swappable,
        ),
        (
            Mutant::BiasCorrection,
            "Adam's bias correction a step ahead",
            &adam,
        ),
        (
            Mutant::DecaySet,
            "weight decay on the vectors instead of the matrices",
            &decaying,
        ),
        (Mutant::ClipScale, "the clip coefficient 1% large", &clipped),
        (
            Mutant::Unscale,
            "fp16: the loss scale left in the gradients",
            &fp16,
        ),
    ];
    for (m, what, pick) in cases {
        let s = first(&all, pick);
        let checks = graph_checks(s, &m);
        record(&mut rows, &mut escaped, what.to_string(), &s.name, checks);
    }

    // Kernels 1% wrong: each op's kernel, on the first subject that runs it.
    let cxx = host::have_cxx();
    if cxx {
        let work = host::work_dir("mutants");
        let mut kernel_ops: BTreeMap<String, usize> = BTreeMap::new();
        for (i, s) in all.iter().enumerate() {
            let c = s.compile_f32();
            let program = fuse(&c.optimized);
            for k in &program.kernels {
                for &n in &k.nodes {
                    kernel_ops
                        .entry(c.optimized.g[n].op.name().to_string())
                        .or_insert(i);
                }
            }
        }
        for (op, i) in kernel_ops {
            let s = &all[i];
            let c = s.compile_f32();
            let stem: String = format!("{}-{op}", s.name)
                .chars()
                .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '-' })
                .collect();
            // Unperturbed the step must match, or a catch would mean nothing.
            if let Err(e) = step_host::run_step(&work, &format!("{stem}-plain"), &c, &s.dims()) {
                panic!("{} in f32 fails without a perturbation: {e}", s.name);
            }
            let r = step_host::run_step_perturbed(&work, &stem, &c, &s.dims(), Some(&op));
            if matches!(r, Ok(ref out) if out.perturbed == 0) {
                // Its float outputs are all zero in this step (a
                // micro-batch accumulator the applying step clears): a
                // scale changes nothing, so there is nothing to catch.
                rows.push(format!(
                    "| the kernel computing `{op}` 1% large (f32) | {} | not exercised: its outputs are zero in a step that applies the update |",
                    s.name
                ));
                continue;
            }
            record(
                &mut rows,
                &mut escaped,
                format!("the kernel computing `{op}` 1% large (f32)"),
                &s.name,
                vec![("whole step on the host against the interpreter", r.is_err())],
            );
        }
        let _ = std::fs::remove_dir_all(&work);
    }

    let table = format!(
        "{START}\n| mutant | model | caught by |\n|---|---|---|\n{}\n{END}",
        rows.join("\n")
    );
    println!("{table}");
    assert!(
        escaped.is_empty(),
        "mutants no check caught:\n{}",
        escaped.join("\n")
    );
    if !cxx {
        // The table is the whole one; without the kernels' rows it is not
        // compared (have_cxx said why).
        return;
    }
    let path = common::root().join("docs/testing.md");
    let doc = std::fs::read_to_string(&path).unwrap_or_default();
    let current = doc
        .find(START)
        .and_then(|a| doc[a..].find(END).map(|b| &doc[a..a + b + END.len()]));
    if current != Some(table.as_str()) {
        if std::env::var_os("FUSEC_UPDATE_DOCS").is_some() {
            let updated = match current {
                Some(old) => doc.replace(old, &table),
                None => format!("{doc}\n{table}\n"),
            };
            std::fs::write(&path, updated).unwrap();
        } else {
            panic!("docs/testing.md's mutant table is out of date: run this test with FUSEC_UPDATE_DOCS=1 and commit the result");
        }
    }
}
