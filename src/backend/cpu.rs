//! The CPU reference interpreter as a backend: small models, and the
//! reference the GPU and PyTorch are checked against.

use super::{source_shapes, split_staged, Backend};
use fusec_compiler::interp::step::train_step;
use fusec_compiler::interp::tensor::Tensor;
use fusec_compiler::interp::{Feeds, Precision};
use fusec_compiler::ir::Graph;
use fusec_compiler::ops::Op;
use fusec_compiler::plan::shard::Piece;
use fusec_runtime::session::StepStats;
use fusec_runtime::stage::HostBuf;
use fusec_runtime::RuntimeError;
use std::collections::{BTreeMap, HashMap};

/// The reference interpreter, with every value rounded to its dtype as the
/// GPU stores it.
pub struct Cpu {
    graph: Graph,
    feeds: Feeds,
    shapes: BTreeMap<String, Vec<usize>>,
    pub precision: Precision,
    /// Inputs staged for the next launch.
    staged: Vec<(String, Vec<f64>)>,
    /// The launched step's result.
    done: Option<StepStats>,
    /// ZeRO stages 1 and 2: each parameter's pieces and their owner ranks,
    /// whose updated values the other ranks take after every step.
    pieces: Option<Vec<Vec<Piece>>>,
    /// The ranks `pieces` are split over (`share_updates`).
    group: usize,
    /// The last step's gradients, by parameter name (`gradients`).
    last_grads: Vec<(String, Vec<f64>)>,
    /// The last step's logits, where it outputs them (`logits`).
    last_logits: Option<Vec<f64>>,
    /// The last step's per-token losses, where it outputs them.
    last_token_losses: Option<Vec<f64>>,
    last_next_tokens: Option<Vec<u32>>,
}

impl Cpu {
    pub fn new(
        graph: &Graph,
        dims: &BTreeMap<String, i64>,
        precision: Precision,
    ) -> Result<Cpu, RuntimeError> {
        let d: HashMap<String, i64> = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let shapes = source_shapes(graph, &d)?;
        let mut feeds = Feeds {
            dims: d,
            ..Feeds::default()
        };
        for n in graph.g.node_indices() {
            let (map, name) = match &graph.g[n].op {
                Op::Input(x) => (&mut feeds.inputs, &x.name),
                Op::Param(x) => (&mut feeds.params, &x.name),
                Op::State(x) => (&mut feeds.state, &x.name),
                _ => continue,
            };
            map.insert(name.clone(), Tensor::zeros(&shapes[name]));
        }
        Ok(Cpu {
            graph: graph.clone(),
            feeds,
            shapes,
            precision,
            staged: Vec::new(),
            done: None,
            pieces: None,
            group: 1,
            last_grads: Vec::new(),
            last_logits: None,
            last_token_losses: None,
            last_next_tokens: None,
        })
    }
}

impl Cpu {
    /// Makes this the rank of a data-parallel group that `peers` names:
    /// its `all_reduce`s meet the other ranks' (see `interp::peers`).
    pub fn join(&mut self, peers: fusec_compiler::interp::peers::Peers) {
        self.feeds.peers = Some(peers);
    }

    /// ZeRO stages 1 and 2: after each step, every parameter takes its
    /// owner's values (the step updated only this rank's own); the owners
    /// are ranks of this rank's group of `group` consecutive ranks (all of
    /// them, or its host's with hybrid sharding).
    /// Stage 3 shares nothing: each rank keeps its pieces alone, and the
    /// step gathers them (every rank's graph has the same gathers, so all
    /// decide alike).
    pub fn share_updates(&mut self, group: u32) {
        if self.graph.gathers_weights() {
            return;
        }
        self.pieces = Some(fusec_compiler::autodiff::zero::pieces(
            &self.graph.params,
            group,
        ));
        self.group = group as usize;
    }
}

