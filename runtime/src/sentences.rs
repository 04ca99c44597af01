//! Batches of sentences: sentence pairs for a translator and labelled
//! sentences for a classifier, already tokenized. The step's shapes are
//! fixed when it compiles, so every batch is padded to them (`S` and `T`);
//! the lengths go to the step as inputs, where they mask the padded keys
//! in attention, and padded targets carry the loss's `ignore_index`.
//!
//! Sentences are batched with others of similar length (bucketing, as
//! torchtext's `BucketIterator` and fairseq do): each epoch shuffles them,
//! takes pools of a hundred batches, sorts each pool by length, cuts it
//! into batches and shuffles the batches. With a budget of padded tokens
//! a batch holds as many sentences as fit (fairseq's `--max-tokens`:
//! sentences x the longest of them), at most the step's rows; rows left
//! over are empty (length 0, nothing counted).

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// One example, token ids without padding.
#[derive(Clone, Debug, PartialEq)]
pub enum Example {
    /// A translator's pair: the source (its end token included) and the
    /// target as the decoder reads it (`tgt_in`, starting with the begin
    /// token) and predicts it (`tgt_out`, ending with the end token).
    Pair {
        src: Vec<u32>,
        tgt_in: Vec<u32>,
        tgt_out: Vec<u32>,
    },
    /// A classifier's sentence and its class.
    Labelled { tokens: Vec<u32>, label: u32 },
}

impl Example {
    /// What bucketing sorts by and the budget counts: the longer side.
    fn length(&self) -> usize {
        match self {
            Example::Pair { src, tgt_in, .. } => src.len().max(tgt_in.len()),
            Example::Labelled { tokens, .. } => tokens.len(),
        }
    }

    /// Tokens fed that are not padding.
    fn real(&self) -> u64 {
        match self {
            Example::Pair { src, tgt_in, .. } => (src.len() + tgt_in.len()) as u64,
            Example::Labelled { tokens, .. } => tokens.len() as u64,
        }
    }
}

/// The step's shapes and what fills the padding.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Rows of a batch (the step's `B`).
    pub rows: usize,
    /// Pairs: the source's padded length `S` (unused for labelled sentences).
    pub src_len: usize,
    /// The target's (pairs) or the sentence's (labelled) padded length `T`.
    pub len: usize,
    /// The id that pads token inputs.
    pub pad: i32,
    /// The target that the loss ignores: padded targets, and the labels
    /// of empty rows. None where the loss ignores none (then every row
    /// must hold a sentence).
    pub ignore: Option<i32>,
    /// Labelled sentences: the model also has `segment_ids` (zeros).
    pub segments: bool,
    /// A budget of padded tokens a batch (see the module's note).
    pub max_tokens: Option<usize>,
}

/// Why the examples cannot fill the step's batches.
#[derive(Debug, PartialEq)]
pub struct BatchError(pub String);

/// Sentence batches, epoch after epoch.
pub struct SentenceBatches {
    examples: Vec<Example>,
    layout: Layout,
    seed: u64,
    epoch: u64,
    /// This epoch's batches (indices into `examples`) and the next one's place.
    order: Vec<Vec<usize>>,
    next: usize,
    /// Batches handed out since the first epoch began.
    pub read: u64,
}

impl SentenceBatches {
    /// Checks that every example fits the step's shapes and that a batch
    /// can be formed.
    pub fn new(examples: Vec<Example>, layout: Layout, seed: u64) -> Result<Self, BatchError> {
        if examples.is_empty() {
            return Err(BatchError("the data holds no sentences".into()));
        }
        if layout.rows == 0 {
            return Err(BatchError(
                "a batch of 0 rows holds no sentence (--batch)".into(),
            ));
        }
        if layout.ignore.is_none() && layout.max_tokens.is_some() {
            return Err(BatchError(
                "a token budget leaves rows empty, and the loss has no ignore_index for their targets: add `ignore_index = N` to the model's cross_entropy, or drop the budget".into(),
            ));
        }
        if let Some(budget) = layout.max_tokens {
            let longest = examples.iter().map(Example::length).max().unwrap_or(0);
            if budget < longest {
                return Err(BatchError(format!(
                    "the token budget {budget} is below the longest sentence ({longest} tokens): no batch could hold it"
                )));
            }
        }
        let mut me = SentenceBatches {
            examples,
            layout,
            seed,
            epoch: 0,
            order: Vec::new(),
            next: 0,
            read: 0,
        };
        me.plan_epoch();
        Ok(me)
    }

