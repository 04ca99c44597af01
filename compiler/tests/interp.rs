//! The reference interpreter: optimizer updates as PyTorch defines them,
//! rounding to the stored dtype, and whole training steps that learn.

use fusec_compiler::driver::compile;
use fusec_compiler::elaborate::Options;
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::step::train_step;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{round_to, run, Feeds, Precision};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::DType;
use std::collections::HashMap;

fn compiled(src: &str) -> fusec_compiler::driver::Compiled {
    compile(src, "t", &Options::default()).unwrap_or_else(|f| panic!("{}", f.render("t.dsl", src)))
}

/// Every parameter of `a` within `tol` of `b`'s, element by element.
fn assert_params_close(a: &Feeds, b: &Feeds, tol: f64) {
    for (name, p) in &b.params {
        let err = p
            .data
            .iter()
            .zip(&a.params[name].data)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(err < tol, "{name}: {err}");
    }
}

#[test]
fn adamw_matches_the_pytorch_formula() {
    // loss = sum(p * 0.5): the gradient of every entry is 0.5.
    let src = "param p: [1, 2] = ones\ntrain {\n loss = sum(p * 0.5)\n optimizer = adamw(lr = 0.1, betas = (0.9, 0.999), eps = 1e-8, weight_decay = 0.1)\n}\n";
    let c = compiled(src);
    let mut feeds = random_feeds(&c.training, &HashMap::new(), 1).unwrap();
    train_step(&c.training, &mut feeds, 0.1, 1, Precision::F64).unwrap();
    // torch.optim.AdamW, step 1: p *= 1 - lr*wd; m = 0.05; v = 0.00025;
    // p -= lr * (m / 0.1) / (sqrt(v / 0.001) + eps) = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8)
    let expected = 0.99 - 0.1 * 0.5 / (0.5 + 1e-8);
    for &x in &feeds.params["p"].data {
        assert!((x - expected).abs() < 1e-12, "{x} vs {expected}");
    }
    assert!((feeds.state["p.adam_m"].data[0] - 0.05).abs() < 1e-12);
    assert!((feeds.state["p.adam_v"].data[0] - 0.00025).abs() < 1e-12);
}

#[test]
fn weight_decay_skips_vectors() {
    let src = "param w: [2, 2] = ones\nparam b: [2] = ones\ntrain {\n loss = sum(w * 0.0) + sum(b * 0.0)\n optimizer = adamw(lr = 0.5, weight_decay = 0.1)\n}\n";
    let c = compiled(src);
    let mut feeds = random_feeds(&c.training, &HashMap::new(), 1).unwrap();
    train_step(&c.training, &mut feeds, 0.5, 1, Precision::F64).unwrap();
    assert!(
        (feeds.params["w"].data[0] - 0.95).abs() < 1e-12,
        "matrices decay"
    );
    assert_eq!(feeds.params["b"].data[0], 1.0, "vectors do not");
}

#[test]
fn sgd_momentum_and_clipping() {
    // Gradient 3 on one entry and 4 on the other: norm 5, clipped to 1.
    let src = "param p: [2] = zeros\nparam k: [2] = zeros\ntrain {\n loss = sum(p * (k + 1) * 3) + 0.0 * sum(k)\n optimizer = sgd(lr = 1.0, momentum = 0.9)\n clip_grad_norm = 1.0\n}\n";
    let c = compiled(src);
    let mut feeds = random_feeds(&c.training, &HashMap::new(), 1).unwrap();
    let r = train_step(&c.training, &mut feeds, 1.0, 1, Precision::F64).unwrap();
    // dp = 3, 3; dk = 3 p = 0: norm = sqrt(18).
    let norm = 18f64.sqrt();
    assert!((r.grad_norm.unwrap() - norm).abs() < 1e-12);
    let coef = 1.0 / (norm + 1e-6);
    assert!((feeds.params["p"].data[0] + 3.0 * coef).abs() < 1e-12);
    assert!((feeds.state["p.momentum"].data[0] - 3.0 * coef).abs() < 1e-12);
    train_step(&c.training, &mut feeds, 1.0, 2, Precision::F64).unwrap();
    // Second step: buf = 0.9 * buf + g.
    let p = feeds.params["p"].data[0];
    assert!(p < -3.0 * coef, "momentum carries the first step: {p}");
}

