//! The products the runtime asks cuBLASLt for, checked without a GPU: for
//! every matmul kernel of every shipped model (tiny sizes), the row-major
//! `GemmSpec` the executor derives (sizes, transposes, batch strides,
//! the stack-of-rows folding) and its epilogue, evaluated on the CPU from
//! the stored operand buffers, must give the interpreter's outputs.

mod common;

use common::{model, sizes, tiny_models};
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::Precision;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::kernel::Body;
use fusec_compiler::ops::{Op, UnaryKind};
use fusec_runtime::exec::gemm_spec;
use fusec_runtime::gemm::GemmSpec;

/// `D = A @ B` as the spec describes it, on the stored buffers.
fn product(s: &GemmSpec, a: &[f64], b: &[f64]) -> Vec<f64> {
    let (m, n, k) = (s.m as usize, s.n as usize, s.k as usize);
    let mut d = vec![0.0; s.batch as usize * m * n];
    for bi in 0..s.batch as usize {
        let (oa, ob, od) = (
            bi * s.batch_stride_a as usize,
            bi * s.batch_stride_b as usize,
            bi * if s.batch == 1 {
                0
            } else {
                s.batch_stride_d as usize
            },
        );
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0;
                for kk in 0..k {
                    let x = a[oa
                        + if s.a_transposed {
                            kk * m + i
                        } else {
                            i * k + kk
                        }];
                    let y = b[ob
                        + if s.b_transposed {
                            j * k + kk
                        } else {
                            kk * n + j
                        }];
                    acc += x * y;
                }
                d[od + i * n + j] = acc;
            }
        }
    }
    d
}

#[test]
fn every_gemm_spec_computes_its_kernel() {
    let mut checked = 0;
    for (file, sets, dims) in tiny_models() {
        let c = model(file, &sets);
        let g = &c.optimized;
        let p = fuse(g);
        let (dmap, bdims) = sizes(&dims);
        let feeds = random_feeds(g, &dmap, 3).unwrap();
        let bufs = run_program(g, &p, &feeds, Precision::F64).unwrap();
        for k in &p.kernels {
            let (n, ep) = match &k.body {
                Body::Gemm(n, e) => (*n, Some(e)),
                Body::Op(n) if matches!(g.g[*n].op, Op::MatMul(_)) => (*n, None),
                _ => continue,
            };
            let spec = gemm_spec(g, &p, k, n, &bdims).unwrap();
            let a = &bufs[k.inputs[0]].data;
            let b = &bufs[k.inputs[1]].data;
            let mut d = product(&spec, a, b);
            let gelu = UnaryKind::Gelu;
            let mut aux = None;
            if let Some(e) = ep {
                let cols = spec.n as usize;
                for (i, x) in d.iter_mut().enumerate() {
                    if let Some(r) = e.residual {
                        *x += bufs[k.inputs[r]].data[i];
                    }
                    if let Some(bias) = e.bias {
                        *x += bufs[k.inputs[bias]].data[i % cols];
                    }
                    if let Some(pre) = e.dgelu {
                        *x *= gelu.derivative(bufs[k.inputs[pre]].data[i]);
                    }
                }
                if e.gelu {
                    aux = Some(d.clone());
                    d = d.iter().map(|&x| gelu.apply(x)).collect();
                }
            }
            let want = &bufs[k.outputs[0]].data;
            assert_eq!(d.len(), want.len(), "{file} {}: {spec:?}", k.name);
            let err = d
                .iter()
                .zip(want)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(err < 1e-9, "{file} {}: error {err} with {spec:?}", k.name);
            if let Some(aux) = aux {
                assert_eq!(
                    &aux, &bufs[k.outputs[1]].data,
                    "{file} {}: pre-activation",
                    k.name
                );
            }
            checked += 1;
        }
    }
    println!("{checked} GEMM kernels computed from their specs");
    assert!(checked > 50, "{checked}");
}
