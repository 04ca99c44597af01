//! `fusec build` writes memory.html, the arena over the step: one
//! rectangle per buffer of the plan that has storage of its own. The page
//! is checked against plan.json, and, where Chromium is installed (Debian's
//! `chromium`; CI installs it), rendered headless: the screenshot must not
//! be blank and must show the colours of weights, gradients, optimizer
//! state and activations.

mod common;

use common::fusec;

#[test]
fn memory_picture_draws_every_buffer_and_renders() {
    let out = common::host::work_dir("memory-picture").join("build");
    let (code, _, err) = fusec(&[
        "build",
        "dsl-examples/gpt2-block.dsl",
        "--batch",
        "2",
        "--seq",
        "64",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let page = std::fs::read_to_string(out.join("memory.html")).unwrap();
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("plan.json")).unwrap()).unwrap();
    let own = plan["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| {
            b.get("alias_of").is_none()
                && b.get("shares_with").is_none()
                && b["bytes"].as_u64() > Some(0)
        })
        .count();
    assert_eq!(page.matches("class=\"buffer\"").count(), own);
    assert!(
        page.contains(&format!("{own} buffers")),
        "the page says how many"
    );
    assert!(
        page.contains("made by layernorm at dsl-examples/gpt2-block.dsl:26"),
        "a buffer names its line"
    );
    // Rendered, where a browser is.
    let Some((pixels, browser)) = common::browser::screenshot(&out.join("memory.html"), 1280, 760)
    else {
        return;
    };
    let drawn = common::browser::assert_drawn(
        &pixels,
        &[
            ("weights", [0x4c, 0x78, 0xa8]),
            ("gradients", [0xf5, 0x85, 0x18]),
            ("optimizer state", [0xb2, 0x79, 0xa2]),
            ("activations kept for backward", [0x54, 0xa2, 0x4b]),
        ],
    );
    println!(
        "rendered with {browser}: {own} buffers, {drawn} of {} pixels not white",
        pixels.len()
    );
}
