//! The classes of the twin: one scope (the model, a block call, a layer of a
//! `repeat`) at a time, its own nodes in the order elaboration added them,
//! its calls as calls of submodules.
//!
//! Long (some 930 lines) because it holds the PyTorch form of every op the
//! twin writes, one match arm each, so that a new op's twin is added in one
//! place.

use super::expr::{mean_cross_entropy, op_expr, Prec, PyExpr};
use super::{class_name, ExportError};
use crate::dsl::ast::Span;
use crate::ir::graph::Init;
use crate::ir::{Dim, Graph, Value};
use crate::model::structure::Structure;
use crate::model::values::Val;
use crate::ops::{CeRule, Op, ReduceKind};
use petgraph::stable_graph::NodeIndex;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write;

/// Words a local name may not take: Python's keywords and what the twin's
/// code itself uses.
const RESERVED: &[&str] = &[
    "self",
    "torch",
    "nn",
    "F",
    "math",
    "layer",
    "rope",
    "attention",
    "rms_norm",
    "causal_mask",
    "conv2d_nhwc",
    "float",
    "print",
    "super",
    "range",
];

/// Python's keywords: no name, local or attribute, can be one.
const KEYWORDS: &[&str] = &[
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield",
];

/// Attributes every `nn.Module` has: a parameter or submodule cannot take them.
const MODULE_ATTRS: &[&str] = &[
    "training",
    "forward",
    "train",
    "eval",
    "to",
    "cuda",
    "cpu",
    "float",
    "double",
    "half",
    "bfloat16",
    "type",
    "apply",
    "parameters",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "state_dict",
    "load_state_dict",
    "zero_grad",
    "register_buffer",
    "register_parameter",
    "register_module",
    "add_module",
    "get_submodule",
    "get_parameter",
    "get_buffer",
    "requires_grad_",
    "share_memory",
    "extra_repr",
    "compile",
    "dump_patches",
    "call_super_init",
    "ipu",
    "xpu",
    "mtia",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_backward_hook",
    "register_full_backward_hook",
    "set_extra_state",
    "get_extra_state",
    "to_empty",
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_version",
    "_apply",
    "_call_impl",
    "_get_name",
    "_named_members",
    "_save_to_state_dict",
    "_load_from_state_dict",
];

/// Names the twin's file defines at the top level, which no class may take
/// (a block `f` would otherwise become a class `F` over `torch.nn.functional`).
const FILE_NAMES: &[&str] = &[
    "F",
    "MODEL",
    "FUSEC_MODEL",
    "DIMS",
    "INPUTS",
    "OPTIMIZER",
    "CLIP_GRAD_NORM",
    "PRECISION",
    "MICRO_BATCHES",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Item {
    Call(usize),
    Repeat(usize),
}

struct Tree {
    item: Option<Item>,
    path: String,
    first: usize,
    end: usize,
    children: Vec<Tree>,
}

/// What a caller needs to call a class: the tensors it takes and the
/// dimensions it must be given (those no tensor argument carries).
#[derive(Clone)]
struct ClassInfo {
    name: String,
    dims: Vec<String>,
}

pub struct Gen<'a> {
    g: &'a Graph,
    st: &'a Structure,
    alias: HashMap<Value, Value>,
    /// (block and class text with `CLASS` for its name, the name given, the text).
    classes: Vec<(String, String, String)>,
    names_taken: HashSet<String>,
}

fn leaves(v: &Val, out: &mut Vec<Value>) {
    match v {
        Val::Tensor(t) => out.push(*t),
        Val::List(items) => items.iter().for_each(|(v, _)| leaves(v, out)),
        _ => {}
    }
}

/// A local Python name for a model-file name.
fn local(name: &str, dims: &[String]) -> String {
    if RESERVED.contains(&name) || KEYWORDS.contains(&name) || dims.iter().any(|d| d == name) {
        format!("{name}_")
    } else {
        name.to_string()
    }
}

fn err(msg: impl Into<String>) -> ExportError {
    ExportError::new(msg, None)
}

