//! The graph: nodes are ops, edges are tensors. A node may have several
//! outputs (attention gives its output and the log-sum-exp); an edge names
//! which output it carries (`src_port`) and which input slot it feeds
//! (`dst_slot`), so a node's inputs are its incoming edges ordered by slot.

use super::types::TensorType;
use crate::dsl::ast::Span;
use crate::ops::{Op, OpError};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;

/// One output of one node.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct Value {
    pub node: NodeIndex,
    pub port: usize,
}

/// Which part of the training step a node belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Phase {
    Forward,
    Backward,
    Update,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Update => "update",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Node {
    pub op: Op,
    pub outputs: Vec<TensorType>,
    /// Where in the model file this node came from (backward nodes keep the
    /// span of the forward op they differentiate).
    pub span: Option<Span>,
    pub phase: Phase,
    /// A forward op run again in the backward pass (the `recompute` stage)
    /// in place of a kept activation: scheduled just before the first node
    /// that reads it, so its result lives no longer than it must.
    pub recompute: bool,
    /// The node whose turn in the step's order this one takes (a pass's
    /// replacement runs where what it replaces would have; `None`: its own,
    /// by when it was added). See `schedule::topo_order`.
    pub turn: Option<NodeIndex>,
    /// Among ready nodes of one turn, the lower runs first: a rewrite that
    /// must run in steps (the loss head's chunks, `loss_head`) numbers
    /// them; 0 for every other node.
    pub sub_turn: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct Edge {
    pub src_port: usize,
    pub dst_slot: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Uniform { bound: f64 },
    Constant(f64),
}

impl std::fmt::Display for Init {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Init::Normal { std } => write!(f, "normal(std={})", crate::ir::print::num(*std)),
            Init::Uniform { bound } => {
                write!(f, "uniform(bound={})", crate::ir::print::num(*bound))
            }
            Init::Constant(c) if *c == 0.0 => write!(f, "zeros"),
            Init::Constant(c) if *c == 1.0 => write!(f, "ones"),
            Init::Constant(c) => write!(f, "constant({})", crate::ir::print::num(*c)),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ParamInfo {
    /// Dotted path as the model file spells it: `h.3.attn.qkv_w`.
    pub name: String,
    pub ty: TensorType,
    pub init: Init,
    /// Decay with AdamW's weight decay (matrices and embeddings; not norms or biases).
    pub decay: bool,
    pub span: Span,
    pub node: NodeIndex,
}

impl ParamInfo {
    /// Its elements (a parameter's sizes are constants; an unbound one
    /// counts 1, as ZeRO's pieces have always counted it).
    pub fn numel(&self) -> u64 {
        self.ty
            .shape
            .iter()
            .map(|d| d.as_const().unwrap_or(1).max(1) as u64)
            .product()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Loss,
    /// The logits the loss reads (`driver::logits_graph`: what generation
    /// samples the next token from).
    Logits,
    /// Each position's cross-entropy of its target, [B, T]
    /// (`driver::token_losses_graph`: what a multiple-choice scorer sums).
    TokenLosses,
    /// Greedy decoding's picks, i32 [B, T] (`decode::greedy_graph`): the
    /// largest logit's index of each position.
    NextTokens,
    Grad(usize),
    NewParam(usize),
    NewState(String),
    GradNorm,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Role::Loss => write!(f, "loss"),
            Role::Logits => write!(f, "logits"),
            Role::TokenLosses => write!(f, "token_losses"),
            Role::NextTokens => write!(f, "next_tokens"),
            Role::Grad(i) => write!(f, "grad[{i}]"),
            Role::NewParam(i) => write!(f, "param[{i}]"),
            Role::NewState(s) => write!(f, "state \"{s}\""),
            Role::GradNorm => write!(f, "grad_norm"),
        }
    }
}

/// One block call of the model file (a layer of a `repeat` is one too):
/// nodes elaborated inside it carry `Span::call` = 1 + its index in
/// `Graph::calls`.
#[derive(Clone, Debug)]
pub struct CallSite {
    pub block: String,
    /// The instance path, as parameter names spell it: `h.3.attn`.
    pub path: String,
    /// The call's place (itself inside the call that made it, if any).
    pub site: Span,
}

#[derive(Clone, Debug)]
pub struct Graph {
    pub name: String,
    pub g: StableDiGraph<Node, Edge>,
    /// Symbolic dimensions, in declaration order.
    pub dims: Vec<String>,
    pub params: Vec<ParamInfo>,
    pub outputs: Vec<(Role, Value)>,
    /// The block calls nodes were elaborated in (see `Span::call`).
    pub calls: Vec<CallSite>,
    /// Sizes the `pad-dims` pass padded inside the step.
    pub padded: Vec<PaddedSize>,
    /// Order the nodes minding memory (`schedule::topo_order`): set by the
    /// recompute stage where that plans a smaller step.
    pub order_by_memory: bool,
    /// Places whose ops a pass made one (`passes::FuseProjections`: the
    /// projection of q's line also computes those of k's and v's): the
    /// span the ops keep, and the others they stand for, so the report and
    /// `fusec explain` still name every line (`Graph::places`).
    pub merged: Vec<(Span, Vec<Span>)>,
}

/// One awkward size read padded (`passes::pad_dims`): the parameters read
/// with zeros after their last row or column, and how many tensors of the
/// forward pass grew to the padded size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaddedSize {
    pub size: i64,
    pub to: i64,
    pub params: Vec<String>,
    pub widened: usize,
}

