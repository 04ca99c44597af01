//! What feeds `fusec train`'s inputs: windows of a token file prefetched
//! into page-locked buffers, or random values (`--data random`, or a fresh
//! batch every micro-batch with `random-stream`); with `--save-data`, the
//! log of what was fed.

use super::common::input_type;
use super::open::runtime_err;
use super::sentences::Kind;
use super::train_args::TrainArgs;
use super::CliError;
use fusec::backend::Backend;
use fusec_compiler::interp::round_to;
use fusec_compiler::ir::DType;
use fusec_runtime::batch_log::BatchLog;
use fusec_runtime::checkpoint::Checkpoint;
use fusec_runtime::data::{Batches, Prefetch};
use std::collections::BTreeMap;

/// The run's data source and, with `--save-data`, its log.
pub(super) struct Feed {
    pub batches: Option<Prefetch>,
    pub record: Option<BatchLog>,
    /// Sentence data (counted in batches, not windows, for a resume).
    pub sentences: bool,
}

/// Where the run stands when its data is prepared.
pub(super) struct Where<'a> {
    /// The model's data inputs (not the update's).
    pub data_inputs: &'a [String],
    /// The sizes of the whole batch (all ranks').
    pub data_dims: &'a BTreeMap<String, i64>,
    /// One rank's sizes.
    pub dims: &'a BTreeMap<String, i64>,
    pub tokens_shape: Option<&'a [usize]>,
    pub micro: u64,
    /// The first step this run takes (after a `--resume`, the next one).
    pub first: u64,
    pub resumed: Option<&'a Checkpoint>,
}

/// Checks that `--data` can feed the model's inputs and sets the source
/// up: random values set once, or a token file's windows from where a
/// resumed run stopped.
pub(super) fn prepare(args: &TrainArgs, b: &mut dyn Backend, at: &Where) -> Result<Feed, CliError> {
    let Where {
        data_inputs,
        data_dims,
        dims,
        tokens_shape,
        micro,
        first,
        resumed,
    } = *at;
    let mut batches = None;
    let mut record = args.save_data.as_ref().map(|_| {
        let mut log = BatchLog::default();
        log.note("data", &args.data);
        log.note("micro_batches", micro);
        log.note("first_step", first);
        log
    });
    let stream = args.data == RANDOM_STREAM;
    if args.tokenizer.is_some() && (args.data == "random" || stream) {
        return Err(CliError::usage(format!(
            "error: --tokenizer tokenizes the text of --data; --data {} has none",
            args.data
        )));
    }
    let sentences = Kind::of(data_inputs).filter(|_| args.data != "random" && !stream);
    if args.data_target.is_some() && sentences != Some(Kind::Pairs) {
        return Err(CliError::usage(
            "error: --data-target gives the targets of sentence pairs, and this model does not read pairs (inputs src, src_len, tgt_in, tgt_len, tgt_out)".to_string(),
        ));
    }
    if args.max_tokens.is_some() && sentences.is_none() {
        return Err(CliError::usage(
            "error: --max-tokens sets how many sentences a batch holds; this model does not read sentences (pairs: inputs src, src_len, tgt_in, tgt_len, tgt_out; labelled: tokens, lengths, labels)".to_string(),
        ));
    }
    if let Some(kind) = sentences {
        let mut src = super::sentences::prepare(kind, args, b.graph(), b.shapes(), dims)?;
        // A resumed run reads on from the batch the first run stopped at.
        if let Some(n) = resumed
            .and_then(|ck| ck.extra.get(SENTENCE_BATCHES_READ))
            .and_then(|v| v.parse().ok())
        {
            src.skip(n);
        }
        let buffers = b.batch_buffers(3, src.buffer_len()).map_err(runtime_err)?;
        return Ok(Feed {
            batches: Some(fusec_runtime::data::prefetch(Box::new(src), buffers)),
            record,
            sentences: true,
        });
    }
    if args.data == "random" || stream {
        if let Some(log) = &mut record {
            log.note(
                "reuse",
                if stream {
                    "a fresh random batch for every micro-batch"
                } else {
                    "every micro-batch of every step reads this one batch"
                },
            );
        }
        if !stream {
            feed_random(b, data_inputs, data_dims, args.seed, 0, &mut record)?;
        }
    } else {
        for need in ["tokens", "targets"] {
            if !data_inputs.iter().any(|n| n == need) {
                return Err(CliError::usage(format!(
                    "error: --data {} feeds the inputs `tokens` and `targets`, and this model has no input `{need}` (its inputs: {}); use --data random",
                    args.data,
                    data_inputs.join(", ")
                )));
            }
            // Token ids are copied to the GPU as they are read: i32.
            if let Some(ty) = input_type(b.graph(), need) {
                if ty.dtype != DType::I32 {
                    return Err(CliError::usage(format!(
                        "error: --data {} feeds token ids into `{need}`, which this model declares as {ty}; declare it as i32 (e.g. `input {need}: i32[B, T]`) or use --data random",
                        args.data
                    )));
                }
            }
        }
        // A token file has nothing for any other input to read.
        let others: Vec<&str> = data_inputs
            .iter()
            .map(String::as_str)
            .filter(|n| *n != "tokens" && *n != "targets")
            .collect();
        if !others.is_empty() {
            return Err(CliError::usage(format!(
                "error: --data {} feeds only `tokens` and `targets`, and this model also has the input{} {}; use --data random (random values for every input)",
                args.data,
                if others.len() == 1 { "" } else { "s" },
                others.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
            )));
        }
        // Windows of the data, shaped as the model's `tokens` input.
        let (bsz, t) = match tokens_shape {
            Some(&[bsz, t]) => (bsz, t),
            other => {
                return Err(CliError::usage(format!(
                    "error: --data {} cuts the data into [batch, sequence] windows, and this model's `tokens` input has shape {:?}; use --data random",
                    args.data,
                    other.unwrap_or(&[])
                )))
            }
        };
        // Each window's targets are its tokens shifted by one: same shape.
        let targets_shape = b.shapes().get("targets").cloned();
        if targets_shape.as_deref() != tokens_shape {
            return Err(CliError::usage(format!(
                "error: --data {} feeds `targets` a window shaped as `tokens` {:?}, and this model's `targets` has shape {:?}; declare both with the same shape or use --data random",
                args.data,
                tokens_shape.unwrap_or(&[]),
                targets_shape.as_deref().unwrap_or(&[])
            )));
        }
        let tokens = super::tokenize::read_tokens(
            std::path::Path::new(&args.data),
            args.tokenizer.as_deref(),
        )?;
        let vocab = token_bound(b.graph(), dims);
        let text = args.tokenizer.is_none() && !args.data.ends_with(".bin");
        let mut src = Batches::new(tokens, bsz, t, vocab).map_err(|e| CliError {
            message: match vocab {
                Some(v) if text && v < 256 => format!(
                    "error: {}: {e}\n(a file that is not a .bin shard is read as bytes, ids 0 to 255: the model needs a vocabulary of at least 256, e.g. --set vocab=256)",
                    args.data
                ),
                _ => format!("error: {}: {e}", args.data),
            },
            code: 3,
        })?;
        // A resumed run reads on from where the first run stopped.
        // (By windows where the checkpoint counts them: the first run may
        // have had another batch or number of GPUs.)
        match resumed
            .as_ref()
            .and_then(|ck| ck.extra.get(WINDOWS_READ))
            .and_then(|v| v.parse().ok())
        {
            Some(windows) => src.skip_windows(windows),
            None => {
                for _ in 0..(first - 1) * micro {
                    src.next_batch();
                }
            }
        }
        // Three page-locked buffers: one being copied to the GPU, two
        // filled ahead by the data thread.
        let buffers = b.batch_buffers(3, src.buffer_len()).map_err(runtime_err)?;
        batches = Some(src.prefetch(buffers));
    }
    Ok(Feed {
        batches,
        record,
        sentences: false,
    })
}