impl<'a> Gen<'a> {
    pub fn new(g: &'a Graph, st: &'a Structure) -> Gen<'a> {
        Gen {
            g,
            st,
            alias: cast_sources(g),
            classes: Vec::new(),
            names_taken: FILE_NAMES.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The block calls and `repeat`s as a tree, the whole model at its root.
    fn tree(&self) -> Tree {
        let mut items: Vec<(usize, usize, String, Item)> = Vec::new();
        for (i, c) in self.st.calls.iter().enumerate() {
            items.push((c.first, c.end, c.path.clone(), Item::Call(i)));
        }
        for (i, r) in self.st.repeats.iter().enumerate() {
            items.push((r.first, r.end, r.path.clone(), Item::Repeat(i)));
        }
        // Parents before children: by start, then the shorter path.
        items.sort_by(|a, b| a.0.cmp(&b.0).then(a.2.len().cmp(&b.2.len())));
        let mut tree = Tree {
            item: None,
            path: String::new(),
            first: 0,
            end: self.g.g.node_count(),
            children: Vec::new(),
        };
        for (first, end, path, item) in items {
            insert(
                &mut tree,
                Tree {
                    item: Some(item),
                    path,
                    first,
                    end,
                    children: Vec::new(),
                },
            );
        }
        tree
    }

    fn canon(&self, v: Value) -> Value {
        *self.alias.get(&v).unwrap_or(&v)
    }

    pub fn class_texts(&self) -> Vec<String> {
        self.classes.iter().map(|(_, _, t)| t.clone()).collect()
    }

    /// The model's class, under the name it was given (`name`, unless a
    /// block took it); every block class it uses is written first.
    pub fn root(&mut self, name: &str, loss: Value) -> Result<String, ExportError> {
        for d in &self.g.dims {
            python_name(d, "dimension", None)?;
        }
        let mut inputs = Vec::new();
        for n in self.g.topo_order() {
            if let Op::Input(i) = &self.g.g[n].op {
                // The twin draws its dropout masks from PyTorch's generator.
                if i.name == crate::ops::DROPOUT_KEY_INPUT {
                    continue;
                }
                // Inputs are keyword arguments of `forward`, named as in the file.
                python_name(&i.name, "input", self.g.g[n].span)?;
                inputs.push((i.name.clone(), Value { node: n, port: 0 }));
            }
        }
        let loss = self.canon(loss);
        let info = self.class(&self.tree(), None, &inputs, &[loss], Some(name))?;
        if !info.dims.is_empty() {
            return Err(err(format!(
                "no input has an axis of exactly {}, so the twin cannot read {} from its inputs",
                info.dims.join(", "),
                if info.dims.len() == 1 { "it" } else { "them" }
            ))
            .help("give some input an axis of that dimension alone"));
        }
        Ok(info.name)
    }

    /// Writes (or reuses) the class for one scope. `args` are the tensors
    /// the scope receives, named; `result` the values it returns.
    fn class(
        &mut self,
        tree: &Tree,
        block: Option<&str>,
        args: &[(String, Value)],
        result: &[Value],
        fixed_name: Option<&str>,
    ) -> Result<ClassInfo, ExportError> {
        let mut body = Body::new(self, tree, args, result);
        body.run(self, tree)?;
        let Body {
            init,
            lines,
            dims_used,
            ..
        } = body;
        // Dimensions come from the shapes of tensor arguments where one
        // carries them; the rest must be passed in.
        let mut head = Vec::new();
        let mut extra = Vec::new();
        for d in &dims_used {
            let sym = Dim::symbol(d);
            let found = args.iter().find_map(|(n, v)| {
                let ty = self.g.ty(*v);
                ty.shape
                    .iter()
                    .position(|x| *x == sym)
                    .map(|i| (n.clone(), i))
            });
            match found {
                Some((n, i)) => head.push(format!("        {d} = {n}.shape[{i}]")),
                None => extra.push(d.clone()),
            }
        }
        let mut text = String::new();
        let _ = writeln!(text, "class CLASS(nn.Module):");
        match block {
            Some(b) => {
                let _ = writeln!(text, "    \"\"\"block `{b}` of the model file\"\"\"\n");
            }
            None => {
                let _ = writeln!(
                    text,
                    "    \"\"\"the model file's top level; returns the loss\"\"\"\n"
                );
            }
        }
        if !init.is_empty() {
            let _ = writeln!(text, "    def __init__(self):");
            let _ = writeln!(text, "        super().__init__()");
            for l in &init {
                let _ = writeln!(text, "        {l}");
            }
            let _ = writeln!(text);
        }
        let mut sig: Vec<String> = vec!["self".into()];
        sig.extend(args.iter().map(|(n, _)| n.clone()));
        if !extra.is_empty() {
            sig.push("*".into());
            sig.extend(extra.iter().cloned());
        }
        let _ = writeln!(text, "    def forward({}):", sig.join(", "));
        for l in head.iter().chain(lines.iter()) {
            let _ = writeln!(text, "{l}");
        }
        let base = fixed_name
            .map(|s| s.to_string())
            .unwrap_or_else(|| class_name(block.unwrap_or("block"), "Block"));
        let key = format!("{}\n{text}", block.unwrap_or(""));
        if let Some((_, name, _)) = self.classes.iter().find(|(k, _, _)| *k == key) {
            return Ok(ClassInfo {
                name: name.clone(),
                dims: extra,
            });
        }
        let mut name = base.clone();
        let mut k = 1;
        while !self.names_taken.insert(name.clone()) {
            k += 1;
            name = format!("{base}{k}");
        }
        let text = text.replacen("class CLASS(", &format!("class {name}("), 1);
        self.classes.push((key, name.clone(), text));
        Ok(ClassInfo { name, dims: extra })
    }
}

fn insert(parent: &mut Tree, t: Tree) {
    if let Some(last) = parent.children.last_mut() {
        if t.path.starts_with(&format!("{}.", last.path)) {
            insert(last, t);
            return;
        }
    }
    parent.children.push(t);
}

/// The forward body of one scope being written.
struct Body {
    path: String,
    dims: Vec<String>,
    own: BTreeSet<usize>,
    /// Python expression of each value available here.
    bound: HashMap<Value, PyExpr>,
    /// Values whose expression waits to be written into its one reader.
    pending: HashMap<Value, PyExpr>,
    /// Local name -> the value it holds now.
    holder: HashMap<String, Option<Value>>,
    /// Where each value is read in this scope (own nodes, or the start of a
    /// call it is passed to; `usize::MAX` for the scope's result).
    uses: HashMap<Value, Vec<usize>>,
    result: Vec<Value>,
    init: Vec<String>,
    lines: Vec<String>,
    dims_used: BTreeSet<String>,
    /// Attributes `__init__` has set: parameters and submodules.
    attrs: HashSet<String>,
    temps: usize,
    /// Per cross-entropy value: its logits, targets and the logits' rank.
    ce: HashMap<Value, (PyExpr, PyExpr, usize, CeRule)>,
}

impl Body {
    fn new(gen: &Gen, tree: &Tree, args: &[(String, Value)], result: &[Value]) -> Body {
        let mut own: BTreeSet<usize> = (tree.first..tree.end).collect();
        for c in &tree.children {
            for i in c.first..c.end {
                own.remove(&i);
            }
        }
        let mut b = Body {
            path: tree.path.clone(),
            dims: gen.g.dims.clone(),
            own,
            bound: HashMap::new(),
            pending: HashMap::new(),
            holder: HashMap::new(),
            uses: HashMap::new(),
            result: result.to_vec(),
            init: Vec::new(),
            lines: Vec::new(),
            dims_used: BTreeSet::new(),
            attrs: HashSet::new(),
            temps: 0,
            ce: HashMap::new(),
        };
        for d in &gen.g.dims {
            b.holder.insert(d.clone(), None);
        }
        for (n, v) in args {
            let v = gen.canon(*v);
            b.bound.entry(v).or_insert_with(|| PyExpr::name(n));
            b.holder.insert(n.clone(), Some(v));
        }
        // Uses: own readers, calls the value is passed to, the result.
        for &n in &b.own {
            let idx = NodeIndex::new(n);
            if !gen.g.g.contains_node(idx) || matches!(gen.g.g[idx].op, Op::Cast(_)) {
                continue;
            }
            for v in gen.g.inputs(idx) {
                b.uses.entry(gen.canon(v)).or_default().push(n);
            }
        }
        for c in &tree.children {
            for v in gen.call_args(c) {
                b.uses.entry(gen.canon(v)).or_default().push(c.first);
            }
        }
        for v in result {
            b.uses.entry(*v).or_default().push(usize::MAX);
        }
        b
    }

