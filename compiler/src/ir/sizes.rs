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

#[cfg(test)]
mod tests {
    use super::*;

    fn graph() -> (Graph, String) {
        let src = "dim B, T\ninput x: f32[B, T, 2]\nparam pos: [4, 2] = normal(0.1)\nlet y = x + pos[0:T]\ntrain {\n    loss = mean(y * y)\n}\n";
        let ast = crate::dsl::parse(src).unwrap();
        let model = crate::elaborate::elaborate(&ast, "pos", &Default::default()).unwrap();
        (model.graph, src.to_string())
    }

    fn sizes(t: i64) -> BTreeMap<String, i64> {
        [("B".to_string(), 2), ("T".to_string(), t)].into()
    }

    #[test]
    fn a_slice_within_its_axis_passes_and_one_past_it_is_placed_in_the_file() {
        let (g, src) = graph();
        assert!(check(&g, &sizes(4)).is_ok());
        assert!(check(&g, &sizes(1)).is_ok());
        let d = check(&g, &sizes(5)).unwrap_err();
        assert!(
            d.message
                .contains("this slice [0:5] runs past the end of an axis of 4"),
            "{}",
            d.message
        );
        let text = d.render("pos.dsl", &src);
        assert!(text.contains("pos.dsl:4:13"), "{text}");
    }
}
