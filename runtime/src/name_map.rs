//! Name maps: how another program's checkpoint (a Hugging Face
//! `save_pretrained` safetensors file) becomes a model file's parameters.
//! A map is a small JSON file:
//!
//! ```json
//! {
//!   "about": "Hugging Face GPT-2 into dsl-examples/gpt2-small.dsl",
//!   "rename": [["transformer.h.{i}.ln_1.weight", "h.{i}.ln_1_w"]],
//!   "transpose": ["layer.{i}.attention_block.wq"],
//!   "ignore": ["lm_head.weight"]
//! }
//! ```
//!
//! A name is renamed by the first rule whose pattern it matches; `{x}`
//! stands for any run of characters without a dot, and the same `{x}` in
//! the new name takes what it matched. `transpose` lists parameters (by
//! their new names) stored the other way round (PyTorch's `nn.Linear`
//! keeps `[out, in]`; a model file's `x @ w` takes `[in, out]`). `ignore`
//! drops tensors the model has no use for (a tied output head, buffers).
//! A name no rule matches keeps its name, so the check that follows lists
//! it as a tensor the model does not have.

use crate::checkpoint::{Checkpoint, CheckpointError, Tensor};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameMap {
    #[serde(default)]
    pub about: Option<String>,
    #[serde(default)]
    pub rename: Vec<(String, String)>,
    #[serde(default)]
    pub transpose: Vec<String>,
    #[serde(default)]
    pub ignore: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Lit(String),
    Var(String),
}

/// `pattern` as literal runs and `{name}` placeholders.
fn parse(pattern: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut rest = pattern;
    while !rest.is_empty() {
        match rest.find('{') {
            Some(0) => {
                let end = rest
                    .find('}')
                    .ok_or_else(|| format!("`{pattern}`: a `{{` without its `}}`"))?;
                let name = &rest[1..end];
                if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || c == '_') {
                    return Err(format!(
                        "`{pattern}`: `{{{name}}}` is not a placeholder name"
                    ));
                }
                if matches!(parts.last(), Some(Part::Var(_))) {
                    return Err(format!("`{pattern}`: two placeholders in a row"));
                }
                parts.push(Part::Var(name.to_string()));
                rest = &rest[end + 1..];
            }
            Some(i) => {
                parts.push(Part::Lit(rest[..i].to_string()));
                rest = &rest[i..];
            }
            None => {
                parts.push(Part::Lit(rest.to_string()));
                rest = "";
            }
        }
    }
    Ok(parts)
}

/// Whether `s` matches `parts`, with what each placeholder took.
fn matches(parts: &[Part], s: &str, caps: &mut HashMap<String, String>) -> bool {
    match parts.first() {
        None => s.is_empty(),
        Some(Part::Lit(l)) => s
            .strip_prefix(l.as_str())
            .is_some_and(|r| matches(&parts[1..], r, caps)),
        Some(Part::Var(v)) => {
            for (end, c) in s.char_indices().skip(1).chain([(s.len(), ' ')]) {
                let _ = c;
                let took = &s[..end];
                if took.contains('.') {
                    break;
                }
                if caps.get(v).is_some_and(|prev| prev != took) {
                    continue;
                }
                let fresh = !caps.contains_key(v);
                caps.insert(v.clone(), took.to_string());
                if matches(&parts[1..], &s[end..], caps) {
                    return true;
                }
                if fresh {
                    caps.remove(v);
                }
            }
            false
        }
    }
}

fn fill(parts: &[Part], caps: &HashMap<String, String>) -> Result<String, String> {
    parts
        .iter()
        .map(|p| match p {
            Part::Lit(l) => Ok(l.clone()),
            Part::Var(v) => caps
                .get(v)
                .cloned()
                .ok_or_else(|| format!("`{{{v}}}` is not in the pattern it renames")),
        })
        .collect()
}

/// Reads and checks a map file.
pub fn load(path: &Path) -> Result<NameMap, CheckpointError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        CheckpointError(format!("cannot read the name map {}: {e}", path.display()))
    })?;
    let map: NameMap = serde_json::from_str(&text).map_err(|e| {
        CheckpointError(format!(
            "{} is not a name map: {e} (expected {{\"rename\": [[from, to], ...], \"transpose\": [...], \"ignore\": [...]}})",
            path.display()
        ))
    })?;
    let bad = |m: String| CheckpointError(format!("{}: {m}", path.display()));
    for (from, to) in &map.rename {
        let (f, t) = (parse(from).map_err(bad)?, parse(to).map_err(bad)?);
        for p in &t {
            if let Part::Var(v) = p {
                if !f.contains(&Part::Var(v.clone())) {
                    return Err(bad(format!(
                        "rename `{from}` -> `{to}`: `{{{v}}}` is not in `{from}`"
                    )));
                }
            }
        }
    }
    for p in map.transpose.iter().chain(&map.ignore) {
        parse(p).map_err(bad)?;
    }
    Ok(map)
}

