//! Elementwise chains: which pointwise ops share a kernel, and the kernel
//! that runs a chain (its expressions, what it stores, and a column sum it
//! adds up as it goes). Apart from the entry point because forming chains
//! has rules of its own (who may join whom), and because the norm
//! prologues (prologues.rs) build their expressions with the same code.

use super::*;

impl Fuser<'_> {
    /// A widening cast (bf16 gradient to its f32 buffer) that the op
    /// kernel before it performs as it stores: the op computes in f32, so
    /// the narrow value is never written. Not after a collective: NCCL
    /// stores in the type it reads, so a cast after one must stay a kernel.
    pub(super) fn absorbed_cast(&self, n: NodeIndex) -> Option<Value> {
        let Op::Cast(c) = &self.g.g[n].op else {
            return None;
        };
        if !self.opts.on(Optimisation::CastsIntoProducers) {
            return None;
        }
        let x = self.g.inputs(n)[0];
        let absorbs = c.to == DType::F32
            && self.class(x.node) == FusionClass::Kernel
            && !matches!(
                self.g.g[x.node].op,
                Op::AdamW(_) | Op::Sgd(_) | Op::AllReduce(_)
            )
            && self.g.users(x).len() == 1
            && !self.outputs.contains(&x);
        absorbs.then_some(x)
    }

    /// Whether add `n` should start a chain of its own rather than join
    /// the chain of `x`, its other operand: `n` adds the product of a GEMM
    /// that `n` alone reads to a value stored before that GEMM runs, so
    /// the GEMM adds it as its residual (cuBLASLt's C) and a sum of many
    /// products (a layer input's gradient from its query, key and value
    /// projections) becomes a run of residual epilogues, not an add kernel
    /// reading every product back.
    fn residual_for_gemm(&self, n: NodeIndex, x: Value, at: &HashMap<NodeIndex, usize>) -> bool {
        let is_add = matches!(&self.g.g[n].op, Op::Binary(b) if b.kind == BinaryKind::Add);
        if !is_add || !self.opts.on(Optimisation::GemmEpilogues) {
            return false;
        }
        let ins = self.g.inputs(n);
        let Some(&m) = ins.iter().find(|&&v| v != x) else {
            return false;
        };
        let out = self.g.ty(Value { node: n, port: 0 });
        matches!(self.g.g[m.node].op, Op::MatMul(_))
            && m.port == 0
            && self.g.users(m).len() == 1
            && !self.outputs.contains(&m)
            && self.g.ty(m) == out
            && self.g.ty(x) == out
            && at.get(&self.base(x).0.node) < at.get(&m.node)
    }

    pub(super) fn form_chains(&mut self) {
        let order = self.g.topo_order();
        let at = self.position.clone();
        for n in order {
            if self.class(n) != FusionClass::Elementwise {
                continue;
            }
            if let Some(x) = self.absorbed_cast(n) {
                self.cast_into.insert(x, n);
                continue;
            }
            let mut joined = None;
            let chains = self.opts.on(Optimisation::ElementwiseChains);
            for x in self.g.inputs(n).into_iter().filter(|_| chains) {
                let (b, _) = self.base(x);
                let Some(&gi) = self.group.get(&b.node) else {
                    continue;
                };
                let tail = *self.chains[gi].last().expect("chains are not empty");
                let only_reader = self.readers(b).iter().all(|&r| r == n);
                if tail == b.node
                    && only_reader
                    && !self.outputs.contains(&b)
                    && self.same_elements(x, n)
                    && !self.residual_for_gemm(n, x, &at)
                {
                    joined = Some(gi);
                    break;
                }
            }
            let gi = joined.unwrap_or_else(|| {
                self.chains.push(Vec::new());
                self.chains.len() - 1
            });
            self.chains[gi].push(n);
            self.group.insert(n, gi);
        }
    }

    /// The expressions of `chain`, their loads reading the buffers of the
    /// returned inputs by position, and the expression of its last value.
    pub(super) fn chain_exprs(
        &mut self,
        chain: &[NodeIndex],
        kernels: &mut Vec<Kernel>,
    ) -> (Vec<PExpr>, Vec<usize>, usize) {
        let mut exprs: Vec<PExpr> = Vec::new();
        let mut inputs: Vec<usize> = Vec::new();
        let mut prev: Option<(NodeIndex, usize)> = None;
        for &n in chain {
            let out_shape = self.g.g[n].outputs[0].shape.clone();
            let mut args = Vec::new();
            let mut key_slot = None;
            for (at, x) in self.g.inputs(n).into_iter().enumerate() {
                // Dropout's key is read whole, not as an element.
                if at == 1 && matches!(self.g.g[n].op, Op::Dropout(_)) {
                    let (b, _) = self.base(x);
                    let src = match self.buffer_of.get(&b) {
                        Some(&src) => src,
                        None => self.materialise(x, kernels),
                    };
                    key_slot = Some(match inputs.iter().position(|&i| i == src) {
                        Some(s) => s,
                        None => {
                            inputs.push(src);
                            inputs.len() - 1
                        }
                    });
                    continue;
                }
                let (b, _) = self.base(x);
                let e = match prev {
                    Some((p, e)) if b.node == p && self.same_elements(x, n) => e,
                    _ => {
                        let ex = match self.scalar_expr(x) {
                            Some(s) => s,
                            None => {
                                let flat = self.flat_view(x, &out_shape);
                                let src = match (&flat, self.needs_copy(x)) {
                                    (None, true) => self.materialise(x, kernels),
                                    _ => self.buffer_of[&b],
                                };
                                // A flat view has the kernel's elements in
                                // another shape; the others broadcast to it.
                                let view = match (flat, self.needs_copy(x)) {
                                    (Some(v), _) => v,
                                    (None, true) => {
                                        View::contiguous(&self.g.ty(x).shape).expand_to(&out_shape)
                                    }
                                    (None, false) => self.view_of(x).expand_to(&out_shape),
                                };
                                let slot = match inputs.iter().position(|&i| i == src) {
                                    Some(s) => s,
                                    None => {
                                        inputs.push(src);
                                        inputs.len() - 1
                                    }
                                };
                                PExpr::Load { input: slot, view }
                            }
                        };
                        exprs.push(ex);
                        exprs.len() - 1
                    }
                };
                args.push(e);
            }
            let e = match &self.g.g[n].op {
                Op::Unary(u) => PExpr::Unary(u.kind, args[0]),
                Op::UnaryGrad(u) => PExpr::UnaryGrad(u.kind, args[0], args[1]),
                Op::Binary(b) => PExpr::Binary(b.kind, args[0], args[1]),
                Op::Cast(c) => PExpr::Round(c.to, args[0]),
                Op::Dropout(d) => PExpr::Dropout {
                    op: d.clone(),
                    x: args[0],
                    key: key_slot.expect("dropout reads its key"),
                },
                other => unreachable!("{} is not pointwise", other.name()),
            };
            exprs.push(e);
            prev = Some((n, exprs.len() - 1));
        }
        (exprs, inputs, prev.expect("a chain has ops").1)
    }

    pub(super) fn chain_kernel(&mut self, chain: &[NodeIndex], kernels: &mut Vec<Kernel>) {
        let (exprs, inputs, last) = self.chain_exprs(chain, kernels);
        let tail = *chain.last().expect("chains are not empty");
        let v = Value {
            node: tail,
            port: 0,
        };
        let n = self.g.g[tail].outputs[0].numel();
        let summed = self.chain_sum(tail, &n);
        // Stored unless the sum is its one reader.
        let keep = summed.as_ref().is_none_or(|s| !s.only_reader);
        let mut nodes = chain.to_vec();
        let mut outputs = Vec::new();
        let mut stores = Vec::new();
        if keep {
            outputs.push(self.store(v, BufKind::Temp));
            stores.push((0, last));
        }
        let sum = summed.map(|s| {
            self.summed.insert(s.node);
            nodes.push(s.node);
            let r = Value {
                node: s.node,
                port: 0,
            };
            // A widening cast after the sum is its store, as for the sum's
            // own kernel.
            let stored = match self.cast_into.get(&r) {
                Some(&c) => {
                    nodes.push(c);
                    Value { node: c, port: 0 }
                }
                None => r,
            };
            outputs.push(self.store(stored, BufKind::Temp));
            ColumnSum {
                expr: last,
                dtype: self.g.ty(v).dtype,
                out: outputs.len() - 1,
                cols: s.cols,
                mean: s.mean,
            }
        });
        kernels.push(Kernel {
            name: kernel_name(self.g, kernels.len(), &nodes),
            nodes,
            inputs,
            outputs,
            input_views: Vec::new(),
            residual: None,
            prologue: None,
            body: Body::Pointwise(Pointwise {
                n,
                exprs,
                stores,
                sum,
            }),
        });
    }

    /// A sum over the leading axes that reads chain tail `tail` (of `n`
    /// elements, through reshapes alone) and that the chain's kernel can
    /// add up as it computes it.
    pub(super) fn chain_sum(&self, tail: NodeIndex, n: &Dim) -> Option<ChainSum> {
        if !self.opts.on(Optimisation::SumsIntoChains) {
            return None;
        }
        let v = Value {
            node: tail,
            port: 0,
        };
        if !self.g.ty(v).dtype.is_float() {
            return None;
        }
        let readers = self.readers(v);
        readers.iter().find_map(|&r| {
            let x = *self.g.inputs(r).first()?;
            let (base, views) = self.base(x);
            let (cols, mean) = crate::kernel::forms::leading_sum(self.g, r)?;
            let reshapes = views
                .iter()
                .all(|&u| matches!(self.g.g[u].op, Op::Reshape(_)));
            let viewed = views
                .iter()
                .any(|&u| self.outputs.contains(&Value { node: u, port: 0 }));
            (base == v && reshapes && self.g.ty(x).numel() == *n && !self.summed.contains(&r))
                .then_some(ChainSum {
                    node: r,
                    cols,
                    mean,
                    only_reader: readers.len() == 1 && !viewed && !self.outputs.contains(&v),
                })
        })
    }
}

/// A sum a chain's kernel performs (`Fuser::chain_sum`).
pub(super) struct ChainSum {
    node: NodeIndex,
    cols: i64,
    mean: bool,
    /// The chain's value is read by the sum alone, so it is not stored.
    only_reader: bool,
}
