//! ZeRO across processes: a tensor the ranks hold in pieces, gathered onto
//! every rank over the communicator (a launched job's checkpoint).

use super::Executor;
use crate::nccl;
use crate::RuntimeError;
use cudarc::driver::DevicePtr;
use fusec_compiler::dtype::DType;

impl Executor {
    /// ZeRO across processes: the whole of an f32 tensor of `numel`
    /// elements that the ranks hold in `pieces` (each its owner's elements
    /// [lo, hi)), this rank its own in buffer `mine` (`None`: it owns
    /// none), gathered onto every rank: each owner broadcasts its piece
    /// into a scratch buffer of the whole. Every rank of the job calls it
    /// with the same pieces, in the same order (a checkpoint's gather).
    pub fn gather(
        &mut self,
        mine: Option<usize>,
        pieces: &[fusec_compiler::plan::shard::Piece],
        numel: usize,
    ) -> Result<Vec<u8>, RuntimeError> {
        let Some(dp) = self.dp.as_ref() else {
            return Err(RuntimeError::Unsupported(
                "gathering a tensor split over the ranks needs the ranks' communicator".into(),
            ));
        };
        let driver = |e| RuntimeError::driver("gathering a tensor split over the ranks", e);
        let stream = &self.gpu.stream;
        // The step (and its collectives) are done with what this reads.
        stream.synchronize().map_err(driver)?;
        let bytes = numel * 4;
        let mut scratch = stream.alloc_zeros::<u8>(bytes.max(4)).map_err(driver)?;
        let here = pieces.iter().find(|pc| pc.rank as usize == dp.comm.rank);
        if let (Some(b), Some(pc)) = (mine, here) {
            let s = &self.slots[b];
            let (lo, hi) = (pc.lo as usize * 4, pc.hi as usize * 4);
            if s.dtype != DType::F32 || s.packed_bytes() as usize != hi - lo {
                return Err(RuntimeError::Unsupported(format!(
                    "rank {}'s piece holds {} bytes of {:?}, where elements {}..{} of f32 take {}",
                    dp.comm.rank,
                    s.packed_bytes(),
                    s.dtype,
                    pc.lo,
                    pc.hi,
                    hi - lo
                )));
            }
            let from = self
                .arena
                .slice(s.offset as usize..(s.offset as usize + hi - lo));
            let mut to = scratch.slice_mut(lo..hi);
            stream.memcpy_dtod(&from, &mut to).map_err(driver)?;
        }
        let at = {
            let (ptr, _sync) = scratch.device_ptr(stream);
            ptr
        };
        let calls: Vec<(nccl::Tensor, usize)> = pieces
            .iter()
            .filter(|pc| pc.hi > pc.lo)
            .map(|pc| {
                let p = at + pc.lo * 4;
                (
                    nccl::Tensor {
                        input: p,
                        output: p,
                        count: (pc.hi - pc.lo) as usize,
                        dtype: DType::F32,
                    },
                    pc.rank as usize,
                )
            })
            .collect();
        dp.comm.broadcast(stream, &calls)?;
        let mut out = vec![0u8; bytes];
        stream
            .memcpy_dtoh(&scratch.slice(0..bytes), &mut out)
            .map_err(driver)?;
        stream.synchronize().map_err(driver)?;
        Ok(out)
    }
}
