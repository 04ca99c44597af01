//! One forward op as one PyTorch expression. Operands arrive as expressions
//! with a precedence, so that `x @ w + b` prints without parentheses and
//! `(a + b) * c` with them.

use crate::ir::{Dim, Node};
use crate::ops::{BinaryKind, CeRule, Op, ReduceKind, TorchForm};

/// Python precedence, loosest first: `a + b`, `a * b`, `-a`, then atoms
/// (names, calls, attributes, subscripts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Prec {
    Add,
    Mul,
    Neg,
    Atom,
}

#[derive(Clone, Debug)]
pub struct PyExpr {
    pub text: String,
    pub prec: Prec,
    /// Local names the text reads: a name may not be rebound while an
    /// expression that reads it is still to be written out.
    pub reads: Vec<String>,
    /// `a @ b` or `a * b` at the top: Python gives `@` and `*` one level, so
    /// a mix of them reads better with parentheses.
    pub top: Option<char>,
}

impl PyExpr {
    pub fn name(n: &str) -> PyExpr {
        PyExpr {
            text: n.to_string(),
            prec: Prec::Atom,
            reads: vec![n.to_string()],
            top: None,
        }
    }
    /// Text that reads no local name: a literal, `self.w`.
    pub fn bare(text: String, prec: Prec) -> PyExpr {
        PyExpr {
            text,
            prec,
            reads: vec![],
            top: None,
        }
    }
    fn new(text: String, prec: Prec, parts: &[&PyExpr]) -> PyExpr {
        PyExpr {
            text,
            prec,
            reads: parts.iter().flat_map(|p| p.reads.iter().cloned()).collect(),
            top: None,
        }
    }
    /// The text, in parentheses unless it binds at least as tightly as `p`.
    pub fn at(&self, p: Prec) -> String {
        if self.prec >= p {
            self.text.clone()
        } else {
            format!("({})", self.text)
        }
    }
    /// As an operand of the `*`-level operator `op`: in parentheses when
    /// it is another `*`-level operator (`(a @ b) * c`, `(a * b) @ c`).
    fn operand(&self, op: char) -> String {
        match self.top {
            Some(t) if t != op && (t == '@' || op == '@') => format!("({})", self.text),
            _ => self.at(Prec::Mul),
        }
    }
}

/// A Python float literal that reads back as the same f64.
pub fn float(v: f64) -> String {
    if v.is_nan() {
        "float(\"nan\")".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "float(\"inf\")".into()
        } else {
            "-float(\"inf\")".into()
        }
    } else {
        format!("{v:?}")
    }
}

/// A dimension as Python: an integer, a name, or arithmetic on the names.
pub fn dim(d: &Dim) -> PyExpr {
    let text = d.to_string();
    let reads = d.symbols().map(|s| s.to_string()).collect();
    let prec = if let Some(c) = d.as_const() {
        if c < 0 {
            Prec::Neg
        } else {
            Prec::Atom
        }
    } else if text.contains(" + ") || text.contains(" - ") {
        Prec::Add
    } else if text.contains('*') {
        Prec::Mul
    } else if text.starts_with('-') {
        Prec::Neg
    } else {
        Prec::Atom
    };
    PyExpr {
        reads,
        ..PyExpr::bare(text, prec)
    }
}

fn dims(ds: &[Dim]) -> (String, Vec<String>) {
    let parts: Vec<PyExpr> = ds.iter().map(dim).collect();
    let text = parts
        .iter()
        .map(|p| p.text.clone())
        .collect::<Vec<_>>()
        .join(", ");
    (text, parts.into_iter().flat_map(|p| p.reads).collect())
}

/// An axis as PyTorch code usually writes it: the last ones counted from the end.
fn axis(a: usize, rank: usize) -> String {
    if a + 1 == rank {
        "-1".into()
    } else {
        a.to_string()
    }
}

fn call(f: &str, args: &[&PyExpr], extra: &[String]) -> PyExpr {
    let mut all: Vec<String> = args.iter().map(|a| a.text.clone()).collect();
    all.extend(extra.iter().cloned());
    PyExpr::new(format!("{f}({})", all.join(", ")), Prec::Atom, args)
}

fn method(recv: &PyExpr, m: &str, args: &str, more_reads: Vec<String>) -> PyExpr {
    let mut e = PyExpr::new(
        format!("{}.{m}({args})", recv.at(Prec::Atom)),
        Prec::Atom,
        &[recv],
    );
    e.reads.extend(more_reads);
    e
}

