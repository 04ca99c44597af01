//! Bulk tensor copies (TMA, sm_90) for the Hopper attention kernels: one
//! thread copies a whole box of a 16-bit `[B, T, H, D]` tensor from global
//! into shared memory, swizzled so that wgmma's descriptors read it without
//! bank conflicts, and the copy signals an mbarrier by the bytes it
//! delivers (`kernels/attention/sm90.cuh`, `SwizzledTile`).
//!
//! A copy names a *tensor map* (`CUtensorMap`, 128 opaque bytes the driver
//! encodes on the host: base address, extents, strides, box, swizzle). The
//! kernel takes one per copied tensor as a `const __grid_constant__`
//! parameter after all its other parameters; the runtime encodes each
//! [`TensorMap`] for the launch's buffers and sizes. A map views a `[B, T,
//! H, D]` attention input with its view's strides, in memory order
//! innermost first: features (`box_feats` per box: 64, 32 or 16 for the
//! 128-, 64- and 32-byte swizzles), heads (1), rows (`box_rows`), batch (1).
//! Rows past T, and features past D (a head dim padded to the box), read as
//! zeros.
//!
//! In a host build a tensor map is a plain struct built inside the kernel
//! from its pointer arguments ([`host_maps`]), a copy a loop that writes the
//! same swizzled bytes, and the emulated wgmma reads through the swizzle.

use crate::emit::access::Access;
use crate::emit::templates::Ctx;
use crate::ir::{Dim, Graph};
use petgraph::stable_graph::NodeIndex;

/// The swizzle (bytes per box row) of a tile whose rows hold `feats`
/// 16-bit features: the widest of 128, 64 and 32 whose box divides them
/// (`swizzle_for` in `kernels/attention/sm90.cuh`).
pub fn swizzle_for(feats: u64) -> u32 {
    if feats.is_multiple_of(64) {
        128
    } else if feats.is_multiple_of(32) {
        64
    } else {
        32
    }
}

/// How to encode one kernel parameter's tensor map for a launch: a view of
/// a `[B, T, H, D]` 16-bit attention input, copied in boxes of `box_feats`
/// features by `box_rows` rows with a `swizzle`-byte swizzle.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMap {
    /// The kernel parameter's name.
    pub name: String,
    /// The buffer's position among the kernel's arguments (inputs, then
    /// outputs).
    pub arg: usize,
    /// Element offset of element (0, 0, 0, 0) in the buffer.
    pub offset: Dim,
    /// Extents, innermost first: D, H, T, B.
    pub dims: [Dim; 4],
    /// Strides in elements of H, T and B.
    pub strides: [Dim; 3],
    /// Features (D) per box: half the swizzle's bytes.
    pub box_feats: u32,
    /// Rows (T) per box.
    pub box_rows: u32,
    /// Bytes per swizzled box row: 128, 64 or 32.
    pub swizzle: u32,
}

/// A [`TensorMap`] with sizes bound: what `cuTensorMapEncodeTiled` takes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TensorMapSizes {
    pub offset_bytes: u64,
    pub dims: [u64; 4],
    pub strides_bytes: [u64; 3],
    pub boxes: [u32; 4],
}

impl TensorMap {
    /// Op input `i` of attention node `n` (a `[B, T, H, D]` view) as map
    /// `name`, copied into tiles of `box_rows` rows by `padded` features;
    /// `None` for a view that repeats elements (a stride of 0 on an axis that
    /// may be longer than 1), which a tensor map cannot describe.
    pub(crate) fn of_input(
        g: &Graph,
        c: &Ctx,
        n: NodeIndex,
        i: usize,
        name: &str,
        box_rows: u64,
        padded: u64,
    ) -> Option<TensorMap> {
        let a = Access::input(g, c, n, i);
        let shape = &g.ty(g.inputs(n)[i]).shape;
        let s = a.strides();
        let repeats =
            |axis: usize| s[axis].as_const() == Some(0) && shape[axis].as_const() != Some(1);
        if (0..3).any(repeats) {
            return None;
        }
        Some(TensorMap {
            name: name.to_string(),
            arg: c.ins[i],
            offset: a.offset().clone(),
            dims: [
                shape[3].clone(),
                shape[2].clone(),
                shape[1].clone(),
                shape[0].clone(),
            ],
            strides: [s[2].clone(), s[1].clone(), s[0].clone()],
            box_feats: swizzle_for(padded) / 2,
            box_rows: box_rows as u32,
            swizzle: swizzle_for(padded),
        })
    }