/// The checkpoint's count of sentence batches read.
pub(super) const SENTENCE_BATCHES_READ: &str = "sentence_batches_read";

/// Random values for every data input, batch `batch` of `seed` (batch 0 is
/// `--data random`'s one batch), written to the step and to `--save-data`.
pub(super) fn feed_random(
    b: &mut dyn Backend,
    data_inputs: &[String],
    dims: &BTreeMap<String, i64>,
    seed: u64,
    batch: u64,
    record: &mut Option<BatchLog>,
) -> Result<(), CliError> {
    let dmap = dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
    let feeds = fusec_compiler::interp::random::random_inputs(b.graph(), &dmap, seed, batch)
        .map_err(|e| CliError::usage(format!("error: {}", e.0)))?;
    for name in data_inputs {
        let (values, shape) = (&feeds.inputs[name].data, &feeds.inputs[name].shape);
        b.set(name, values).map_err(runtime_err)?;
        if let Some(log) = record {
            let dtype = input_type(b.graph(), name).map_or(DType::F32, |t| t.dtype);
            let pushed = if dtype == DType::I32 {
                let ids: Vec<i32> = values.iter().map(|&x| x as i32).collect();
                log.push_i32(name, shape, &ids)
            } else {
                // As the step reads it: rounded to the input's dtype.
                let stored: Vec<f64> = values.iter().map(|&x| round_to(dtype, x)).collect();
                log.push_f32(name, shape, &stored)
            };
            pushed.map_err(|e| CliError::usage(format!("error: --save-data: {e}")))?;
        }
    }
    Ok(())
}

/// The bound token ids must respect: the embedding's rows.
pub(super) fn token_bound(
    g: &fusec_compiler::ir::Graph,
    dims: &BTreeMap<String, i64>,
) -> Option<u32> {
    super::sentences::bound_of(g, "tokens", dims)
}

/// The checkpoint entry counting the token file's windows read so far.
pub(super) const WINDOWS_READ: &str = "windows_read";

/// `--data random-stream`: a new random batch for every micro-batch.
pub(super) const RANDOM_STREAM: &str = "random-stream";
