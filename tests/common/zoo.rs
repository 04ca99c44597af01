//! Models nobody chose: a generator of model files drawn from what the
//! language can say, one model a seed. Decoder language models, encoder
//! classifiers over padded batches, encoder-decoders with S != T and
//! models of float features; layer or RMS norms before or after each
//! sublayer, or parallel blocks; GELU (tanh or erf), ReLU, SiLU, tanh,
//! sigmoid or softplus MLPs or gated ones at odd widths; attention at any
//! head dim from 8 to 256 with any grouping, causal or padded, with or
//! without dropout; rotary positions at drawn thetas or learned ones;
//! biases or none; tied or untied heads; each precision; AdamW or SGD;
//! clipping, micro-batches, label smoothing and ignored targets or none.
//!
//! Dropout rates are the constants `p_drop` and `p_attn` (0 where a model
//! has none), which `--set` turns off for a comparison with PyTorch.
//!
//! `FUSEC_ZOO_WRITE=DIR` writes each drawn model to `DIR/zoo-SEED.dsl`
//! with its sizes in a comment, for runs elsewhere (the GPU machine's
//! twin parity sweep).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt::Write;

/// One drawn model.
pub struct Drawn {
    pub seed: u64,
    /// `zoo-SEED`.
    pub name: String,
    /// What was drawn, in one line (for failure messages).
    pub summary: String,
    pub source: String,
    /// Sizes of its symbolic dims.
    pub dims: Vec<(String, i64)>,
}

