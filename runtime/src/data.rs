//! Training data: token shards in llm.c's `.bin` format (a header of 256
//! little-endian i32 — magic 20240520, version 1, token count — then uint16
//! tokens) and plain text read as bytes (one token per byte, vocabulary
//! 256). Batches are windows of T + 1 tokens: the first T are the inputs,
//! the last T the targets. A background thread writes the next batches
//! into a small pool of host buffers (page-locked on a GPU, see
//! `stage::HostBuf`) while the GPU runs the current step.

use crate::stage::HostBuf;
use std::path::Path;
use std::sync::mpsc;

pub const MAGIC: i32 = 20240520;

#[derive(Debug)]
pub struct DataError(pub String);

impl std::fmt::Display for DataError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DataError {}

/// Every token of a data file.
pub fn load_tokens(path: &Path) -> Result<Vec<u32>, DataError> {
    let bytes = std::fs::read(path)
        .map_err(|e| DataError(format!("cannot read the data file {}: {e}", path.display())))?;
    if path.extension().is_some_and(|e| e == "bin") {
        parse_bin(&bytes).map_err(|m| DataError(format!("{}: {m}", path.display())))
    } else {
        if bytes.is_empty() {
            return Err(DataError(format!("{}: the file is empty", path.display())));
        }
        Ok(bytes.iter().map(|&b| b as u32).collect())
    }
}

/// An llm.c token shard.
pub fn parse_bin(bytes: &[u8]) -> Result<Vec<u32>, String> {
    if bytes.len() < 1024 {
        return Err(format!(
            "too short for an llm.c token shard ({} bytes; the header alone is 1024)",
            bytes.len()
        ));
    }
    let header: Vec<i32> = bytes[..1024]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if header[0] != MAGIC {
        return Err(format!(
            "not an llm.c token shard (magic {}, expected {MAGIC}); plain text must not end in .bin",
            header[0]
        ));
    }
    if header[1] != 1 {
        return Err(format!(
            "token shard version {} (only version 1, uint16 tokens, is read)",
            header[1]
        ));
    }
    let count = usize::try_from(header[2]).map_err(|_| "negative token count".to_string())?;
    let body = &bytes[1024..];
    if body.len() < count * 2 {
        return Err(format!(
            "truncated: the header promises {count} tokens ({} bytes), the file has {} bytes after it",
            count * 2,
            body.len()
        ));
    }
    Ok(body[..count * 2]
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
        .collect())
}

/// Writes tokens as an llm.c shard (for tests and examples).
pub fn write_bin(path: &Path, tokens: &[u16]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(1024 + tokens.len() * 2);
    let mut header = [0i32; 256];
    header[0] = MAGIC;
    header[1] = 1;
    header[2] = tokens.len() as i32;
    for h in header {
        out.extend_from_slice(&h.to_le_bytes());
    }
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    std::fs::write(path, out)
}

/// One batch: inputs and targets, each B*T tokens, row-major [B, T].
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub inputs: Vec<i32>,
    pub targets: Vec<i32>,
}

/// Consecutive windows through the tokens, wrapping around at the end.
pub struct Batches {
    tokens: Vec<u32>,
    b: usize,
    t: usize,
    pos: usize,
}

impl Batches {
    /// Checks that the data can fill a batch and that every token is below
    /// `vocab` (the model's embedding rows).
    pub fn new(
        tokens: Vec<u32>,
        b: usize,
        t: usize,
        vocab: Option<u32>,
    ) -> Result<Batches, DataError> {
        if tokens.len() < t + 1 {
            return Err(DataError(format!(
                "the data has {} tokens; one sequence needs T + 1 = {}",
                tokens.len(),
                t + 1
            )));
        }
        if let Some(v) = vocab {
            if let Some((i, bad)) = tokens.iter().enumerate().find(|(_, &x)| x >= v) {
                return Err(DataError(format!(
                    "token {bad} at position {i} is outside the model's vocabulary of {v}"
                )));
            }
        }
        Ok(Batches {
            tokens,
            b,
            t,
            pos: 0,
        })
    }

