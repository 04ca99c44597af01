//! `fusec build`: compile a model and write every stage to a folder.

use super::common::{fit_memory, load_staged, load_steps, BudgetArgs, ModelArgs, SizeArgs};
use super::CliError;
use clap::{Args, ValueEnum};
use fusec_compiler::driver::{Compiled, Stage};
use fusec_compiler::emit::{HEADERS, PRELUDE, PRELUDE_NAME};
use fusec_compiler::ir::{dot::to_dot, print::print_graph};
use fusec_compiler::kernel::fuse::fuse_with;
use fusec_compiler::lowering::select_kernels;
use fusec_compiler::plan::plan_with;
use fusec_compiler::select::Target;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    Text,
    Dot,
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Folder for the results (created if missing)
    #[arg(short, long, value_name = "DIR", default_value = "out")]
    pub out: PathBuf,
    /// Print one stage to standard output: ast, forward, backward, train,
    /// optimized, layout or kernels
    #[arg(long, value_name = "STAGE", value_parser = stage_names())]
    pub dump: Option<Stage>,
    /// Print the step graph after one pass (`fusec passes` lists them)
    #[arg(long, value_name = "PASS", value_parser = pass_names(), conflicts_with = "dump")]
    pub dump_after: Option<String>,
    /// Sizes, for the memory plan
    #[command(flatten)]
    pub sizes: SizeArgs,
    #[command(flatten)]
    pub budget: BudgetArgs,
    /// Data parallelism: the flags `fusec train` takes (ZeRO's split: the
    /// plan and report of rank --rank)
    #[command(flatten)]
    pub parallel: super::parallel::ParallelArgs,
    /// The rank whose plan a ZeRO build writes
    #[arg(long, value_name = "R", default_value_t = 0, requires = "gpus")]
    pub rank: u32,
    /// Device to build for: which kernels run (h100 and h200: sm_90a, with
    /// the Hopper tensor-core attention; a100: sm_80, mma.sync; rtx3090:
    /// sm_86, rtx4090 and l40s: sm_89, mma.sync in 99 KiB of shared memory a
    /// block) and the report's roofline estimate
    #[arg(long, value_name = "NAME", default_value = fusec_compiler::device::DEFAULT, value_parser = device_names())]
    pub device: String,
    /// The attention backward without atomics (as `fusec train
    /// --deterministic` runs it)
    #[arg(long)]
    pub deterministic: bool,
    /// f32 products as `fusec train --tf32` or `--exact-f32` run them
    #[command(flatten)]
    pub f32: super::f32_math::F32Args,
    /// Format of --dump and --dump-after: readable text or Graphviz dot
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
    /// Build the decode step `fusec generate` runs (greedy) instead of the
    /// training step: --batch rows (default 1) of --seq new positions
    /// (default 1) against caches of --dim KV=N positions (default 256);
    /// writes its kernels, plan.json and report.txt
    #[arg(long, conflicts_with_all = ["dump", "dump_after", "gpus"])]
    pub decode: bool,
}

/// The device table's names, each with what it is (`--help` lists them,
/// and a name not among them is refused with the list).
fn device_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        fusec_compiler::device::DEVICES
            .iter()
            .map(|d| clap::builder::PossibleValue::new(d.name).help(d.about)),
    )
}

/// The stages `--dump` prints, each with what it holds (`--help` lists
/// them; another name is refused with the list).
fn stage_names() -> impl clap::builder::TypedValueParser<Value = Stage> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(
        Stage::ALL
            .iter()
            .map(|s| clap::builder::PossibleValue::new(s.name()).help(s.about())),
    )
    .try_map(|name: String| Stage::from_name(&name).ok_or("not a stage"))
}

/// The passes `--dump-after` prints the graph after: the graph passes,
/// the recompute choice and the kernel stages, in the order they run.
fn pass_names() -> clap::builder::PossibleValuesParser {
    let mut names = fusec_compiler::passes::pass_names();
    names.push("recompute");
    names.extend(fusec_compiler::kernel::STAGES.iter().map(|(n, _)| *n));
    clap::builder::PossibleValuesParser::new(names)
}

fn graph_text(g: &fusec_compiler::ir::Graph, source: &str, format: Format) -> String {
    match format {
        Format::Text => print_graph(g, Some(source)),
        Format::Dot => to_dot(g),
    }
}

