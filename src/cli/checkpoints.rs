//! Checkpoints of a run: written (gathered from every rank first), and read
//! back checked against the model.

use super::open::runtime_err;
use super::CliError;
use fusec::backend::{self, Backend};
use fusec_runtime::checkpoint;
use std::collections::BTreeMap;

/// A checkpoint of the run after `step`, written to `path` where this
/// process `writes` (rank 0 of a launched job; the others only help gather
/// what their ranks keep).
pub(super) fn save(
    b: &mut dyn Backend,
    path: &std::path::Path,
    step: u64,
    extra: &BTreeMap<String, String>,
    writes: bool,
) -> Result<(), CliError> {
    b.gather_for_checkpoint().map_err(runtime_err)?;
    if !writes {
        return Ok(());
    }
    let mut ck = backend::checkpoint(b, step).map_err(runtime_err)?;
    ck.extra = extra.clone();
    checkpoint::save(path, &ck).map_err(|e| CliError {
        message: format!("error: {e}"),
        code: 3,
    })
}

/// The weights of `path`, renamed through the name map `map` where given
/// (`--name-map`), checked to hold the parameters `needed` by name and
/// shape (optimizer state riding along is passed over): what `train
/// --init-from`, `eval` and `generate` read. A problem is exit status 3
/// with the file and the tensors named.
pub(super) fn load_weights(
    path: &std::path::Path,
    map: Option<&std::path::Path>,
    needed: &[(String, Vec<usize>)],
) -> Result<checkpoint::Checkpoint, CliError> {
    let err = |e: checkpoint::CheckpointError| CliError {
        message: format!("error: {e}"),
        code: 3,
    };
    let mut ck = checkpoint::load(path).map_err(err)?;
    if let Some(map) = map {
        ck = fusec_runtime::name_map::load(map)
            .and_then(|m| m.apply(ck))
            .map_err(err)?;
    }
    checkpoint::check_weights(&ck, path, needed).map_err(err)?;
    Ok(ck)
}

/// The weights of `path` (through the name map `map`) written into the
/// parameters of `b`, checked to fit them first.
pub(super) fn restore_weights(
    b: &mut dyn Backend,
    path: &std::path::Path,
    map: Option<&std::path::Path>,
) -> Result<(), CliError> {
    let ck = load_weights(path, map, &backend::needed_params(b))?;
    backend::restore_params(b, &ck).map_err(runtime_err)
}

/// A checkpoint or weights file, checked to hold `needed` by name and shape;
/// a problem is exit status 3 with the file and the tensor named.
pub(super) fn load_checked(
    path: &std::path::Path,
    needed: &[(String, Vec<usize>)],
) -> Result<checkpoint::Checkpoint, CliError> {
    let err = |e: checkpoint::CheckpointError| CliError {
        message: format!("error: {e}"),
        code: 3,
    };
    let ck = checkpoint::load(path).map_err(err)?;
    checkpoint::check_against(&ck, path, needed).map_err(err)?;
    Ok(ck)
}