    pub fn next_batch(&mut self) -> Batch {
        let mut inputs = vec![0; self.buffer_len()];
        self.fill(&mut inputs);
        let targets = inputs.split_off(self.b * self.t);
        Batch { inputs, targets }
    }

    /// Writes the next batch into `out`: the B*T inputs, then the B*T targets.
    pub fn fill(&mut self, out: &mut [i32]) {
        let (b, t) = (self.b, self.t);
        assert_eq!(
            out.len(),
            2 * b * t,
            "a batch buffer holds inputs and targets"
        );
        let (inputs, targets) = out.split_at_mut(b * t);
        for r in 0..b {
            if self.pos + t + 1 > self.tokens.len() {
                self.pos = 0;
            }
            let w = &self.tokens[self.pos..self.pos + t + 1];
            for (i, &x) in w[..t].iter().enumerate() {
                inputs[r * t + i] = x as i32;
            }
            for (i, &x) in w[1..].iter().enumerate() {
                targets[r * t + i] = x as i32;
            }
            self.pos += t;
        }
    }

    /// Moves past `n` windows, as `n / B` batches would (any `n`: a run
    /// resumed with another batch or number of GPUs reads on from the same
    /// window).
    pub fn skip_windows(&mut self, n: u64) {
        let t = self.t;
        // Windows repeat with the data's period: skip whole laps at once.
        let per_lap = (self.tokens.len() - 1) / t;
        let n = if self.pos == 0 && per_lap > 0 {
            n % per_lap as u64
        } else {
            n
        };
        for _ in 0..n {
            if self.pos + t + 1 > self.tokens.len() {
                self.pos = 0;
            }
            self.pos += t;
        }
    }

    /// Values in one batch buffer: inputs and targets.
    pub fn buffer_len(&self) -> usize {
        2 * self.b * self.t
    }

    /// The batches, written on a background thread (see [`prefetch`]).
    pub fn prefetch(self, buffers: Vec<HostBuf>) -> Prefetch {
        prefetch(Box::new(self), buffers)
    }
}

/// What fills a batch buffer: the named i32 inputs' values, one after
/// the other, in the order `names` gives.
pub trait Source: Send {
    /// The inputs a buffer holds, in order.
    fn names(&self) -> Vec<&'static str>;
    /// Values in one batch buffer.
    fn buffer_len(&self) -> usize;
    /// Writes the next batch into `out`; returns the tokens in it that are
    /// not padding.
    fn fill(&mut self, out: &mut [i32]) -> u64;
}

impl Source for Batches {
    fn names(&self) -> Vec<&'static str> {
        vec!["tokens", "targets"]
    }
    fn buffer_len(&self) -> usize {
        Batches::buffer_len(self)
    }
    fn fill(&mut self, out: &mut [i32]) -> u64 {
        Batches::fill(self, out);
        (self.b * self.t) as u64
    }
}

/// The batches of `src`, written on a background thread into `buffers`
/// (each `buffer_len` long) in turn: as many batches ready ahead as there
/// are buffers the consumer has given back.
pub fn prefetch(mut src: Box<dyn Source>, buffers: Vec<HostBuf>) -> Prefetch {
    let (full_tx, full) = mpsc::channel();
    let (free, free_rx) = mpsc::channel::<HostBuf>();
    for b in buffers {
        let _ = free.send(b);
    }
    let names = src.names();
    std::thread::spawn(move || {
        for mut buf in free_rx {
            let len = src.buffer_len();
            let filled = match buf.write() {
                Ok(v) if v.len() == len => {
                    let real = src.fill(v);
                    Ok(Filled { buf, real })
                }
                Ok(v) => Err(DataError(format!(
                    "a batch buffer holds {} values, a batch {len}",
                    v.len()
                ))),
                Err(e) => Err(DataError(format!("cannot write a batch buffer: {e}"))),
            };
            if full_tx.send(filled).is_err() {
                break;
            }
        }
    });
    Prefetch { full, free, names }
}

/// A batch buffer filled, and its tokens that are not padding.
pub struct Filled {
    pub buf: HostBuf,
    pub real: u64,
}

