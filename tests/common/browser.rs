//! Rendering a page or picture in headless Chromium (Debian's `chromium`;
//! CI installs it) and reading the screenshot back, for the tests of the
//! pictures fusec writes.

/// The screenshot of `file` at `width` x `height` as RGB pixels, and the
/// browser that took it; `None` (having said so) where no Chromium is
/// installed.
pub fn screenshot(
    file: &std::path::Path,
    width: u32,
    height: u32,
) -> Option<(Vec<[u8; 3]>, &'static str)> {
    let browser = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            std::process::Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
    let Some(browser) = browser else {
        super::skip(
            "the rendering: no Chromium on this machine (Debian: apt-get install chromium)",
        );
        return None;
    };
    let shot = file.with_extension("png");
    let out = std::process::Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--window-size={width},{height}"))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", file.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
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
    let pixels = buf[..info.buffer_size()]
        .chunks(px)
        .map(|c| [c[0], c[1], c[2]])
        .collect();
    Some((pixels, browser))
}

/// Asserts a screenshot is not blank and shows each named colour (more
/// than 50 pixels of it); returns its pixels that are not white.
pub fn assert_drawn(pixels: &[[u8; 3]], colours: &[(&str, [u8; 3])]) -> usize {
    let white = pixels.iter().filter(|p| **p == [255, 255, 255]).count();
    assert!(white < pixels.len() * 95 / 100, "the screenshot is blank");
    for (what, rgb) in colours {
        let n = pixels.iter().filter(|p| *p == rgb).count();
        assert!(n > 50, "{what}: {n} pixels of its colour");
    }
    pixels.len() - white
}
