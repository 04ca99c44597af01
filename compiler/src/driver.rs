//! The front half as one call: source text to a checked model and its
//! training graph, with every stage's result kept for `--dump`.

use crate::autodiff;
use crate::diag::Errors;
use crate::dsl::{self, ast::Module};
use crate::elaborate::{self, Options};
use crate::ir::verify::verify;
use crate::ir::{DType, Graph};
use crate::model::Model;
use crate::optimisation::Optimisation;
use crate::passes::{default_pipeline, forward_pipeline, run_pipeline, PassStats};

/// A stage whose result `fusec build --dump STAGE` prints (and `fusec
/// build` writes, as STAGE.txt, all but the syntax tree).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Ast,
    Forward,
    Backward,
    Train,
    Optimized,
    Layout,
    Kernels,
}

impl Stage {
    /// Every stage, in the order the compile makes them.
    pub const ALL: &'static [Stage] = &[
        Stage::Ast,
        Stage::Forward,
        Stage::Backward,
        Stage::Train,
        Stage::Optimized,
        Stage::Layout,
        Stage::Kernels,
    ];

    /// Its name on the command line and its file's stem.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Ast => "ast",
            Stage::Forward => "forward",
            Stage::Backward => "backward",
            Stage::Train => "train",
            Stage::Optimized => "optimized",
            Stage::Layout => "layout",
            Stage::Kernels => "kernels",
        }
    }

    /// What its result holds.
    pub fn about(self) -> &'static str {
        match self {
            Stage::Ast => "the syntax tree, as parsed",
            Stage::Forward => "the forward graph, after elaboration",
            Stage::Backward => "forward and backward: the loss and every parameter's gradient",
            Stage::Train => "the whole step: forward, backward, clipping and the optimizer update",
            Stage::Optimized => "the whole step after every pass (see --dump-after)",
            Stage::Layout => "where every value lives: stored row-major, a strided view read in place, or registers",
            Stage::Kernels => "the kernels in launch order, with what each reads (through which view) and writes",
        }
    }

    /// Whether its result is a graph (which prints as Graphviz dot too).
    pub fn is_graph(self) -> bool {
        !matches!(self, Stage::Ast | Stage::Layout | Stage::Kernels)
    }

    /// The stage of that name, if there is one.
    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.iter().copied().find(|s| s.name() == name)
    }
}

