//! Unary math: every function of one element, each declared once in the
//! table below with everything fusec needs of it — its names, its CPU
//! reference and derivative, the PyTorch call its twin writes, and the
//! facts the passes rely on. The ops `Unary` and `UnaryGrad` (and the
//! builtins, the twin exporter and the padding pass) read the table; adding
//! a function means a variant, a `UnaryFn` and a line in `UnaryKind::def`
//! here, and its CUDA C in `emit::unary` (an exhaustive match: the compiler
//! names a function without one).

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryKind {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Tanh,
    Sigmoid,
    /// GELU, tanh approximation (as GPT-2 uses).
    Gelu,
    /// GELU with the exact erf (BERT's, and PyTorch's `F.gelu` default).
    GeluErf,
    Relu,
    Silu,
    Softplus,
}

/// How the PyTorch twin writes a unary function of `x`.
#[derive(Clone, Copy, Debug)]
pub enum TorchForm {
    /// A prefix operator: `-x`.
    Prefix(&'static str),
    /// A call with extra keyword arguments: `F.gelu(x, approximate="tanh")`.
    Call(&'static str, &'static [&'static str]),
}

/// One unary function, whole.
pub struct UnaryFn {
    /// The op's name in the IR, and the builtin's in a model file.
    pub name: &'static str,
    /// The name of its backward op (`dy * f'(x)`) in the IR.
    pub grad_name: &'static str,
    /// The builtin's signature and one-line description (docs/dsl.md has a
    /// section per builtin); `None` where a model file spells it otherwise
    /// (`-x`).
    pub builtin: Option<(&'static str, &'static str)>,
    /// Applied to a plain number in a model file, it is computed at
    /// compile time (`sqrt(64)`).
    pub on_numbers: bool,
    /// f(0) = 0 with a finite f'(0): padded zeros stay zeros forward and
    /// their gradients finite (the pad-dims pass relies on it).
    pub keeps_zero: bool,
    pub apply: fn(f64) -> f64,
    pub derivative: fn(f64) -> f64,
    pub torch: TorchForm,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044715;

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

const NEG: UnaryFn = UnaryFn {
    name: "neg",
    grad_name: "neg_grad",
    builtin: None,
    on_numbers: false,
    keeps_zero: true,
    apply: |x| -x,
    derivative: |_| -1.0,
    torch: TorchForm::Prefix("-"),
};

const EXP: UnaryFn = UnaryFn {
    name: "exp",
    grad_name: "exp_grad",
    builtin: Some(("exp(x)", "e^x (also on numbers)")),
    on_numbers: true,
    keeps_zero: false,
    apply: f64::exp,
    derivative: f64::exp,
    torch: TorchForm::Call("torch.exp", &[]),
};

const LOG: UnaryFn = UnaryFn {
    name: "log",
    grad_name: "log_grad",
    builtin: Some(("log(x)", "natural logarithm (also on numbers)")),
    on_numbers: true,
    keeps_zero: false,
    apply: f64::ln,
    derivative: |x| 1.0 / x,
    torch: TorchForm::Call("torch.log", &[]),
};

const SQRT: UnaryFn = UnaryFn {
    name: "sqrt",
    grad_name: "sqrt_grad",
    builtin: Some(("sqrt(x)", "square root (also on numbers)")),
    on_numbers: true,
    keeps_zero: false,
    apply: f64::sqrt,
    derivative: |x| 0.5 / x.sqrt(),
    torch: TorchForm::Call("torch.sqrt", &[]),
};

const RSQRT: UnaryFn = UnaryFn {
    name: "rsqrt",
    grad_name: "rsqrt_grad",
    builtin: Some(("rsqrt(x)", "1 / sqrt(x) (also on numbers)")),
    on_numbers: true,
    keeps_zero: false,
    apply: |x| 1.0 / x.sqrt(),
    derivative: |x| -0.5 * x.powf(-1.5),
    torch: TorchForm::Call("torch.rsqrt", &[]),
};

const TANH: UnaryFn = UnaryFn {
    name: "tanh",
    grad_name: "tanh_grad",
    builtin: Some(("tanh(x)", "hyperbolic tangent")),
    on_numbers: true,
    keeps_zero: true,
    apply: f64::tanh,
    derivative: |x| 1.0 - x.tanh().powi(2),
    torch: TorchForm::Call("torch.tanh", &[]),
};

const SIGMOID: UnaryFn = UnaryFn {
    name: "sigmoid",
    grad_name: "sigmoid_grad",
    builtin: Some(("sigmoid(x)", "1 / (1 + exp(-x))")),
    on_numbers: false,
    keeps_zero: false,
    apply: sigmoid,
    derivative: |x| sigmoid(x) * (1.0 - sigmoid(x)),
    torch: TorchForm::Call("torch.sigmoid", &[]),
};

const GELU: UnaryFn = UnaryFn {
    name: "gelu",
    grad_name: "gelu_grad",
    builtin: Some(("gelu(x)", "GELU, tanh approximation")),
    on_numbers: false,
    keeps_zero: true,
    apply: |x| 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + GELU_C * x * x * x)).tanh()),
    derivative: |x| {
        let u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x);
        let t = u.tanh();
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x)
    },
    torch: TorchForm::Call("F.gelu", &["approximate=\"tanh\""]),
};