impl Backend for Cpu {
    fn graph(&self) -> &Graph {
        &self.graph
    }
    fn set(&mut self, name: &str, values: &[f64]) -> Result<(), RuntimeError> {
        let shape = self
            .shapes
            .get(name)
            .ok_or_else(|| {
                RuntimeError::Unsupported(format!("the step has no tensor named `{name}`"))
            })?
            .clone();
        if shape.iter().product::<usize>() != values.len() {
            return Err(RuntimeError::Unsupported(format!(
                "`{name}` holds {} values of shape {shape:?}, given {}",
                shape.iter().product::<usize>(),
                values.len()
            )));
        }
        let t = Tensor::new(shape, values.to_vec());
        for map in [
            &mut self.feeds.inputs,
            &mut self.feeds.params,
            &mut self.feeds.state,
        ] {
            if let Some(slot) = map.get_mut(name) {
                *slot = t;
                return Ok(());
            }
        }
        Err(RuntimeError::Unsupported(format!(
            "the step has no tensor named `{name}`"
        )))
    }
    fn get(&self, name: &str) -> Result<Vec<f64>, RuntimeError> {
        [&self.feeds.inputs, &self.feeds.params, &self.feeds.state]
            .iter()
            .find_map(|m| m.get(name))
            .map(|t| t.data.clone())
            .ok_or_else(|| {
                RuntimeError::Unsupported(format!("the step has no tensor named `{name}`"))
            })
    }
    fn launch(&mut self, lr: f64, step: u64) -> Result<(), RuntimeError> {
        for (name, values) in std::mem::take(&mut self.staged) {
            self.set(&name, &values)?;
        }
        let r = train_step(&self.graph, &mut self.feeds, lr, step, self.precision)
            .map_err(|e| RuntimeError::Unsupported(format!("the CPU reference failed: {}", e.0)))?;
        if let (Some(pieces), Some(peers)) = (&self.pieces, &self.feeds.peers) {
            for (p, pieces) in self.graph.params.iter().zip(pieces) {
                let Some(t) = self.feeds.params.get_mut(&p.name) else {
                    continue;
                };
                let first = peers.rank() / self.group * self.group;
                for pc in pieces {
                    let from = peers.share(first + pc.rank as usize, t);
                    let (lo, hi) = (pc.lo as usize, pc.hi as usize);
                    t.data[lo..hi].copy_from_slice(&from.data[lo..hi]);
                }
            }
        }
        let unscale = self
            .feeds
            .inputs
            .get(fusec_compiler::autodiff::LOSS_SCALE_INPUT)
            .map_or(1.0, |t| t.data[0]);
        self.last_grads = r
            .grads
            .into_iter()
            .map(|(i, t)| {
                let name = self.graph.params[i].name.clone();
                (name, t.data.iter().map(|x| x / unscale).collect())
            })
            .collect();
        self.last_logits = r.logits.map(|t| t.data);
        self.last_token_losses = r.token_losses.map(|t| t.data);
        self.last_next_tokens = r
            .next_tokens
            .map(|t| t.data.iter().map(|&x| x as u32).collect());
        self.done = Some(StepStats {
            loss: r.loss,
            grad_norm: r.grad_norm,
        });
        Ok(())
    }
    fn gradients(&self) -> Result<Vec<(String, Vec<f64>)>, RuntimeError> {
        Ok(self.last_grads.clone())
    }
    fn next_tokens(&self) -> Result<Vec<u32>, RuntimeError> {
        self.last_next_tokens
            .clone()
            .ok_or_else(|| RuntimeError::Unsupported("the step outputs no greedy picks".into()))
    }
    fn token_losses(&self) -> Result<Vec<f64>, RuntimeError> {
        self.last_token_losses
            .clone()
            .ok_or_else(|| RuntimeError::Unsupported("the step outputs no per-token losses".into()))
    }
    fn logits(&self) -> Result<Vec<f32>, RuntimeError> {
        // The reference's values are rounded to their dtype as stored:
        // f32 holds them exactly.
        self.last_logits
            .as_ref()
            .map(|v| v.iter().map(|&x| x as f32).collect())
            .ok_or_else(|| RuntimeError::Unsupported("the step outputs no logits".into()))
    }
    fn finish(&mut self) -> Result<StepStats, RuntimeError> {
        self.done
            .take()
            .ok_or_else(|| RuntimeError::Unsupported("no step was launched".into()))
    }
    fn stage(&mut self, names: &[&str], buf: &HostBuf) -> Result<(), RuntimeError> {
        let values = buf.read()?;
        let parts = split_staged(values, names, |n| self.numel(n))?;
        self.staged = names
            .iter()
            .zip(parts)
            .map(|(name, part)| (name.to_string(), part.iter().map(|&x| x as f64).collect()))
            .collect();
        Ok(())
    }
    fn shapes(&self) -> &BTreeMap<String, Vec<usize>> {
        &self.shapes
    }
}
