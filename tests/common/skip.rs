//! A test that cannot run here says so where a reader sees it: the reason on
//! its output and, where FUSEC_SKIP_LOG names a file (`.ci/run` sets it), a
//! line there naming the test, which `.ci/run`'s closing line counts apart
//! from the passes and lists by name. Shared by the root tests and
//! runtime/tests.

use std::io::Write;

/// Records that the running test skips (all of it, or the part `why`
/// names) and prints why.
pub fn skip(why: &str) {
    println!("skipped: {why}");
    let Some(path) = std::env::var_os("FUSEC_SKIP_LOG") else {
        return;
    };
    // Cargo names a test binary `<test file>-<hash>`; libtest names each
    // test's thread after the test.
    let binary = std::env::args()
        .next()
        .and_then(|a| {
            let stem = std::path::Path::new(&a)
                .file_stem()?
                .to_string_lossy()
                .into_owned();
            Some(
                stem.rsplit_once('-')
                    .map_or(stem.clone(), |(name, _)| name.to_string()),
            )
        })
        .unwrap_or_default();
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("main");
    // One short line a write, appended: lines from parallel tests and test
    // binaries do not interleave.
    let line = format!("{binary}::{test}\t{}\n", why.replace(['\n', '\t'], " "));
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        let _ = f.write_all(line.as_bytes());
    }
}
