//! The bundle: what ternfleet nodes serve. A directory written by `ternfleet convert`:
//!
//! ```text
//! DIR/manifest.json                 this module's [`Manifest`] (JSON), written last
//! DIR/coordinator.gguf              everything but the routed experts, plus the routers
//! DIR/experts/blk.L/expert.E.gguf   one routed expert: tensors ffn_gate, ffn_up, ffn_down
//! ```
//!
//! Each part is a GGUF file (memory-mappable, self-describing) with its size and SHA-256 in
//! the manifest, so a part can be copied to another machine and checked there on its own.
//! Opening a bundle checks the manifest against the parts: a missing part, a size or checksum
//! that differs, or a manifest that does not describe the files is refused with an error that
//! names the file.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// `format` of every manifest.
pub const FORMAT: &str = "ternfleet-bundle";
/// The manifest version this code writes and reads.
pub const VERSION: u32 = 1;
/// The manifest's file name inside a bundle directory.
pub const MANIFEST: &str = "manifest.json";
/// The coordinator part's file name.
pub const COORDINATOR: &str = "coordinator.gguf";

/// Largest manifest accepted (a hostile one could be any size).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// How a layer's router turns scores into expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gating {
    /// Softmax over all experts, top-k, the chosen probabilities as weights (qwen2moe).
    Softmax,
    /// Softmax, top-k, weights renormalised to sum to one (qwen3moe, Mixtral).
    SoftmaxNorm,
    /// Experts are a partition of a dense FFN (MoEfication): top-k by the router's linear
    /// score, every chosen expert with weight 1, so choosing all of them is the dense FFN.
    TopKUnit,
}

/// One file of a bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    /// Path relative to the bundle directory, `/`-separated.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// SHA-256 of the whole file, lowercase hex.
    pub sha256: String,
}

/// One tensor of an expert blob, as the manifest describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    /// ggml type name (`q8_0`, `tq2_0`, `tf2`, ...).
    #[serde(rename = "type")]
    pub ty: String,
    /// ggml `ne` order.
    pub dims: Vec<u64>,
}

/// One routed expert.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertPart {
    pub layer: usize,
    pub expert: usize,
    #[serde(flatten)]
    pub part: Part,
    pub tensors: Vec<TensorEntry>,
}

/// What the model's experts are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeInfo {
    /// Routed experts per layer.
    pub n_expert: usize,
    /// Experts a token uses by default (`--top-k` overrides at run time).
    pub n_expert_used: usize,
    /// Intermediate width of one expert.
    pub n_ff_exp: usize,
    pub gating: Gating,
    /// qwen2moe's shared expert width (it stays in the coordinator part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_ff_shexp: Option<usize>,
}

