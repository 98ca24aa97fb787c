//! What a node holds, and how it follows the replicated placement: experts copied in by moves,
//! dropped when a move takes them away.
//!
//! [`Holdings`] keeps the node's open experts by (layer, expert) and builds the [`Shard`] the
//! node serves from them; a change builds a new shard and swaps it in whole (a running call
//! finishes on the shard it started with). With a control-plane seat, [`follow`] runs on a
//! thread of its own and, at every new committed state (and once a second), reconciles:
//!
//! 1. **wanted** = the experts the state gives this node + those moves in flight bring to it.
//!    Each wanted expert not open yet is opened from the bundle directory when its blob is
//!    there and verifies, else **copied** from a node holding it (the move's source first)
//!    over QUIC: `Fetch` frames of at most [`CHUNK`] bytes into `FILE.partial` (a copy cut
//!    off resumes where the partial file ends), paced to `--move-rate` bytes per second, the
//!    whole file checked against the manifest's SHA-256 before it is renamed into place and
//!    opened. Then the target proposes `complete_move` (the switch: it becomes a holder, the
//!    source stops being one) — only once it serves the expert, so the coordinator never
//!    routes a row to a node that does not hold it. A copy that fails [`MAX_ATTEMPTS`] times
//!    is given up (`abort_move`).
//! 2. **kept** = wanted + the experts this node is the source of a move in flight for. An open
//!    expert not kept for [`DROP_GRACE`] is dropped (the grace lets every coordinator take the
//!    new placement first: a coordinator a version behind may still route a row here); with
//!    `--prune` its blob file is deleted too.
//!
//! Serving `Fetch` ([`Holdings::serve_fetch`]) reads only files the manifest names (never a
//! path from the request), and only when the file has the manifest's size.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ternfleet_control::state::{ClusterState, Command, Outcome};
use ternfleet_shared::bundle::{ExpertPart, Manifest, VerifiedParts};
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::expert::ExpertBackend;
use ternfleet_shared::net::{read_frame, write_frame, CONNECT_TIMEOUT};
use ternfleet_shared::wire::{Frame, MAX_BLOB_CHUNK};

use crate::control::Member;
use crate::expert::{FfnWeights, LocalExperts};
use crate::service::{Service, Shard};
use crate::shard::{open_expert_with, ExpertShape};
use crate::store::{Evict, StoreExperts};

/// Bytes asked for per `Fetch` by default (`--move-chunk`).
pub const CHUNK: u32 = 1 << 20;
/// How long an expert no longer held stays open (coordinators take the new placement first).
pub const DROP_GRACE: Duration = Duration::from_secs(5);
/// Failed copies of one move before it is given up.
pub const MAX_ATTEMPTS: u32 = 3;
/// Experts copied before they are served and their moves switched (one shard rebuild each).
const BATCH: usize = 16;
/// How long an expert that could not be obtained waits before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// How long one `Fetch` may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

/// How the node keeps its experts in memory.
#[derive(Clone, Copy, Debug)]
pub struct BackendOptions {
    /// `None`: every expert mapped; else the expert store's RAM budget.
    pub ram_budget: Option<u64>,
    pub evict: Evict,
    pub io_threads: usize,
}

/// How moves copy into this node and what a source does after.
#[derive(Clone, Copy, Debug)]
pub struct MoveOptions {
    /// Delete the blob file of an expert dropped after a move (`--prune`).
    pub prune: bool,
    /// Copy rate limit, bytes per second (0: none; `--move-rate`).
    pub rate: u64,
    /// Bytes per `Fetch` (`--move-chunk`).
    pub chunk: u32,
}

/// The node's open experts and where they come from.
pub struct Holdings {
    id: String,
    dir: PathBuf,
    man: Arc<Manifest>,
    shape: ExpertShape,
    backend: BackendOptions,
    verified: VerifiedParts,
    svc: Arc<Service>,
    moves: MoveOptions,
    open: Mutex<BTreeMap<(u32, u32), FfnWeights>>,
}

