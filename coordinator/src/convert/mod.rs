//! `ternfleet convert`: a GGUF model to a bundle (`ternfleet_shared::bundle`).
//!
//! - A native MoE model (qwen3moe, qwen2moe, Mixtral-style llama) is split as it is: each
//!   expert's slices of the stacked `ffn_*_exps` tensors become one blob; no calibration.
//! - A dense model (gemma3, llama, qwen2, qwen3) is MoEfied with `--experts E`: each FFN's
//!   neurons are clustered into E equal experts by co-activation on a calibration text and a
//!   linear router is fitted per layer ([`moefy`]).
//! - `--expert-type` converts the routed experts' weights (BitNet b1.58 ternary: tq2_0 / tq1_0,
//!   llama.cpp-compatible, or ternfleet's tf2 / tf1 with 128-wide blocks); routers, attention,
//!   embeddings, the LM head and shared experts keep their types.
//!
//! Every part is written to a temporary name and renamed, its checksum recorded in a journal,
//! and the manifest written last: an interrupted conversion leaves no manifest (the bundle will
//! not load), and running the same command again skips the parts already written.

pub mod moefy;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use ternfleet_kernels::GgmlType;
use ternfleet_shared::bundle::{
    self, BundleError, Calibration, ExpertPart, Gating, Manifest, MoeInfo, Part, Provenance,
    TensorEntry,
};
use ternfleet_shared::gguf::{GgufError, GgufFile, GgufWriter, Value, EXTENDED_TYPES_KEY};

use crate::model::weights::BLOB_TENSORS;
use crate::model::{LoadError, Model, ModelConfig, ModelError, BLOB_EXPERT_KEY, BLOB_LAYER_KEY};

/// What the routed experts' weights become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertType {
    /// Their source type (MoEfied `ffn_down` slices, whose columns are regathered, become
    /// q8_0).
    Keep,
    /// Requantized to this type from the dequantized source.
    To(GgmlType),
}

impl ExpertType {
    /// The accepted `--expert-type` values.
    pub const NAMES: &'static str = "keep, tq2_0, tq1_0, tf2, tf1, q8_0";

    /// Parses an `--expert-type` value.
    pub fn parse(s: &str) -> Result<ExpertType, ConvertError> {
        let ty = match s.to_ascii_lowercase().as_str() {
            "keep" => return Ok(ExpertType::Keep),
            "tq2_0" => GgmlType::TQ2_0,
            "tq1_0" => GgmlType::TQ1_0,
            "tf2" => GgmlType::TF2,
            "tf1" => GgmlType::TF1,
            "q8_0" => GgmlType::Q8_0,
            _ => {
                return Err(ConvertError::Options(format!(
                    "--expert-type {s:?}: expected one of {}",
                    Self::NAMES
                )))
            }
        };
        Ok(ExpertType::To(ty))
    }

    fn name(self) -> &'static str {
        match self {
            ExpertType::Keep => "keep",
            ExpertType::To(t) => t.name(),
        }
    }
}

/// Options of one conversion.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub model: PathBuf,
    pub out: PathBuf,
    /// MoEfication: experts per layer (dense models only).
    pub experts: Option<usize>,
    /// Experts a token uses by default.
    pub top_k: Option<usize>,
    /// MoEfication: calibration text.
    pub calib: Option<PathBuf>,
    /// MoEfication: calibration tokens to use at most.
    pub calib_tokens: usize,
    pub expert_type: ExpertType,
    /// MoEfication: seed of the clustering.
    pub seed: u64,
    /// MoEfication: how neurons are grouped into experts.
    pub grouping: moefy::Grouping,
}

