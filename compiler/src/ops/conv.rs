//! 2-D convolution in NHWC: x [B, H, W, Cin], w [KH, KW, Cin, Cout]
//! -> [B, Ho, Wo, Cout]. Channels innermost, as tensor cores want them.

use super::*;

#[derive(Clone, Debug, PartialEq)]
pub struct Conv2d {
    pub stride: usize,
    pub padding: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Conv2dGradInput {
    pub stride: usize,
    pub padding: usize,
    pub h: Dim,
    pub w: Dim,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Conv2dGradWeight {
    pub stride: usize,
    pub padding: usize,
    pub kh: Dim,
    pub kw: Dim,
}

fn conv_attrs(stride: usize, padding: usize) -> Vec<String> {
    vec![format!("stride={stride}"), format!("padding={padding}")]
}

fn out_size(op: &str, size: &Dim, k: &Dim, stride: usize, padding: usize) -> Result<Dim, OpError> {
    let err = || {
        OpError::new(
            format!("`{op}`: the kernel does not fit"),
            format!("input size {size}, kernel {k}, stride {stride}, padding {padding}"),
        )
    };
    let span = size
        .checked_add(&Dim::constant(2 * padding as i64))
        .and_then(|d| d.checked_sub(k))
        .ok_or_else(err)?;
    if let Some(n) = span.as_const() {
        if n < 0 {
            return Err(err());
        }
        return Ok(Dim::constant(n / stride as i64 + 1));
    }
    let q = span.checked_div(&Dim::constant(stride as i64)).ok_or_else(|| {
        err().help("with a symbolic image size, (size + 2*padding - kernel) must be divisible by the stride")
    })?;
    q.checked_add(&Dim::constant(1)).ok_or_else(err)
}

/// Visits every (output position, kernel tap, input position) triple.
struct Geometry {
    b: usize,
    h: usize,
    w: usize,
    ci: usize,
    kh: usize,
    kw: usize,
    co: usize,
    ho: usize,
    wo: usize,
    stride: usize,
    pad: usize,
}

impl Geometry {
    fn each(&self, mut f: impl FnMut(usize, usize, usize)) {
        // f(x_base, w_base, y_base): x[.., ci], w[.., ci, co], y[.., co]
        for b in 0..self.b {
            for oy in 0..self.ho {
                for ox in 0..self.wo {
                    for ky in 0..self.kh {
                        for kx in 0..self.kw {
                            let iy = (oy * self.stride + ky) as isize - self.pad as isize;
                            let ix = (ox * self.stride + kx) as isize - self.pad as isize;
                            if iy < 0 || ix < 0 || iy as usize >= self.h || ix as usize >= self.w {
                                continue;
                            }
                            let xb = ((b * self.h + iy as usize) * self.w + ix as usize) * self.ci;
                            let wb = (ky * self.kw + kx) * self.ci * self.co;
                            let yb = ((b * self.ho + oy) * self.wo + ox) * self.co;
                            f(xb, wb, yb);
                        }
                    }
                }
            }
        }
    }
}

fn geometry(x: &[usize], w: &[usize], y: &[usize], stride: usize, pad: usize) -> Geometry {
    Geometry {
        b: x[0],
        h: x[1],
        w: x[2],
        ci: x[3],
        kh: w[0],
        kw: w[1],
        co: w[3],
        ho: y[1],
        wo: y[2],
        stride,
        pad,
    }
}

impl OpDef for Conv2d {
    fn name(&self) -> &'static str {
        "conv2d"
    }
    fn attrs(&self) -> Vec<String> {
        conv_attrs(self.stride, self.padding)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("conv2d", inputs, 2)?;
        let (x, w) = (&inputs[0], &inputs[1]);
        expect_float("conv2d", x, 0)?;
        expect_same_dtype("conv2d", x, w)?;
        if x.rank() != 4 {
            return Err(OpError::new(
                "`conv2d` needs NHWC input [B, H, W, C]",
                format!("found {x}"),
            )
            .at(0));
        }
        if w.rank() != 4 {
            return Err(OpError::new(
                "`conv2d` needs a weight [KH, KW, Cin, Cout]",
                format!("found {w}"),
            )
            .at(1));
        }
        dims_equal(
            "conv2d",
            "input channels of x and w",
            &x.shape[3],
            &w.shape[2],
        )
        .map_err(|e| e.at(1))?;
        if self.stride == 0 {
            return Err(OpError::new("`conv2d` needs stride >= 1", "found 0"));
        }
        let ho = out_size(
            "conv2d",
            &x.shape[1],
            &w.shape[0],
            self.stride,
            self.padding,
        )?;
        let wo = out_size(
            "conv2d",
            &x.shape[2],
            &w.shape[1],
            self.stride,
            self.padding,
        )?;
        Ok(vec![x.with_shape(vec![
            x.shape[0].clone(),
            ho,
            wo,
            w.shape[3].clone(),
        ])])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let (x, w) = (inputs[0], inputs[1]);
        let ys = &ctx.out_shapes[0];
        let g = geometry(&x.shape, &w.shape, ys, self.stride, self.padding);
        let mut y = vec![0.0; ys.iter().product()];
        g.each(|xb, wb, yb| {
            for c in 0..g.ci {
                let xv = x.data[xb + c];
                for o in 0..g.co {
                    y[yb + o] += xv * w.data[wb + c * g.co + o];
                }
            }
        });
        vec![Tensor::new(ys.clone(), y)]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(dy) = douts[0] else {
            return Ok(vec![None, None]);
        };
        let (xs, ws) = (b.ty(inputs[0]).shape, b.ty(inputs[1]).shape);
        let gi = Conv2dGradInput {
            stride: self.stride,
            padding: self.padding,
            h: xs[1].clone(),
            w: xs[2].clone(),
        };
        let gw = Conv2dGradWeight {
            stride: self.stride,
            padding: self.padding,
            kh: ws[0].clone(),
            kw: ws[1].clone(),
        };
        let dx = b.op1(gi, &[dy, inputs[1]])?;
        let dw = b.op1(gw, &[inputs[0], dy])?;
        Ok(vec![Some(dx), Some(dw)])
    }
}

impl OpDef for Conv2dGradInput {
    fn name(&self) -> &'static str {
        "conv2d_grad_input"
    }
    fn attrs(&self) -> Vec<String> {
        conv_attrs(self.stride, self.padding)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("conv2d_grad_input", inputs, 2)?;
        ranks_and_stride("conv2d_grad_input", inputs, self.stride)?;
        let (dy, w) = (&inputs[0], &inputs[1]);
        Ok(vec![dy.with_shape(vec![
            dy.shape[0].clone(),
            self.h.clone(),
            self.w.clone(),
            w.shape[2].clone(),
        ])])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let (dy, w) = (inputs[0], inputs[1]);
        let xs = &ctx.out_shapes[0];
        let g = geometry(xs, &w.shape, &dy.shape, self.stride, self.padding);
        let mut dx = vec![0.0; xs.iter().product()];
        g.each(|xb, wb, yb| {
            for c in 0..g.ci {
                let mut acc = 0.0;
                for o in 0..g.co {
                    acc += dy.data[yb + o] * w.data[wb + c * g.co + o];
                }
                dx[xb + c] += acc;
            }
        });
        vec![Tensor::new(xs.clone(), dx)]
    }
}