type Key = (u32, u32);

impl Holdings {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: &str,
        dir: PathBuf,
        man: Arc<Manifest>,
        shape: ExpertShape,
        backend: BackendOptions,
        verified: VerifiedParts,
        svc: Arc<Service>,
        moves: MoveOptions,
    ) -> Holdings {
        Holdings {
            id: id.to_string(),
            dir,
            man,
            shape,
            backend,
            verified,
            svc,
            moves: MoveOptions {
                chunk: moves.chunk.max(1),
                ..moves
            },
            open: Mutex::new(BTreeMap::new()),
        }
    }

    fn part(&self, (l, e): Key) -> Option<&ExpertPart> {
        self.man
            .experts
            .iter()
            .find(|p| p.layer == l as usize && p.expert == e as usize)
    }

    /// The bundle's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.man
    }

    /// How the experts compute.
    pub fn shape(&self) -> ExpertShape {
        self.shape
    }

    /// The node's frame handler.
    pub fn svc(&self) -> &Service {
        &self.svc
    }

    /// The verified-blob memory (the loader shares it).
    pub fn verified(&self) -> &VerifiedParts {
        &self.verified
    }

    /// The experts open now.
    pub fn held(&self) -> BTreeSet<Key> {
        self.open
            .lock()
            .map(|o| o.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Serves `experts` (opened by the loader) from now on.
    pub fn install(&self, experts: Vec<(Key, FfnWeights)>) -> Result<(), String> {
        let mut open = self.open.lock().map_err(|_| "holdings lock poisoned")?;
        open.extend(experts);
        let shard = self.build(&open)?;
        self.svc.ready(shard);
        Ok(())
    }

    /// A shard over `open` (model numbers ascending within each layer).
    fn build(&self, open: &BTreeMap<Key, FfnWeights>) -> Result<Shard, String> {
        let n_layer = self.man.n_layer;
        let mut held: Vec<Vec<usize>> = vec![Vec::new(); n_layer];
        let mut layers: Vec<Vec<FfnWeights>> = vec![Vec::new(); n_layer];
        for (&(l, e), w) in open {
            let l = l as usize;
            if l < n_layer {
                held[l].push(e as usize);
                layers[l].push(w.clone());
            }
        }
        let backend: Box<dyn ExpertBackend> = match self.backend.ram_budget {
            None => Box::new(LocalExperts::new(layers)),
            Some(b) => Box::new(
                StoreExperts::new(
                    layers,
                    usize::MAX,
                    b,
                    self.backend.evict,
                    self.backend.io_threads.max(1),
                )
                .map_err(|e| format!("expert store: {e}"))?,
            ),
        };
        Ok(Shard::new(backend, &held, self.man.moe.n_expert))
    }

    /// Adds and removes experts, then serves the new shard.
    fn change(&self, add: Vec<(Key, FfnWeights)>, drop: &[Key]) -> Result<(), String> {
        let mut open = self.open.lock().map_err(|_| "holdings lock poisoned")?;
        open.extend(add);
        for k in drop {
            open.remove(k);
        }
        let shard = self.build(&open)?;
        self.svc.replace(shard);
        Ok(())
    }

    /// Answers a member's `Fetch`: the chunk of a blob this node has a complete file of.
    pub fn serve_fetch(&self, layer: u32, expert: u32, offset: u64, max: u32) -> Frame {
        let err = |class, message: String| Frame::Error { class, message };
        let Some(part) = self.part((layer, expert)) else {
            return err(
                ErrorClass::NotFound,
                format!("layer {layer} expert {expert} is not in the bundle"),
            );
        };
        let path = self.dir.join(&part.part.file);
        let read = || -> std::io::Result<Option<Vec<u8>>> {
            let mut f = std::fs::File::open(&path)?;
            if f.metadata()?.len() != part.part.bytes {
                return Ok(None);
            }
            let n = (part.part.bytes.saturating_sub(offset)).min(max.min(MAX_BLOB_CHUNK) as u64);
            f.seek(SeekFrom::Start(offset))?;
            let mut buf = vec![0u8; n as usize];
            f.read_exact(&mut buf)?;
            Ok(Some(buf))
        };
        if offset > part.part.bytes {
            return err(
                ErrorClass::BadRequest,
                format!(
                    "offset {offset} is past the blob's {} bytes",
                    part.part.bytes
                ),
            );
        }
        match read() {
            Ok(Some(bytes)) => Frame::Blob {
                layer,
                expert,
                offset,
                total: part.part.bytes,
                bytes,
            },
            Ok(None) => err(
                ErrorClass::NotFound,
                format!(
                    "node {}: the blob of layer {layer} expert {expert} is incomplete here",
                    self.id
                ),
            ),
            Err(e) => err(
                ErrorClass::NotFound,
                format!(
                    "node {}: layer {layer} expert {expert}: {}: {e}",
                    self.id,
                    path.display()
                ),
            ),
        }
    }
}

/// What the state asks of this node.
struct Wanted {
    /// Experts it should serve (held, or brought by a move in flight).
    wanted: BTreeSet<Key>,
    /// `wanted` + experts a move in flight takes from it (kept until the switch).
    kept: BTreeSet<Key>,
    /// Moves in flight to it: id → (expert, source).
    incoming: BTreeMap<u64, (Key, Option<String>)>,
}

fn wanted(state: &ClusterState, me: &str) -> Option<Wanted> {
    let node = state.nodes.get(me)?;
    let mut wanted: BTreeSet<Key> = node
        .experts
        .iter()
        .flat_map(|(&l, es)| es.iter().map(move |&e| (l, e)))
        .collect();
    let mut incoming = BTreeMap::new();
    let mut kept = BTreeSet::new();
    for (&id, m) in &state.moves {
        if m.to == me {
            wanted.insert((m.layer, m.expert));
            incoming.insert(id, ((m.layer, m.expert), m.from.clone()));
        }
        if m.from.as_deref() == Some(me) {
            kept.insert((m.layer, m.expert));
        }
    }
    kept.extend(wanted.iter().copied());
    Some(Wanted {
        wanted,
        kept,
        incoming,
    })
}

/// The nodes to copy `key` from: `first` (a move's source), then every other holder (in
/// service first), with their addresses.
fn sources(state: &ClusterState, me: &str, key: Key, first: Option<&str>) -> Vec<(String, String)> {
    // The move's source first, then holders in service, then the others (a drained node
    // keeps its files).
    let mut holders: Vec<(bool, bool, String, String)> = state
        .nodes
        .iter()
        .filter(|(id, n)| {
            id.as_str() != me && n.experts.get(&key.0).is_some_and(|s| s.contains(&key.1))
        })
        .map(|(id, n)| {
            let not_first = Some(id.as_str()) != first;
            (
                not_first,
                !n.status.in_service(),
                id.clone(),
                n.addr.clone(),
            )
        })
        .collect();
    holders.sort();
    holders
        .into_iter()
        .map(|(_, _, id, addr)| (id, addr))
        .collect()
}

/// Follows the replicated placement until the member stops (see the module's doc).
pub fn follow(
    h: Arc<Holdings>,
    m: Arc<Member>,
    endpoint: quinn::Endpoint,
    client: quinn::ClientConfig,
    rt: tokio::runtime::Handle,
) {
    let mut rx = m.handle.applied();
    let mut unneeded: HashMap<Key, Instant> = HashMap::new();
    let mut failures: HashMap<u64, u32> = HashMap::new();
    let mut completed: HashMap<u64, Instant> = HashMap::new();
    let mut conns: HashMap<String, quinn::Connection> = HashMap::new();
    let mut retry_at: HashMap<Key, Instant> = HashMap::new();
    loop {
        let state = rx.borrow_and_update().clone();
        if let Some(w) = wanted(&state, &h.id).filter(|_| state.placement_version > 0) {
            // Copy in and open what is wanted and not open, a batch at a time: each batch
            // served (one new shard) and its moves switched before the next is copied.
            let missing: Vec<Key> = w
                .wanted
                .difference(&h.held())
                .copied()
                .filter(|k| retry_at.get(k).is_none_or(|t| Instant::now() >= *t))
                .collect();
            for batch in missing.chunks(BATCH) {
                let mut add = Vec::new();
                for &key in batch {
                    let incoming = w.incoming.iter().find(|(_, (k, _))| *k == key);
                    let first = incoming.and_then(|(_, (_, from))| from.as_deref());
                    match obtain(&h, &state, key, first, &endpoint, &client, &rt, &mut conns) {
                        Ok(weights) => add.push((key, weights)),
                        Err(e) => {
                            tracing::warn!("moves: layer {} expert {}: {e}", key.0, key.1);
                            retry_at.insert(key, Instant::now() + RETRY_AFTER);
                            if let Some((&id, _)) = incoming {
                                let n = failures.entry(id).or_default();
                                *n += 1;
                                if *n >= MAX_ATTEMPTS {
                                    tracing::error!(
                                        "moves: move {id} failed {n} times: giving it up"
                                    );
                                    propose(&m, &rt, Command::AbortMove { id });
                                    failures.remove(&id);
                                }
                            }
                        }
                    }
                }
                if add.is_empty() {
                    continue;
                }
                let n = add.len();
                match h.change(add, &[]) {
                    Ok(()) => tracing::info!(experts = n, "moves: serving {n} experts more"),
                    Err(e) => tracing::error!("moves: rebuilding the shard: {e}"),
                }
                complete(&h, &m, &rt, &w, &mut completed);
            }
            retry_at.retain(|k, _| w.wanted.contains(k));
            // Drop what is no longer kept, after the grace.
            let held = h.held();
            let now = Instant::now();
            unneeded.retain(|k, _| !w.kept.contains(k) && held.contains(k));
            for k in held.difference(&w.kept) {
                unneeded.entry(*k).or_insert(now);
            }
            let drop: Vec<Key> = unneeded
                .iter()
                .filter(|(_, &t)| now - t >= DROP_GRACE)
                .map(|(k, _)| *k)
                .collect();
            if !drop.is_empty() {
                match h.change(Vec::new(), &drop) {
                    Ok(()) => {
                        for k in &drop {
                            unneeded.remove(k);
                            tracing::info!("moves: dropped layer {} expert {}", k.0, k.1);
                            if h.moves.prune {
                                prune(&h, *k);
                            }
                        }
                    }
                    Err(e) => tracing::error!("moves: rebuilding the shard: {e}"),
                }
            }
            // Switch every move whose expert this node serves (retried once a second until
            // the state shows it done).
            complete(&h, &m, &rt, &w, &mut completed);
            completed.retain(|id, _| w.incoming.contains_key(id));
            failures.retain(|id, _| w.incoming.contains_key(id));
        }
        let changed =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(1), rx.changed()).await });
        if let Ok(Err(_)) = changed {
            return; // the member stopped
        }
    }
}