/// Why a conversion failed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{0}")]
    Options(String),
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: {err}")]
    Gguf { path: PathBuf, err: GgufError },
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },
    #[error(transparent)]
    Kernel(#[from] ternfleet_kernels::KernelError),
    #[error(transparent)]
    Forward(#[from] crate::model::ForwardError),
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ConvertError + '_ {
    move |err| ConvertError::Io {
        path: path.to_owned(),
        err,
    }
}

/// Reports progress: `(stage, done, total)`.
pub type Progress<'a> = &'a (dyn Fn(&str, u64, u64) + Sync);

/// The parts already written by an interrupted run of the same conversion.
#[derive(Default, Serialize, Deserialize)]
struct Journal {
    fingerprint: String,
    done: BTreeMap<String, Done>,
}

/// One finished part, with what the manifest needs to say about it.
#[derive(Clone, Serialize, Deserialize)]
struct Done {
    part: Part,
    #[serde(default)]
    tensors: Vec<TensorEntry>,
    #[serde(default)]
    notes: Vec<String>,
}

const JOURNAL: &str = ".convert-journal.json";

impl Journal {
    fn load(dir: &Path, fingerprint: &str) -> Journal {
        let j: Option<Journal> = std::fs::read(dir.join(JOURNAL))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        match j {
            Some(j) if j.fingerprint == fingerprint => j,
            _ => Journal {
                fingerprint: fingerprint.to_owned(),
                done: BTreeMap::new(),
            },
        }
    }

    fn save(&self, dir: &Path) -> Result<(), ConvertError> {
        let path = dir.join(JOURNAL);
        let tmp = dir.join(format!("{JOURNAL}.tmp"));
        let text = serde_json::to_vec(self).map_err(|e| ConvertError::Options(e.to_string()))?;
        std::fs::write(&tmp, text).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))
    }

    /// The part `file` if a previous run wrote it and it is still intact.
    fn reuse(&self, dir: &Path, file: &str) -> Option<Done> {
        let d = self.done.get(file)?;
        Manifest::verify_part(dir, &d.part).ok().map(|_| d.clone())
    }
}

/// Writes `w` to `DIR/file` through a temporary name; returns the part record.
fn write_part(dir: &Path, file: &str, w: &GgufWriter<'_>) -> Result<Part, ConvertError> {
    let path = dir.join(file);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    let tmp = path.with_extension("gguf.tmp");
    w.write_file(&tmp).map_err(|err| ConvertError::Gguf {
        path: tmp.clone(),
        err,
    })?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    let (sha256, bytes) = bundle::sha256_file(&path).map_err(io(&path))?;
    Ok(Part {
        file: file.to_owned(),
        bytes,
        sha256,
    })
}

/// One expert matrix ready to be written: type, ggml dims `[cols, rows]`, bytes.
pub struct Matrix {
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    pub bytes: Vec<u8>,
}

impl Matrix {
    /// From f32 rows (`rows × cols`), quantized to `ty`.
    pub fn quantize(ty: GgmlType, cols: usize, values: &[f32]) -> Result<Matrix, ConvertError> {
        let rows = values.len() / cols.max(1);
        let rb = ty
            .row_size(cols as u64)
            .ok_or_else(|| ConvertError::Options(format!("{cols} columns do not fit {ty:?}")))?
            as usize;
        let mut bytes = vec![0u8; rb * rows];
        bytes
            .par_chunks_mut(rb)
            .zip(values.par_chunks(cols))
            .try_for_each(|(dst, src)| ternfleet_kernels::quantize_row(ty, src, dst))?;
        Ok(Matrix {
            ty,
            cols,
            rows,
            bytes,
        })
    }

    /// Dequantized rows.
    pub fn to_f32(&self) -> Result<Vec<f32>, ConvertError> {
        dequantize(self.ty, &self.bytes, self.cols)
    }
}

/// Dequantizes whole rows of `cols` values.
pub fn dequantize(ty: GgmlType, bytes: &[u8], cols: usize) -> Result<Vec<f32>, ConvertError> {
    let rb = ty.row_size(cols as u64).unwrap_or(0) as usize;
    if rb == 0 || !bytes.len().is_multiple_of(rb) {
        return Err(ConvertError::Options(format!(
            "{} bytes are not whole {ty:?} rows of {cols}",
            bytes.len()
        )));
    }
    let mut out = vec![0f32; bytes.len() / rb * cols];
    out.par_chunks_mut(cols)
        .zip(bytes.par_chunks(rb))
        .try_for_each(|(dst, src)| ternfleet_kernels::dequantize_row(ty, src, dst))?;
    Ok(out)
}

