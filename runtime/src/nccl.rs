//! NCCL, as data parallelism uses it: one communicator per rank (a GPU),
//! joined through a unique id that one rank makes and hands to the others
//! (over a channel in one process, over TCP across processes; see
//! `rendezvous`), and the gradient buckets averaged in place on the
//! communication stream.

use crate::device::Gpu;
use crate::RuntimeError;
use cudarc::driver::CudaStream;
use cudarc::nccl::{result, sys};
use fusec_compiler::dtype::DType;
use fusec_compiler::plan::shard::Piece;

/// The id ranks join a communicator by (`ncclUniqueId`).
pub type UniqueId = [u8; 128];

pub struct Comm {
    /// NCCL's communicator, or (checking on one GPU) the ranks' meeting
    /// place in host memory.
    link: Link,
    pub rank: usize,
    pub ranks: usize,
    /// Communicators split from this one so far (each rank splits in the
    /// same order: the loopback tells the splits apart by it).
    splits: std::sync::atomic::AtomicUsize,
}

enum Link {
    Nccl(sys::ncclComm_t),
    Loopback(std::sync::Arc<crate::loopback::Loopback>),
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time;
// `Comm` is owned by the one thread that steps its rank.
unsafe impl Send for Comm {}

fn nccl_error(what: &str, e: result::NcclError) -> RuntimeError {
    RuntimeError::Driver {
        what: what.to_string(),
        detail: format!("NCCL error {:?} (NCCL_DEBUG=INFO says more)", e.0),
    }
}

/// Whether libnccl can be loaded.
pub fn present() -> bool {
    // SAFETY: only probes the dynamic loader.
    unsafe { sys::is_culib_present() }
}

pub fn need_nccl() -> Result<(), RuntimeError> {
    if present() {
        Ok(())
    } else {
        Err(RuntimeError::NoGpu(
            "training on several GPUs needs NCCL (libnccl.so.2), which is not on the loader path; install it (e.g. pip's nvidia-nccl-cu13) or add its folder to LD_LIBRARY_PATH".into(),
        ))
    }
}

/// `2.27.7`, or why not.
pub fn version() -> String {
    if !present() {
        return "not installed".into();
    }
    match result::get_nccl_version() {
        Ok(v) => format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100),
        Err(_) => "version unknown".into(),
    }
}

/// A fresh unique id, made by one rank (rank 0) for all.
pub fn unique_id() -> Result<UniqueId, RuntimeError> {
    need_nccl()?;
    let id = result::get_uniqueid().map_err(|e| nccl_error("making an NCCL unique id", e))?;
    Ok(id.internal.map(|c| c as u8))
}

fn dtype(dt: DType) -> Result<sys::ncclDataType_t, RuntimeError> {
    Ok(match dt {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
    })
}

/// One tensor of a bucket: device addresses in and out (equal: in place),
/// elements, dtype.
#[derive(Clone, Copy, Debug)]
pub struct Tensor {
    pub input: u64,
    pub output: u64,
    pub count: usize,
    pub dtype: DType,
}

/// `tensors` with each run of in-place tensors of one dtype that lie end
/// to end in memory (the next starting where the last one's bytes, aligned
/// up to `align`, end: the plan lays a bucket's gradients out so) merged
/// into one: NCCL averages one long buffer at close to the link's
/// bandwidth, and a dozen short ones (biases, norm weights) at a fraction
/// of it. The alignment gaps between them belong to no other buffer;
/// averaging them changes nothing anyone reads.
pub fn coalesce(tensors: &[Tensor], align: u64) -> Vec<Tensor> {
    let mut out: Vec<Tensor> = Vec::with_capacity(tensors.len());
    for &t in tensors {
        if let Some(last) = out.last_mut() {
            let size = last.dtype.size_bytes() as u64;
            let end = last.input + last.count as u64 * size;
            let joins = last.input == last.output
                && t.input == t.output
                && t.dtype == last.dtype
                && t.input == end.div_ceil(align) * align
                && (t.input - last.input) % size == 0;
            if joins {
                last.count = ((t.input - last.input) / size) as usize + t.count;
                continue;
            }
        }
        out.push(t);
    }
    out
}

