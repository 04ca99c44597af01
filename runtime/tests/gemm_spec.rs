//! The products the runtime asks cuBLASLt for, checked without a GPU: for
//! every matmul kernel of every shipped model (tiny sizes), the row-major
//! product its plan launch carries (`plan::gemm`: sizes, transposes, batch
//! strides, the stack-of-rows folding), which the executor hands cuBLASLt
//! as it is, with its epilogue, evaluated on the CPU from the stored
//! operand buffers, must give the interpreter's outputs.

mod common;

use common::{model, sizes, tiny_models};
use fusec_compiler::interp::random::random_feeds;
use fusec_compiler::interp::Precision;
use fusec_compiler::kernel::fuse::fuse;
use fusec_compiler::kernel::interp::run_program;
use fusec_compiler::kernel::Body;
use fusec_compiler::ops::{Op, UnaryKind};
use fusec_compiler::plan::plan;
use fusec_runtime::gemm::GemmShape;

/// `D = A @ B` as the spec describes it, on the stored buffers.
fn product(s: &GemmShape, a: &[f64], b: &[f64]) -> Vec<f64> {
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

/// Products of stacked matrices, each batch entry its own (`h @
/// transpose(h)`: both operands batched, B read transposed; the backward's
/// transposed A), beside the shipped models, whose products are all a
/// stack of rows times one matrix.
const BATCHED: &str = "dim B, T
input x: f32[B, T, 12]
param w: [12, 12] = normal(0.3)
let h = x @ w
let y = softmax(h @ transpose(h)) @ h
train { loss = mean(y * y) }
";

#[test]
fn every_gemm_spec_computes_its_kernel() {
    let mut checked = 0;
    let batched = fusec_compiler::driver::compile(BATCHED, "batched", &Default::default())
        .unwrap_or_else(|f| panic!("{}", f.render("batched.dsl", BATCHED)));
    let models = tiny_models()
        .into_iter()
        .map(|(file, sets, dims)| (file, model(file, &sets), dims))
        .chain([("batched.dsl", batched, vec![("B", 3), ("T", 5)])]);
    for (file, c, dims) in models {
        let g = &c.optimized;
        let p = fuse(g);
        let (dmap, bdims) = sizes(&dims);
        let feeds = random_feeds(g, &dmap, 3).unwrap();
        let bufs = run_program(g, &p, &feeds, Precision::F64).unwrap();
        let launches = plan(g, &p, &bdims).unwrap().launches;
        for (k, l) in p.kernels.iter().zip(&launches) {
            let ep = match &k.body {
                Body::Gemm(_, e) => Some(e),
                Body::Op(n) if matches!(g.g[*n].op, Op::MatMul(_)) => None,
                _ => continue,
            };
            let shape = l
                .gemm
                .as_ref()
                .unwrap_or_else(|| panic!("{file} {}: no product in the plan", k.name));
            let spec = *shape;
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