/// Applies `--expert-type` to one expert matrix. Returns the matrix and, when the requested
/// type cannot hold it (its blocks do not divide the row), a note saying it was kept.
fn retype(
    m: Matrix,
    want: ExpertType,
    what: &str,
) -> Result<(Matrix, Option<String>), ConvertError> {
    let ExpertType::To(ty) = want else {
        return Ok((m, None));
    };
    if m.ty == ty {
        return Ok((m, None));
    }
    if !m.cols.is_multiple_of(ty.block_size()) {
        let note = format!(
            "{what}: rows of {} do not split into {} blocks of {}; kept as {}",
            m.cols,
            ty.name(),
            ty.block_size(),
            m.ty.name()
        );
        return Ok((m, Some(note)));
    }
    let v = m.to_f32()?;
    Ok((Matrix::quantize(ty, m.cols, &v)?, None))
}

/// Builds an expert blob: the three matrices in [`BLOB_TENSORS`] order.
fn blob_writer<'a>(
    layer: usize,
    expert: usize,
    model: &str,
    mats: &'a [Matrix; 3],
) -> Result<GgufWriter<'a>, ConvertError> {
    let gg = |err| ConvertError::Gguf {
        path: PathBuf::from(bundle::expert_file(layer, expert)),
        err,
    };
    let mut w = GgufWriter::new();
    w.add_kv("general.type", Value::String("ternfleet-expert".into()))
        .map_err(gg)?;
    w.add_kv("ternfleet.bundle.model", Value::String(model.into()))
        .map_err(gg)?;
    w.add_kv(BLOB_LAYER_KEY, Value::U32(layer as u32))
        .map_err(gg)?;
    w.add_kv(BLOB_EXPERT_KEY, Value::U32(expert as u32))
        .map_err(gg)?;
    if mats.iter().any(|m| !m.ty.is_ggml()) {
        w.add_kv(EXTENDED_TYPES_KEY, Value::Bool(true))
            .map_err(gg)?;
    }
    for (name, m) in BLOB_TENSORS.iter().zip(mats) {
        w.add_tensor(
            *name,
            &[m.cols as u64, m.rows as u64],
            m.ty,
            m.bytes.as_slice(),
        )
        .map_err(gg)?;
    }
    Ok(w)
}

fn tensor_entries(mats: &[Matrix; 3]) -> Vec<TensorEntry> {
    BLOB_TENSORS
        .iter()
        .zip(mats)
        .map(|(n, m)| TensorEntry {
            name: (*n).into(),
            ty: m.ty.name().into(),
            dims: vec![m.cols as u64, m.rows as u64],
        })
        .collect()
}

/// What a conversion produced.
#[derive(Debug)]
pub struct ConvertReport {
    pub manifest: Manifest,
    /// Parts reused from an interrupted run.
    pub reused: usize,
    /// Parts written now.
    pub written: usize,
}

