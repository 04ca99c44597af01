//! How the processes of one data-parallel job find each other: rank 0
//! listens at `MASTER_ADDR:MASTER_PORT`, every other rank connects and says
//! who it is and the hash of the plan it is about to run, and rank 0 answers
//! each with the NCCL unique id (or with why the job cannot start: a rank
//! twice, a rank out of range, a plan that differs). NCCL does the rest.
//!
//! The protocol is one line each way:
//! `fusec-rendezvous 1 <rank> <world> <plan hash>` and `ok <id as hex>` or
//! `error <message>`.

use crate::nccl::UniqueId;
use crate::RuntimeError;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const HELLO: &str = "fusec-rendezvous 1";

/// Where and as whom this process joins.
#[derive(Clone, Debug)]
pub struct Rendezvous {
    pub addr: String,
    pub port: u16,
    pub rank: usize,
    pub world: usize,
    /// How long rank 0 waits for the others, and the others for rank 0.
    pub timeout: Duration,
}

fn fail(m: String) -> RuntimeError {
    RuntimeError::Unsupported(m)
}

impl Rendezvous {
    /// Exchanges the id: rank 0 makes it with `make_id` and hands it out;
    /// every rank returns it. `plan` is the hash of the plan this rank runs.
    pub fn exchange(
        &self,
        plan: u64,
        make_id: impl FnOnce() -> Result<UniqueId, RuntimeError>,
    ) -> Result<UniqueId, RuntimeError> {
        if self.world < 2 || self.rank >= self.world {
            return Err(fail(format!(
                "rank {} of {}: a job needs at least 2 ranks, each below WORLD_SIZE",
                self.rank, self.world
            )));
        }
        if self.rank == 0 {
            self.serve(plan, make_id)
        } else {
            self.join(plan)
        }
    }

    fn serve(
        &self,
        plan: u64,
        make_id: impl FnOnce() -> Result<UniqueId, RuntimeError>,
    ) -> Result<UniqueId, RuntimeError> {
        let listener = TcpListener::bind(("0.0.0.0", self.port)).map_err(|e| {
            fail(format!(
                "rank 0 cannot listen on port {} (MASTER_PORT): {e}; pick a free port",
                self.port
            ))
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(format!("rank 0: {e}")))?;
        let deadline = Instant::now() + self.timeout;
        // (rank, its connection), in arrival order.
        let mut peers: Vec<(usize, TcpStream)> = Vec::new();
        let mut problem: Option<String> = None;
        while peers.len() + 1 < self.world {
            match listener.accept() {
                Ok((stream, from)) => {
                    stream
                        .set_nonblocking(false)
                        .and_then(|_| stream.set_read_timeout(Some(Duration::from_secs(30))))
                        .map_err(|e| fail(format!("rank 0: {e}")))?;
                    let mut line = String::new();
                    BufReader::new(&stream)
                        .read_line(&mut line)
                        .map_err(|e| fail(format!("rank 0: reading from {from}: {e}")))?;
                    let (rank, world, hash) = parse_hello(&line).ok_or_else(|| {
                        fail(format!(
                            "rank 0: {from} connected to MASTER_PORT {} but is not a fusec rank (it sent {:?})",
                            self.port,
                            line.trim_end()
                        ))
                    })?;
                    let why = if world != self.world {
                        Some(format!(
                            "rank {rank} was started with WORLD_SIZE={world}, rank 0 with {}",
                            self.world
                        ))
                    } else if rank == 0 || rank >= self.world {
                        Some(format!(
                            "a process claims rank {rank}, outside 1..{}",
                            self.world
                        ))
                    } else if peers.iter().any(|(r, _)| *r == rank) {
                        Some(format!("two processes claim rank {rank}"))
                    } else if hash != plan {
                        Some(format!(
                            "rank {rank}'s plan differs from rank 0's (hash {hash:016x} against {plan:016x}): every rank must run the same model file, --set, sizes, precision and data"
                        ))
                    } else {
                        None
                    };
                    if let Some(w) = why {
                        problem.get_or_insert(w);
                    }
                    peers.push((rank, stream));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = (1..self.world)
                            .filter(|r| !peers.iter().any(|(p, _)| p == r))
                            .map(|r| r.to_string())
                            .collect();
                        let m = format!(
                            "rank 0: rank{} {} of {} did not arrive within {} s at port {}; start every rank with the same MASTER_ADDR and MASTER_PORT (FUSEC_RENDEZVOUS_TIMEOUT sets the wait)",
                            if missing.len() == 1 { "" } else { "s" },
                            missing.join(", "),
                            self.world,
                            self.timeout.as_secs(),
                            self.port
                        );
                        for (_, s) in &mut peers {
                            let _ = writeln!(s, "error {m}");
                        }
                        return Err(fail(m));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(fail(format!("rank 0: accepting a rank: {e}"))),
            }
        }
        if let Some(m) = problem {
            for (_, s) in &mut peers {
                let _ = writeln!(s, "error {m}");
            }
            return Err(fail(m));
        }
        let id = match make_id() {
            Ok(id) => id,
            Err(e) => {
                for (_, s) in &mut peers {
                    let _ = writeln!(s, "error rank 0 could not start NCCL: {e}");
                }
                return Err(e);
            }
        };
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        for (rank, s) in &mut peers {
            writeln!(s, "ok {hex}")
                .map_err(|e| fail(format!("rank 0: sending the id to rank {rank}: {e}")))?;
        }
        Ok(id)
    }

    fn join(&self, plan: u64) -> Result<UniqueId, RuntimeError> {
        let deadline = Instant::now() + self.timeout;
        let target = format!("{}:{}", self.addr, self.port);
        let mut stream = loop {
            let tried = target
                .to_socket_addrs()
                .map_err(|e| {
                    fail(format!(
                        "rank {}: MASTER_ADDR {} does not resolve: {e}",
                        self.rank, self.addr
                    ))
                })?
                .find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok());
            match tried {
                Some(s) => break s,
                // Rank 0 may not be listening yet.
                None if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                None => {
                    return Err(fail(format!(
                        "rank {}: could not reach rank 0 at {target} within {} s; is rank 0 running, and are MASTER_ADDR and MASTER_PORT the same on every rank?",
                        self.rank,
                        self.timeout.as_secs()
                    )))
                }
            }
        };
        writeln!(stream, "{HELLO} {} {} {plan}", self.rank, self.world)
            .map_err(|e| fail(format!("rank {}: talking to rank 0: {e}", self.rank)))?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        stream
            .set_read_timeout(Some(remaining.max(Duration::from_secs(5))))
            .map_err(|e| fail(format!("rank {}: {e}", self.rank)))?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line).map_err(|e| {
            fail(format!(
                "rank {}: no answer from rank 0 ({e}): some rank has not started",
                self.rank
            ))
        })?;
        let line = line.trim_end();
        if let Some(m) = line.strip_prefix("error ") {
            return Err(fail(format!(
                "rank {}: rank 0 refused the job: {m}",
                self.rank
            )));
        }
        line.strip_prefix("ok ")
            .and_then(parse_id)
            .ok_or_else(|| fail(format!("rank {}: rank 0 answered {line:?}", self.rank)))
    }
}

