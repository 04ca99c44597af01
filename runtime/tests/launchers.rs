//! Processes started as each launcher starts them find each other: the test
//! runs this binary three times with one launcher's variables (one host
//! standing in for several), each process reads its job from them and
//! takes part in the rendezvous, and every process must come back with the
//! NCCL id rank 0 made, as the rank and local rank the launcher gave it.

use fusec_runtime::launcher::{self, Launcher};
use std::net::TcpListener;
use std::process::Command;

/// Every launcher's variables: cleared in each child, so the machine's own
/// (a CI runner inside a Slurm job) cannot leak in.
const ALL_VARS: &[&str] = &[
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_SIZE",
    "PMI_RANK",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
];

const CHILD: &str = "FUSEC_LAUNCHER_TEST_CHILD";

/// The id rank 0 hands out: its bytes say it came from rank 0.
fn made_by_rank0() -> [u8; 128] {
    std::array::from_fn(|i| (i * 7 + 3) as u8)
}

/// One rank: run by `each_launchers_ranks_find_each_other` as a child
/// process (ignored when the tests run, as it needs the launcher's
/// variables).
#[test]
#[ignore]
fn child_rank() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let job = launcher::from_env(|k| std::env::var(k).ok())
        .expect("the variables are sound")
        .expect("a job of several ranks");
    let id = job
        .rendezvous
        .exchange(42, || Ok(made_by_rank0()))
        .expect("the rendezvous");
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "launched {:?} rank {} of {} local {} id {hex}",
        job.launcher, job.rendezvous.rank, job.rendezvous.world, job.local
    );
}

fn free_port(range: std::ops::Range<u16>) -> u16 {
    range
        .into_iter()
        .find(|p| TcpListener::bind(("0.0.0.0", *p)).is_ok())
        .expect("a free port")
}

/// Starts `vars(rank)` for ranks 0..3 at once and checks what each says.
fn run_job(launcher: Launcher, vars: impl Fn(usize) -> Vec<(String, String)>) {
    let me = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..3)
        .rev() // rank 0 last: the others must wait for it
        .map(|r| {
            let mut c = Command::new(&me);
            c.args(["--ignored", "--exact", "child_rank", "--nocapture"]);
            for v in ALL_VARS {
                c.env_remove(v);
            }
            c.env(CHILD, "1").env("FUSEC_RENDEZVOUS_TIMEOUT", "60");
            c.envs(vars(r));
            (r, c.output_pending())
        })
        .collect();
    let want: String = made_by_rank0().iter().map(|b| format!("{b:02x}")).collect();
    for (r, child) in children {
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("launched"))
            .unwrap_or_else(|| {
                panic!(
                    "{launcher:?} rank {r} said nothing: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        let expect = format!(
            "launched {launcher:?} rank {r} of 3 local {} id {want}",
            r % 2
        );
        assert_eq!(line, expect, "{launcher:?} rank {r}");
    }
}

trait Pending {
    fn output_pending(&mut self) -> std::process::Child;
}

impl Pending for Command {
    fn output_pending(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starts")
    }
}

fn pairs(p: &[(&str, String)]) -> Vec<(String, String)> {
    p.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

#[test]
fn torchrun_ranks_find_each_other() {
    let port = free_port(31000..32000).to_string();
    run_job(Launcher::Torchrun, |r| {
        pairs(&[
            ("WORLD_SIZE", "3".into()),
            ("RANK", r.to_string()),
            ("LOCAL_RANK", (r % 2).to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
        ])
    });
}

/// srun's tasks, rank 0 on the first host of the step's list (this one,
/// as `localhost`) at the port the job's id gives.
#[test]
fn srun_tasks_find_each_other() {
    let port = free_port(29600..30400);
    let job_id = (7000 + port - 29500).to_string();
    run_job(Launcher::Slurm, |r| {
        pairs(&[
            ("SLURM_STEP_NUM_TASKS", "3".into()),
            ("SLURM_NTASKS", "3".into()),
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_LOCALID", (r % 2).to_string()),
            ("SLURM_STEP_NODELIST", "localhost,gpu[02-03]".into()),
            ("SLURM_JOB_ID", job_id.clone()),
        ])
    });
}

/// Open MPI and MPICH on one host: rank 0 is on this host.
#[test]
fn mpirun_ranks_find_each_other() {
    let port = free_port(32000..33000).to_string();
    run_job(Launcher::OpenMpi, |r| {
        pairs(&[
            ("OMPI_COMM_WORLD_SIZE", "3".into()),
            ("OMPI_COMM_WORLD_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", (r % 2).to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "3".into()),
            ("MASTER_PORT", port.clone()),
        ])
    });
    let port = free_port(33000..34000).to_string();
    run_job(Launcher::Hydra, |r| {
        pairs(&[
            ("PMI_SIZE", "3".into()),
            ("PMI_RANK", r.to_string()),
            ("MPI_LOCALRANKID", (r % 2).to_string()),
            ("MPI_LOCALNRANKS", "3".into()),
            ("MASTER_PORT", port.clone()),
        ])
    });
}
