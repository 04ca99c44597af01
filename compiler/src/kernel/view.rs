//! Views: how a kernel reads a stored tensor through reshapes, permutes,
//! slices and broadcasts without copying it. A view maps an index of its
//! own shape to an element of the stored buffer:
//! `offset + sum(index[k] * strides[k])`, strides of 0 for broadcast axes.

use crate::ir::Dim;
use crate::ops::{Broadcast, Permute, Reshape, Slice};

#[derive(Clone, Debug, PartialEq)]
pub struct View {
    pub shape: Vec<Dim>,
    pub strides: Vec<Dim>,
    pub offset: Dim,
}

/// Row-major strides of a shape.
pub fn contiguous_strides(shape: &[Dim]) -> Vec<Dim> {
    let mut s = vec![Dim::constant(1); shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1].checked_mul(&shape[i + 1]).unwrap_or_default();
    }
    s
}

impl View {
    /// The whole buffer, in row-major order.
    pub fn contiguous(shape: &[Dim]) -> View {
        View {
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: Dim::constant(0),
        }
    }

    pub fn is_contiguous(&self) -> bool {
        self.offset == Dim::constant(0) && self.strides == contiguous_strides(&self.shape)
    }

    pub fn permute(&self, p: &Permute) -> View {
        View {
            shape: p.perm.iter().map(|&a| self.shape[a].clone()).collect(),
            strides: p.perm.iter().map(|&a| self.strides[a].clone()).collect(),
            offset: self.offset.clone(),
        }
    }

    pub fn slice(&self, s: &Slice) -> Option<View> {
        let mut v = self.clone();
        v.offset = v
            .offset
            .checked_add(&s.start.checked_mul(&v.strides[s.axis])?)?;
        v.shape[s.axis] = s.end.checked_sub(&s.start)?;
        Some(v)
    }

    pub fn broadcast(&self, b: &Broadcast) -> View {
        let extra = b.shape.len() - self.shape.len();
        let mut strides = vec![Dim::constant(0); extra];
        for (i, st) in self.strides.iter().enumerate() {
            let stretched = self.shape[i].is_one() && !b.shape[extra + i].is_one();
            strides.push(if stretched {
                Dim::constant(0)
            } else {
                st.clone()
            });
        }
        View {
            shape: b.shape.clone(),
            strides,
            offset: self.offset.clone(),
        }
    }

    /// A reshape keeps a view affine when the view is contiguous (then the
    /// new shape's row-major strides apply), or when it only adds or removes
    /// axes of size 1. Otherwise the data must be copied first.
    pub fn reshape(&self, r: &Reshape) -> Option<View> {
        if self.is_contiguous() {
            return Some(View::contiguous(&r.shape));
        }
        let kept_old: Vec<usize> = (0..self.shape.len())
            .filter(|&i| !self.shape[i].is_one())
            .collect();
        let kept_new: Vec<usize> = (0..r.shape.len())
            .filter(|&i| !r.shape[i].is_one())
            .collect();
        if kept_old.len() != kept_new.len()
            || kept_old
                .iter()
                .zip(&kept_new)
                .any(|(&a, &b)| self.shape[a] != r.shape[b])
        {
            return None;
        }
        let mut strides = vec![Dim::constant(0); r.shape.len()];
        for (&a, &b) in kept_old.iter().zip(&kept_new) {
            strides[b] = self.strides[a].clone();
        }
        Some(View {
            shape: r.shape.clone(),
            strides,
            offset: self.offset.clone(),
        })
    }

    /// Numpy-style broadcast of this view to a larger iteration shape.
    pub fn expand_to(&self, shape: &[Dim]) -> View {
        self.broadcast(&Broadcast {
            shape: shape.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: i64) -> Dim {
        Dim::constant(n)
    }

    #[test]
    fn permute_slice_broadcast_compose() {
        let v = View::contiguous(&[d(2), d(3), d(4)]);
        let p = v.permute(&Permute {
            perm: vec![2, 0, 1],
        });
        assert_eq!(p.strides, vec![d(1), d(12), d(4)]);
        let s = v
            .slice(&Slice {
                axis: 2,
                start: d(1),
                end: d(3),
            })
            .unwrap();
        assert_eq!((s.offset.clone(), s.shape[2].clone()), (d(1), d(2)));
        let b = View::contiguous(&[d(4)]).expand_to(&[d(2), d(3), d(4)]);
        assert_eq!(b.strides, vec![d(0), d(0), d(1)]);
        let b1 = View::contiguous(&[d(3), d(1)]).expand_to(&[d(3), d(4)]);
        assert_eq!(b1.strides, vec![d(1), d(0)]);
    }

    #[test]
    fn reshape_of_a_strided_view_only_moves_unit_axes() {
        let v = View::contiguous(&[d(2), d(3)]).permute(&Permute { perm: vec![1, 0] });
        assert!(v.reshape(&Reshape { shape: vec![d(6)] }).is_none());
        let r = v
            .reshape(&Reshape {
                shape: vec![d(3), d(1), d(2)],
            })
            .unwrap();
        assert_eq!(r.strides, vec![d(1), d(0), d(3)]);
    }
}
