//! The device's own ceilings, measured: copy bandwidth (a device-to-device
//! copy reads and writes every byte) and the bf16 tensor-core GEMM rate
//! (cuBLASLt, 8192 x 8192 x 8192). `fusec bench --profile` judges each
//! kernel against these rather than against a datasheet: they are what a
//! kernel on this GPU, under this driver and clock, can reach.

use crate::device::Gpu;
use crate::gemm::{EpiloguePtrs, Gemm, GemmElem, GemmShape};
use crate::RuntimeError;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, DevicePtr};

#[derive(Clone, Copy, Debug)]
pub struct Ceilings {
    /// Bytes read plus bytes written per second, in GB/s.
    pub copy_gb_s: f64,
    /// bf16 in, f32 accumulation, bf16 out, in TFLOP/s.
    pub bf16_tflops: f64,
}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::driver(what, e)
}

/// Times `body` over `reps` runs after one warm-up, in seconds a run.
fn timed(
    gpu: &Gpu,
    reps: u32,
    mut body: impl FnMut() -> Result<(), RuntimeError>,
) -> Result<f64, RuntimeError> {
    body()?;
    let ev = || {
        gpu.stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("recording a timing event"))
    };
    let start = ev()?;
    for _ in 0..reps {
        body()?;
    }
    let end = ev()?;
    end.synchronize().map_err(driver("timing the ceilings"))?;
    let ms = start
        .elapsed_ms(&end)
        .map_err(driver("reading a timing event"))?;
    Ok(f64::from(ms) / 1e3 / f64::from(reps))
}

pub fn measure(gpu: &Gpu) -> Result<Ceilings, RuntimeError> {
    let s = &gpu.stream;
    // Copy: 512 MiB, well past every cache (an H100's L2 is 50 MiB).
    let n = 1usize << 29;
    let alloc = |bytes: usize| -> Result<CudaSlice<u8>, RuntimeError> {
        s.alloc_zeros::<u8>(bytes)
            .map_err(driver("allocating the ceiling measurements' buffers"))
    };
    let copy_gb_s = {
        let src = alloc(n)?;
        let mut dst = alloc(n)?;
        let t = timed(gpu, 5, || {
            s.memcpy_dtod(&src, &mut dst)
                .map_err(driver("copying on the device"))
        })?;
        2.0 * n as f64 / t / 1e9
    };
    let bf16_tflops = {
        let m = 8192u64;
        let bytes = (m * m * 2) as usize;
        let (a, b, d) = (alloc(bytes)?, alloc(bytes)?, alloc(bytes)?);
        let mut gemm = Gemm::new(s).map_err(|e| RuntimeError::Gemm(e.to_string()))?;
        let spec = GemmShape::plain(m, m, m, GemmElem::BF16, GemmElem::BF16);
        let (pa, pb, pd) = (a.device_ptr(s).0, b.device_ptr(s).0, d.device_ptr(s).0);
        let t = timed(gpu, 10, || {
            gemm.run(&spec, pa, pb, pd, &EpiloguePtrs::default())
                .map_err(|e| RuntimeError::Gemm(e.to_string()))
        })?;
        2.0 * (m * m * m) as f64 / t / 1e12
    };
    Ok(Ceilings {
        copy_gb_s,
        bf16_tflops,
    })
}
