//! Values as the arena stores them: f64 host values encoded in a buffer's
//! dtype (rounded to nearest even), and decoded back.

use fusec_compiler::dtype::DType;

/// `n` values encoded as `dt` stores them, drawn by `fill(start, out)`
/// (values `start..start + out.len()`, any chunk, any order) in parallel
/// chunks: how a parameter's initial values are made. The chunks are
/// small, so that a parameter of a few hundred thousand values still keeps
/// every thread busy.
pub fn encode_filled(dt: DType, n: usize, fill: &(dyn Fn(usize, &mut [f64]) + Sync)) -> Vec<u8> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 13;
    let size = dt.size_bytes();
    let mut bytes = vec![0u8; n * size];
    bytes
        .par_chunks_mut(CHUNK * size)
        .enumerate()
        .for_each(|(k, out)| {
            let mut values = vec![0.0; out.len() / size];
            fill(k * CHUNK, &mut values);
            encode_into(dt, &values, out);
        });
    bytes
}

pub fn encode(dt: DType, values: &[f64]) -> Vec<u8> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20;
    if values.len() > CHUNK {
        return values
            .par_chunks(CHUNK)
            .map(|c| encode_serial(dt, c))
            .collect::<Vec<_>>()
            .concat();
    }
    encode_serial(dt, values)
}

/// `values` encoded into `out` (exactly `values.len()` elements of `dt`).
fn encode_into(dt: DType, values: &[f64], out: &mut [u8]) {
    let size = dt.size_bytes();
    debug_assert_eq!(out.len(), values.len() * size);
    for (&v, o) in values.iter().zip(out.chunks_exact_mut(size)) {
        match dt {
            DType::F32 => o.copy_from_slice(&(v as f32).to_le_bytes()),
            DType::BF16 => o.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
            DType::F16 => o.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            DType::I32 => o.copy_from_slice(&(v as i32).to_le_bytes()),
        }
    }
}

fn encode_serial(dt: DType, values: &[f64]) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * dt.size_bytes()];
    encode_into(dt, values, &mut out);
    out
}

/// A buffer's bytes as host values.
pub fn decode(dt: DType, bytes: &[u8]) -> Vec<f64> {
    match dt {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::I32 => bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
    }
}
