//! `fusec train` as a user runs it, on the CPU reference (`--cpu`), so it
//! runs everywhere: the loss falls on the shipped text, checkpoints are
//! safetensors that a resumed run continues from exactly as an unbroken run
//! would, and bad data, checkpoints and a missing GPU are clear errors.

mod common;

use common::fusec;

use std::path::Path;

const SMALL: &[&str] = &[
    "--set",
    "vocab=256",
    "--set",
    "layers=1",
    "--set",
    "d=32",
    "--set",
    "n_heads=2",
    "--set",
    "ctx=64",
    "--batch",
    "2",
    "--seq",
    "32",
    "--lr",
    "3e-3",
    "--cpu",
];

/// The shipped training text.
const TEXT: &str = "dsl-examples/data/founding-texts.txt";

fn run(extra: &[&str]) -> (i32, String, String) {
    run_on(TEXT, extra)
}

/// `fusec train model --cpu --data TEXT extra..`.
fn train_cpu(model: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["train", model.to_str().unwrap(), "--cpu", "--data", TEXT];
    args.extend_from_slice(extra);
    fusec(&args)
}

fn run_on(data: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["train", "dsl-examples/gpt2-small.dsl", "--data", data];
    args.extend_from_slice(SMALL);
    args.extend_from_slice(extra);
    fusec(&args)
}

/// The loss of a `losses` line.
fn loss(line: &str) -> f64 {
    line.split(':').nth(1).unwrap().parse().unwrap()
}

fn losses(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!("{}:{}", v["step"], v["loss"])
        })
        .collect()
}

fn tmp(name: &str) -> std::path::PathBuf {
    common::host::work_dir("train-cli").join(name)
}

/// A bigram model in the temp folder: i32 `tokens` and `targets`, both
/// `[dims]`, an embedding and an output projection of 16 features, AdamW,
/// and `extra` lines in its `train` block.
fn bigram(name: &str, dims: &str, extra: &str) -> std::path::PathBuf {
    let model = tmp(name);
    std::fs::write(
        &model,
        format!(
            "dim {dims}\ninput tokens: i32[{dims}]\ninput targets: i32[{dims}]\n\
             param emb: [256, 16] = normal(0.1)\nparam w: [16, 256] = normal(0.1)\n\
             train {{\n loss = cross_entropy(embedding(emb, tokens) @ w, targets)\n optimizer = adamw(lr = 1e-2)\n{extra}}}\n"
        ),
    )
    .unwrap();
    model
}

