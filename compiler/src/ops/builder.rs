//! A small helper for writing gradient rules: adds nodes to the graph with
//! the span and phase of the op being differentiated.

use super::*;
use crate::dsl::ast::Span;
use crate::ir::graph::{Graph, Phase};

pub struct Builder<'g> {
    pub graph: &'g mut Graph,
    pub span: Option<Span>,
    pub phase: Phase,
}

impl<'g> Builder<'g> {
    pub fn new(graph: &'g mut Graph, span: Option<Span>, phase: Phase) -> Builder<'g> {
        Builder { graph, span, phase }
    }

    pub fn ty(&self, v: Value) -> TensorType {
        self.graph.ty(v).clone()
    }

    pub fn op(&mut self, op: impl Into<Op>, inputs: &[Value]) -> Result<Vec<Value>, OpError> {
        self.graph.add(op.into(), inputs, self.span, self.phase)
    }

    pub fn op1(&mut self, op: impl Into<Op>, inputs: &[Value]) -> Result<Value, OpError> {
        Ok(self.op(op, inputs)?[0])
    }

    pub fn binary(&mut self, kind: BinaryKind, a: Value, b: Value) -> Result<Value, OpError> {
        self.op1(Binary { kind }, &[a, b])
    }
    pub fn add(&mut self, a: Value, b: Value) -> Result<Value, OpError> {
        self.binary(BinaryKind::Add, a, b)
    }
    pub fn sub(&mut self, a: Value, b: Value) -> Result<Value, OpError> {
        self.binary(BinaryKind::Sub, a, b)
    }
    pub fn mul(&mut self, a: Value, b: Value) -> Result<Value, OpError> {
        self.binary(BinaryKind::Mul, a, b)
    }
    pub fn div(&mut self, a: Value, b: Value) -> Result<Value, OpError> {
        self.binary(BinaryKind::Div, a, b)
    }
    pub fn unary(&mut self, kind: UnaryKind, a: Value) -> Result<Value, OpError> {
        self.op1(Unary { kind }, &[a])
    }
    pub fn neg(&mut self, a: Value) -> Result<Value, OpError> {
        self.unary(UnaryKind::Neg, a)
    }

    /// A scalar constant of the given dtype.
    pub fn constant(&mut self, value: f64, dtype: DType) -> Result<Value, OpError> {
        self.op1(Constant { value, dtype }, &[])
    }

    /// `a * c` for a scalar constant c of a's dtype.
    pub fn scale(&mut self, a: Value, c: f64) -> Result<Value, OpError> {
        let k = self.constant(c, self.ty(a).dtype)?;
        self.mul(a, k)
    }

    pub fn cast(&mut self, a: Value, dtype: DType) -> Result<Value, OpError> {
        if self.ty(a).dtype == dtype {
            return Ok(a);
        }
        self.op1(Cast { to: dtype }, &[a])
    }

    pub fn reshape(&mut self, a: Value, shape: Vec<Dim>) -> Result<Value, OpError> {
        if self.ty(a).shape == shape {
            return Ok(a);
        }
        self.op1(Reshape { shape }, &[a])
    }

    pub fn permute(&mut self, a: Value, perm: Vec<usize>) -> Result<Value, OpError> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(a);
        }
        self.op1(Permute { perm }, &[a])
    }

    /// Swaps the last two axes.
    pub fn transpose_last2(&mut self, a: Value) -> Result<Value, OpError> {
        let r = self.ty(a).rank();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        self.permute(a, perm)
    }

    pub fn sum(&mut self, a: Value, axes: Vec<usize>, keepdim: bool) -> Result<Value, OpError> {
        if axes.is_empty() {
            return Ok(a);
        }
        self.op1(
            Reduce {
                kind: ReduceKind::Sum,
                axes,
                keepdim,
            },
            &[a],
        )
    }

    /// Sums over the axes that broadcasting added or stretched, so that a
    /// gradient gets the shape of the operand it belongs to.
    pub fn sum_to(&mut self, g: Value, target: &[Dim]) -> Result<Value, OpError> {
        let shape = self.ty(g).shape;
        if shape == target {
            return Ok(g);
        }
        let r = shape.len();
        let off = r - target.len();
        let mut lead: Vec<usize> = (0..off).collect();
        let mut stretched = Vec::new();
        for i in off..r {
            if target[i - off].is_one() && !shape[i].is_one() {
                stretched.push(i);
            }
        }
        let mut v = g;
        if !stretched.is_empty() {
            v = self.sum(v, stretched, true)?;
        }
        if !lead.is_empty() {
            lead.sort();
            v = self.sum(v, lead, false)?;
        }
        self.reshape(v, target.to_vec())
    }

    pub fn broadcast_to(&mut self, a: Value, shape: Vec<Dim>) -> Result<Value, OpError> {
        if self.ty(a).shape == shape {
            return Ok(a);
        }
        self.op1(Broadcast { shape }, &[a])
    }

    pub fn matmul(&mut self, a: Value, b: Value) -> Result<Value, OpError> {
        self.op1(MatMul, &[a, b])
    }
}
