//! The Chrome trace of a step (`fusec bench --trace`) and its picture. A
//! GPU run gives the times; here the roofline's predicted times stand in
//! for them, so the layout, the schema and the picture are checked without
//! one: every shipped model's trace is valid Trace Event Format with one
//! event per launch on the compute track, every launch names its source
//! lines, and the phases cover the step in order. The picture is rendered
//! in headless Chromium where one is installed (CI installs Debian's).

mod common;

use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::plan::roofline::{device, estimate};
use fusec_compiler::plan::trace::{chrome_trace, labels, predicted, svg};
use fusec_compiler::plan::{plan, Plan};
use serde_json::Value;
use std::collections::BTreeMap;

fn traced(file: &str, sets: &[(&str, &str)], dims: &[(&str, i64)]) -> (Value, Plan, Vec<String>) {
    let (name, src) = common::example(file);
    let c = common::compile_with(&src, &name, sets);
    let g = &c.optimized;
    let program = fuse(g);
    let dims: BTreeMap<String, i64> = dims.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let p = plan(g, &program, &dims).unwrap_or_else(|e| panic!("{file}: {e}"));
    let est = estimate(g, &program, &p, device("h100").unwrap());
    let times = predicted(&est);
    let source = Some((name.as_str(), src.as_str()));
    let trace = chrome_trace(
        g,
        &program,
        &p,
        &est,
        source,
        &times,
        &format!("{file} predicted"),
    );
    let names = labels(g, &program, source)
        .into_iter()
        .map(|(phase, l)| format!("{} {l}", phase.name()))
        .collect();
    (trace, p, names)
}

fn num(e: &Value, key: &str) -> f64 {
    e[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {e}"))
}

#[test]
fn every_shipped_models_trace_is_well_formed_and_names_its_lines() {
    for (file, sets, dims) in common::tiny_models() {
        let (trace, p, labels) = traced(file, &sets, &dims);
        // Through text and back, as a viewer reads it.
        let trace: Value = serde_json::from_str(&trace.to_string()).unwrap();
        let events = trace["traceEvents"].as_array().expect("traceEvents");
        for e in events {
            assert!(e["name"].is_string(), "{file}: {e}");
            assert_eq!(e["pid"], 1, "{file}: {e}");
            match e["ph"].as_str() {
                Some("M") => assert!(e["args"].is_object(), "{file}: {e}"),
                Some("X") => {
                    assert!(num(e, "ts") >= 0.0 && num(e, "dur") >= 0.0, "{file}: {e}");
                    assert!(e["tid"].is_u64(), "{file}: {e}");
                }
                other => panic!("{file}: an event of phase {other:?}"),
            }
        }
        let launches: Vec<&Value> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == 1)
            .collect();
        assert_eq!(launches.len(), p.launches.len(), "{file}");
        for (e, l) in launches.iter().zip(&p.launches) {
            assert_eq!(e["name"], l.kernel.as_str(), "{file}");
            let src = e["args"]["source"].as_str().unwrap_or("");
            let stem = file.trim_end_matches(".dsl");
            assert!(
                src.starts_with(&format!("{stem}.dsl:"))
                    && src[stem.len() + 5..].starts_with(|c: char| c.is_ascii_digit()),
                "{file}: {} has no source line ({src:?})",
                l.kernel
            );
            for key in ["bytes", "flops"] {
                assert!(e["args"][key].is_u64(), "{file}: {key} of {e}");
            }
        }
        // Launches back to back, in order.
        for w in launches.windows(2) {
            let end = num(w[0], "ts") + num(w[0], "dur");
            assert!(
                (num(w[1], "ts") - end).abs() < 2e-3,
                "{file}: {} then {}",
                w[0],
                w[1]
            );
        }
        // Phases: forward first, update last, never overlapping, covering every launch.
        let phases: Vec<&Value> = events.iter().filter(|e| e["cat"] == "phase").collect();
        let names: Vec<&str> = phases.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(names.first(), Some(&"forward"), "{file}: {names:?}");
        assert_eq!(names.last(), Some(&"update"), "{file}: {names:?}");
        let covered: u64 = phases
            .iter()
            .map(|e| e["args"]["launches"].as_u64().unwrap())
            .sum();
        assert_eq!(covered as usize, p.launches.len(), "{file}");
        for w in phases.windows(2) {
            assert!(
                num(w[1], "ts") + 2e-3 >= num(w[0], "ts") + num(w[0], "dur"),
                "{file}"
            );
        }
        // The labels profilers get (NVTX ranges, --profile) name the lines too.
        assert_eq!(labels.len(), p.launches.len());
        assert!(
            labels.iter().all(|l| l.contains(".dsl:")),
            "{file}: {labels:?}"
        );
    }
}

#[test]
fn the_trace_picture_draws_every_launch_and_renders() {
    let (trace, p, _) = traced(
        "gpt2-block.dsl",
        &[("d", "64"), ("n_heads", "2")],
        &[("B", 2), ("T", 64)],
    );
    let picture = svg(&trace);
    assert_eq!(
        picture.matches("class=\"launch\"").count(),
        p.launches.len()
    );
    assert_eq!(
        picture.matches("class=\"phase\"").count(),
        3,
        "forward, backward, update"
    );
    assert!(
        picture.contains("gpt2-block.dsl:"),
        "a launch names its line"
    );
    let dir = common::host::work_dir("trace-picture");
    let path = dir.join("step.svg");
    std::fs::write(&path, &picture).unwrap();
    let Some((pixels, browser)) = common::browser::screenshot(&path, 1430, 300) else {
        return;
    };
    let drawn = common::browser::assert_drawn(
        &pixels,
        &[
            ("GEMMs", [0x4c, 0x78, 0xa8]),
            ("generated kernels", [0x54, 0xa2, 0x4b]),
            ("the forward phase", [0x9e, 0xca, 0xe9]),
            ("the backward phase", [0xff, 0xbf, 0x79]),
        ],
    );
    println!(
        "rendered with {browser}: {} launches, {drawn} of {} pixels not white",
        p.launches.len(),
        pixels.len()
    );
}

#[test]
fn a_launch_inside_a_repeated_block_names_its_call_stack() {
    let (trace, _, _) = traced(
        "gpt2-small.dsl",
        &[
            ("vocab", "64"),
            ("ctx", "16"),
            ("d", "32"),
            ("n_heads", "2"),
            ("layers", "3"),
        ],
        &[("B", 2), ("T", 16)],
    );
    let stacks: Vec<Vec<String>> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["tid"] == 1)
        .map(|e| {
            e["args"]["stack"]
                .as_array()
                .map(|s| s.iter().map(|f| f.as_str().unwrap().to_string()).collect())
                .unwrap_or_default()
        })
        .collect();
    // The MLP's first GEMM of the third layer: the line of the product, the
    // mlp call inside the layer, the layer the repeat made.
    let deep = stacks
        .iter()
        .find(|s| s.len() == 3 && s[1].ends_with(" as h.2.mlp"))
        .unwrap_or_else(|| panic!("no launch in h.2.mlp: {stacks:?}"));
    assert!(deep[0].starts_with("gpt2-small.dsl:"), "{deep:?}");
    assert!(deep[2].ends_with(" as h.2"), "{deep:?}");
    // Every layer's launches say which layer they are.
    for layer in 0..3 {
        let inside = stacks
            .iter()
            .filter(|s| {
                s.last()
                    .is_some_and(|f| f.ends_with(&format!(" as h.{layer}")))
            })
            .count();
        assert!(inside >= 8, "layer {layer}: {inside} launches");
    }
}