/// Proposes `complete_move` for every move to this node whose expert it serves (once a
/// second at most per move).
fn complete(
    h: &Holdings,
    m: &Member,
    rt: &tokio::runtime::Handle,
    w: &Wanted,
    completed: &mut HashMap<u64, Instant>,
) {
    let held = h.held();
    for (&id, (key, _)) in &w.incoming {
        let recent = completed
            .get(&id)
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
        if held.contains(key) && !recent {
            completed.insert(id, Instant::now());
            propose(m, rt, Command::CompleteMove { id });
        }
    }
}

fn propose(m: &Member, rt: &tokio::runtime::Handle, cmd: Command) {
    let what = format!("{cmd:?}");
    match rt.block_on(m.handle.propose(cmd)) {
        Ok(Outcome::Rejected(why)) => tracing::warn!("moves: {what} refused: {why}"),
        Ok(_) => tracing::info!("moves: {what} committed"),
        Err(e) => tracing::debug!("moves: {what}: {e} (retried)"),
    }
}

fn prune(h: &Holdings, key: Key) {
    if let Some(p) = h.part(key) {
        let path = h.dir.join(&p.part.file);
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::info!("moves: pruned {}", path.display()),
            Err(e) => tracing::warn!("moves: pruning {}: {e}", path.display()),
        }
    }
}