#[test]
fn the_loss_falls_and_a_resumed_run_matches_an_unbroken_one() {
    let (whole, first, second) = (tmp("whole.jsonl"), tmp("first.jsonl"), tmp("second.jsonl"));
    let ck = tmp("ck.safetensors");
    let (code, _, err) = run(&["--steps", "8", "--log", whole.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let all = losses(&whole);
    assert_eq!(all.len(), 8);
    assert!(loss(&all[7]) < 0.95 * loss(&all[0]), "{all:?}");

    let (code, _, err) = run(&[
        "--steps",
        "5",
        "--log",
        first.to_str().unwrap(),
        "--save",
        ck.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("saved"), "{err}");
    let (code, _, err) = run(&[
        "--steps",
        "3",
        "--log",
        second.to_str().unwrap(),
        "--resume",
        ck.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("after step 5"), "{err}");
    let mut resumed = losses(&first);
    resumed.extend(losses(&second));
    assert_eq!(
        resumed, all,
        "a resumed run must repeat the unbroken run's losses exactly"
    );
}

#[test]
fn bad_data_and_checkpoints_are_named() {
    let (code, _, err) = run_on("no/such/file.bin", &["--steps", "1"]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("cannot read the data file no/such/file.bin"),
        "{err}"
    );

    let bad = tmp("bad.bin");
    std::fs::write(&bad, [0u8; 2000]).unwrap();
    let (code, _, err) = run_on(bad.to_str().unwrap(), &["--steps", "1"]);
    assert_eq!(code, 3);
    assert!(err.contains("not an llm.c token shard"), "{err}");

    let truncated = tmp("short.safetensors");
    std::fs::write(&truncated, b"\x10\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    let (code, _, err) = run(&["--steps", "1", "--resume", truncated.to_str().unwrap()]);
    assert_eq!(code, 3);
    assert!(err.contains("not a usable checkpoint"), "{err}");

    // A checkpoint of another model names the missing tensor.
    let other = tmp("other.safetensors");
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/mlp.dsl",
        "--cpu",
        "--data",
        "random",
        "--batch",
        "2",
        "--steps",
        "1",
        "--set",
        "d_hidden=4",
        "--save",
        other.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&["--steps", "1", "--resume", other.to_str().unwrap()]);
    assert_eq!(code, 3);
    assert!(
        err.contains("has no tensor `wte`") || err.contains("has no tensor"),
        "{err}"
    );

    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/mlp.dsl",
        "--cpu",
        "--data",
        "random",
        "--batch",
        "0",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--batch must be a positive size"), "{err}");
}

#[test]
fn without_a_gpu_train_says_so() {
    if fusec_runtime::device::driver_present() {
        common::skip("this machine has a CUDA driver");
        return;
    }
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/mlp.dsl",
        "--data",
        "random",
        "--batch",
        "2",
    ]);
    assert_eq!(code, 3);
    assert!(
        err.contains("no GPU") && err.contains("fusec build"),
        "{err}"
    );
}

/// Token windows take their shape from the model's `tokens` input, whatever
/// its dimensions are called.
#[test]
fn token_data_follows_the_tokens_input_shape() {
    let model = bigram("nl.dsl", "N, L", "");
    let (code, _, err) = train_cpu(&model, &["--dim", "N=2", "--dim", "L=8", "--steps", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("step     2/2"), "{err}");
}

/// fp16 with micro-batches trains: one loss scale per step over its two
/// micro-batches; steps whose gradients overflow (the loss is scaled up so
/// that the first ones do) are skipped and the scale halves; the loss falls.
#[test]
fn fp16_with_micro_batches_trains() {
    let model = bigram(
        "fp16-micro.dsl",
        "B, T",
        " precision = fp16\n micro_batches = 2\n",
    );
    let text = std::fs::read_to_string(&model).unwrap();
    let scaled = text.replace("loss = cross_entropy", "loss = 1000 * cross_entropy");
    assert_ne!(scaled, text);
    std::fs::write(&model, scaled).unwrap();
    let log = tmp("fp16-micro.jsonl");
    let (code, _, err) = train_cpu(
        &model,
        &[
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "30",
            "--log",
            log.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("gradients overflowed, step skipped; loss scale now 32768"),
        "{err}"
    );
    let first_line = std::fs::read_to_string(&log).unwrap();
    assert!(
        first_line
            .lines()
            .next()
            .unwrap()
            .contains("\"grad_norm\":null"),
        "{first_line}"
    );
    let all = losses(&log);
    assert_eq!(all.len(), 30);
    let (first, last) = (loss(&all[0]), loss(&all[29]));
    assert!(last < 0.9 * first, "{first} -> {last}\n{err}");
}

/// Token data needs i32 `tokens`: any other type is named, with the fix,
/// before anything runs.
#[test]
fn token_data_needs_i32_tokens() {
    // f32 tokens can only be features (an embedding takes i32 indices).
    let model = tmp("f32-tokens.dsl");
    std::fs::write(
        &model,
        "dim B, T\ninput tokens: f32[B, T]\ninput targets: i32[B, T]\n\
         param emb: [256, 16] = normal(0.1)\nparam w: [16, 256] = normal(0.1)\n\
         train {\n loss = cross_entropy(embedding(emb, targets) @ w + mean(tokens), targets)\n optimizer = adamw(lr = 1e-2)\n}\n",
    )
    .unwrap();
    let (code, _, err) = train_cpu(&model, &["--batch", "2", "--seq", "8"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("declares as f32[B, T]") && err.contains("declare it as i32"),
        "{err}"
    );
}

/// Token windows feed `targets` shaped as `tokens`: another shape is named
/// before anything runs.
#[test]
fn token_data_needs_targets_shaped_as_tokens() {
    let model = tmp("targets-shape.dsl");
    std::fs::write(
        &model,
        "dim B, T, S\ninput tokens: i32[B, T]\ninput targets: i32[B, S]\n\
         param emb: [256, 16] = normal(0.1)\nparam w: [16, 256] = normal(0.1)\n\
         train {\n loss = cross_entropy(embedding(emb, targets) @ w, targets) + mean(embedding(emb, tokens))\n optimizer = adamw(lr = 1e-2)\n}\n",
    )
    .unwrap();
    let (code, _, err) = train_cpu(&model, &["--dim", "B=2", "--dim", "T=8", "--dim", "S=3"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("`targets` has shape [2, 3]") && err.contains("same shape"),
        "{err}"
    );
}

#[test]
fn init_from_starts_from_saved_weights_and_names_a_missing_one() {
    let (init, a, b) = (tmp("init.safetensors"), tmp("a.jsonl"), tmp("b.jsonl"));
    // A run that saves its initial weights, then a run with another seed
    // that starts from them: the same first loss, to the bit.
    let (code, _, err) = run(&[
        "--steps",
        "1",
        "--save-init",
        init.to_str().unwrap(),
        "--log",
        a.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&[
        "--steps",
        "1",
        "--seed",
        "99",
        "--init-from",
        init.to_str().unwrap(),
        "--log",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("weights from"), "{err}");
    assert_eq!(losses(&a), losses(&b));
    // Weights of another model: exit 3, naming the tensor.
    let (code, _, err) = run(&[
        "--steps",
        "1",
        "--set",
        "layers=2",
        "--init-from",
        init.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("missing `h.1."), "{err}");
}

/// A token file feeds `tokens` and `targets` only: a model with another
/// input is told so instead of training on whatever that input holds.
#[test]
fn token_data_with_another_input_is_an_error() {
    let model = tmp("extra-input.dsl");
    std::fs::write(
        &model,
        "dim B, T\ninput tokens: i32[B, T]\ninput targets: i32[B, T]\ninput bias: f32[B, T, 16]\n\
         param emb: [256, 16] = normal(0.1)\nparam w: [16, 256] = normal(0.1)\n\
         train {\n loss = cross_entropy((embedding(emb, tokens) + bias) @ w, targets)\n optimizer = adamw(lr = 1e-2)\n}\n",
    )
    .unwrap();
    let (code, _, err) = train_cpu(&model, &["--batch", "2", "--seq", "8"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("also has the input `bias`") && err.contains("--data random"),
        "{err}"
    );
}

/// The f32 values of a safetensors tensor, and its shape and dtype.
fn tensor(path: &Path, name: &str) -> (String, Vec<usize>, Vec<f64>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    let values = t
        .data()
        .chunks_exact(4)
        .map(|c| match t.dtype() {
            safetensors::Dtype::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
            _ => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
        })
        .collect();
    (format!("{:?}", t.dtype()), t.shape().to_vec(), values)
}

/// `--save-data` writes every window a run fed, in order: consecutive
/// windows of T + 1 bytes of the text, targets one ahead of the tokens,
/// micro-batches included.
#[test]
fn save_data_holds_the_windows_fed() {
    let model = bigram("windows.dsl", "B, T", " micro_batches = 2\n");
    let data = tmp("windows.safetensors");
    let (code, _, err) = train_cpu(
        &model,
        &[
            "--batch",
            "2",
            "--seq",
            "5",
            "--steps",
            "3",
            "--save-data",
            data.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("saved the batches fed"), "{err}");
    let text = std::fs::read(common::root().join(TEXT)).unwrap();
    let (dtype, shape, tokens) = tensor(&data, "tokens");
    assert_eq!((dtype.as_str(), shape.as_slice()), ("I32", &[6, 2, 5][..]));
    let (_, _, targets) = tensor(&data, "targets");
    // Window w (row r of batch k, w = 2k + r) starts at byte 5w.
    for w in 0..12 {
        for i in 0..5 {
            assert_eq!(tokens[w * 5 + i], text[w * 5 + i] as f64, "window {w}");
            assert_eq!(targets[w * 5 + i], text[w * 5 + i + 1] as f64, "window {w}");
        }
    }
}

/// With `--data random` the one batch is written once, as the step reads
/// it: a bf16 input rounded to bf16.
#[test]
fn save_data_holds_the_random_batch_as_read() {
    let model = tmp("random-batch.dsl");
    std::fs::write(
        &model,
        "dim B\ninput x: bf16[B, 4]\ninput y: i32[B]\nparam w: [4, 3] = normal(0.1)\n\
         train {\n loss = cross_entropy(x @ w, y)\n optimizer = sgd(lr = 0.1)\n}\n",
    )
    .unwrap();
    let data = tmp("random-batch.safetensors");
    let (code, _, err) = fusec(&[
        "train",
        model.to_str().unwrap(),
        "--cpu",
        "--data",
        "random",
        "--batch",
        "5",
        "--steps",
        "2",
        "--save-data",
        data.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let (dtype, shape, x) = tensor(&data, "x");
    assert_eq!((dtype.as_str(), shape.as_slice()), ("F32", &[1, 5, 4][..]));
    assert!(x.iter().any(|v| *v != 0.0));
    for v in &x {
        assert_eq!(
            half::bf16::from_f64(*v).to_f64(),
            *v,
            "{v} is not a bf16 value"
        );
    }
    let (dtype, shape, y) = tensor(&data, "y");
    assert_eq!((dtype.as_str(), shape.as_slice()), ("I32", &[1, 5][..]));
    assert!(y.iter().all(|v| (0.0..3.0).contains(v)), "{y:?}");
}

/// `--precision` replaces the train section's: the report says so, and a
/// misspelling is a usage error naming the choices.
#[test]
fn precision_on_the_command_line_replaces_the_models() {
    let (code, out, err) = fusec(&["check", "dsl-examples/gpt2-block.dsl"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("bf16 compute"), "{out}");
    let (code, out, err) = fusec(&[
        "check",
        "dsl-examples/gpt2-block.dsl",
        "--precision",
        "fp32",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("f32 compute"), "{out}");
    let (code, _, err) = fusec(&[
        "check",
        "dsl-examples/gpt2-block.dsl",
        "--precision",
        "half",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("expected fp32, bf16 or fp16"), "{err}");
}

/// `(step, lr, loss)` of every line of a metrics log.
fn rates(log: &Path) -> Vec<(u64, f64, String)> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["lr"].as_f64().unwrap(),
                v["loss"].to_string(),
            )
        })
        .collect()
}

/// Warmup then cosine decay, from the command line: each step's rate in
/// the log is the formula's; runs stopped in the middle of the warmup and
/// in the middle of the decay and resumed repeat the unbroken run's rates
/// and losses exactly (the decay's end, the run's last step, travels in
/// the checkpoint).
#[test]
fn a_schedule_follows_its_formula_and_resumes_exactly() {
    let sched = ["--schedule", "cosine", "--warmup", "3", "--min-lr", "1e-4"];
    let (whole, ck) = (tmp("sched-whole.jsonl"), tmp("sched.safetensors"));
    let mut args = vec!["--steps", "10", "--log", whole.to_str().unwrap()];
    args.extend_from_slice(&sched);
    let (code, _, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("learning rate: cosine(warmup=3"), "{err}");
    let want = rates(&whole);
    assert_eq!(want.len(), 10);
    for (step, lr, _) in &want {
        let f = if *step <= 3 {
            3e-3 * *step as f64 / 3.0
        } else {
            let r = (*step - 4) as f64 / 6.0;
            1e-4 + 0.5 * (1.0 + (std::f64::consts::PI * r).cos()) * (3e-3 - 1e-4)
        };
        assert!((lr - f).abs() <= 1e-15, "step {step}: lr {lr}, formula {f}");
    }
    // Stopped after step 2 (warmup) and after step 6 (decay), resumed to 10.
    for stop in [2u64, 6] {
        let log = tmp(&format!("sched-{stop}.jsonl"));
        let stop_s = stop.to_string();
        let mut a = vec![
            "--steps",
            stop_s.as_str(),
            "--save",
            ck.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
        ];
        a.extend_from_slice(&sched);
        // The first run alone does not know the whole run's end: it decays
        // to its own. Give the end explicitly, as a user resuming would.
        a.extend_from_slice(&["--decay-steps", "10"]);
        let (code, _, err) = run(&a);
        assert_eq!(code, 0, "{err}");
        let rest = (10 - stop).to_string();
        let mut b = vec![
            "--steps",
            rest.as_str(),
            "--resume",
            ck.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
        ];
        b.extend_from_slice(&sched);
        b.extend_from_slice(&["--decay-steps", "10"]);
        let (code, _, err) = run(&b);
        assert_eq!(code, 0, "{err}");
        assert_eq!(rates(&log), want, "stopped after step {stop}");
    }
}

/// Without `--decay-steps` the decay ends at the first run's last step,
/// and a resumed run keeps that end from the checkpoint.
#[test]
fn a_resumed_run_keeps_the_first_runs_decay_end() {
    let (log, ck) = (tmp("sched-end.jsonl"), tmp("sched-end.safetensors"));
    let sched = ["--schedule", "linear"];
    let mut a = vec![
        "--steps",
        "4",
        "--save",
        ck.to_str().unwrap(),
        "--log",
        log.to_str().unwrap(),
    ];
    a.extend_from_slice(&sched);
    let (code, _, err) = run(&a);
    assert_eq!(code, 0, "{err}");
    let mut b = vec![
        "--steps",
        "2",
        "--resume",
        ck.to_str().unwrap(),
        "--log",
        log.to_str().unwrap(),
    ];
    b.extend_from_slice(&sched);
    let (code, _, err) = run(&b);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("ending at step 4"), "{err}");
    let lrs: Vec<f64> = rates(&log).iter().map(|r| r.1).collect();
    // 3e-3 (SMALL's) at step 1, then down a third a step to 0 at step 4.
    let want = [3e-3, 2e-3, 1e-3, 0.0, 0.0, 0.0];
    assert_eq!(lrs.len(), 6);
    for (got, want) in lrs.iter().zip(want) {
        assert!((got - want).abs() <= 1e-15, "{lrs:?}");
    }
}

/// A schedule in the model file's `train` section: `fusec check` shows it
/// and `fusec train` follows it (warmup to the peak, then a linear decay
/// from the peak to `min_lr` at `steps`, `min_lr` after).
#[test]
fn the_model_files_schedule_is_followed() {
    let model = bigram(
        "scheduled.dsl",
        "B, T",
        " schedule = linear(warmup = 2, steps = 5, min_lr = 1e-3)\n",
    );
    let (code, out, err) = fusec(&["check", model.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("learning rate: linear(warmup=2, steps=5, min_lr=0.001)"),
        "{out}"
    );
    let log = tmp("scheduled.jsonl");
    let (code, _, err) = train_cpu(
        &model,
        &[
            "--batch",
            "2",
            "--seq",
            "8",
            "--steps",
            "6",
            "--log",
            log.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let lrs: Vec<f64> = rates(&log).iter().map(|r| r.1).collect();
    let want = [5e-3, 1e-2, 1e-2, 5.5e-3, 1e-3, 1e-3];
    for (got, want) in lrs.iter().zip(want) {
        assert!((got - want).abs() <= 1e-15, "{lrs:?}");
    }
}

/// `--gpus N --cpu`: N ranks of the CPU reference, each with B rows,
/// follow one rank with N x B rows; a checkpoint of one rank resumes on two
/// at the same window of the text.
#[test]
fn simulated_ranks_follow_one_rank_and_resume_across_rank_counts() {
    let train = |extra: &[&str]| small_gpt2_on_cpu(&[&["--precision", "fp32"], extra].concat());
    let (full, ck, two, res) = (
        tmp("dp-full.jsonl"),
        tmp("dp-ck.safetensors"),
        tmp("dp-two.jsonl"),
        tmp("dp-res.jsonl"),
    );
    train(&[
        "--batch",
        "4",
        "--steps",
        "4",
        "--log",
        full.to_str().unwrap(),
    ]);
    let err = train(&[
        "--batch",
        "2",
        "--gpus",
        "2",
        "--zero",
        "0",
        "--steps",
        "4",
        "--log",
        two.to_str().unwrap(),
    ]);
    assert!(err.contains("2 ranks meeting at each all-reduce"), "{err}");
    assert!(
        err.contains("every rank keeps the whole optimizer state"),
        "{err}"
    );
    train(&[
        "--batch",
        "4",
        "--steps",
        "2",
        "--save",
        ck.to_str().unwrap(),
    ]);
    train(&[
        "--batch",
        "2",
        "--gpus",
        "2",
        "--steps",
        "2",
        "--resume",
        ck.to_str().unwrap(),
        "--log",
        res.to_str().unwrap(),
    ]);
    let close = |a: &[String], b: &[String]| {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                let (x, y) = (loss(x), loss(y));
                (x - y).abs() <= 1e-6 * y.abs()
            })
    };
    // ZeRO stage 1: the same losses, and a checkpoint with every rank's state.
    let (zl, zck) = (tmp("dp-zero.jsonl"), tmp("dp-zero.safetensors"));
    let err = train(&[
        "--batch",
        "2",
        "--gpus",
        "2",
        "--zero",
        "1",
        "--steps",
        "4",
        "--log",
        zl.to_str().unwrap(),
        "--save",
        zck.to_str().unwrap(),
    ]);
    assert!(err.contains("saved"), "{err}");
    assert!(err.contains("ZeRO stage 1: each rank keeps"), "{err}");
    let (_, moments, _) = tensor(&zck, "wte.adam_m");
    assert_eq!(moments, vec![256, 32]);
    let full = losses(&full);
    assert!(
        close(&losses(&zl), &full),
        "{:?} against {full:?}",
        losses(&zl)
    );
    assert_eq!(full.len(), 4);
    assert!(
        close(&losses(&two), &full),
        "{:?} against {full:?}",
        losses(&two)
    );
    assert!(
        close(&losses(&res), &full[2..]),
        "{:?} against {full:?}",
        losses(&res)
    );
}

/// `fusec train` of a small gpt2-small (SMALL's sizes, T = 8) on text on
/// the CPU reference, with `extra`; its stderr, the run having succeeded.
fn small_gpt2_on_cpu(extra: &[&str]) -> String {
    let (code, _, err) = fusec(&small_gpt2_args(extra));
    assert_eq!(code, 0, "{err}");
    err
}

/// `fusec train` of the small GPT-2 on the CPU reference at T = 8, then
/// `extra`.
fn small_gpt2_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--data",
        TEXT,
        "--cpu",
        "--seq",
        "8",
    ];
    a.extend_from_slice(&SMALL[..10]);
    a.extend_from_slice(extra);
    a
}

/// ZeRO on a bf16 model: the ranks keep the parameters in bf16 and each
/// owner the f32 masters of its pieces. The run follows one rank (as
/// stored, within bf16's rounding), the checkpoint holds the masters
/// gathered whole (f32 values a bf16 cannot hold, no `.master` tensors),
/// and one rank without ZeRO resumes from it.
#[test]
fn zero_on_a_bf16_model_saves_its_masters_whole() {
    let train = small_gpt2_on_cpu;
    let (one, zl, zck, res) = (
        tmp("bf16-one.jsonl"),
        tmp("bf16-zero.jsonl"),
        tmp("bf16-zero.safetensors"),
        tmp("bf16-res.jsonl"),
    );
    train(&[
        "--batch",
        "4",
        "--steps",
        "4",
        "--log",
        one.to_str().unwrap(),
    ]);
    train(&[
        "--batch",
        "2",
        "--gpus",
        "2",
        "--zero",
        "1",
        "--steps",
        "3",
        "--log",
        zl.to_str().unwrap(),
        "--save",
        zck.to_str().unwrap(),
    ]);
    let one = losses(&one);
    let zero = losses(&zl);
    for (a, b) in zero.iter().zip(&one) {
        let (a, b) = (loss(a), loss(b));
        assert!((a - b).abs() <= 1e-2 * b.abs(), "{zero:?} against {one:?}");
    }
    let (dtype, shape, wte) = tensor(&zck, "wte");
    assert_eq!((dtype.as_str(), shape), ("F32", vec![256, 32]));
    let unrounded = wte
        .iter()
        .filter(|&&x| half::bf16::from_f64(x).to_f64() != x)
        .count();
    assert!(
        unrounded > wte.len() / 2,
        "{unrounded} of {} values are f32's",
        wte.len()
    );
    let bytes = std::fs::read(&zck).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(
        st.names().iter().all(|n| !n.ends_with(".master")),
        "{:?}",
        st.names()
    );
    train(&[
        "--batch",
        "4",
        "--steps",
        "1",
        "--resume",
        zck.to_str().unwrap(),
        "--log",
        res.to_str().unwrap(),
    ]);
    let res = losses(&res);
    assert_eq!(res.len(), 1, "{res:?}");
    let (a, b) = (loss(&res[0]), loss(&one[3]));
    assert!((a - b).abs() <= 1e-2 * b.abs(), "{res:?} against {one:?}");
    // And ZeRO resumes from it: the masters set from the checkpoint.
    let zres = tmp("bf16-zero-res.jsonl");
    train(&[
        "--batch",
        "2",
        "--gpus",
        "2",
        "--zero",
        "1",
        "--steps",
        "1",
        "--resume",
        zck.to_str().unwrap(),
        "--log",
        zres.to_str().unwrap(),
    ]);
    let zres = losses(&zres);
    assert_eq!(zres.len(), 1, "{zres:?}");
    let a = loss(&zres[0]);
    assert!((a - b).abs() <= 1e-2 * b.abs(), "{zres:?} against {one:?}");
}

#[test]
fn rank_settings_that_cannot_work_are_named() {
    // fusec train under a launcher's variables (None: removed), with or
    // without --gpus 2: the usage error it gives.
    let launched = |gpus: bool, env: &[(&str, Option<&str>)]| -> String {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_fusec"));
        c.args(["train", "dsl-examples/gpt2-small.dsl", "--data", TEXT])
            .args(SMALL);
        if gpus {
            c.args(["--gpus", "2"]);
        }
        for (k, v) in env {
            match v {
                Some(v) => c.env(k, v),
                None => c.env_remove(k),
            };
        }
        let out = c.current_dir(common::root()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{err}");
        err
    };
    // --gpus under a launcher, torchrun's and srun's variables named.
    let err = launched(true, &[("WORLD_SIZE", Some("2")), ("RANK", Some("0"))]);
    assert!(
        err.contains("--gpus 2 and torchrun's WORLD_SIZE=2"),
        "{err}"
    );
    let err = launched(
        true,
        &[
            ("WORLD_SIZE", None),
            ("SLURM_STEP_NUM_TASKS", Some("4")),
            ("SLURM_PROCID", Some("0")),
            ("SLURM_STEP_NODELIST", Some("gpu[01-02]")),
        ],
    );
    assert!(
        err.contains("--gpus 2 and srun's SLURM_STEP_NUM_TASKS=4"),
        "{err}"
    );
    // A launcher without RANK.
    let err = launched(false, &[("WORLD_SIZE", Some("2")), ("RANK", None)]);
    assert!(err.contains("RANK is not"), "{err}");
    // The CPU's ranks live in one process.
    let err = launched(false, &[("WORLD_SIZE", Some("2")), ("RANK", Some("1"))]);
    assert!(err.contains("--cpu runs its ranks in one process"), "{err}");
    // ZeRO needs ranks.
    let mut a = vec![
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--data",
        TEXT,
        "--zero",
        "1",
    ];
    a.extend_from_slice(SMALL);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--zero 1 splits the optimizer state"), "{err}");
}

/// `--val-data`: the mean loss over the first `--eval-batches` batches of
/// the validation text, with the step's weights, equals the reference
/// interpreter's in f64 over the same windows with the checkpoint's
/// weights. An fp32 model, stored and computed in f32 by the CPU
/// reference: 1e-5 relative (each token's loss carries a few hundred f32
/// roundings of 2^-24, far below it; a window more or less moves the mean
/// by about 1e-2).
#[test]
fn validation_loss_is_the_interpreters_mean_over_the_same_windows() {
    validation_against_the_interpreter("val", &["--batch", "2"]);
}

/// With data parallelism, rank 0's process validates alone over the
/// windows one GPU with the whole batch reads (two ranks of one row: four
/// whole batches are eight of a rank's), and its loss is the interpreter's
/// over them with the run's checkpoint.
#[test]
fn data_parallel_validation_reads_the_whole_batches_windows() {
    validation_against_the_interpreter("val-dp", &["--batch", "1", "--gpus", "2"]);
}

/// A run of 6 steps on `batch` (B = 2 in all), validating after steps 3 and
/// 6 over 4 batches of README.md, against the interpreter.
fn validation_against_the_interpreter(name: &str, batch: &[&str]) {
    use fusec_compiler::interp::{run, Feeds, Precision};
    use fusec_runtime::data::{load_tokens, Batches};
    let (log, ck) = (
        tmp(&format!("{name}.jsonl")),
        tmp(&format!("{name}.safetensors")),
    );
    let sets = [
        "--set",
        "vocab=256",
        "--set",
        "layers=1",
        "--set",
        "d=32",
        "--set",
        "n_heads=2",
        "--set",
        "ctx=64",
    ];
    let mut a = vec![
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--precision",
        "fp32",
        "--data",
        TEXT,
        "--seq",
        "16",
        "--steps",
        "6",
        "--val-data",
        "README.md",
        "--eval-every",
        "3",
        "--eval-batches",
        "4",
        "--log",
        log.to_str().unwrap(),
        "--save",
        ck.to_str().unwrap(),
    ];
    a.extend_from_slice(batch);
    a.extend_from_slice(&sets);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("step     3/6  val loss") && err.contains("(4 batches, 128 tokens)"),
        "{err}"
    );
    let vals: Vec<(u64, f64)> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64()?, v.get("val_loss")?.as_f64()?))
        })
        .collect();
    assert_eq!(vals.iter().map(|v| v.0).collect::<Vec<_>>(), vec![3, 6]);
    // The interpreter, in f64, on the forward graph with the saved weights.
    let (_, src) = common::example("gpt2-small.dsl");
    let opts = fusec_compiler::elaborate::Options {
        overrides: sets
            .chunks(2)
            .map(|kv| kv[1].split_once('=').unwrap())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        precision: Some(fusec_compiler::ir::DType::F32),
        ..Default::default()
    };
    let c = fusec_compiler::driver::compile(&src, "gpt2-small", &opts).unwrap();
    let g = fusec_compiler::driver::forward_graph(&c).unwrap();
    let mut feeds = Feeds {
        dims: common::dims(&[("B", 2), ("T", 16)]),
        ..Feeds::default()
    };
    for p in &g.params {
        let (_, shape, data) = tensor(&ck, &p.name);
        feeds.params.insert(
            p.name.clone(),
            fusec_compiler::interp::tensor::Tensor::new(shape, data),
        );
    }
    let tokens = load_tokens(&common::root().join("README.md")).unwrap();
    let mut src = Batches::new(tokens, 2, 16, Some(256)).unwrap();
    let mut total = 0.0;
    for _ in 0..4 {
        let b = src.next_batch();
        let t = |v: Vec<i32>| {
            fusec_compiler::interp::tensor::Tensor::new(
                vec![2, 16],
                v.into_iter().map(f64::from).collect(),
            )
        };
        feeds.inputs.insert("tokens".into(), t(b.inputs));
        feeds.inputs.insert("targets".into(), t(b.targets));
        let vals = run(&g, &feeds, Precision::F64).unwrap();
        let loss = g
            .outputs
            .iter()
            .find(|(r, _)| *r == fusec_compiler::ir::graph::Role::Loss)
            .unwrap()
            .1;
        total += vals[&loss].data[0];
    }
    let want = total / 4.0;
    let got = vals[1].1;
    assert!(
        (got - want).abs() <= 1e-5 * want,
        "fusec {got}, interpreter {want}"
    );
}

/// `--schedule inverse_sqrt`: a linear warmup to lr, then lr * sqrt(warmup
/// / step), step by step in the log; without a warmup it is refused.
#[test]
fn inverse_sqrt_schedule_as_logged() {
    let log = tmp("inverse-sqrt.jsonl");
    let log_s = log.to_str().unwrap();
    small_gpt2_on_cpu(&[
        "--batch",
        "2",
        "--steps",
        "6",
        "--schedule",
        "inverse_sqrt",
        "--warmup",
        "3",
        "--lr",
        "0.002",
        "--log",
        log_s,
    ]);
    let text = std::fs::read_to_string(&log).unwrap();
    let rates: Vec<f64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("lr").and_then(|r| r.as_f64()))
        .collect();
    assert_eq!(rates.len(), 6, "{text}");
    for (i, r) in rates.iter().enumerate() {
        let step = (i + 1) as f64;
        let want = if step <= 3.0 {
            0.002 * step / 3.0
        } else {
            0.002 * (3.0 / step).sqrt()
        };
        assert!(
            (r - want).abs() <= 1e-12 * want,
            "step {step}: {r} vs {want}"
        );
    }
    let mut a = vec![
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--data",
        TEXT,
        "--cpu",
        "--seq",
        "8",
        "--batch",
        "2",
        "--steps",
        "1",
        "--schedule",
        "inverse_sqrt",
    ];
    a.extend_from_slice(&SMALL[..10]);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("needs --warmup of at least 1 step"), "{err}");
}

/// ZeRO on a model without gradient clipping (the translator): a rank that
/// owns no piece of a parameter reads nothing of its gradient's mean, and
/// must still take part in the reduce, or the other rank waits for it (on
/// the CPU ranks the sizes of their all-reduces part; on GPUs NCCL hangs).
/// Two ZeRO ranks train as two ranks that keep everything whole.
#[test]
fn zero_ranks_take_part_in_every_reduce_without_clipping() {
    let run = |zero: &str, log: &Path| {
        let (code, _, err) = fusec(&[
            "train",
            "dsl-examples/translator.dsl",
            "--cpu",
            "--gpus",
            "2",
            "--zero",
            zero,
            "--data",
            "random",
            "--batch",
            "4",
            "--dim",
            "S=8",
            "--dim",
            "T=8",
            "--set",
            "d=32",
            "--set",
            "layers=1",
            "--set",
            "n_heads=2",
            "--set",
            "ffn=64",
            "--set",
            "vocab=100",
            "--steps",
            "3",
            "--log",
            log.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "--zero {zero}: {err}");
        losses(log)
    };
    let whole = run("0", &tmp("translator-zero0.jsonl"));
    let split = run("1", &tmp("translator-zero1.jsonl"));
    assert_eq!(whole.len(), 3);
    assert_eq!(split, whole);
    // Stage 2: each gradient reduced into its owners' pieces, which the
    // update reads as they are: the same arithmetic, the same bits.
    let sharded = run("2", &tmp("translator-zero2.jsonl"));
    assert_eq!(sharded, whole);
    // Stage 3: the weights kept in pieces and gathered before each pass
    // reads them (f32 here: the gather moves the values as they are).
    let gathered = run("3", &tmp("translator-zero3.jsonl"));
    assert_eq!(gathered, whole);
}

/// ZeRO stage 2's and stage 3's checkpoints are the file stage 1 writes,
/// bit for bit (the same arithmetic: each piece's mean is the one stage 1
/// reads in place; stage 3's gathered weights are the casts of the pieces
/// stage 1's owners round), and they resume on another number of ranks at
/// another stage: on one rank without ZeRO, on three at stage 2, on three
/// at stage 3.
#[test]
fn zero_two_and_three_checkpoint_as_stage_one_and_resume_anywhere() {
    let train = small_gpt2_on_cpu;
    let (ck1, ck2, ck3) = (
        tmp("z1.safetensors"),
        tmp("z2.safetensors"),
        tmp("z3.safetensors"),
    );
    for (z, ck) in [("1", &ck1), ("2", &ck2), ("3", &ck3)] {
        train(&[
            "--batch",
            "2",
            "--gpus",
            "2",
            "--zero",
            z,
            "--steps",
            "3",
            "--save",
            ck.to_str().unwrap(),
        ]);
    }
    let b1 = std::fs::read(&ck1).unwrap();
    let s1 = safetensors::SafeTensors::deserialize(&b1).unwrap();
    let mut names = s1.names();
    names.sort();
    assert!(names.iter().any(|n| n.ends_with(".adam_m")), "{names:?}");
    for (stage, ck) in [("2", &ck2), ("3", &ck3)] {
        let b = std::fs::read(ck).unwrap();
        let s = safetensors::SafeTensors::deserialize(&b).unwrap();
        let mut other = s.names();
        other.sort();
        assert_eq!(names, other, "stage {stage}");
        for &n in &names {
            let (a, b) = (s1.tensor(n).unwrap(), s.tensor(n).unwrap());
            assert_eq!(a.shape(), b.shape(), "stage {stage}: {n}");
            assert!(
                a.data() == b.data(),
                "stage {stage}: {n} differs from stage 1's"
            );
        }
    }
    for (k, (ck, extra)) in [
        (&ck2, &["--batch", "4"][..]),
        (&ck2, &["--batch", "2", "--gpus", "3", "--zero", "2"][..]),
        (&ck3, &["--batch", "4"][..]),
        (&ck3, &["--batch", "2", "--gpus", "3", "--zero", "3"][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let log = tmp(&format!("z23-resumed-{k}.jsonl"));
        let mut a = extra.to_vec();
        a.extend([
            "--steps",
            "1",
            "--resume",
            ck.to_str().unwrap(),
            "--log",
            log.to_str().unwrap(),
        ]);
        train(&a);
        let l = losses(&log);
        assert_eq!(l.len(), 1, "{extra:?}: {l:?}");
        assert!(loss(&l[0]).is_finite(), "{extra:?}: {l:?}");
    }
}

/// A memory budget over ZeRO ranks: every rank's step is fitted with one
/// choice (said once), and the run is the run without it, bit for bit
/// (recomputing changes no arithmetic).
#[test]
fn a_memory_budget_fits_every_zero_ranks_step() {
    // Three CPU ranks at stage 2 training a small GPT-2 for `steps` steps.
    let job = |steps: &'static str| -> Vec<&'static str> {
        vec![
            "train",
            "dsl-examples/gpt2-small.dsl",
            "--cpu",
            "--gpus",
            "3",
            "--zero",
            "2",
            "--data",
            TEXT,
            "--set",
            "layers=2",
            "--set",
            "d=64",
            "--set",
            "n_heads=2",
            "--set",
            "vocab=256",
            "--set",
            "ctx=64",
            "--batch",
            "2",
            "--seq",
            "64",
            "--steps",
            steps,
        ]
    };
    let run = |budget: Option<&str>, log: &Path| {
        let mut a = job("3");
        a.extend(["--log", log.to_str().unwrap()]);
        if let Some(b) = budget {
            a.extend(["--memory-budget", b]);
        }
        let (code, _, err) = fusec(&a);
        assert_eq!(code, 0, "{budget:?}: {err}");
        (losses(log), err)
    };
    let (plain, _) = run(None, &tmp("budget-ranks-none.jsonl"));
    // Each rank's arena is 1.45 MiB as it is, at least 1.25 with every
    // activation it may drop recomputed.
    let (fitted, err) = run(Some("1.35MiB"), &tmp("budget-ranks-fit.jsonl"));
    assert_eq!(
        err.matches("each rank's step, recompute for a memory budget of 1.3 MiB")
            .count(),
        1,
        "{err}"
    );
    assert_eq!(plain.len(), 3);
    assert_eq!(fitted, plain);
    let mut a = job("1");
    a.extend(["--memory-budget", "0.5MiB"]);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("the memory budget of 512.0 KiB cannot be met"),
        "{err}"
    );
}

/// `--zero 2` splits the gradients over ranks: without ranks it is
/// refused, saying what to give.
#[test]
fn zero_two_needs_ranks() {
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/gpt2-small.dsl",
        "--cpu",
        "--zero",
        "2",
        "--data",
        "random",
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "1",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--zero 2 splits the optimizer state and the gradients over data-parallel ranks: give --gpus N"),
        "{err}"
    );
    let (code, _, err) = fusec(&["build", "dsl-examples/gpt2-small.dsl", "--zero", "3"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--zero 3 splits the optimizer state, the gradients and the weights over data-parallel ranks"),
        "{err}"
    );
    let (code, _, err) = fusec(&["build", "dsl-examples/gpt2-small.dsl", "--zero", "4"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--zero"), "{err}");
}

/// `--save-grads` writes the gradients the update read: with plain SGD the
/// update is -lr g, so each saved gradient is (old - new) / lr, up to the
/// f32 rounding of the weights (2^-24 of 0.5 over lr = 0.1: 3e-7 of a
/// gradient of size 1, bound 1e-5). In fp16 the loss scale is divided out,
/// and with two micro-batches it is the gradient of their mean loss.
#[test]
fn save_grads_holds_the_gradients_the_update_read() {
    for (label, precision, micro) in [("f32", "f32", 1), ("fp16", "f16", 1), ("micro", "f32", 2)] {
        let model = tmp(&format!("grads-{label}.dsl"));
        std::fs::write(
            &model,
            format!(
                "dim B\ninput x: f32[B, 4]\ninput y: i32[B]\nparam w: [4, 3] = normal(0.5)\nparam b: [3] = normal(0.5)\n\
                 train {{\n loss = cross_entropy(linear(x, w, b), y)\n optimizer = sgd(lr = 0.1)\n precision = {precision}\n micro_batches = {micro}\n}}\n"
            ),
        )
        .unwrap();
        let (init, last, grads) = (
            tmp(&format!("grads-{label}-init.safetensors")),
            tmp(&format!("grads-{label}-last.safetensors")),
            tmp(&format!("grads-{label}-grads.safetensors")),
        );
        let (code, _, err) = fusec(&[
            "train",
            model.to_str().unwrap(),
            "--cpu",
            "--data",
            "random",
            "--batch",
            "6",
            "--steps",
            "1",
            "--save-init",
            init.to_str().unwrap(),
            "--save",
            last.to_str().unwrap(),
            "--save-grads",
            grads.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{label}: {err}");
        assert!(err.contains("saved the gradients of step 1"), "{err}");
        for name in ["w", "b"] {
            let (_, shape, g) = tensor(&grads, name);
            let (_, want_shape, old) = tensor(&init, name);
            let (_, _, new) = tensor(&last, name);
            assert_eq!(shape, want_shape, "{label}: {name}");
            let top = g.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            assert!(top > 1e-3, "{label}: {name}'s gradient is {g:?}");
            for ((g, o), n) in g.iter().zip(&old).zip(&new) {
                let from_update = (o - n) / 0.1;
                assert!(
                    (g - from_update).abs() <= 1e-5 * top.max(1.0),
                    "{label}: {name}: saved {g}, the update moved by {from_update}"
                );
            }
        }
    }
    // Several GPUs cannot save one gradient: refused before anything runs.
    let (code, _, err) = fusec(&[
        "train",
        "dsl-examples/mlp.dsl",
        "--gpus",
        "2",
        "--data",
        "random",
        "--save-grads",
        "g.safetensors",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("'--gpus <N>' cannot be used with '--save-grads <FILE>'"),
        "{err}"
    );
}

/// ZeRO stage 3 with what a run adds to the step: fp16 with its loss
/// scaling (the gathers move fp16 casts of the f32 pieces, as stage 1's
/// owners round their masters), `--deterministic`, a warm-up and cosine
/// schedule: three CPU ranks at stage 3 follow three at stage 1 bit for
/// bit (the same arithmetic on the same values). (Micro-batches and
/// clipping: tests/ranks_cpu.rs.)
#[test]
fn zero_three_with_fp16_and_schedules_follows_stage_one() {
    let run = |zero: &str, extra: &[&str], log: &Path| {
        let mut a = vec![
            "--gpus", "3", "--zero", zero, "--batch", "2", "--steps", "4",
        ];
        a.extend(["--log", log.to_str().unwrap()]);
        a.extend_from_slice(extra);
        small_gpt2_on_cpu(&a);
        losses(log)
    };
    for (k, extra) in [
        &["--precision", "fp16"][..],
        &["--deterministic", "--schedule", "cosine", "--warmup", "2"][..],
    ]
    .into_iter()
    .enumerate()
    {
        let one = run("1", extra, &tmp(&format!("z3-follows-{k}-one.jsonl")));
        let three = run("3", extra, &tmp(&format!("z3-follows-{k}-three.jsonl")));
        assert_eq!(one.len(), 4, "{extra:?}");
        assert_eq!(three, one, "{extra:?}");
    }
}

/// Hybrid sharding from the command line: `--gpus 4 --shard-within 2`
/// (two groups of two ranks, each group holding every piece) follows
/// `--gpus 4` over all four at stages 1 and 3 (losses within 1e-6
/// relative: only the order of the gradient norm's partial sums differs),
/// says how it splits, and writes the checkpoint the whole-job run writes
/// (the same names and shapes, values within 1e-6), which resumes on one
/// rank and on two at stage 3. One process's ranks are one host's:
/// `--shard-within host` there splits over all of them.
#[test]
fn shard_within_groups_follows_the_whole_job_and_checkpoints_alike() {
    let run = |zero: &str, within: Option<&str>, name: &str| {
        let (log, ck) = (
            tmp(&format!("{name}.jsonl")),
            tmp(&format!("{name}.safetensors")),
        );
        let mut a = vec![
            "--gpus", "4", "--zero", zero, "--batch", "2", "--steps", "3",
        ];
        if let Some(w) = within {
            a.extend(["--shard-within", w]);
        }
        a.extend([
            "--log",
            log.to_str().unwrap(),
            "--save",
            ck.to_str().unwrap(),
        ]);
        let err = small_gpt2_on_cpu(&a);
        (losses(&log), std::fs::read(&ck).unwrap(), err)
    };
    for zero in ["1", "3"] {
        let (whole, ck_whole, err_whole) = run(zero, None, &format!("hsdp-{zero}-all"));
        let (hybrid, ck_hybrid, err) = run(zero, Some("2"), &format!("hsdp-{zero}-2"));
        assert!(
            err.contains("split over groups of 2 ranks, 2 groups holding the same pieces"),
            "{err}"
        );
        assert!(!err_whole.contains("groups of"), "{err_whole}");
        assert_eq!(whole.len(), 3);
        for (a, b) in hybrid.iter().zip(&whole) {
            let (a, b) = (loss(a), loss(b));
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "stage {zero}: {a} against {b}"
            );
        }
        let (s, t) = (
            safetensors::SafeTensors::deserialize(&ck_whole).unwrap(),
            safetensors::SafeTensors::deserialize(&ck_hybrid).unwrap(),
        );
        let (mut names, mut other) = (s.names(), t.names());
        names.sort();
        other.sort();
        assert_eq!(names, other, "stage {zero}");
        for n in names {
            let (a, b) = (s.tensor(n).unwrap(), t.tensor(n).unwrap());
            assert_eq!(a.shape(), b.shape(), "{n}");
            let f = |d: &[u8]| -> Vec<f32> {
                d.chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            };
            for (x, y) in f(a.data()).iter().zip(f(b.data())) {
                assert!(
                    (x - y).abs() <= 1e-6 * x.abs().max(1.0),
                    "{n}: {x} against {y}"
                );
            }
        }
    }
    let ck = tmp("hsdp-3-2.safetensors");
    for (k, extra) in [
        &["--batch", "8"][..],
        &["--batch", "4", "--gpus", "2", "--zero", "3"][..],
    ]
    .into_iter()
    .enumerate()
    {
        let log = tmp(&format!("hsdp-resumed-{k}.jsonl"));
        let mut a = extra.to_vec();
        a.extend(["--steps", "1", "--resume", ck.to_str().unwrap()]);
        a.extend(["--log", log.to_str().unwrap()]);
        small_gpt2_on_cpu(&a);
        assert!(loss(&losses(&log)[0]).is_finite(), "{extra:?}");
    }
    let err = small_gpt2_on_cpu(&[
        "--gpus",
        "2",
        "--zero",
        "2",
        "--batch",
        "2",
        "--steps",
        "1",
        "--shard-within",
        "host",
    ]);
    assert!(!err.contains("groups of"), "one process is one host: {err}");
}

/// `--shard-within` asks for what the job can give, or says why not.
#[test]
fn shard_within_refuses_what_the_job_cannot_split() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--gpus", "4", "--shard-within", "3"],
            "groups of 3 ranks, which do not divide the job's 4",
        ),
        (
            &["--gpus", "4", "--shard-within", "8"],
            "groups of 8 ranks, which do not divide the job's 4",
        ),
        (&["--shard-within", "2"], "give --gpus N (N >= 2)"),
        (
            &["--gpus", "2", "--zero", "0", "--shard-within", "host"],
            "--zero 0 splits nothing",
        ),
        (
            &["--gpus", "2", "--shard-within", "1"],
            "not host, all or a number of ranks (2 or more)",
        ),
    ];
    for (extra, want) in cases {
        let mut a = small_gpt2_args(&["--steps", "1", "--batch", "2"]);
        a.extend_from_slice(extra);
        let (code, _, err) = fusec(&a);
        assert_ne!(code, 0, "{extra:?}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
}
