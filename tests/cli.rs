//! The `fusec` command as a person runs it.

mod common;

use common::fusec;

#[test]
fn check_reports_gpt2_small_parameter_count() {
    let (code, out, err) = fusec(&["check", "dsl-examples/gpt2-small.dsl"]);
    assert_eq!(code, 0, "{err}");
    // The count PyTorch gives for GPT-2 small with tied embeddings.
    assert!(out.contains("total: 124,439,808 parameters"), "{out}");
    assert!(out.contains("tokens               i32[B, T]"), "{out}");
    assert!(out.contains("h.11.mlp.c_proj_w"), "{out}");
}

#[test]
fn set_overrides_a_constant() {
    let (code, out, err) = fusec(&["check", "dsl-examples/gpt2-small.dsl", "--set", "layers=2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("h.1.mlp.c_proj_w") && !out.contains("h.2."),
        "{out}"
    );
    let (code, _, err) = fusec(&["check", "dsl-examples/gpt2-small.dsl", "--set", "nope=2"]);
    assert_eq!(code, 2);
    assert!(err.contains("no top-level constant `nope`"), "{err}");
    let (code, _, err) = fusec(&["check", "dsl-examples/gpt2-small.dsl", "--set", "layers"]);
    assert_eq!(code, 2);
    assert!(err.contains("NAME=VALUE"), "{err}");
}

#[test]
fn build_writes_every_stage() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-build-{}", std::process::id()));
    let (code, out, err) = fusec(&["build", "dsl-examples/mlp.dsl", "-o", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    for f in ["forward.txt", "backward.txt", "train.txt", "train.dot"] {
        let p = dir.join(f);
        assert!(p.exists(), "{} missing; stdout:\n{out}", p.display());
    }
    let train = std::fs::read_to_string(dir.join("train.txt")).unwrap();
    assert!(
        train.contains("= sgd(") && train.contains("backward:"),
        "{train}"
    );
    let dot = std::fs::read_to_string(dir.join("train.dot")).unwrap();
    assert!(dot.starts_with("digraph \"mlp\" {"), "{dot}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn every_shipped_model_checks_and_builds() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-all-{}", std::process::id()));
    let mut files: Vec<_> = std::fs::read_dir(common::root().join("dsl-examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "dsl"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    for f in files {
        let f = f.to_str().unwrap();
        let (code, _, err) = fusec(&["check", f]);
        assert_eq!(code, 0, "check {f}: {err}");
        let out = dir.join(std::path::Path::new(f).file_stem().unwrap());
        let (code, _, err) = fusec(&["build", f, "-o", out.to_str().unwrap()]);
        assert_eq!(code, 0, "build {f}: {err}");
        assert!(out.join("optimized.txt").exists());
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn build_writes_kernels_plan_and_report_for_given_sizes() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-plan-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let (code, out, err) = fusec(&["build", "dsl-examples/gpt2-block.dsl", "-o", d]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("no memory plan: give the size of B, T"),
        "{out}"
    );
    assert!(dir.join("kernels/fusec_prelude.cuh").exists() && !dir.join("plan.json").exists());
    let (code, out, err) = fusec(&[
        "build",
        "dsl-examples/gpt2-block.dsl",
        "-o",
        d,
        "--batch",
        "4",
        "--dim",
        "T=64",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("memory plan: arena of") && out.contains("one step launches"),
        "{out}"
    );
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
    assert_eq!(plan["dims"]["T"], 64);
    let launches = plan["launches"].as_array().unwrap();
    let cu = std::fs::read_dir(dir.join("kernels"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "cu")
        })
        .count();
    // One .cu file per kernel the plan launches (no other).
    let steps: Vec<&str> = launches
        .iter()
        .flat_map(|l| l["steps"].as_array().into_iter().flatten())
        .map(|s| s["function"].as_str().unwrap())
        .collect();
    assert_eq!(cu, steps.len(), "one .cu file per launched kernel");
    for f in &steps {
        assert!(dir.join(format!("kernels/{f}.cu")).exists(), "{f}.cu");
    }
    assert!(std::fs::read_to_string(dir.join("report.txt"))
        .unwrap()
        .contains("kernels in launch order"));
    for (args, msg) in [
        (vec!["--batch", "0"], "--batch must be a positive size"),
        (
            vec!["--dim", "X=3"],
            "the model has no dimension `X`; its dimensions are: B, T",
        ),
        (vec!["--dim", "T"], "--dim expects NAME=N"),
        // Sizes whose bytes overflow are refused, not a panic.
        (
            vec!["--batch", "4611686018427387904", "--seq", "64"],
            "check the sizes",
        ),
        (
            vec!["--batch", "1099511627776", "--seq", "1024"],
            "takes more than 2^60 bytes: check the sizes",
        ),
    ] {
        let mut a = vec!["build", "dsl-examples/gpt2-block.dsl", "-o", d];
        a.extend(args);
        let (code, _, err) = fusec(&a);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(msg), "{err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn dump_prints_one_stage() {
    let (code, out, _) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump", "forward"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("graph mlp (B)\n") && !out.contains("backward:"),
        "{out}"
    );
    let (code, out, _) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump", "backward"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("backward:") && !out.contains("update:"),
        "{out}"
    );
    let (code, out, _) = fusec(&[
        "build",
        "dsl-examples/mlp.dsl",
        "--dump",
        "train",
        "--format",
        "dot",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("-> n"), "{out}");
    let (code, _, err) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump", "cuda"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("invalid value 'cuda' for '--dump <STAGE>'") && err.contains("optimized"),
        "{err}"
    );
    let (code, out, _) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump", "kernels"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("kernels of mlp (B): "), "{out}");
    assert!(out.contains("(gemm, epilogue bias)"), "{out}");
    let (code, out, _) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump-after", "fuse"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("kernels of mlp (B): "), "{out}");
    let (code, _, err) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump-after", "plan"]);
    assert_eq!(code, 2);
    assert!(err.contains("needs a size for B"), "{err}");
    let (code, out, _) = fusec(&[
        "build",
        "dsl-examples/mlp.dsl",
        "--dump-after",
        "plan",
        "--batch",
        "4",
    ]);
    assert_eq!(code, 0);
    assert!(out.contains("\"arena_bytes\""), "{out}");
    let (code, out, _) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump", "layout"]);
    assert_eq!(code, 0);
    assert!(out.contains("stored, row-major (parameter)"), "{out}");
    let (code, _, err) = fusec(&[
        "build",
        "dsl-examples/mlp.dsl",
        "--dump",
        "layout",
        "--format",
        "dot",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("--dump layout has no Graphviz form"), "{err}");
    let (code, _, err) = fusec(&[
        "build",
        "dsl-examples/mlp.dsl",
        "--dump",
        "ast",
        "--format",
        "dot",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("no Graphviz form"), "{err}");
}

/// The build's summary names the attention templates that run and how
/// many: with dropout, Hopper's forward and its backward at head dim 64,
/// the mma.sync backward at head dim 128 (Hopper's takes dropout up to 96).
#[test]
fn build_names_the_attention_templates_that_run() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-families-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    for (sets, want) in [
        (
            &["d=128", "n_heads=2"][..],
            "DkDvDqSm90 x2, DqStore x2, ForwardSm90 x2",
        ),
        (
            &["d=256", "n_heads=2"][..],
            "DkDvSm80 x2, DqStore x2, ForwardSm90 x2",
        ),
    ] {
        let mut a = vec![
            "build",
            "dsl-examples/bert-classifier.dsl",
            "-o",
            d,
            "--device",
            "h100",
            "--precision",
            "bf16",
            "--set",
            "layers=2",
        ];
        for s in sets {
            a.extend(["--set", s]);
        }
        let (code, out, err) = fusec(&a);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains(&format!("kernels/attention/ templates: Delta x2, {want})")),
            "{out}"
        );
    }
    // f32 on TF32 tensor cores: three products a step (PRECISE, the last
    // template parameter), or one with --tf32.
    for (tf32, precise) in [(false, "true"), (true, "false")] {
        let _ = std::fs::remove_dir_all(&dir);
        let mut a = vec![
            "build",
            "dsl-examples/bert-classifier.dsl",
            "-o",
            d,
            "--device",
            "h100",
            "--precision",
            "fp32",
            "--set",
            "layers=2",
        ];
        if tf32 {
            a.push("--tf32");
        }
        let (code, out, err) = fusec(&a);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("templates: Delta x2, DkDvF32 x2, DqStore x2, ForwardF32 x2"),
            "{out}"
        );
        // The GEMMs take three TF32 products by default, one with --tf32.
        assert_eq!(
            out.contains(
                "f32 GEMMs as three TF32 products, operands split by fs_gemm_split_tf32.cu"
            ),
            !tf32,
            "{out}"
        );
        assert_eq!(
            dir.join("kernels/fs_gemm_split_tf32.cu").exists(),
            !tf32,
            "the split kernels' source"
        );
        let mut instances = Vec::new();
        for f in std::fs::read_dir(dir.join("kernels")).unwrap() {
            let path = f.unwrap().path();
            if path.extension().is_none_or(|e| e != "cu") {
                continue;
            }
            let text = std::fs::read_to_string(path).unwrap();
            for line in text.lines().filter(|l| l.starts_with("typedef fs_attn::")) {
                if line.contains("F32<") {
                    instances.push(line.to_string());
                }
            }
        }
        assert_eq!(instances.len(), 4, "{instances:?}");
        for i in &instances {
            assert!(i.contains(&format!(", {precise}> ")), "--tf32 {tf32}: {i}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `fusec build --device` writes the kernels that run on that device: on
/// an H100 the Hopper attention templates' instances (and the headers they
/// include, so each .cu compiles on its own), on an A100 the mma.sync ones;
/// the plan launches exactly those files, and `--dump-after select` says
/// what runs each kernel.
#[test]
fn build_for_a_device_writes_the_kernels_that_run_there() {
    use fusec_compiler::emit::HEADERS;
    let dir = std::env::temp_dir().join(format!("fusec-cli-device-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    for (model, device, template, head_dim) in [
        (
            "dsl-examples/gpt2-small.dsl",
            "h100",
            "attention/forward_sm90_persistent.cuh",
            64,
        ),
        (
            "tests/models/llama-hd80.dsl",
            "h100",
            "attention/forward_sm90.cuh",
            80,
        ),
        (
            "tests/models/llama-hd80.dsl",
            "a100",
            "attention/forward_sm80.cuh",
            80,
        ),
    ] {
        let (code, out, err) = fusec(&[
            "build", model, "-o", d, "--device", device, "--batch", "2", "--seq", "256",
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("tensor-core attention"), "{out}");
        let kernels = dir.join("kernels");
        for (path, text) in HEADERS {
            assert_eq!(
                &std::fs::read_to_string(kernels.join(path)).unwrap(),
                text,
                "{path}"
            );
        }
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        let forward = plan["launches"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["ops"][0] == "attention")
            .expect("an attention launch");
        assert_eq!(forward["kind"], "template", "{forward}");
        let f = forward["steps"][0]["function"].as_str().unwrap();
        let text = std::fs::read_to_string(kernels.join(format!("{f}.cu"))).unwrap();
        assert!(
            text.contains(&format!("#include \"{template}\""))
                && text.contains(&format!(", {head_dim}, {head_dim}, true, true>")),
            "{model} {device}: {text}"
        );
        let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
        assert!(
            report.contains("template instances") && !report.contains("runs the simple attention"),
            "{report}"
        );
        if common::nvrtc_ready() {
            let arch = if device == "h100" { "sm_90a" } else { "sm_80" };
            fusec_runtime::nvrtc::compile(f, &text, arch).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    // A head dim that is no multiple of 8 stays on the simple kernels, and
    // the report says so.
    let src = dir.join("hd36.dsl");
    std::fs::write(
        &src,
        "dim B, T\ninput x: bf16[B, T, 72]\nparam w: [72, 216] = normal(0.02)\nlet q, k, v = split(x @ w, 3)\nlet y = attention(heads(q, 2), heads(k, 2), heads(v, 2), causal = true)\ntrain {\n loss = mean(y * y)\n precision = bf16\n}\n",
    )
    .unwrap();
    let (code, _, err) = fusec(&[
        "build",
        src.to_str().unwrap(),
        "-o",
        d,
        "--batch",
        "2",
        "--seq",
        "64",
    ]);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert!(
        report.contains("runs the simple attention kernels")
            && report.contains("the head dim of q and k is 36"),
        "{report}"
    );
    let (code, out, err) = fusec(&[
        "build",
        "tests/models/llama-hd80.dsl",
        "--dump-after",
        "select",
        "--set",
        "layers=1",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("# kernels for tensor-core attention for sm_90a")
            && out.contains("fs_attn::ForwardSm90<fs_attn::Bf16, 80, 80, true, true>")
            // 8 query heads a key/value head: two blocks a key tile.
            && out.contains("fs_attn::DkDvDqSm90<fs_attn::Bf16, 80, 80, true, 2>")
            && out.contains("fs_attn::DkvStore<fs_attn::Bf16, 80, 80, 2>")
            && out.contains(": cuBLASLt"),
        "{out}"
    );
    let (code, _, err) = fusec(&["build", "dsl-examples/mlp.dsl", "--device", "v100"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("invalid value 'v100' for '--device <NAME>'")
            && err.contains("h100, h200, a100"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn passes_are_listed_and_dumped_after() {
    let (code, out, _) = fusec(&["passes"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("fold-attention")
            && out.contains("\nsimplify ")
            && out.contains("\ndce ")
            && out.contains("\nloss-head ")
            && out.contains("\nrecompute "),
        "{out}"
    );
    let (code, out, err) = fusec(&[
        "build",
        "dsl-examples/gpt2-block.dsl",
        "--dump-after",
        "cse",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("graph gpt2-block (B, T)") && out.contains("update:"),
        "{out}"
    );
    let (code, _, err) = fusec(&["build", "dsl-examples/mlp.dsl", "--dump-after", "fusion9"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("invalid value 'fusion9' for '--dump-after <PASS>'")
            && err.contains("simplify"),
        "{err}"
    );
}

#[test]
fn help_on_every_command() {
    for args in [
        vec!["--help"],
        vec!["check", "--help"],
        vec!["build", "--help"],
    ] {
        let (code, out, _) = fusec(&args);
        assert_eq!(code, 0);
        assert!(out.contains("Usage: fusec"), "{out}");
    }
    let (code, _, err) = fusec(&["frobnicate"]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn missing_and_non_utf8_files() {
    let (code, _, err) = fusec(&["check", "no/such/model.dsl"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("cannot read model file no/such/model.dsl"),
        "{err}"
    );
    let p = std::env::temp_dir().join(format!("fusec-binary-{}.dsl", std::process::id()));
    std::fs::write(&p, [0xff, 0xfe, 0x00, 0x41]).unwrap();
    let (code, _, err) = fusec(&["check", p.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("is not UTF-8 text"), "{err}");
    let _ = std::fs::remove_file(p);
}

#[test]
fn bench_attention_rejects_bad_sizes_before_looking_for_a_gpu() {
    // Each is a usage error (exit 2) on any machine, GPU or not.
    for (args, says) in [
        (vec!["--group", "0"], "must be positive"),
        (vec!["--kv-seq", "0"], "must be positive"),
        (vec!["--head-dims", "64,0"], "must be positive"),
        (vec!["--masks", "sideways"], "possible values: causal, none"),
    ] {
        let mut all = vec!["bench-attention"];
        all.extend(args.iter().copied());
        let (code, _, err) = fusec(&all);
        assert_eq!(code, 2, "{all:?}: {err}");
        assert!(err.contains(says), "{all:?}: {err}");
    }
    let (code, out, _) = fusec(&["bench-attention", "--help"]);
    assert_eq!(code, 0);
    for flag in ["--kv-seq", "--group", "--masks", "--deterministic"] {
        assert!(out.contains(flag), "{flag} missing from:\n{out}");
    }
}

#[test]
fn export_torch_writes_a_twin_and_explains_what_it_cannot_write() {
    let dir = std::env::temp_dir().join(format!("fusec-export-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("gpt2.py");
    let (code, stdout, err) = fusec(&[
        "export-torch",
        "dsl-examples/gpt2-small.dsl",
        "--set",
        "layers=2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        stdout.contains("wrote ") && stdout.contains("smoke run"),
        "{stdout}"
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("class Gpt2Small(nn.Module):"), "{text}");
    assert!(
        text.contains("self.h = nn.ModuleList([H() for _ in range(2)])"),
        "{text}"
    );
    assert!(text.contains("PRECISION = \"bf16\""), "{text}");
    // `-o -` writes to standard output.
    let (code, stdout, err) = fusec(&["export-torch", "dsl-examples/mlp.dsl", "-o", "-"]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("class Mlp(nn.Module):"), "{stdout}");

    // A parameter PyTorch cannot hold under its name: an error at the parameter.
    let model = dir.join("clash.dsl");
    std::fs::write(
        &model,
        "dim B\ninput x: f32[B, 4]\nparam to: [4, 4] = normal(0.1)\ntrain { loss = mean(x @ to) }\n",
    )
    .unwrap();
    let (code, _, err) = fusec(&["export-torch", model.to_str().unwrap(), "-o", "-"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("error: no PyTorch twin: `to` cannot be a PyTorch attribute"),
        "{err}"
    );
    assert!(err.contains("clash.dsl:3:"), "{err}");
    assert!(err.contains("rename `to`"), "{err}");
    // A model fusec rejects gets fusec's own error.
    std::fs::write(
        &model,
        "dim B\ninput x: f32[B, 4]\ntrain { loss = mean(x @ x) }\n",
    )
    .unwrap();
    let (code, _, err) = fusec(&["export-torch", model.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("error:"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn export_torch_names_what_python_cannot_hold() {
    let dir = std::env::temp_dir().join(format!("fusec-export-names-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("names.dsl");
    let cases = [
        // An input is a keyword argument of `forward`: it keeps its name.
        (
            "dim B\ninput F: f32[B, 4]\nparam w: [4, 4] = normal(0.1)\ntrain { loss = mean(F @ w) }\n",
            "the input `F` cannot keep its name in Python",
            "names.dsl:2:",
        ),
        // A parameter and a block instance of one name in one module.
        (
            "dim B\ninput x: f32[B, 4]\nblock mlp(x) {\n param w: [4, 4] = normal(0.1)\n return x @ w\n}\n\
             param mlp: [4] = zeros\ntrain { loss = mean(mlp(x) + mlp) }\n",
            "`mlp` is both a parameter and a block instance",
            "= rename the parameter `mlp`",
        ),
    ];
    for (src, message, place) in cases {
        std::fs::write(&model, src).unwrap();
        let (code, _, err) = fusec(&["export-torch", model.to_str().unwrap(), "-o", "-"]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(message), "{err}");
        assert!(err.contains(place), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An awkward MLP width and untied head are padded, the report says so,
/// and `--disable-pass` leaves the pass out (an unknown name is an error
/// that lists the passes).
#[test]
fn awkward_sizes_are_padded_and_a_pass_can_be_left_out() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-pad-{}", std::process::id()));
    let model = "tests/models/twins/gqa-hd80.dsl";
    let out_dir = dir.to_str().unwrap();
    let args = ["build", model, "--batch", "2", "--seq", "16", "-o", out_dir];
    let (code, _, err) = fusec(&args);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert!(
        report.contains("padded size 1713 -> 1728 (pad-dims)"),
        "{report}"
    );
    assert!(
        report.contains("padded size 5003 -> 5056 (pad-dims)"),
        "{report}"
    );
    assert!(report.contains("layer.0.w_down"), "{report}");
    // The graph after each forward pass is that pass's: no padding yet
    // after fold-attention, which runs before pad-dims.
    let after = |pass: &str| fusec(&["build", model, "--dump-after", pass]).1;
    assert!(!after("fold-attention").contains("1728"));
    assert!(after("pad-dims").contains("1728"));
    let mut off = args.to_vec();
    off.extend(["--disable-pass", "pad-dims"]);
    let (code, _, err) = fusec(&off);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert!(!report.contains("padded size"), "{report}");
    let (code, _, err) = fusec(&["check", model, "--disable-pass", "nope"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("there is no pass or optimisation `nope`")
            && err.contains("pad-dims")
            && err.contains("gemm-epilogues"),
        "{err}"
    );
    let (code, _, err) = fusec(&[
        "build",
        model,
        "--disable-pass",
        "cse",
        "--dump-after",
        "cse",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("left out by --disable-pass cse"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sizes that make a slice run past its axis (BERT's 512 positions at
/// `--seq 1024`) are an error at the slice's place in the model file, not
/// a read past the table's end.
#[test]
fn a_sequence_longer_than_the_position_table_is_refused() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-slice-{}", std::process::id()));
    let out_dir = dir.to_str().unwrap();
    let bert = "dsl-examples/bert-encoder.dsl";
    let (code, _, err) = fusec(&[
        "build", bert, "--batch", "2", "--seq", "1024", "-o", out_dir,
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("this slice [0:1024] runs past the end of an axis of 512")
            && err.contains("bert-encoder.dsl:49:46"),
        "{err}"
    );
    let (code, _, err) = fusec(&["build", bert, "--batch", "2", "--seq", "512", "-o", out_dir]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = fusec(&[
        "bench",
        "dsl-examples/gpt2-small.dsl",
        "--batch",
        "1",
        "--seq",
        "2048",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("gpt2-small.dsl:48:34"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A dump piped into a reader that stops early (`| head`) ends fusec
/// quietly: no panic on the closed pipe.
#[cfg(unix)]
#[test]
fn a_closed_pipe_ends_a_dump_quietly() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_fusec"))
        .args(["build", "dsl-examples/gpt2-small.dsl", "--dump", "train"])
        .current_dir(common::root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fusec runs");
    let mut first = [0u8; 64];
    child
        .stdout
        .take()
        .expect("piped")
        .read_exact(&mut first)
        .expect("the dump starts");
    // The read end is closed here; the rest of the dump has nowhere to go.
    let out = child.wait_with_output().expect("fusec ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

/// `--bucket-mib` sets where data parallelism's gradient buckets close:
/// gpt2-small on 4 GPUs has 6 collectives at the default 100 MiB and 15 at
/// 25 MiB (the report lists them); without ranks it is a usage error.
#[test]
fn bucket_mib_sizes_the_gradient_buckets() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-buckets-{}", std::process::id()));
    let out_dir = dir.to_str().unwrap();
    let base = [
        "build",
        "dsl-examples/gpt2-small.dsl",
        "--gpus",
        "4",
        "--batch",
        "4",
        "--seq",
        "64",
        "-o",
        out_dir,
    ];
    let buckets = |extra: &[&str]| -> usize {
        let mut args = base.to_vec();
        args.extend(extra);
        let (code, _, err) = fusec(&args);
        assert_eq!(code, 0, "{err}");
        let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
        let line = report
            .lines()
            .find(|l| l.starts_with("data parallel over 4 ranks"))
            .unwrap_or_else(|| panic!("{report}"))
            .to_string();
        line.split(": ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"))
    };
    assert_eq!(buckets(&["--zero", "0"]), 6);
    assert_eq!(buckets(&["--zero", "0", "--bucket-mib", "25"]), 15);
    // Averaged in bf16 the default closes at half the bytes: the same 6.
    assert_eq!(buckets(&["--zero", "0", "--reduce-dtype", "bf16"]), 6);
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert!(report.contains("(mean in bf16, NCCL)"), "{report}");
    // ZeRO: the same gradients go to their pieces' owners, and the norm's
    // sum of squares (each rank's over its pieces) is added over the ranks:
    // one collective more.
    assert_eq!(buckets(&["--zero", "1", "--rank", "1"]), 7);
    // ZeRO is the default over several ranks.
    let explicit = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert_eq!(buckets(&["--rank", "1"]), 7);
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert_eq!(report, explicit, "the default is --zero 1");
    assert!(
        report.contains("each gradient's mean goes to the owners of its pieces alone"),
        "{report}"
    );
    // A bf16 model: the ranks keep the parameters in bf16, the f32 masters
    // of their pieces with the optimizer state, and send bf16 pieces.
    for line in [
        "parameters (compute dtype)",
        "optimizer state (+ f32 masters)",
        "sends its pieces of the parameters to the other ranks in bf16",
    ] {
        assert!(report.contains(line), "{line}: {report}");
    }
    let (code, _, err) = fusec(&[
        "build",
        "dsl-examples/gpt2-small.dsl",
        "--bucket-mib",
        "100",
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--bucket-mib sizes the gradient buckets"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--reduce-dtype bf16` averages a bf16 model's gradients in bf16 on
/// several ranks; anything else is a usage error that says what to do.
#[test]
fn reduce_dtype_needs_ranks_and_a_bf16_model() {
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "build",
                "dsl-examples/gpt2-small.dsl",
                "--reduce-dtype",
                "bf16",
            ],
            "give --gpus N",
        ),
        (
            &[
                "build",
                "dsl-examples/gpt2-small.dsl",
                "--gpus",
                "2",
                "--precision",
                "fp32",
                "--reduce-dtype",
                "bf16",
            ],
            "this model trains in f32",
        ),
        (
            &[
                "build",
                "dsl-examples/gpt2-small.dsl",
                "--gpus",
                "2",
                "--reduce-dtype",
                "fp8",
            ],
            "expected f32 or bf16",
        ),
        (
            &[
                "train",
                "dsl-examples/gpt2-small.dsl",
                "--cpu",
                "--reduce-dtype",
                "bf16",
                "--steps",
                "1",
                "--data",
                "/nonexistent/tokens.bin",
            ],
            "give --gpus N",
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = fusec(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// ZeRO stage 1 is the default over several ranks, but a model too small
/// to give every rank a piece of its parameters runs unsplit by default;
/// asked for with `--zero 1` it is refused with the reason.
#[test]
fn zero_leaves_a_model_too_small_for_its_ranks_unsplit_unless_asked() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-tiny-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.dsl");
    std::fs::write(
        &model,
        "dim B\ninput x: f32[B, 4]\nparam w: [4, 4] = normal(0.1)\ntrain { loss = mean(x @ w) }\n",
    )
    .unwrap();
    let out = dir.join("out");
    let build = |extra: &[&str]| {
        let mut a = vec![
            "build",
            model.to_str().unwrap(),
            "--gpus",
            "4",
            "--dim",
            "B=8",
            "-o",
            out.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        fusec(&a)
    };
    let (code, _, err) = build(&[]);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(out.join("report.txt")).unwrap();
    assert!(report.contains("data parallel over 4 ranks"), "{report}");
    assert!(!report.contains("ZeRO"), "{report}");
    let (code, _, err) = build(&["--zero", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--zero 1 cannot split this model"), "{err}");
    assert!(err.contains("leave 3 of 4 ranks nothing to own"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `fusec build --decode` writes the decode step `fusec generate` runs:
/// its products as skinny GEMMs at batch 2 (and on cuBLASLt past 32
/// rows), the greedy picks in its plan, a layer's cache writes as one
/// launch; caches longer than the model's positions are refused.
#[test]
fn build_writes_the_decode_step() {
    let dir = std::env::temp_dir().join(format!("fusec-cli-decode-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let sets = ["--set", "layers=2"];
    let mut a = vec!["build", "dsl-examples/gpt2-small.dsl", "--decode", "-o", d];
    a.extend(sets);
    a.extend(["--batch", "2", "--dim", "KV=64"]);
    let (code, out, err) = fusec(&a);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("batch 2, 1 new position a step, caches of 64"),
        "{out}"
    );
    let plan = std::fs::read_to_string(dir.join("plan.json")).unwrap();
    assert!(
        plan.contains("\"next_tokens\""),
        "no greedy picks in the plan"
    );
    assert_eq!(
        plan.matches("fs_skinny::").count(),
        9,
        "4 products a layer and the head"
    );
    assert!(plan.contains("kv_write_x2"));
    let report = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert!(!report.contains("textbook"), "a decode step trains nothing");
    // 33 rows: cuBLASLt.
    let mut a = vec!["build", "dsl-examples/gpt2-small.dsl", "--decode", "-o", d];
    a.extend(sets);
    a.extend(["--batch", "33", "--dim", "KV=64"]);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 0, "{err}");
    let plan = std::fs::read_to_string(dir.join("plan.json")).unwrap();
    assert_eq!(plan.matches("fs_skinny::").count(), 0);
    let mut a = vec!["build", "dsl-examples/gpt2-small.dsl", "--decode", "-o", d];
    a.extend(["--dim", "KV=5000"]);
    let (code, _, err) = fusec(&a);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("5000 positions") && err.contains("gpt2-small.dsl:"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
