//! What flows along an edge: a tensor's dtype, shape and layout.

use super::dim::Dim;
use std::fmt;

pub use crate::dtype::DType;

pub type Shape = Vec<Dim>;

/// Order in which the axes are laid out in memory, outermost first. The
/// identity permutation is the ordinary row-major layout; the layout pass
/// (later in the pipeline) may choose others and turn transposes into views.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Layout(pub Vec<usize>);

impl Layout {
    pub fn row_major(rank: usize) -> Layout {
        Layout((0..rank).collect())
    }
    pub fn is_row_major(&self) -> bool {
        self.0.iter().enumerate().all(|(i, &a)| i == a)
    }
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
    pub layout: Layout,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Shape) -> TensorType {
        let layout = Layout::row_major(shape.len());
        TensorType {
            dtype,
            shape,
            layout,
        }
    }
    pub fn scalar(dtype: DType) -> TensorType {
        TensorType::new(dtype, Vec::new())
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn with_shape(&self, shape: Shape) -> TensorType {
        TensorType::new(self.dtype, shape)
    }
    pub fn with_dtype(&self, dtype: DType) -> TensorType {
        TensorType::new(dtype, self.shape.clone())
    }
    /// Number of elements, as a dimension expression.
    pub fn numel(&self) -> Dim {
        self.shape
            .iter()
            .try_fold(Dim::constant(1), |acc, d| acc.checked_mul(d))
            .unwrap_or_else(|| Dim::constant(i64::MAX))
    }
}

pub fn shape_string(shape: &[Dim]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, shape_string(&self.shape))?;
        if !self.layout.is_row_major() {
            let order: Vec<String> = self.layout.0.iter().map(|a| a.to_string()).collect();
            write!(f, "{{{}}}", order.join(","))?;
        }
        Ok(())
    }
}
