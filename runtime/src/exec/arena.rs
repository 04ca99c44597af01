//! The executor's arena seen from the host: writing, staging, copying,
//! zeroing and reading planned buffers (rows at their pitch, zero rows
//! after the last, as the plan lays them out).

use super::Executor;
use crate::stage::{HostBuf, Stager};
use crate::RuntimeError;
use fusec_compiler::dtype::DType;

impl Executor {
    /// Copies host bytes into buffer `b` (exactly its size).
    pub fn write(&mut self, b: usize, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.written = true;
        let s = &self.slots[b];
        if bytes.len() as u64 != s.packed_bytes() {
            return Err(RuntimeError::Unsupported(format!(
                "buffer {b} holds {} bytes, given {}",
                s.packed_bytes(),
                bytes.len()
            )));
        }
        let (lo, hi) = (s.offset as usize, (s.offset + s.bytes) as usize);
        // Padded rows: each row at its pitch, zeros between.
        let padded;
        let bytes = match s.rows() {
            Some((row, pitch)) if row > 0 => {
                let mut out = vec![0u8; s.bytes as usize];
                for (r, chunk) in bytes.chunks(row).enumerate() {
                    out[r * pitch..r * pitch + row].copy_from_slice(chunk);
                }
                padded = out;
                &padded[..]
            }
            // Zero rows after the last (kernel::pitch::pad_gemm_sizes).
            _ if (bytes.len() as u64) < s.bytes => {
                let mut out = vec![0u8; s.bytes as usize];
                out[..bytes.len()].copy_from_slice(bytes);
                padded = out;
                &padded[..]
            }
            _ => bytes,
        };
        let mut view = self.arena.slice_mut(lo..hi);
        self.gpu
            .stream
            .memcpy_htod(bytes, &mut view)
            .map_err(|e| RuntimeError::driver("copying to the GPU", e))
    }

    /// Starts copying `buf` to the GPU for the i32 buffers `targets` (their
    /// values in order, each whole), on a second stream, so the copy runs
    /// while the current step computes; the next `run_step` copies it in
    /// before its first kernel.
    pub fn stage(&mut self, targets: &[(&str, usize)], buf: &HostBuf) -> Result<(), RuntimeError> {
        self.written = true;
        let mut parts = Vec::with_capacity(targets.len());
        let mut at = 0;
        for &(name, b) in targets {
            let s = &self.slots[b];
            if s.dtype != DType::I32 || s.rows().is_some() {
                return Err(RuntimeError::Unsupported(format!(
                    "`{name}` ({:?}, shape {:?}) cannot take a staged batch: only unpadded i32 inputs can; declare it i32",
                    s.dtype, s.shape
                )));
            }
            let n: usize = s.shape.iter().product();
            parts.push((b, at, n));
            at += n;
        }
        let len = buf.len();
        if len != at {
            let names: Vec<&str> = targets.iter().map(|t| t.0).collect();
            return Err(RuntimeError::Unsupported(format!(
                "a staged batch holds {len} values; {} take {at}",
                names.join(" and ")
            )));
        }
        if self
            .stager
            .as_ref()
            .is_none_or(|st| st.area.len() != at.max(1))
        {
            self.stager = Some(Stager::new(&self.gpu, at)?);
        }
        let st = self.stager.as_mut().expect("made above");
        st.upload(buf)?;
        st.parts = parts;
        st.pending = true;
        Ok(())
    }

    /// The staged batch into its input buffers (on the step's stream, after
    /// the staging copy).
    pub(super) fn copy_staged(&mut self) -> Result<(), RuntimeError> {
        let Executor {
            stager,
            arena,
            slots,
            gpu,
            ..
        } = self;
        let Some(st) = stager.as_mut().filter(|st| st.pending) else {
            return Ok(());
        };
        for &(b, at, n) in &st.parts {
            let s = &slots[b];
            let mut bytes = arena.slice_mut(s.offset as usize..(s.offset + s.bytes) as usize);
            // SAFETY: the buffer is an unpadded i32 tensor of n values
            // (checked by `stage`), and the arena is 256-byte aligned.
            let mut dst = unsafe { bytes.transmute_mut::<i32>(n) }.ok_or_else(|| {
                RuntimeError::Unsupported(format!("buffer {b} is smaller than its {n} values"))
            })?;
            gpu.stream
                .memcpy_dtod(&st.area.slice(at..at + n), &mut dst)
                .map_err(|e| RuntimeError::driver("copying a staged batch in", e))?;
        }
        st.pending = false;
        Ok(())
    }

