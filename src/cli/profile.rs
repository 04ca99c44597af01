//! `fusec bench --profile FILE`: every launch of one step timed, judged
//! against what it must move and compute (the plan's bytes and FLOPs) and
//! against the device's own ceilings (`fusec_runtime::ceilings`, measured
//! in the same run). One JSON line a launch goes to the file; the terminal
//! gets the costliest kinds and a table of every kernel over 1% of the step.

use super::CliError;
use fusec_compiler::ir::graph::Phase;
use fusec_compiler::plan::roofline::Estimate;
use fusec_runtime::ceilings::Ceilings;
use fusec_runtime::exec::LaunchTime;
use std::collections::BTreeMap;
use std::fmt::Write;

/// `--profile`: every kernel's time judged against this GPU's measured
/// ceilings.
pub(super) fn write_for(
    path: &std::path::Path,
    s: &fusec::backend::Gpu,
    times: &[LaunchTime],
    labels: &[(Phase, String)],
    est: &Estimate,
) -> Result<(), CliError> {
    // The measurement needs about 0.9 GiB beside the step's arena;
    // where the GPU has no room, the datasheet's figures stand in.
    let ceilings = fusec_runtime::ceilings::measure(&s.session.exec.gpu).unwrap_or_else(|e| {
        eprintln!(
            "note: could not measure this GPU's ceilings ({e}); judging against {}'s datasheet figures",
            est.device.about
        );
        Ceilings {
            copy_gb_s: est.device.bytes_per_s / 1e9,
            bf16_tflops: est.device.tensor_flops / 1e12,
        }
    });
    write(path, times, labels, est, ceilings)
}

/// One step of `s` (a step other than training's: a decode step) profiled
/// launch by launch and written as `--profile` writes a training step's.
pub(super) fn profile_step(
    path: &std::path::Path,
    s: &mut fusec::backend::Gpu,
    source: Option<(&str, &str)>,
) -> Result<(), CliError> {
    let times = s
        .session
        .exec
        .profile_step()
        .map_err(super::open::runtime_err)?;
    let labels = fusec_compiler::plan::trace::labels(&s.graph, &s.program, source);
    let est = fusec_compiler::plan::roofline::estimate(
        &s.graph,
        &s.program,
        &s.session.plan,
        super::bench::roofline_device(&s.session.exec.gpu.name),
    );
    write_for(path, s, &times, &labels, &est)
}

/// Below this fraction of its ceiling a kernel is marked as one to improve.
const NEAR: f64 = 0.7;

/// A launch's achieved rate and its fraction of the ceiling that bounds it
/// (FLOPs for a compute-bound kernel, bytes for the rest).
struct Judged {
    gb_s: f64,
    tflops: f64,
    of_ceiling: f64,
    compute: bool,
}

fn judge(bytes: f64, flops: f64, ms: f64, compute: bool, c: Ceilings) -> Judged {
    let s = (ms / 1e3).max(1e-12);
    let (gb_s, tflops) = (bytes / s / 1e9, flops / s / 1e12);
    let of_ceiling = if compute {
        tflops / c.bf16_tflops
    } else {
        gb_s / c.copy_gb_s
    };
    Judged {
        gb_s,
        tflops,
        of_ceiling,
        compute,
    }
}