impl Drawn {
    pub fn dims(&self) -> Vec<(&str, i64)> {
        self.dims.iter().map(|(k, v)| (k.as_str(), *v)).collect()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Family {
    Decoder,
    Classifier,
    EncoderDecoder,
    Features,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Norm {
    Layer,
    Rms,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Placement {
    Pre,
    Post,
    Parallel,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mlp {
    Plain(&'static str),
    SwiGlu,
    /// act(x @ gate) * (x @ up).
    Gated(&'static str),
}

const ACTIVATIONS: &[&str] = &[
    "gelu", "gelu_erf", "relu", "silu", "tanh", "sigmoid", "softplus",
];

/// Everything drawn for one model.
struct Arch {
    family: Family,
    layers: u32,
    d: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    /// Value head dim (the same as head_dim unless drawn apart).
    v_dim: u32,
    ffn: u32,
    norm: Norm,
    eps: &'static str,
    placement: Placement,
    mlp: Mlp,
    bias: bool,
    fused_qkv: bool,
    rope: Option<&'static str>,
    tied: bool,
    vocab: u32,
    classes: u32,
    attn_dropout: &'static str,
    dropout: &'static str,
    smoothing: &'static str,
    precision: &'static str,
    optimizer: String,
    clip: Option<&'static str>,
    micro: u32,
}

fn pick<T: Copy>(rng: &mut ChaCha8Rng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

/// Head dims: mostly the small and odd ones a tiny model affords, at times
/// a wide one up to 256.
fn head_dim(rng: &mut ChaCha8Rng) -> u32 {
    if rng.random_bool(0.2) {
        rng.random_range(64..=256)
    } else {
        rng.random_range(8..=40)
    }
}

fn draw_arch(rng: &mut ChaCha8Rng) -> Arch {
    let family = pick(
        rng,
        &[
            Family::Decoder,
            Family::Decoder,
            Family::Decoder,
            Family::Classifier,
            Family::Classifier,
            Family::EncoderDecoder,
            Family::EncoderDecoder,
            Family::Features,
        ],
    );
    let kv_heads = rng.random_range(1..=2);
    let heads = kv_heads * pick(rng, &[1, 1, 2, 3, 4]);
    let head_dim = head_dim(rng);
    let v_dim = if rng.random_bool(0.15) {
        rng.random_range(8..=48)
    } else {
        head_dim
    };
    let placement = pick(
        rng,
        &[
            Placement::Pre,
            Placement::Pre,
            Placement::Post,
            Placement::Parallel,
        ],
    );
    let mlp = match rng.random_range(0..4) {
        0 => Mlp::SwiGlu,
        1 => Mlp::Gated(pick(rng, &["gelu", "gelu_erf", "relu", "sigmoid"])),
        _ => Mlp::Plain(pick(rng, ACTIVATIONS)),
    };
    let rope = (family != Family::Features && head_dim.is_multiple_of(2) && rng.random_bool(0.5))
        .then(|| pick(rng, &["10000", "500000", "1000000", "77"]));
    let optimizer = if rng.random_bool(0.75) {
        format!(
            "adamw(lr = {}, betas = ({}, {}), eps = {}, weight_decay = {})",
            pick(rng, &["1e-3", "3e-4", "2e-3"]),
            pick(rng, &["0.9", "0.8"]),
            pick(rng, &["0.999", "0.95", "0.98"]),
            pick(rng, &["1e-8", "1e-6"]),
            pick(rng, &["0.0", "0.01", "0.1"]),
        )
    } else {
        format!(
            "sgd(lr = {}, momentum = {}, weight_decay = {})",
            pick(rng, &["0.1", "0.01"]),
            pick(rng, &["0", "0.9"]),
            pick(rng, &["0", "1e-4"]),
        )
    };
    let dropping = rng.random_bool(0.3);
    Arch {
        family,
        layers: rng.random_range(1..=2),
        d: rng.random_range(8..=48),
        heads,
        kv_heads,
        head_dim,
        v_dim,
        ffn: rng.random_range(5..=72),
        norm: pick(rng, &[Norm::Layer, Norm::Rms]),
        eps: pick(rng, &["1e-5", "1e-6", "1e-12"]),
        placement,
        mlp,
        bias: rng.random_bool(0.5),
        fused_qkv: rng.random_bool(0.3),
        rope,
        tied: family != Family::Classifier && family != Family::Features && rng.random_bool(0.5),
        vocab: rng.random_range(11..=97),
        classes: rng.random_range(2..=9),
        attn_dropout: if dropping {
            pick(rng, &["0.1", "0.3"])
        } else {
            "0"
        },
        dropout: if dropping && rng.random_bool(0.5) {
            "0.1"
        } else {
            "0"
        },
        smoothing: pick(rng, &["0", "0", "0.1"]),
        precision: pick(rng, &["f32", "f32", "bf16", "bf16", "f16"]),
        optimizer,
        clip: rng.random_bool(0.4).then(|| pick(rng, &["0.5", "1.0"])),
        micro: pick(rng, &[1, 1, 1, 2]),
    }
}

impl Arch {
    /// `linear(x, w, b)` or `x @ w`, declaring the parameters in `params`.
    fn linear(&self, params: &mut String, x: &str, w: &str, fan_in: &str, out: &str) -> String {
        let _ = writeln!(params, "    param {w}_w: [{fan_in}, {out}] = normal(0.3)");
        if self.bias {
            let _ = writeln!(params, "    param {w}_b: [{out}] = normal(0.1)");
            format!("linear({x}, {w}_w, {w}_b)")
        } else {
            format!("{x} @ {w}_w")
        }
    }

    fn norm(&self, params: &mut String, x: &str, name: &str) -> String {
        let _ = writeln!(params, "    param {name}_w: [d] = ones");
        match self.norm {
            Norm::Layer => {
                let _ = writeln!(params, "    param {name}_b: [d] = zeros");
                format!("layernorm({x}, {name}_w, {name}_b, eps = {})", self.eps)
            }
            Norm::Rms => format!("rmsnorm({x}, {name}_w, eps = {})", self.eps),
        }
    }

    fn dropout(&self, x: String) -> String {
        if self.dropout == "0" {
            x
        } else {
            format!("dropout({x}, p_drop)")
        }
    }

    /// The attention block `name(x[, memory][, lengths])`: self-attention,
    /// or cross-attention over `memory` when `cross`.
    fn attention_block(
        &self,
        out: &mut String,
        name: &str,
        cross: bool,
        causal: bool,
        lengths: Option<&str>,
    ) {
        let mut p = String::new();
        let mut lets = String::new();
        let (q_w, kv_w, v_w) = ("n_heads * head_dim", "n_kv * head_dim", "n_kv * v_dim");
        let kv_src = if cross { "memory" } else { "x" };
        let (q, k, v) = if self.fused_qkv && !cross {
            let all = self.linear(&mut p, "x", "qkv", "d", &format!("{q_w} + {kv_w} + {v_w}"));
            let _ = writeln!(
                lets,
                "    let q0, k0, v0 = split({all}, [{q_w}, {kv_w}, {v_w}])"
            );
            ("q0".to_string(), "k0".to_string(), "v0".to_string())
        } else {
            (
                self.linear(&mut p, "x", "q", "d", q_w),
                self.linear(&mut p, kv_src, "k", "d", kv_w),
                self.linear(&mut p, kv_src, "v", "d", v_w),
            )
        };
        let rope = |t: String| match self.rope {
            Some(theta) if !cross => format!("rope({t}, theta = {theta})"),
            _ => t,
        };
        let o = self.linear(&mut p, "merge_heads(a)", "o", "n_heads * v_dim", "d");
        let mut args = String::from("x");
        if cross {
            args.push_str(", memory");
        }
        let mut opts = String::new();
        if causal {
            opts.push_str(", causal = true");
        }
        if let Some(l) = lengths {
            let _ = write!(args, ", {l}");
            let _ = write!(opts, ", lengths = {l}");
        }
        if self.attn_dropout != "0" {
            opts.push_str(", dropout = p_attn");
        }
        let _ = writeln!(
            out,
            "block {name}({args}) {{\n{p}{lets}    let a = attention({}, {}, heads({v}, n_kv){opts})\n    return {}\n}}\n",
            rope(format!("heads({q}, n_heads)")),
            rope(format!("heads({k}, n_kv)")),
            self.dropout(o)
        );
    }

    fn mlp_block(&self, out: &mut String) {
        let mut p = String::new();
        let body = match self.mlp {
            Mlp::Plain(act) => {
                let h = self.linear(&mut p, "x", "fc1", "d", "ffn");
                format!("{act}({h})")
            }
            Mlp::SwiGlu => {
                let g = self.linear(&mut p, "x", "gate", "d", "ffn");
                let u = self.linear(&mut p, "x", "up", "d", "ffn");
                format!("swiglu({g}, {u})")
            }
            Mlp::Gated(act) => {
                let g = self.linear(&mut p, "x", "gate", "d", "ffn");
                let u = self.linear(&mut p, "x", "up", "d", "ffn");
                format!("{act}({g}) * ({u})")
            }
        };
        let down = self.linear(&mut p, "h", "fc2", "ffn", "d");
        let _ = writeln!(
            out,
            "block mlp(x) {{\n{p}    let h = {}\n    return {}\n}}\n",
            self.dropout(body),
            self.dropout(down)
        );
    }

    /// Layer block `name(x{extra})`: self-attention `sa(h)` (and
    /// cross-attention `ca(h)`), then the MLP, with norms placed as drawn.
    fn layer_block(
        &self,
        out: &mut String,
        name: &str,
        extra: &str,
        sa: &dyn Fn(&str) -> String,
        ca: Option<&dyn Fn(&str) -> String>,
    ) {
        let mut p = String::new();
        let mut body = String::new();
        match self.placement {
            Placement::Pre => {
                let n1 = self.norm(&mut p, "x", "n1");
                let _ = writeln!(body, "    let x = x + {}", sa(&n1));
                if let Some(ca) = ca {
                    let nc = self.norm(&mut p, "x", "nc");
                    let _ = writeln!(body, "    let x = x + {}", ca(&nc));
                }
                let n2 = self.norm(&mut p, "x", "n2");
                let _ = writeln!(body, "    return x + mlp({n2})");
            }
            Placement::Post => {
                let n1 = self.norm(&mut p, &format!("x + {}", sa("x")), "n1");
                let _ = writeln!(body, "    let x = {n1}");
                if let Some(ca) = ca {
                    let nc = self.norm(&mut p, &format!("x + {}", ca("x")), "nc");
                    let _ = writeln!(body, "    let x = {nc}");
                }
                let n2 = self.norm(&mut p, "x + mlp(x)", "n2");
                let _ = writeln!(body, "    return {n2}");
            }
            Placement::Parallel => {
                if let Some(ca) = ca {
                    let nc = self.norm(&mut p, "x", "nc");
                    let _ = writeln!(body, "    let x = x + {}", ca(&nc));
                }
                let n1 = self.norm(&mut p, "x", "n1");
                let _ = writeln!(body, "    let h = {n1}");
                let _ = writeln!(body, "    return x + {} + mlp(h)", sa("h"));
            }
        }
        let _ = writeln!(out, "block {name}(x{extra}) {{\n{p}{body}}}\n");
    }

    fn source(&self, seed: u64) -> (String, String) {
        let mut s = String::new();
        let summary = format!(
            "{:?}, {} layer(s), d {}, heads {}/{} of dim {} (v {}), {:?} {:?} eps {}, {:?} ffn {}, bias {}, fused qkv {}, rope {:?}, tied {}, vocab {}, dropout {}/{}, smoothing {}, {}, {}, clip {:?}, micro-batches {}",
            self.family, self.layers, self.d, self.heads, self.kv_heads, self.head_dim, self.v_dim,
            self.norm, self.placement, self.eps, self.mlp, self.ffn, self.bias, self.fused_qkv, self.rope,
            self.tied, self.vocab, self.attn_dropout, self.dropout, self.smoothing, self.precision,
            self.optimizer, self.clip, self.micro
        );
        let _ = writeln!(s, "# zoo-{seed}: {summary}\n");
        for (k, v) in [
            ("vocab", self.vocab),
            ("ctx", 16),
            ("classes", self.classes),
            ("d", self.d),
            ("n_heads", self.heads),
            ("n_kv", self.kv_heads),
            ("head_dim", self.head_dim),
            ("v_dim", self.v_dim),
            ("ffn", self.ffn),
            ("layers", self.layers),
        ] {
            let _ = writeln!(s, "const {k} = {v}");
        }
        // Dropout rates as constants, so that `--set p_drop=0 --set
        // p_attn=0` turns dropout off (the PyTorch twin draws other masks).
        let _ = writeln!(
            s,
            "const p_drop = {}\nconst p_attn = {}",
            self.dropout, self.attn_dropout
        );
        let positions = |s: &mut String, name: &str, len: &str| -> String {
            if self.rope.is_some() {
                String::new()
            } else {
                let _ = writeln!(s, "param {name}: [ctx, d] = normal(0.3)");
                format!(" + {name}[0:{len}]")
            }
        };
        let ce = |targets: &str, ignore: bool| {
            let mut o = String::new();
            if ignore {
                o.push_str(", ignore_index = 0");
            }
            if self.smoothing != "0" {
                let _ = write!(o, ", label_smoothing = {}", self.smoothing);
            }
            format!("cross_entropy(logits, {targets}{o})")
        };
        // A norm at the top level: its parameters declared there.
        let top_norm = |s: &mut String, x: &str, name: &str| -> String {
            let mut p = String::new();
            let y = self.norm(&mut p, x, name);
            s.push_str(&p.replace("    param", "param"));
            y
        };
        let final_norm = |s: &mut String, x: &str| top_norm(s, x, "final");
        let head = |s: &mut String, h: &str| -> String {
            if self.tied {
                format!("{h} @ transpose(emb)")
            } else {
                let _ = writeln!(s, "param head: [d, vocab] = normal(0.3)");
                format!("{h} @ head")
            }
        };
        let loss = match self.family {
            Family::Decoder => {
                s.push_str("\ndim B, T\ninput tokens: i32[B, T]\ninput targets: i32[B, T]\n\n");
                self.attention_block(&mut s, "self_attn", false, true, None);
                self.mlp_block(&mut s);
                self.layer_block(&mut s, "layer", "", &|h| format!("self_attn({h})"), None);
                s.push_str("param emb: [vocab, d] = normal(0.3)\n");
                let pos = positions(&mut s, "pos", "T");
                let x = final_norm(&mut s, "repeat layers layer(x0)");
                let logits = head(&mut s, "h");
                let _ = writeln!(
                    s,
                    "let x0 = embedding(emb, tokens){pos}\nlet h = {x}\nlet logits = {logits}"
                );
                ce("targets", false)
            }
            Family::Classifier => {
                s.push_str("\ndim B, T\ninput tokens: i32[B, T]\ninput lengths: i32[B]\ninput labels: i32[B]\n\n");
                self.attention_block(&mut s, "self_attn", false, false, Some("lengths"));
                self.mlp_block(&mut s);
                self.layer_block(
                    &mut s,
                    "layer",
                    ", lengths",
                    &|h| format!("self_attn({h}, lengths)"),
                    None,
                );
                s.push_str("param emb: [vocab, d] = normal(0.3)\nparam cls_w: [d, classes] = normal(0.3)\nparam cls_b: [classes] = zeros\n");
                let pos = positions(&mut s, "pos", "T");
                let x = final_norm(&mut s, "repeat layers layer(x0, lengths)");
                let pooled = if self.bias {
                    "h[:, 0, :]"
                } else {
                    "mean(h, axis = 1)"
                };
                let _ = writeln!(
                    s,
                    "let x0 = embedding(emb, tokens){pos}\nlet h = {x}\nlet logits = linear(tanh({pooled}), cls_w, cls_b)"
                );
                ce("labels", false)
            }
            Family::EncoderDecoder => {
                s.push_str("\ndim B, S, T\ninput src: i32[B, S]\ninput src_len: i32[B]\ninput tgt_in: i32[B, T]\ninput tgt_len: i32[B]\ninput tgt_out: i32[B, T]\n\n");
                self.attention_block(&mut s, "enc_attn", false, false, Some("src_len"));
                self.attention_block(&mut s, "self_attn", false, true, Some("tgt_len"));
                self.attention_block(&mut s, "cross_attn", true, false, Some("src_len"));
                self.mlp_block(&mut s);
                self.layer_block(
                    &mut s,
                    "enc_layer",
                    ", src_len",
                    &|h| format!("enc_attn({h}, src_len)"),
                    None,
                );
                self.layer_block(
                    &mut s,
                    "dec_layer",
                    ", memory, tgt_len, src_len",
                    &|h| format!("self_attn({h}, tgt_len)"),
                    Some(&|h| format!("cross_attn({h}, memory, src_len)")),
                );
                s.push_str("param emb: [vocab, d] = normal(0.3)\n");
                let src_pos = positions(&mut s, "src_pos", "S");
                let tgt_pos = positions(&mut s, "tgt_pos", "T");
                let mem = top_norm(&mut s, "repeat layers enc_layer(x0, src_len)", "enc_final");
                let h = final_norm(
                    &mut s,
                    "repeat layers dec_layer(y0, memory, tgt_len, src_len)",
                );
                let logits = head(&mut s, "h");
                let _ = writeln!(
                    s,
                    "let x0 = embedding(emb, src){src_pos}\nlet memory = {mem}\nlet y0 = embedding(emb, tgt_in){tgt_pos}\nlet h = {h}\nlet logits = {logits}"
                );
                ce("tgt_out", true)
            }
            Family::Features => {
                s.push_str("\nconst d_in = 7\ndim B, T\ninput x: f32[B, T, d_in]\ninput labels: i32[B]\n\n");
                self.attention_block(&mut s, "self_attn", false, false, None);
                self.mlp_block(&mut s);
                self.layer_block(&mut s, "layer", "", &|h| format!("self_attn({h})"), None);
                s.push_str("param proj: [d_in, d] = normal(0.3)\nparam cls_w: [d, classes] = normal(0.3)\n");
                let x = final_norm(&mut s, "repeat layers layer(x @ proj)");
                let _ = writeln!(s, "let h = {x}\nlet logits = mean(h, axis = 1) @ cls_w");
                ce("labels", false)
            }
        };
        let _ = writeln!(
            s,
            "\ntrain {{\n    loss = {loss}\n    optimizer = {}",
            self.optimizer
        );
        if let Some(c) = self.clip {
            let _ = writeln!(s, "    clip_grad_norm = {c}");
        }
        let _ = writeln!(s, "    precision = {}", self.precision);
        if self.micro > 1 {
            let _ = writeln!(s, "    micro_batches = {}", self.micro);
        }
        s.push_str("}\n");
        (s, summary)
    }
}

/// The model of `seed`.
pub fn draw(seed: u64) -> Drawn {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x005e_ed0f_2005);
    let arch = draw_arch(&mut rng);
    let (source, summary) = arch.source(seed);
    let batch = arch.micro * rng.random_range(1..=2);
    let t = rng.random_range(2..=9);
    let mut dims = vec![("B".to_string(), batch as i64), ("T".to_string(), t)];
    if arch.family == Family::EncoderDecoder {
        // S != T: the source a few tokens longer or shorter.
        let s = if rng.random_bool(0.5) {
            t + rng.random_range(1..=4)
        } else {
            (t - 1).max(1)
        };
        dims.push(("S".to_string(), s));
    }
    let drawn = Drawn {
        seed,
        name: format!("zoo-{seed}"),
        summary,
        source,
        dims,
    };
    if let Some(dir) = std::env::var_os("FUSEC_ZOO_WRITE") {
        let dir = std::path::PathBuf::from(dir);
        let _ = std::fs::create_dir_all(&dir);
        let sizes: Vec<String> = drawn.dims.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let text = format!("# sizes: {}\n{}", sizes.join(" "), drawn.source);
        let _ = std::fs::write(dir.join(format!("{}.dsl", drawn.name)), text);
    }
    drawn
}

/// Model files written by `FUSEC_ZOO_WRITE` (their first line gives the
/// sizes), named in `FUSEC_ZOO_FILES` (comma-separated): checked in place
/// of drawn models, to study one after changing it by hand.
pub fn files() -> Option<Vec<Drawn>> {
    let v = std::env::var("FUSEC_ZOO_FILES").ok()?;
    Some(
        v.split(',')
            .map(|f| {
                let text = std::fs::read_to_string(f.trim()).unwrap_or_else(|e| panic!("{f}: {e}"));
                let sizes = text
                    .lines()
                    .next()
                    .and_then(|l| l.strip_prefix("# sizes: "))
                    .unwrap_or_else(|| panic!("{f}: the first line should be `# sizes: B=2 T=3`"));
                let dims = sizes
                    .split_whitespace()
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').expect("NAME=N");
                        (k.to_string(), v.parse().expect("a size"))
                    })
                    .collect();
                Drawn {
                    seed: 0,
                    name: std::path::Path::new(f.trim())
                        .file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    summary: f.trim().to_string(),
                    source: text,
                    dims,
                }
            })
            .collect(),
    )
}

/// The seeds a run draws: `FUSEC_ZOO_SEEDS` as `N` (seeds 0..N), `A..B`,
/// or a comma-separated list; else 0..`default`.
pub fn seeds(default: u64) -> Vec<u64> {
    let Ok(v) = std::env::var("FUSEC_ZOO_SEEDS") else {
        return (0..default).collect();
    };
    let v = v.trim();
    if let Some((a, b)) = v.split_once("..") {
        let a: u64 = a.parse().expect("FUSEC_ZOO_SEEDS: A..B");
        let b: u64 = b.parse().expect("FUSEC_ZOO_SEEDS: A..B");
        return (a..b).collect();
    }
    if v.contains(',') {
        return v
            .split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .expect("FUSEC_ZOO_SEEDS: a list of numbers")
            })
            .collect();
    }
    (0..v.parse().expect("FUSEC_ZOO_SEEDS: a number of seeds")).collect()
}