impl NameMap {
    /// `ck` with its tensors renamed, transposed and dropped as the map says.
    pub fn apply(&self, ck: Checkpoint) -> Result<Checkpoint, CheckpointError> {
        let compile = |p: &String| parse(p).map_err(CheckpointError);
        let rules: Vec<(Vec<Part>, Vec<Part>)> = self
            .rename
            .iter()
            .map(|(f, t)| Ok((compile(f)?, compile(t)?)))
            .collect::<Result<_, CheckpointError>>()?;
        let ignore: Vec<Vec<Part>> = self.ignore.iter().map(compile).collect::<Result<_, _>>()?;
        let transpose: Vec<Vec<Part>> = self
            .transpose
            .iter()
            .map(compile)
            .collect::<Result<_, _>>()?;
        let hit =
            |ps: &[Vec<Part>], name: &str| ps.iter().any(|p| matches(p, name, &mut HashMap::new()));
        let mut out: BTreeMap<String, (String, Tensor)> = BTreeMap::new();
        for t in ck.tensors {
            if hit(&ignore, &t.name) {
                continue;
            }
            let mut name = t.name.clone();
            for (from, to) in &rules {
                let mut caps = HashMap::new();
                if matches(from, &t.name, &mut caps) {
                    name = fill(to, &caps).map_err(CheckpointError)?;
                    break;
                }
            }
            let mut t = Tensor {
                name: name.clone(),
                ..t
            };
            if hit(&transpose, &name) {
                let [r, c] = t.shape[..] else {
                    return Err(CheckpointError(format!(
                        "`{name}` has shape {:?}: only a matrix can be transposed",
                        t.shape
                    )));
                };
                let mut data = vec![0.0f32; t.data.len()];
                for i in 0..r {
                    for j in 0..c {
                        data[j * r + i] = t.data[i * c + j];
                    }
                }
                t.data = data;
                t.shape = vec![c, r];
            }
            let from = t.name.clone();
            if let Some((other, _)) = out.insert(name.clone(), (from.clone(), t)) {
                return Err(CheckpointError(format!(
                    "both `{other}` and another tensor map to `{name}`: check the map's rules"
                )));
            }
        }
        Ok(Checkpoint {
            tensors: out.into_values().map(|(_, t)| t).collect(),
            ..ck
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        Tensor {
            name: name.into(),
            shape,
            data,
        }
    }

    #[test]
    fn rules_rename_transpose_and_drop() {
        let map = NameMap {
            rename: vec![
                (
                    "model.layers.{i}.self_attn.q_proj.weight".into(),
                    "layer.{i}.wq".into(),
                ),
                ("model.norm.weight".into(), "norm".into()),
            ],
            transpose: vec!["layer.{i}.wq".into()],
            ignore: vec!["lm_head.weight".into()],
            ..Default::default()
        };
        let ck = Checkpoint {
            model: "m".into(),
            step: 0,
            tensors: vec![
                t(
                    "model.layers.12.self_attn.q_proj.weight",
                    vec![2, 3],
                    vec![1., 2., 3., 4., 5., 6.],
                ),
                t("model.norm.weight", vec![2], vec![7., 8.]),
                t("lm_head.weight", vec![1], vec![0.]),
                t("other", vec![1], vec![9.]),
            ],
            extra: Default::default(),
        };
        let out = map.apply(ck).unwrap();
        let names: Vec<&str> = out.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["layer.12.wq", "norm", "other"]);
        assert_eq!(out.tensors[0].shape, vec![3, 2]);
        assert_eq!(out.tensors[0].data, vec![1., 4., 2., 5., 3., 6.]);
    }

    #[test]
    fn placeholders_match_one_name_segment_and_must_agree() {
        let p = parse("h.{i}.mlp.{i}").unwrap();
        assert!(matches(&p, "h.3.mlp.3", &mut HashMap::new()));
        assert!(!matches(&p, "h.3.mlp.4", &mut HashMap::new()));
        assert!(!matches(&p, "h.3.x.mlp.3", &mut HashMap::new()));
        assert!(parse("a.{").is_err());
        assert!(parse("a.{i}{j}").is_err());
    }
}
