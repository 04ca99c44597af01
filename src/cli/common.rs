//! What check and build share: reading the model file, `--set`, compiling.

use super::CliError;
use clap::Args;
use fusec_compiler::driver::{self, Compiled};
use fusec_compiler::elaborate::Options;
use fusec_compiler::ir::DType;
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// The model file (.dsl)
    pub model: PathBuf,
    /// Replace a top-level constant, e.g. --set layers=2 (repeatable)
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub set: Vec<String>,
    /// Replace the train section's precision (fp32, bf16 or fp16), e.g. to
    /// compare a bf16 model's run with an fp32 one
    #[arg(long, value_name = "DTYPE", value_parser = parse_precision)]
    pub precision: Option<DType>,
    /// Do not run this graph pass, or leave out this optimisation of the
    /// kernel stages (`fusec passes` lists both), e.g. --disable-pass
    /// pad-dims to see what padding awkward sizes gains, or
    /// gemm-epilogues to bisect a wrong result (repeatable)
    #[arg(long = "disable-pass", value_name = "PASS")]
    pub disable_pass: Vec<String>,
}

/// `--reduce-dtype`: f32 or bf16.
pub fn parse_reduce_dtype(s: &str) -> Result<DType, String> {
    match s {
        "f32" | "fp32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        other => Err(format!(
            "`{other}` is not a type gradients are averaged in; expected f32 or bf16"
        )),
    }
}

fn parse_precision(s: &str) -> Result<DType, String> {
    match s {
        "fp32" | "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "fp16" | "f16" => Ok(DType::F16),
        other => Err(format!(
            "`{other}` is not a precision; expected fp32, bf16 or fp16"
        )),
    }
}

/// `--batch`, `--seq` and `--dim`: the sizes of a model's symbolic dimensions.
#[derive(Args, Debug, Clone)]
pub struct SizeArgs {
    /// Size of the batch dimension B
    #[arg(long, value_name = "N")]
    pub batch: Option<i64>,
    /// Size of the sequence dimension T
    #[arg(long, value_name = "N")]
    pub seq: Option<i64>,
    /// Size of any symbolic dimension, e.g. --dim B=8 (repeatable)
    #[arg(long = "dim", value_name = "NAME=N")]
    pub dims: Vec<String>,
}

impl SizeArgs {
    /// The sizes given, checked against the dimensions the model declares.
    pub fn resolve(
        &self,
        declared: &[String],
    ) -> Result<std::collections::BTreeMap<String, i64>, CliError> {
        dim_sizes(self.batch, self.seq, &self.dims, declared)
    }

    /// The sizes, which must cover every dimension the model declares.
    pub fn resolve_all(
        &self,
        declared: &[String],
    ) -> Result<std::collections::BTreeMap<String, i64>, CliError> {
        let dims = self.resolve(declared)?;
        let missing = missing(&dims, declared);
        if missing.is_empty() {
            Ok(dims)
        } else {
            Err(CliError::usage(format!(
                "error: give the size of {} (--batch for B, --seq for T, --dim NAME=N)",
                missing.join(", ")
            )))
        }
    }
}

/// The model checked at the sizes given: a slice that runs past its axis
/// at these sizes (BERT's `position_embeddings[0:T]` at `--seq 1024`, a
/// table of 512 rows) is an error at its place in the model file.
pub fn check_sizes(
    loaded: &Loaded,
    dims: &std::collections::BTreeMap<String, i64>,
) -> Result<(), CliError> {
    fusec_compiler::ir::sizes::check(&loaded.compiled.optimized, dims)
        .map_err(|d| CliError::usage(d.render(&loaded.path.display().to_string(), &loaded.source)))
}

pub struct Loaded {
    pub path: PathBuf,
    pub source: String,
    /// The step, and the options it was compiled with (what a rank's own
    /// step is compiled again from, `rank_steps`).
    pub compiled: Compiled,
    /// A memory budget the ZeRO ranks' own steps are fitted to where they
    /// are compiled (`parallel::start`), all with one choice.
    pub rank_budget: Option<RankBudget>,
}

/// What fits each ZeRO rank's step to a memory budget (`fit_memory`, for
/// `parallel::start`).
#[derive(Clone, Debug)]
pub struct RankBudget {
    pub bytes: u64,
    /// The GPU the plan is made for, and `--deterministic`.
    pub device: String,
    pub deterministic: bool,
}