impl Graph {
    pub fn new(name: &str) -> Graph {
        Graph {
            name: name.to_string(),
            g: StableDiGraph::new(),
            dims: Vec::new(),
            params: Vec::new(),
            outputs: Vec::new(),
            calls: Vec::new(),
            padded: Vec::new(),
            order_by_memory: false,
            merged: Vec::new(),
        }
    }

    /// The places in the model file an op of span `span` computes: that
    /// span, and those a pass merged into it (`merged`).
    pub fn places(&self, span: Span) -> Vec<Span> {
        let mut out = vec![span];
        for (s, others) in &self.merged {
            if *s == span {
                out.extend(others.iter().copied());
            }
        }
        out
    }

    /// The block calls a place was elaborated in, innermost first.
    pub fn call_stack(&self, span: Span) -> Vec<&CallSite> {
        let mut out = Vec::new();
        let mut at = span.call;
        // Each call's site lies in an earlier call, so this ends; the bound
        // guards a graph built by hand.
        while at > 0 && out.len() <= self.calls.len() {
            let Some(c) = self.calls.get(at as usize - 1) else {
                break;
            };
            out.push(c);
            at = c.site.call;
        }
        out
    }

    pub fn ty(&self, v: Value) -> &TensorType {
        &self.g[v.node].outputs[v.port]
    }

    pub fn node(&self, n: NodeIndex) -> &Node {
        &self.g[n]
    }

    /// Adds a node after checking its inputs with the op's shape rule.
    pub fn add(
        &mut self,
        op: Op,
        inputs: &[Value],
        span: Option<Span>,
        phase: Phase,
    ) -> Result<Vec<Value>, OpError> {
        let types: Vec<TensorType> = inputs.iter().map(|v| self.ty(*v).clone()).collect();
        let outputs = op.infer(&types)?;
        let n = outputs.len();
        let node = self.g.add_node(Node {
            op,
            outputs,
            span,
            phase,
            recompute: false,
            turn: None,
            sub_turn: 0,
        });
        for (slot, v) in inputs.iter().enumerate() {
            self.g.add_edge(
                v.node,
                node,
                Edge {
                    src_port: v.port,
                    dst_slot: slot,
                },
            );
        }
        Ok((0..n).map(|port| Value { node, port }).collect())
    }

    /// Where `n` comes in the step's order among nodes ready with it: its
    /// `turn`, else itself.
    pub fn turn_of(&self, n: NodeIndex) -> NodeIndex {
        self.g[n].turn.unwrap_or(n)
    }

    /// Gives the nodes of `made` the turn of `replaced` (a pass's rewrite).
    pub fn take_turn(&mut self, made: &[Value], replaced: NodeIndex) {
        let turn = self.turn_of(replaced);
        for v in made {
            self.g[v.node].turn = Some(turn);
        }
    }

    /// The node's inputs, in slot order.
    pub fn inputs(&self, n: NodeIndex) -> Vec<Value> {
        let mut ins: Vec<(usize, Value)> = self
            .g
            .edges_directed(n, Direction::Incoming)
            .map(|e| {
                (
                    e.weight().dst_slot,
                    Value {
                        node: e.source(),
                        port: e.weight().src_port,
                    },
                )
            })
            .collect();
        ins.sort_by_key(|(slot, _)| *slot);
        ins.into_iter().map(|(_, v)| v).collect()
    }

    /// Whether node `n` is read, and only by ZeRO stage 3's gathers (the
    /// cast of a piece a gather moves).
    pub fn only_gathered(&self, n: NodeIndex) -> bool {
        let users = self.users(Value { node: n, port: 0 });
        !users.is_empty()
            && users
                .iter()
                .all(|&(u, _)| matches!(self.g[u].op, Op::AllGather(_)))
    }

    /// Whether the step gathers its weights (ZeRO stage 3): every rank's
    /// step does, or none does.
    pub fn gathers_weights(&self) -> bool {
        self.g
            .node_weights()
            .any(|n| matches!(n.op, Op::AllGather(_)))
    }

    /// The ranks a ZeRO step splits each parameter over (its collectives'
    /// group: all the ranks, or a host's with hybrid sharding), where the
    /// step splits anything over its ranks.
    pub fn shard_group(&self) -> Option<u32> {
        self.g.node_weights().find_map(|n| match &n.op {
            Op::AllReduce(a) if a.owners_of.is_some() => Some(a.group),
            Op::AllGather(a) => Some(a.pieces.len() as u32),
            _ => None,
        })
    }

    /// Every (consumer, slot) that reads `v`.
    pub fn users(&self, v: Value) -> Vec<(NodeIndex, usize)> {
        let mut u: Vec<(NodeIndex, usize)> = self
            .g
            .edges_directed(v.node, Direction::Outgoing)
            .filter(|e| e.weight().src_port == v.port)
            .map(|e| (e.target(), e.weight().dst_slot))
            .collect();
        u.sort();
        u
    }

    /// Nodes in a deterministic topological order (`schedule::topo_order`):
    /// among the ready nodes, forward before backward before update, then
    /// the one added first, so the order follows the model file (indices
    /// freed by removed nodes are reused, so within a phase this is only
    /// mostly file order); recomputed nodes just before their readers.
    pub fn topo_order(&self) -> Vec<NodeIndex> {
        super::schedule::topo_order(self)
    }

    pub fn output(&self, role: &Role) -> Option<Value> {
        self.outputs
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, v)| *v)
    }

    pub fn param_count(&self) -> Option<i64> {
        self.params
            .iter()
            .try_fold(0i64, |acc, p| acc.checked_add(p.ty.numel().as_const()?))
    }
}
