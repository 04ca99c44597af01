//! `fusec bench --gpus N --profile FILE`: one step of every rank launch by
//! launch, with each bucket's collective timed on the communication stream
//! beside it. What it shows is whether the collectives hide under the
//! backward pass: for each, when the compute stream had finished its
//! gradients, when it started and ended, and how long the compute stream
//! waited for it at its join (the first launch that reads a result: the
//! gradient norm, or the update). JSON lines go to the file (a line per
//! launch and per collective, each with its rank: every rank with
//! `--gpus N`, rank 0's under a launcher, where each process holds its
//! own); the terminal gets rank 0's table.

use super::CliError;
use fusec_runtime::exec::StepProfile;
use serde_json::json;
use std::io::Write;
use std::path::Path;

pub(super) fn write(path: &Path, profiles: &[(usize, StepProfile)]) -> Result<(), CliError> {
    let mut out = String::new();
    for (rank, p) in profiles {
        for l in &p.launches {
            let line = json!({"rank": rank, "launch": l.name, "start_ms": l.start_ms, "ms": l.ms});
            out.push_str(&format!("{line}\n"));
        }
        for c in &p.collectives {
            let line = json!({
                "rank": rank, "collective": c.name, "bytes": c.bytes,
                "ready_ms": c.ready_ms, "start_ms": c.start_ms, "ms": c.ms,
                "join": p.launches.get(c.join).map(|l| l.name.clone()), "join_ms": c.join_ms,
            });
            out.push_str(&format!("{line}\n"));
        }
        let line = json!({"rank": rank, "step_end_ms": p.step_end_ms});
        out.push_str(&format!("{line}\n"));
    }
    std::fs::File::create(path)
        .and_then(|mut f| f.write_all(out.as_bytes()))
        .map_err(|e| CliError {
            message: format!("error: cannot write the profile {}: {e}", path.display()),
            code: 3,
        })?;
    if let Some((rank, p)) = profiles.first() {
        eprint!("{}", table(*rank, p));
    }
    eprintln!(
        "the launches and collectives of rank{} {}: {}",
        if profiles.len() > 1 { "s" } else { "" },
        profiles
            .iter()
            .map(|(r, _)| r.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        path.display()
    );
    Ok(())
}

/// Rank `rank`'s collectives, one row each, and where the step's end went.
fn table(rank: usize, p: &StepProfile) -> String {
    let mut s = format!(
        "rank {rank}, one step launch by launch: the compute stream ends at {:.2} ms\n",
        p.step_end_ms
    );
    s.push_str(
        "  collective                      MiB   ready ms   start ms     end ms       ms     GB/s   joined by (at ms)          wait ms\n",
    );
    let mut busy = 0.0;
    // The compute stream waits at a join for every collective issued
    // before it; the wait is the last one's end past the join.
    let mut waits: std::collections::BTreeMap<usize, (f64, f64)> = Default::default();
    for c in &p.collectives {
        let end = c.start_ms + c.ms;
        busy += c.ms;
        let w = waits.entry(c.join).or_insert((c.join_ms, 0.0));
        w.1 = w.1.max(end - c.join_ms);
        let joined = p
            .launches
            .get(c.join)
            .map_or("the step's end".to_string(), |l| l.name.clone());
        s.push_str(&format!(
            "  {:<28} {:>7.1} {:>10.2} {:>10.2} {:>10.2} {:>8.3} {:>8.0}   {:<24} {:>7.3}\n",
            c.name,
            c.bytes as f64 / (1u64 << 20) as f64,
            c.ready_ms,
            c.start_ms,
            end,
            c.ms,
            c.bytes as f64 / (c.ms / 1e3).max(1e-12) / 1e9,
            format!("{joined} ({:.2})", c.join_ms),
            (end - c.join_ms).max(0.0)
        ));
    }
    let waited: f64 = waits.values().map(|w| w.1.max(0.0)).sum();
    s.push_str(&format!(
        "  {} collectives: {busy:.2} ms on the communication stream; the compute stream waited {waited:.2} ms for them at its joins\n",
        p.collectives.len()
    ));
    s
}
