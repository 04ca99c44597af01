//! A plain host tensor, row-major f64 data: what every op's reference
//! computes on (`ops`), and the reference interpreter's values.
//! Integer tensors (token ids) are stored as f64 too; every i32 is exact.

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// numpy broadcasting of two shapes; `None` if they do not broadcast.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r {
            a[i + a.len() - r]
        } else {
            1
        };
        let db = if i + b.len() >= r {
            b[i + b.len() - r]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f64>) -> Tensor {
        debug_assert_eq!(numel(&shape), data.len());
        Tensor { shape, data }
    }
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor::new(shape.to_vec(), vec![0.0; numel(shape)])
    }
    pub fn full(shape: &[usize], v: f64) -> Tensor {
        Tensor::new(shape.to_vec(), vec![v; numel(shape)])
    }
    pub fn scalar(v: f64) -> Tensor {
        Tensor::new(Vec::new(), vec![v])
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Tensor {
        Tensor::new(
            self.shape.clone(),
            self.data.iter().map(|&x| f(x)).collect(),
        )
    }

    /// Reads this tensor as if broadcast to `shape` (which it must broadcast to).
    pub fn broadcast_to(&self, shape: &[usize]) -> Tensor {
        if self.shape == shape {
            return self.clone();
        }
        let r = shape.len();
        let off = r - self.shape.len();
        let src_strides = strides(&self.shape);
        let mut out = Vec::with_capacity(numel(shape));
        let mut idx = vec![0usize; r];
        for _ in 0..numel(shape) {
            let mut src = 0;
            for i in off..r {
                if self.shape[i - off] != 1 {
                    src += idx[i] * src_strides[i - off];
                }
            }
            out.push(self.data[src]);
            for i in (0..r).rev() {
                idx[i] += 1;
                if idx[i] < shape[i] {
                    break;
                }
                idx[i] = 0;
            }
        }
        Tensor::new(shape.to_vec(), out)
    }

    /// Elementwise with broadcasting.
    pub fn zip(&self, other: &Tensor, f: impl Fn(f64, f64) -> f64) -> Tensor {
        let shape = broadcast_shapes(&self.shape, &other.shape).expect("shapes were checked");
        let a = self.broadcast_to(&shape);
        let b = other.broadcast_to(&shape);
        let data = a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect();
        Tensor::new(shape, data)
    }

    /// Sums away broadcast axes so the result has `shape` (the inverse of broadcast_to).
    pub fn sum_to(&self, shape: &[usize]) -> Tensor {
        if self.shape == shape {
            return self.clone();
        }
        let r = self.shape.len();
        let off = r - shape.len();
        let tgt_strides = strides(shape);
        let mut out = vec![0.0; numel(shape)];
        let mut idx = vec![0usize; r];
        for &v in &self.data {
            let mut dst = 0;
            for i in off..r {
                if shape[i - off] != 1 {
                    dst += idx[i] * tgt_strides[i - off];
                }
            }
            out[dst] += v;
            for i in (0..r).rev() {
                idx[i] += 1;
                if idx[i] < self.shape[i] {
                    break;
                }
                idx[i] = 0;
            }
        }
        Tensor::new(shape.to_vec(), out)
    }

    pub fn permute(&self, perm: &[usize]) -> Tensor {
        let shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        let src_strides = strides(&self.shape);
        let r = shape.len();
        let mut out = Vec::with_capacity(self.data.len());
        let mut idx = vec![0usize; r];
        for _ in 0..self.data.len() {
            let src: usize = (0..r).map(|i| idx[i] * src_strides[perm[i]]).sum();
            out.push(self.data[src]);
            for i in (0..r).rev() {
                idx[i] += 1;
                if idx[i] < shape[i] {
                    break;
                }
                idx[i] = 0;
            }
        }
        Tensor::new(shape, out)
    }

    /// Splits the shape around `axis` into (outer, len, inner) for loops
    /// that work along one axis.
    pub fn around(&self, axis: usize) -> (usize, usize, usize) {
        let outer = numel(&self.shape[..axis]);
        let len = self.shape[axis];
        let inner = numel(&self.shape[axis + 1..]);
        (outer, len, inner)
    }
}

/// Batched matmul with numpy broadcasting of the batch axes: [..., M, K] @ [..., K, N].
pub fn matmul(a: &Tensor, b: &Tensor) -> Tensor {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let n = b.shape[rb - 1];
    let batch = broadcast_shapes(&a.shape[..ra - 2], &b.shape[..rb - 2]).expect("checked");
    let mut sa = batch.clone();
    sa.extend([m, k]);
    let mut sb = batch.clone();
    sb.extend([k, n]);
    let a = a.broadcast_to(&sa);
    let b = b.broadcast_to(&sb);
    let nb = numel(&batch);
    let mut out = vec![0.0; nb * m * n];
    for bi in 0..nb {
        let ao = &a.data[bi * m * k..(bi + 1) * m * k];
        let bo = &b.data[bi * k * n..(bi + 1) * k * n];
        let oo = &mut out[bi * m * n..(bi + 1) * m * n];
        for i in 0..m {
            for p in 0..k {
                let av = ao[i * k + p];
                if av == 0.0 {
                    continue;
                }
                for j in 0..n {
                    oo[i * n + j] += av * bo[p * n + j];
                }
            }
        }
    }
    let mut shape = batch;
    shape.extend([m, n]);
    Tensor::new(shape, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_and_sum_to_are_adjoint() {
        let a = Tensor::new(vec![1, 3], vec![1.0, 2.0, 3.0]);
        let b = a.broadcast_to(&[2, 2, 3]);
        assert_eq!(b.data, vec![1., 2., 3., 1., 2., 3., 1., 2., 3., 1., 2., 3.]);
        assert_eq!(b.sum_to(&[1, 3]).data, vec![4.0, 8.0, 12.0]);
        assert_eq!(b.sum_to(&[3]).data, vec![4.0, 8.0, 12.0]);
    }

    #[test]
    fn matmul_batches() {
        let a = Tensor::new(vec![2, 1, 2], vec![1., 2., 3., 4.]);
        let b = Tensor::new(vec![2, 1], vec![10., 100.]);
        let c = matmul(&a, &b);
        assert_eq!(c.shape, vec![2, 1, 1]);
        assert_eq!(c.data, vec![210.0, 430.0]);
    }

    #[test]
    fn permute_transposes() {
        let a = Tensor::new(vec![2, 3], vec![0., 1., 2., 3., 4., 5.]);
        let t = a.permute(&[1, 0]);
        assert_eq!(t.shape, vec![3, 2]);
        assert_eq!(t.data, vec![0., 3., 1., 4., 2., 5.]);
    }
}
