//! The decode loop of `fusec generate`: a batch of continuations run
//! through the decode step (`fusec_compiler::decode`) a position at a
//! time, each row's key/value caches filling as it goes. Every row stands
//! at the same position. Where there is a prefill step (the decode step
//! at T = m, without its logits), it writes the caches of every row's
//! first m prompt tokens at once; after it, a row still within its prompt
//! is fed its prompt's next token, the others their last pick.

use super::common::Loaded;
use super::CliError;
use fusec::backend::Backend;
use fusec_compiler::decode::{decode_graph, POSITIONS_INPUT};
use fusec_compiler::ir::graph::Role;
use fusec_compiler::ir::{dim, Graph};
use fusec_compiler::ops::Op;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// Text to ids and back: a Hugging Face tokenizer, or UTF-8 bytes.
pub enum Codec {
    Tokenizer(Box<tokenizers::Tokenizer>),
    Bytes,
}

impl Codec {
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, CliError> {
        match self {
            Codec::Tokenizer(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| CliError::usage(format!("error: cannot encode the prompt: {e}"))),
            Codec::Bytes => Ok(text.bytes().map(u32::from).collect()),
        }
    }
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Codec::Tokenizer(t) => t.decode(ids, false).unwrap_or_default(),
            Codec::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&i| i.min(255) as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
        }
    }
}

/// The model reads token ids as `tokens` (i32 `[B, T]`); any other input
/// the decode step keeps is fed zeros (a training target the logits do
/// not read).
fn check_inputs(g: &Graph, file: &str) -> Result<(), CliError> {
    let tokens = g.g.node_indices().any(|n| {
        matches!(&g.g[n].op, Op::Input(i) if i.name == "tokens"
            && i.ty.to_string() == format!("i32[{}, {}]", dim::BATCH, dim::SEQ))
    });
    if !tokens {
        return Err(CliError::usage(format!(
            "error: fusec generate feeds token ids to a language model's `tokens` (i32[B, T], as dsl-examples/gpt2-small.dsl declares it); {file} has none"
        )));
    }
    Ok(())
}

/// What the decode step is built for.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions {
    /// Each next token picked on the device (`decode::greedy_graph`): the
    /// step outputs the picks instead of the logits.
    pub greedy: bool,
    /// The weights kept in the dtype the passes read
    /// (`decode::weights_as_read`): faster steps, but a training step's
    /// f32 weights copied in through the host.
    pub weights_as_read: bool,
}

/// A model made ready to continue prompts: its decode step, the positions
/// the longest prompt and its new tokens take, and its vocabulary.
pub struct Prepared {
    pub step: Graph,
    pub positions: usize,
    pub vocab: Option<usize>,
}

/// The decode step of `loaded`, checked to continue `prompts` (`ids_in`
/// names them in messages) by `new` tokens each (`positions_of` names the
/// sum): the model reads `tokens`, has the positions, and knows every
/// prompt id and every id the tokenizer can give; built as `options` say.
pub fn prepare(
    loaded: &Loaded,
    codec: &Codec,
    prompts: &[Vec<u32>],
    new: usize,
    ids_in: &str,
    positions_of: &str,
    options: StepOptions,
) -> Result<Prepared, CliError> {
    let file = loaded.path.display().to_string();
    let whole = fusec_compiler::driver::logits_graph(&loaded.compiled)
        .map_err(|e| CliError::usage(format!("error: {file}: {e}")))?;
    check_inputs(&whole, &file)?;
    let step =
        decode_graph(&whole).map_err(|f| CliError::model(f.render(&file, &loaded.source)))?;
    let positions = prompts.iter().map(Vec::len).max().unwrap_or(0) + new;
    let sizes = BTreeMap::from([
        (dim::BATCH.to_string(), 1i64),
        (dim::SEQ.to_string(), positions as i64),
    ]);
    super::common::check_sizes(loaded, &sizes).map_err(|e| {
        CliError::usage(format!(
            "error: {positions_of} make {positions} positions, which the model cannot take:\n{}",
            e.message
        ))
    })?;
    let vocab = super::feed::token_bound(&loaded.compiled.optimized, &sizes);
    if let (Some(v), Codec::Tokenizer(t)) = (vocab, codec) {
        let n = t.get_vocab_size(true);
        if n > v as usize {
            return Err(CliError::usage(format!(
                "error: the tokenizer has {n} ids and the model's vocabulary {v}: it is not the tokenizer the model was trained with"
            )));
        }
    }
    if let Some(v) = vocab {
        if let Some(&bad) = prompts.iter().flatten().find(|&&x| x >= v) {
            return Err(CliError::usage(format!(
                "error: {ids_in} holds token id {bad}, and the model's vocabulary has {v} ids (0 to {})",
                v - 1
            )));
        }
    }
    let model_err =
        |f: fusec_compiler::driver::Failure| CliError::model(f.render(&file, &loaded.source));
    let step = match options.weights_as_read {
        true => fusec_compiler::decode::weights_as_read(&step).map_err(model_err)?,
        false => step,
    };
    let step = match options.greedy {
        true => {
            let width = step
                .output(&Role::Logits)
                .and_then(|v| step.ty(v).shape.last()?.as_const());
            let classes = match (vocab.map(i64::from), width) {
                (Some(v), Some(w)) => v.min(w),
                (v, w) => v.or(w).ok_or_else(|| {
                    CliError::usage(format!(
                        "error: {file}: the logits have no fixed width to pick the most likely token from"
                    ))
                })?,
            };
            fusec_compiler::decode::greedy_graph(&step, classes).map_err(model_err)?
        }
        false => step,
    };
    Ok(Prepared {
        step,
        positions,
        vocab: vocab.map(|v| v as usize),
    })
}

