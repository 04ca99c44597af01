//! Dead-code elimination: drops every node that no graph output depends
//! on. Parameters stay even when unused (they are part of the model's
//! state), and so do inputs (the runtime feeds them by name). Collectives
//! stay too: every rank must take part in each one, in the same order,
//! even a rank that reads nothing of the result (under ZeRO a rank that
//! owns no piece of a parameter; without clipping nothing else reads its
//! gradient's mean there, and a rank that skipped the reduce left the
//! others waiting for it).

use super::Pass;
use crate::ir::Graph;
use crate::ops::Op;
use petgraph::Direction;
use std::collections::HashSet;

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }
    fn about(&self) -> &'static str {
        "dead-code elimination: remove ops no output depends on"
    }
    fn run(&self, g: &mut Graph) -> usize {
        let mut live: HashSet<_> = g.outputs.iter().map(|(_, v)| v.node).collect();
        live.extend(
            g.g.node_indices()
                .filter(|&n| matches!(g.g[n].op, Op::AllReduce(_))),
        );
        let mut stack: Vec<_> = live.iter().copied().collect();
        while let Some(n) = stack.pop() {
            for m in g.g.neighbors_directed(n, Direction::Incoming) {
                if live.insert(m) {
                    stack.push(m);
                }
            }
        }
        let dead: Vec<_> =
            g.g.node_indices()
                .filter(|n| !live.contains(n) && !matches!(g.g[*n].op, Op::Param(_) | Op::Input(_)))
                .collect();
        for n in &dead {
            g.g.remove_node(*n);
        }
        dead.len()
    }
}
