//! The kernel stages as passes: each stage's verifier catches a result
//! broken on purpose (in the build the tests run in, release), and every
//! optimisation `--disable-pass` can turn off leaves a step that computes
//! the same values with more kernels or simpler ones.

mod common;

use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::{run, Precision};
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::lowering::{lower, select_kernels, Lowered};
use fusec_compiler::optimisation::{LowerOptions, Optimisation};
use fusec_compiler::plan::MemKind;
use fusec_compiler::select::{Choice, Target};

fn h100() -> Target {
    Target::for_device("h100", false).expect("h100 is a device")
}

fn gpt2_tiny() -> fusec_compiler::driver::Compiled {
    let (name, src) = common::example("gpt2-small.dsl");
    common::compile_with(
        &src,
        &name,
        &[
            ("vocab", "61"),
            ("ctx", "16"),
            ("d", "64"),
            ("n_heads", "1"),
            ("layers", "2"),
        ],
    )
}

/// A selection without a source for a kernel it runs, with a duplicate
/// source, or with a choice missing is caught.
#[test]
fn the_selection_verifier_catches_broken_selections() {
    let c = gpt2_tiny();
    let (program, selection) = select_kernels(&c.optimized, &h100(), None, None);
    assert_eq!(selection.verify(&program), Ok(()));
    assert!(
        selection
            .choices
            .iter()
            .any(|c| matches!(c, Choice::Templates(_))),
        "gpt2 on an h100 runs the attention templates"
    );

    let mut lost = selection.clone();
    let (gone, _) = lost.sources.remove(0);
    let e = lost.verify(&program).unwrap_err().join("\n");
    assert!(e.contains(&gone) && e.contains("has no source"), "{e}");

    let mut twice = selection.clone();
    let first = twice.sources[0].clone();
    twice.sources.push(first);
    let e = twice.verify(&program).unwrap_err().join("\n");
    assert!(e.contains("two kernels are named"), "{e}");

    let mut short = selection.clone();
    short.choices.pop();
    let e = short.verify(&program).unwrap_err().join("\n");
    assert!(e.contains("choices for"), "{e}");
}

/// A plan with two live temporaries in the same bytes, storage shared at a
/// different offset, a buffer past the arena, or a launch of a buffer that
/// does not exist is caught.
#[test]
fn the_plan_verifier_catches_broken_plans() {
    let c = gpt2_tiny();
    let dims = common::dims(&[("B", 2), ("T", 16)]).into_iter().collect();
    let Lowered { plan, .. } = lower(&c.optimized, &h100(), &dims, None).expect("plans");
    assert_eq!(plan.verify(), Ok(()));

    // Two temporaries alive at the same kernel, in different bytes.
    let temps: Vec<usize> = plan
        .buffers
        .iter()
        .filter(|b| b.kind == MemKind::Activation && b.alias_of.is_none())
        .filter(|b| b.shares_with.is_none() && b.bytes > 0)
        .map(|b| b.id)
        .collect();
    let (a, b) = temps
        .iter()
        .flat_map(|&a| temps.iter().map(move |&b| (a, b)))
        .find(|&(a, b)| {
            let (x, y) = (&plan.buffers[a], &plan.buffers[b]);
            let (lx, ly) = (x.live.unwrap(), y.live.unwrap());
            a != b && lx.0 <= ly.1 && ly.0 <= lx.1 && x.offset != y.offset
        })
        .expect("two temporaries alive at once");
    let mut clash = plan.clone();
    clash.buffers[b].offset = clash.buffers[a].offset;
    let e = clash.verify().unwrap_err().join("\n");
    assert!(
        e.contains("share bytes") && e.contains("while both are alive"),
        "{e}"
    );

    let mut moved = plan.clone();
    let shared = moved
        .buffers
        .iter()
        .position(|b| b.alias_of.is_some() || b.shares_with.is_some())
        .expect("an update in place");
    moved.buffers[shared].offset += 256;
    let e = moved.verify().unwrap_err().join("\n");
    assert!(e.contains("is stored over buffer"), "{e}");

    let mut past = plan.clone();
    past.arena_bytes -= 256;
    let e = past.verify().unwrap_err().join("\n");
    assert!(e.contains("ends past the arena"), "{e}");

    let mut dangling = plan.clone();
    dangling.launches[0].inputs.push(1 << 20);
    let e = dangling.verify().unwrap_err().join("\n");
    assert!(e.contains("does not exist"), "{e}");
}