pub fn write(
    path: &std::path::Path,
    times: &[LaunchTime],
    labels: &[(Phase, String)],
    est: &Estimate,
    ceilings: Ceilings,
) -> Result<(), CliError> {
    let total: f64 = times.iter().map(|t| t.ms).sum();
    let mut by_kind: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    let mut lines = String::new();
    let mut rows = Vec::new();
    for (i, t) in times.iter().enumerate() {
        let name = &t.name;
        // `k12_matmul_add` -> `matmul_add`
        let kind = name
            .split_once('_')
            .map_or(name.as_str(), |(_, k)| k)
            .to_string();
        let e = by_kind.entry(kind).or_default();
        e.0 += 1;
        e.1 += t.ms;
        let (phase, label) = labels
            .get(i)
            .map_or(("", ""), |(p, l)| (p.name(), l.as_str()));
        let source = label.strip_prefix(name.as_str()).unwrap_or("").trim();
        let cost = est.kernels.get(i);
        let (bytes, flops, compute) =
            cost.map_or((0.0, 0.0, false), |c| (c.bytes, c.flops, c.compute_bound));
        let j = judge(bytes, flops, t.ms, compute, ceilings);
        // `ms` stays last: `fusec explain --profile` reads it from the end.
        let _ = writeln!(
            lines,
            "{{\"kernel\":\"{name}\",\"phase\":\"{phase}\",\"source\":{},\"bytes\":{},\"flops\":{},\"gb_s\":{:.1},\"tflops\":{:.2},\"bound\":\"{}\",\"of_ceiling\":{:.3},\"start_ms\":{:.4},\"ms\":{:.4}}}",
            serde_json::Value::from(source),
            bytes as u64,
            flops as u64,
            j.gb_s,
            j.tflops,
            if compute { "compute" } else { "memory" },
            j.of_ceiling,
            t.start_ms,
            t.ms
        );
        rows.push((name.clone(), source.to_string(), t.ms, bytes, flops, j));
    }
    std::fs::write(path, lines)
        .map_err(|e| CliError::usage(format!("error: cannot write {}: {e}", path.display())))?;
    let mut kinds: Vec<_> = by_kind.into_iter().collect();
    kinds.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    eprintln!("one step launch by launch: {total:.2} ms; by kind (count, ms, share):");
    for (kind, (n, ms)) in kinds.iter().take(15) {
        eprintln!(
            "  {kind:<32} {n:>4}  {ms:>9.3}  {:>5.1}%",
            100.0 * ms / total
        );
    }
    eprintln!(
        "ceilings measured on this GPU: copy {:.0} GB/s (read + write), bf16 GEMM {:.0} TFLOP/s",
        ceilings.copy_gb_s, ceilings.bf16_tflops
    );
    eprint!("{}", table(&rows, total));
    Ok(())
}

type Row = (String, String, f64, f64, f64, Judged);

/// Every kernel over 1% of the step, costliest first, with its fraction of
/// the ceiling; those under 70% marked.
fn table(rows: &[Row], total: f64) -> String {
    let mut big: Vec<&Row> = rows.iter().filter(|r| r.2 > 0.01 * total).collect();
    big.sort_by(|a, b| b.2.total_cmp(&a.2));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "kernels over 1% of the step ({} of {}): ms, share, MiB moved, GFLOP, achieved, of its ceiling",
        big.len(),
        rows.len()
    );
    let mut under = 0;
    for (name, source, ms, bytes, flops, j) in big {
        let rate = if j.compute {
            format!("{:>7.1} TFLOP/s", j.tflops)
        } else {
            format!("{:>7.0} GB/s   ", j.gb_s)
        };
        let mark = if j.of_ceiling < NEAR {
            under += 1;
            " <70%"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "  {name:<28} {ms:>8.3} {:>5.1}% {:>9.1} {:>9.1} {rate} {:>5.0}%{mark}  {source}",
            100.0 * ms / total,
            bytes / (1u64 << 20) as f64,
            flops / 1e9,
            100.0 * j.of_ceiling,
        );
    }
    let _ = writeln!(
        s,
        "  {under} of them under 70% of their ceiling (memory-bound kernels against the copy bandwidth, compute-bound ones against the bf16 GEMM rate)"
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_are_judged_against_the_ceiling_that_bounds_them() {
        let c = Ceilings {
            copy_gb_s: 3000.0,
            bf16_tflops: 700.0,
        };
        // 3 GB in 1.5 ms: 2000 GB/s, two thirds of the copy bandwidth.
        let j = judge(3e9, 1e9, 1.5, false, c);
        assert!((j.gb_s - 2000.0).abs() < 1e-6 && (j.of_ceiling - 2.0 / 3.0).abs() < 1e-9);
        // 1.4 TFLOP in 4 ms: 350 TFLOP/s, half the GEMM rate.
        let j = judge(1e8, 1.4e12, 4.0, true, c);
        assert!((j.tflops - 350.0).abs() < 1e-6 && (j.of_ceiling - 0.5).abs() < 1e-9);
        let rows = vec![
            (
                "k1_matmul".to_string(),
                "m.dsl:3".to_string(),
                4.0,
                1e8,
                1.4e12,
                j,
            ),
            (
                "k2_add".to_string(),
                "m.dsl:4".to_string(),
                0.01,
                1e6,
                0.0,
                judge(1e6, 0.0, 0.01, false, c),
            ),
        ];
        let t = table(&rows, 4.01);
        assert!(t.contains("(1 of 2)"), "{t}");
        assert!(t.contains("k1_matmul") && t.contains("50% <70%"), "{t}");
        assert!(!t.contains("k2_add"), "under 1% of the step: {t}");
        assert!(t.contains("1 of them under 70%"), "{t}");
    }
}