pub struct Compiled {
    pub ast: Module,
    pub model: Model,
    /// The step as autodiff and the update built it.
    pub training: Graph,
    /// The step after the pass pipeline.
    pub optimized: Graph,
    pub pass_stats: Vec<(&'static str, PassStats)>,
    /// What it was compiled with: among them the graph passes left out
    /// and the kernel stages' options (`options.lower`, which a target
    /// lowers the step with: `Target::lower`).
    pub options: Options,
    /// The graph as the pass `Options::dump_after` left it, where one was
    /// named and ran (`fusec build --dump-after PASS`).
    pub dumped: Option<Graph>,
}

/// Why a compile failed.
#[derive(Debug)]
pub enum Failure {
    /// The model file is wrong; render against its text.
    Model(Errors),
    /// The options are wrong (e.g. `--set` of a constant the model lacks).
    Usage(String),
}

impl Failure {
    pub fn render(&self, file_name: &str, source: &str) -> String {
        match self {
            Failure::Model(errors) => errors.render(file_name, source),
            Failure::Usage(m) => format!("error: {m}\n"),
        }
    }
    pub fn is_usage(&self) -> bool {
        matches!(self, Failure::Usage(_))
    }
}

/// `--set` may only name top-level constants; checked on the syntax tree so
/// the message can list the ones there are.
fn check_overrides(ast: &Module, opts: &Options) -> Result<(), Failure> {
    let consts: Vec<&str> = ast
        .items
        .iter()
        .filter_map(|i| match i {
            crate::dsl::ast::Item::Const { name, .. } => Some(name.name.as_str()),
            _ => None,
        })
        .collect();
    for (name, value) in &opts.overrides {
        if !consts.contains(&name.as_str()) {
            let list = if consts.is_empty() {
                "it has none".to_string()
            } else {
                format!("they are: {}", consts.join(", "))
            };
            return Err(Failure::Usage(format!(
                "--set {name}={value}: the model has no top-level constant `{name}`; {list}"
            )));
        }
    }
    // Optimisations arrive typed (`Options::disable` sorts them out); a
    // name here must be a graph pass, and the message lists both kinds.
    let passes = crate::passes::pass_names();
    let mut names = passes.clone();
    names.extend(Optimisation::ALL.iter().map(|o| o.name()));
    for d in &opts.disabled_passes {
        if !passes.contains(&d.as_str()) {
            return Err(Failure::Usage(format!(
                "--disable-pass {d}: there is no pass or optimisation `{d}`; they are: {}",
                names.join(", ")
            )));
        }
    }
    Ok(())
}

/// The error for `--reduce-dtype bf16` on one rank (the CLI gives it too,
/// for commands that never build a step for several ranks).
pub const REDUCE_NEEDS_RANKS: &str = "--reduce-dtype bf16 sets how data parallelism averages gradients: give --gpus N (N >= 2) or start the ranks with a launcher";

/// The type `--reduce-dtype` asks gradients to be averaged in, checked
/// against the step: bf16 only for a bf16 model on several ranks.
fn reduce_dtype(opts: &Options, train: &crate::model::TrainConfig) -> Result<DType, Failure> {
    match opts.reduce_dtype {
        None | Some(DType::F32) => Ok(DType::F32),
        Some(DType::BF16) if train.ranks < 2 => Err(Failure::Usage(REDUCE_NEEDS_RANKS.into())),
        Some(DType::BF16) if train.precision == DType::BF16 => Ok(DType::BF16),
        Some(DType::BF16) => Err(Failure::Usage(format!(
            "--reduce-dtype bf16 averages the gradients of a bf16 model in bf16; this model trains in {} (set `precision = bf16` in its train section or pass --precision bf16)",
            train.precision
        ))),
        Some(other) => Err(Failure::Usage(format!(
            "--reduce-dtype {other}: gradients are averaged in f32 or bf16"
        ))),
    }
}

/// The model as elaboration made it, before any pass: what the file says, op
/// for op (`fusec export-torch` writes its twin from this).
pub fn elaborate_only(source: &str, model_name: &str, opts: &Options) -> Result<Model, Failure> {
    Ok(front(source, model_name, opts)?.1)
}

/// Parse, check `--set` and elaborate: the syntax tree and the verified model.
fn front(source: &str, model_name: &str, opts: &Options) -> Result<(Module, Model), Failure> {
    let ast = dsl::parse(source).map_err(Failure::Model)?;
    check_overrides(&ast, opts)?;
    let model = elaborate::elaborate(&ast, model_name, opts).map_err(Failure::Model)?;
    check_verified(&model.graph, "elaboration")?;
    Ok((ast, model))
}

/// Parse, elaborate, the passes on the forward graph, autodiff, the update
/// and the passes on the step, each result verified.
pub fn compile(source: &str, model_name: &str, opts: &Options) -> Result<Compiled, Failure> {
    let mut all = compile_ranks(source, model_name, opts, &[opts.zero_rank])?;
    Ok(all.remove(0))
}

/// The steps of several ZeRO ranks (`zero_ranks`, each `None` for a step
/// that updates every parameter) from one compile of what they share: the
/// file is parsed and elaborated, the forward passes and autodiff run once,
/// and each rank then gets its own update and the passes after it. The
/// graph after the pass `Options::dump_after` names is kept as it passes
/// (`Compiled::dumped`), not made again.
pub fn compile_ranks(
    source: &str,
    model_name: &str,
    opts: &Options,
    zero_ranks: &[Option<u32>],
) -> Result<Vec<Compiled>, Failure> {
    let (ast, mut model) = front(source, model_name, opts)?;
    let wanted = opts.dump_after.as_deref();
    let mut shared_dump = None;
    model.train.reduce_dtype = reduce_dtype(opts, &model.train)?;
    let internal = |e: crate::passes::PassError| {
        Failure::Model(
            crate::diag::Diagnostic::new(e.to_string(), crate::dsl::ast::Span::default(), "")
                .with_help("this is a bug in fusec; please report it with the model file")
                .into(),
        )
    };
    let enabled = |passes: Vec<Box<dyn crate::passes::Pass>>| -> Vec<Box<dyn crate::passes::Pass>> {
        passes
            .into_iter()
            .filter(|p| !opts.disabled_passes.iter().any(|d| d == p.name()))
            .collect()
    };
    let forward_stats = run_pipeline(
        &mut model.graph,
        &enabled(forward_pipeline()),
        keep(wanted, &mut shared_dump),
    )
    .map_err(internal)?;
    let backward = autodiff::add_backward(&model).map_err(Failure::Model)?;
    check_verified(&backward, "autodiff")?;
    let mut out = Vec::with_capacity(zero_ranks.len());
    for &zero_rank in zero_ranks {
        let mut model = model.clone();
        model.train.zero_rank = zero_rank.filter(|_| model.train.ranks > 1);
        model.train.zero_stage = opts.zero_stage;
        let mut training = backward.clone();
        if let Some(r) = model.train.zero_rank {
            let group = model.train.shard_group;
            if group < 2 || !model.train.ranks.is_multiple_of(group) || r >= group {
                return Err(Failure::Usage(format!(
                    "ZeRO cannot split over groups of {group} of {} ranks (rank {r}): a group holds at least 2 ranks, the groups are of one size, and a rank's place is below it",
                    model.train.ranks
                )));
            }
            if let Some(why) = autodiff::zero::unsplittable(&training.params, group) {
                return Err(Failure::Usage(format!(
                    "--zero {} cannot split this model over {group} ranks: {why}; train it with --zero 0, or on fewer GPUs",
                    opts.zero_stage.number(),
                )));
            }
        }
        autodiff::add_update(&mut training, &model.train).map_err(|e| {
            Failure::Model(
                crate::diag::Diagnostic::new(
                    format!("internal error building the update: {e}"),
                    model.train.loss_span,
                    "",
                )
                .into(),
            )
        })?;
        check_verified(&training, "the optimizer update")?;
        let mut optimized = training.clone();
        let mut pass_stats = forward_stats.clone();
        let mut dumped = shared_dump.clone();
        pass_stats.extend(
            run_pipeline(
                &mut optimized,
                &enabled(default_pipeline()),
                keep(wanted, &mut dumped),
            )
            .map_err(internal)?,
        );
        out.push(Compiled {
            ast: ast.clone(),
            model,
            training,
            optimized,
            pass_stats,
            options: Options {
                zero_rank,
                ..opts.clone()
            },
            dumped,
        });
    }
    Ok(out)
}

/// A pipeline's hook that keeps the graph after the pass named `wanted`.
fn keep<'a>(
    wanted: Option<&'a str>,
    dumped: &'a mut Option<Graph>,
) -> impl FnMut(&str, &Graph) + 'a {
    move |pass, g| {
        if wanted == Some(pass) {
            *dumped = Some(g.clone());
        }
    }
}

