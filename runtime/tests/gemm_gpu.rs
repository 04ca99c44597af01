//! `fusec_runtime::gemm` (cuBLASLt) against a plain CPU f64 reference: every
//! type pair, both transposes, sizes that are not multiples of 16, strided
//! batches and each epilogue. Outputs start as NaN, so an element cuBLASLt
//! never wrote (or wrote in a batch's gap) shows up. Without a GPU the GPU
//! test prints why and passes, unless FUSEC_REQUIRE_GPU=1 (as a GPU CI sets
//! it); the CPU tests (rounding, validation) always run.

#[path = "../../tests/common/skip.rs"]
mod skip;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use fusec_runtime::gemm::{EpiloguePtrs, Gemm, GemmChecks, GemmElem, GemmError, GemmShape};
use fusec_runtime::gemm_tuning::{Tuning, TuningStats};
use std::sync::Arc;

// ---- element codecs, by hand (the runtime does not depend on `half`) ----

/// f32 -> bf16 bits, round to nearest even (NaN stays a quiet NaN).
fn bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let b = x.to_bits();
    // Adding 0x7fff plus the lowest kept bit rounds ties to even.
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// f32 -> f16 bits, round to nearest even, with subnormals and overflow.
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let abs = b & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return sign | 0x7e00; // NaN
    }
    if abs >= 0x477f_f000 {
        return sign | 0x7c00; // 65520 and up round to infinity
    }
    if abs < 0x3880_0000 {
        // Below 2^-14: a multiple of 2^-24; scaling by 2^24 is exact.
        return sign | (f32::from_bits(abs) * 16_777_216.0).round_ties_even() as u16;
    }
    let (exp, man) = ((abs >> 23) - 112, abs & 0x7f_ffff);
    let (mut h, rest) = ((exp << 10) | (man >> 13), man & 0x1fff);
    if rest > 0x1000 || (rest == 0x1000 && h & 1 == 1) {
        h += 1; // a carry into the exponent is still the right encoding
    }
    sign | h as u16
}

fn f16_value(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = ((h >> 10) & 0x1f, (h & 0x3ff) as f32);
    match exp {
        0 => sign * man * 2f32.powi(-24),
        31 if man == 0.0 => sign * f32::INFINITY,
        31 => f32::NAN,
        _ => sign * (1.0 + man / 1024.0) * 2f32.powi(exp as i32 - 15),
    }
}

fn encode(t: GemmElem, xs: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(xs.len() * t.bytes() as usize);
    for &x in xs {
        match t {
            GemmElem::F32 => out.extend_from_slice(&x.to_le_bytes()),
            GemmElem::BF16 => out.extend_from_slice(&bf16_bits(x).to_le_bytes()),
            GemmElem::F16 => out.extend_from_slice(&f16_bits(x).to_le_bytes()),
        }
    }
    out
}