/// The expression for `node`'s first output, given its inputs'.
/// `Err` names what PyTorch code cannot say this way.
pub fn op_expr(node: &Node, ins: &[PyExpr], in_shapes: &[Vec<Dim>]) -> Result<PyExpr, String> {
    let a = ins.first();
    let rank0 = in_shapes.first().map_or(0, |s| s.len());
    let out_rank = node.outputs[0].rank();
    Ok(match &node.op {
        Op::Constant(c) => {
            let text = float(c.value);
            let prec = if text.starts_with('-') {
                Prec::Neg
            } else {
                Prec::Atom
            };
            PyExpr::bare(text, prec)
        }
        Op::DimValue(d) => dim(&d.dim),
        Op::Unary(u) => {
            let x = a.expect("unary ops take one input");
            match u.kind.def().torch {
                TorchForm::Prefix(op) => {
                    PyExpr::new(format!("{op}{}", x.at(Prec::Neg)), Prec::Neg, &[x])
                }
                TorchForm::Call(f, kwargs) => {
                    let kwargs: Vec<String> = kwargs.iter().map(|k| k.to_string()).collect();
                    call(f, &[x], &kwargs)
                }
            }
        }
        Op::Binary(b) => {
            let (l, r) = (&ins[0], &ins[1]);
            let (sym, p) = match b.kind {
                BinaryKind::Add => ("+", Prec::Add),
                BinaryKind::Sub => ("-", Prec::Add),
                BinaryKind::Mul => ("*", Prec::Mul),
                BinaryKind::Div => ("/", Prec::Mul),
                other => return Err(format!("the update's `{}`", other.name())),
            };
            let c = sym.chars().next().expect("a symbol");
            let (left, right) = match p {
                Prec::Add => (l.at(p), r.at(Prec::Mul)),
                _ => (l.operand(c), r.at(Prec::Neg)),
            };
            let mut e = PyExpr::new(format!("{left} {sym} {right}"), p, &[l, r]);
            e.top = (p == Prec::Mul).then_some(c);
            e
        }
        Op::MatMul(_) => {
            let (l, r) = (&ins[0], &ins[1]);
            let mut e = PyExpr::new(
                format!("{} @ {}", l.operand('@'), r.at(Prec::Neg)),
                Prec::Mul,
                &[l, r],
            );
            e.top = Some('@');
            e
        }
        Op::Reduce(r) => {
            let x = a.expect("reductions take one input");
            let m = match r.kind {
                ReduceKind::Sum => "sum",
                ReduceKind::Mean => "mean",
            };
            let all = r.axes.len() == rank0;
            let mut args = Vec::new();
            if !all || r.keepdim {
                let ax: Vec<String> = r.axes.iter().map(|&i| axis(i, rank0)).collect();
                args.push(if ax.len() == 1 {
                    format!("dim={}", ax[0])
                } else {
                    format!("dim=({})", ax.join(", "))
                });
                if r.keepdim {
                    args.push("keepdim=True".into());
                }
            }
            method(x, m, &args.join(", "), vec![])
        }
        Op::Reshape(r) => {
            let (t, reads) = dims(&r.shape);
            let t = if r.shape.is_empty() {
                "()".to_string()
            } else {
                t
            };
            method(a.expect("reshape takes one input"), "reshape", &t, reads)
        }
        Op::Permute(p) => {
            let x = a.expect("permute takes one input");
            let moved: Vec<usize> = (0..p.perm.len()).filter(|&i| p.perm[i] != i).collect();
            if moved.len() == 2 && p.perm[moved[0]] == moved[1] {
                let n = p.perm.len() as i64;
                let (i, j) = (moved[0] as i64, moved[1] as i64);
                let (i, j) = if j == n - 1 { (i - n, j - n) } else { (i, j) };
                method(x, "transpose", &format!("{i}, {j}"), vec![])
            } else {
                let t: Vec<String> = p.perm.iter().map(|i| i.to_string()).collect();
                method(x, "permute", &t.join(", "), vec![])
            }
        }
        Op::Slice(s) => {
            let x = a.expect("slices take one input");
            let start = dim(&s.start);
            let end = dim(&s.end);
            let mut reads = start.reads.clone();
            reads.extend(end.reads.clone());
            let lo = if s.start.as_const() == Some(0) {
                String::new()
            } else {
                start.text
            };
            let whole = in_shapes[0].get(s.axis) == Some(&s.end);
            let hi = if whole { String::new() } else { end.text };
            let mut idx: Vec<String> = vec![":".into(); s.axis];
            idx.push(format!("{lo}:{hi}"));
            let mut e = PyExpr::new(
                format!("{}[{}]", x.at(Prec::Atom), idx.join(", ")),
                Prec::Atom,
                &[x],
            );
            e.reads.extend(reads);
            e
        }
        Op::Concat(c) => {
            let list = ins
                .iter()
                .map(|e| e.text.clone())
                .collect::<Vec<_>>()
                .join(", ");
            let refs: Vec<&PyExpr> = ins.iter().collect();
            PyExpr::new(
                format!("torch.cat([{list}], dim={})", axis(c.axis, out_rank)),
                Prec::Atom,
                &refs,
            )
        }
        Op::Broadcast(b) => {
            let (t, reads) = dims(&b.shape);
            method(a.expect("broadcast takes one input"), "expand", &t, reads)
        }
        Op::Softmax(s) => method(
            a.expect("softmax takes one input"),
            "softmax",
            &format!("dim={}", axis(s.axis, rank0)),
            vec![],
        ),
        Op::LayerNorm(l) => {
            let c = node.outputs[0]
                .shape
                .last()
                .cloned()
                .unwrap_or(Dim::constant(1));
            let c = dim(&c);
            let mut extra = vec![];
            if l.eps != 1e-5 {
                extra.push(format!("eps={}", float(l.eps)));
            }
            let mut e = PyExpr::new(
                format!(
                    "F.layer_norm({}, ({},), {}, {}{})",
                    ins[0].text,
                    c.text,
                    ins[1].text,
                    ins[2].text,
                    extra.iter().map(|s| format!(", {s}")).collect::<String>()
                ),
                Prec::Atom,
                &[&ins[0], &ins[1], &ins[2]],
            );
            e.reads.extend(c.reads);
            e
        }
        Op::RmsNorm(r) => call(
            "rms_norm",
            &[&ins[0], &ins[1]],
            &[format!("eps={}", float(r.eps))],
        ),
        Op::Embedding(_) => call("F.embedding", &[&ins[1], &ins[0]], &[]),
        Op::CrossEntropy(ce) => {
            // One loss per row, the shape of the targets (fusec takes their mean as a separate op).
            let (logits, targets) = (&ins[0], &ins[1]);
            let rule = ce_kwargs(&ce.rule);
            let mut e = PyExpr::new(
                format!(
                    "F.cross_entropy({}.flatten(0, -2), {}.flatten().long(), reduction=\"none\"{rule}).view({}.shape)",
                    logits.at(Prec::Atom),
                    targets.at(Prec::Atom),
                    targets.at(Prec::Atom)
                ),
                Prec::Atom,
                &[logits, targets],
            );
            e.reads.dedup();
            e
        }
        Op::Counted(c) => PyExpr::new(
            format!(
                "({} != {}).to(torch.float32)",
                ins[0].at(Prec::Atom),
                c.ignore_index
            ),
            Prec::Atom,
            &[&ins[0]],
        ),
        Op::Dropout(d) => call(
            "F.dropout",
            &[&ins[0]],
            &[format!("p={}", float(d.p)), "training=self.training".into()],
        ),
        Op::Rope(r) if !r.inverse && !r.positions => {
            call("rope", &[&ins[0]], &[format!("theta={}", float(r.theta))])
        }
        Op::CausalMask(m) => {
            if m.fill == f64::NEG_INFINITY {
                call("causal_mask", &[&ins[0]], &[])
            } else {
                call(
                    "causal_mask",
                    &[&ins[0]],
                    &[format!("fill={}", float(m.fill))],
                )
            }
        }
        Op::Attention(at) => {
            // The lengths, where given, are the fourth argument; the
            // dropout key stays behind (the twin's masks are PyTorch's).
            let args: Vec<&PyExpr> = ins.iter().take(3 + at.lengths as usize).collect();
            let mut kw = vec![
                format!("causal={}", if at.causal { "True" } else { "False" }),
                format!("scale={}", float(at.scale)),
            ];
            if let Some(d) = at.dropout {
                kw.push(format!("dropout={}", float(d.p)));
                kw.push("training=self.training".into());
            }
            call("attention", &args, &kw)
        }
        Op::Conv2d(c) => call(
            "conv2d_nhwc",
            &[&ins[0], &ins[1]],
            &[
                format!("stride={}", c.stride),
                format!("padding={}", c.padding),
            ],
        ),
        other => return Err(format!("the op `{}`", other.name())),
    })
}

