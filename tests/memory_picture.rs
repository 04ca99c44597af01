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
    let browser = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            std::process::Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
    let Some(browser) = browser else {
        println!(
            "skipped the rendering: no Chromium on this machine (Debian: apt-get install chromium)"
        );
        return;
    };
    let shot = out.join("memory.png");
    let status = std::process::Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,760",
        ])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", out.join("memory.html").display()))
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let px = match info.color_type {
        png::ColorType::Rgba => 4,
        png::ColorType::Rgb => 3,
        other => panic!("a screenshot in {other:?}"),
    };
    let pixels: Vec<[u8; 3]> = buf[..info.buffer_size()]
        .chunks(px)
        .map(|c| [c[0], c[1], c[2]])
        .collect();
    let white = pixels.iter().filter(|p| **p == [255, 255, 255]).count();
    assert!(white < pixels.len() * 95 / 100, "the screenshot is blank");
    for (what, rgb) in [
        ("weights", [0x4c, 0x78, 0xa8]),
        ("gradients", [0xf5, 0x85, 0x18]),
        ("optimizer state", [0xb2, 0x79, 0xa2]),
        ("activations kept for backward", [0x54, 0xa2, 0x4b]),
    ] {
        let n = pixels.iter().filter(|p| **p == rgb).count();
        assert!(n > 50, "{what}: {n} pixels of its colour");
    }
    println!(
        "rendered with {browser}: {own} buffers, {} of {} pixels not white",
        pixels.len() - white,
        pixels.len()
    );
}
