//! A whole training step of each shipped model run the way the GPU runtime
//! runs it, on the host, against the kernel-IR interpreter
//! (tests/common/step_host.rs says how), and what the padding passes did to
//! the awkward ones.

mod common;

use common::{host, step_host};

#[test]
fn a_whole_step_in_one_arena_matches_the_interpreter() {
    if !host::have_cxx() {
        return;
    }
    let work = host::work_dir("host-step");
    let mut report = Vec::new();
    // GPT-2 again with 1029 bf16 logits a row: not a multiple of 16 bytes,
    // so the logits are stored with rows padded to 1088 and the products
    // around them run at 1088 (kernel::pitch).
    let padded = (
        "gpt2-small.dsl",
        vec![
            ("vocab", "1029"),
            ("ctx", "8"),
            ("d", "16"),
            ("n_heads", "2"),
            ("layers", "1"),
        ],
        vec![("B", 2), ("T", 3)],
    );
    // BERT's head adds a bias in the GEMM's epilogue, and sums the padded
    // logits' gradient for the bias's gradient.
    let bert = (
        "bert-encoder.dsl",
        vec![
            ("vocab", "1029"),
            ("ctx", "8"),
            ("d", "16"),
            ("n_heads", "2"),
            ("layers", "1"),
        ],
        vec![("B", 2), ("T", 3)],
    );
    // LLaMA-style at sizes nobody chose (common::awkward_gqa).
    let (file, sets) = common::awkward_gqa();
    let awkward = (file, sets, vec![("B", 2), ("T", 3)]);
    // In f32 with 131 classes: the bias and the last weight read padded to
    // 136, the cross-entropy's scalar (not 16-byte) path over 131 of them.
    let awkward_f32 = (
        "mlp.dsl",
        vec![("d_in", "37"), ("d_hidden", "64"), ("classes", "131")],
        vec![("B", 5)],
    );
    let (mut pitches, mut zero_rows, mut pads, mut padded_sizes) = (0, 0, Vec::new(), Vec::new());
    let (mut updates, mut updates_16): (f64, f64) = (0.0, 0.0);
    for (file, sets, dims) in
        common::tiny_models()
            .into_iter()
            .chain([padded, bert, awkward, awkward_f32])
    {
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        padded_sizes.extend(c.optimized.padded.iter().map(|p| (p.size, p.to)));
        let stem = file
            .rsplit('/')
            .next()
            .unwrap_or(file)
            .trim_end_matches(".dsl");
        let out =
            step_host::run_step(&work, stem, &c, &dims).unwrap_or_else(|e| panic!("{file}: {e}"));
        pitches += out.pitches;
        zero_rows += out.zero_rows;
        pads.extend(out.pads);
        if c.model.train.precision == fusec_compiler::ir::DType::F32 {
            updates = updates.max(out.updates);
        } else {
            updates_16 = updates_16.max(out.updates);
        }
        report.push(format!(
            "{file}: {} launches, worst {:.2} of its bound",
            out.launches, out.worst
        ));
    }
    for r in report {
        println!("{r}");
    }
    println!("updates: at most {updates:.2e} (f32 models) and {updates_16:.2e} (16-bit) of their norm from the interpreter's");
    assert_eq!(
        padded_sizes,
        [(131, 136), (1003, 1008), (131, 136)],
        "pad-dims should pad the awkward models' MLP width, untied head and classes, and nothing in the shipped models"
    );
    // The logits and their gradient, in GPT-2 and in BERT.
    assert_eq!(
        pitches, 4,
        "the padded GPT-2 and BERT should store their logits with padded rows"
    );
    // The output projection at n = 1088 and its input gradient at k = 1088,
    // over the bf16 table with 59 zero rows after its last (and BERT's bias
    // with 59 zeros after its end), and the table's gradient at m = 1088.
    assert_eq!(
        zero_rows, 5,
        "the padded GPT-2's and BERT's table copies and tables' gradients, and BERT's bias, should end in zeros"
    );
    let want = [
        fusec_compiler::kernel::GemmPad {
            n: Some(1088),
            ..Default::default()
        },
        fusec_compiler::kernel::GemmPad {
            k: Some(1088),
            ..Default::default()
        },
        fusec_compiler::kernel::GemmPad {
            m: Some(1088),
            ..Default::default()
        },
    ];
    let want: Vec<_> = want.iter().chain(&want).copied().collect();
    assert_eq!(
        pads, want,
        "the padded GPT-2's and BERT's products should run at 1088"
    );
    let _ = std::fs::remove_dir_all(&work);
}
