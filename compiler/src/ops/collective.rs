//! Data parallelism's ops: the mean of a tensor over every rank (each rank
//! a GPU holding a replica of the model and its own slice of the batch),
//! and ZeRO stage 3's gather of a parameter from its owners' pieces
//! (`AllGather`). The update phase applies the mean to each gradient, and
//! to the loss, when the step is built for more than one rank; on the GPU
//! it is an NCCL all-reduce, on the CPU reference it meets the other ranks
//! through `interp::Peers`. Under ZeRO a gradient's mean is needed only by
//! the owners of its pieces (`autodiff::zero`): it is reduced to each owner
//! alone (NCCL reduces rooted at the owners, together a reduce-scatter),
//! and every other element of the result is left undefined. Under ZeRO
//! stage 2 the owner's result is its piece alone (`piece`), a buffer of
//! that size, so the whole gradient is a temporary that dies with the
//! collective.

use super::*;

#[derive(Clone, Debug, PartialEq)]
pub struct AllReduce {
    /// Ranks taking part (the mean divides by it).
    pub ranks: u32,
    /// ZeRO: the ranks a parameter's pieces are split over (`owners_of`'s
    /// owners are ranks 0..group of each group of consecutive ranks; the
    /// groups hold the same pieces): `ranks` unless the step shards within
    /// hosts (`--shard-within`). The mean is over all `ranks` either way.
    pub group: u32,
    /// Run on every micro-batch (the loss, which each one reports), not
    /// only on the one that ends the step (the gradients' sums).
    pub every_micro_batch: bool,
    /// ZeRO: the gradient of parameter `i`, whose mean each rank needs only
    /// on the piece it owns; elsewhere the result is undefined (the CPU
    /// reference fills it with NaN, so that a reader shows).
    pub owners_of: Option<usize>,
    /// ZeRO stage 2: the gradient is the backward pass's temporary (no
    /// rank keeps it whole past this collective); the rank keeps its piece
    /// of the mean (`piece`), all of it where it owns it whole, else none.
    pub sharded: bool,
    /// Stage 2: the result is elements [lo, hi) of the mean alone, flat
    /// (this rank's piece of parameter `owners_of`).
    pub piece: Option<(i64, i64)>,
}

impl OpDef for AllReduce {
    fn name(&self) -> &'static str {
        "all_reduce"
    }
    fn attrs(&self) -> Vec<String> {
        let mut a = vec!["op=mean".into(), format!("ranks={}", self.ranks)];
        if self.group != self.ranks {
            a.push(format!("group={}", self.group));
        }
        if self.every_micro_batch {
            a.push("every_micro_batch".into());
        }
        if let Some(i) = self.owners_of {
            a.push(format!("owners_of={i}"));
        }
        if self.sharded {
            a.push("sharded".into());
        }
        if let Some((lo, hi)) = self.piece {
            a.push(format!("piece={lo}..{hi}"));
        }
        a
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("all_reduce", inputs, 1)?;
        if self.group == 0 || !self.ranks.is_multiple_of(self.group) {
            return Err(OpError::new(
                "`all_reduce`'s group does not divide its ranks",
                format!("group {} of {} ranks", self.group, self.ranks),
            ));
        }
        let Some((lo, hi)) = self.piece else {
            return Ok(vec![inputs[0].clone()]);
        };
        let n = inputs[0].numel().as_const();
        if lo < 0 || hi <= lo || n.is_none_or(|n| hi > n) {
            return Err(OpError::new(
                "`all_reduce`'s piece is outside its tensor",
                format!("{lo}..{hi} of {}", inputs[0]),
            ));
        }
        Ok(vec![TensorType::new(
            inputs[0].dtype,
            vec![Dim::constant(hi - lo)],
        )])
    }
    /// Alone (no other ranks to meet): every rank holds what this one does,
    /// so the mean is the tensor itself. The interpreter evaluates the op
    /// with its peers where it has them.
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        vec![self.own(inputs[0].clone())]
    }
}