/// How the next token is chosen from a row of logits.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub temperature: f64,
    pub top_k: Option<u32>,
    pub top_p: Option<f64>,
}

impl Sampling {
    /// Whether the pick is the most likely token (a greedy step makes it
    /// on the device).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The next token: the first most likely one (greedy), or one drawn
    /// from the softmax of `row / temperature` restricted to the `top_k`
    /// most likely and then to the fewest whose probabilities reach `top_p`.
    pub fn pick(&self, row: &[f32], rng: &mut rand_chacha::ChaCha8Rng) -> u32 {
        if self.is_greedy() {
            // The first of the largest, NaNs passed over (the device's
            // `argmax` picks alike): 0 where every logit is NaN.
            let mut best: Option<(usize, f32)> = None;
            for (i, &x) in row.iter().enumerate() {
                if !x.is_nan() && best.is_none_or(|(_, b)| x > b) {
                    best = Some((i, x));
                }
            }
            return best.map_or(0, |(i, _)| i as u32);
        }
        // Most likely first, equal logits by id: a total order, so the
        // draw is repeatable. Only what top-k and top-p need is sorted:
        // the k best (selected first), or every id for top-p alone; with
        // neither, every id in id order.
        let by_rank = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
        let mut order: Vec<usize> = match (self.top_k.map(|k| k as usize), self.top_p) {
            (Some(k), _) if k < row.len() => top_k(row, k),
            (None, None) => (0..row.len()).collect(),
            _ => {
                let mut all: Vec<usize> = (0..row.len()).collect();
                all.sort_unstable_by(by_rank);
                all
            }
        };
        let top = order
            .iter()
            .map(|&i| row[i] as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((row[i] as f64 - top) / self.temperature).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if let Some(p) = self.top_p {
            let mut sum = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    sum += q;
                    sum >= p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            order.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut u = rng.random::<f64>() * total;
        for (&i, &q) in order.iter().zip(&probs) {
            if u < q {
                return i as u32;
            }
            u -= q;
        }
        order[probs.len() - 1] as u32
    }
}

/// The `k` (at least 1) most likely ids of `row`, most likely first, equal
/// logits by id (`f32::total_cmp`'s order: a NaN ranks above every
/// number): one pass keeping the k best in a heap, most ids losing to the
/// heap's worst at one comparison. Selecting among every id instead made
/// the picks of top-k 50 over 32 rows of 50257 take 0.95 ms a step on a
/// 16-core host (docs/benchmarks.md).
fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    use std::cmp::Ordering;
    use std::collections::BinaryHeap;
    /// Ordered so that the heap's top is the worst kept: the lower logit,
    /// then the higher id.
    struct Kept(f32, usize);
    impl Ord for Kept {
        fn cmp(&self, other: &Self) -> Ordering {
            other.0.total_cmp(&self.0).then(self.1.cmp(&other.1))
        }
    }
    impl PartialOrd for Kept {
        fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
            Some(self.cmp(other))
        }
    }
    impl PartialEq for Kept {
        fn eq(&self, other: &Self) -> bool {
            self.cmp(other) == Ordering::Equal
        }
    }
    impl Eq for Kept {}
    let mut heap: BinaryHeap<Kept> = BinaryHeap::with_capacity(k + 1);
    for (i, &x) in row.iter().enumerate() {
        if heap.len() < k {
            heap.push(Kept(x, i));
        } else if let Some(worst) = heap.peek() {
            // Later ids lose ties: better only with a larger logit.
            if x.total_cmp(&worst.0) == Ordering::Greater {
                heap.pop();
                heap.push(Kept(x, i));
            }
        }
    }
    // Ascending by `Kept`'s order is best first.
    heap.into_sorted_vec()
        .into_iter()
        .map(|kept| kept.1)
        .collect()
}