    /// Examples a batch buffer's values hold, input by input.
    pub fn names(&self) -> Vec<&'static str> {
        match (&self.examples[0], self.layout.segments) {
            (Example::Pair { .. }, _) => vec!["src", "src_len", "tgt_in", "tgt_len", "tgt_out"],
            (Example::Labelled { .. }, false) => vec!["tokens", "lengths", "labels"],
            (Example::Labelled { .. }, true) => vec!["tokens", "lengths", "labels", "segment_ids"],
        }
    }

    /// Each input's shape, in the order of [`names`](Self::names).
    pub fn shapes(&self) -> Vec<Vec<usize>> {
        let (b, s, t) = (self.layout.rows, self.layout.src_len, self.layout.len);
        self.names()
            .iter()
            .map(|n| match *n {
                "src" => vec![b, s],
                "tgt_in" | "tgt_out" | "tokens" | "segment_ids" => vec![b, t],
                _ => vec![b],
            })
            .collect()
    }

    /// The epoch's batches: shuffled, pooled, sorted, cut, shuffled again.
    fn plan_epoch(&mut self) {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ self.epoch.wrapping_mul(0x9e37_79b9));
        let mut idx: Vec<usize> = (0..self.examples.len()).collect();
        idx.shuffle(&mut rng);
        if self.layout.max_tokens.is_none() {
            // Whole batches only: the last is topped up from the epoch's start.
            let rows = self.layout.rows;
            let short = (rows - idx.len() % rows) % rows;
            let top: Vec<usize> = idx.iter().cycle().take(short).copied().collect();
            idx.extend(top);
        }
        let pool = self.layout.rows * 100;
        let mut order = Vec::new();
        for chunk in idx.chunks(pool) {
            let mut chunk = chunk.to_vec();
            chunk.sort_by_key(|&i| self.examples[i].length());
            let mut batches = self.cut(&chunk);
            batches.shuffle(&mut rng);
            order.extend(batches);
        }
        self.order = order;
        self.next = 0;
    }

    /// Sorted examples cut into batches: `rows` each, or as many as the
    /// budget allows.
    fn cut(&self, sorted: &[usize]) -> Vec<Vec<usize>> {
        let rows = self.layout.rows;
        let Some(budget) = self.layout.max_tokens else {
            return sorted.chunks(rows).map(<[usize]>::to_vec).collect();
        };
        let mut out: Vec<Vec<usize>> = Vec::new();
        let mut cur: Vec<usize> = Vec::new();
        let mut longest = 0;
        for &i in sorted {
            let len = self.examples[i].length();
            let fits = (cur.len() + 1) * longest.max(len) <= budget && cur.len() < rows;
            if !fits && !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
                longest = 0;
            }
            longest = longest.max(len);
            cur.push(i);
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    }

    /// The next batch's examples.
    fn next_batch(&mut self) -> Vec<usize> {
        if self.next == self.order.len() {
            self.epoch += 1;
            self.plan_epoch();
        }
        let batch = self.order[self.next].clone();
        self.next += 1;
        self.read += 1;
        batch
    }

    /// Moves past `n` batches, as reading them would.
    pub fn skip(&mut self, n: u64) {
        for _ in 0..n {
            self.next_batch();
        }
    }

    /// Values in one batch buffer.
    pub fn buffer_len(&self) -> usize {
        self.shapes()
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    /// Writes the next batch into `out` (inputs in the order of `names`);
    /// returns its tokens that are not padding.
    pub fn fill(&mut self, out: &mut [i32]) -> u64 {
        let batch = self.next_batch();
        let l = &self.layout;
        let (b, s, t) = (l.rows, l.src_len, l.len);
        let ignore = l.ignore.unwrap_or(l.pad);
        let mut real = 0;
        let (mut at, mut parts) = (0, Vec::new());
        for shape in self.shapes() {
            let n: usize = shape.iter().product();
            parts.push(at..at + n);
            at += n;
        }
        assert_eq!(at, out.len(), "a batch buffer holds the batch's inputs");
        // Empty rows: padding everywhere, length 0, targets ignored.
        for (k, r) in parts.iter().enumerate() {
            let fill = match self.names()[k] {
                "src_len" | "tgt_len" | "lengths" | "segment_ids" => 0,
                "tgt_out" | "labels" => ignore,
                _ => l.pad,
            };
            out[r.clone()].fill(fill);
        }
        let put = |out: &mut [i32],
                   part: &std::ops::Range<usize>,
                   row: usize,
                   width: usize,
                   ids: &[u32]| {
            let base = part.start + row * width;
            for (j, &x) in ids.iter().enumerate() {
                out[base + j] = x as i32;
            }
        };
        for (row, &i) in batch.iter().enumerate() {
            let e = &self.examples[i];
            real += e.real();
            match e {
                Example::Pair {
                    src,
                    tgt_in,
                    tgt_out,
                } => {
                    put(out, &parts[0], row, s, src);
                    out[parts[1].start + row] = src.len() as i32;
                    put(out, &parts[2], row, t, tgt_in);
                    out[parts[3].start + row] = tgt_in.len() as i32;
                    put(out, &parts[4], row, t, tgt_out);
                }
                Example::Labelled { tokens, label } => {
                    put(out, &parts[0], row, t, tokens);
                    out[parts[1].start + row] = tokens.len() as i32;
                    out[parts[2].start + row] = *label as i32;
                }
            }
        }
        debug_assert!(batch.len() <= b);
        real
    }
}