fn decode(t: GemmElem, bytes: &[u8]) -> Vec<f32> {
    match t {
        GemmElem::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GemmElem::BF16 => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        GemmElem::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16_value(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
    }
}

/// The value `x` has once stored as `t`.
fn round(t: GemmElem, x: f32) -> f32 {
    decode(t, &encode(t, &[x]))[0]
}

#[test]
fn conversions_round_to_nearest_even() {
    assert_eq!(bf16_bits(1.0), 0x3f80);
    assert_eq!(bf16_bits(1.0 + 2f32.powi(-8)), 0x3f80, "tie to even (down)");
    assert_eq!(
        bf16_bits(1.0 + 3.0 * 2f32.powi(-8)),
        0x3f82,
        "tie to even (up)"
    );
    assert_eq!(bf16_bits(-2.0), 0xc000);
    assert_eq!(f16_bits(1.0), 0x3c00);
    assert_eq!(f16_bits(1.0 + 2f32.powi(-11)), 0x3c00, "tie to even (down)");
    assert_eq!(
        f16_bits(1.0 + 3.0 * 2f32.powi(-11)),
        0x3c02,
        "tie to even (up)"
    );
    assert_eq!(f16_bits(65504.0), 0x7bff);
    assert_eq!(f16_bits(65520.0), 0x7c00);
    assert_eq!(f16_bits(2f32.powi(-24)), 0x0001);
    assert_eq!(f16_bits(-2f32.powi(-14)), 0x8400);
    assert!(f16_value(f16_bits(f32::NAN)).is_nan());
    for x in [0.1f32, -0.7, 3.25, 1e-5, -1234.5] {
        let (b, h) = (round(GemmElem::BF16, x), round(GemmElem::F16, x));
        assert!((b - x).abs() <= x.abs() * 2f32.powi(-8), "bf16 {x} -> {b}");
        assert!(
            (h - x).abs() <= x.abs() * 2f32.powi(-11) + 2f32.powi(-25),
            "f16 {x} -> {h}"
        );
    }
}

#[test]
fn invalid_requests_are_rejected_with_the_product_named() {
    let spec = GemmShape::plain(37, 45, 29, GemmElem::BF16, GemmElem::BF16);
    let aux = EpiloguePtrs {
        gelu_aux_out: Some(256),
        ..Default::default()
    };
    let e = spec.validate(&aux).unwrap_err();
    assert!(matches!(e, GemmError::Invalid { .. }));
    let text = e.to_string();
    assert!(
        text.contains("m=37 n=45 k=29") && text.contains("gelu_aux"),
        "{text}"
    );
    assert!(text.contains("divisible by 8"), "{text}");
    let dgelu_bias = EpiloguePtrs {
        bias: Some(256),
        dgelu_aux_in: Some(512),
        ..Default::default()
    };
    let spec48 = GemmShape::plain(37, 48, 29, GemmElem::BF16, GemmElem::BF16);
    assert!(spec48.validate(&dgelu_bias).is_err());
    let overlapping = GemmShape {
        batch: 3,
        batch_stride_d: 10,
        ..spec48
    };
    assert!(overlapping.validate(&EpiloguePtrs::default()).is_err());
    assert!(GemmShape::plain(0, 4, 4, GemmElem::F32, GemmElem::F32)
        .validate(&EpiloguePtrs::default())
        .is_err());
    let ok = EpiloguePtrs {
        bias: Some(256),
        residual: Some(512),
        gelu_aux_out: Some(1024),
        ..Default::default()
    };
    assert_eq!(spec48.validate(&ok), Ok(()));
}

// ---- the GPU test ----

/// xorshift64*: values in [-1, -1/32] or [1/32, 1], never zero (also after
/// rounding to bf16/f16), so a zero left by a missed write cannot match.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let u = (r >> 40) as f32 / (1u64 << 24) as f32;
        let mag = 1.0 / 32.0 + (1.0 - 1.0 / 32.0) * u;
        if r & 1 == 1 {
            mag
        } else {
            -mag
        }
    }

    fn vec(&mut self, t: GemmElem, len: usize) -> Vec<f32> {
        (0..len).map(|_| round(t, self.next())).collect()
    }
}

#[derive(Clone, Copy, Default)]
struct Epi {
    bias: bool,
    residual: bool,
    gelu: bool,
    dgelu: bool,
    /// The residual is D itself (`d += a @ b`): C and D the same buffer.
    in_place: bool,
}

struct Case {
    spec: GemmShape,
    epi: Epi,
}

impl Case {
    fn name(&self) -> String {
        let s = &self.spec;
        let mut e = Vec::new();
        for (on, what) in [
            (self.epi.bias, "bias"),
            (self.epi.residual, "residual"),
            (self.epi.gelu, "gelu_aux"),
            (self.epi.dgelu, "dgelu"),
            (self.epi.in_place, "in place"),
        ] {
            if on {
                e.push(what);
            }
        }
        format!(
            "{}x{}x{} batch={} (strides a={} b={} d={}) aT={} bT={} {}->{} [{}]",
            s.m,
            s.n,
            s.k,
            s.batch,
            s.batch_stride_a,
            s.batch_stride_b,
            s.batch_stride_d,
            s.a_transposed,
            s.b_transposed,
            s.in_type.name(),
            s.out_type.name(),
            e.join("+")
        )
    }
}

/// Elements a strided batch of `size`-element matrices spans.
fn span(batch: u64, stride: u64, size: u64) -> usize {
    ((batch - 1) * stride + size) as usize
}