pub fn stage_text(c: &Compiled, stage: Stage, source: &str, format: Format) -> String {
    let graph = match stage {
        Stage::Ast => return format!("{:#?}\n", c.ast),
        Stage::Forward => &c.model.graph,
        Stage::Backward => {
            // The training graph without its update phase.
            let mut g = c.training.clone();
            g.g.retain_nodes(|gr, n| gr[n].phase != fusec_compiler::ir::Phase::Update);
            g.outputs.retain(|(_, v)| g.g.contains_node(v.node));
            return graph_text(&g, source, format);
        }
        Stage::Train => &c.training,
        Stage::Optimized => &c.optimized,
        Stage::Layout => {
            let program = fuse_with(&c.optimized, &c.options.lower);
            return fusec_compiler::kernel::print::print_layouts(&c.optimized, &program);
        }
        Stage::Kernels => {
            let program = fuse_with(&c.optimized, &c.options.lower);
            return fusec_compiler::kernel::print::print_program(&c.optimized, &program);
        }
    };
    graph_text(graph, source, format)
}

/// `sources` as `DIR/<name>.cu`, beside the prelude and every header
/// they include: each compiles on its own (nvcc -I DIR). Stale kernels
/// of an earlier build would mislead, so the folder starts afresh.
pub(super) fn write_kernels(dir: &Path, sources: &[(String, String)]) -> Result<(), CliError> {
    let _ = std::fs::remove_dir_all(dir);
    let mkdir = |d: &Path| {
        std::fs::create_dir_all(d)
            .map_err(|e| CliError::usage(format!("error: cannot create {}: {e}", d.display())))
    };
    mkdir(dir)?;
    write(&dir.join(PRELUDE_NAME), PRELUDE)?;
    for (path, text) in HEADERS {
        let p = dir.join(path);
        if let Some(parent) = p.parent() {
            mkdir(parent)?;
        }
        write(&p, text)?;
    }
    for (name, text) in sources {
        write(&dir.join(format!("{name}.cu")), text)?;
    }
    Ok(())
}

/// The report's summary: everything before its table of kernels.
pub(super) fn report_head(text: &str) -> String {
    let head: Vec<&str> = text
        .lines()
        .take_while(|l| !l.starts_with("kernels in launch order"))
        .collect();
    head.join("\n").trim_end().to_string()
}

pub(super) fn write(path: &Path, text: &str) -> Result<(), CliError> {
    std::fs::write(path, text)
        .map_err(|e| CliError::usage(format!("error: cannot write {}: {e}", path.display())))
}

/// The target `--device`, `--deterministic`, `--tf32` and `--exact-f32` name.
fn target(args: &BuildArgs, c: &Compiled) -> Target {
    Target {
        f32_math: args.f32.math(),
        lower: c.options.lower.clone(),
        ..Target::for_device(&args.device, args.deterministic).expect("checked by clap")
    }
}

/// `--dump-after layout|fuse|select|plan`: the stages on kernels.
fn kernel_stage(c: &Compiled, stage: &str, args: &BuildArgs) -> Result<Option<String>, CliError> {
    use fusec_compiler::kernel::print::{print_layouts, print_program};
    if !matches!(stage, "layout" | "fuse" | "select" | "plan") {
        return Ok(None);
    }
    if matches!(args.format, Format::Dot) {
        return Err(CliError::usage(format!(
            "error: --dump-after {stage} has no Graphviz form; use it without --format dot"
        )));
    }
    // Each stage verifies its own result (fusion, selection, the plan).
    let g = &c.optimized;
    // Chosen at the step's sizes where every one is given, as a run is.
    let dims = args.sizes.resolve(&g.dims)?;
    let sized = super::common::missing(&dims, &g.dims).is_empty();
    let (program, selection) = select_kernels(g, &target(args, c), None, sized.then_some(&dims));
    Ok(Some(match stage {
        "layout" => print_layouts(g, &program),
        "fuse" => print_program(g, &program),
        "select" => selection.print(g, &program),
        _ => {
            let plan = plan_with(g, &program, Some(&selection), &dims).map_err(|e| {
                CliError::usage(format!(
                    "error: {e} (give sizes with --batch, --seq or --dim)"
                ))
            })?;
            plan.to_json()
        }
    }))
}

