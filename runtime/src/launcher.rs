//! Which launcher started this process, and the job it describes: the
//! ranks, this one's rank and its place on its host, and where rank 0
//! listens. Each launcher says it with variables of its own:
//!
//! - torchrun (and anything that sets them): `WORLD_SIZE`, `RANK`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`;
//! - Slurm's `srun`: `SLURM_STEP_NUM_TASKS` (set for the tasks of a step,
//!   not in a batch script's own shell), `SLURM_PROCID`, `SLURM_LOCALID`,
//!   and the step's hosts (`SLURM_STEP_NODELIST`, as `gpu[01-04]`): rank 0
//!   runs on the first;
//! - Open MPI's `mpirun`: `OMPI_COMM_WORLD_SIZE`, `_RANK`, `_LOCAL_RANK`,
//!   `_LOCAL_SIZE`;
//! - MPICH's and Intel MPI's Hydra: `PMI_SIZE`, `PMI_RANK`,
//!   `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`.
//!
//! `MASTER_ADDR` and `MASTER_PORT` override what a launcher implies; MPI
//! says nothing of rank 0's host, so a job over several hosts under mpirun
//! needs `-x MASTER_ADDR=...`.

use crate::rendezvous::Rendezvous;
use crate::RuntimeError;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Slurm,
    OpenMpi,
    Hydra,
}

impl Launcher {
    /// The variable that gives its number of ranks.
    pub fn world_var(&self) -> &'static str {
        VARS.iter()
            .find(|(l, _)| l == self)
            .map_or("WORLD_SIZE", |(_, v)| v[0])
    }
    /// The launcher's name as a person knows it.
    pub fn name(&self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "srun",
            Launcher::OpenMpi => "Open MPI's mpirun",
            Launcher::Hydra => "MPICH's or Intel MPI's mpirun",
        }
    }
}

/// A process a launcher started as one rank of a job.
#[derive(Clone, Debug)]
pub struct Launched {
    pub launcher: Launcher,
    pub rendezvous: Rendezvous,
    /// Its rank among the ranks on its host: the GPU it takes.
    pub local: usize,
    /// The ranks on each host, where the launcher says so and every host
    /// runs as many (torchrun's `LOCAL_WORLD_SIZE`, Slurm's
    /// `SLURM_STEP_TASKS_PER_NODE`, Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE`,
    /// Hydra's `MPI_LOCALNRANKS`): what hybrid sharding groups by.
    pub local_size: Option<usize>,
}

/// The variables of each launcher: world size, rank, local rank.
const VARS: [(Launcher, [&str; 3]); 4] = [
    (Launcher::Torchrun, ["WORLD_SIZE", "RANK", "LOCAL_RANK"]),
    (
        Launcher::Slurm,
        ["SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID"],
    ),
    (
        Launcher::OpenMpi,
        [
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ],
    ),
    (Launcher::Hydra, ["PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"]),
];

fn fail(m: String) -> RuntimeError {
    RuntimeError::Unsupported(m)
}

/// The job the first launcher found describes (in the order above: a
/// torchrun started inside an srun step is the one that counts); `None`
/// when none is set or it asks for one rank.
pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launched>, RuntimeError> {
    let num = |name: &str| -> Result<Option<usize>, RuntimeError> {
        match var(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| fail(format!("{name}={v:?} is not a whole number"))),
        }
    };
    let Some((launcher, [world_var, rank_var, local_var])) =
        VARS.into_iter().find(|(_, v)| var(v[0]).is_some())
    else {
        return Ok(None);
    };
    let world = match num(world_var)? {
        None | Some(0) | Some(1) => return Ok(None),
        Some(w) => w,
    };
    let rank = num(rank_var)?.ok_or_else(|| {
        fail(format!(
            "{world_var}={world} is set but {rank_var} is not: the launcher sets both"
        ))
    })?;
    if rank >= world {
        return Err(fail(format!(
            "{rank_var}={rank} must be below {world_var}={world}"
        )));
    }
    let local = num(local_var)?.unwrap_or(rank);
    let port = match var("MASTER_PORT") {
        Some(p) => p
            .trim()
            .parse()
            .map_err(|_| fail(format!("MASTER_PORT={p:?} is not a port number")))?,
        // Two jobs sharing a host under Slurm get different ports.
        None => match (launcher, num("SLURM_JOB_ID")?) {
            (Launcher::Slurm, Some(job)) => 29500 + (job % 1000) as u16,
            _ => 29500,
        },
    };
    let addr = match var("MASTER_ADDR") {
        Some(a) => a,
        None => rank0_host(launcher, world, &var, &num)?,
    };
    let local_size = match launcher {
        Launcher::Torchrun => num("LOCAL_WORLD_SIZE")?,
        Launcher::Slurm => var("SLURM_STEP_TASKS_PER_NODE")
            .or_else(|| var("SLURM_TASKS_PER_NODE"))
            .and_then(|v| same_tasks_per_node(&v)),
        Launcher::OpenMpi => num("OMPI_COMM_WORLD_LOCAL_SIZE")?,
        Launcher::Hydra => num("MPI_LOCALNRANKS")?,
    };
    let timeout = Duration::from_secs(num("FUSEC_RENDEZVOUS_TIMEOUT")?.unwrap_or(300) as u64);
    Ok(Some(Launched {
        launcher,
        rendezvous: Rendezvous {
            addr,
            port,
            rank,
            world,
            timeout,
        },
        local,
        local_size,
    }))
}

