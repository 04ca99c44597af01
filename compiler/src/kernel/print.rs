//! Text forms of the kernel program: where every value of the step lives
//! (its layout), and the kernels in launch order with what each reads and
//! writes. `fusec build --dump layout` and `--dump kernels` print them;
//! value names (`%12`) are those of `--dump optimized`.

use super::view::View;
use super::{Body, BufKind, Program};
use crate::ir::print::Names;
use crate::ir::{Graph, Value};
use crate::ops::Op;
use std::collections::HashMap;
use std::fmt::Write;

/// Where a value of the step graph lives.
#[derive(Clone, Debug, PartialEq)]
pub enum Layout {
    /// In device memory, row-major in its own shape: buffer `b`.
    Stored(usize),
    /// Read in place through a view of buffer `b`: a transpose, slice,
    /// head split or broadcast that costs no copy.
    View(usize, View),
    /// Computed and consumed inside kernel `k`; never in memory.
    Registers(usize),
    /// A constant or size, folded into the code that reads it.
    Folded,
    /// Nothing reads it (removed).
    Unused,
}

/// `v` as a view of a stored buffer, following view ops back.
fn view_of(g: &Graph, p: &Program, v: Value) -> Option<(usize, View)> {
    let mut chain = Vec::new();
    let mut at = v;
    while p.buffer_of(at).is_none() {
        if !g.g[at.node].op.is_view() {
            return None;
        }
        chain.push(at.node);
        at = g.inputs(at.node)[0];
    }
    let b = p.buffer_of(at)?;
    let view = chain
        .into_iter()
        .rev()
        .try_fold(View::contiguous(&g.ty(at).shape), |v, n| {
            v.apply(&g.g[n].op)
        })?;
    Some((b, view))
}

/// The layout of every value, in the graph's print order.
pub fn layouts(g: &Graph, p: &Program) -> Vec<(Value, Layout)> {
    let mut in_kernel: HashMap<petgraph::stable_graph::NodeIndex, usize> = HashMap::new();
    for (k, kernel) in p.kernels.iter().enumerate() {
        for &n in &kernel.nodes {
            in_kernel.entry(n).or_insert(k);
        }
    }
    let mut out = Vec::new();
    for n in g.topo_order() {
        for port in 0..g.g[n].outputs.len() {
            let v = Value { node: n, port };
            let mut base = v;
            while g.g[base.node].op.is_view() && p.buffer_of(base).is_none() {
                base = g.inputs(base.node)[0];
            }
            let layout = if let Some(b) = p.buffer_of(v) {
                Layout::Stored(b)
            } else if matches!(g.g[base.node].op, Op::Constant(_) | Op::DimValue(_)) {
                Layout::Folded
            } else if let Some((b, view)) = view_of(g, p, v) {
                Layout::View(b, view)
            } else if let Some(&k) = in_kernel.get(&n) {
                Layout::Registers(k)
            } else {
                Layout::Unused
            };
            out.push((v, layout));
        }
    }
    out
}

fn dims(ds: &[crate::ir::Dim]) -> String {
    let parts: Vec<String> = ds.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

fn describe_view(view: &View) -> String {
    let offset = if view.offset.as_const() == Some(0) {
        String::new()
    } else {
        format!("offset {}, ", view.offset)
    };
    format!("{offset}strides {}", dims(&view.strides))
}

/// One line per value: its type and where it lives.
pub fn print_layouts(g: &Graph, p: &Program) -> String {
    let names = Names::of(g);
    let buffer_name = |b: usize| names.get(p.buffers[b].value);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "layout of {} ({}): every value of the optimized step graph",
        g.name,
        g.dims.join(", ")
    );
    let _ = writeln!(
        s,
        "stored values are row-major in their own shape; views are read in place"
    );
    for (v, layout) in layouts(g, p) {
        let what = match &layout {
            Layout::Stored(b) => {
                let kind = match p.buffers[*b].kind {
                    BufKind::Input => "input",
                    BufKind::Param => "parameter",
                    BufKind::State => "optimizer state",
                    BufKind::Temp => "computed",
                };
                match p.buffers[*b].pitch {
                    Some(pitch) => format!(
                        "stored, row-major with rows padded to {pitch} elements for aligned GEMMs ({kind})"
                    ),
                    None => format!("stored, row-major ({kind})"),
                }
            }
            Layout::View(b, view) if view.is_contiguous() => {
                format!("view of {}: same elements, row-major", buffer_name(*b))
            }
            Layout::View(b, view) => {
                format!("view of {}: {}", buffer_name(*b), describe_view(view))
            }
            Layout::Registers(k) => format!("in registers of {}", p.kernels[*k].name),
            Layout::Folded => "constant, folded into its readers".into(),
            Layout::Unused => "not computed".into(),
        };
        let _ = writeln!(s, "  {}: {}  {what}", names.get(v), g.ty(v));
    }
    s
}