    /// Copies buffer `src` of `other` (an executor on the same GPU) into
    /// buffer `dst` of this one, device to device; both hold the same
    /// bytes (unpadded, one dtype and shape).
    pub fn copy_from(
        &mut self,
        other: &Executor,
        src: usize,
        dst: usize,
    ) -> Result<(), RuntimeError> {
        self.written = true;
        let (a, b) = (&other.slots[src], &self.slots[dst]);
        if a.bytes != b.bytes || a.dtype != b.dtype {
            return Err(RuntimeError::Unsupported(format!(
                "cannot copy a buffer of {} bytes ({:?}) into one of {} ({:?})",
                a.bytes, a.dtype, b.bytes, b.dtype
            )));
        }
        let from = other
            .arena
            .slice(a.offset as usize..(a.offset + a.bytes) as usize);
        let mut to = self
            .arena
            .slice_mut(b.offset as usize..(b.offset + b.bytes) as usize);
        // The source's stream has finished its step (`finish` waited).
        self.gpu
            .stream
            .memcpy_dtod(&from, &mut to)
            .map_err(|e| RuntimeError::driver("copying the weights for validation", e))
    }

    /// Sets every byte of buffer `b` to zero, on the device.
    pub fn zero(&mut self, b: usize) -> Result<(), RuntimeError> {
        self.written = true;
        let s = &self.slots[b];
        let (lo, hi) = (s.offset as usize, (s.offset + s.bytes) as usize);
        let mut view = self.arena.slice_mut(lo..hi);
        self.gpu
            .stream
            .memset_zeros(&mut view)
            .map_err(|e| RuntimeError::driver("clearing a buffer", e))
    }

    /// Buffer `b`'s bytes (waits for the stream).
    pub fn read(&self, b: usize) -> Result<Vec<u8>, RuntimeError> {
        let s = &self.slots[b];
        let (lo, hi) = (s.offset as usize, (s.offset + s.bytes) as usize);
        let mut out = vec![0u8; s.bytes as usize];
        let view = self.arena.slice(lo..hi);
        self.gpu
            .stream
            .memcpy_dtoh(&view, &mut out)
            .map_err(|e| RuntimeError::driver("copying from the GPU", e))?;
        self.synchronize()?;
        // Padded rows: the rows alone, packed.
        if let Some((row, pitch)) = s.rows() {
            let n = s.packed_bytes() as usize;
            let mut packed = Vec::with_capacity(n);
            for r in 0..n.checked_div(row).unwrap_or(0) {
                packed.extend_from_slice(&out[r * pitch..r * pitch + row]);
            }
            return Ok(packed);
        }
        out.truncate(s.packed_bytes() as usize);
        Ok(out)
    }

    /// Fills every byte of the arena with `byte` (tests poison it).
    pub fn fill(&mut self, byte: u8) -> Result<(), RuntimeError> {
        self.written = true;
        let host = vec![byte; self.arena.len()];
        self.gpu
            .stream
            .memcpy_htod(&host, &mut self.arena)
            .map_err(|e| RuntimeError::driver("filling the arena", e))
    }

    /// Whether the arena is still all zeros as allocated (or cleared):
    /// nothing written into it since.
    pub fn untouched(&self) -> bool {
        !self.written
    }

    /// Zeros the whole arena on the device.
    pub fn clear(&mut self) -> Result<(), RuntimeError> {
        self.gpu
            .stream
            .memset_zeros(&mut self.arena)
            .map_err(|e| RuntimeError::driver("clearing the arena", e))?;
        self.written = false;
        Ok(())
    }

    /// The arena's device address (for diagnostics).
    pub fn base(&self) -> u64 {
        self.base
    }
}