/// One continuation: its prompt, the tokens made so far, and its own
/// generator (seeded by the run's seed and the row's number, so a row
/// draws the same tokens whatever else shares its batch).
pub struct Row {
    pub prompt: Vec<u32>,
    pub made: Vec<u32>,
    pub done: bool,
    rng: rand_chacha::ChaCha8Rng,
}

impl Row {
    pub fn new(prompt: Vec<u32>, seed: u64, number: u64) -> Row {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(number);
        Row {
            prompt,
            made: Vec::new(),
            done: false,
            rng,
        }
    }
    /// The token at position `pos`, from the prompt or what was made.
    fn at(&self, pos: usize) -> u32 {
        match self.prompt.get(pos) {
            Some(&t) => t,
            None => self.made[pos - self.prompt.len()],
        }
    }
}

/// What the loop needs besides the step: when to stop and how to pick.
pub struct Limits {
    pub max_new: usize,
    pub eos: Option<u32>,
    pub sampling: Sampling,
    /// The model's vocabulary: a logits row's first `vocab` entries are
    /// its classes (any after them are padding).
    pub vocab: Option<usize>,
}

/// Time spent, for the run's last line.
#[derive(Default)]
pub struct Timing {
    pub steps: usize,
    pub made: usize,
    pub seconds: f64,
    /// Of `seconds`: feeding the step and launching it, reading its
    /// output back (the picks or the logits: the wait for the step is
    /// here), and picking the next tokens.
    pub in_step: f64,
    pub reading: f64,
    pub picking: f64,
}

impl Timing {
    /// Adds another batch's.
    pub fn add(&mut self, t: &Timing) {
        self.steps += t.steps;
        self.made += t.made;
        self.seconds += t.seconds;
        self.in_step += t.in_step;
        self.reading += t.reading;
        self.picking += t.picking;
    }
}