#[test]
fn as_stored_rounds_each_value_to_its_dtype() {
    assert_eq!(round_to(DType::BF16, 1.0 + 1.0 / 512.0), 1.0);
    assert_eq!(round_to(DType::F16, 1.0 + 1.0 / 4096.0), 1.0);
    assert_ne!(round_to(DType::F32, 1.0 + 1.0 / 4096.0), 1.0);
    let src = "param a: [1] = ones\ntrain {\n loss = sum(a * 1.001)\n precision = bf16\n}\n";
    let c = compiled(src);
    let feeds = random_feeds(&c.model.graph, &HashMap::new(), 1).unwrap();
    let loss = c.model.graph.output(&Role::Loss).unwrap();
    let exact = run(&c.model.graph, &feeds, Precision::F64).unwrap()[&loss].data[0];
    let stored = run(&c.model.graph, &feeds, Precision::AsStored).unwrap()[&loss].data[0];
    assert!((exact - 1.001).abs() < 1e-12);
    assert_eq!(stored, 1.0, "1.001 is 1.0 in bf16");
}

#[test]
fn feeds_are_checked() {
    let src = "dim B\ninput x: f32[B, 3]\nparam w: [3, 2] = ones\ntrain {\n loss = sum(x @ w)\n}\n";
    let c = compiled(src);
    let dims: HashMap<String, i64> = [("B".to_string(), 2)].into();
    let mut feeds = random_feeds(&c.model.graph, &dims, 1).unwrap();
    feeds.inputs.insert("x".into(), Tensor::zeros(&[2, 4]));
    let err = run(&c.model.graph, &feeds, Precision::F64).unwrap_err();
    assert!(
        err.0.contains("input `x` should have shape [2, 3]"),
        "{err}"
    );
    feeds.dims.clear();
    let err = run(&c.model.graph, &feeds, Precision::F64).unwrap_err();
    assert!(err.0.contains("no size given for dimension B"), "{err}");
}

#[test]
fn slices_past_the_end_at_run_time_are_errors() {
    let src = "dim T\ninput t: i32[T]\nparam pos: [4, 2] = ones\nparam e: [5, 2] = ones\ntrain {\n loss = sum(embedding(e, t) + pos[0:T])\n}\n";
    let c = compiled(src);
    let dims: HashMap<String, i64> = [("T".to_string(), 6)].into();
    let feeds = random_feeds(&c.model.graph, &dims, 1).unwrap();
    let err = run(&c.model.graph, &feeds, Precision::F64).unwrap_err();
    assert!(
        err.0
            .contains("slice 0:T is out of range for an axis of size 4"),
        "{err}"
    );
}