fn gelu(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

fn dgelu(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

fn upload(stream: &Arc<CudaStream>, t: GemmElem, xs: &[f32]) -> CudaSlice<u8> {
    stream.clone_htod(&encode(t, xs)).expect("copy to the GPU")
}

fn addr(s: &CudaSlice<u8>, stream: &CudaStream) -> u64 {
    // One stream throughout, so the access record can be dropped at once.
    s.device_ptr(stream).0
}

/// Runs one case on fresh buffers; returns the worst error relative to
/// max |ref| over D (and aux), or a description of what went wrong.
fn run_case(
    gemm: &mut Gemm,
    stream: &Arc<CudaStream>,
    case: &Case,
    rng: &mut Rng,
) -> Result<f64, String> {
    let s = case.spec;
    let (m, n, k) = (s.m as usize, s.n as usize, s.k as usize);
    let (it, ot) = (s.in_type, s.out_type);
    let a = rng.vec(it, span(s.batch, s.batch_stride_a, s.m * s.k));
    let b = rng.vec(it, span(s.batch, s.batch_stride_b, s.k * s.n));
    let d_len = span(s.batch, s.batch_stride_d, s.m * s.n);
    let bias = rng.vec(ot, n);
    // Elements from one batch's D to the next (a plain product has one).
    let sd = if s.batch > 1 {
        s.batch_stride_d as usize
    } else {
        m * n
    };
    // NaN in the batches' gaps, which nothing may read or (in place) write.
    let mut residual = rng.vec(ot, d_len);
    for (x, r) in residual.iter_mut().enumerate() {
        if x % sd >= m * n {
            *r = f32::NAN;
        }
    }
    // A pre-activation around GELU's bend, where gelu' varies most.
    let aux_in: Vec<f32> = rng
        .vec(ot, d_len)
        .iter()
        .map(|x| round(ot, 2.0 * x))
        .collect();

    // CPU reference, in f64 from the values the GPU sees.
    let mut ab = vec![f64::NAN; d_len];
    for p in 0..s.batch as usize {
        let (pa, pb) = (p * s.batch_stride_a as usize, p * s.batch_stride_b as usize);
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for l in 0..k {
                    let av = if s.a_transposed {
                        a[pa + l * m + i]
                    } else {
                        a[pa + i * k + l]
                    };
                    let bv = if s.b_transposed {
                        b[pb + j * k + l]
                    } else {
                        b[pb + l * n + j]
                    };
                    acc += av as f64 * bv as f64;
                }
                ab[p * s.batch_stride_d as usize + i * n + j] = acc;
            }
        }
    }
    let e = case.epi;
    let pre: Vec<f64> = (0..d_len)
        .map(|x| {
            let mut v = ab[x];
            if e.residual {
                v += residual[x] as f64;
            }
            if e.bias {
                v += bias[(x % sd) % n] as f64;
            }
            v
        })
        .collect();
    let want_d: Vec<f64> = (0..d_len)
        .map(|x| match (e.gelu, e.dgelu) {
            (true, _) => gelu(pre[x]),
            (_, true) => dgelu(aux_in[x] as f64) * ab[x],
            _ => pre[x],
        })
        .collect();

    // The GPU run, every output NaN to start with.
    let nan = vec![f32::NAN; d_len];
    let (da, db) = (upload(stream, it, &a), upload(stream, it, &b));
    // In place, D starts as the residual; its gaps are NaN all the same.
    let dd = upload(stream, ot, if e.in_place { &residual } else { &nan });
    let dbias = upload(stream, ot, &bias);
    let dres = upload(stream, ot, &residual);
    let daux_out = upload(stream, ot, &nan);
    let daux_in = upload(stream, ot, &aux_in);
    let ep = EpiloguePtrs {
        bias: e.bias.then(|| addr(&dbias, stream)),
        residual: e
            .residual
            .then(|| addr(if e.in_place { &dd } else { &dres }, stream)),
        gelu_aux_out: e.gelu.then(|| addr(&daux_out, stream)),
        dgelu_aux_in: e.dgelu.then(|| addr(&daux_in, stream)),
    };
    gemm.run(
        &s,
        addr(&da, stream),
        addr(&db, stream),
        addr(&dd, stream),
        &ep,
    )
    .map_err(|e| e.to_string())?;
    let read = |buf: &CudaSlice<u8>| -> Result<Vec<f32>, String> {
        let bytes = stream.clone_dtoh(buf).map_err(|e| format!("{e:?}"))?;
        Ok(decode(ot, &bytes))
    };
    let got_d = read(&dd)?;
    let mut outputs = vec![("D", got_d, want_d)];
    if e.gelu {
        outputs.push(("aux", read(&daux_out)?, pre));
    }

    let tol = if ot == GemmElem::F32 { 1e-4 } else { 2e-2 };
    let mut worst = 0.0f64;
    for (what, got, want) in outputs {
        let scale = want
            .iter()
            .filter(|v| !v.is_nan())
            .fold(0.0f64, |m, v| m.max(v.abs()));
        for (x, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let (p, r) = (x / sd, x % sd);
            let in_gap = r >= m * n;
            match (in_gap, g.is_nan()) {
                (true, false) => {
                    return Err(format!("{what}: batch gap element {x} was written ({g})"))
                }
                (true, true) => continue,
                (false, true) => {
                    return Err(format!(
                        "{what}: element {x} (batch {p}, row {}, col {}) never written",
                        r / n,
                        r % n
                    ))
                }
                (false, false) => {}
            }
            let err = (g as f64 - w).abs() / scale;
            if err > tol {
                return Err(format!(
                    "{what}: element {x} (batch {p}, row {}, col {}) is {g}, want {w} (error {err:.2e} of max |ref| {scale:.3}, tolerance {tol:.0e})",
                    r / n,
                    r % n
                ));
            }
            worst = worst.max(err);
        }
    }
    Ok(worst)
}