fn parse_hello(line: &str) -> Option<(usize, usize, u64)> {
    let rest = line.trim_end().strip_prefix(HELLO)?;
    let mut w = rest.split_whitespace();
    let rank = w.next()?.parse().ok()?;
    let world = w.next()?.parse().ok()?;
    let hash = w.next()?.parse().ok()?;
    w.next().is_none().then_some((rank, world, hash))
}

fn parse_id(hex: &str) -> Option<UniqueId> {
    if hex.len() != 256 {
        return None;
    }
    let mut id = [0u8; 128];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn at(port: u16, rank: usize, world: usize, secs: u64) -> Rendezvous {
        Rendezvous {
            addr: "127.0.0.1".into(),
            port,
            rank,
            world,
            timeout: Duration::from_secs(secs),
        }
    }

    /// Runs ranks 0..world with the given plan hashes, each on a thread.
    fn job(world: usize, hashes: &[u64], secs: u64) -> Vec<Result<UniqueId, String>> {
        let port = free_port();
        let id = [7u8; 128];
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let rv = at(port, r, world, secs);
                    let h = hashes[r];
                    s.spawn(move || rv.exchange(h, || Ok(id)).map_err(|e| e.to_string()))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_gets_rank_zeros_id_over_loopback() {
        let out = job(4, &[5, 5, 5, 5], 20);
        for r in &out {
            assert_eq!(r.as_ref().unwrap(), &[7u8; 128]);
        }
    }

    #[test]
    fn a_rank_with_another_plan_stops_the_job_and_is_named() {
        let out = job(3, &[5, 5, 6], 20);
        for r in &out {
            let e = r.as_ref().unwrap_err();
            assert!(e.contains("rank 2's plan differs from rank 0's"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_never_comes_is_named_after_the_timeout() {
        let port = free_port();
        let e = at(port, 0, 3, 1)
            .exchange(1, || Ok([0; 128]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ranks 1, 2 of 3 did not arrive within 1 s"),
            "{e}"
        );
        let e = at(free_port(), 1, 2, 1)
            .exchange(1, || Ok([0; 128]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1: could not reach rank 0"), "{e}");
    }

    #[test]
    fn ids_round_trip_through_hex() {
        let id: UniqueId = std::array::from_fn(|i| i as u8);
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(parse_id(&hex), Some(id));
        assert_eq!(parse_id("zz"), None);
    }
}