impl AllReduce {
    /// The result as this rank keeps it: all of `mean`, or its piece.
    pub fn own(&self, mean: Tensor) -> Tensor {
        match self.piece {
            Some((lo, hi)) => Tensor::new(
                vec![(hi - lo) as usize],
                mean.data[lo as usize..hi as usize].to_vec(),
            ),
            None => mean,
        }
    }
}

/// ZeRO stage 3: parameter `param` gathered whole from its owners' pieces
/// just before a pass reads it, where the ranks keep only their pieces.
/// Input 0 is rank `rank`'s piece (flat: elements `pieces[rank]` of the
/// parameter, none where it owns none); the result is the whole parameter,
/// `shape`, in the piece's dtype, every rank's run in its place. The
/// pieces are `shard::pieces`'s, the same on every rank, so the ranks
/// gather the same parameters in the same order (NCCL's rule).
#[derive(Clone, Debug, PartialEq)]
pub struct AllGather {
    pub rank: u32,
    pub param: usize,
    /// Each rank's elements [lo, hi) of the parameter, in rank order,
    /// `(lo, lo)` where it owns none; together they tile the parameter.
    pub pieces: Vec<(i64, i64)>,
    pub shape: Vec<Dim>,
}

impl OpDef for AllGather {
    fn name(&self) -> &'static str {
        "all_gather"
    }
    fn attrs(&self) -> Vec<String> {
        let pieces: Vec<String> = self
            .pieces
            .iter()
            .map(|(lo, hi)| format!("{lo}..{hi}"))
            .collect();
        vec![
            format!("rank={}", self.rank),
            format!("param={}", self.param),
            format!("pieces={}", pieces.join(",")),
            shape_string(&self.shape),
        ]
    }
    fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>, OpError> {
        expect_arity("all_gather", inputs, 1)?;
        let numel = self
            .shape
            .iter()
            .try_fold(1i64, |n, d| Some(n * d.as_const()?))
            .ok_or_else(|| {
                OpError::new(
                    "`all_gather` needs a parameter of constant shape",
                    format!("shape {}", shape_string(&self.shape)),
                )
            })?;
        let tiled = self.pieces.iter().try_fold(0i64, |at, &(lo, hi)| {
            (lo == at || lo == hi).then_some(if hi > lo { hi } else { at })
        });
        let outside = |&(lo, hi): &(i64, i64)| lo < 0 || hi < lo || hi > numel;
        if tiled != Some(numel) || self.pieces.iter().any(outside) {
            return Err(OpError::new(
                "`all_gather`'s pieces do not tile its parameter",
                format!("{:?} of {numel} elements", self.pieces),
            ));
        }
        let Some(&(lo, hi)) = self.pieces.get(self.rank as usize) else {
            return Err(OpError::new(
                "`all_gather`'s rank has no piece",
                format!("rank {} of {}", self.rank, self.pieces.len()),
            ));
        };
        if inputs[0].numel().as_const() != Some(hi - lo) {
            return Err(OpError::new(
                "`all_gather`'s input is not its rank's piece",
                format!("{} against {lo}..{hi}", inputs[0]),
            ));
        }
        Ok(vec![TensorType::new(inputs[0].dtype, self.shape.clone())])
    }
    /// Alone (no other ranks to meet): only this rank's piece is known,
    /// NaN elsewhere (so that a reader shows); the interpreter gathers
    /// with its peers where it has them (`AllGather::assemble`).
    fn eval(&self, inputs: &[&Tensor], _: &EvalCtx) -> Vec<Tensor> {
        let mut parts: Vec<Option<&[f64]>> = vec![None; self.pieces.len()];
        parts[self.rank as usize] = Some(&inputs[0].data);
        vec![self.assemble(&parts)]
    }
}

