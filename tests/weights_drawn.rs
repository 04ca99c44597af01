//! Initial weights drawn ahead (`draw_params`, while a GPU opens) are the
//! ones `init_params` writes, as the parameters' f32 stores them.

mod common;

use fusec::backend::{draw_params, init_params, init_params_drawn, Backend, Cpu};
use fusec_compiler::interp::Precision;

#[test]
fn weights_drawn_ahead_are_the_initial_weights() {
    let c = common::model(
        "llama-small.dsl",
        &[
            ("vocab", "97"),
            ("d", "32"),
            ("n_heads", "2"),
            ("n_kv_heads", "1"),
            ("ffn", "40"),
            ("layers", "2"),
        ],
    );
    let g = &c.optimized;
    let dims: std::collections::BTreeMap<String, i64> =
        [("B".to_string(), 2), ("T".to_string(), 5)].into();
    let mut plain = Cpu::new(g, &dims, Precision::AsStored).unwrap();
    let mut ahead = Cpu::new(g, &dims, Precision::AsStored).unwrap();
    init_params(&mut plain, 11).unwrap();
    let drawn = draw_params(g, 11).expect("constant parameter sizes");
    assert_eq!(drawn.len(), g.params.len());
    init_params_drawn(&mut ahead, drawn).unwrap();
    let mut names: Vec<String> = g.params.iter().map(|p| p.name.clone()).collect();
    names.extend(plain.state_names());
    for name in names {
        let (a, b) = (plain.get(&name).unwrap(), ahead.get(&name).unwrap());
        assert_eq!(a.len(), b.len(), "{name}");
        assert!(
            a.iter().zip(&b).all(|(x, y)| *x as f32 == *y as f32),
            "{name}: the values drawn ahead differ"
        );
    }
}
