//! The verifier, run after every stage and pass: the graph is acyclic, every
//! node's inputs fill its slots, every recorded type is what the op's shape
//! rule gives, the graph's outputs exist, and a recomputed node belongs to
//! the backward pass and is no graph output.

use super::graph::Graph;
use petgraph::visit::EdgeRef;
use petgraph::Direction;

pub fn verify(g: &Graph) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    let order = g.topo_order();
    if order.len() != g.g.node_count() {
        problems.push(format!(
            "the graph has a cycle ({} of {} nodes ordered)",
            order.len(),
            g.g.node_count()
        ));
    }
    for n in g.g.node_indices() {
        let node = &g.g[n];
        let mut slots: Vec<usize> =
            g.g.edges_directed(n, Direction::Incoming)
                .map(|e| e.weight().dst_slot)
                .collect();
        slots.sort();
        if slots.iter().enumerate().any(|(i, &s)| i != s) {
            problems.push(format!(
                "node {} ({}): input slots {:?} are not 0..n",
                n.index(),
                node.op.name(),
                slots
            ));
            continue;
        }
        for e in g.g.edges_directed(n, Direction::Incoming) {
            if e.weight().src_port >= g.g[e.source()].outputs.len() {
                problems.push(format!("node {} reads a missing output port", n.index()));
            }
        }
        let types: Vec<_> = g.inputs(n).into_iter().map(|v| g.ty(v).clone()).collect();
        match node.op.infer(&types) {
            Ok(t) if t == node.outputs => {}
            Ok(t) => problems.push(format!(
                "node {} ({}): recorded types {:?} but the shape rule gives {:?}",
                n.index(),
                node.op.name(),
                node.outputs,
                t
            )),
            Err(e) => problems.push(format!("node {} ({}): {e}", n.index(), node.op.name())),
        }
    }
    for (role, v) in &g.outputs {
        if !g.g.contains_node(v.node) || v.port >= g.g[v.node].outputs.len() {
            problems.push(format!("output {role} refers to a missing value"));
        } else if g.g[v.node].recompute {
            problems.push(format!("output {role} is a recomputed value"));
        }
    }
    for n in g.g.node_indices() {
        let node = &g.g[n];
        if node.recompute && node.phase != super::graph::Phase::Backward {
            problems.push(format!(
                "node {} ({}) is recomputed but in the {} phase",
                n.index(),
                node.op.name(),
                node.phase.name()
            ));
        }
    }
    for p in &g.params {
        if !g.g.contains_node(p.node) {
            problems.push(format!("parameter {} has no node", p.name));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::graph::{Phase, Role};
    use crate::ir::types::{DType, TensorType};
    use crate::ir::{Dim, Graph};
    use crate::ops::{Binary, BinaryKind, Param};

    fn small() -> Graph {
        let mut g = Graph::new("t");
        let ty = TensorType::new(DType::F32, vec![Dim::constant(3)]);
        let p = g
            .add(
                Param {
                    name: "p".into(),
                    ty,
                }
                .into(),
                &[],
                None,
                Phase::Forward,
            )
            .unwrap()[0];
        let s = g
            .add(
                Binary {
                    kind: BinaryKind::Add,
                }
                .into(),
                &[p, p],
                None,
                Phase::Forward,
            )
            .unwrap()[0];
        g.outputs.push((Role::Loss, s));
        g
    }

    #[test]
    fn a_well_formed_graph_passes() {
        assert_eq!(verify(&small()), Ok(()));
    }

    #[test]
    fn a_wrong_recorded_type_is_caught() {
        let mut g = small();
        let n = g.topo_order()[1];
        g.g[n].outputs[0] = TensorType::new(DType::F32, vec![Dim::constant(4)]);
        let err = verify(&g).unwrap_err();
        assert!(err[0].contains("recorded types"), "{err:?}");
    }

    #[test]
    fn a_recomputed_forward_node_is_caught() {
        let mut g = small();
        let n = g.topo_order()[1];
        g.g[n].recompute = true;
        let err = verify(&g).unwrap_err();
        assert!(
            err.iter()
                .any(|e| e.contains("is recomputed but in the forward phase")),
            "{err:?}"
        );
    }

    #[test]
    fn a_missing_input_is_caught() {
        let mut g = small();
        let n = g.topo_order()[1];
        let first =
            g.g.edges_directed(n, Direction::Incoming)
                .find(|e| e.weight().dst_slot == 0)
                .unwrap()
                .id();
        g.g.remove_edge(first);
        let err = verify(&g).unwrap_err();
        assert!(err[0].contains("input slots [1] are not 0..n"), "{err:?}");
    }

    #[test]
    fn a_dangling_output_is_caught() {
        let mut g = small();
        let n = g.topo_order()[1];
        g.g.remove_node(n);
        let err = verify(&g).unwrap_err();
        assert!(
            err.iter()
                .any(|e| e.contains("output loss refers to a missing value")),
            "{err:?}"
        );
    }
}
