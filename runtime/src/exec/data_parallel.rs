//! A rank's share of data parallelism in the executor: its communicator,
//! the stream its buckets' collectives run on, and the timings of those
//! collectives in a profiled step.

use super::LaunchTime;
use crate::device::Gpu;
use crate::nccl;
use crate::RuntimeError;

/// A rank's share of data parallelism: its communicator and the stream
/// the buckets' collectives run on. A collective starts once the compute
/// stream has finished what it averages; the launch that first reads a
/// result (the plan's `join`) waits for every collective issued so far.
pub struct DataParallel {
    pub comm: nccl::Comm,
    pub(super) stream: std::sync::Arc<cudarc::driver::CudaStream>,
    /// Issued and not yet waited for by the compute stream.
    pub(super) outstanding: bool,
    /// ZeRO stage 1: every parameter buffer and its owner rank, sent from
    /// the owner after the update.
    pub shares: Vec<(nccl::Tensor, usize)>,
    /// ZeRO stage 1: each parameter's pieces (`autodiff::zero::pieces`),
    /// to whose owners its gradient's mean is reduced.
    pub pieces: Vec<Vec<fusec_compiler::plan::shard::Piece>>,
    /// While a step is profiled: each collective's launch and the events
    /// recorded on the communication stream around it.
    pub(super) timing: Option<Vec<(usize, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>>,
    /// ZeRO stage 3: the gathers' own communicator and stream, so that a
    /// gather does not queue behind a bucket of gradients (`None`: they
    /// share the buckets').
    pub(super) gathers: Option<Channel>,
    /// Hybrid sharding (`shard_within`): ZeRO's pieces are split over this
    /// rank's group, whose communicator takes the reduces to the owners,
    /// the owners' broadcasts and the gathers; the owners' means are then
    /// averaged over the groups. `None`: every rank is one group.
    pub(super) hybrid: Option<Hybrid>,
}

/// Hybrid sharding's communicators: this rank's group (consecutive ranks,
/// a host's; its rank there is its place in the group) and its replicas
/// (the rank at the same place in every group: they own the same pieces).
pub(super) struct Hybrid {
    within: nccl::Comm,
    across: nccl::Comm,
}

/// A second communicator with its stream (`DataParallel::split_gathers`).
pub(super) struct Channel {
    comm: nccl::Comm,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    /// Each gather issued and not yet waited for: the launch that joins
    /// it and the event recorded after it, so that a reader waits for its
    /// own gathers, not for the sets issued after them.
    pending: Vec<(usize, cudarc::driver::CudaEvent)>,
}

/// What the compute stream waits for before a launch: the buckets (and
/// shares) issued so far, the gathers, or both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Join {
    pub reduces: bool,
    pub gathers: bool,
}

/// A collective of a profiled step (`Executor::profile_step_full`), in
/// milliseconds after the step's first event.
#[derive(Clone, Debug)]
pub struct CollectiveTime {
    /// The plan's launch it is.
    pub launch: usize,
    pub name: String,
    pub bytes: u64,
    /// When the compute stream had finished what it reads.
    pub ready_ms: f64,
    /// When it started and how long it ran on the communication stream.
    pub start_ms: f64,
    pub ms: f64,
    /// The launch the compute stream waits for it before (the number of
    /// launches: the end of the step), and when the compute stream got there.
    pub join: usize,
    pub join_ms: f64,
}

/// A step profiled launch by launch, with its collectives.
pub struct StepProfile {
    pub launches: Vec<LaunchTime>,
    pub collectives: Vec<CollectiveTime>,
    /// When the step ended (its last launch, and any wait for collectives
    /// after it).
    pub step_end_ms: f64,
}