    /// The sizes for `env`; `None` for an unbound symbol or a negative size.
    /// An axis of extent 1 (whose view stride may be 0: it is never stepped)
    /// takes the packed stride, which the driver accepts.
    pub fn sizes(&self, env: &dyn Fn(&str) -> Option<i64>) -> Option<TensorMapSizes> {
        let ev = |d: &Dim| d.eval(env).and_then(|x| u64::try_from(x).ok());
        let mut s = TensorMapSizes {
            offset_bytes: 2 * ev(&self.offset)?,
            dims: [
                ev(&self.dims[0])?,
                ev(&self.dims[1])?,
                ev(&self.dims[2])?,
                ev(&self.dims[3])?,
            ],
            strides_bytes: [
                2 * ev(&self.strides[0])?,
                2 * ev(&self.strides[1])?,
                2 * ev(&self.strides[2])?,
            ],
            boxes: [self.box_feats, 1, self.box_rows, 1],
        };
        let mut packed = 2 * s.dims[0];
        for i in 0..3 {
            if s.dims[i + 1] == 1 {
                s.strides_bytes[i] = packed.next_multiple_of(16);
            }
            packed = s.strides_bytes[i] * s.dims[i + 1];
        }
        Some(s)
    }

    /// The host build's definition of the map (see [`host_maps`]).
    fn host_def(&self) -> String {
        let c = |d: &Dim| format!("(fs_i64)({})", d.to_c());
        format!(
            "    FS_TMAP_HOST({}, reinterpret_cast<const unsigned short*>(in{}) + {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {});\n",
            self.name,
            self.arg,
            c(&self.offset),
            c(&self.dims[0]),
            c(&self.dims[1]),
            c(&self.dims[2]),
            c(&self.dims[3]),
            c(&self.strides[0]),
            c(&self.strides[1]),
            c(&self.strides[2]),
            self.box_feats,
            self.box_rows,
            self.swizzle
        )
    }
}

/// The body's first lines in a host build: each map from the kernel's
/// pointer arguments and size parameters.
pub(crate) fn host_maps(maps: &[TensorMap]) -> String {
    let defs: String = maps.iter().map(TensorMap::host_def).collect();
    format!("#ifndef __CUDA_ARCH__\n{defs}#endif\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(heads: i64, stride_h: i64) -> TensorMap {
        TensorMap {
            name: "tm_k".into(),
            arg: 1,
            offset: Dim::constant(64),
            dims: [64, heads, 1000, 2].map(Dim::constant),
            strides: [stride_h, 3 * 64 * heads, 1000 * 3 * 64 * heads].map(Dim::constant),
            box_feats: 64,
            box_rows: 64,
            swizzle: 128,
        }
    }

    #[test]
    fn sizes_are_bytes_in_memory_order() {
        let s = map(4, 64).sizes(&|_| None).unwrap();
        assert_eq!(s.offset_bytes, 128);
        assert_eq!(s.dims, [64, 4, 1000, 2]);
        assert_eq!(s.strides_bytes, [128, 1536, 1_536_000]);
        assert_eq!(s.boxes, [64, 1, 64, 1]);
    }

    /// One kv head: the view's head stride is 0, which the driver refuses;
    /// the axis is never stepped, so the packed stride stands in.
    #[test]
    fn a_single_head_takes_the_packed_stride() {
        let s = map(1, 0).sizes(&|_| None).unwrap();
        assert_eq!(s.strides_bytes, [128, 384, 384_000]);
    }

    #[test]
    fn unbound_sizes_give_none() {
        let mut m = map(4, 64);
        m.dims[2] = Dim::symbol("T");
        assert!(m.sizes(&|_| None).is_none());
        assert_eq!(m.sizes(&|s| (s == "T").then_some(10)).unwrap().dims[2], 10);
    }
}
