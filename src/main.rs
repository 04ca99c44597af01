//! `fusec`: compile a model file into one fused training step.

mod cli;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "fusec",
    version,
    about = "A training-graph compiler: a model file in, one fused training step out",
    long_about = "fusec turns a model written in its small DSL into one training step \
(forward, backward and optimizer update) as fused CUDA kernels and a static memory plan.\n\n\
Start with `fusec check dsl-examples/gpt2-small.dsl`, then `fusec build`.",
    after_help = "Exit status: 0 ok, 1 the model file has an error, 2 the command line is wrong, 3 the GPU, data or a run failed."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a model file and list its inputs and parameters
    Check(cli::check::CheckArgs),
    /// Compile a model file and write the results to a folder
    Build(cli::build::BuildArgs),
    /// List the graph passes in the order `fusec build` runs them
    Passes,
    /// Train a model on a GPU: compile, load, and run steps
    Train(Box<cli::train::TrainArgs>),
    /// Continue a prompt with a trained language model, a token at a time
    Generate(cli::generate::GenerateArgs),
    /// A trained model's loss and perplexity over a token file
    Eval(cli::eval::EvalArgs),
    /// Time the compiled step on a GPU and print one JSON line
    Bench(cli::bench::BenchArgs),
    /// Time the attention kernels alone over head dims and lengths (JSON lines)
    BenchAttention(cli::bench::BenchAttentionArgs),
    /// Write the model as a standalone PyTorch module (its twin), with the
    /// training step of its `train` section
    ExportTorch(cli::export::ExportArgs),
    /// What a line of the model file (or a parameter) became: its ops,
    /// the kernels holding them, their bytes and time
    Explain(cli::explain::ExplainArgs),
    /// Turn text files into llm.c token shards with a Hugging Face
    /// tokenizer.json (train and validation)
    Tokenize(cli::tokenize::TokenizeArgs),
}

fn main() -> ExitCode {
    fusec_runtime::startup::begin();
    // Rust ignores SIGPIPE, so printing a dump into a pipe that closed early
    // (`| head`) would panic; the default action ends the process quietly,
    // as other command-line tools do.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default before any
    // thread starts; no handler runs Rust code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(a) => cli::check::run(&a),
        Command::Build(a) => cli::build::run(&a),
        Command::Train(a) => cli::train::train(&a),
        Command::Eval(a) => cli::eval::run(&a),
        Command::Generate(a) => cli::generate::run(&a),
        Command::Bench(a) => cli::bench::bench(&a),
        Command::BenchAttention(a) => cli::bench::bench_attention(&a),
        Command::ExportTorch(a) => cli::export::run(&a),
        Command::Tokenize(a) => cli::tokenize::run(&a),
        Command::Explain(a) => cli::explain::run(&a),
        Command::Passes => {
            let passes = fusec_compiler::passes::forward_pipeline()
                .into_iter()
                .chain(fusec_compiler::passes::default_pipeline());
            for p in passes {
                println!("{:<15} {}", p.name(), p.about());
            }
            println!("\nthen, at the sizes given (--batch, --seq, --dim):");
            println!("{:<15} {}", "loss-head", fusec_compiler::loss_head::ABOUT);
            println!("{:<15} {}", "recompute", fusec_compiler::recompute::ABOUT);
            println!("\nthen, on kernels (see --dump layout, --dump kernels, plan.json):");
            for (name, about) in fusec_compiler::kernel::STAGES {
                println!("{name:<15} {about}");
            }
            println!("\noptimisations of the kernel stages, each on unless --disable-pass NAME:");
            for o in fusec_compiler::optimisation::Optimisation::ALL {
                println!("{:<22} ({}) {}", o.name(), o.stage(), o.about());
            }
            Ok(())
        }
    };
    fusec_runtime::startup::mark("command returned");
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("{}", e.message);
            if !e.message.ends_with('\n') {
                eprintln!();
            }
            ExitCode::from(e.code)
        }
    }
}