impl AllGather {
    /// The whole parameter from each rank's piece (`None`, or a part of
    /// another length than its piece: not known, NaN).
    pub fn assemble(&self, parts: &[Option<&[f64]>]) -> Tensor {
        let shape: Vec<usize> = self
            .shape
            .iter()
            .map(|d| d.as_const().unwrap_or(0).max(0) as usize)
            .collect();
        let mut data = vec![f64::NAN; shape.iter().product()];
        for (&(lo, hi), part) in self.pieces.iter().zip(parts) {
            match part {
                Some(p) if p.len() as i64 == hi - lo && hi as usize <= data.len() => {
                    data[lo as usize..hi as usize].copy_from_slice(p)
                }
                _ => {}
            }
        }
        Tensor::new(shape, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::peers::Peers;
    use crate::interp::{run, Feeds, Precision};
    use crate::ir::parse::parse_graph;

    fn gather(rank: u32, pieces: &[(i64, i64)]) -> AllGather {
        AllGather {
            rank,
            param: 0,
            pieces: pieces.to_vec(),
            shape: vec![Dim::constant(3), Dim::constant(4)],
        }
    }

    fn piece(n: i64) -> TensorType {
        TensorType::new(DType::BF16, vec![Dim::constant(n)])
    }

    /// The result is the whole parameter in the piece's dtype; pieces must
    /// tile it (a rank may own none), and the input must be the rank's.
    #[test]
    fn a_gather_types_its_parameter_from_tiling_pieces() {
        let tiles = [(0, 5), (5, 5), (5, 12)];
        let out = gather(2, &tiles).infer(&[piece(7)]).unwrap();
        assert_eq!(
            out,
            vec![TensorType::new(
                DType::BF16,
                vec![Dim::constant(3), Dim::constant(4)]
            )]
        );
        assert!(gather(1, &tiles).infer(&[piece(0)]).is_ok());
        let bad = |g: AllGather, n: i64| g.infer(&[piece(n)]).unwrap_err().to_string();
        assert!(bad(gather(0, &[(0, 5), (6, 12)]), 5).contains("do not tile"));
        assert!(bad(gather(0, &[(0, 5), (4, 12)]), 5).contains("do not tile"));
        assert!(bad(gather(0, &[(0, 5), (5, 11)]), 5).contains("do not tile"));
        assert!(bad(gather(0, &[(0, 5), (30, 30), (5, 12)]), 5).contains("do not tile"));
        assert!(bad(gather(0, &tiles), 6).contains("not its rank's piece"));
        assert!(bad(gather(3, &tiles), 0).contains("has no piece"));
    }

    /// Three ranks, one of them owning nothing: each runs its own graph
    /// (its piece an input), meets the others at the gather, and gets the
    /// same whole parameter; alone, a rank knows its own piece only.
    #[test]
    fn ranks_gather_the_same_parameter_from_their_pieces() {
        let tiles = "0..5,5..5,5..12";
        let sizes = [5usize, 0, 7];
        let graph = |rank: usize| {
            parse_graph(&format!(
                "graph g ()\nforward:\n  %0: f32[{n}] = input \"piece\"\n  %1: f32[3, 4] = all_gather(%0) rank={rank} param=0 pieces={tiles} [3, 4]\noutputs:\n  loss = %1\n",
                n = sizes[rank]
            ))
            .unwrap_or_else(|e| panic!("{e}"))
        };
        let whole: Vec<f64> = (0..12).map(|x| x as f64 * 0.5 - 2.0).collect();
        let feeds = |rank: usize, peers: Option<Peers>| {
            let lo = [0, 5, 5][rank];
            let data = whole[lo..lo + sizes[rank]].to_vec();
            Feeds {
                inputs: [("piece".to_string(), Tensor::new(vec![sizes[rank]], data))].into(),
                peers,
                ..Default::default()
            }
        };
        let got: Vec<Vec<f64>> = std::thread::scope(|s| {
            let hs: Vec<_> = Peers::group(3)
                .into_iter()
                .enumerate()
                .map(|(rank, p)| {
                    let (g, f) = (graph(rank), feeds(rank, Some(p)));
                    s.spawn(move || {
                        let vals = run(&g, &f, Precision::F64).unwrap();
                        let out = g.outputs[0].1;
                        vals[&out].data.clone()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for g in &got {
            assert_eq!(g, &whole);
        }
        let g = graph(2);
        let alone = run(&g, &feeds(2, None), Precision::F64).unwrap();
        let out = &alone[&g.outputs[0].1].data;
        assert!(out[..5].iter().all(|x| x.is_nan()));
        assert_eq!(&out[5..], &whole[5..]);
    }
}