/// The kernels in launch order: ops, inputs (with the view each is read
/// through), outputs, and a GEMM's epilogue.
pub fn print_program(g: &Graph, p: &Program) -> String {
    let names = Names::of(g);
    let buf = |b: usize| format!("{} {}", names.get(p.buffers[b].value), p.buffers[b].ty);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "kernels of {} ({}): {} launch{}",
        g.name,
        g.dims.join(", "),
        p.kernels.len(),
        if p.kernels.len() == 1 { "" } else { "es" }
    );
    for k in &p.kernels {
        let ops: Vec<&str> = k.nodes.iter().map(|&n| g.g[n].op.name()).collect();
        let kind = match &k.body {
            Body::Pointwise(pw) => match &pw.sum {
                Some(sum) => format!(
                    "pointwise, out{} sums its {} values over the leading axes",
                    sum.out, sum.dtype
                ),
                None => "pointwise".to_string(),
            },
            Body::Op(_) => match (k.residual, &k.prologue) {
                (Some(r), _) => format!("op, in{r} added to out0"),
                (None, Some(pro)) => format!(
                    "op, its input 0 computed by a chain of {} expressions as it loads{}",
                    pro.chain.exprs.len(),
                    if pro.chain.stores.is_empty() {
                        ""
                    } else {
                        " (stored as out1)"
                    }
                ),
                (None, None) => "op".to_string(),
            },
            Body::Group(m) => format!("group of {}", m.len()),
            Body::Gemm(_, e) => format!("gemm, epilogue {}", e.name()),
        };
        let _ = writeln!(s, "{} ({kind}): {}", k.name, op_runs(&ops, 2));
        for (slot, &b) in k.inputs.iter().enumerate() {
            let through = match k.input_views.get(slot).and_then(|v| v.as_ref()) {
                Some(v) => format!(" as {} {}", dims(&v.shape), describe_view(v)),
                None => String::new(),
            };
            let _ = writeln!(s, "  in{slot}  {}{through}", buf(b));
        }
        if let Body::Pointwise(pw) = &k.body {
            for e in &pw.exprs {
                if let super::PExpr::Load { input, view } = e {
                    if !view.is_contiguous() {
                        let _ = writeln!(
                            s,
                            "        in{input} read as {} {}",
                            dims(&view.shape),
                            describe_view(view)
                        );
                    }
                }
            }
        }
        for (slot, &b) in k.outputs.iter().enumerate() {
            let _ = writeln!(s, "  out{slot} {}", buf(b));
        }
    }
    s
}

/// `add + gelu`, `cast x148`: ops in order, a run of at least `shortest`
/// equal ops written once with its count, shorter runs spelled out.
pub fn op_runs<S: AsRef<str>>(ops: &[S], shortest: usize) -> String {
    let mut parts: Vec<(&str, usize)> = Vec::new();
    for op in ops {
        match parts.last_mut() {
            Some((last, n)) if *last == op.as_ref() => *n += 1,
            _ => parts.push((op.as_ref(), 1)),
        }
    }
    parts
        .iter()
        .map(|&(op, n)| {
            if n >= shortest {
                format!("{op} x{n}")
            } else {
                vec![op; n].join(" + ")
            }
        })
        .collect::<Vec<_>>()
        .join(" + ")
}