impl RankBudget {
    /// Fits every rank's step (`graphs`, the job's ranks in order) to the
    /// budget with one choice (`recompute::fit_ranks`).
    pub fn fit(
        &self,
        graphs: &mut [fusec_compiler::ir::Graph],
        dims: &std::collections::BTreeMap<String, i64>,
        lower: &fusec_compiler::optimisation::LowerOptions,
    ) -> Result<Option<fusec_compiler::recompute::Choice>, CliError> {
        let target = fusec_compiler::select::Target {
            lower: lower.clone(),
            ..fusec_compiler::select::Target::for_device(&self.device, self.deterministic)
                .unwrap_or_else(fusec_compiler::select::Target::simple)
        };
        let roof = fusec_compiler::device::device(&self.device)
            .unwrap_or_else(fusec_compiler::device::default_device);
        fusec_compiler::recompute::fit_ranks(graphs, dims, self.bytes, &target, roof)
            .map_err(|e| CliError::usage(format!("error: {e}")))
    }
}

pub fn read_source(path: &Path) -> Result<String, CliError> {
    let bytes = std::fs::read(path).map_err(|e| {
        CliError::usage(format!(
            "error: cannot read model file {}: {e}",
            path.display()
        ))
    })?;
    String::from_utf8(bytes).map_err(|e| {
        CliError::model(format!(
            "error: {} is not UTF-8 text (invalid byte at offset {})\n",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

pub fn options(args: &ModelArgs) -> Result<Options, CliError> {
    let set = &args.set;
    let mut overrides = Vec::new();
    for s in set {
        let Some((k, v)) = s.split_once('=') else {
            return Err(CliError::usage(format!(
                "error: --set expects NAME=VALUE, found `{s}`"
            )));
        };
        overrides.push((k.trim().to_string(), v.trim().to_string()));
    }
    let mut opts = Options {
        overrides,
        precision: args.precision,
        ranks: 1,
        ..Options::default()
    };
    for name in &args.disable_pass {
        opts.disable(name);
    }
    Ok(opts)
}

pub fn load(args: &ModelArgs) -> Result<Loaded, CliError> {
    load_ranks(args, 1, None)
}

/// [`load`] for a step built for `ranks` data-parallel ranks, averaging
/// gradients in `reduce_dtype` (`--reduce-dtype`; `None`: f32).
pub fn load_ranks(
    args: &ModelArgs,
    ranks: u32,
    reduce_dtype: Option<DType>,
) -> Result<Loaded, CliError> {
    load_rank(args, ranks, None, reduce_dtype)
}

/// [`load_ranks`] for rank `zero_rank` of a ZeRO stage 1 job (the step
/// updates only the parameters that rank owns).
pub fn load_rank(
    args: &ModelArgs,
    ranks: u32,
    zero_rank: Option<u32>,
    reduce_dtype: Option<DType>,
) -> Result<Loaded, CliError> {
    let mut all = load_steps(args, ranks, &[zero_rank], reduce_dtype, None)?;
    Ok(all.remove(0))
}

/// The steps of several ZeRO ranks of one job (`None`: a step that updates
/// every parameter) from one compile of what they share (the front, the
/// forward passes, autodiff): each rank adds only its update and the
/// passes after it. `dump_after`: a graph pass whose result to keep
/// (`--dump-after`).
pub fn load_steps(
    args: &ModelArgs,
    ranks: u32,
    zero_ranks: &[Option<u32>],
    reduce_dtype: Option<DType>,
    dump_after: Option<&str>,
) -> Result<Vec<Loaded>, CliError> {
    let zero = super::parallel::Zero {
        stage: Default::default(),
        group: ranks,
    };
    load_staged(args, ranks, zero_ranks, zero, reduce_dtype, dump_after)
}

/// [`load_steps`] under ZeRO as `zero` says (where `zero_ranks` name
/// ranks: their places in their groups).
pub fn load_staged(
    args: &ModelArgs,
    ranks: u32,
    zero_ranks: &[Option<u32>],
    zero: super::parallel::Zero,
    reduce_dtype: Option<DType>,
    dump_after: Option<&str>,
) -> Result<Vec<Loaded>, CliError> {
    let source = read_source(&args.model)?;
    let opts = Options {
        ranks,
        zero_stage: zero.stage,
        shard_group: zero.group,
        reduce_dtype,
        dump_after: dump_after.map(str::to_string),
        ..options(args)?
    };
    let name = driver::model_name(&args.model);
    let steps = driver::compile_ranks(&source, &name, &opts, zero_ranks)
        .map_err(|f| compile_error(&f, &args.model, &source))?;
    Ok(steps
        .into_iter()
        .map(|compiled| Loaded {
            path: args.model.clone(),
            source: source.clone(),
            compiled,
            rank_budget: None,
        })
        .collect())
}

/// A compile's failure as the command line reports it: a usage error
/// (exit 2) or an error in the model file (exit 1), with its place.
pub fn compile_error(f: &driver::Failure, path: &Path, source: &str) -> CliError {
    let text = f.render(&path.display().to_string(), source);
    if f.is_usage() {
        CliError::usage(text)
    } else {
        CliError::model(text)
    }
}

/// The model as `loaded` was compiled (its options as they stand, with
/// `--bucket-mib`), rebuilt for ZeRO ranks `ranks` of a job of `world`
/// (one compile for all of them).
pub fn rank_steps(
    loaded: &Loaded,
    world: u32,
    zero: super::parallel::Zero,
    ranks: &[u32],
) -> Result<Vec<Loaded>, CliError> {
    let opts = Options {
        ranks: world,
        zero_stage: zero.stage,
        shard_group: zero.group,
        dump_after: None,
        ..loaded.compiled.options.clone()
    };
    let zero: Vec<Option<u32>> = ranks.iter().map(|&r| Some(r)).collect();
    let name = driver::model_name(&loaded.path);
    let steps = driver::compile_ranks(&loaded.source, &name, &opts, &zero)
        .map_err(|f| compile_error(&f, &loaded.path, &loaded.source))?;
    Ok(steps
        .into_iter()
        .map(|compiled| Loaded {
            path: loaded.path.clone(),
            source: loaded.source.clone(),
            compiled,
            rank_budget: None,
        })
        .collect())
}

/// `124439808` -> `124,439,808`
pub fn thousands(n: i64) -> String {
    let s = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// --batch, --seq and --dim as one map; B and T are the names the shipped
/// models use for batch and sequence.
pub fn dim_sizes(
    batch: Option<i64>,
    seq: Option<i64>,
    dim_args: &[String],
    declared: &[String],
) -> Result<std::collections::BTreeMap<String, i64>, CliError> {
    let mut dims = std::collections::BTreeMap::new();
    let mut set = |name: &str, v: i64, flag: &str| -> Result<(), CliError> {
        if v <= 0 {
            return Err(CliError::usage(format!(
                "error: {flag} must be a positive size, found {v}"
            )));
        }
        if !declared.iter().any(|d| d == name) {
            let list = if declared.is_empty() {
                "none".to_string()
            } else {
                declared.join(", ")
            };
            return Err(CliError::usage(format!(
                "error: {flag}: the model has no dimension `{name}`; its dimensions are: {list}"
            )));
        }
        dims.insert(name.to_string(), v);
        Ok(())
    };
    if let Some(b) = batch {
        set(fusec_compiler::ir::dim::BATCH, b, "--batch")?;
    }
    if let Some(t) = seq {
        set(fusec_compiler::ir::dim::SEQ, t, "--seq")?;
    }
    for d in dim_args {
        let parsed = d
            .split_once('=')
            .and_then(|(k, v)| Some((k.trim(), v.trim().parse::<i64>().ok()?)));
        let Some((k, v)) = parsed else {
            return Err(CliError::usage(format!(
                "error: --dim expects NAME=N, found `{d}`"
            )));
        };
        set(k, v, &format!("--dim {k}"))?;
    }
    Ok(dims)
}

/// The declared dimensions `dims` gives no size.
pub fn missing<'a>(
    dims: &std::collections::BTreeMap<String, i64>,
    declared: &'a [String],
) -> Vec<&'a str> {
    declared
        .iter()
        .filter(|d| !dims.contains_key(*d))
        .map(|s| s.as_str())
        .collect()
}

/// `--memory-budget`: recompute activations to fit the step in a size.
#[derive(Args, Debug, Clone, Default)]
pub struct BudgetArgs {
    /// Fit the step in this much device memory by recomputing activations
    /// in the backward pass (e.g. 12GiB, 9000MiB; a bare number is GiB);
    /// replaces the train section's `memory_budget`. The report says what
    /// is recomputed and what it costs
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    pub memory_budget: Option<u64>,
    /// Rows of logits the loss head computes at a time: `auto` chunks
    /// logits that would take over 512 MiB whole (GPT-2 at B = 8, T = 1024:
    /// two chunks of 4096 rows) so the whole B x T x V logits and their
    /// gradient are never stored; `all` computes them at once; a number
    /// caps a chunk's rows
    #[arg(long, value_name = "ROWS", default_value = "auto")]
    pub loss_head_rows: fusec_compiler::loss_head::Rows,
}

/// What the stages at the step's sizes did: the loss head's chunks and
/// what is recomputed.
#[derive(Default)]
pub struct Fitted {
    pub loss_head: Vec<fusec_compiler::loss_head::Chunked>,
    pub recompute: Option<fusec_compiler::recompute::Choice>,
}

impl Fitted {
    /// The report's paragraphs, `None` where the stages changed nothing.
    pub fn describe(
        &self,
        g: &fusec_compiler::ir::Graph,
        source: Option<(&str, &str)>,
    ) -> Option<String> {
        let mut s: String = self.loss_head.iter().map(|c| c.describe()).collect();
        if let Some(r) = &self.recompute {
            s.push_str(&r.describe(g, source));
        }
        (!s.is_empty()).then_some(s)
    }
}

fn parse_budget(s: &str) -> Result<u64, String> {
    fusec_compiler::recompute::parse_size(s)
}

/// The device table's row to plan a step for before its GPU is open: the
/// row of the GPU's name as its driver reports it (`gpu_name`), else the
/// default device's (no GPU, `--cpu`, or a GPU the table lacks).
pub fn planning_device(gpu_name: Option<&str>) -> &'static str {
    gpu_name
        .and_then(fusec_compiler::device::find_gpu)
        .map_or(fusec_compiler::device::DEFAULT, |d| d.name)
}

/// Applies the memory budget (`--memory-budget`, else the train
/// section's) to the step at sizes `dims`: the step graph is rewritten to
/// recompute what the choice drops. Without a budget, what is free to
/// recompute (`recompute::free_drops`) where the sizes are known; first,
/// the loss head in chunks of rows (`--loss-head-rows`). A step of several
/// ranks (`ranks` > 1) recomputes nothing without a budget; with one, the
/// step is fitted to it, or where each ZeRO rank compiles its own step
/// later (`per_rank`) every rank's is, with one choice
/// (`Loaded::rank_budget`, applied by `parallel::start`).
pub fn fit_memory(
    loaded: &mut Loaded,
    budget: &BudgetArgs,
    dims: &std::collections::BTreeMap<String, i64>,
    ranks: u32,
    per_rank: bool,
    device: &str,
    deterministic: bool,
) -> Result<Fitted, CliError> {
    use fusec_compiler::recompute;
    let rows = budget.loss_head_rows;
    loaded.compiled.options.loss_head_rows = rows;
    if let fusec_compiler::loss_head::Rows::At(n) = rows {
        let missing = missing(dims, &loaded.compiled.optimized.dims);
        if !missing.is_empty() {
            return Err(CliError::usage(format!(
                "error: --loss-head-rows {n}: the loss head is cut into chunks at the sizes the step runs at: give the size of {} (--batch, --seq or --dim NAME=N)",
                missing.join(", ")
            )));
        }
    }
    let missing = missing(dims, &loaded.compiled.optimized.dims);
    if ranks > 1 {
        let bytes = match (budget.memory_budget, loaded.compiled.model.train.memory_budget) {
            (Some(b), _) if !missing.is_empty() => {
                return Err(CliError::usage(format!(
                    "error: --memory-budget {}: a budget is met at the sizes the step runs at: give the size of {} (--batch, --seq or --dim NAME=N)",
                    fusec_compiler::recompute::size(b),
                    missing.join(", ")
                )))
            }
            _ if !missing.is_empty() => None,
            (flag, file) => flag.or(file),
        };
        // Each rank's step (`parallel::start` chunks the ZeRO ranks' own).
        let loss_head = chunk_loss_head(&mut loaded.compiled.optimized, dims, rows)?;
        let recompute = match bytes {
            Some(bytes) if per_rank => {
                loaded.rank_budget = Some(RankBudget {
                    bytes,
                    device: device.to_string(),
                    deterministic,
                });
                None
            }
            Some(bytes) => RankBudget {
                bytes,
                device: device.to_string(),
                deterministic,
            }
            .fit(
                std::slice::from_mut(&mut loaded.compiled.optimized),
                dims,
                &loaded.compiled.options.lower,
            )?,
            None => None,
        };
        return Ok(Fitted {
            loss_head,
            recompute,
        });
    }
    let target = fusec_compiler::select::Target {
        lower: loaded.compiled.options.lower.clone(),
        ..fusec_compiler::select::Target::for_device(device, deterministic)
            .unwrap_or_else(fusec_compiler::select::Target::simple)
    };
    let roof = fusec_compiler::device::device(device)
        .unwrap_or_else(fusec_compiler::device::default_device);
    let budget = match (budget.memory_budget, loaded.compiled.model.train.memory_budget) {
        (Some(b), _) if !missing.is_empty() => {
            return Err(CliError::usage(format!(
                "error: --memory-budget {}: a budget is met at the sizes the step runs at: give the size of {} (--batch, --seq or --dim NAME=N)",
                recompute::size(b),
                missing.join(", ")
            )))
        }
        // The file's budget, or none, waits for a build with sizes.
        _ if !missing.is_empty() => return Ok(Fitted::default()),
        (flag, file) => flag.or(file),
    };
    let loss_head = chunk_loss_head(&mut loaded.compiled.optimized, dims, rows)?;
    // What is free first; a budget then takes what it needs on top.
    let free = recompute::free_drops(&mut loaded.compiled.optimized, dims, &target, roof)
        .map_err(|e| CliError::usage(format!("error: {e}")))?;
    let Some(bytes) = budget else {
        return Ok(Fitted {
            loss_head,
            recompute: free,
        });
    };
    let chosen = recompute::fit_budget(&mut loaded.compiled.optimized, dims, bytes, &target, roof)
        .map_err(|e| {
            CliError::usage(format!(
                "error: {e}\n  (model {}, sizes {})",
                loaded.path.display(),
                dims.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
    Ok(Fitted {
        loss_head,
        recompute: match (free, chosen) {
            (Some(f), Some(c)) => Some(f.then(c)),
            (f, c) => c.or(f),
        },
    })
}

/// The loss head of step `g` in chunks of `rows` (`loss_head::chunk`) at
/// sizes `dims` (nothing where a size is not known); where rows were
/// asked for and a head stays whole, a note says why.
pub fn chunk_loss_head(
    g: &mut fusec_compiler::ir::Graph,
    dims: &std::collections::BTreeMap<String, i64>,
    rows: fusec_compiler::loss_head::Rows,
) -> Result<Vec<fusec_compiler::loss_head::Chunked>, CliError> {
    if !missing(dims, &g.dims).is_empty() {
        return Ok(Vec::new());
    }
    let (done, left) = fusec_compiler::loss_head::chunk(g, dims, rows)
        .map_err(|e| CliError::usage(format!("error: {e}")))?;
    for why in left {
        eprintln!("note: --loss-head-rows: the loss head stays whole: {why}");
    }
    Ok(done)
}

/// Says on standard error what the stages at the step's sizes did (the
/// loss head's chunks, what is recomputed).
pub fn announce_fitted(fitted: Fitted, loaded: &Loaded) {
    let file = loaded.path.display().to_string();
    if let Some(text) = fitted.describe(&loaded.compiled.optimized, Some((&file, &loaded.source))) {
        eprint!("{text}");
    }
}

/// Whether the model has an input `name`.
pub(super) fn is_input(g: &fusec_compiler::ir::Graph, name: &str) -> bool {
    input_type(g, name).is_some()
}

/// The declared type of the input `name`.
pub(super) fn input_type<'g>(
    g: &'g fusec_compiler::ir::Graph,
    name: &str,
) -> Option<&'g fusec_compiler::ir::TensorType> {
    g.g.node_indices().find_map(|n| match &g.g[n].op {
        fusec_compiler::ops::Op::Input(i) if i.name == name => Some(&i.ty),
        _ => None,
    })
}

/// A number for a JSON line: `null` where it is not finite.
pub(super) fn json_num(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".into()
    }
}

#[cfg(test)]
mod tests {
    use super::planning_device;

    /// A budget is fitted for the GPU the run opens, not always an H100.
    #[test]
    fn steps_are_planned_for_the_gpu_found() {
        assert_eq!(planning_device(Some("NVIDIA A100-SXM4-80GB")), "a100");
        assert_eq!(planning_device(Some("NVIDIA GeForce RTX 3090")), "rtx3090");
        assert_eq!(planning_device(Some("NVIDIA H200")), "h200");
        // No GPU, or one the table lacks: the default.
        assert_eq!(planning_device(None), fusec_compiler::device::DEFAULT);
        assert_eq!(
            planning_device(Some("Tesla V100-SXM2-16GB")),
            fusec_compiler::device::DEFAULT
        );
    }
}