    /// Records an attribute `__init__` sets; a parameter and a block
    /// instance of one name cannot both be attributes of one module.
    fn attr(&mut self, attr: &str, full: &str, span: Option<Span>) -> Result<(), ExportError> {
        attr_ok(attr, full).map_err(|e| e.with_span(span))?;
        if !self.attrs.insert(attr.to_string()) {
            return Err(err(format!(
                "`{full}` is both a parameter and a block instance of one module"
            ))
            .with_span(span)
            .help(format!(
                "rename the parameter `{attr}` or the block it shares its name with"
            )));
        }
        Ok(())
    }

    fn used_after(&self, v: Value, pos: usize) -> bool {
        self.uses
            .get(&v)
            .is_some_and(|u| u.iter().any(|&p| p > pos))
    }

    /// A name for `v` at `pos`: its `let` name, unless that name holds a
    /// value still needed (then `name_2`, ...).
    fn fresh(&mut self, gen: &Gen, v: Value, pos: usize) -> String {
        self.fresh_avoiding(gen, v, pos, &[])
    }

    /// As `fresh`, also avoiding the names `avoid` reads.
    fn fresh_avoiding(&mut self, gen: &Gen, v: Value, pos: usize, avoid: &[PyExpr]) -> String {
        let base = match gen.st.names.get(&(self.path.clone(), v)) {
            Some(n) => local(n, &self.dims),
            None => {
                self.temps += 1;
                format!("t{}", self.temps)
            }
        };
        let mut name = base.clone();
        let mut k = 1;
        loop {
            let busy = match self.holder.get(&name) {
                None => false,
                Some(None) => true,
                Some(Some(u)) => *u != v && self.used_after(*u, pos),
            } || self
                .pending
                .values()
                .chain(avoid)
                .any(|e| e.reads.contains(&name));
            if !busy {
                break;
            }
            k += 1;
            name = format!("{base}_{k}");
        }
        self.holder.insert(name.clone(), Some(v));
        name
    }