/// The forward pass alone, from the inputs to the loss, after the same
/// passes as the training step: what a validation loss runs (no
/// gradients, no optimizer state, no dropout; its parameters are the
/// step's).
pub fn forward_graph(c: &Compiled) -> Result<Graph, String> {
    let mut g = c.model.graph.clone();
    crate::passes::remove_dropout(&mut g);
    run_pipeline(&mut g, &default_pipeline(), |_, _| {}).map_err(|e| e.to_string())?;
    Ok(g)
}

/// The forward pass from the inputs to the logits the loss reads (the
/// first input of the one `cross_entropy` the loss is computed from),
/// output as `Role::Logits`, after the training step's passes but
/// `pad-dims` (whose padded classes only a cross-entropy knows to leave
/// out): what generation samples the next token from. No dropout.
pub fn logits_graph(c: &Compiled) -> Result<Graph, String> {
    use crate::ir::graph::Role;
    let (mut g, ce) = loss_cross_entropy(c)?;
    let logits = g.inputs(ce)[0];
    g.outputs = vec![(Role::Logits, logits)];
    forward_passes(&mut g)?;
    Ok(g)
}

/// The forward pass to each position's cross-entropy of its target, [B,
/// T], output as `Role::TokenLosses`: the loss's one cross-entropy over the
/// same logits and targets, without its smoothing or ignored targets (the
/// log-probability of each target, negated) and not averaged. What a
/// multiple-choice scorer sums over a completion's tokens. No dropout.
pub fn token_losses_graph(c: &Compiled) -> Result<Graph, String> {
    use crate::ir::graph::{Phase, Role};
    use crate::ops::{CeRule, CrossEntropy, Op};
    let (mut g, ce) = loss_cross_entropy(c)?;
    let Op::CrossEntropy(x) = &g.g[ce].op else {
        unreachable!("loss_cross_entropy returns a cross-entropy")
    };
    let plain = CrossEntropy {
        classes: x.classes,
        rule: CeRule::default(),
    };
    let ins = g.inputs(ce);
    let span = g.g[ce].span;
    let losses = g
        .add(plain.into(), &[ins[0], ins[1]], span, Phase::Forward)
        .map_err(|e| e.to_string())?[0];
    g.outputs = vec![(Role::TokenLosses, losses)];
    forward_passes(&mut g)?;
    Ok(g)
}