/// Opens `key` from the bundle directory, copying its blob first when it is not there whole
/// and verified.
#[allow(clippy::too_many_arguments)]
fn obtain(
    h: &Holdings,
    state: &ClusterState,
    key: Key,
    first: Option<&str>,
    endpoint: &quinn::Endpoint,
    client: &quinn::ClientConfig,
    rt: &tokio::runtime::Handle,
    conns: &mut HashMap<String, quinn::Connection>,
) -> Result<FfnWeights, String> {
    let part = h
        .part(key)
        .ok_or_else(|| "not in the bundle's manifest".to_string())?
        .clone();
    // Served from its mapping when the node has no RAM budget: read in first, as at load.
    let resident = |w: FfnWeights| -> Result<FfnWeights, String> {
        if h.backend.ram_budget.is_none() {
            w.populate().map_err(|e| format!("reading it in: {e}"))?;
        }
        Ok(w)
    };
    if let Ok(w) = open_expert_with(&h.dir, &part, h.shape, &h.verified) {
        return resident(w);
    }
    let srcs = sources(state, &h.id, key, first);
    if srcs.is_empty() {
        return Err("no node holds it to copy from".into());
    }
    let mut last = String::new();
    for (src, addr) in srcs {
        let t = Instant::now();
        match copy(h, &part, &src, &addr, endpoint, client, rt, conns) {
            Ok(bytes) => {
                // The manifest's SHA-256 of the whole file, checked before it is used.
                let w = open_expert_with(&h.dir, &part, h.shape, &h.verified).map_err(|e| {
                    let _ = std::fs::remove_file(h.dir.join(&part.part.file));
                    format!("the copy from {src} does not verify (deleted): {e}")
                })?;
                if let Err(e) = h.verified.save() {
                    tracing::debug!("moves: remembering verified blobs: {e}");
                }
                tracing::info!(
                    layer = key.0,
                    expert = key.1,
                    from = %src,
                    bytes,
                    sha256 = %part.part.sha256,
                    "moves: copied layer {} expert {} from {src}: {} bytes in {:.2}s, sha256 verified",
                    key.0,
                    key.1,
                    part.part.bytes,
                    t.elapsed().as_secs_f64()
                );
                return resident(w);
            }
            Err(e) => {
                conns.remove(&src);
                last = format!("copying from {src} at {addr}: {e}");
            }
        }
    }
    Err(last)
}