const GELU_ERF: UnaryFn = UnaryFn {
    name: "gelu_erf",
    grad_name: "gelu_erf_grad",
    builtin: Some((
        "gelu_erf(x)",
        "GELU with the exact erf: x * (1 + erf(x / sqrt 2)) / 2",
    )),
    on_numbers: false,
    keeps_zero: true,
    apply: |x| 0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)),
    derivative: |x| {
        let cdf = 0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2));
        let pdf = (-0.5 * x * x).exp()
            * (0.5 * std::f64::consts::FRAC_2_SQRT_PI)
            * std::f64::consts::FRAC_1_SQRT_2;
        cdf + x * pdf
    },
    torch: TorchForm::Call("F.gelu", &[]),
};

const RELU: UnaryFn = UnaryFn {
    name: "relu",
    grad_name: "relu_grad",
    builtin: Some(("relu(x)", "max(x, 0)")),
    on_numbers: false,
    keeps_zero: true,
    apply: |x| x.max(0.0),
    // 0 at exactly 0, as PyTorch's.
    derivative: |x| if x > 0.0 { 1.0 } else { 0.0 },
    torch: TorchForm::Call("F.relu", &[]),
};

const SILU: UnaryFn = UnaryFn {
    name: "silu",
    grad_name: "silu_grad",
    builtin: Some(("silu(x)", "x * sigmoid(x)")),
    on_numbers: false,
    keeps_zero: true,
    apply: |x| x * sigmoid(x),
    derivative: |x| {
        let s = sigmoid(x);
        s + x * s * (1.0 - s)
    },
    torch: TorchForm::Call("F.silu", &[]),
};

const SOFTPLUS: UnaryFn = UnaryFn {
    name: "softplus",
    grad_name: "softplus_grad",
    builtin: Some(("softplus(x)", "log(1 + exp(x))")),
    on_numbers: false,
    keeps_zero: false,
    // max(x, 0) + log1p(exp(-|x|)): no overflow of exp for large x, no
    // loss of the small term for very negative x.
    apply: |x| x.max(0.0) + (-x.abs()).exp().ln_1p(),
    derivative: sigmoid,
    torch: TorchForm::Call("F.softplus", &[]),
};