    /// The expression of a value read here; a waiting expression is used up.
    fn take(&mut self, gen: &Gen, v: Value) -> Result<PyExpr, ExportError> {
        let v = gen.canon(v);
        if let Some(e) = self.pending.remove(&v) {
            return Ok(e);
        }
        if let Some(e) = self.bound.get(&v) {
            return Ok(e.clone());
        }
        // Constants may be shared between scopes; they are written in place.
        let node = &gen.g.g[v.node];
        if matches!(node.op, Op::Constant(_) | Op::DimValue(_)) {
            return op_expr(node, &[], &[]).map_err(err);
        }
        Err(err(format!(
            "internal error: a value of `{}` is read in `{}` but not made there",
            node.op.name(),
            if self.path.is_empty() {
                "the top level"
            } else {
                &self.path
            }
        )))
    }

    fn note_dims(&mut self, e: &PyExpr) {
        for r in &e.reads {
            if self.dims.contains(r) && !matches!(self.holder.get(r), Some(Some(_))) {
                self.dims_used.insert(r.clone());
            }
        }
    }

    /// Binds `v` to `e`: written into its one reader if it has exactly one
    /// and no name, else as a statement of its own.
    fn define(&mut self, gen: &Gen, v: Value, e: PyExpr, pos: usize) {
        let uses = self.uses.get(&v).map_or(0, |u| u.len());
        let named = gen.st.names.contains_key(&(self.path.clone(), v));
        if uses == 0 && !named {
            return;
        }
        let only_returned = self.uses.get(&v).is_some_and(|u| u == &[usize::MAX]);
        if uses == 1 && !named && (e.text.len() <= 88 || only_returned) {
            self.pending.insert(v, e);
            return;
        }
        self.note_dims(&e);
        let name = self.fresh(gen, v, pos);
        self.lines.push(format!("        {name} = {}", e.text));
        self.bound.insert(v, PyExpr::name(&name));
    }

    fn run(&mut self, gen: &mut Gen, tree: &Tree) -> Result<(), ExportError> {
        let mut pos = tree.first;
        let mut ci = 0;
        loop {
            if ci < tree.children.len() && tree.children[ci].first <= pos {
                let c = &tree.children[ci];
                self.child(gen, c)?;
                pos = pos.max(c.end);
                ci += 1;
                continue;
            }
            if pos >= tree.end {
                break;
            }
            if self.own.contains(&pos) {
                self.node(gen, pos)?;
            }
            pos += 1;
        }
        // The return statement.
        let mut outs = Vec::new();
        for v in self.result.clone() {
            let e = self.take(gen, v)?;
            self.note_dims(&e);
            outs.push(e.text);
        }
        self.lines
            .push(format!("        return {}", outs.join(", ")));
        Ok(())
    }

