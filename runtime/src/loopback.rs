//! Ranks of one process meeting without NCCL, through host memory: every
//! collective a rank's communicator is asked for (`nccl::Comm::group`) is
//! deposited here, and once every rank has deposited its calls each takes
//! its results from all of them. For checking the data-parallel step (the
//! plan's buckets and gathers, the executor's issue and joins, ZeRO's
//! pieces) on a machine with one GPU, where NCCL refuses two ranks on one
//! device: several ranks' sessions share the GPU, each with its own arena.
//! Slow (every collective waits for the streams and goes through the
//! host), and not capturable in a CUDA graph; never a measurement of
//! communication.

use crate::exec::{decode, encode};
use crate::RuntimeError;
use cudarc::driver::{result, CudaStream};
use fusec_compiler::dtype::DType;
use std::sync::{Barrier, Mutex};

/// What one rank asks of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// The mean onto every rank.
    AllReduce,
    /// The mean onto the root alone.
    Reduce(usize),
    /// The root's values onto every rank.
    Broadcast(usize),
}

/// One call as deposited: what, its type, the input's values (as f64), and
/// where this rank wants the output.
struct Deposit {
    call: Call,
    dtype: DType,
    values: Vec<f64>,
    output: u64,
    /// Elements of the output.
    count: usize,
}

/// The ranks' meeting place.
pub struct Loopback {
    ranks: usize,
    deposits: Mutex<Vec<Vec<Deposit>>>,
    barrier: Barrier,
    /// The places of the communicators split from this one (`split`), by
    /// (the split's number among this one's, its colour).
    splits: Mutex<std::collections::BTreeMap<(usize, usize), std::sync::Arc<Loopback>>>,
}

fn driver(e: cudarc::driver::DriverError) -> RuntimeError {
    RuntimeError::driver("a loopback collective's copy", e)
}

impl Loopback {
    pub fn new(ranks: usize) -> Loopback {
        Loopback {
            ranks,
            deposits: Mutex::new((0..ranks).map(|_| Vec::new()).collect()),
            barrier: Barrier::new(ranks),
            splits: Mutex::new(Default::default()),
        }
    }