/// Converts `opts.model` into the bundle directory `opts.out`.
pub fn convert(
    opts: &ConvertOptions,
    progress: Progress<'_>,
) -> Result<ConvertReport, ConvertError> {
    let src = &opts.model;
    if !src.is_file() {
        return Err(ConvertError::Options(format!(
            "{}: not a GGUF file (convert reads a model file, not a bundle)",
            src.display()
        )));
    }
    let file = Arc::new(GgufFile::open(src).map_err(|err| ConvertError::Gguf {
        path: src.clone(),
        err,
    })?);
    let cfg = ModelConfig::from_gguf(&file)?;
    let native = cfg.moe.clone();
    match (&native, opts.experts) {
        (None, None) => {
            return Err(ConvertError::Options(format!(
                "{} is a dense {} model: pass --experts E (and --calib FILE) to split its FFNs \
                 into experts",
                src.display(),
                cfg.arch.name()
            )))
        }
        (Some(m), Some(e)) if e != m.n_expert => {
            return Err(ConvertError::Options(format!(
                "{} already has {} experts per layer; --experts {e} applies to dense models only",
                src.display(),
                m.n_expert
            )))
        }
        (None, Some(_)) if opts.calib.is_none() => {
            return Err(ConvertError::Options(
                "MoEfying a dense model needs --calib FILE (a calibration text)".into(),
            ))
        }
        _ => {}
    }
    std::fs::create_dir_all(&opts.out).map_err(|e| {
        ConvertError::Options(format!(
            "-o {}: cannot create the bundle directory: {e}",
            opts.out.display()
        ))
    })?;
    let dir = opts.out.as_path();
    progress("checksum source", 0, 1);
    let (src_sha, src_bytes) = bundle::sha256_file(src).map_err(io(src))?;
    progress("checksum source", 1, 1);
    let calib = match &opts.calib {
        Some(p) if native.is_none() => {
            let (sha, _) = bundle::sha256_file(p).map_err(io(p))?;
            Some((p.clone(), sha))
        }
        _ => None,
    };
    let fingerprint = format!(
        "v1 src={src_sha} experts={:?} type={} calib={:?} calib_tokens={} seed={} grouping={:?}",
        opts.experts,
        opts.expert_type.name(),
        calib.as_ref().map(|c| &c.1),
        opts.calib_tokens,
        opts.seed,
        opts.grouping
    );
    // A previous manifest describes another conversion (or this one, redone): drop it first,
    // so a crash below never leaves a manifest that disagrees with the parts.
    let _ = std::fs::remove_file(dir.join(bundle::MANIFEST));
    let mut journal = Journal::load(dir, &fingerprint);
    let model_name = file
        .get_str("general.name")
        .ok()
        .flatten()
        .map(str::to_owned)
        .unwrap_or_else(|| {
            src.file_stem()
                .map_or("model".into(), |s| s.to_string_lossy().into_owned())
        });

    let (moe_info, plan, calib_tokens) = match &native {
        Some(m) => (
            MoeInfo {
                n_expert: m.n_expert,
                n_expert_used: opts.top_k.unwrap_or(m.n_expert_used),
                n_ff_exp: m.n_ff_exp,
                gating: m.gating,
                n_ff_shexp: m.n_ff_shexp,
            },
            None,
            0,
        ),
        None => {
            let e = opts.experts.unwrap_or(1);
            let (calib_path, _) = calib
                .as_ref()
                .ok_or_else(|| ConvertError::Options("--calib is required".into()))?;
            let model = Model::from_file(file.clone())?;
            let plan = moefy::plan_cached(dir, &fingerprint, || {
                let text = std::fs::read_to_string(calib_path).map_err(io(calib_path))?;
                moefy::calibrate(
                    &model,
                    &text,
                    e,
                    opts.calib_tokens,
                    opts.seed,
                    opts.grouping,
                    progress,
                )
            })?;
            let tokens = plan.tokens;
            (
                MoeInfo {
                    n_expert: e,
                    n_expert_used: opts.top_k.unwrap_or(e.div_ceil(2)),
                    n_ff_exp: cfg.n_ff / e,
                    gating: Gating::TopKUnit,
                    n_ff_shexp: None,
                },
                Some(plan),
                tokens,
            )
        }
    };
    if moe_info.n_expert_used == 0 || moe_info.n_expert_used > moe_info.n_expert {
        return Err(ConvertError::Options(format!(
            "--top-k {} must be in 1..={}",
            moe_info.n_expert_used, moe_info.n_expert
        )));
    }

    let mut reused = 0;
    let mut written = 0;
    // The coordinator part.
    let coordinator = match journal.reuse(dir, bundle::COORDINATOR) {
        Some(d) => {
            reused += 1;
            d.part
        }
        None => {
            progress("coordinator part", 0, 1);
            let w = coordinator_writer(&file, &cfg, plan.as_ref())?;
            let p = write_part(dir, bundle::COORDINATOR, &w)?;
            journal.done.insert(
                p.file.clone(),
                Done {
                    part: p.clone(),
                    tensors: vec![],
                    notes: vec![],
                },
            );
            journal.save(dir)?;
            written += 1;
            progress("coordinator part", 1, 1);
            p
        }
    };

    // The experts, layer by layer; the experts of a layer in parallel.
    let ne = moe_info.n_expert;
    let total = (cfg.n_layer * ne) as u64;
    let mut notes = Vec::<String>::new();
    let mut experts = Vec::with_capacity(cfg.n_layer * ne);
    for l in 0..cfg.n_layer {
        // Parts an earlier run finished (checked against their checksums once).
        let earlier: Vec<Option<Done>> = (0..ne)
            .into_par_iter()
            .map(|e| journal.reuse(dir, &bundle::expert_file(l, e)))
            .collect();
        let source = if earlier.iter().all(Option::is_some) {
            None
        } else {
            Some(match &plan {
                Some(p) => LayerSource::moefied(&file, &cfg, l, &p.layers[l])?,
                None => LayerSource::native(&file, &cfg, l)?,
            })
        };
        let results: Vec<(ExpertPart, Vec<String>, bool)> = earlier
            .into_par_iter()
            .enumerate()
            .map(|(e, done)| {
                let fresh = done.is_none();
                let d = match (done, &source) {
                    (Some(d), _) => d,
                    (None, Some(src)) => {
                        write_expert(dir, src, l, e, opts.expert_type, &model_name)?
                    }
                    (None, None) => {
                        return Err(ConvertError::Options(format!(
                            "layer {l} expert {e}: no source"
                        )))
                    }
                };
                let ep = ExpertPart {
                    layer: l,
                    expert: e,
                    part: d.part,
                    tensors: d.tensors,
                };
                Ok((ep, d.notes, fresh))
            })
            .collect::<Result<_, ConvertError>>()?;
        for (ep, n, fresh) in results {
            if fresh {
                written += 1;
                journal.done.insert(
                    ep.part.file.clone(),
                    Done {
                        part: ep.part.clone(),
                        tensors: ep.tensors.clone(),
                        notes: n.clone(),
                    },
                );
            } else {
                reused += 1;
            }
            notes.extend(n);
            experts.push(ep);
        }
        journal.save(dir)?;
        progress("experts", ((l + 1) * ne) as u64, total);
    }
    notes.sort();
    notes.dedup();
    let manifest = Manifest {
        format: bundle::FORMAT.into(),
        version: bundle::VERSION,
        model: model_name,
        architecture: cfg.arch.name().into(),
        n_layer: cfg.n_layer,
        moe: moe_info,
        coordinator,
        experts,
        provenance: Provenance {
            source: Part {
                file: src
                    .file_name()
                    .map_or(String::new(), |s| s.to_string_lossy().into_owned()),
                bytes: src_bytes,
                sha256: src_sha,
            },
            method: if native.is_some() {
                "native"
            } else {
                "moefied"
            }
            .into(),
            expert_type: opts.expert_type.name().into(),
            calibration: calib.map(|(p, sha256)| Calibration {
                file: p
                    .file_name()
                    .map_or(String::new(), |s| s.to_string_lossy().into_owned()),
                sha256,
                tokens: calib_tokens,
            }),
            notes,
        },
    };
    manifest.validate().map_err(ConvertError::Options)?;
    manifest.write(dir)?;
    Ok(ConvertReport {
        manifest,
        reused,
        written,
    })
}

