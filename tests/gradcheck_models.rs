//! Every shipped model, shrunk to tiny sizes, passes a finite-difference
//! gradient check in f64: autodiff's gradient of each sampled parameter
//! entry agrees with a central difference of the loss (h = 1e-6) within
//! |error| <= 1e-8 + 1e-5 * |gradient|.

mod common;

#[test]
fn every_shipped_model_passes_its_gradient_check() {
    let mut failures = Vec::new();
    for (file, sets, dims) in common::tiny_models() {
        let path = common::root().join("dsl-examples").join(file);
        if !path.exists() {
            failures.push(format!("{file}: missing"));
            continue;
        }
        let (name, src) = common::example(file);
        let c = common::compile_with(&src, &name, &sets);
        let report = common::gradcheck(&c, &dims, 7, 4).unwrap_or_else(|e| panic!("{file}: {e}"));
        println!(
            "{file}: {} gradient entries checked, max abs error {:.2e}, max rel error {:.2e}",
            report.checked, report.max_abs_err, report.max_rel_err
        );
        assert!(report.checked > 0, "{file}: nothing checked");
        for f in report.failures {
            failures.push(format!("{file}: {f}"));
        }
    }
    assert!(
        failures.is_empty(),
        "gradient check failures:\n{}",
        failures.join("\n")
    );
}
