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

    /// A reshape keeps a view affine when each run of old axes that the
    /// new shape merges or splits is itself contiguous in memory (so heads
    /// split out of a sliced QKV projection stay a view). Axes of size 1
    /// are free. Otherwise the data must be copied first.
    pub fn reshape(&self, r: &Reshape) -> Option<View> {
        if self.is_contiguous() {
            return Some(View::contiguous(&r.shape));
        }
        let old: Vec<usize> = (0..self.shape.len())
            .filter(|&i| !self.shape[i].is_one())
            .collect();
        let new: Vec<usize> = (0..r.shape.len())
            .filter(|&i| !r.shape[i].is_one())
            .collect();
        let mut strides = vec![Dim::constant(0); r.shape.len()];
        let (mut i, mut j) = (0, 0);
        while i < old.len() && j < new.len() {
            // Grow a group of old axes and a group of new axes until both
            // hold the same number of elements.
            let (i0, j0) = (i, j);
            let mut po = self.shape[old[i]].clone();
            let mut pn = r.shape[new[j]].clone();
            while po != pn {
                if pn.checked_div(&po).is_some() && i + 1 < old.len() {
                    i += 1;
                    po = po.checked_mul(&self.shape[old[i]])?;
                } else if po.checked_div(&pn).is_some() && j + 1 < new.len() {
                    j += 1;
                    pn = pn.checked_mul(&r.shape[new[j]])?;
                } else {
                    return None;
                }
            }
            // The old group must be one contiguous run of memory.
            for a in i0..i {
                let inner = self.strides[old[a + 1]].checked_mul(&self.shape[old[a + 1]])?;
                if self.strides[old[a]] != inner {
                    return None;
                }
            }
            let mut st = self.strides[old[i]].clone();
            for b in (j0..=j).rev() {
                strides[new[b]] = st.clone();
                st = st.checked_mul(&r.shape[new[b]])?;
            }
            i += 1;
            j += 1;
        }
        if i != old.len() || j != new.len() {
            return None;
        }
        Some(View {
            shape: r.shape.clone(),
            strides,
            offset: self.offset.clone(),
        })
    }

    /// This view seen through one view op (reshape, permute, slice,
    /// broadcast); `None` when no affine view expresses it (a reshape that
    /// needs a copy) or `op` is not a view op.
    pub fn apply(&self, op: &crate::ops::Op) -> Option<View> {
        use crate::ops::Op;
        match op {
            Op::Permute(p) => Some(self.permute(p)),
            Op::Broadcast(b) => Some(self.broadcast(b)),
            Op::Slice(s) => self.slice(s),
            Op::Reshape(r) => self.reshape(r),
            _ => None,
        }
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

    #[test]
    fn heads_split_out_of_a_sliced_projection_stay_a_view() {
        // qkv [B=2, T=5, 3*C] with C = 8; k = qkv[..., 8:16] as [2, 5, H=2, D=4].
        let qkv = View::contiguous(&[d(2), d(5), d(24)]);
        let k = qkv
            .slice(&Slice {
                axis: 2,
                start: d(8),
                end: d(16),
            })
            .unwrap();
        let h = k
            .reshape(&Reshape {
                shape: vec![d(2), d(5), d(2), d(4)],
            })
            .unwrap();
        assert_eq!(h.strides, vec![d(120), d(24), d(4), d(1)]);
        assert_eq!(h.offset, d(8));
        // Batch and time merge (uniform stride); time and features do not.
        let bt = k
            .reshape(&Reshape {
                shape: vec![d(10), d(8)],
            })
            .unwrap();
        assert_eq!(bt.strides, vec![d(24), d(1)]);
        assert!(k
            .reshape(&Reshape {
                shape: vec![d(2), d(40)]
            })
            .is_none());
        // Merging the split axes back is.
        let m = h
            .reshape(&Reshape {
                shape: vec![d(2), d(5), d(8)],
            })
            .unwrap();
        assert_eq!(m, k);
        // A transposed matrix cannot be flattened, but its axes can be split.
        let t = View::contiguous(&[d(4), d(6)]).permute(&Permute { perm: vec![1, 0] });
        let s = t
            .reshape(&Reshape {
                shape: vec![d(2), d(3), d(4)],
            })
            .unwrap();
        assert_eq!(s.strides, vec![d(3), d(1), d(6)]);
    }
}