/// Builds, retypes and writes expert `e` of layer `l`.
fn write_expert(
    dir: &Path,
    source: &LayerSource<'_>,
    l: usize,
    e: usize,
    want: ExpertType,
    model_name: &str,
) -> Result<Done, ConvertError> {
    let mut notes = Vec::new();
    let mut mats = Vec::with_capacity(3);
    for (m, name) in source.expert(e)?.into_iter().zip(BLOB_TENSORS) {
        let (m, note) = retype(m, want, &format!("blk.{l}.{name}"))?;
        notes.extend(note);
        mats.push(m);
    }
    let mats: [Matrix; 3] = mats
        .try_into()
        .map_err(|_| ConvertError::Options("three matrices per expert".into()))?;
    let w = blob_writer(l, e, model_name, &mats)?;
    Ok(Done {
        part: write_part(dir, &bundle::expert_file(l, e), &w)?,
        tensors: tensor_entries(&mats),
        notes,
    })
}

/// Everything but the routed experts, plus the routers of a MoEfied model.
fn coordinator_writer<'a>(
    file: &'a GgufFile,
    cfg: &ModelConfig,
    plan: Option<&moefy::Plan>,
) -> Result<GgufWriter<'a>, ConvertError> {
    let gg = |err| ConvertError::Gguf {
        path: PathBuf::from(bundle::COORDINATOR),
        err,
    };
    let mut w = GgufWriter::new();
    w.set_alignment(file.alignment()).map_err(gg)?;
    for (k, v) in file.metadata() {
        if k != "general.alignment" {
            w.add_kv(k.clone(), v.clone()).map_err(gg)?;
        }
    }
    let routed = |name: &str| -> bool {
        let Some(rest) = name.strip_prefix("blk.") else {
            return false;
        };
        let t = rest.split_once('.').map_or("", |(_, t)| t);
        if plan.is_some() {
            matches!(t, "ffn_gate.weight" | "ffn_up.weight" | "ffn_down.weight")
        } else {
            matches!(
                t,
                "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight"
            )
        }
    };
    for t in file.tensors() {
        if !routed(&t.name) {
            w.add_tensor(t.name.clone(), &t.dims, t.ty, file.tensor_data(t))
                .map_err(gg)?;
        }
    }
    if let Some(p) = plan {
        for (l, lp) in p.layers.iter().enumerate() {
            let e = lp.experts.len();
            w.add_tensor(
                format!("blk.{l}.ffn_gate_inp.weight"),
                &[cfg.n_embd as u64, e as u64],
                GgmlType::F32,
                f32_bytes(&lp.router_w),
            )
            .map_err(gg)?;
            w.add_tensor(
                format!("blk.{l}.ffn_gate_inp.bias"),
                &[e as u64],
                GgmlType::F32,
                f32_bytes(&lp.router_b),
            )
            .map_err(gg)?;
        }
    }
    Ok(w)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Where one layer's experts come from.
