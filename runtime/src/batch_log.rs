//! The batches a run fed, kept to be written as one safetensors file
//! (`fusec train --save-data`): each data input under its own name, with a
//! leading axis over the batches in the order they were fed. A PyTorch twin
//! (or anything else) can then train on exactly what fusec trained on,
//! whether the batches were token windows or `--data random`.

use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Values of one input over the batches: token ids stay integers.
enum Values {
    I32(Vec<i32>),
    F32(Vec<f32>),
}

struct Stacked {
    shape: Vec<usize>,
    values: Values,
    batches: usize,
}

#[derive(Default)]
pub struct BatchLog {
    inputs: BTreeMap<String, Stacked>,
    metadata: BTreeMap<String, String>,
}

impl BatchLog {
    /// A note kept in the file's metadata (e.g. how batches map to steps).
    pub fn note(&mut self, key: &str, value: impl ToString) {
        self.metadata.insert(key.to_string(), value.to_string());
    }

    /// One batch of the integer input `name`, shaped `shape`.
    pub fn push_i32(&mut self, name: &str, shape: &[usize], values: &[i32]) -> Result<(), String> {
        let s = self.slot(name, shape, values.len(), || Values::I32(Vec::new()))?;
        match &mut s.values {
            Values::I32(v) => v.extend_from_slice(values),
            Values::F32(_) => return Err(format!("input `{name}` was logged as f32, now as i32")),
        }
        s.batches += 1;
        Ok(())
    }

    /// One batch of the floating-point input `name` (kept as f32, as fusec reads it).
    pub fn push_f32(&mut self, name: &str, shape: &[usize], values: &[f64]) -> Result<(), String> {
        let s = self.slot(name, shape, values.len(), || Values::F32(Vec::new()))?;
        match &mut s.values {
            Values::F32(v) => v.extend(values.iter().map(|&x| x as f32)),
            Values::I32(_) => return Err(format!("input `{name}` was logged as i32, now as f32")),
        }
        s.batches += 1;
        Ok(())
    }

    fn slot(
        &mut self,
        name: &str,
        shape: &[usize],
        len: usize,
        empty: impl FnOnce() -> Values,
    ) -> Result<&mut Stacked, String> {
        if shape.iter().product::<usize>() != len {
            return Err(format!(
                "input `{name}`: {len} values for the shape {shape:?}"
            ));
        }
        let s = self
            .inputs
            .entry(name.to_string())
            .or_insert_with(|| Stacked {
                shape: shape.to_vec(),
                values: empty(),
                batches: 0,
            });
        if s.shape != shape {
            return Err(format!(
                "input `{name}` was logged with the shape {:?}, now {shape:?}",
                s.shape
            ));
        }
        Ok(s)
    }

    /// Writes every input as `[batches, ...shape]`.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let mut bytes = Vec::with_capacity(self.inputs.len());
        for s in self.inputs.values() {
            let b: Vec<u8> = match &s.values {
                Values::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Values::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            bytes.push(b);
        }
        let mut views = Vec::with_capacity(bytes.len());
        for ((name, s), b) in self.inputs.iter().zip(&bytes) {
            let dtype = match s.values {
                Values::I32(_) => Dtype::I32,
                Values::F32(_) => Dtype::F32,
            };
            let shape: Vec<usize> = std::iter::once(s.batches)
                .chain(s.shape.iter().copied())
                .collect();
            let v = TensorView::new(dtype, shape, b).map_err(|e| format!("input `{name}`: {e}"))?;
            views.push((name.clone(), v));
        }
        let mut meta: HashMap<String, String> = self.metadata.clone().into_iter().collect();
        meta.insert("format".into(), "fusec-batches".into());
        let out = safetensors::serialize(views, Some(meta))
            .map_err(|e| format!("cannot encode the batches: {e}"))?;
        crate::cache::write_atomic(path, &out)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    #[test]
    fn batches_stack_on_a_leading_axis() {
        let mut log = BatchLog::default();
        log.push_i32("tokens", &[2, 3], &[1, 2, 3, 4, 5, 6])
            .unwrap();
        log.push_i32("tokens", &[2, 3], &[7, 8, 9, 10, 11, 12])
            .unwrap();
        log.push_f32("x", &[2], &[0.5, -1.25]).unwrap();
        log.note("micro_batches", 2);
        let dir = std::env::temp_dir().join(format!("fusec-batch-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("b.safetensors");
        log.save(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("tokens").unwrap();
        assert_eq!(t.dtype(), Dtype::I32);
        assert_eq!(t.shape(), &[2, 2, 3]);
        let ids: Vec<i32> = t
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(ids, (1..=12).collect::<Vec<_>>());
        let x = st.tensor("x").unwrap();
        assert_eq!((x.dtype(), x.shape()), (Dtype::F32, &[1usize, 2][..]));
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta = meta.metadata().clone().unwrap();
        assert_eq!(meta["micro_batches"], "2");
        assert_eq!(meta["format"], "fusec-batches");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_shape_or_type_change_is_an_error() {
        let mut log = BatchLog::default();
        assert!(log.push_i32("t", &[2], &[1, 2, 3]).is_err());
        log.push_i32("t", &[2], &[1, 2]).unwrap();
        assert!(log.push_i32("t", &[1, 2], &[1, 2]).is_err());
        assert!(log.push_f32("t", &[2], &[1.0, 2.0]).is_err());
    }
}