/// Batches prepared ahead on a background thread (`Batches::prefetch`).
pub struct Prefetch {
    full: mpsc::Receiver<Result<Filled, DataError>>,
    free: mpsc::Sender<HostBuf>,
    /// The inputs each buffer holds, in order.
    pub names: Vec<&'static str>,
}

impl Prefetch {
    /// The next batch, waiting for the thread if it is not ready yet.
    pub fn next(&self) -> Result<Filled, DataError> {
        self.full
            .recv()
            .map_err(|_| DataError("the data thread stopped".into()))?
    }

    /// Hands a buffer back to be filled again (the thread waits for any
    /// copy from it to finish before writing).
    pub fn give_back(&self, buf: HostBuf) {
        let _ = self.free.send(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_round_trip_and_bad_ones_are_named() {
        let dir = std::env::temp_dir().join(format!("fusec-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.bin");
        write_bin(&p, &[1, 2, 3, 65535]).unwrap();
        assert_eq!(load_tokens(&p).unwrap(), vec![1, 2, 3, 65535]);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes.truncate(1024 + 5);
        let e = parse_bin(&bytes).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
        bytes[..4].copy_from_slice(&7i32.to_le_bytes());
        assert!(parse_bin(&bytes).unwrap_err().contains("magic 7"));
        assert!(parse_bin(b"short").unwrap_err().contains("too short"));
        let missing = load_tokens(&dir.join("none.bin")).unwrap_err().0;
        assert!(missing.contains("cannot read"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn batches_are_shifted_windows_and_wrap() {
        let tokens: Vec<u32> = (0..10).collect();
        let mut b = Batches::new(tokens, 2, 3, Some(10)).unwrap();
        let x = b.next_batch();
        assert_eq!(x.inputs, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(x.targets, vec![1, 2, 3, 4, 5, 6]);
        let y = b.next_batch();
        assert_eq!(y.inputs, vec![6, 7, 8, 0, 1, 2]);
        let mut buf = vec![0; b.buffer_len()];
        b.fill(&mut buf);
        assert_eq!(buf, vec![3, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 9]);
        assert!(Batches::new(vec![1, 2], 1, 3, None).is_err());
        let e = Batches::new(vec![1, 300, 2, 3, 4], 1, 3, Some(256))
            .err()
            .unwrap()
            .0;
        assert!(e.contains("token 300 at position 1"), "{e}");
    }

    #[test]
    fn skipping_windows_lands_where_reading_them_would() {
        let tokens: Vec<u32> = (0..103).map(|x| x % 50).collect();
        for skip in [0u64, 1, 5, 7, 33, 34, 1000] {
            // One batch of 1 row per window read, against one skip.
            let mut read = Batches::new(tokens.clone(), 1, 3, None).unwrap();
            for _ in 0..skip {
                read.next_batch();
            }
            let mut jumped = Batches::new(tokens.clone(), 2, 3, None).unwrap();
            jumped.skip_windows(skip);
            let a = read.next_batch();
            let b = jumped.next_batch();
            assert_eq!(a.inputs[..], b.inputs[..3], "after {skip} windows");
        }
    }

    #[test]
    fn prefetch_keeps_order_with_few_buffers() {
        // Two buffers for ten batches: each is refilled only after it is
        // given back, and the batches come in the order `next_batch` gives.
        let tokens: Vec<u32> = (0..97).collect();
        let mut serial = Batches::new(tokens.clone(), 3, 5, None).unwrap();
        let src = Batches::new(tokens, 3, 5, None).unwrap();
        let len = src.buffer_len();
        let pf = src.prefetch(vec![
            HostBuf::Plain(vec![-1; len]),
            HostBuf::Plain(vec![-1; len]),
        ]);
        for _ in 0..10 {
            let want = serial.next_batch();
            let got = pf.next().unwrap();
            assert_eq!(got.real, 15);
            let got = got.buf;
            let v = got.read().unwrap();
            assert_eq!(v[..15], want.inputs[..]);
            assert_eq!(v[15..], want.targets[..]);
            pf.give_back(got);
        }
    }
}