/// Each optimisation turned off: the step's kernel program still gives
/// the graph's outputs exactly (f64), its plan verifies, and the step
/// changes: more launches, or (the attention, the skinny products) no
/// template instances.
#[test]
fn every_optimisation_turned_off_keeps_the_step() {
    let mut changed = std::collections::HashMap::<Optimisation, usize>::new();
    for (file, sets, dims) in common::tiny_models() {
        // A pre-LN decoder of each kind, and the post-LN translator (dropout,
        // biases: its bias gradients and norms take the chains before them).
        if !matches!(
            file,
            "gpt2-small.dsl" | "llama-small.dsl" | "translator.dsl"
        ) {
            continue;
        }
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let feed_dims = common::dims(&dims);
        let dims = feed_dims.clone().into_iter().collect();
        let all_on = lower(&c.optimized, &h100(), &dims, None).expect("plans");
        let launches = |l: &Lowered| {
            l.plan
                .launches
                .iter()
                .map(|x| x.steps.len().max(1))
                .sum::<usize>()
        };
        let feeds = random_feeds(&c.optimized, &feed_dims, 3).expect("feeds");
        let reference = run(&c.optimized, &feeds, Precision::F64).expect("graph runs");
        for &opt in Optimisation::ALL {
            let g = &c.optimized;
            let target = Target {
                lower: LowerOptions {
                    off: [opt].into(),
                    bucket_bytes: None,
                },
                ..h100()
            };
            let off = lower(g, &target, &dims, None)
                .unwrap_or_else(|e| panic!("{file} without {opt}: {e}"));
            let bufs = run_program(g, &off.program, &feeds, Precision::F64)
                .unwrap_or_else(|e| panic!("{file} without {opt}: {e}"));
            for (role, v) in &g.outputs {
                let b = off.program.buffer_of(*v).expect("outputs are stored");
                for (x, y) in reference[v].data.iter().zip(&bufs[b].data) {
                    assert!(
                        (x - y).abs() <= 1e-12 * x.abs().max(1.0),
                        "{file} without {opt}: {role}: {x} vs {y}"
                    );
                }
            }
            let (on, without) = (launches(&all_on), launches(&off));
            println!("{file}: {on} launches, {without} without {opt}");
            let templates = |l: &Lowered| {
                let c = &l.selection.choices;
                c.iter()
                    .filter(|c| matches!(c, Choice::Templates(_)))
                    .count()
            };
            let skinny = |l: &Lowered| {
                let c = &l.selection.choices;
                c.iter().filter(|c| matches!(c, Choice::Skinny(_))).count()
            };
            if opt == Optimisation::SkinnyGemm {
                // As many launches: cuBLASLt where the skinny kernels ran.
                assert_eq!(skinny(&off), 0, "{file}: {opt}");
                assert_eq!(without, on, "{file}: {opt}");
                *changed.entry(opt).or_default() += usize::from(skinny(&all_on) > 0);
            } else if opt == Optimisation::TensorCoreAttention {
                // Fewer launches: a simple kernel where several templates ran.
                assert_eq!(templates(&off), 0, "{file}: {opt}");
                *changed.entry(opt).or_default() += usize::from(templates(&all_on) > 0);
            } else {
                assert!(without >= on, "{file}: {opt} off gave fewer launches");
                *changed.entry(opt).or_default() += usize::from(without > on);
            }
        }
    }
    for opt in Optimisation::ALL {
        assert!(
            changed.get(opt).is_some_and(|&n| n > 0),
            "turning {opt} off changed no model's step"
        );
    }
}