/// The step `--gpus` and `--rank` ask for: rank `--rank`'s own under ZeRO
/// (the default over several ranks, where the model splits), else the
/// step every rank runs. Where ZeRO may apply, both come from one compile
/// (the rank's is kept where `zero_on` says so); a model too small to split
/// is compiled again without it.
fn load_for_rank(args: &BuildArgs, ranks: u32) -> Result<super::common::Loaded, CliError> {
    let par = &args.parallel;
    let dump = args.dump_after.as_deref();
    let plain =
        || load_steps(&args.model, ranks, &[None], par.reduce_dtype, dump).map(|mut v| v.remove(0));
    if ranks < 2 || par.zero == Some(0) {
        return plain();
    }
    // One process's ranks are one host's.
    let group = super::parallel::shard_group(par, &super::parallel::Job::Local(ranks as usize))?;
    let zero = super::parallel::Zero {
        stage: par.asked_stage(),
        group,
    };
    match load_staged(
        &args.model,
        ranks,
        &[None, Some(args.rank % group)],
        zero,
        par.reduce_dtype,
        dump,
    ) {
        Ok(mut both) => {
            let own = both.pop().expect("two steps");
            let plain = both.pop().expect("two steps");
            Ok(
                match par.zero_stage(ranks as usize, group, &plain.compiled.optimized.params) {
                    Some(_) => own,
                    None => plain,
                },
            )
        }
        // `--zero 1` or `2` on a model it cannot split says why; by default
        // such a model runs unsplit.
        Err(e) if par.zero.is_some() => Err(e),
        Err(_) => plain(),
    }
}