fn cases() -> Vec<Case> {
    let (m, n, k) = (37, 45, 29);
    let mut cases = Vec::new();
    let plain = |it, ot, at, bt, n: u64| GemmShape {
        a_transposed: at,
        b_transposed: bt,
        ..GemmShape::plain(m, n, k, it, ot)
    };
    let none = Epi::default();
    // Every type pair, both transposes.
    for (it, ot) in [
        (GemmElem::F32, GemmElem::F32),
        (GemmElem::BF16, GemmElem::BF16),
        (GemmElem::BF16, GemmElem::F32),
        (GemmElem::F16, GemmElem::F16),
    ] {
        for (at, bt) in [(false, false), (true, false), (false, true), (true, true)] {
            cases.push(Case {
                spec: plain(it, ot, at, bt, n),
                epi: none,
            });
        }
    }
    // Strided batches: D with a gap after each matrix (which must stay
    // untouched), A transposed, and B shared by every batch (stride 0).
    let batched = |it, ot, at, n: u64, shared_b: bool| GemmShape {
        batch: 3,
        batch_stride_a: m * k + 3,
        batch_stride_b: if shared_b { 0 } else { k * n + 5 },
        batch_stride_d: (m * n).next_multiple_of(8) + 8,
        ..plain(it, ot, at, false, n)
    };
    for (it, ot) in [
        (GemmElem::F32, GemmElem::F32),
        (GemmElem::BF16, GemmElem::BF16),
        (GemmElem::BF16, GemmElem::F32),
    ] {
        for shared_b in [false, true] {
            cases.push(Case {
                spec: batched(it, ot, true, n, shared_b),
                epi: none,
            });
        }
    }
    // Each epilogue; GELU's aux buffer needs n divisible by 8 (cuBLASLt's rule).
    let e = |bias, residual, gelu, dgelu| Epi {
        in_place: false,
        bias,
        residual,
        gelu,
        dgelu,
    };
    let epilogues = [
        (e(true, false, false, false), n),
        (e(true, true, false, false), n),
        (
            Epi {
                in_place: true,
                ..e(true, true, false, false)
            },
            n,
        ),
        (e(false, true, false, false), n),
        (e(false, false, true, false), 48),
        (e(true, false, true, false), 48),
        (e(true, true, true, false), 48),
        (e(false, false, false, true), 48),
    ];
    for (it, ot) in [
        (GemmElem::BF16, GemmElem::BF16),
        (GemmElem::F32, GemmElem::F32),
        (GemmElem::BF16, GemmElem::F32),
    ] {
        for &(epi, n) in &epilogues {
            cases.push(Case {
                spec: plain(it, ot, false, true, n),
                epi,
            });
            cases.push(Case {
                spec: plain(it, ot, true, false, n),
                epi,
            });
        }
    }
    for &(epi, n) in &epilogues {
        cases.push(Case {
            spec: batched(GemmElem::BF16, GemmElem::BF16, false, n, false),
            epi,
        });
    }
    cases
}