/// Runs `rows` (at most the step's batch; the rest of the batch repeats
/// the last row, and its output is dropped) to the end: each has
/// `max_new` tokens or stopped at the end-of-text id. `shown` is called
/// after each step with the rows (to stream a single one).
pub fn decode(
    step: &mut dyn Backend,
    prefill: Option<&mut Box<dyn Backend>>,
    batch: usize,
    rows: &mut [Row],
    limits: &Limits,
    mut shown: impl FnMut(&[Row]),
) -> Result<Timing, CliError> {
    let err = |e: fusec_runtime::RuntimeError| CliError {
        message: format!("error: {e}"),
        code: 4,
    };
    for name in step.state_names() {
        step.zero(&name).map_err(err)?;
    }
    for r in rows.iter_mut() {
        r.done = limits.max_new == 0;
    }
    let t0 = std::time::Instant::now();
    let mut timing = Timing::default();
    let longest = rows.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let positioned = step.shapes().contains_key(POSITIONS_INPUT);
    let mut pos = 0;
    if let Some(p) = prefill {
        // Its T: fewer positions than any row's prompt holds.
        let m = p.shapes().get("tokens").map_or(0, |s| s[1]);
        let tokens: Vec<f64> = (0..batch)
            .flat_map(|b| {
                rows[b.min(rows.len() - 1)].prompt[..m]
                    .iter()
                    .map(|&t| t as f64)
            })
            .collect();
        p.set("tokens", &tokens).map_err(err)?;
        if positioned {
            let at: Vec<f64> = (0..m).map(|i| i as f64).collect();
            p.set(POSITIONS_INPUT, &at).map_err(err)?;
        }
        p.step(0.0, 1).map_err(err)?;
        step.copy_state_from(p.as_ref()).map_err(err)?;
        timing.steps += 1;
        pos = m;
    }
    while rows.iter().any(|r| !r.done) {
        let tokens: Vec<f64> = (0..batch)
            .map(|b| {
                let r = &rows[b.min(rows.len() - 1)];
                // A finished row is fed its last token again: its output is unused.
                let at = pos.min(r.prompt.len() + r.made.len() - 1);
                r.at(at) as f64
            })
            .collect();
        let at = std::time::Instant::now();
        step.set("tokens", &tokens).map_err(err)?;
        if positioned {
            step.set(POSITIONS_INPUT, &[pos as f64]).map_err(err)?;
        }
        step.step(0.0, 1).map_err(err)?;
        let stepped = std::time::Instant::now();
        // A greedy step's picks, or the logits to pick from.
        let (picks, logits) = match limits.sampling.is_greedy() {
            true => (step.next_tokens().map_err(err)?, Vec::new()),
            false => (Vec::new(), step.logits().map_err(err)?),
        };
        let read = std::time::Instant::now();
        timing.in_step += (stepped - at).as_secs_f64();
        timing.reading += (read - stepped).as_secs_f64();
        let width = logits.len() / batch;
        let classes = limits.vocab.map_or(width, |v| v.min(width));
        timing.steps += 1;
        // Each row picks from its own logits with its own generator: on
        // every core, the same picks in any order. The device's picks need
        // no cores (waking the pool would cost more than taking them).
        let take = |(b, r): (usize, &mut Row)| {
            if r.done || pos + 1 < r.prompt.len() {
                return 0;
            }
            let next = match picks.get(b) {
                Some(&id) => id,
                None => {
                    let row = &logits[b * width..b * width + classes];
                    limits.sampling.pick(row, &mut r.rng)
                }
            };
            r.made.push(next);
            r.done = r.made.len() >= limits.max_new || Some(next) == limits.eos;
            1
        };
        timing.made += match picks.is_empty() {
            true => rows.par_iter_mut().enumerate().map(take).sum::<usize>(),
            false => rows.iter_mut().enumerate().map(take).sum::<usize>(),
        };
        timing.picking += read.elapsed().as_secs_f64();
        shown(rows);
        pos += 1;
        debug_assert!(pos <= longest + limits.max_new);
    }
    timing.seconds = t0.elapsed().as_secs_f64();
    Ok(timing)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Greedy takes the first most likely token; sampling keeps to top-k
    /// and top-p, and one seed draws the same tokens again.
    #[test]
    fn greedy_and_sampled_picks_keep_to_their_rules() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let row = [0.5f32, 2.0, 2.0, -1.0, 1.9];
        let greedy = Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
        };
        assert_eq!(greedy.pick(&row, &mut rng), 1);
        let top2 = Sampling {
            temperature: 1.0,
            top_k: Some(2),
            top_p: None,
        };
        let draws: Vec<u32> = (0..200).map(|_| top2.pick(&row, &mut rng)).collect();
        assert!(draws.iter().all(|&d| d == 1 || d == 2), "{draws:?}");
        assert!(draws.contains(&1) && draws.contains(&2));
        // Probabilities .315, .315, .285 of the top three: 0.5 keeps two.
        let nucleus = Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.5),
        };
        assert!((0..200).all(|_| matches!(nucleus.pick(&row, &mut rng), 1 | 2)));
        let again = |seed| {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            (0..20).map(|_| top2.pick(&row, &mut r)).collect::<Vec<_>>()
        };
        assert_eq!(again(7), again(7));
        assert_ne!(again(7), again(8));
    }

    use proptest::prelude::*;

    proptest! {
        /// The one-pass top-k keeps what sorting every id by rank keeps,
        /// in the same order: rows of few distinct values (many ties),
        /// infinities and NaNs, k from 1 past the row's length.
        #[test]
        fn top_k_is_the_sorted_ranks_first_k(
            row in prop::collection::vec(
                prop_oneof![
                    (-3i32..4).prop_map(|x| x as f32 * 0.5),
                    prop::num::f32::ANY,
                ],
                1..200,
            ),
            k in 1usize..220,
        ) {
            let k = k.min(row.len());
            let mut all: Vec<usize> = (0..row.len()).collect();
            all.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
            all.truncate(k);
            prop_assert_eq!(top_k(&row, k), all);
        }
    }
}