pub fn run(args: &BuildArgs) -> Result<(), CliError> {
    if let Some(stage) = args.dump.filter(|s| !s.is_graph()) {
        if matches!(args.format, Format::Dot) {
            return Err(CliError::usage(format!(
                "error: --dump {} has no Graphviz form; use it without --format dot",
                stage.name()
            )));
        }
    }
    let par = &args.parallel;
    let ranks = par.gpus.unwrap_or(1);
    par.check_ranks(ranks, false)?;
    if args.rank >= ranks {
        return Err(CliError::usage(format!(
            "error: --rank {} is not one of the --gpus {ranks} ranks (0 to {})",
            args.rank,
            ranks - 1
        )));
    }
    // ZeRO by default over several ranks, where the model splits: then the
    // step is rank --rank's own.
    let mut loaded = load_for_rank(args, ranks)?;
    if args.decode {
        let t = target(args, &loaded.compiled);
        return super::build_decode::run(args, &loaded, t);
    }
    par.shape_buckets(&mut loaded.compiled.options.lower);
    let dims = args.sizes.resolve(&loaded.compiled.optimized.dims)?;
    let recomputed = fit_memory(
        &mut loaded,
        &args.budget,
        &dims,
        ranks,
        false,
        &args.device,
        args.deterministic,
    )?;
    let loaded = loaded;
    let c = &loaded.compiled;
    if args.dump_after.as_deref() == Some("recompute") {
        let missing = super::common::missing(&dims, &c.optimized.dims);
        if !missing.is_empty() {
            return Err(CliError::usage(format!(
                "error: --dump-after recompute: the stage runs at the step's sizes; give the size of {} (--batch, --seq or --dim NAME=N)",
                missing.join(", ")
            )));
        }
        print!("{}", graph_text(&c.optimized, &loaded.source, args.format));
        return Ok(());
    }
    if let Some(stage) = args.dump_after.as_deref() {
        if let Some(text) = kernel_stage(c, stage, args)? {
            print!("{text}");
            return Ok(());
        }
    }
    if let Some(pass) = &args.dump_after {
        if c.options.disabled_passes.contains(pass) {
            return Err(CliError::usage(format!(
                "error: --dump-after {pass}: that pass is left out by --disable-pass {pass}"
            )));
        }
        let g = c
            .dumped
            .as_ref()
            .ok_or_else(|| CliError::usage(format!("error: unknown pass `{pass}`")))?;
        print!("{}", graph_text(g, &loaded.source, args.format));
        return Ok(());
    }
    if let Some(stage) = args.dump {
        print!("{}", stage_text(c, stage, &loaded.source, args.format));
        return Ok(());
    }
    std::fs::create_dir_all(&args.out).map_err(|e| {
        CliError::usage(format!(
            "error: cannot create output folder {}: {e}",
            args.out.display()
        ))
    })?;
    let mut written = Vec::new();
    for &stage in Stage::ALL.iter().filter(|&&s| s != Stage::Ast) {
        let p = args.out.join(format!("{}.txt", stage.name()));
        write(&p, &stage_text(c, stage, &loaded.source, Format::Text))?;
        written.push(p);
    }
    let p = args.out.join("train.dot");
    write(&p, &to_dot(&c.training))?;
    written.push(p);

    let sized = super::common::missing(&dims, &c.optimized.dims).is_empty();
    let (program, selection) = select_kernels(
        &c.optimized,
        &target(args, c),
        Some(&loaded.source),
        sized.then_some(&dims),
    );
    let kdir = args.out.join("kernels");
    write_kernels(&kdir, &selection.sources)?;
    let unrunnable: Vec<String> = program
        .kernels
        .iter()
        .zip(&selection.choices)
        .filter(|(_, c)| matches!(c, fusec_compiler::select::Choice::Missing))
        .map(|(k, _)| k.name.clone())
        .collect();
    if !unrunnable.is_empty() {
        eprintln!(
            "warning: {} kernel{} ha{} no GPU code yet, and `fusec train` on a GPU stops at {}: {} (`fusec train --cpu` runs the model on the CPU reference)",
            unrunnable.len(),
            if unrunnable.len() == 1 { "" } else { "s" },
            if unrunnable.len() == 1 { "s" } else { "ve" },
            if unrunnable.len() == 1 { "it" } else { "them" },
            unrunnable.join(", ")
        );
    }
    // Which attention templates run, and how many of each: the family
    // (mma.sync or Hopper's) is in the name.
    let mut families: std::collections::BTreeMap<String, usize> = Default::default();
    for c in &selection.choices {
        if let fusec_compiler::select::Choice::Templates(ks) = c {
            for k in ks {
                let ty = k.launch.template.as_deref().unwrap_or("?");
                let name = ty
                    .split('<')
                    .next()
                    .unwrap_or(ty)
                    .trim_start_matches("fs_attn::");
                *families.entry(name.to_string()).or_default() += 1;
            }
        }
    }
    let templates: usize = families.values().sum();
    let listed: Vec<String> = families.iter().map(|(n, c)| format!("{n} x{c}")).collect();
    let split = selection
        .choices
        .iter()
        .filter(|c| matches!(c, fusec_compiler::select::Choice::SplitGemm))
        .count();
    let split_note = match split {
        0 => String::new(),
        n => format!(
            "; {n} f32 GEMM{} as three TF32 products, operands split by {}.cu (kernels/gemm/split_tf32.cuh)",
            if n == 1 { "" } else { "s" },
            fusec_compiler::emit::gemm_split::SPLIT_SOURCE
        ),
    };
    let skinny = selection
        .choices
        .iter()
        .filter(|c| matches!(c, fusec_compiler::select::Choice::Skinny(_)))
        .count();
    let skinny_note = match skinny {
        0 => String::new(),
        n => format!(
            "; {n} product{} of 32 rows or fewer as skinny GEMMs (kernels/gemm/skinny.cuh)",
            if n == 1 { "" } else { "s" }
        ),
    };
    written.push(kdir.join(format!(
        "*.cu ({} kernels for {}: {templates} of them tensor-core attention, kernels/attention/ templates{}{}{split_note}{skinny_note})",
        selection.sources.len(),
        args.device,
        if listed.is_empty() { "" } else { ": " },
        listed.join(", ")
    )));

    let missing = super::common::missing(&dims, &c.optimized.dims);
    let plan_note = if missing.is_empty() {
        super::common::check_sizes(&loaded, &dims)?;
        let plan = plan_with(&c.optimized, &program, Some(&selection), &dims)
            .map_err(|e| CliError::usage(format!("error: {e}")))?;
        let p = args.out.join("plan.json");
        write(&p, &plan.to_json())?;
        written.push(p);
        let p = args.out.join("report.txt");
        let file = loaded.path.display().to_string();
        let text = fusec_compiler::plan::report::report_with_source(
            &c.optimized,
            &program,
            &plan,
            c.training.g.node_count(),
            fusec_compiler::plan::roofline::device(&args.device).expect("checked by clap"),
            Some((&file, &loaded.source)),
            recomputed
                .describe(&c.optimized, Some((&file, &loaded.source)))
                .as_deref(),
        );
        write(&p, &text)?;
        written.push(p);
        let p = args.out.join("memory.html");
        let page = fusec_compiler::plan::picture::memory_html(
            &c.optimized,
            &program,
            &plan,
            Some(&loaded.source),
            &loaded.path.display().to_string(),
        );
        write(&p, &page)?;
        written.push(p);
        report_head(&text)
    } else {
        format!(
            "no memory plan: give the size of {} (--batch, --seq or --dim NAME=N) for plan.json, report.txt and memory.html",
            missing.join(", ")
        )
    };
    print!(
        "{}",
        super::check::summary(c, &loaded.path.display().to_string())
    );
    println!("\n{plan_note}");
    println!("\nwrote:");
    for p in written {
        println!("  {}", p.display());
    }
    Ok(())
}