fn skip(reason: &str) {
    assert!(
        std::env::var("FUSEC_REQUIRE_GPU").is_err(),
        "FUSEC_REQUIRE_GPU is set but {reason}"
    );
    skip::skip(reason);
}

#[test]
fn gemm_matches_cpu_reference() {
    // SAFETY: only probes the dynamic loader.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return skip("no GPU: the CUDA driver (libcuda.so) is not on the loader path");
    }
    let ctx = match CudaContext::new(0) {
        Ok(ctx) => ctx,
        Err(e) => return skip(&format!("no GPU: CudaContext::new(0) failed ({e:?})")),
    };
    let stream = ctx.new_stream().expect("a CUDA stream");
    println!("GPU: {}", ctx.name().unwrap_or_default());
    // Every case with cuBLASLt's first choice; then with the algorithms
    // timed (each product run several times on its own buffers, so an
    // in-place product timed would add its residual again and fail), their
    // choices written to a fresh cache; then read back from it.
    let dir = std::env::temp_dir().join(format!("fusec-gemm-gpu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let timed = Tuning::Timed {
        dir: Some(dir.clone()),
        gpu: ctx.name().unwrap_or_default(),
    };
    // In-place cases first: a product is planned (and timed or not) at its
    // first run, and an in-place case whose twin ran before it would take
    // the twin's plan untimed.
    let mut cases = cases();
    cases.sort_by_key(|c| !c.epi.in_place);
    let in_place = cases.iter().filter(|c| c.epi.in_place).count();
    let mut failures = Vec::new();
    let mut stats = Vec::new();
    for (pass, tuning) in [
        ("first choice", Tuning::First),
        ("timed", timed.clone()),
        ("from cache", timed),
    ] {
        let mut gemm = match Gemm::new(&stream) {
            Ok(g) => g,
            Err(e @ GemmError::NotLoaded) => return skip(&e.to_string()),
            Err(e) => panic!("{e}"),
        };
        gemm.tuning = tuning;
        let mut rng = Rng(0x5eed_1234_abcd_9876);
        for case in &cases {
            // Twice on fresh buffers: the second run takes the cached plan with
            // new pointers.
            for attempt in ["first", "cached"] {
                match run_case(&mut gemm, &stream, case, &mut rng) {
                    Ok(worst) => println!(
                        "ok   {} ({pass}, {attempt}): worst error {worst:.2e}",
                        case.name()
                    ),
                    Err(e) => {
                        failures.push(format!("FAIL {} ({pass}, {attempt}): {e}", case.name()))
                    }
                }
            }
        }
        let t = gemm.tuning_stats();
        println!(
            "{pass}: {} cases, {} cached plans, algorithms {t:?}",
            cases.len(),
            gemm.cached_plans()
        );
        stats.push((gemm.cached_plans(), t));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let (plans, first) = stats[0];
    assert_eq!(
        first,
        TuningStats::default(),
        "the first choice times nothing"
    );
    // Timed: every product but those writing over their inputs (each
    // in-place case is a product of its own: distinct spec or alignment).
    let (_, t) = stats[1];
    assert!(in_place >= 1, "the cases have in-place products");
    assert_eq!(
        t.untimed, in_place,
        "in-place products are left untimed: {t:?}"
    );
    assert_eq!((t.timed + t.untimed, t.cached), (plans, 0), "{t:?}");
    // Read back: every timed choice from the cache, nothing timed again.
    let (_, c) = stats[2];
    assert_eq!(
        (c.cached, c.timed, c.untimed, c.changed),
        (t.timed, 0, t.untimed, t.changed),
        "{c:?}"
    );
}