enum LayerSource<'a> {
    /// Slices of the stacked tensors.
    Native {
        /// Per matrix: stacked bytes, type, cols, rows, bytes per expert.
        parts: [(&'a [u8], GgmlType, usize, usize, usize); 3],
    },
    /// Gathered rows of the dense gate/up and regathered columns of the dense down.
    Moefied {
        gate: (&'a [u8], GgmlType, usize),
        up: (&'a [u8], GgmlType, usize),
        /// `n_embd × n_ff`, dequantized.
        down: Vec<f32>,
        /// The source bytes of `down`.
        down_bytes: &'a [u8],
        /// The source type of `down`.
        down_ty: GgmlType,
        n_ff: usize,
        n_embd: usize,
        experts: &'a [Vec<u32>],
    },
}

fn tensor_of<'a>(
    file: &'a GgufFile,
    name: &str,
) -> Result<&'a ternfleet_shared::gguf::TensorInfo, ConvertError> {
    file.tensor(name)
        .ok_or_else(|| ConvertError::Model(ModelError::MissingTensor { name: name.into() }))
}

impl<'a> LayerSource<'a> {
    fn native(file: &'a GgufFile, cfg: &ModelConfig, l: usize) -> Result<Self, ConvertError> {
        let m = cfg
            .moe
            .as_ref()
            .ok_or_else(|| ConvertError::Options("not an MoE model".into()))?;
        let (d, ff, ne) = (cfg.n_embd, m.n_ff_exp, m.n_expert);
        let mut parts = Vec::with_capacity(3);
        for (name, cols, rows) in [("gate", d, ff), ("up", d, ff), ("down", ff, d)] {
            let n = format!("blk.{l}.ffn_{name}_exps.weight");
            let t = tensor_of(file, &n)?;
            if t.dims != [cols as u64, rows as u64, ne as u64] {
                return Err(ConvertError::Model(ModelError::TensorShape {
                    name: n,
                    got: t.dims.clone(),
                    want: vec![cols as u64, rows as u64, ne as u64],
                }));
            }
            let bytes = file.tensor_data(t);
            parts.push((bytes, t.ty, cols, rows, bytes.len() / ne));
        }
        let parts: [_; 3] = parts
            .try_into()
            .map_err(|_| ConvertError::Options("three expert tensors".into()))?;
        Ok(LayerSource::Native { parts })
    }

    fn moefied(
        file: &'a GgufFile,
        cfg: &ModelConfig,
        l: usize,
        lp: &'a moefy::LayerPlan,
    ) -> Result<Self, ConvertError> {
        let (d, ff) = (cfg.n_embd, cfg.n_ff);
        let get = |name: &str, cols: usize, rows: usize| -> Result<_, ConvertError> {
            let n = format!("blk.{l}.{name}.weight");
            let t = tensor_of(file, &n)?;
            if t.dims != [cols as u64, rows as u64] {
                return Err(ConvertError::Model(ModelError::TensorShape {
                    name: n,
                    got: t.dims.clone(),
                    want: vec![cols as u64, rows as u64],
                }));
            }
            Ok((file.tensor_data(t), t.ty, cols))
        };
        let gate = get("ffn_gate", d, ff)?;
        let up = get("ffn_up", d, ff)?;
        let (db, dty, _) = get("ffn_down", ff, d)?;
        Ok(LayerSource::Moefied {
            gate,
            up,
            down: dequantize(dty, db, ff)?,
            down_bytes: db,
            down_ty: dty,
            n_ff: ff,
            n_embd: d,
            experts: &lp.experts,
        })
    }

    /// Expert `e`'s gate, up and down matrices.
    fn expert(&self, e: usize) -> Result<Vec<Matrix>, ConvertError> {
        match self {
            LayerSource::Native { parts } => Ok(parts
                .iter()
                .map(|&(bytes, ty, cols, rows, per)| Matrix {
                    ty,
                    cols,
                    rows,
                    bytes: bytes[e * per..(e + 1) * per].to_vec(),
                })
                .collect()),
            LayerSource::Moefied {
                gate,
                up,
                down,
                down_bytes,
                down_ty,
                n_ff,
                n_embd,
                experts,
            } => {
                let ids = &experts[e];
                let rows_of = |(bytes, ty, cols): (&[u8], GgmlType, usize)| {
                    let rb = ty.row_size(cols as u64).unwrap_or(0) as usize;
                    let mut out = Vec::with_capacity(rb * ids.len());
                    for &j in ids {
                        out.extend_from_slice(&bytes[j as usize * rb..(j as usize + 1) * rb]);
                    }
                    Matrix {
                        ty,
                        cols,
                        rows: ids.len(),
                        bytes: out,
                    }
                };
                let k = ids.len();
                // A contiguous run of neurons that starts and ends on the source's block
                // boundaries keeps its bytes: every down row's blocks for those columns.
                let first = ids.first().copied().unwrap_or(0) as usize;
                let contiguous = ids
                    .iter()
                    .enumerate()
                    .all(|(i, &j)| j as usize == first + i);
                let bs = down_ty.block_size();
                if contiguous && first.is_multiple_of(bs) && k.is_multiple_of(bs) {
                    let rb = down_ty.row_size(*n_ff as u64).unwrap_or(0) as usize;
                    let (off, len) = (
                        first / bs * down_ty.type_size(),
                        k / bs * down_ty.type_size(),
                    );
                    let mut bytes = Vec::with_capacity(len * n_embd);
                    for r in 0..*n_embd {
                        bytes.extend_from_slice(&down_bytes[r * rb + off..r * rb + off + len]);
                    }
                    return Ok(vec![
                        rows_of(*gate),
                        rows_of(*up),
                        Matrix {
                            ty: *down_ty,
                            cols: k,
                            rows: *n_embd,
                            bytes,
                        },
                    ]);
                }
                let mut dv = vec![0f32; n_embd * k];
                for (r, row) in dv.chunks_exact_mut(k).enumerate() {
                    let src = &down[r * n_ff..(r + 1) * n_ff];
                    for (o, &j) in row.iter_mut().zip(ids.iter()) {
                        *o = src[j as usize];
                    }
                }
                // Regathered columns keep a float source's type exactly; quantized blocks
                // cannot be regathered: q8_0 when the width allows, f32 otherwise.
                let down_ty = match down_ty {
                    GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => *down_ty,
                    _ if k.is_multiple_of(32) => GgmlType::Q8_0,
                    _ => GgmlType::F32,
                };
                Ok(vec![
                    rows_of(*gate),
                    rows_of(*up),
                    Matrix::quantize(down_ty, k, &dv)?,
                ])
            }
        }
    }
}