/// `F.cross_entropy`'s keyword arguments for a loss's rule (each with its
/// leading comma; empty for none).
fn ce_kwargs(rule: &CeRule) -> String {
    let mut kw = String::new();
    if let Some(i) = rule.ignore_index {
        kw.push_str(&format!(", ignore_index={i}"));
    }
    if rule.smoothing != 0.0 {
        kw.push_str(&format!(", label_smoothing={}", float(rule.smoothing)));
    }
    kw
}

/// The one-expression form of `mean(cross_entropy(logits, targets))` over
/// every row, the way PyTorch code writes a language-model loss, with the
/// loss's rule. Only for a loss without an ignored index: there
/// F.cross_entropy's mean divides by the kept rows, fusec's by all.
pub fn mean_cross_entropy(
    logits: &PyExpr,
    targets: &PyExpr,
    logits_rank: usize,
    rule: &CeRule,
) -> PyExpr {
    let rule = ce_kwargs(rule);
    let text = if logits_rank == 2 {
        format!(
            "F.cross_entropy({}, {}.long(){rule})",
            logits.text,
            targets.at(Prec::Atom)
        )
    } else {
        format!(
            "F.cross_entropy({}.flatten(0, -2), {}.flatten().long(){rule})",
            logits.at(Prec::Atom),
            targets.at(Prec::Atom)
        )
    };
    PyExpr::new(text, Prec::Atom, &[logits, targets])
}