/// The model graph and the one cross-entropy its loss is computed from.
fn loss_cross_entropy(c: &Compiled) -> Result<(Graph, petgraph::stable_graph::NodeIndex), String> {
    use crate::ir::graph::Role;
    let g = c.model.graph.clone();
    let loss = g
        .outputs
        .iter()
        .find(|(r, _)| *r == Role::Loss)
        .map(|&(_, v)| v.node)
        .ok_or("the model has no loss")?;
    // The cross-entropies the loss is computed from.
    let mut seen = std::collections::HashSet::from([loss]);
    let mut stack = vec![loss];
    let mut entropies = Vec::new();
    while let Some(n) = stack.pop() {
        if matches!(g.g[n].op, crate::ops::Op::CrossEntropy(_)) {
            entropies.push(n);
            continue;
        }
        for v in g.inputs(n) {
            if seen.insert(v.node) {
                stack.push(v.node);
            }
        }
    }
    let [ce] = entropies[..] else {
        return Err(format!(
            "the loss is computed from {} cross-entropies, and generation and scoring read the logits of exactly one",
            entropies.len()
        ));
    };
    Ok((g, ce))
}

/// The training step's passes but `pad-dims`, after removing dropout.
fn forward_passes(g: &mut Graph) -> Result<(), String> {
    crate::passes::remove_dropout(g);
    let passes: Vec<_> = default_pipeline()
        .into_iter()
        .filter(|p| p.name() != "pad-dims")
        .collect();
    run_pipeline(g, &passes, |_, _| {}).map_err(|e| e.to_string())?;
    Ok(())
}

/// The verifier guards the compiler's own invariants: a failure is a bug in
/// fusec, never in the model file, and is reported as such.
fn check_verified(g: &Graph, after: &str) -> Result<(), Failure> {
    verify(g).map_err(|problems| {
        Failure::Model(
            crate::diag::Diagnostic::new(
                format!("internal error: the graph is invalid after {after}"),
                crate::dsl::ast::Span::default(),
                "",
            )
            .with_help(problems.join("\n"))
            .with_help("this is a bug in fusec; please report it with the model file")
            .into(),
        )
    })
}

/// Derives a model name from a file path: `dsl-examples/gpt2-small.dsl` -> `gpt2-small`.
pub fn model_name(path: &std::path::Path) -> String {
    path.file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned())
}

/// Every generated CUDA C kernel of a model file, as (kernel name, source),
/// in launch order: what `fusec build` writes to `kernels/`. The text depends
/// only on the model file and the options, so it can be held in snapshots.
pub fn generated_kernels(
    source: &str,
    model_name: &str,
    opts: &Options,
) -> Result<Vec<(String, String)>, Failure> {
    let c = compile(source, model_name, opts)?;
    let program = crate::kernel::fuse::fuse_with(&c.optimized, &c.options.lower);
    Ok(crate::emit::cuda::emit_program(
        &c.optimized,
        &program,
        Some(source),
    ))
}