impl UnaryKind {
    /// Every unary function, in the order the builtins list them.
    pub const ALL: &'static [UnaryKind] = &[
        UnaryKind::Gelu,
        UnaryKind::GeluErf,
        UnaryKind::Relu,
        UnaryKind::Silu,
        UnaryKind::Softplus,
        UnaryKind::Sigmoid,
        UnaryKind::Tanh,
        UnaryKind::Exp,
        UnaryKind::Log,
        UnaryKind::Sqrt,
        UnaryKind::Rsqrt,
        UnaryKind::Neg,
    ];

    pub fn def(self) -> &'static UnaryFn {
        match self {
            UnaryKind::Neg => &NEG,
            UnaryKind::Exp => &EXP,
            UnaryKind::Log => &LOG,
            UnaryKind::Sqrt => &SQRT,
            UnaryKind::Rsqrt => &RSQRT,
            UnaryKind::Tanh => &TANH,
            UnaryKind::Sigmoid => &SIGMOID,
            UnaryKind::Gelu => &GELU,
            UnaryKind::GeluErf => &GELU_ERF,
            UnaryKind::Relu => &RELU,
            UnaryKind::Silu => &SILU,
            UnaryKind::Softplus => &SOFTPLUS,
        }
    }

    pub fn name(self) -> &'static str {
        self.def().name
    }

    /// The name of its backward op.
    pub fn grad_name(self) -> &'static str {
        self.def().grad_name
    }

    pub fn apply(self, x: f64) -> f64 {
        (self.def().apply)(x)
    }

    /// d apply / dx
    pub fn derivative(self, x: f64) -> f64 {
        (self.def().derivative)(x)
    }

    /// The builtin of this name, if a model file can call it.
    pub fn builtin(name: &str) -> Option<UnaryKind> {
        Self::ALL
            .iter()
            .copied()
            .find(|k| k.def().builtin.is_some() && k.name() == name)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Unary {
    pub kind: UnaryKind,
}

impl OpDef for Unary {
    fn class(&self) -> FusionClass {
        FusionClass::Elementwise
    }
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity(self.kind.name(), inputs, 1)?;
        expect_float(self.kind.name(), &inputs[0], 0)?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![inputs[0].map(|x| self.kind.apply(x))]
    }
    fn vjp(
        &self,
        b: &mut Builder,
        inputs: &[Value],
        _: &[Value],
        douts: &[Option<Value>],
    ) -> Result<Vec<Option<Value>>, OpError> {
        let Some(dy) = douts[0] else {
            return Ok(vec![None]);
        };
        let dx = if self.kind == UnaryKind::Neg {
            b.neg(dy)?
        } else {
            b.op1(UnaryGrad { kind: self.kind }, &[inputs[0], dy])?
        };
        Ok(vec![Some(dx)])
    }
}

/// `dy * f'(x)` for a unary `f`: the backward of every unary op, fused.
#[derive(Clone, Debug, PartialEq)]
pub struct UnaryGrad {
    pub kind: UnaryKind,
}

impl OpDef for UnaryGrad {
    fn class(&self) -> FusionClass {
        FusionClass::Elementwise
    }
    fn name(&self) -> &'static str {
        self.kind.grad_name()
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity(self.name(), inputs, 2)?;
        dims_equal(
            self.name(),
            "x and dy",
            &inputs[0].numel(),
            &inputs[1].numel(),
        )?;
        Ok(vec![inputs[0].clone()])
    }
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![inputs[0].zip(inputs[1], |x, dy| self.kind.derivative(x) * dy)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every function's derivative agrees with central differences of its
    /// reference at points inside its domain, to 1e-6 relative.
    #[test]
    fn derivatives_match_finite_differences() {
        for &k in UnaryKind::ALL {
            for x in [0.3, 0.7, 1.3, 2.1, -0.4, -1.7] {
                if !k.apply(x).is_finite() || (k == UnaryKind::Relu && x.abs() < 1e-3) {
                    continue;
                }
                let h = 1e-5;
                let fd = (k.apply(x + h) - k.apply(x - h)) / (2.0 * h);
                let d = k.derivative(x);
                assert!(
                    (fd - d).abs() <= 1e-6 * fd.abs().max(1.0),
                    "{}'({x}) = {d}, differences give {fd}",
                    k.name()
                );
            }
        }
    }

    /// `gelu_erf` is PyTorch's `F.gelu` (exact): x (1 + erf(x / sqrt 2)) / 2
    /// at 1 and -0.5 as Python's math.erf gives them; `gelu` (tanh)
    /// differs at 1 by more than 1e-4.
    #[test]
    fn gelu_erf_is_the_exact_gelu() {
        let k = UnaryKind::GeluErf;
        assert!((k.apply(1.0) - 0.841_344_746_068_542_9).abs() < 1e-15);
        assert!((k.apply(-0.5) - -0.154_268_769_362_993_44).abs() < 1e-15);
        assert!((UnaryKind::Gelu.apply(1.0) - k.apply(1.0)).abs() > 1e-4);
    }

    /// `keeps_zero` is true exactly where f(0) = 0 with a finite f'(0).
    #[test]
    fn keeps_zero_is_true_to_the_function() {
        for &k in UnaryKind::ALL {
            let holds = k.apply(0.0) == 0.0 && k.derivative(0.0).is_finite();
            assert_eq!(k.def().keeps_zero, holds, "{}", k.name());
        }
    }
}