/// ZeRO's broadcasts (each piece with its owner rank, in the parameters'
/// order) with each run of one owner's pieces merged as [`coalesce`]
/// merges a bucket's gradients: an owner's pieces are consecutive runs of
/// the parameters laid end to end, so where the arena keeps the parameters
/// in that order each rank sends one long buffer, not one per parameter.
pub fn coalesce_shares(shares: &[(Tensor, usize)], align: u64) -> Vec<(Tensor, usize)> {
    let mut out: Vec<(Tensor, usize)> = Vec::with_capacity(shares.len());
    let mut i = 0;
    while i < shares.len() {
        let root = shares[i].1;
        let run = shares[i..].iter().take_while(|(_, r)| *r == root).count();
        let tensors: Vec<Tensor> = shares[i..i + run].iter().map(|(t, _)| *t).collect();
        out.extend(coalesce(&tensors, align).into_iter().map(|t| (t, root)));
        i += run;
    }
    out
}

/// ZeRO stage 3: a parameter gathered whole on rank `rank` as one
/// broadcast per owner: each rank's piece (`pieces`, elements [lo, hi) in
/// rank order, empty where a rank owns none) from its owner into its
/// place in the whole buffer at `output`; the owner sends from its piece's
/// buffer at `input` (NCCL reads the send buffer on the root alone).
pub fn gather_calls(
    rank: usize,
    input: u64,
    output: u64,
    dtype: DType,
    pieces: &[(u64, u64)],
) -> Vec<(Tensor, usize)> {
    let size = dtype.size_bytes() as u64;
    pieces
        .iter()
        .enumerate()
        .filter(|(_, (lo, hi))| hi > lo)
        .map(|(root, &(lo, hi))| {
            let at = output + lo * size;
            (
                Tensor {
                    input: if root == rank { input } else { at },
                    output: at,
                    count: (hi - lo) as usize,
                    dtype,
                },
                root,
            )
        })
        .collect()
}

/// ZeRO: each of `tensors` (a parameter's values, or a bucket's tensor of
/// its gradient; with the parameter's index) cut into that parameter's
/// pieces (`pieces`, from `autodiff::zero::pieces`), each with its owner
/// rank, merged where one owner's pieces lie end to end
/// ([`coalesce_shares`]): the owners' broadcasts after the update, and
/// the reduces of the gradients to their owners.
pub fn owned_pieces(
    tensors: &[(Tensor, usize)],
    pieces: &[Vec<Piece>],
    align: u64,
) -> Vec<(Tensor, usize)> {
    let mut out = Vec::new();
    for (t, i) in tensors {
        let size = t.dtype.size_bytes() as u64;
        for pc in &pieces[*i] {
            out.push((
                Tensor {
                    input: t.input + pc.lo * size,
                    output: t.output + pc.lo * size,
                    count: (pc.hi - pc.lo) as usize,
                    dtype: t.dtype,
                },
                pc.rank as usize,
            ));
        }
    }
    coalesce_shares(&out, align)
}

/// ZeRO stage 2: each of `tensors` (a bucket's whole gradient, with its
/// parameter) cut into that parameter's pieces, each reduced to its owner:
/// where this rank keeps a piece (`kept`, by tensor), into the tensor's
/// output, a buffer of that piece alone; every other piece in place (its
/// output unused here: the reduce writes on its root alone). Never merged:
/// a rank's temporaries lie where its own plan put them, so what one rank
/// could merge another could not, and every rank must make the same calls.
pub fn kept_pieces(
    tensors: &[(Tensor, usize)],
    kept: &[Option<(u64, u64)>],
    pieces: &[Vec<Piece>],
) -> Vec<(Tensor, usize)> {
    let mut out = Vec::new();
    for ((t, i), mine) in tensors.iter().zip(kept) {
        let size = t.dtype.size_bytes() as u64;
        for pc in &pieces[*i] {
            let input = t.input + pc.lo * size;
            let output = match mine {
                Some((lo, hi)) if (*lo, *hi) == (pc.lo, pc.hi) => t.output,
                _ => input,
            };
            out.push((
                Tensor {
                    input,
                    output,
                    count: (pc.hi - pc.lo) as usize,
                    dtype: t.dtype,
                },
                pc.rank as usize,
            ));
        }
    }
    out
}