    fn node(&mut self, gen: &Gen, pos: usize) -> Result<(), ExportError> {
        let g = gen.g;
        let idx = NodeIndex::new(pos);
        let node = &g.g[idx];
        let v = Value { node: idx, port: 0 };
        match &node.op {
            Op::Cast(_) | Op::Input(_) => return Ok(()),
            Op::Param(p) => {
                let local = p
                    .name
                    .strip_prefix(&format!("{}.", self.path))
                    .unwrap_or(&p.name)
                    .to_string();
                let info = g.params.iter().find(|i| i.name == p.name);
                self.attr(&local, &p.name, info.map(|i| i.span))?;
                let shape: Vec<String> = p.ty.shape.iter().map(|d| d.to_string()).collect();
                let shape = if shape.is_empty() {
                    "()".to_string()
                } else {
                    shape.join(", ")
                };
                let init = match info.map(|i| &i.init) {
                    Some(Init::Normal { std }) => {
                        format!("torch.empty({shape}).normal_(std={})", super::float(*std))
                    }
                    Some(Init::Uniform { bound }) => {
                        format!(
                            "torch.empty({shape}).uniform_(-{b}, {b})",
                            b = super::float(*bound)
                        )
                    }
                    Some(Init::Constant(c)) if *c == 0.0 => format!("torch.zeros({shape})"),
                    Some(Init::Constant(c)) if *c == 1.0 => format!("torch.ones({shape})"),
                    Some(Init::Constant(c)) => {
                        let tuple = match p.ty.shape.len() {
                            0 => "()".to_string(),
                            1 => format!("({shape},)"),
                            _ => format!("({shape})"),
                        };
                        format!("torch.full({tuple}, {})", super::float(*c))
                    }
                    None => format!("torch.zeros({shape})"),
                };
                self.init
                    .push(format!("self.{local} = nn.Parameter({init})"));
                self.bound
                    .insert(v, PyExpr::bare(format!("self.{local}"), Prec::Atom));
                return Ok(());
            }
            _ => {}
        }
        for port in 1..node.outputs.len() {
            let other = Value { node: idx, port };
            if self.uses.get(&other).is_some_and(|u| !u.is_empty()) {
                return Err(err(format!(
                    "output {port} of `{}` is read: the twin writes each op's first output only",
                    node.op.name()
                ))
                .with_span(node.span));
            }
        }
        let ins_v: Vec<Value> = g.inputs(idx).into_iter().map(|v| gen.canon(v)).collect();
        let shapes: Vec<Vec<Dim>> = ins_v.iter().map(|v| g.ty(*v).shape.clone()).collect();
        // mean(cross_entropy(logits, targets)) over every row: one call.
        if let Op::Reduce(r) = &node.op {
            let all = r.axes.len() == shapes[0].len() && !r.keepdim;
            if r.kind == ReduceKind::Mean && all && self.pending.contains_key(&ins_v[0]) {
                if let Some((l, t, rank, rule)) = self.ce.remove(&ins_v[0]) {
                    self.pending.remove(&ins_v[0]);
                    let e = mean_cross_entropy(&l, &t, rank, &rule);
                    self.define(gen, v, e, pos);
                    return Ok(());
                }
            }
        }
        let mut ins = Vec::new();
        // A dropout's key stays behind: the twin's masks are PyTorch's.
        let read = match &node.op {
            Op::Dropout(_) => &ins_v[..1],
            Op::Attention(a) if a.dropout.is_some() => &ins_v[..ins_v.len() - 1],
            _ => &ins_v[..],
        };
        for iv in read {
            ins.push(self.take(gen, *iv)?);
        }
        let e = op_expr(node, &ins, &shapes)
            .map_err(|what| err(format!("{what} has no PyTorch twin")).with_span(node.span))?;
        // With an ignored index, F.cross_entropy's mean divides by the
        // kept rows where a mean of the per-row losses divides by all of
        // them: such a loss keeps its per-row form.
        if let Op::CrossEntropy(ce) = &node.op {
            if ce.rule.ignore_index.is_some() {
                self.define(gen, v, e, pos);
                return Ok(());
            }
            let pending = (ins[0].clone(), ins[1].clone(), shapes[0].len(), ce.rule);
            self.ce.insert(v, pending);
            // Kept for its reader whatever its length: a `mean` over it
            // becomes one `F.cross_entropy`.
            let single = self.uses.get(&v).is_some_and(|u| u.len() == 1);
            if single && !gen.st.names.contains_key(&(self.path.clone(), v)) {
                self.pending.insert(v, e);
                return Ok(());
            }
        }
        self.define(gen, v, e, pos);
        Ok(())
    }