impl DataParallel {
    pub fn new(gpu: &Gpu, comm: nccl::Comm) -> Result<DataParallel, RuntimeError> {
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| RuntimeError::driver("creating the communication stream", e))?;
        Ok(DataParallel {
            comm,
            stream,
            outstanding: false,
            shares: Vec::new(),
            pieces: Vec::new(),
            timing: None,
            gathers: None,
            hybrid: None,
        })
    }

    /// Hybrid sharding: ZeRO's pieces split over groups of `group`
    /// consecutive ranks (a host's), which hold the same pieces. Every rank
    /// calls it, before `split_gathers`.
    pub fn shard_within(&mut self, group: usize) -> Result<(), RuntimeError> {
        let (rank, ranks) = (self.comm.rank, self.comm.ranks);
        if group == 0 || !ranks.is_multiple_of(group) {
            return Err(RuntimeError::Unsupported(format!(
                "groups of {group} ranks do not divide {ranks} ranks"
            )));
        }
        let within = self.comm.split_by(rank / group, rank % group, group)?;
        let across = self
            .comm
            .split_by(rank % group, rank / group, ranks / group)?;
        self.hybrid = Some(Hybrid { within, across });
        Ok(())
    }

    /// The communicator ZeRO's owners are ranks of: the group's with
    /// hybrid sharding, else every rank's.
    fn owners(&self) -> &nccl::Comm {
        self.hybrid.as_ref().map_or(&self.comm, |h| &h.within)
    }

    /// ZeRO stage 3: the gathers on a communicator split from this one and
    /// a stream of their own. Every rank calls it.
    pub fn split_gathers(&mut self, gpu: &Gpu) -> Result<(), RuntimeError> {
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| RuntimeError::driver("creating the gathers' stream", e))?;
        self.gathers = Some(Channel {
            comm: self.owners().split()?,
            stream,
            pending: Vec::new(),
        });
        Ok(())
    }

    /// The owners' updated parameters to every rank, once the compute
    /// stream has run the update.
    pub(super) fn share(&mut self, gpu: &Gpu) -> Result<(), RuntimeError> {
        if self.shares.is_empty() {
            return Ok(());
        }
        self.stream.join(&gpu.stream).map_err(|e| {
            RuntimeError::driver("ordering the parameters' broadcast after the update", e)
        })?;
        self.owners().broadcast(&self.stream, &self.shares)?;
        self.outstanding = true;
        Ok(())
    }

    pub(super) fn issue(
        &mut self,
        gpu: &Gpu,
        bucket: &super::Bucket,
        launch: usize,
    ) -> Result<(), RuntimeError> {
        if let Some(ga) = &bucket.gather {
            let rank = self.owners().rank;
            let calls = nccl::gather_calls(rank, ga.input, ga.output, ga.dtype, &ga.pieces);
            let Some(ch) = self.gathers.as_mut() else {
                // The piece's cast is on the compute stream, just before.
                self.stream
                    .join(&gpu.stream)
                    .map_err(|e| RuntimeError::driver("ordering a gather after its piece", e))?;
                return self.timed(launch, |dp| dp.owners().gather(&dp.stream, &calls));
            };
            ch.stream
                .join(&gpu.stream)
                .map_err(|e| RuntimeError::driver("ordering a gather after its piece", e))?;
            let start = match self.timing {
                Some(_) => Some(event(&ch.stream)?),
                None => None,
            };
            ch.comm.gather(&ch.stream, &calls)?;
            if let Some(start) = start {
                let end = event(&ch.stream)?;
                if let Some(t) = self.timing.as_mut() {
                    t.push((launch, start, end));
                }
            }
            ch.pending.push((ga.join, event(&ch.stream)?));
            return Ok(());
        }
        if !bucket.owned.is_empty() && self.pieces.is_empty() {
            return Err(RuntimeError::Unsupported(
                "the step was built with --zero 1, 2 or 3 (gradients reduced to their owners), and this run does not shard the optimizer state: run it with the --zero it was built with".into(),
            ));
        }
        let rooted = if bucket.kept.is_empty() {
            nccl::owned_pieces(&bucket.owned, &self.pieces, fusec_compiler::plan::ALIGN)
        } else {
            nccl::kept_pieces(&bucket.owned, &bucket.kept, &self.pieces)
        };
        let tensors = &bucket.all;
        self.stream
            .join(&gpu.stream)
            .map_err(|e| RuntimeError::driver("ordering a collective after its gradients", e))?;
        let Some(h) = self.hybrid.as_ref() else {
            return self.timed(launch, |dp| dp.comm.average(&dp.stream, tensors, &rooted));
        };
        // Hybrid: the whole tensors over every rank; each piece to its
        // owner in the group, then the owners' means over the groups (the
        // ranks at one place own the same pieces, so each calls the same).
        let own: Vec<nccl::Tensor> = rooted
            .iter()
            .filter(|&&(_, root)| root == h.within.rank)
            .map(|&(t, _)| nccl::Tensor {
                input: t.output,
                ..t
            })
            .collect();
        self.timed(launch, |dp| {
            if !tensors.is_empty() {
                dp.comm.average(&dp.stream, tensors, &[])?;
            }
            let Some(h) = dp.hybrid.as_ref() else {
                unreachable!("checked above");
            };
            h.within.average(&dp.stream, &[], &rooted)?;
            if !own.is_empty() {
                h.across.average(&dp.stream, &own, &[])?;
            }
            Ok(())
        })
    }

    /// Queues `queue` (NCCL calls on the communication stream), between
    /// timing events while a step is profiled.
    fn timed(
        &mut self,
        launch: usize,
        queue: impl FnOnce(&Self) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let start = match self.timing {
            Some(_) => Some(event(&self.stream)?),
            None => None,
        };
        queue(self)?;
        if let Some(start) = start {
            let end = event(&self.stream)?;
            if let Some(t) = self.timing.as_mut() {
                t.push((launch, start, end));
            }
        }
        self.outstanding = true;
        Ok(())
    }

    /// The compute stream waits for everything issued so far.
    pub(super) fn wait(&mut self, gpu: &Gpu) -> Result<(), RuntimeError> {
        let all = Join {
            reduces: true,
            gathers: true,
        };
        self.wait_for(gpu, all, usize::MAX)
    }

    /// Before launch `at`, the compute stream waits for the buckets issued
    /// so far, the gathers that `at` joins (and any before them), or both
    /// (on one shared stream, a wait for either is for both).
    pub(super) fn wait_for(
        &mut self,
        gpu: &Gpu,
        join: Join,
        at: usize,
    ) -> Result<(), RuntimeError> {
        let shared = self.gathers.is_none() && (join.reduces || join.gathers);
        if (join.reduces || shared) && self.outstanding {
            gpu.stream
                .join(&self.stream)
                .map_err(|e| RuntimeError::driver("waiting for the averaged gradients", e))?;
            self.outstanding = false;
        }
        if let Some(ch) = self.gathers.as_mut().filter(|_| join.gathers) {
            // Issued in order on one stream: the last event due covers
            // every one before it.
            if let Some(k) = ch.pending.iter().rposition(|(j, _)| *j <= at) {
                gpu.stream
                    .wait(&ch.pending[k].1)
                    .map_err(|e| RuntimeError::driver("waiting for the gathered weights", e))?;
                ch.pending.drain(..=k);
            }
        }
        Ok(())
    }
}

/// An event recorded on `stream` (a profiled collective's start or end).
fn event(stream: &cudarc::driver::CudaStream) -> Result<cudarc::driver::CudaEvent, RuntimeError> {
    stream
        .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| RuntimeError::driver("recording a timing event", e))
}