/// One call of a group: its kind and, for the rooted ones, the root.
use crate::loopback::Call;

impl Comm {
    /// Joins the communicator of `ranks` ranks as `rank`, on `gpu`. Blocks
    /// until every rank has joined.
    pub fn join(gpu: &Gpu, id: &UniqueId, rank: usize, ranks: usize) -> Result<Comm, RuntimeError> {
        need_nccl()?;
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| RuntimeError::driver("binding the GPU to its rank's thread", e))?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as ::core::ffi::c_char),
        };
        let mut raw = std::mem::MaybeUninit::uninit();
        // SAFETY: `raw` is written by NCCL before it is read; the rank and
        // size are in range (checked by the callers).
        let raw = unsafe {
            result::comm_init_rank(raw.as_mut_ptr(), ranks as i32, id, rank as i32)
                .map_err(|e| nccl_error(&format!("rank {rank} joining {ranks} ranks"), e))?;
            raw.assume_init()
        };
        Ok(Comm {
            link: Link::Nccl(raw),
            rank,
            ranks,
            splits: Default::default(),
        })
    }

    /// Rank `rank` of the ranks meeting at `place` (one process, one GPU,
    /// no NCCL: `loopback`), for checking the data-parallel step where
    /// there are not GPUs enough for NCCL.
    pub fn loopback(place: std::sync::Arc<crate::loopback::Loopback>, rank: usize) -> Comm {
        let ranks = place.ranks();
        Comm {
            link: Link::Loopback(place),
            rank,
            ranks,
            splits: Default::default(),
        }
    }

    /// A second communicator of the same ranks (`ncclCommSplit`), whose
    /// calls may run on another stream beside this one's (ZeRO stage 3's
    /// gathers beside the gradients' buckets). Every rank calls it.
    pub fn split(&self) -> Result<Comm, RuntimeError> {
        self.split_by(0, self.rank, self.ranks)
    }

    /// The communicator of the ranks that give the same `color` (as this
    /// rank, `key`-th of them; `ranks` of them in all): hybrid sharding's
    /// group of a host's ranks, or of the ranks at one place in every
    /// group. Every rank of this communicator calls it, in the same order
    /// as its other splits.
    pub fn split_by(&self, color: usize, key: usize, ranks: usize) -> Result<Comm, RuntimeError> {
        let nth = self
            .splits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let raw = match &self.link {
            Link::Loopback(place) => {
                return Ok(Comm::loopback(place.split(nth, color, ranks), key));
            }
            Link::Nccl(raw) => *raw,
        };
        let mut new = std::mem::MaybeUninit::uninit();
        // SAFETY: `raw` is live; NCCL writes `new` before it is read; no
        // configuration (null) keeps the parent's.
        let new = unsafe {
            sys::ncclCommSplit(
                raw,
                color as i32,
                key as i32,
                new.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
            .map_err(|e| nccl_error("splitting the communicator", e))?;
            new.assume_init()
        };
        Ok(Comm {
            link: Link::Nccl(new),
            rank: key,
            ranks,
            splits: Default::default(),
        })
    }

    /// Whether this rank meets the others through host memory
    /// (`loopback`): its collectives cannot be captured in a CUDA graph.
    pub fn is_loopback(&self) -> bool {
        matches!(self.link, Link::Loopback(_))
    }

    /// Averages each of `all` over the ranks onto every rank, and each of
    /// `rooted` onto its root rank alone (ZeRO's gradient pieces, to their
    /// owners: together a reduce-scatter), as one NCCL group queued on
    /// `stream`.
    pub fn average(
        &self,
        stream: &CudaStream,
        all: &[Tensor],
        rooted: &[(Tensor, usize)],
    ) -> Result<(), RuntimeError> {
        let calls = rooted
            .iter()
            .map(|&(t, root)| (t, Call::Reduce(root)))
            .chain(all.iter().map(|&t| (t, Call::AllReduce)));
        self.group(stream, "averaging gradients over the ranks", calls)
    }

    /// Each tensor from its root rank to every rank (ZeRO's updated
    /// parameters from their owners), in place, as one NCCL group queued
    /// on `stream`.
    pub fn broadcast(
        &self,
        stream: &CudaStream,
        tensors: &[(Tensor, usize)],
    ) -> Result<(), RuntimeError> {
        let calls = tensors.iter().map(|&(t, root)| (t, Call::Broadcast(root)));
        self.group(
            stream,
            "sending the updated parameters from their owners",
            calls,
        )
    }

    /// ZeRO stage 3: a parameter's pieces from their owners into the
    /// whole on every rank (`gather_calls`), as one NCCL group queued on
    /// `stream`.
    pub fn gather(
        &self,
        stream: &CudaStream,
        calls: &[(Tensor, usize)],
    ) -> Result<(), RuntimeError> {
        let calls = calls.iter().map(|&(t, root)| (t, Call::Broadcast(root)));
        self.group(stream, "gathering a parameter from its owners", calls)
    }

    /// `calls` as one NCCL group queued on `stream`.
    fn group(
        &self,
        stream: &CudaStream,
        what: &str,
        calls: impl Iterator<Item = (Tensor, Call)>,
    ) -> Result<(), RuntimeError> {
        let raw = match &self.link {
            Link::Nccl(raw) => *raw,
            Link::Loopback(place) => {
                let calls: Vec<_> = calls
                    .map(|(t, call)| (t.input, t.output, t.count, t.dtype, call))
                    .collect();
                return place.group(self.rank, stream, &calls);
            }
        };
        let what = |e| nccl_error(what, e);
        let s = stream.cu_stream() as sys::cudaStream_t;
        result::group_start().map_err(what)?;
        for (t, call) in calls {
            let (input, output) = (
                t.input as *const ::core::ffi::c_void,
                t.output as *mut ::core::ffi::c_void,
            );
            let dt = dtype(t.dtype)?;
            let avg = sys::ncclRedOp_t::ncclAvg;
            // SAFETY: the addresses lie in this rank's arena, `count`
            // elements of `dtype` each, and stay valid until the stream
            // passes this call (the plan keeps them alive to the join).
            unsafe {
                match call {
                    Call::AllReduce => result::all_reduce(input, output, t.count, dt, avg, raw, s),
                    Call::Reduce(root) => {
                        result::reduce(input, output, t.count, dt, avg, root as i32, raw, s)
                    }
                    Call::Broadcast(root) => {
                        result::broadcast(input, output, t.count, dt, root as i32, raw, s)
                    }
                }
            }
            .map_err(what)?;
        }
        result::group_end().map_err(what)?;
        Ok(())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and no call on it is in flight
        // (the owner synchronised its streams or is unwinding an error).
        unsafe {
            if let Link::Nccl(raw) = self.link {
                let _ = result::comm_destroy(raw);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(at: u64, count: usize, dtype: DType) -> Tensor {
        Tensor {
            input: at,
            output: at,
            count,
            dtype,
        }
    }

    /// Each owner's piece goes to its place in the whole; the owner sends
    /// from its own buffer, the others name their place (ignored by NCCL
    /// off the root); a rank owning nothing is no call.
    #[test]
    fn a_gather_is_one_broadcast_per_owner_into_its_place() {
        let pieces = [(0, 100), (100, 100), (100, 164)];
        let calls = gather_calls(2, 9000, 4096, DType::BF16, &pieces);
        assert_eq!(calls.len(), 2);
        let (a, ra) = calls[0];
        assert_eq!((a.input, a.output, a.count, ra), (4096, 4096, 100, 0));
        let (b, rb) = calls[1];
        assert_eq!((b.input, b.output, b.count, rb), (9000, 4096 + 200, 64, 2));
        let on0 = gather_calls(0, 7000, 4096, DType::BF16, &pieces);
        assert_eq!(on0[0].0.input, 7000);
        assert_eq!(on0[1].0.input, 4096 + 200);
    }

    #[test]
    fn tensors_end_to_end_become_one() {
        // 768 f32 (3072 bytes, aligned), then 10 f32 (40 bytes, padded to
        // 256), then 64 f32 right after the padding: one run of 768 + 64 +
        // 64 elements (the padding's 54 included).
        let run = [
            t(1 << 20, 768, DType::F32),
            t((1 << 20) + 3072, 10, DType::F32),
            t((1 << 20) + 3072 + 256, 64, DType::F32),
        ];
        let out = coalesce(&run, 256);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].input, 1 << 20);
        assert_eq!(out[0].count, 768 + 64 + 64);
    }

    #[test]
    fn zero_gradients_go_to_their_pieces_owners_merged_by_owner() {
        let base = 1u64 << 20;
        // A bucket of two gradients end to end: the first (parameter 5)
        // split between ranks 2 and 3, the second (parameter 4) owned by
        // rank 3 alone: rank 2 gets the first's head, rank 3 its tail and
        // the second as one reduce.
        let owned = [
            (t(base, 1000, DType::F32), 5),
            (t(base + 4096, 64, DType::F32), 4),
        ];
        let pc = |rank, lo, hi| Piece { rank, lo, hi };
        let mut pieces = vec![Vec::new(); 6];
        pieces[5] = vec![pc(2, 0, 640), pc(3, 640, 1000)];
        pieces[4] = vec![pc(3, 0, 64)];
        let out = owned_pieces(&owned, &pieces, 256);
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].0.input, out[0].0.count, out[0].1), (base, 640, 2));
        // 360 elements of the tail, the alignment gap to 4096 bytes, then 64.
        assert_eq!(out[1].0.input, base + 640 * 4);
        assert_eq!(out[1].0.count, (4096 - 640 * 4) / 4 + 64);
        assert_eq!(out[1].1, 3);
    }

    #[test]
    fn each_owners_run_of_pieces_becomes_one_broadcast() {
        let base = 1u64 << 20;
        // Two parameters end to end, the second split between ranks 0 and
        // 1, then a third owned by rank 1: rank 0 sends the first and the
        // second's head as one buffer, rank 1 the tail and the third.
        let shares = [
            (t(base, 768, DType::F32), 0),
            (t(base + 3072, 64, DType::F32), 0),
            (t(base + 3072 + 256, 192, DType::F32), 1),
            (t(base + 4096, 10, DType::F32), 1),
            // A gap: another buffer may lie between.
            (t(base + 8192, 64, DType::F32), 1),
        ];
        let out = coalesce_shares(&shares, 256);
        let got: Vec<(u64, usize, usize)> = out
            .iter()
            .map(|(t, r)| (t.input - base, t.count, *r))
            .collect();
        assert_eq!(
            got,
            vec![(0, 768 + 64, 0), (3328, 192 + 10, 1), (8192, 64, 1)]
        );
        // Owners alternating never merge.
        let alternating = [
            (t(base, 64, DType::F32), 0),
            (t(base + 256, 64, DType::F32), 1),
        ];
        assert_eq!(coalesce_shares(&alternating, 256).len(), 2);
    }

    #[test]
    fn gaps_dtypes_and_copies_keep_tensors_apart() {
        let base = 1u64 << 20;
        // A gap of a whole alignment unit: another buffer may live there.
        let gap = [t(base, 64, DType::F32), t(base + 512, 64, DType::F32)];
        assert_eq!(coalesce(&gap, 256).len(), 2);
        // Another dtype.
        let mixed = [t(base, 64, DType::F32), t(base + 256, 128, DType::BF16)];
        assert_eq!(coalesce(&mixed, 256).len(), 2);
        // Not in place: the result goes elsewhere.
        let mut copy = t(base + 256, 64, DType::F32);
        copy.output = base + (1 << 16);
        assert_eq!(coalesce(&[t(base, 64, DType::F32), copy], 256).len(), 2);
        // Out of order.
        let back = [t(base + 256, 64, DType::F32), t(base, 64, DType::F32)];
        assert_eq!(coalesce(&back, 256).len(), 2);
    }
}
