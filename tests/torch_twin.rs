//! `fusec export-torch`: every twin is valid Python, two are held as
//! snapshots, and where PyTorch can be imported (not in CI: its wheel needs
//! gigabytes of CUDA libraries) each twin, run in float64 on the CPU, gives
//! the reference interpreter's loss and every parameter gradient within
//! 1e-9 relative (each gradient to its largest entry), at tiny sizes, and
//! two steps of its `train_step` (optimizer, weight-decay groups, clipping,
//! micro-batches) the training graph's losses, norms and updates likewise;
//! and a twin's saved weights start `fusec train --init-from`, which writes
//! them back unchanged.

mod common;

use fusec_compiler::driver::elaborate_only;
use fusec_compiler::elaborate::Options;
use fusec_compiler::export::torch::twin;
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::step::train_step;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{run, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::DType;
use fusec_compiler::ops::Op;
use serde_json::{json, Value as Json};
use std::path::{Path, PathBuf};
use std::process::Command;

type Case = (String, Vec<(String, String)>, Vec<(&'static str, i64)>);
/// A case with its dims' names owned (drawn models name their own).
type OwnedCase = (String, Vec<(String, String)>, Vec<(String, i64)>);

/// The shipped models (shrunk) and the model files written for the twins,
/// which use every builtin and option at awkward sizes.
fn cases() -> Vec<Case> {
    let mut out: Vec<Case> = common::tiny_models()
        .into_iter()
        .map(|(f, sets, dims)| {
            (
                format!("dsl-examples/{f}"),
                sets.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                dims,
            )
        })
        .collect();
    for (file, dims) in TWIN_MODELS {
        out.push((format!("tests/models/twins/{file}"), vec![], dims.to_vec()));
    }
    out
}

/// Drawn models (tests/common/zoo.rs), written to `dir`, dropout off (the
/// twin's masks are PyTorch's): forms of a loss, norms and heads no shipped
/// model combines (a label-smoothed classifier's loss once lost its
/// smoothing in the twin).
fn drawn_cases(dir: &Path) -> Vec<OwnedCase> {
    let off = vec![
        ("p_drop".to_string(), "0".to_string()),
        ("p_attn".to_string(), "0".to_string()),
    ];
    common::zoo::seeds(DRAWN_TWINS)
        .into_iter()
        .map(common::zoo::draw)
        .map(|m| {
            let path = dir.join(format!("{}.dsl", m.name.replace('-', "_")));
            std::fs::write(&path, &m.source).unwrap();
            (path.display().to_string(), off.clone(), m.dims.clone())
        })
        .collect()
}

/// How many drawn models the f64 comparison takes (FUSEC_ZOO_SEEDS picks
/// others, as in tests/model_zoo.rs).
const DRAWN_TWINS: u64 = 16;

const TWIN_MODELS: &[(&str, &[(&str, i64)])] = &[
    ("gqa-hd80.dsl", &[("B", 2), ("T", 3)]),
    ("hd96-fp16.dsl", &[("B", 2), ("T", 4)]),
    ("hd40-by-hand.dsl", &[("B", 1), ("T", 5)]),
    ("cross-attention.dsl", &[("B", 2), ("T", 3), ("S", 5)]),
    ("conv-sgd.dsl", &[("B", 2)]),
    ("blocks.dsl", &[("B", 2), ("T", 3)]),
    ("slicing.dsl", &[("B", 2), ("T", 4)]),
    ("wide-mlp.dsl", &[("B", 3)]),
    ("repeat-shared.dsl", &[("B", 3)]),
];

fn export(file: &str, sets: &[(String, String)]) -> String {
    let path = common::root().join(file);
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    let name = fusec_compiler::driver::model_name(&path);
    let opts = Options {
        overrides: sets.to_vec(),
        ..Options::default()
    };
    let model =
        elaborate_only(&src, &name, &opts).unwrap_or_else(|f| panic!("{}", f.render(file, &src)));
    let shown = path.file_name().unwrap().to_string_lossy().into_owned();
    twin(&model, &shown).unwrap_or_else(|e| panic!("{file}: no twin: {}", e.message))
}

/// What the reference interpreter computes in f64: inputs, parameters,
/// loss and gradients, as tools/twin_check.py reads them.
fn reference_case(file: &str, sets: &[(String, String)], dims: &[(&str, i64)]) -> Json {
    let src = std::fs::read_to_string(common::root().join(file)).unwrap();
    let sets: Vec<(&str, &str)> = sets.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let c = common::compile_with(&src, file, &sets);
    let backward = fusec_compiler::autodiff::add_backward(&c.model).expect("differentiates");
    let feeds = random_feeds(&backward, &common::dims(dims), 11).expect("feeds");
    let vals = run(&backward, &feeds, Precision::F64).expect("runs");
    let loss = vals[&backward.output(&Role::Loss).unwrap()].data[0];
    let mut params = serde_json::Map::new();
    let mut grads = serde_json::Map::new();
    for (i, p) in backward.params.iter().enumerate() {
        let t = &feeds.params[&p.name];
        params.insert(p.name.clone(), json!({"shape": t.shape, "data": t.data}));
        let g = &vals[&backward.output(&Role::Grad(i)).unwrap()];
        grads.insert(p.name.clone(), json!({"shape": g.shape, "data": g.data}));
    }
    let mut inputs = serde_json::Map::new();
    for (name, ty) in c.model.inputs() {
        let t = &feeds.inputs[&name];
        let data: Json = if ty.dtype == DType::I32 {
            json!(t.data.iter().map(|v| *v as i64).collect::<Vec<_>>())
        } else {
            json!(t.data)
        };
        inputs.insert(
            name,
            json!({"shape": t.shape, "dtype": ty.dtype.name(), "data": data}),
        );
    }
    // Two optimizer steps of the whole training graph (every micro-batch
    // on the same batch), for the twin's `train_step` to repeat.
    let mut train = feeds.clone();
    for n in c.training.g.node_indices() {
        if let Op::State(st) = &c.training.g[n].op {
            let shape: Vec<usize> = st
                .ty
                .shape
                .iter()
                .map(|d| d.as_const().unwrap() as usize)
                .collect();
            train.state.insert(st.name.clone(), Tensor::zeros(&shape));
        }
    }
    let lr = c.model.train.optimizer.lr();
    let micro = c.model.train.micro_batches;
    let mut steps = Vec::new();
    for step in 1..=2u64 {
        let mut losses = 0.0;
        let mut norm = None;
        for m in 0..micro {
            let apply = if m + 1 == micro { 1.0 } else { 0.0 };
            train.inputs.insert(
                fusec_compiler::autodiff::APPLY_INPUT.into(),
                Tensor::scalar(apply),
            );
            let r = train_step(&c.training, &mut train, lr, step, Precision::F64).expect("steps");
            losses += r.loss;
            norm = r.grad_norm;
        }
        steps.push(json!({"loss": losses / micro as f64, "grad_norm": norm}));
    }
    let mut after = serde_json::Map::new();
    for p in &backward.params {
        let t = &train.params[&p.name];
        after.insert(p.name.clone(), json!({"shape": t.shape, "data": t.data}));
    }
    json!({
        "lr": lr,
        "steps": steps,
        "params_after": after,
        "model": file,
        "loss": loss,
        "grad_scale": 1.0 / c.model.train.micro_batches as f64,
        "params": params,
        "grads": grads,
        "inputs": inputs,
    })
}

fn python_has_torch() -> bool {
    Command::new("python3")
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A folder of this test's own (tests run in parallel in one process).
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fusec-twins-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn py_compile(path: &Path) -> Result<(), String> {
    let out = Command::new("python3")
        .args(["-m", "py_compile"])
        .arg(path)
        .output()
        .map_err(|e| format!("python3 does not run: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn every_twin_compiles_and_matches_the_reference_in_f64() {
    let dir = scratch("f64");
    let torch = python_has_torch();
    if !torch {
        common::skip("the f64 comparison: PyTorch cannot be imported by python3, so each twin is byte-compiled only (set PYTHONPATH to a PyTorch install to compare in f64)");
    }
    let mut failures = Vec::new();
    let owned = |(f, s, d): Case| (f, s, d.iter().map(|(k, v)| (k.to_string(), *v)).collect());
    let mut all: Vec<OwnedCase> = cases().into_iter().map(owned).collect();
    all.extend(drawn_cases(&dir));
    for (file, mut sets, dims) in all {
        let dims: Vec<(&str, i64)> = dims.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        sets.extend(dropout_off(&file));
        let text = export(&file, &sets);
        let stem = Path::new(&file)
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .replace('-', "_");
        let py = dir.join(format!("{stem}.py"));
        std::fs::write(&py, &text).unwrap();
        if let Err(e) = py_compile(&py) {
            failures.push(format!("{file}: not valid Python:\n{e}"));
            continue;
        }
        if !torch {
            continue;
        }
        let case = dir.join(format!("{stem}.json"));
        std::fs::write(&case, reference_case(&file, &sets, &dims).to_string()).unwrap();
        let out = Command::new("python3")
            .arg(common::root().join("tools/twin_check.py"))
            .arg(&py)
            .arg(&case)
            .output()
            .expect("python3 runs");
        let text = String::from_utf8_lossy(&out.stdout);
        print!("{text}");
        if !out.status.success() {
            failures.push(format!(
                "{file}:\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn twin_snapshots() {
    let llama = common::tiny_models()
        .into_iter()
        .find(|m| m.0 == "llama-small.dsl")
        .unwrap();
    let sets: Vec<(String, String)> = llama
        .1
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    insta::assert_snapshot!(
        "twin_llama_small",
        export("dsl-examples/llama-small.dsl", &sets)
    );
    insta::assert_snapshot!("twin_blocks", export("tests/models/twins/blocks.dsl", &[]));
}

/// Weights both ways: a twin's `save_fusec` file starts `fusec train
/// --init-from`, and the `--save-init` that run writes holds the same
/// numbers, which the twin's `load_fusec` reads back.
#[test]
fn a_twins_weights_start_fusec_train() {
    if !python_has_torch() {
        common::skip("PyTorch cannot be imported by python3");
        return;
    }
    let dir = scratch("weights");
    let sets = [
        ("layers", "2"),
        ("d", "16"),
        ("n_heads", "2"),
        ("vocab", "23"),
        ("ctx", "8"),
    ];
    let owned: Vec<(String, String)> = sets
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let twin_py = dir.join("twin.py");
    std::fs::write(&twin_py, export("dsl-examples/gpt2-small.dsl", &owned)).unwrap();
    let (from_twin, from_fusec) = (dir.join("twin.safetensors"), dir.join("fusec.safetensors"));
    let script = format!(
        "import importlib.util, torch\n\
         spec = importlib.util.spec_from_file_location('twin', {twin:?}); t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n\
         torch.manual_seed(3); m = t.MODEL(); t.save_fusec(m, {a:?})\n",
        twin = twin_py.to_str().unwrap(),
        a = from_twin.to_str().unwrap()
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut args: Vec<String> = [
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--data",
        "random",
        "--batch",
        "2",
        "--seq",
        "5",
        "--steps",
        "1",
    ]
    .map(String::from)
    .to_vec();
    for (k, v) in &sets {
        args.extend(["--set".to_string(), format!("{k}={v}")]);
    }
    args.extend([
        "--init-from".to_string(),
        from_twin.display().to_string(),
        "--save-init".to_string(),
        from_fusec.display().to_string(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, _, err) = common::fusec(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("weights from"), "{err}");
    let check = format!(
        "import importlib.util, torch\n\
         spec = importlib.util.spec_from_file_location('twin', {twin:?}); t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n\
         a = t.MODEL(); t.load_fusec(a, {a:?}); b = t.MODEL(); t.load_fusec(b, {b:?})\n\
         sa, sb = a.state_dict(), b.state_dict()\n\
         assert sa.keys() == sb.keys()\n\
         bad = [k for k in sa if not torch.equal(sa[k], sb[k])]\n\
         assert not bad, bad\n\
         print(len(sa), 'tensors equal')\n",
        twin = twin_py.to_str().unwrap(),
        a = from_twin.to_str().unwrap(),
        b = from_fusec.to_str().unwrap()
    );
    let out = Command::new("python3")
        .args(["-c", &check])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{}", String::from_utf8_lossy(&out.stdout));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The twin draws dropout masks from PyTorch's generator, not fusec's
/// Philox: with them on, the two runs see other masks and part at once.
/// The shipped models that drop (their rate in `const p`) are compared at
/// p = 0; the masks themselves are checked against the interpreter's draws
/// elsewhere (tests/dropout.rs).
fn dropout_off(file: &str) -> Option<(String, String)> {
    let source = std::fs::read_to_string(common::root().join(file)).unwrap_or_default();
    (source.contains("dropout(") && source.contains("\nconst p = "))
        .then(|| ("p".to_string(), "0".to_string()))
}

/// Token models train on the shipped text (every window new within the 50
/// steps, with the vocabulary raised to the 256 byte values where it is
/// smaller); the others on `--data random`, one fixed batch. A model that
/// memorizes its batch drives the loss towards zero, where relative
/// differences measure only the rounding of a cancellation: the sizes
/// here keep every loss well above that.
fn parity_args(file: &str, sets: &[(String, String)], dims: &[(&str, i64)]) -> Vec<String> {
    let text = [
        "gpt2-small",
        "llama-small",
        "gqa-hd80",
        "hd40-by-hand",
        "blocks",
    ]
    .iter()
    .any(|m| file.ends_with(&format!("/{m}.dsl")));
    let mut args = vec![
        common::root()
            .join("tools/twin_parity.py")
            .display()
            .to_string(),
        file.to_string(),
        "--fusec".into(),
        env!("CARGO_BIN_EXE_fusec").into(),
        "--cpu".into(),
        "--device".into(),
        "cpu".into(),
        "--steps".into(),
        "50".into(),
        // Steps 1 and 7 also tensor by tensor from fusec's own weights.
        "--tensors".into(),
        "1".into(),
        "--tensors".into(),
        "7".into(),
    ];
    if let Some((k, v)) = dropout_off(file) {
        args.extend(["--set".into(), format!("{k}={v}")]);
    }
    for (k, v) in sets {
        let v = if text && k == "vocab" { "256" } else { v };
        let v = if text && k == "ctx" { "16" } else { v };
        args.extend(["--set".into(), format!("{k}={v}")]);
    }
    if text {
        if file.ends_with("hd40-by-hand.dsl") || file.ends_with("blocks.dsl") {
            args.extend(["--set".into(), "vocab=256".into()]);
        }
        args.extend([
            "--data".into(),
            "dsl-examples/data/founding-texts.txt".into(),
            "--batch".into(),
            "2".into(),
            "--seq".into(),
            "16".into(),
        ]);
    } else {
        for (d, n) in dims {
            // Three rows of a regression are fitted to a loss of 1e-6 within
            // 50 steps, where fp16's rounding of `pred - y` is all that is
            // left to compare; 64 rows keep the loss away from zero.
            let n = if file.ends_with("wide-mlp.dsl") {
                64
            } else {
                *n
            };
            args.extend(["--dim".into(), format!("{d}={n}")]);
        }
    }
    args
}

/// Item 3 of the twin's promise, on the CPU: fusec's reference interpreter
/// trains each model 50 steps, in f32 and in the model's own precision, and
/// stays as close to the float64 twin as the same-precision twin does (3x,
/// or the precision's floor), step by step, in the loss and the gradient
/// norm (tools/twin_parity.py).
#[test]
fn fifty_steps_of_fusec_stay_with_the_f64_twin() {
    if !python_has_torch() {
        common::skip("PyTorch cannot be imported by python3");
        return;
    }
    let mut failures = Vec::new();
    for (file, sets, dims) in cases() {
        let args = parity_args(&file, &sets, &dims);
        let out = Command::new("python3")
            .args(&args)
            .current_dir(common::root())
            .output()
            .expect("python3 runs");
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{}", text.lines().last().unwrap_or(""));
        if !out.status.success() {
            failures.push(format!(
                "{file}:\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A loss's rules survive the twin's one-call form of a mean cross-entropy
/// (a label-smoothed loss once lost its smoothing there, and the twin
/// trained another function), and an ignored index keeps the per-row form,
/// whose mean divides by every row as fusec's does. Runs without PyTorch.
#[test]
fn a_mean_loss_keeps_its_rules_in_the_twin() {
    let dir = scratch("rules");
    for (rule, want, unwanted) in [
        (
            ", label_smoothing = 0.1",
            "F.cross_entropy(logits, labels.long(), label_smoothing=0.1)",
            "",
        ),
        (
            ", ignore_index = 3",
            "reduction=\"none\", ignore_index=3)",
            "F.cross_entropy(logits, labels.long())",
        ),
    ] {
        let src = format!(
            "dim B\ninput x: f32[B, 4]\ninput labels: i32[B]\nparam w: [4, 5] = normal(0.3)\n\
             let logits = x @ w\ntrain {{\n    loss = cross_entropy(logits, labels{rule})\n    \
             optimizer = sgd(lr = 0.1)\n}}\n"
        );
        let path = dir.join("rules.dsl");
        std::fs::write(&path, &src).unwrap();
        let text = export(&path.display().to_string(), &[]);
        assert!(
            text.contains(want),
            "{rule}: the twin should say `{want}`:\n{text}"
        );
        assert!(
            unwanted.is_empty() || !text.contains(unwanted),
            "{rule}: the twin should not say `{unwanted}`:\n{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
