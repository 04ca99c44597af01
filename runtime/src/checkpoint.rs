//! Checkpoints in safetensors: every parameter under the name the model
//! file gives it, the optimizer state as `<param>.adam_m` / `.adam_v` (or
//! `.momentum`), all f32, and in the metadata the step reached and the
//! model's name. Written to a temporary file and renamed, so a crash never
//! leaves a broken checkpoint; the same file loads in PyTorch with
//! `safetensors.torch.load_file`.

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub model: String,
    /// Steps completed: a resumed run continues with step + 1.
    pub step: u64,
    pub tensors: Vec<Tensor>,
    /// Run state beyond the tensors (the fp16 loss scale, the optimizer's
    /// own step count), as text.
    pub extra: std::collections::BTreeMap<String, String>,
}

#[derive(Debug)]
pub struct CheckpointError(pub String);

impl std::fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CheckpointError {}

impl Checkpoint {
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

pub fn save(path: &Path, ck: &Checkpoint) -> Result<(), CheckpointError> {
    let bytes: Vec<Vec<u8>> = ck
        .tensors
        .iter()
        .map(|t| t.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let mut views = Vec::with_capacity(ck.tensors.len());
    for (t, b) in ck.tensors.iter().zip(&bytes) {
        let v = TensorView::new(Dtype::F32, t.shape.clone(), b)
            .map_err(|e| CheckpointError(format!("tensor {}: {e}", t.name)))?;
        views.push((t.name.clone(), v));
    }
    let mut meta = HashMap::from([
        ("format".to_string(), "fusec".to_string()),
        ("model".to_string(), ck.model.clone()),
        ("step".to_string(), ck.step.to_string()),
    ]);
    for (k, v) in &ck.extra {
        meta.insert(format!("fusec.{k}"), v.clone());
    }
    let out = safetensors::serialize(views, Some(meta))
        .map_err(|e| CheckpointError(format!("cannot encode the checkpoint: {e}")))?;
    crate::cache::write_atomic(path, &out)
        .map_err(|e| CheckpointError(format!("cannot write {}: {e}", path.display())))
}

pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let bytes = std::fs::read(path)
        .map_err(|e| CheckpointError(format!("cannot read checkpoint {}: {e}", path.display())))?;
    let bad = |m: String| {
        CheckpointError(format!(
            "{} is not a usable checkpoint: {m}",
            path.display()
        ))
    };
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let info = meta.metadata().clone().unwrap_or_default();
    let step = info
        .get("step")
        .map(|s| {
            s.parse::<u64>()
                .map_err(|_| bad(format!("step `{s}` is not a number")))
        })
        .transpose()?
        .unwrap_or(0);
    let mut tensors = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    for name in names {
        let v = st.tensor(&name).map_err(|e| bad(e.to_string()))?;
        let data: Vec<f32> = match v.dtype() {
            Dtype::F32 => v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => v
                .data()
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => v
                .data()
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(bad(format!(
                    "tensor {name} is {other:?}; f32, bf16 or f16 expected"
                )))
            }
        };
        tensors.push(Tensor {
            name,
            shape: v.shape().to_vec(),
            data,
        });
    }
    let extra = info
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("fusec.").map(|k| (k.to_string(), v.clone())))
        .collect();
    Ok(Checkpoint {
        model: info.get("model").cloned().unwrap_or_default(),
        step,
        tensors,
        extra,
    })
}

/// Checks a checkpoint against the tensors a run needs (name and shape),
/// naming the first problem and what to do.
pub fn check_against(
    ck: &Checkpoint,
    path: &Path,
    needed: &[(String, Vec<usize>)],
) -> Result<(), CheckpointError> {
    for (name, shape) in needed {
        match ck.get(name) {
            None => {
                return Err(CheckpointError(format!(
                    "{} has no tensor `{name}` (it holds {} tensors, e.g. {}); was it saved from this model?",
                    path.display(),
                    ck.tensors.len(),
                    ck.tensors.iter().take(3).map(|t| t.name.as_str()).collect::<Vec<_>>().join(", ")
                )))
            }
            Some(t) if &t.shape != shape => {
                return Err(CheckpointError(format!(
                    "{}: tensor `{name}` has shape {:?}, the model needs {:?}",
                    path.display(),
                    t.shape,
                    shape
                )))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Weights for a model (`--init-from`): every tensor the model needs,
/// none it lacks a place for, each of its shape; all the problems listed
/// by name at once.
pub fn check_weights(
    ck: &Checkpoint,
    path: &Path,
    needed: &[(String, Vec<usize>)],
) -> Result<(), CheckpointError> {
    let mut problems = Vec::new();
    for (name, shape) in needed {
        match ck.get(name) {
            None => problems.push(format!("missing `{name}` {shape:?}")),
            Some(t) if &t.shape != shape => problems.push(format!(
                "`{name}` has shape {:?}, the model needs {shape:?}",
                t.shape
            )),
            Some(_) => {}
        }
    }
    // A checkpoint's optimizer state rides along (`<param>.adam_m` and
    // the like): fresh state is used, so it is passed over.
    let state_of_a_param = |name: &str| {
        name.rsplit_once('.')
            .is_some_and(|(p, _)| needed.iter().any(|(n, _)| n == p))
    };
    for t in &ck.tensors {
        if !needed.iter().any(|(n, _)| *n == t.name) && !state_of_a_param(&t.name) {
            problems.push(format!(
                "`{}` {:?} is not a parameter of the model",
                t.name, t.shape
            ));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    let shown = problems.len().min(100);
    Err(CheckpointError(format!(
        "{} does not fit the model ({} problem{}):\n  {}{}\n(a name map, --name-map, renames, transposes and drops another program's tensors)",
        path.display(),
        problems.len(),
        if problems.len() == 1 { "" } else { "s" },
        problems[..shown].join("\n  "),
        if problems.len() > shown {
            format!("\n  and {} more", problems.len() - shown)
        } else {
            String::new()
        }
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_clear_errors() {
        let dir = std::env::temp_dir().join(format!("fusec-ck-{}", std::process::id()));
        let p = dir.join("a.safetensors");
        let ck = Checkpoint {
            model: "m".into(),
            step: 12,
            tensors: vec![
                Tensor {
                    name: "w".into(),
                    shape: vec![2, 3],
                    data: vec![1.0, -2.0, 3.5, 0.0, 1e-8, 7.0],
                },
                Tensor {
                    name: "w.adam_m".into(),
                    shape: vec![2, 3],
                    data: vec![0.5; 6],
                },
            ],
            extra: [("loss_scale".to_string(), "1024".to_string())].into(),
        };
        save(&p, &ck).unwrap();
        assert_eq!(load(&p).unwrap(), ck);
        let need = vec![("w".to_string(), vec![2, 3])];
        check_against(&ck, &p, &need).unwrap();
        let e = check_against(&ck, &p, &[("b".to_string(), vec![3])])
            .unwrap_err()
            .0;
        assert!(e.contains("no tensor `b`"), "{e}");
        let e = check_against(&ck, &p, &[("w".to_string(), vec![3, 2])])
            .unwrap_err()
            .0;
        assert!(
            e.contains("has shape [2, 3], the model needs [3, 2]"),
            "{e}"
        );
        // Truncated and missing files are errors, not panics.
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        assert!(load(&p).unwrap_err().0.contains("not a usable checkpoint"));
        assert!(load(&dir.join("none"))
            .unwrap_err()
            .0
            .contains("cannot read"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