    /// The meeting place of the `ranks` ranks of colour `color` in split
    /// number `nth` of this communicator (what `ncclCommSplit` makes): the
    /// same place for every rank of that colour that asks.
    pub fn split(&self, nth: usize, color: usize, ranks: usize) -> std::sync::Arc<Loopback> {
        let mut splits = self.splits.lock().expect("a rank panicked");
        let place = splits
            .entry((nth, color))
            .or_insert_with(|| std::sync::Arc::new(Loopback::new(ranks)));
        std::sync::Arc::clone(place)
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Rank `rank`'s part of one group of calls ((device input, device
    /// output, elements, dtype), what): waits for what `stream` has queued,
    /// reads its inputs, meets the other ranks, writes its outputs. Every
    /// rank must make the same calls in the same order (NCCL's rule; a
    /// mismatch is an error here, where NCCL would hang).
    pub fn group(
        &self,
        rank: usize,
        stream: &CudaStream,
        calls: &[(u64, u64, usize, DType, Call)],
    ) -> Result<(), RuntimeError> {
        if let Some(&(.., dtype, _)) = calls
            .iter()
            .find(|c| !matches!(c.3, DType::F32 | DType::BF16 | DType::F16))
        {
            return Err(RuntimeError::Unsupported(format!(
                "a loopback collective of {dtype:?} values: only floats are averaged or sent"
            )));
        }
        stream.synchronize().map_err(driver)?;
        let mut mine = Vec::with_capacity(calls.len());
        for &(input, output, count, dtype, call) in calls {
            // Only a root's input matters to a broadcast.
            let read = !matches!(call, Call::Broadcast(root) if root != rank);
            let values = if read {
                let mut bytes = vec![0u8; count * dtype.size_bytes()];
                // SAFETY: `input` is `count` elements of `dtype` in this
                // rank's arena, and the stream that writes it is idle.
                unsafe { result::memcpy_dtoh_sync(&mut bytes, input) }.map_err(driver)?;
                decode(dtype, &bytes)
            } else {
                Vec::new()
            };
            mine.push(Deposit {
                call,
                dtype,
                values,
                output,
                count,
            });
        }
        self.deposits.lock().expect("a rank panicked")[rank] = mine;
        self.barrier.wait();
        let outcome = self.results(rank);
        // Nobody clears a deposit before every rank has read them all.
        self.barrier.wait();
        let outputs = outcome?;
        for (output, bytes) in outputs {
            // SAFETY: `output` holds as many bytes of this rank's arena
            // (the call's count of its dtype), which nothing else writes
            // until the step's next launch.
            unsafe { result::memcpy_htod_sync(output, &bytes) }.map_err(driver)?;
        }
        Ok(())
    }

    /// Rank `rank`'s outputs (address, bytes) from every rank's deposits.
    fn results(&self, rank: usize) -> Result<Vec<(u64, Vec<u8>)>, RuntimeError> {
        let all = self.deposits.lock().expect("a rank panicked");
        let mine = &all[rank];
        if let Some(r) = all.iter().position(|d| d.len() != mine.len()) {
            return Err(RuntimeError::Unsupported(format!(
                "loopback ranks {rank} and {r} made {} and {} collective calls in one group",
                mine.len(),
                all[r].len()
            )));
        }
        let mut out = Vec::new();
        for (k, d) in mine.iter().enumerate() {
            let peer = |r: usize| &all[r][k];
            if (0..self.ranks).any(|r| peer(r).call != d.call) {
                return Err(RuntimeError::Unsupported(format!(
                    "loopback rank {rank}'s call {k} is {:?}, another rank's differs",
                    d.call
                )));
            }
            if (0..self.ranks).any(|r| peer(r).count != d.count) {
                return Err(RuntimeError::Unsupported(format!(
                    "loopback rank {rank}'s call {k} moves {} elements, another rank's differs",
                    d.count
                )));
            }
            let values = match d.call {
                Call::Broadcast(root) => peer(root).values.clone(),
                Call::Reduce(root) if root != rank => continue,
                Call::AllReduce | Call::Reduce(_) => {
                    let n = d.values.len();
                    if let Some(r) = (0..self.ranks).find(|&r| peer(r).values.len() != n) {
                        return Err(RuntimeError::Unsupported(format!(
                            "loopback ranks {rank} and {r} average {n} and {} elements in call {k}",
                            peer(r).values.len()
                        )));
                    }
                    let mut sum = vec![0.0; n];
                    for r in 0..self.ranks {
                        for (s, v) in sum.iter_mut().zip(&peer(r).values) {
                            *s += v;
                        }
                    }
                    sum.iter().map(|s| s / self.ranks as f64).collect()
                }
            };
            out.push((d.output, encode(d.dtype, &values)));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deposit(call: Call, values: &[f64], output: u64) -> Deposit {
        Deposit {
            call,
            dtype: DType::F32,
            values: values.to_vec(),
            output,
            count: values.len().max(2),
        }
    }

    /// What each rank takes from the deposits: the mean on every rank,
    /// the mean on a reduce's root alone, the root's values on every rank
    /// (a broadcast's other ranks deposit nothing); calls that differ
    /// between the ranks are an error.
    #[test]
    fn each_rank_takes_the_mean_or_the_roots_values() {
        let place = Loopback::new(2);
        {
            let mut d = place.deposits.lock().unwrap();
            d[0] = vec![
                deposit(Call::AllReduce, &[1.0, 2.0], 100),
                deposit(Call::Reduce(1), &[4.0, 5.0], 200),
                deposit(Call::Broadcast(0), &[7.0, 8.0], 300),
            ];
            d[1] = vec![
                deposit(Call::AllReduce, &[3.0, 6.0], 110),
                deposit(Call::Reduce(1), &[0.0, 1.0], 210),
                deposit(Call::Broadcast(0), &[], 310),
            ];
        }
        let floats = |b: &[u8]| decode(DType::F32, b);
        let r0 = place.results(0).unwrap();
        assert_eq!(r0.len(), 2, "rank 0 is no reduce's root");
        assert_eq!((r0[0].0, floats(&r0[0].1)), (100, vec![2.0, 4.0]));
        assert_eq!((r0[1].0, floats(&r0[1].1)), (300, vec![7.0, 8.0]));
        let r1 = place.results(1).unwrap();
        assert_eq!(r1.len(), 3);
        assert_eq!((r1[0].0, floats(&r1[0].1)), (110, vec![2.0, 4.0]));
        assert_eq!((r1[1].0, floats(&r1[1].1)), (210, vec![2.0, 3.0]));
        assert_eq!((r1[2].0, floats(&r1[2].1)), (310, vec![7.0, 8.0]));
        place.deposits.lock().unwrap()[1][1].call = Call::AllReduce;
        assert!(place.results(0).is_err());
        place.deposits.lock().unwrap()[1][1].call = Call::Reduce(1);
        place.deposits.lock().unwrap()[1][2].count = 3;
        assert!(place.results(0).is_err(), "a broadcast of another length");
        place.deposits.lock().unwrap()[1][2].count = 2;
        place.deposits.lock().unwrap()[1][0].values.push(1.0);
        assert!(place.results(0).is_err());
    }

    /// A split's ranks of one colour meet at one place of their own
    /// (hybrid sharding's group and its replicas), another colour or
    /// another split elsewhere.
    #[test]
    fn a_split_gives_each_colour_its_own_place() {
        let place = Loopback::new(4);
        let (a, b) = (place.split(0, 1, 2), place.split(0, 1, 2));
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        assert_eq!(a.ranks(), 2);
        assert!(!std::sync::Arc::ptr_eq(&a, &place.split(0, 0, 2)));
        assert!(!std::sync::Arc::ptr_eq(&a, &place.split(1, 1, 2)));
    }

    #[test]
    fn values_round_trip_through_each_dtype() {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let v = [1.5, -2.25, 0.0, 1024.0];
            assert_eq!(decode(dt, &encode(dt, &v)), v.to_vec(), "{dt:?}");
        }
    }
}