impl crate::data::Source for SentenceBatches {
    fn names(&self) -> Vec<&'static str> {
        SentenceBatches::names(self)
    }
    fn buffer_len(&self) -> usize {
        SentenceBatches::buffer_len(self)
    }
    fn fill(&mut self, out: &mut [i32]) -> u64 {
        SentenceBatches::fill(self, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(n: usize, m: usize) -> Example {
        Example::Pair {
            src: vec![5; n],
            tgt_in: std::iter::once(1)
                .chain(std::iter::repeat_n(6, m - 1))
                .collect(),
            tgt_out: std::iter::repeat_n(6, m - 1)
                .chain(std::iter::once(2))
                .collect(),
        }
    }

    fn layout(rows: usize, budget: Option<usize>) -> Layout {
        Layout {
            rows,
            src_len: 8,
            len: 6,
            pad: 0,
            ignore: Some(-1),
            segments: false,
            max_tokens: budget,
        }
    }

    #[test]
    fn a_pair_batch_is_padded_and_its_lengths_and_ignored_targets_are_set() {
        let mut src = SentenceBatches::new(vec![pair(3, 2)], layout(2, Some(8)), 0).unwrap();
        let mut buf = vec![99; src.buffer_len()];
        let real = src.fill(&mut buf);
        assert_eq!(real, 5);
        let (s, rest) = buf.split_at(16);
        assert_eq!(s, &[5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&rest[..2], &[3, 0], "src_len; the empty row has length 0");
        assert_eq!(&rest[2..14], &[1, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&rest[14..16], &[2, 0], "tgt_len");
        assert_eq!(&rest[16..], &[6, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]);
    }

    #[test]
    fn buckets_hold_similar_lengths_and_every_sentence_comes_once_an_epoch() {
        let examples: Vec<Example> = (0..400).map(|i| pair(1 + i % 7, 1 + (i * 3) % 5)).collect();
        let mut src = SentenceBatches::new(examples.clone(), layout(4, None), 7).unwrap();
        let mut seen = vec![0; examples.len()];
        let mut spread = 0;
        for _ in 0..100 {
            let batch = src.next_batch();
            let lens: Vec<usize> = batch.iter().map(|&i| examples[i].length()).collect();
            spread += lens.iter().max().unwrap() - lens.iter().min().unwrap();
            for i in batch {
                seen[i] += 1;
            }
        }
        assert!(
            seen.iter().all(|&n| n == 1),
            "one epoch reads each pair once"
        );
        // Lengths 1..=7 in pools of 400 sorted: a batch of 4 spans at most
        // one step of length, so 100 batches add up to well under 100.
        assert!(spread <= 10, "batches mix lengths: total spread {spread}");
        // The same seed gives the same batches; skipping lands where reading does.
        let mut again = SentenceBatches::new(examples.clone(), layout(4, None), 7).unwrap();
        again.skip(100);
        let mut on = src;
        assert_eq!(on.next_batch(), again.next_batch());
    }

    #[test]
    fn a_token_budget_takes_as_many_sentences_as_fit() {
        let examples: Vec<Example> = (0..50).map(|i| pair(2 + i % 5, 2)).collect();
        let mut src = SentenceBatches::new(examples.clone(), layout(16, Some(12)), 1).unwrap();
        let mut used = 0;
        for _ in 0..30 {
            let batch = src.next_batch();
            let longest = batch.iter().map(|&i| examples[i].length()).max().unwrap();
            assert!(batch.len() * longest <= 12, "{} x {longest}", batch.len());
            used += batch.len() * longest;
        }
        // Sorted lengths fill most of each budget (a batch closes early
        // only where the length steps up).
        assert!(
            used * 10 >= 30 * 12 * 7,
            "{used} of {} padded tokens",
            30 * 12
        );
        let e = SentenceBatches::new(examples.clone(), layout(4, Some(3)), 1)
            .err()
            .unwrap();
        assert!(
            e.0.contains("below the longest sentence (6 tokens)"),
            "{}",
            e.0
        );
        let mut no_ignore = layout(4, Some(12));
        no_ignore.ignore = None;
        let e = SentenceBatches::new(examples, no_ignore, 1).err().unwrap();
        assert!(e.0.contains("ignore_index"), "{}", e.0);
    }

    #[test]
    fn labelled_sentences_fill_tokens_lengths_labels_and_segments() {
        let ex = vec![Example::Labelled {
            tokens: vec![3, 9, 4],
            label: 1,
        }];
        let mut l = layout(2, None);
        l.len = 4;
        l.segments = true;
        l.ignore = Some(-100);
        l.max_tokens = Some(8);
        let mut src = SentenceBatches::new(ex, l, 0).unwrap();
        assert_eq!(
            src.names(),
            vec!["tokens", "lengths", "labels", "segment_ids"]
        );
        let mut buf = vec![7; src.buffer_len()];
        // Two rows, one sentence and a budget: the second row is empty and
        // ignored (without a budget it would repeat the sentence).
        assert_eq!(src.fill(&mut buf), 3);
        assert_eq!(&buf[..8], &[3, 9, 4, 0, 0, 0, 0, 0]);
        assert_eq!(&buf[8..12], &[3, 0, 1, -100]);
        assert_eq!(&buf[12..], &[0; 8]);
    }
}
