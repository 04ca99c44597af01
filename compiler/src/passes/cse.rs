//! Common-subexpression elimination: two nodes with the same op (and
//! attributes) reading the same values compute the same thing; the later
//! one is replaced by the earlier. Autodiff produces many of these (the two
//! gradients of `x * x`, repeated transposes of one weight).

use super::{replace_uses, Pass};
use crate::ir::{Graph, Value};
use std::collections::HashMap;

pub struct Cse;

impl Pass for Cse {
    fn name(&self) -> &'static str {
        "cse"
    }
    fn about(&self) -> &'static str {
        "common-subexpression elimination: merge ops that compute the same value"
    }
    fn run(&self, g: &mut Graph) -> usize {
        let mut seen: HashMap<(String, Vec<Value>), petgraph::stable_graph::NodeIndex> =
            HashMap::new();
        let mut merged = 0;
        // Each output of the step keeps a node (and so a buffer) of its own:
        // two parameters whose gradients are equal (key biases' zeros) still
        // have a gradient each for the optimizer, the buckets and ZeRO's
        // pieces to address.
        let outputs: std::collections::HashSet<_> = g.outputs.iter().map(|(_, v)| v.node).collect();
        for n in g.topo_order() {
            let node = &g.g[n];
            // ZeRO stage 3 gathers a parameter again for the backward pass
            // on purpose, and casts the piece it gathers again: the forward
            // pass's copies are freed in between.
            if node.op.is_source()
                || matches!(node.op, crate::ops::Op::AllGather(_))
                || g.only_gathered(n)
            {
                continue;
            }
            // Debug output holds every attribute exactly (floats round-trip).
            let key = (format!("{:?}", node.op), g.inputs(n));
            match seen.get(&key) {
                Some(&first) if !(outputs.contains(&first) && outputs.contains(&n)) => {
                    for port in 0..g.g[n].outputs.len() {
                        replace_uses(g, Value { node: n, port }, Value { node: first, port });
                    }
                    g.g.remove_node(n);
                    merged += 1;
                }
                Some(_) => {}
                None => {
                    seen.insert(key, n);
                }
            }
        }
        merged
    }
}
