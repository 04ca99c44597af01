//! Checks a graph at concrete sizes. What the model file leaves symbolic
//! can only be checked once the sizes are given: BERT's
//! `position_embeddings[0:T]` slices a table of `ctx` = 512 rows, fine for
//! any T up to 512 and a read past the table's end at `--seq 1024`.

use super::Graph;
use crate::diag::Diagnostic;
use crate::ops::Op;
use std::collections::BTreeMap;

/// The first slice that runs past its axis at sizes `dims`, as a
/// diagnostic at its place in the model file.
pub fn check(g: &Graph, dims: &BTreeMap<String, i64>) -> Result<(), Diagnostic> {
    let env = |name: &str| dims.get(name).copied();
    for n in g.topo_order() {
        let Op::Slice(s) = &g.g[n].op else { continue };
        let Some(input) = g.inputs(n).first().copied() else {
            continue;
        };
        let axis = &g.ty(input).shape[s.axis];
        let (Some(size), Some(start), Some(end)) =
            (axis.eval(&env), s.start.eval(&env), s.end.eval(&env))
        else {
            continue;
        };
        if 0 <= start && start <= end && end <= size {
            continue;
        }
        let given: Vec<String> = dims.iter().map(|(k, v)| format!("{k} = {v}")).collect();
        return Err(Diagnostic::new(
            format!(
                "at the sizes given ({}), this slice [{start}:{end}] runs past the end of an axis of {size}",
                given.join(", ")
            ),
            g.g[n].span.unwrap_or_default(),
            format!("reads {} to {} of {size}", s.start, s.end),
        )
        .with_help("give smaller sizes (--seq, --batch, --dim), or make the sliced tensor larger (a `--set` of the constant that sizes it)"));
    }
    Ok(())
}
