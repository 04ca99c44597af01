//! Ranks of a data-parallel step on the CPU reference: one interpreter per
//! rank, each on its own thread, meeting at every `all_reduce`. The CPU
//! stand-in for NCCL, so that N ranks can be checked against one rank with
//! N times the batch without a GPU.

use super::tensor::Tensor;
use std::sync::{Arc, Barrier, Mutex};

/// What the ranks of one group share.
struct Group {
    ranks: usize,
    barrier: Barrier,
    /// Each rank's contribution to the all-reduce in progress.
    slots: Mutex<Vec<Option<Vec<f64>>>>,
}

/// One rank's handle on its group.
#[derive(Clone)]
pub struct Peers {
    group: Arc<Group>,
    rank: usize,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Peers(rank {} of {})", self.rank, self.group.ranks)
    }
}

impl Peers {
    /// The handles of a group of `ranks` ranks, rank 0 first.
    pub fn group(ranks: usize) -> Vec<Peers> {
        let group = Arc::new(Group {
            ranks,
            barrier: Barrier::new(ranks),
            slots: Mutex::new(vec![None; ranks]),
        });
        (0..ranks)
            .map(|rank| Peers {
                group: Arc::clone(&group),
                rank,
            })
            .collect()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn ranks(&self) -> usize {
        self.group.ranks
    }

    /// The element-wise mean of `t` over every rank. Blocks until every rank
    /// has called it. Each rank sums in rank order, so all get the same
    /// bits.
    pub fn mean(&self, t: &Tensor) -> Tensor {
        let mut sum = vec![0.0; t.data.len()];
        for s in self.gather(t) {
            assert_eq!(s.len(), sum.len(), "ranks all-reduce tensors of one size");
            for (a, b) in sum.iter_mut().zip(&s) {
                *a += b;
            }
        }
        let ranks = self.group.ranks as f64;
        Tensor::new(
            t.shape.clone(),
            sum.into_iter().map(|x| x / ranks).collect(),
        )
    }

    /// Every rank's `t`, in rank order (the mean's parts; ZeRO stage 3's
    /// gather of a parameter's pieces). Blocks until every rank has called
    /// it.
    pub fn gather(&self, t: &Tensor) -> Vec<Vec<f64>> {
        let g = &self.group;
        g.slots.lock().expect("a rank panicked")[self.rank] = Some(t.data.clone());
        g.barrier.wait();
        let all = g
            .slots
            .lock()
            .expect("a rank panicked")
            .iter()
            .map(|s| s.clone().expect("every rank has written its part"))
            .collect();
        // Nobody writes the next collective's part before all have read.
        g.barrier.wait();
        all
    }
}

impl Peers {
    /// Rank `root`'s `t`, on every rank (ZeRO's broadcast of the updated
    /// parameters from their owner). Blocks until every rank has called it.
    pub fn share(&self, root: usize, t: &Tensor) -> Tensor {
        let g = &self.group;
        if self.rank == root {
            g.slots.lock().expect("a rank panicked")[root] = Some(t.data.clone());
        }
        g.barrier.wait();
        let data = g.slots.lock().expect("a rank panicked")[root]
            .clone()
            .expect("the root has written its part");
        g.barrier.wait();
        Tensor::new(t.shape.clone(), data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_mean_in_the_same_bits() {
        let peers = Peers::group(3);
        let out: Vec<Vec<f64>> = std::thread::scope(|s| {
            let hs: Vec<_> = peers
                .iter()
                .map(|p| {
                    s.spawn(move || {
                        let r = p.rank() as f64;
                        // Two rounds: the second must not see the first's parts.
                        let a = p.mean(&Tensor::new(vec![2], vec![r, 0.1 * r]));
                        let b = p.mean(&Tensor::new(vec![1], vec![10.0 * r]));
                        [a.data, b.data].concat()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in &out {
            assert_eq!(o, &out[0]);
        }
        assert_eq!(out[0][0], 1.0);
        assert!((out[0][1] - 0.1).abs() < 1e-15);
        assert_eq!(out[0][2], 10.0);
    }
}