/// The tasks on every node of a Slurm step, where each runs as many:
/// `SLURM_STEP_TASKS_PER_NODE` as `4(x2)` or `4,4` is 4; `4,2` or
/// `2(x2),1` is `None`.
pub fn same_tasks_per_node(list: &str) -> Option<usize> {
    let mut counts = list.split(',').map(|entry| {
        let n = entry.split('(').next()?.trim();
        n.parse::<usize>().ok()
    });
    let first = counts.next()??;
    counts.all(|n| n == Some(first)).then_some(first)
}

/// Where rank 0 runs when `MASTER_ADDR` does not say.
fn rank0_host(
    launcher: Launcher,
    world: usize,
    var: &impl Fn(&str) -> Option<String>,
    num: &impl Fn(&str) -> Result<Option<usize>, RuntimeError>,
) -> Result<String, RuntimeError> {
    let local_size = |name: &str| num(name).map(|n| n == Some(world));
    match launcher {
        Launcher::Torchrun => Ok("127.0.0.1".into()),
        Launcher::Slurm => {
            let list = [
                "SLURM_STEP_NODELIST",
                "SLURM_JOB_NODELIST",
                "SLURM_NODELIST",
            ]
            .into_iter()
            .find_map(|v| var(v).map(|l| (v, l)));
            match list {
                Some((v, l)) => first_host(&l).ok_or_else(|| {
                    fail(format!(
                        "{v}={l:?} is not a host list fusec can read; set MASTER_ADDR to rank 0's host"
                    ))
                }),
                None => Err(fail(
                    "srun set no SLURM_STEP_NODELIST: set MASTER_ADDR to rank 0's host".into(),
                )),
            }
        }
        Launcher::OpenMpi | Launcher::Hydra => {
            let one_host = if launcher == Launcher::OpenMpi {
                local_size("OMPI_COMM_WORLD_LOCAL_SIZE")?
            } else {
                local_size("MPI_LOCALNRANKS")?
            };
            if one_host {
                Ok("127.0.0.1".into())
            } else {
                Err(fail(format!(
                    "{} ranks over several hosts, and mpirun does not say which host runs rank 0: pass its address, e.g. mpirun -x MASTER_ADDR=<rank 0's host> (Open MPI) or -env MASTER_ADDR <host> (MPICH)",
                    world
                )))
            }
        }
    }
}