    fn child(&mut self, gen: &mut Gen, c: &Tree) -> Result<(), ExportError> {
        let attr = c.path.rsplit('.').next().unwrap_or(&c.path).to_string();
        self.attr(&attr, &c.path, None)?;
        match c.item {
            Some(Item::Call(i)) => {
                let rec = gen.st.calls[i].clone();
                let (args, result) = gen.scope_io(&rec.args, &rec.result);
                let info = gen.class(c, Some(&rec.block), &args, &result, None)?;
                self.init.push(format!("self.{attr} = {}()", info.name));
                let mut texts = Vec::new();
                for (_, v) in &args {
                    texts.push(self.take(gen, *v)?);
                }
                let call = self.call_text(&format!("self.{attr}"), &texts, &info.dims);
                self.bind_results(gen, c, call, &result)
            }
            Some(Item::Repeat(_)) => self.repeat(gen, c, &attr),
            None => Ok(()),
        }
    }

    fn call_text(&mut self, f: &str, args: &[PyExpr], dims: &[String]) -> PyExpr {
        let mut parts: Vec<String> = args.iter().map(|a| a.text.clone()).collect();
        for d in dims {
            parts.push(format!("{d}={d}"));
            if !matches!(self.holder.get(d), Some(Some(_))) {
                self.dims_used.insert(d.clone());
            }
        }
        PyExpr {
            reads: args
                .iter()
                .flat_map(|a| a.reads.iter().cloned())
                .chain(dims.iter().cloned())
                .collect(),
            ..PyExpr::bare(format!("{f}({})", parts.join(", ")), Prec::Atom)
        }
    }

    /// The values a call returns, bound in this scope.
    fn bind_results(
        &mut self,
        gen: &Gen,
        c: &Tree,
        call: PyExpr,
        result: &[Value],
    ) -> Result<(), ExportError> {
        let made_here = |v: &Value| (c.first..c.end).contains(&v.node.index());
        match result {
            [] => Ok(()),
            [v] if made_here(v) => {
                self.define(gen, *v, call, c.first);
                Ok(())
            }
            _ => {
                self.note_dims(&call);
                let mut names = Vec::new();
                for v in result {
                    if made_here(v) && !self.bound.contains_key(v) {
                        let n = self.fresh(gen, *v, c.first);
                        self.bound.insert(*v, PyExpr::name(&n));
                        names.push(n);
                    } else {
                        names.push("_".into());
                    }
                }
                self.lines
                    .push(format!("        {} = {}", names.join(", "), call.text));
                Ok(())
            }
        }
    }