/// Copies `part`'s blob from `src` over QUIC: [`copy_with`] asking through one connection
/// (kept in `conns` for the next blob).
#[allow(clippy::too_many_arguments)]
fn copy(
    h: &Holdings,
    part: &ExpertPart,
    src: &str,
    addr: &str,
    endpoint: &quinn::Endpoint,
    client: &quinn::ClientConfig,
    rt: &tokio::runtime::Handle,
    conns: &mut HashMap<String, quinn::Connection>,
) -> Result<u64, String> {
    let conn = match conns.get(src) {
        Some(c) if c.close_reason().is_none() => c.clone(),
        _ => {
            let c = rt.block_on(connect(endpoint, client, src, addr))?;
            conns.insert(src.to_string(), c.clone());
            c
        }
    };
    copy_with(&h.dir, part, h.moves.chunk, h.moves.rate, |req| {
        rt.block_on(ask(&conn, req))
    })
}

/// Copies `part`'s blob into `DIR/FILE.partial` by `Fetch`es of `chunk` bytes answered by
/// `fetch`, from where the partial file ends (a copy cut off resumes), at most `rate` bytes
/// per second (0: unpaced), then renames it into place. The caller checks the SHA-256.
/// Returns the bytes transferred now.
pub fn copy_with(
    dir: &std::path::Path,
    part: &ExpertPart,
    chunk: u32,
    rate: u64,
    mut fetch: impl FnMut(&Frame) -> Result<Frame, String>,
) -> Result<u64, String> {
    let dest = dir.join(&part.part.file);
    let partial = PathBuf::from(format!("{}.partial", dest.display()));
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&partial)
        .map_err(|e| format!("{}: {e}", partial.display()))?;
    let mut offset = f.metadata().map_err(|e| e.to_string())?.len();
    if offset > part.part.bytes {
        f.set_len(0).map_err(|e| e.to_string())?;
        offset = 0;
    }
    if offset > 0 {
        tracing::info!(
            "moves: resuming layer {} expert {} at byte {offset} of {}",
            part.layer,
            part.expert,
            part.part.bytes
        );
    }
    let t0 = Instant::now();
    let mut moved = 0u64;
    while offset < part.part.bytes {
        let req = Frame::Fetch {
            layer: part.layer as u32,
            expert: part.expert as u32,
            offset,
            max: chunk,
        };
        match fetch(&req)? {
            Frame::Blob {
                offset: at,
                total,
                bytes,
                ..
            } if at == offset && total == part.part.bytes && !bytes.is_empty() => {
                f.write_all(&bytes)
                    .map_err(|e| format!("{}: {e}", partial.display()))?;
                offset += bytes.len() as u64;
                moved += bytes.len() as u64;
            }
            Frame::Blob {
                offset: at,
                total,
                bytes,
                ..
            } => {
                return Err(format!(
                    "answered {} bytes at {at} of {total}, asked at {offset} of {}",
                    bytes.len(),
                    part.part.bytes
                ))
            }
            Frame::Error { class, message } => return Err(format!("{class:?}: {message}")),
            other => return Err(format!("answered {}", other.name())),
        }
        if rate > 0 {
            let due = Duration::from_secs_f64(moved as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(t0.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
    f.sync_all().map_err(|e| e.to_string())?;
    drop(f);
    std::fs::rename(&partial, &dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    Ok(moved)
}

async fn connect(
    endpoint: &quinn::Endpoint,
    client: &quinn::ClientConfig,
    id: &str,
    addr: &str,
) -> Result<quinn::Connection, String> {
    let sock = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| format!("{addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("{addr}: no address"))?;
    let connecting = endpoint
        .connect_with(client.clone(), sock, id)
        .map_err(|e| e.to_string())?;
    tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| format!("no handshake within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| e.to_string())
}

async fn ask(conn: &quinn::Connection, req: &Frame) -> Result<Frame, String> {
    let go = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let bytes = req.encode().map_err(|e| e.to_string())?;
        write_frame(&mut send, &bytes).await?;
        read_frame(&mut recv).await
    };
    tokio::time::timeout(FETCH_TIMEOUT, go)
        .await
        .map_err(|_| format!("no answer within {FETCH_TIMEOUT:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use ternfleet_control::state::{Move, NodeCaps, NodeRecord, NodeStatus};

    fn node(experts: &[(u32, &[u32])], status: NodeStatus) -> NodeRecord {
        NodeRecord {
            raft_id: 1,
            addr: "127.0.0.1:1".into(),
            caps: NodeCaps::default(),
            status,
            last_heartbeat_ms: 0,
            experts: experts
                .iter()
                .map(|(l, es)| (*l, es.iter().copied().collect()))
                .collect(),
            applied: 0,
        }
    }

    #[test]
    fn a_copy_cut_off_resumes_where_its_partial_file_ends_and_is_paced() {
        use ternfleet_shared::bundle::Part;
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let part = ExpertPart {
            layer: 1,
            expert: 2,
            part: Part {
                file: "experts/blk.1.2.gguf".into(),
                bytes: src.len() as u64,
                sha256: String::new(),
            },
            tensors: Vec::new(),
        };
        let serve = |req: &Frame| match *req {
            Frame::Fetch { offset, max, .. } => {
                let end = (offset as usize + max as usize).min(src.len());
                Ok(Frame::Blob {
                    layer: 1,
                    expert: 2,
                    offset,
                    total: src.len() as u64,
                    bytes: src[offset as usize..end].to_vec(),
                })
            }
            _ => Err("not a fetch".to_string()),
        };
        // Cut off after three chunks of 1,000.
        let mut asked = Vec::new();
        let r = copy_with(dir.path(), &part, 1000, 0, |req| {
            if let Frame::Fetch { offset, .. } = req {
                asked.push(*offset);
            }
            if asked.len() > 3 {
                Err("connection lost".into())
            } else {
                serve(req)
            }
        });
        assert!(r.unwrap_err().contains("connection lost"));
        let partial = dir.path().join("experts/blk.1.2.gguf.partial");
        assert_eq!(std::fs::read(&partial).unwrap(), &src[..3000]);
        // Resumed: asks from byte 3,000 on, paced to 20,000 bytes/s (7,000 bytes: >= 0.3 s).
        let mut first = None;
        let t = Instant::now();
        let moved = copy_with(dir.path(), &part, 1000, 20_000, |req| {
            if let Frame::Fetch { offset, .. } = req {
                first.get_or_insert(*offset);
            }
            serve(req)
        })
        .unwrap();
        assert_eq!((first, moved), (Some(3000), 7000));
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        assert!(!partial.exists());
        assert_eq!(
            std::fs::read(dir.path().join(&part.part.file)).unwrap(),
            src
        );
        // A source answering the wrong range is an error, not a corrupt file.
        std::fs::remove_file(dir.path().join(&part.part.file)).unwrap();
        let e = copy_with(dir.path(), &part, 1000, 0, |req| match serve(req)? {
            Frame::Blob { bytes, total, .. } => Ok(Frame::Blob {
                layer: 1,
                expert: 2,
                offset: 5,
                total,
                bytes,
            }),
            f => Ok(f),
        })
        .unwrap_err();
        assert!(e.contains("asked at 0"), "{e}");
    }

    #[test]
    fn a_move_is_wanted_by_its_target_and_kept_by_its_source_until_the_switch() {
        let mut s = ClusterState::default();
        s.nodes
            .insert("a".into(), node(&[(0, &[0, 1])], NodeStatus::Up));
        s.nodes
            .insert("b".into(), node(&[(0, &[1])], NodeStatus::Draining));
        s.nodes.insert("c".into(), node(&[], NodeStatus::Up));
        s.moves.insert(
            7,
            Move {
                layer: 0,
                expert: 0,
                from: Some("a".into()),
                to: "c".into(),
            },
        );
        let c = wanted(&s, "c").unwrap();
        assert_eq!(c.wanted, BTreeSet::from([(0, 0)]));
        assert_eq!(c.incoming[&7], ((0, 0), Some("a".into())));
        let a = wanted(&s, "a").unwrap();
        assert_eq!(a.kept, BTreeSet::from([(0, 0), (0, 1)]));
        assert!(wanted(&s, "zz").is_none());
        // The switch: `a` no longer keeps expert 0.
        s.moves.clear();
        s.nodes
            .get_mut("a")
            .unwrap()
            .experts
            .get_mut(&0)
            .unwrap()
            .remove(&0);
        assert_eq!(wanted(&s, "a").unwrap().kept, BTreeSet::from([(0, 1)]));
        // Sources: the move's source first, then holders in service, then the others.
        s.nodes
            .get_mut("a")
            .unwrap()
            .experts
            .get_mut(&0)
            .unwrap()
            .insert(1);
        s.nodes
            .insert("d".into(), node(&[(0, &[1])], NodeStatus::Up));
        let ids: Vec<String> = sources(&s, "c", (0, 1), Some("b"))
            .into_iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(ids, ["b", "a", "d"]);
        let ids: Vec<String> = sources(&s, "c", (0, 1), None)
            .into_iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(ids, ["a", "d", "b"]);
    }
}
