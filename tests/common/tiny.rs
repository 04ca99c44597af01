//! The shipped models at tiny sizes (shared with runtime/tests).

/// Every shipped model, with the constants that shrink it to a size the
/// reference interpreter evaluates in milliseconds, and its symbolic sizes.
pub type TinyModel = (
    &'static str,
    Vec<(&'static str, &'static str)>,
    Vec<(&'static str, i64)>,
);

pub fn tiny_models() -> Vec<TinyModel> {
    vec![
        (
            "mlp.dsl",
            vec![("d_in", "6"), ("d_hidden", "8"), ("classes", "5")],
            vec![("B", 3)],
        ),
        (
            "gpt2-block.dsl",
            vec![("d", "16"), ("n_heads", "2")],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "gpt2-small.dsl",
            vec![
                ("vocab", "23"),
                ("ctx", "8"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
            ],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "llama-small.dsl",
            vec![
                ("vocab", "23"),
                ("d", "16"),
                ("n_heads", "4"),
                ("n_kv_heads", "2"),
                ("ffn", "24"),
                ("layers", "2"),
            ],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "bert-encoder.dsl",
            vec![
                ("vocab", "23"),
                ("ctx", "8"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
            ],
            vec![("B", 2), ("T", 5)],
        ),
        (
            // Padded sources and targets of other lengths (S != T), dropout,
            // label smoothing and ignored targets.
            "translator.dsl",
            vec![
                ("vocab", "23"),
                ("ctx", "8"),
                ("d", "16"),
                ("n_heads", "2"),
                ("ffn", "24"),
                ("layers", "2"),
            ],
            vec![("B", 2), ("S", 5), ("T", 4)],
        ),
        (
            // Padded sentences, classification on the first position
            // (x[:, 0, :]) through a tanh pooler, exact GELU, dropout.
            "bert-classifier.dsl",
            vec![
                ("vocab", "23"),
                ("ctx", "8"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
                ("classes", "3"),
            ],
            vec![("B", 2), ("T", 5)],
        ),
        (
            "vit-tiny.dsl",
            vec![
                ("image", "8"),
                ("patch", "4"),
                ("channels", "3"),
                ("d", "16"),
                ("n_heads", "2"),
                ("layers", "2"),
                ("classes", "5"),
            ],
            vec![("B", 2)],
        ),
    ]
}
