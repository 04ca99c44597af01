//! Chains a norm runs as it loads its rows: a post-LN transformer's
//! `layernorm(x + dropout(y + b))` computes the sum in registers, stores it
//! once for the norm's backward, and normalises it without reading it back
//! from memory (the one-warp-a-row forward, emit/norm_rows.rs and
//! kernels/norm.cuh).

use super::*;
use crate::kernel::Prologue;

impl Fuser<'_> {
    /// The norm whose kernel can run `tail`'s chain as it loads its rows:
    /// a one-warp-a-row norm forward reading the chain's value, unchanged,
    /// as its input 0 (and as nothing else), with every other reader of
    /// that value launched after it.
    pub(super) fn prologue_norm(&self, tail: NodeIndex) -> Option<NodeIndex> {
        if !self.opts.on(Optimisation::ChainsIntoNorms) {
            return None;
        }
        let v = Value {
            node: tail,
            port: 0,
        };
        let n = self.g.g[tail].outputs[0].numel();
        if self.chain_sum(tail, &n).is_some() {
            return None;
        }
        let readers = self.readers(v);
        let norm = readers.iter().copied().find(|&r| {
            let ins = self.g.inputs(r);
            matches!(self.g.g[r].op, Op::LayerNorm(_) | Op::RmsNorm(_))
                && crate::kernel::forms::norm_forward_rows(self.g, r).is_some()
                && self.base(ins[0]).0 == v
                && self.same_elements(ins[0], r)
                && ins[1..].iter().all(|&u| self.base(u).0 != v)
        })?;
        let at = self.position[&norm];
        readers
            .iter()
            .all(|&r| r == norm || self.position[&r] > at)
            .then_some(norm)
    }

    /// The kernel of norm `n` running its deferred chain as it loads its
    /// rows; where the norm's parameters are read through a view (which the
    /// one-warp-a-row kernel does not take), the chain's own kernel and
    /// then the norm's.
    pub(super) fn prologue_kernel(&mut self, n: NodeIndex, kernels: &mut Vec<Kernel>) {
        let chain = self.chains[self.deferred[&n]].clone();
        let mut params = Vec::new();
        for x in self.g.inputs(n).into_iter().skip(1) {
            match self.op_input(x, n, kernels) {
                (b, None) => params.push(b),
                (_, Some(_)) => {
                    self.chain_kernel(&chain, kernels);
                    return self.op_kernel(n, kernels);
                }
            }
        }
        let (mut exprs, chain_inputs, last) = self.chain_exprs(&chain, kernels);
        // The chain's loads read the kernel's inputs after the norm's own.
        let shift = params.len();
        for e in &mut exprs {
            if let PExpr::Load { input, .. } | PExpr::Dropout { key: input, .. } = e {
                *input += shift;
            }
        }
        let tail = *chain.last().expect("chains are not empty");
        let v = Value {
            node: tail,
            port: 0,
        };
        let mut nodes = chain.clone();
        nodes.push(n);
        let y = Value { node: n, port: 0 };
        let out = match self.cast_into.get(&y) {
            Some(&c) => {
                nodes.push(c);
                self.store(Value { node: c, port: 0 }, BufKind::Temp)
            }
            None => self.store(y, BufKind::Temp),
        };
        let mut outputs = vec![out];
        let mut stores = Vec::new();
        // Stored where anything but the norm reads it (its backward).
        if self.readers(v).len() > 1 || self.outputs.contains(&v) {
            outputs.push(self.store(v, BufKind::Temp));
            stores.push((1, last));
        }
        let mut inputs = params;
        inputs.extend(chain_inputs);
        kernels.push(Kernel {
            name: kernel_name(self.g, kernels.len(), &nodes),
            nodes,
            inputs,
            outputs,
            input_views: Vec::new(),
            residual: None,
            prologue: Some(Prologue {
                chain: Pointwise {
                    n: self.g.g[tail].outputs[0].numel(),
                    exprs,
                    stores,
                    sum: None,
                },
                value: last,
                dtype: self.g.ty(v).dtype,
            }),
            body: Body::Op(n),
        });
    }
}