/// A model file, its `--set` overrides and its dimension sizes.
type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [(&'a str, i64)]);

/// Ten steps of each small model on one fixed batch: the loss must fall.
#[test]
fn training_steps_reduce_the_loss() {
    let cases: &[Case] = &[
        (
            "mlp.dsl",
            &[("d_in", "6"), ("d_hidden", "16"), ("classes", "5")],
            &[("B", 8)],
        ),
        (
            "gpt2-small.dsl",
            &[
                ("vocab", "17"),
                ("ctx", "8"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
            ],
            &[("B", 2), ("T", 6)],
        ),
        (
            "llama-small.dsl",
            &[
                ("vocab", "17"),
                ("d", "16"),
                ("n_heads", "4"),
                ("n_kv_heads", "2"),
                ("ffn", "24"),
                ("layers", "1"),
            ],
            &[("B", 2), ("T", 6)],
        ),
    ];
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("dsl-examples");
    for (file, sets, dims) in cases {
        let src = std::fs::read_to_string(root.join(file)).unwrap();
        let opts = Options {
            overrides: sets
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Options::default()
        };
        let c = compile(&src, file, &opts).unwrap_or_else(|f| panic!("{}", f.render(file, &src)));
        let dims: HashMap<String, i64> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let mut feeds = random_feeds(&c.training, &dims, 3).unwrap();
        let lr = c.model.train.optimizer.lr().max(1e-2);
        let first = train_step(&c.training, &mut feeds, lr, 1, Precision::AsStored)
            .unwrap()
            .loss;
        let mut last = first;
        for step in 2..=10 {
            last = train_step(&c.training, &mut feeds, lr, step, Precision::AsStored)
                .unwrap()
                .loss;
        }
        assert!(last < first * 0.9, "{file}: loss {first} -> {last}");
    }
}

/// Two micro-batches of B rows, accumulated, make the same update as one
/// batch of 2B rows: the LLaMA-style model (micro_batches = 2, gradient
/// clipping, AdamW) against itself with one micro-batch, in f64.
#[test]
fn micro_batches_accumulate_into_one_update() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../dsl-examples/llama-small.dsl"
    );
    let src = std::fs::read_to_string(path).unwrap();
    assert!(src.contains("micro_batches = 2"));
    let single = src.replace("micro_batches = 2", "micro_batches = 1");
    let sets = [
        ("vocab", "23"),
        ("d", "16"),
        ("n_heads", "4"),
        ("n_kv_heads", "2"),
        ("ffn", "24"),
        ("layers", "1"),
    ];
    let opts = Options {
        overrides: sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Options::default()
    };
    let two = compile(&src, "llama", &opts).unwrap().training;
    let one = compile(&single, "llama", &opts).unwrap().training;
    let (b, t) = (2usize, 5usize);
    let dims2 = HashMap::from([("B".to_string(), b as i64), ("T".to_string(), t as i64)]);
    let dims4 = HashMap::from([("B".to_string(), 2 * b as i64), ("T".to_string(), t as i64)]);
    let mut big = random_feeds(&one, &dims4, 4).unwrap();
    let mut small = random_feeds(&two, &dims2, 4).unwrap();
    small.params = big.params.clone();
    let half = |name: &str, k: usize| {
        let all = &big.inputs[name].data;
        Tensor::new(vec![b, t], all[k * b * t..(k + 1) * b * t].to_vec())
    };
    let mut losses = Vec::new();
    for (k, apply) in [(0, 0.0), (1, 1.0)] {
        for name in ["tokens", "targets"] {
            small.inputs.insert(name.into(), half(name, k));
        }
        small
            .inputs
            .insert("update.apply".into(), Tensor::scalar(apply));
        losses.push(
            train_step(&two, &mut small, 1e-2, 1, Precision::F64)
                .unwrap()
                .loss,
        );
        if k == 0 {
            // Nothing is applied before the last micro-batch.
            assert_eq!(small.params, big.params);
        }
    }
    let whole = train_step(&one, &mut big, 1e-2, 1, Precision::F64)
        .unwrap()
        .loss;
    assert!(((losses[0] + losses[1]) / 2.0 - whole).abs() < 1e-12);
    assert_params_close(&small, &big, 1e-9);
    // The accumulators are cleared after the update.
    for (name, s) in &small.state {
        if name.ends_with(".grad_acc") {
            assert!(s.data.iter().all(|&x| x == 0.0), "{name}");
        }
    }
}

/// fp16 loss scaling: the backward pass starts from the loss scale and the
/// update divides it out, so in exact arithmetic the step equals the fp32
/// model's; an overflow (a scale too large for fp16) skips the update.
#[test]
fn fp16_loss_scaling_cancels_and_overflow_skips_the_step() {
    let model = |precision: &str| {
        format!(
            "dim B\ninput x: f32[B, 4]\ninput y: i32[B]\nparam w: [4, 3] = normal(0.5)\nparam b: [3] = zeros\n\
             train {{\n loss = cross_entropy(x @ w + b, y)\n optimizer = adamw(lr = 0.1)\n clip_grad_norm = 0.5\n precision = {precision}\n}}\n"
        )
    };
    let half = compiled(&model("fp16")).training;
    let full = compiled(&model("fp32")).training;
    let dims = HashMap::from([("B".to_string(), 5)]);
    let mut a = random_feeds(&half, &dims, 2).unwrap();
    let mut b = random_feeds(&full, &dims, 2).unwrap();
    b.params = a.params.clone();
    b.inputs.extend(
        a.inputs
            .iter()
            .filter(|(k, _)| !k.starts_with("update."))
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    a.inputs
        .insert("update.loss_scale".into(), Tensor::scalar(1024.0));
    let ra = train_step(&half, &mut a, 0.1, 1, Precision::F64).unwrap();
    let rb = train_step(&full, &mut b, 0.1, 1, Precision::F64).unwrap();
    assert!((ra.grad_norm.unwrap() - rb.grad_norm.unwrap()).abs() < 1e-12);
    assert_params_close(&a, &b, 1e-12);
    // A scale that overflows fp16 when values are rounded as stored.
    let before = a.params.clone();
    a.inputs
        .insert("update.loss_scale".into(), Tensor::scalar(1e30));
    let r = train_step(&half, &mut a, 0.1, 2, Precision::AsStored).unwrap();
    assert!(!r.grad_norm.unwrap().is_finite(), "{:?}", r.grad_norm);
    // Unchanged, but for being stored as f32.
    for (name, p) in &before {
        let stored: Vec<f64> = p.data.iter().map(|&x| round_to(DType::F32, x)).collect();
        assert_eq!(
            a.params[name].data, stored,
            "{name}: an overflowing step must not change the weights"
        );
    }
}

/// fp16 with micro-batches: one loss scale over a step's micro-batches,
/// divided out once, so in exact arithmetic the step equals the fp32
/// model's; an overflow skips the update and still clears the gradient
/// sums (to zeros, not NaN), so the step after it is as if the skipped one
/// never ran.
#[test]
fn fp16_micro_batches_share_the_scale_and_an_overflow_clears_the_sums() {
    let model = |precision: &str| {
        format!(
            "dim B\ninput x: f32[B, 4]\ninput y: i32[B]\nparam w: [4, 3] = normal(0.5)\nparam b: [3] = zeros\n\
             train {{\n loss = cross_entropy(x @ w + b, y)\n optimizer = adamw(lr = 0.1)\n clip_grad_norm = 0.5\n precision = {precision}\n micro_batches = 2\n}}\n"
        )
    };
    let half = compiled(&model("fp16")).training;
    let full = compiled(&model("fp32")).training;
    let dims = HashMap::from([("B".to_string(), 5)]);
    let mut a = random_feeds(&half, &dims, 6).unwrap();
    let mut b = random_feeds(&full, &dims, 6).unwrap();
    b.params = a.params.clone();
    let batch = |k: u64| random_feeds(&full, &dims, 100 + k).unwrap().inputs;
    // Two micro-batches of the step: (apply, batch).
    let step = |f: &mut Feeds,
                g: &fusec_compiler::ir::Graph,
                scale: Option<f64>,
                t: u64,
                precision: Precision| {
        let mut r = None;
        for (k, apply) in [(0, 0.0), (1, 1.0)] {
            for (name, v) in batch(2 * t + k) {
                if !name.starts_with("update.") {
                    f.inputs.insert(name, v);
                }
            }
            f.inputs
                .insert("update.apply".into(), Tensor::scalar(apply));
            if let Some(s) = scale {
                f.inputs
                    .insert("update.loss_scale".into(), Tensor::scalar(s));
            }
            r = Some(train_step(g, f, 0.1, t, precision).unwrap());
        }
        r.unwrap()
    };
    let ra = step(&mut a, &half, Some(1024.0), 1, Precision::F64);
    let rb = step(&mut b, &full, None, 1, Precision::F64);
    assert!((ra.grad_norm.unwrap() - rb.grad_norm.unwrap()).abs() < 1e-12);
    assert_params_close(&a, &b, 1e-12);
    // A scale that overflows fp16 when values are rounded as stored.
    let before = a.clone();
    let r = step(&mut a, &half, Some(1e30), 2, Precision::AsStored);
    assert!(!r.grad_norm.unwrap().is_finite(), "{:?}", r.grad_norm);
    for (name, p) in &before.params {
        let stored: Vec<f64> = p.data.iter().map(|&x| round_to(DType::F32, x)).collect();
        assert_eq!(
            a.params[name].data, stored,
            "{name}: the update was skipped"
        );
    }
    for (name, s) in &a.state {
        if name.ends_with(".grad_acc") {
            assert!(s.data.iter().all(|&x| x == 0.0), "{name}: {:?}", s.data);
        }
    }
    // The next step from there equals the fp32 model's step from the same
    // weights and moments.
    b.params = a.params.clone();
    b.state = a.state.clone();
    step(&mut a, &half, Some(1024.0), 2, Precision::F64);
    step(&mut b, &full, None, 2, Precision::F64);
    assert_params_close(&a, &b, 1e-12);
}

/// Initial values filled in chunks from their position in the parameter's
/// stream equal the values filled in one go (what lets the runtime
/// initialise large parameters in parallel), and parameters differ.
#[test]
fn chunked_initialisation_matches_sequential() {
    use fusec_compiler::interp::random::{init_param, init_values};
    use fusec_compiler::ir::graph::Init;
    for init in [
        Init::Normal { std: 0.02 },
        Init::Uniform { bound: 0.5 },
        Init::Constant(0.25),
    ] {
        let whole = init_param(&init, &[1000], 7, 3);
        let mut parts = vec![0.0; 1000];
        for (k, chunk) in parts.chunks_mut(137).enumerate() {
            init_values(&init, 7, 3, k * 137, chunk);
        }
        assert_eq!(whole.data, parts, "{init}");
        let other = init_param(&init, &[1000], 7, 4);
        assert!(matches!(init, Init::Constant(_)) || other.data != whole.data);
    }
}