/// The first host of a Slurm host list: `gpu[003-006,9],login1` is `gpu003`
/// (a range keeps its zeros), `a1,b2` is `a1`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // The first entry ends at a comma outside brackets.
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let entry = &list[..end];
    let host = match entry.find('[') {
        None => entry.to_string(),
        Some(open) => {
            let close = entry[open..].find(']')? + open;
            let first = entry[open + 1..close].split(',').next()?;
            let start = first.split('-').next()?;
            if start.is_empty() || !start.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            format!("{}{start}{}", &entry[..open], &entry[close + 1..])
        }
    };
    let ok = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    ok.then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| pairs.iter().find(|p| p.0 == k).map(|p| p.1.clone())
    }

    fn job(pairs: &[(&str, &str)]) -> Launched {
        from_env(env(pairs)).unwrap().expect("a job")
    }

    fn error(pairs: &[(&str, &str)]) -> String {
        from_env(env(pairs)).unwrap_err().to_string()
    }

    /// What hybrid sharding groups by: each launcher's ranks a host, where
    /// every host runs as many.
    #[test]
    fn each_launcher_says_how_many_ranks_a_host_runs() {
        let torchrun = [("WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "1")];
        assert_eq!(job(&torchrun).local_size, None);
        let mut with = torchrun.to_vec();
        with.push(("LOCAL_WORLD_SIZE", "2"));
        assert_eq!(job(&with).local_size, Some(2));
        let srun = [
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "gpu[1-2]"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
        ];
        assert_eq!(job(&srun).local_size, Some(4));
        assert_eq!(same_tasks_per_node("4,4"), Some(4));
        assert_eq!(same_tasks_per_node("4,2"), None);
        assert_eq!(same_tasks_per_node("2(x2),1"), None);
        assert_eq!(same_tasks_per_node("x"), None);
        let mpi = [
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
        ];
        assert_eq!(job(&mpi).local_size, Some(2));
        let hydra = [
            ("PMI_SIZE", "4"),
            ("PMI_RANK", "1"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "4"),
        ];
        assert_eq!(job(&hydra).local_size, Some(4));
    }

    #[test]
    fn torchrun_variables_are_read_and_checked() {
        assert!(from_env(env(&[])).unwrap().is_none());
        assert!(from_env(env(&[("WORLD_SIZE", "1")])).unwrap().is_none());
        let j = job(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.2"),
            ("MASTER_PORT", "29600"),
        ]);
        let rv = &j.rendezvous;
        assert_eq!((rv.rank, rv.world, j.local, rv.port), (3, 4, 1, 29600));
        assert_eq!(
            (rv.addr.as_str(), j.launcher),
            ("10.0.0.2", Launcher::Torchrun)
        );
        assert!(error(&[("WORLD_SIZE", "2")]).contains("RANK is not"));
        assert!(error(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("below WORLD_SIZE"));
        assert!(error(&[("WORLD_SIZE", "two")]).contains("not a whole number"));
    }

    #[test]
    fn srun_tasks_find_rank_zero_on_the_first_host() {
        let step = [
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "gpu[007-008,012]"),
            ("SLURM_JOB_NODELIST", "gpu[001-012]"),
            ("SLURM_JOB_ID", "123456"),
        ];
        let j = job(&step);
        let rv = &j.rendezvous;
        assert_eq!(j.launcher, Launcher::Slurm);
        assert_eq!((rv.rank, rv.world, j.local), (5, 8, 1));
        assert_eq!((rv.addr.as_str(), rv.port), ("gpu007", 29500 + 456));
        // MASTER_ADDR and MASTER_PORT win; torchrun inside the step wins.
        let mut over = step.to_vec();
        over.extend([("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "31000")]);
        let j = job(&over);
        assert_eq!(
            (j.rendezvous.addr.as_str(), j.rendezvous.port),
            ("10.1.2.3", 31000)
        );
        over.extend([("WORLD_SIZE", "2"), ("RANK", "1")]);
        assert_eq!(job(&over).launcher, Launcher::Torchrun);
        // A batch script's own shell (no step) is one process, not a job.
        assert!(
            from_env(env(&[("SLURM_NTASKS", "8"), ("SLURM_PROCID", "0")]))
                .unwrap()
                .is_none()
        );
        let e = error(&[("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "2")]);
        assert!(
            e.contains("SLURM_PROCID=2 must be below SLURM_STEP_NUM_TASKS=2"),
            "{e}"
        );
        let e = error(&[("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "1")]);
        assert!(e.contains("set MASTER_ADDR"), "{e}");
        let e = error(&[
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NODELIST", "gpu[a-b]"),
        ]);
        assert!(e.contains("not a host list"), "{e}");
    }

    #[test]
    fn mpirun_ranks_need_rank_zeros_host_across_hosts() {
        let one_host = [
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ];
        let j = job(&one_host);
        assert_eq!(j.launcher, Launcher::OpenMpi);
        assert_eq!((j.rendezvous.rank, j.rendezvous.world, j.local), (2, 4, 2));
        assert_eq!(
            (j.rendezvous.addr.as_str(), j.rendezvous.port),
            ("127.0.0.1", 29500)
        );
        let two_hosts = [
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        assert!(error(&two_hosts).contains("-x MASTER_ADDR"));
        let mut given = two_hosts.to_vec();
        given.push(("MASTER_ADDR", "node1"));
        assert_eq!(job(&given).rendezvous.addr, "node1");
        let j = job(&[
            ("PMI_SIZE", "2"),
            ("PMI_RANK", "1"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ]);
        assert_eq!(
            (j.launcher, j.rendezvous.rank, j.local),
            (Launcher::Hydra, 1, 1)
        );
    }

    #[test]
    fn slurm_host_lists() {
        for (list, first) in [
            ("node01", Some("node01")),
            ("gpu[001-004]", Some("gpu001")),
            ("gpu[7,9-10],cpu1", Some("gpu7")),
            ("a1,b2", Some("a1")),
            ("rack-2-n[03-04].cluster", Some("rack-2-n03.cluster")),
            ("gpu[x]", None),
            ("gpu[01", None),
            ("", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list}");
        }
    }
}