/// Where the bundle came from and how it was made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// The source model file name and checksum.
    pub source: Part,
    /// `native` (an MoE GGUF split up) or `moefied` (a dense model's FFNs clustered).
    pub method: String,
    /// Expert weight type requested (`keep`, `tq2_0`, `tq1_0`, `tf2`, `tf1`).
    pub expert_type: String,
    /// Calibration text (MoEfication), with checksum and token count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
    /// Free-form notes (tensors kept in their type because the ternary block did not fit...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The calibration text of a MoEfied bundle.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub file: String,
    pub sha256: String,
    pub tokens: usize,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`] for files this code reads.
    pub version: u32,
    /// `general.name` of the source, or its file stem.
    pub model: String,
    /// `general.architecture` of the coordinator part.
    pub architecture: String,
    pub n_layer: usize,
    pub moe: MoeInfo,
    pub coordinator: Part,
    /// Every routed expert, layer-major.
    pub experts: Vec<ExpertPart>,
    pub provenance: Provenance,
}

/// Why a bundle cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error(
        "{dir}: no {MANIFEST}: not a ternfleet bundle, or its conversion did not finish \
         (run `ternfleet convert` again; it resumes)"
    )]
    NoManifest { dir: PathBuf },
    #[error("{path}: not a valid bundle manifest: {msg}")]
    BadManifest { path: PathBuf, msg: String },
    #[error("{path}: part missing (the manifest lists it): {err}")]
    MissingPart { path: PathBuf, err: std::io::Error },
    #[error("{path}: {got} bytes, the manifest says {want}: the file is truncated or replaced")]
    SizeMismatch { path: PathBuf, got: u64, want: u64 },
    #[error("{path}: checksum mismatch (sha256 {got}, manifest {want}): the file is corrupt")]
    ChecksumMismatch {
        path: PathBuf,
        got: String,
        want: String,
    },
    #[error("{path}: does not match the manifest: {msg}")]
    Mismatch { path: PathBuf, msg: String },
}

/// SHA-256 of a file, streamed, lowercase hex; also returns its size.
pub fn sha256_file(path: &Path) -> Result<(String, u64), std::io::Error> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex(&h.finalize()), n))
}

/// Lowercase hex of bytes.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The relative path of expert `e` of layer `l`.
pub fn expert_file(layer: usize, expert: usize) -> String {
    format!("experts/blk.{layer}/expert.{expert}.gguf")
}

/// Whether `dir` looks like a bundle (has a manifest).
pub fn is_bundle(dir: &Path) -> bool {
    dir.is_dir() && dir.join(MANIFEST).is_file()
}

impl Manifest {
    /// Reads and validates `DIR/manifest.json` (structure only; [`Manifest::verify_part`]
    /// checks each file).
    pub fn read(dir: &Path) -> Result<Manifest, BundleError> {
        let path = dir.join(MANIFEST);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(BundleError::NoManifest {
                    dir: dir.to_owned(),
                })
            }
            Err(err) => return Err(BundleError::Io { path, err }),
        };
        let bad = |msg: String| BundleError::BadManifest {
            path: path.clone(),
            msg,
        };
        if meta.len() > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "{} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have",
                meta.len()
            )));
        }
        let text = std::fs::read(&path).map_err(|err| BundleError::Io {
            path: path.clone(),
            err,
        })?;
        let m: Manifest = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        m.validate().map_err(bad)?;
        Ok(m)
    }

    /// Structural checks: format and version, every expert listed once, file names inside the
    /// bundle.
    pub fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", self.format));
        }
        if self.version != VERSION {
            return Err(format!(
                "version {} (this ternfleet reads version {VERSION})",
                self.version
            ));
        }
        let m = &self.moe;
        if m.n_expert == 0 || m.n_expert_used == 0 || m.n_expert_used > m.n_expert {
            return Err(format!(
                "{} experts, {} used per token",
                m.n_expert, m.n_expert_used
            ));
        }
        let want = self.n_layer.checked_mul(m.n_expert);
        if want != Some(self.experts.len()) {
            return Err(format!(
                "{} expert parts listed, {} layers x {} experts expected",
                self.experts.len(),
                self.n_layer,
                m.n_expert
            ));
        }
        for (i, e) in self.experts.iter().enumerate() {
            let (l, x) = (i / m.n_expert, i % m.n_expert);
            if (e.layer, e.expert) != (l, x) {
                return Err(format!(
                    "entry {i} is layer {} expert {}, expected layer {l} expert {x}",
                    e.layer, e.expert
                ));
            }
            check_rel(&e.part.file)?;
        }
        check_rel(&self.coordinator.file)?;
        Ok(())
    }

    /// Checks that `DIR/part.file` exists with the size and checksum the manifest gives.
    pub fn verify_part(dir: &Path, part: &Part) -> Result<PathBuf, BundleError> {
        let path = dir.join(&part.file);
        let meta = std::fs::metadata(&path).map_err(|err| BundleError::MissingPart {
            path: path.clone(),
            err,
        })?;
        if meta.len() != part.bytes {
            return Err(BundleError::SizeMismatch {
                path,
                got: meta.len(),
                want: part.bytes,
            });
        }
        let (got, _) = sha256_file(&path).map_err(|err| BundleError::Io {
            path: path.clone(),
            err,
        })?;
        if got != part.sha256 {
            return Err(BundleError::ChecksumMismatch {
                path,
                got,
                want: part.sha256.clone(),
            });
        }
        Ok(path)
    }

    /// Writes the manifest atomically (temporary file, then rename).
    pub fn write(&self, dir: &Path) -> Result<(), BundleError> {
        let path = dir.join(MANIFEST);
        let tmp = dir.join(format!("{MANIFEST}.tmp"));
        let io = |err| BundleError::Io {
            path: path.clone(),
            err,
        };
        let text = serde_json::to_vec_pretty(self).map_err(|e| BundleError::BadManifest {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok(())
    }
}

/// A part's path must stay inside the bundle: relative, no `..`, no empty components.
fn check_rel(file: &str) -> Result<(), String> {
    let p = Path::new(file);
    let ok = !file.is_empty()
        && p.components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "part path {file:?} is not a plain relative path inside the bundle"
        ))
    }
}

/// SHA-256 of a bundle's manifest file: the bundle's identity (every part's checksum is in
/// it). Coordinator and nodes compare it so a node serving another bundle of the same shape
/// is never used.
pub fn manifest_digest(dir: &Path) -> Result<String, BundleError> {
    let path = dir.join(MANIFEST);
    sha256_file(&path)
        .map(|(h, _)| h)
        .map_err(|err| BundleError::Io { path, err })
}

/// One part as it was when its checksum was last verified.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Stamp {
    bytes: u64,
    mtime_ns: i128,
    inode: u64,
    sha256: String,
}

impl Stamp {
    fn of(meta: &std::fs::Metadata, sha256: &str) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            bytes: meta.len(),
            mtime_ns: meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128,
            inode: meta.ino(),
            sha256: sha256.to_string(),
        }
    }
}

/// Parts whose checksums were verified, remembered across restarts by file size, modification
/// time and inode: a node restarting on the same bundle does not hash gigabytes again, and a
/// part that was rewritten (any of the three changed) is hashed again. Kept as JSON in a state
/// directory (the bundle itself may be a read-only mount).
#[derive(Debug)]
pub struct VerifiedParts {
    file: Option<PathBuf>,
    entries: std::sync::Mutex<std::collections::BTreeMap<String, Stamp>>,
    hashed: std::sync::atomic::AtomicUsize,
    remembered: std::sync::atomic::AtomicUsize,
}

impl VerifiedParts {
    /// The memory of bundle `dir` under `state` (`None`: remember nothing). A missing or
    /// unreadable file starts empty.
    pub fn open(state: Option<&Path>, dir: &Path) -> VerifiedParts {
        let file = state.map(|s| {
            let canon = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
            let h = Sha256::digest(canon.display().to_string().as_bytes());
            let name: String = h.iter().take(8).map(|b| format!("{b:02x}")).collect();
            s.join(format!("verified-{name}.json"))
        });
        let entries = file
            .as_ref()
            .and_then(|f| std::fs::read(f).ok())
            .filter(|b| b.len() < MAX_MANIFEST_BYTES as usize)
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        VerifiedParts {
            file,
            entries: std::sync::Mutex::new(entries),
            hashed: Default::default(),
            remembered: Default::default(),
        }
    }

    /// [`Manifest::verify_part`], skipping the hash when this part was verified before and
    /// is unchanged since. Returns the path and whether it was hashed now.
    pub fn verify(&self, dir: &Path, part: &Part) -> Result<(PathBuf, bool), BundleError> {
        let path = dir.join(&part.file);
        if let Ok(meta) = std::fs::metadata(&path) {
            let now = Stamp::of(&meta, &part.sha256);
            let known = self
                .entries
                .lock()
                .ok()
                .and_then(|e| e.get(&part.file).cloned());
            if known.as_ref() == Some(&now) && meta.len() == part.bytes {
                self.remembered
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Ok((path, false));
            }
        }
        let path = Manifest::verify_part(dir, part)?;
        self.hashed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let (Ok(meta), Ok(mut e)) = (std::fs::metadata(&path), self.entries.lock()) {
            e.insert(part.file.clone(), Stamp::of(&meta, &part.sha256));
        }
        Ok((path, true))
    }

    /// Parts hashed and parts remembered so far.
    pub fn counts(&self) -> (usize, usize) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.hashed.load(Relaxed), self.remembered.load(Relaxed))
    }

    /// Writes what was verified (atomically: a temporary file renamed). Errors are returned
    /// for the caller to log: forgetting only costs a re-hash at the next start.
    pub fn save(&self) -> Result<(), std::io::Error> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent)?;
        }
        // The lock is held to the rename: two threads saving (moves copy in parallel) never
        // write one temporary file at once. The temporary name carries the pid, so a second
        // process on the same state directory cannot interleave with this one either.
        let e = self
            .entries
            .lock()
            .map_err(|_| std::io::Error::other("verified parts lock poisoned"))?;
        let body = serde_json::to_vec(&*e).map_err(std::io::Error::other)?;
        let tmp = file.with_extension(format!("json.{}.tmp", std::process::id()));
        std::fs::write(&tmp, body)?;
        std::fs::rename(&tmp, file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(dir: &Path) -> Manifest {
        std::fs::write(dir.join("coordinator.gguf"), b"coordinator").unwrap();
        let part = |file: &str| {
            let path = dir.join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, file.as_bytes()).unwrap();
            let (sha256, bytes) = sha256_file(&path).unwrap();
            Part {
                file: file.into(),
                bytes,
                sha256,
            }
        };
        let experts = (0..2)
            .flat_map(|l| (0..2).map(move |e| (l, e)))
            .map(|(l, e)| ExpertPart {
                layer: l,
                expert: e,
                part: part(&expert_file(l, e)),
                tensors: vec![],
            })
            .collect();
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            model: "m".into(),
            architecture: "llama".into(),
            n_layer: 2,
            moe: MoeInfo {
                n_expert: 2,
                n_expert_used: 1,
                n_ff_exp: 8,
                gating: Gating::SoftmaxNorm,
                n_ff_shexp: None,
            },
            coordinator: part(COORDINATOR),
            experts,
            provenance: Provenance {
                source: Part {
                    file: "m.gguf".into(),
                    bytes: 1,
                    sha256: "00".into(),
                },
                method: "native".into(),
                expert_type: "keep".into(),
                calibration: None,
                notes: vec![],
            },
        }
    }

    #[test]
    fn round_trip_and_verify() {
        let dir = tempfile::tempdir().unwrap();
        let m = sample(dir.path());
        m.write(dir.path()).unwrap();
        let r = Manifest::read(dir.path()).unwrap();
        assert_eq!(r, m);
        for e in &r.experts {
            Manifest::verify_part(dir.path(), &e.part).unwrap();
        }
    }

    #[test]
    fn corrupt_parts_are_refused_with_the_file_named() {
        let dir = tempfile::tempdir().unwrap();
        let m = sample(dir.path());
        m.write(dir.path()).unwrap();
        let p0 = &m.experts[0].part;
        // Same size, one byte changed.
        let path = dir.path().join(&p0.file);
        let mut b = std::fs::read(&path).unwrap();
        b[0] ^= 1;
        std::fs::write(&path, &b).unwrap();
        let e = Manifest::verify_part(dir.path(), p0).unwrap_err();
        assert!(matches!(e, BundleError::ChecksumMismatch { .. }), "{e}");
        assert!(e.to_string().contains("expert.0.gguf"), "{e}");
        // Truncated.
        std::fs::write(&path, &b[..3]).unwrap();
        let e = Manifest::verify_part(dir.path(), p0).unwrap_err();
        assert!(matches!(e, BundleError::SizeMismatch { .. }), "{e}");
        // Missing.
        std::fs::remove_file(&path).unwrap();
        let e = Manifest::verify_part(dir.path(), p0).unwrap_err();
        assert!(matches!(e, BundleError::MissingPart { .. }), "{e}");
    }

    #[test]
    fn bad_manifests_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            Manifest::read(dir.path()),
            Err(BundleError::NoManifest { .. })
        ));
        let m = sample(dir.path());
        type Edit = Box<dyn Fn(&mut Manifest)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("format", Box::new(|m| m.format = "other".into())),
            ("version", Box::new(|m| m.version = 99)),
            ("listed", Box::new(|m| drop(m.experts.pop()))),
            ("expected layer", Box::new(|m| m.experts.swap(0, 1))),
            (
                "relative",
                Box::new(|m| m.experts[0].part.file = "../x".into()),
            ),
            ("used per token", Box::new(|m| m.moe.n_expert_used = 3)),
        ];
        for (want, f) in cases {
            let mut b = m.clone();
            f(&mut b);
            b.write(dir.path()).unwrap();
            let e = Manifest::read(dir.path()).unwrap_err();
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
        std::fs::write(dir.path().join(MANIFEST), b"{ not json").unwrap();
        assert!(matches!(
            Manifest::read(dir.path()),
            Err(BundleError::BadManifest { .. })
        ));
    }

    #[test]
    fn verified_parts_are_not_hashed_again_until_they_change() {
        let dir = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let f = dir.path().join("blob.gguf");
        std::fs::write(&f, b"expert bytes").unwrap();
        let (sha, bytes) = sha256_file(&f).unwrap();
        let part = Part {
            file: "blob.gguf".into(),
            bytes,
            sha256: sha,
        };
        let v = VerifiedParts::open(Some(state.path()), dir.path());
        assert!(v.verify(dir.path(), &part).unwrap().1, "first time: hashed");
        assert!(
            !v.verify(dir.path(), &part).unwrap().1,
            "second time: remembered"
        );
        v.save().unwrap();
        // A restart remembers it.
        let v = VerifiedParts::open(Some(state.path()), dir.path());
        assert!(
            !v.verify(dir.path(), &part).unwrap().1,
            "after a restart: remembered"
        );
        // Rewritten with the same size: hashed again, and refused.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&f, b"EXPERT BYTES").unwrap();
        assert!(matches!(
            v.verify(dir.path(), &part),
            Err(BundleError::ChecksumMismatch { .. })
        ));
        // No state directory: every start hashes.
        let v = VerifiedParts::open(None, dir.path());
        std::fs::write(&f, b"expert bytes").unwrap();
        assert!(v.verify(dir.path(), &part).unwrap().1);
        v.save().unwrap();
    }
}