    fn repeat(&mut self, gen: &mut Gen, c: &Tree, attr: &str) -> Result<(), ExportError> {
        let mut classes = Vec::new();
        let mut layer_io = Vec::new();
        for layer in &c.children {
            let Some(Item::Call(i)) = layer.item else {
                continue;
            };
            let rec = gen.st.calls[i].clone();
            let (args, result) = gen.scope_io(&rec.args, &rec.result);
            let info = gen.class(layer, Some(&rec.block), &args, &result, None)?;
            classes.push(info);
            layer_io.push((rec, args, result));
        }
        let Some((first_rec, first_args, _)) = layer_io.first() else {
            return Ok(());
        };
        let (_, _, last_result) = layer_io.last().expect("a repeat has layers");
        if classes.iter().any(|k| k.dims != classes[0].dims) {
            return Err(err(format!(
                "the layers of `repeat` at `{}` take different arguments",
                c.path
            )));
        }
        let n = classes.len();
        if classes.iter().all(|k| k.name == classes[0].name) {
            self.init.push(format!(
                "self.{attr} = nn.ModuleList([{}() for _ in range({n})])",
                classes[0].name
            ));
        } else {
            let list: Vec<String> = classes.iter().map(|k| format!("{}()", k.name)).collect();
            self.init.push(format!(
                "self.{attr} = nn.ModuleList([{}])",
                list.join(", ")
            ));
        }
        // The threaded tensor is the first argument; the others are the same
        // values for every layer and are read once per layer.
        let mut firsts = Vec::new();
        leaves(&first_rec.args[0].1, &mut firsts);
        let x0 = gen.canon(firsts[0]);
        let mut others = Vec::new();
        for (_, v) in first_args.iter().skip(1) {
            let e = self.take(gen, *v)?;
            let e = if e.prec == Prec::Atom
                && e.text
                    .chars()
                    .all(|ch| ch.is_alphanumeric() || ch == '_' || ch == '.')
            {
                e
            } else {
                self.note_dims(&e);
                let t = self.fresh(gen, *v, c.first);
                self.lines.push(format!("        {t} = {}", e.text));
                PyExpr::name(&t)
            };
            others.push(e);
        }
        let out = last_result[0];
        let init = self.take(gen, x0)?;
        self.note_dims(&init);
        // The loop rebinds `name` each layer: no other argument may read it
        // (`repeat 2 f(x, x)` passes the first `x` to every layer).
        let name = self.fresh_avoiding(gen, out, c.first, &others);
        if init.text != name {
            self.lines.push(format!("        {name} = {}", init.text));
        }
        let mut args = vec![PyExpr::name(&name)];
        args.extend(others);
        let call = self.call_text("layer", &args, &classes[0].dims);
        self.lines
            .push(format!("        for layer in self.{attr}:"));
        self.lines
            .push(format!("            {name} = {}", call.text));
        self.bound.insert(out, PyExpr::name(&name));
        Ok(())
    }
}

impl Gen<'_> {
    /// The tensors a call passes (named after the block's parameters) and returns.
    fn scope_io(&self, args: &[(String, Val)], result: &Val) -> (Vec<(String, Value)>, Vec<Value>) {
        let mut named = Vec::new();
        for (name, v) in args {
            let mut ls = Vec::new();
            leaves(v, &mut ls);
            let base = local(name, &self.g.dims);
            if matches!(v, Val::Tensor(_)) {
                named.push((base, self.canon(ls[0])));
            } else {
                for (i, l) in ls.into_iter().enumerate() {
                    named.push((format!("{base}_{i}"), self.canon(l)));
                }
            }
        }
        let mut res = Vec::new();
        leaves(result, &mut res);
        (named, res.into_iter().map(|v| self.canon(v)).collect())
    }

    /// The tensors passed to a child (for a `repeat`, those of its first layer).
    fn call_args(&self, c: &Tree) -> Vec<Value> {
        let rec = match c.item {
            Some(Item::Call(i)) => &self.st.calls[i],
            Some(Item::Repeat(_)) => match c.children.first().and_then(|l| l.item) {
                Some(Item::Call(i)) => &self.st.calls[i],
                _ => return vec![],
            },
            None => return vec![],
        };
        let mut out = Vec::new();
        for (_, v) in &rec.args {
            leaves(v, &mut out);
        }
        out
    }
}

fn attr_ok(attr: &str, full: &str) -> Result<(), ExportError> {
    if MODULE_ATTRS.contains(&attr) || KEYWORDS.contains(&attr) {
        return Err(err(format!(
            "`{full}` cannot be a PyTorch attribute: `{attr}` is a name every nn.Module or Python itself uses"
        ))
        .help(format!("rename `{attr}` in the model file")));
    }
    Ok(())
}

/// Inputs and dimensions keep their model-file names in the twin (inputs
/// are `forward`'s keyword arguments, `INPUTS` and `DIMS` name them), so a
/// name Python or the twin's own code needs is an error, not a rename.
fn python_name(name: &str, what: &str, span: Option<Span>) -> Result<(), ExportError> {
    if KEYWORDS.contains(&name) || RESERVED.contains(&name) || FILE_NAMES.contains(&name) {
        return Err(err(format!(
            "the {what} `{name}` cannot keep its name in Python: the twin's code uses `{name}`"
        ))
        .with_span(span)
        .help(format!("rename the {what} `{name}` in the model file")));
    }
    Ok(())
}

impl ExportError {
    fn with_span(mut self, s: Option<Span>) -> ExportError {
        self.span = s;
        self
    }
}

/// Value -> the value it is a precision copy of (`cast` nodes are the
/// compute-dtype copies of parameters and inputs; the twin leaves dtypes to
/// autocast, so a copy is the value itself).
pub(crate) fn cast_sources(g: &Graph) -> HashMap<Value, Value> {
    let mut alias = HashMap::new();
    for n in g.topo_order() {
        if let Op::Cast(_) = g.g[n].op {
            let src = g.inputs(n)[0];
            let src = *alias.get(&src).unwrap_or(&src);
            alias.insert(Value { node: n, port: 0 }, src);
        }
    }
    alias
}
