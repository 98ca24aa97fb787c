//! Opening a shard of a bundle's routed experts: the blobs a node serves (or, in single-node
//! mode, all of them), each verified against the manifest before use.
//!
//! A node opens only the experts its placement assigns; the coordinator opens only
//! `coordinator.gguf`. Both go through the same manifest checks (`ternfleet_shared::bundle`):
//! size and SHA-256 of every part, then that the blob is the one the manifest describes (its
//! layer and expert keys, every tensor's type and shape).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;
use ternfleet_shared::bundle::{BundleError, ExpertPart, Manifest, VerifiedParts};
use ternfleet_shared::compute::{ComputeError, Linear};
use ternfleet_shared::gguf::{GgufError, GgufFile};

use crate::expert::{Activation, FfnWeights};

/// Metadata keys of an expert blob naming its place in the model.
pub const BLOB_LAYER_KEY: &str = "ternfleet.bundle.layer";
pub const BLOB_EXPERT_KEY: &str = "ternfleet.bundle.expert";
/// Tensor names inside an expert blob.
pub const BLOB_TENSORS: [&str; 3] = ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"];

/// Errors opening a shard.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error("{path}: {err}")]
    Gguf { path: PathBuf, err: GgufError },
    #[error("{path}: {err}")]
    Tensor { path: PathBuf, err: ComputeError },
}

/// How the experts of a bundle compute.
#[derive(Clone, Copy, Debug)]
pub struct ExpertShape {
    pub n_embd: usize,
    pub n_ff: usize,
    pub act: Activation,
    /// Routed experts (llama.cpp's MUL_MAT_ID order in parity mode), see [`FfnWeights::routed`].
    pub routed: bool,
}

fn mismatch(path: &Path, msg: String) -> ShardError {
    ShardError::Bundle(BundleError::Mismatch {
        path: path.to_owned(),
        msg,
    })
}

/// Verifies and opens one expert blob.
pub fn open_expert(
    dir: &Path,
    e: &ExpertPart,
    shape: ExpertShape,
) -> Result<FfnWeights, ShardError> {
    open_expert_with(dir, e, shape, &VerifiedParts::open(None, dir))
}

/// [`open_expert`], hashing the blob only when `verified` does not remember it unchanged.
pub fn open_expert_with(
    dir: &Path,
    e: &ExpertPart,
    shape: ExpertShape,
    verified: &VerifiedParts,
) -> Result<FfnWeights, ShardError> {
    let (path, _) = verified.verify(dir, &e.part)?;
    let f = Arc::new(GgufFile::open(&path).map_err(|err| ShardError::Gguf {
        path: path.clone(),
        err,
    })?);
    let at = |k: &str| f.get_u32(k).ok().flatten().map(|v| v as usize);
    if at(BLOB_LAYER_KEY) != Some(e.layer) || at(BLOB_EXPERT_KEY) != Some(e.expert) {
        return Err(mismatch(
            &path,
            format!(
                "the blob says layer {:?} expert {:?}, the manifest layer {} expert {}",
                at(BLOB_LAYER_KEY),
                at(BLOB_EXPERT_KEY),
                e.layer,
                e.expert
            ),
        ));
    }
    for t in &e.tensors {
        let got = f.tensor(&t.name).map(|i| (i.ty.name(), i.dims.clone()));
        if got != Some((t.ty.as_str(), t.dims.clone())) {
            return Err(mismatch(
                &path,
                format!(
                    "tensor {} is {got:?}, the manifest says {} {:?}",
                    t.name, t.ty, t.dims
                ),
            ));
        }
    }
    let (d, ff) = (shape.n_embd, shape.n_ff);
    let linear = |name: &str, cols: usize, rows: usize| -> Result<Linear, ShardError> {
        let info = f
            .tensor(name)
            .ok_or_else(|| mismatch(&path, format!("no tensor {name}")))?;
        let lin = Linear::new(&f, info).map_err(|err| ShardError::Tensor {
            path: path.clone(),
            err,
        })?;
        if (lin.cols(), lin.rows()) != (cols, rows) {
            return Err(mismatch(
                &path,
                format!(
                    "{name} is {} x {}, the model needs {cols} x {rows}",
                    lin.cols(),
                    lin.rows()
                ),
            ));
        }
        Ok(lin)
    };
    Ok(FfnWeights {
        gate: linear(BLOB_TENSORS[0], d, ff)?,
        up: linear(BLOB_TENSORS[1], d, ff)?,
        down: linear(BLOB_TENSORS[2], ff, d)?,
        act: shape.act,
        routed: shape.routed,
    })
}

/// Opens the manifest's experts that `mine(layer, expert)` selects, verified, in parallel; in
/// manifest order (layer-major, expert order within a layer).
pub fn open_experts(
    dir: &Path,
    man: &Manifest,
    shape: ExpertShape,
    mine: impl Fn(usize, usize) -> bool + Sync,
) -> Result<Vec<(usize, usize, FfnWeights)>, ShardError> {
    open_experts_with(dir, man, shape, mine, &VerifiedParts::open(None, dir))
}

/// [`open_experts`] with a memory of verified blobs (a node's `--state-dir`).
pub fn open_experts_with(
    dir: &Path,
    man: &Manifest,
    shape: ExpertShape,
    mine: impl Fn(usize, usize) -> bool + Sync,
    verified: &VerifiedParts,
) -> Result<Vec<(usize, usize, FfnWeights)>, ShardError> {
    man.experts
        .par_iter()
        .filter(|e| mine(e.layer, e.expert))
        .map(|e| open_expert_with(dir, e, shape, verified).map(|w| (e.layer, e.expert, w)))
        .collect()
}