impl OpDef for Conv2dGradWeight {
    fn name(&self) -> &'static str {
        "conv2d_grad_weight"
    }
    fn attrs(&self) -> Vec<String> {
        conv_attrs(self.stride, self.padding)
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("conv2d_grad_weight", inputs, 2)?;
        ranks_and_stride("conv2d_grad_weight", inputs, self.stride)?;
        let (x, dy) = (&inputs[0], &inputs[1]);
        let shape = vec![
            self.kh.clone(),
            self.kw.clone(),
            x.shape[3].clone(),
            dy.shape[3].clone(),
        ];
        Ok(vec![x.with_shape(shape)])
    }
    fn eval(&self, inputs: &[&Tensor], ctx: &EvalCtx) -> Vec<Tensor> {
        let (x, dy) = (inputs[0], inputs[1]);
        let wshape = &ctx.out_shapes[0];
        let g = geometry(&x.shape, wshape, &dy.shape, self.stride, self.padding);
        let mut dw = vec![0.0; wshape.iter().product()];
        g.each(|xb, wb, yb| {
            for c in 0..g.ci {
                let xv = x.data[xb + c];
                for o in 0..g.co {
                    dw[wb + c * g.co + o] += xv * dy.data[yb + o];
                }
            }
        });
        vec![Tensor::new(wshape.clone(), dw)]
    }
}

/// The gradients' inputs are two NHWC / HWIO tensors of rank 4 and their
/// stride is positive (autodiff builds them so; a graph read from text may
/// not).
fn ranks_and_stride(op: &str, inputs: &[TensorType], stride: usize) -> Result<(), OpError> {
    if inputs.iter().any(|t| t.rank() != 4) {
        return Err(OpError::new(
            format!("`{op}` takes two tensors of rank 4"),
            format!("found {} and {}", inputs[0], inputs[1]),
        ));
    }
    if stride == 0 {
        return Err(OpError::new(
            format!("the stride of `{op}` must be at least 1"),
            format!("found {stride}"),
        ));
    }
    Ok(())
}
