//! The expert store: which experts a process keeps in RAM within a byte budget, which it reads
//! from disk on demand or ahead of time on a hint (DESIGN.md "Node memory hierarchy").
//!
//! - [`policy`] is the decision logic (LFU or LRU within the budget, hinted experts protected
//!   until their layer runs; no I/O, time as input).
//! - [`StoreExperts`] is the expert backend over it: routed experts live on disk in the model
//!   file and are read into aligned buffers with `O_DIRECT` (so "cold" means read from disk:
//!   nothing of an evicted expert stays in the page cache; where the filesystem refuses
//!   `O_DIRECT`, reads are buffered and the range is dropped from the page cache after).
//!   Hints ([`ExpertBackend::prefetch`]) are read by I/O threads, never on the compute path; a
//!   demand for an expert that is neither resident nor in flight is a miss, read at once by
//!   the I/O threads ahead of any prefetch, counted and timed. A failed read fails the batch
//!   that needed it (that request only); the next demand reads again.
//! - A batch computes its experts in the order their weights are ready: resident ones while
//!   its misses are read, each miss as soon as it lands, on every compute thread.
//! - Reads go into buffers of evicted experts (resized with `mremap` when sizes differ) once
//!   no batch holds them, kept within the budget, not fresh mappings: no page faults or
//!   unmaps per read.
//!
//! Shared experts and dense FFNs are not routed: they stay memory-mapped, outside the budget.
pub mod policy;

pub use policy::{Demand, Evict, ExpertId, Policy, PolicyError, StoreStats};

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use rayon::prelude::*;
use ternfleet_kernels::{Activations, GgmlType};
use ternfleet_shared::compute::{AlignedBuf, ComputeError};
use ternfleet_shared::expert::{ExpertBackend, ExpertBatch, ExpertError, InFlight, Ready};

use crate::expert::{run_ffn, FfnWeights, LocalExperts};

/// Where one routed expert's three matrices sit on disk, and its size in memory.
struct Layout {
    /// Index into the store's open files (a GGUF model, or the expert's blob in a bundle).
    file: usize,
    /// The page-aligned file spans read (the three matrices' spans, merged where they touch
    /// or lie within [`MERGE_GAP`] of each other: one request instead of three for a
    /// bundle's blob), in file order, back to back in the buffer.
    spans: Vec<std::ops::Range<usize>>,
    /// Where gate, up and down start in the buffer.
    starts: [usize; 3],
    /// Bytes of each matrix that must be in the file (a shorter read is an error).
    need: Vec<usize>,
    /// Bytes of the buffer it is read into (each range widened to whole 4 KiB pages).
    bytes: u64,
}

/// One file the store reads from.
struct DiskFile {
    path: PathBuf,
    file: File,
    /// Opened with `O_DIRECT` (else reads are buffered and dropped from the cache after).
    direct: bool,
}

/// Matrices of one expert closer than this in the file are read with one request (the bytes
/// between them are read and kept: at most this much per expert).
const MERGE_GAP: usize = 64 << 10;

fn page_span(r: &std::ops::Range<usize>) -> std::ops::Range<usize> {
    let a = AlignedBuf::ALIGN;
    r.start / a * a..r.end.div_ceil(a) * a
}

impl Layout {
    /// The layout of an expert whose three matrices are mapped from one file (opened into
    /// `files` on first sight); `Ok(None)` when they are not.
    fn of(
        w: &FfnWeights,
        files: &mut Vec<DiskFile>,
        index: &mut HashMap<PathBuf, usize>,
    ) -> Result<Option<Layout>, StoreError> {
        let (Some((pg, rg)), Some((pu, ru)), Some((pd, rd))) =
            (w.gate.file_range(), w.up.file_range(), w.down.file_range())
        else {
            return Ok(None);
        };
        if pg != pu || pg != pd {
            return Ok(None);
        }
        let file = match index.get(pg) {
            Some(&i) => i,
            None => {
                let (file, direct) = open_direct(pg).map_err(|err| StoreError::Open {
                    path: pg.display().to_string(),
                    err,
                })?;
                files.push(DiskFile {
                    path: pg.to_path_buf(),
                    file,
                    direct,
                });
                index.insert(pg.to_path_buf(), files.len() - 1);
                files.len() - 1
            }
        };
        let ranges = [rg, ru, rd];
        let mut order = [0usize, 1, 2];
        order.sort_by_key(|&i| ranges[i].start);
        let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
        for &i in &order {
            let sp = page_span(&ranges[i]);
            match spans.last_mut() {
                Some(last) if sp.start <= last.end + MERGE_GAP => last.end = last.end.max(sp.end),
                _ => spans.push(sp),
            }
        }
        // Buffer offset of each span, then of each matrix within its span.
        let mut span_at = Vec::with_capacity(spans.len());
        let mut at = 0;
        for sp in &spans {
            span_at.push(at);
            at += sp.len();
        }
        let mut starts = [0usize; 3];
        let mut need = vec![0usize; spans.len()];
        for (i, r) in ranges.iter().enumerate() {
            let k = spans
                .iter()
                .position(|sp| sp.start <= r.start && r.end <= sp.end)
                .expect("every range lies in a span");
            starts[i] = span_at[k] + (r.start - spans[k].start);
            need[k] = need[k].max(r.end - spans[k].start);
        }
        let bytes = at as u64;
        Ok(Some(Layout {
            file,
            spans,
            starts,
            need,
            bytes,
        }))
    }
}

/// Mutable state under one lock.
struct State {
    policy: Policy,
    /// Resident experts, with the buffer their matrices point into.
    resident: HashMap<ExpertId, (Arc<FfnWeights>, Arc<AlignedBuf>)>,
    /// Buffers of evicted experts kept for the next reads (a fresh mapping costs a page fault
    /// and a kernel zero-fill per 4 KiB page before `O_DIRECT` can fill it, and an unmap with
    /// its TLB shootdown after). A buffer is reused only once no batch holds it. Each read
    /// that starts trims the free ones so that they and the policy's bytes fit the budget
    /// ([`Shared::take_buffer`]); between an eviction and the start of the read that replaces
    /// it, the evicted expert's buffer is counted here (the same memory it held).
    spare: Vec<Arc<AlignedBuf>>,
    /// Reads that took a spare buffer.
    reused: u64,
    /// Reads that failed, for the demands waiting on them.
    failed: HashMap<ExpertId, String>,
    /// Queued reads: demands at the front, prefetches at the back.
    queue: VecDeque<ExpertId>,
    shutdown: bool,
}

struct Shared {
    files: Vec<DiskFile>,
    /// `layers[l][e]`: the memory-mapped description of expert `e` (shared experts and dense
    /// FFNs are used from the map directly).
    layers: Vec<Vec<FfnWeights>>,
    layouts: Vec<Vec<Option<Layout>>>,
    state: Mutex<State>,
    /// Signalled when a read completes or fails (compute and demands wait on it).
    landed: Condvar,
    /// Signalled when a read is queued, and at shutdown (the I/O threads wait on it).
    work: Condvar,
}

/// The store-backed expert backend of one process (see the module docs).
pub struct StoreExperts {
    shared: Arc<Shared>,
    /// For the layers' input types and the batch checks.
    local: LocalExperts,
    io: Vec<std::thread::JoinHandle<()>>,
}

/// Errors opening a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("opening {path} for the expert store: {err}")]
    Open { path: String, err: std::io::Error },
    #[error("--ram-budget {budget} bytes cannot hold the largest expert ({largest} bytes)")]
    BudgetTooSmall { budget: u64, largest: u64 },
    #[error("starting the expert store's I/O threads: {0}")]
    Spawn(std::io::Error),
}

impl StoreExperts {
    /// A store over `layers` (as `LocalExperts` takes them, weights mapped from a GGUF model
    /// or a bundle's expert blobs) that keeps at most `budget` bytes of routed experts in
    /// memory, read from those files by `io_threads` threads.
    /// The first `n_routed` experts of each layer are routed (stored); the rest (a shared
    /// expert) stay mapped.
    pub fn new(
        layers: Vec<Vec<FfnWeights>>,
        n_routed: usize,
        budget: u64,
        evict: Evict,
        io_threads: usize,
    ) -> Result<StoreExperts, StoreError> {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        let mut layouts: Vec<Vec<Option<Layout>>> = Vec::with_capacity(layers.len());
        for l in &layers {
            let mut row = Vec::with_capacity(l.len());
            for (e, w) in l.iter().enumerate() {
                row.push(if e < n_routed {
                    Layout::of(w, &mut files, &mut index)?
                } else {
                    None
                });
            }
            layouts.push(row);
        }
        let largest = layouts
            .iter()
            .flatten()
            .flatten()
            .map(|l| l.bytes)
            .max()
            .unwrap_or(0);
        if largest > budget {
            return Err(StoreError::BudgetTooSmall { budget, largest });
        }
        let direct = files.iter().all(|f| f.direct);
        let shared = Arc::new(Shared {
            files,
            layers: layers.clone(),
            layouts,
            state: Mutex::new(State {
                policy: Policy::with_eviction(budget, evict),
                resident: HashMap::new(),
                spare: Vec::new(),
                reused: 0,
                failed: HashMap::new(),
                queue: VecDeque::new(),
                shutdown: false,
            }),
            landed: Condvar::new(),
            work: Condvar::new(),
        });
        let mut io = Vec::with_capacity(io_threads.max(1));
        for i in 0..io_threads.max(1) {
            let s = shared.clone();
            match std::thread::Builder::new()
                .name(format!("expert-io-{i}"))
                .spawn(move || s.io_loop())
            {
                Ok(t) => io.push(t),
                Err(err) => {
                    // Stop the threads already started before reporting.
                    shared.lock().shutdown = true;
                    shared.work.notify_all();
                    io.into_iter().for_each(|t: std::thread::JoinHandle<()>| {
                        let _ = t.join();
                    });
                    return Err(StoreError::Spawn(err));
                }
            }
        }
        tracing::info!(
            budget,
            evict = ?evict,
            direct,
            io_threads,
            "expert store: {} routed experts on disk in {} file(s)",
            shared.layouts.iter().flatten().flatten().count(),
            shared.files.len()
        );
        Ok(StoreExperts {
            shared,
            local: LocalExperts::new(layers),
            io,
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> StoreStats {
        let st = self.shared.lock();
        StoreStats {
            resident: st.policy.resident() as u64,
            used_bytes: st.policy.used(),
            budget_bytes: st.policy.budget(),
            spare_bytes: st.spare.iter().map(|b| b.len() as u64).sum(),
            buffers_reused: st.reused,
            ..st.policy.stats().clone()
        }
    }
}

impl Drop for StoreExperts {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for t in self.io.drain(..) {
            let _ = t.join();
        }
    }
}

/// Opens `path` for `O_DIRECT` reads, or buffered when the filesystem refuses (`false`).
fn open_direct(path: &Path) -> std::io::Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((File::open(path)?, false)),
        Err(e) => Err(e),
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn id(layer: usize, expert: usize) -> ExpertId {
        ExpertId {
            layer: layer as u32,
            expert: expert as u32,
        }
    }

    fn layout(&self, id: ExpertId) -> Option<&Layout> {
        self.layouts
            .get(id.layer as usize)?
            .get(id.expert as usize)?
            .as_ref()
    }

    /// Drops evicted experts (their memory goes when no batch holds them) and queues `id`.
    fn queue(&self, st: &mut State, id: ExpertId, evict: &[ExpertId], front: bool) {
        for e in evict {
            if let Some((_, buf)) = st.resident.remove(e) {
                st.spare.push(buf);
            }
        }
        st.failed.remove(&id);
        if front {
            st.queue.push_front(id);
        } else {
            st.queue.push_back(id);
        }
        self.work.notify_one();
    }

    fn io_loop(&self) {
        loop {
            let (id, buf) = {
                let mut st = self.lock();
                loop {
                    if st.shutdown {
                        return;
                    }
                    if let Some(id) = st.queue.pop_front() {
                        let buf = self.take_buffer(&mut st, id);
                        break (id, buf);
                    }
                    st = self.work.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            };
            let got = buf.and_then(|b| self.read(id, b));
            let mut st = self.lock();
            let now = Instant::now();
            match got {
                Ok((w, buf)) => {
                    st.policy.read_done(id, true, now);
                    // Evicted or failed while being read: the policy forgot it.
                    if st.policy.is_resident(id) {
                        st.resident.insert(id, (Arc::new(w), buf));
                    } else {
                        drop(w);
                        st.spare.push(buf);
                    }
                }
                Err(e) => {
                    tracing::warn!("expert store: reading {id}: {e}");
                    st.policy.read_done(id, false, now);
                    st.failed.insert(id, e);
                }
            }
            drop(st);
            self.landed.notify_all();
        }
    }

    /// A buffer for reading expert `id` (already taken off the queue): a spare one that no
    /// batch holds, else a fresh mapping. Then drops unheld spare buffers until they and the
    /// buffers in use (the policy's bytes, this read's included, less the reads still queued)
    /// fit the budget.
    fn take_buffer(&self, st: &mut State, id: ExpertId) -> Result<AlignedBuf, String> {
        let lay = self
            .layout(id)
            .ok_or_else(|| format!("{id} is not stored"))?;
        let len = lay.bytes as usize;
        // A spare of this size, else the largest free one resized (`mremap`: only the pages
        // it grows by are new).
        let free = |b: &Arc<AlignedBuf>| Arc::strong_count(b) == 1;
        let pick = st
            .spare
            .iter()
            .position(|b| b.len() == len && free(b))
            .or_else(|| {
                (0..st.spare.len())
                    .filter(|&i| free(&st.spare[i]))
                    .max_by_key(|&i| st.spare[i].len())
            });
        let reuse = pick
            .and_then(|i| Arc::try_unwrap(st.spare.swap_remove(i)).ok())
            .and_then(|b| b.resized(len).ok());
        let buf = match reuse {
            Some(b) => {
                st.reused += 1;
                b
            }
            None => AlignedBuf::zeroed(len).ok_or_else(|| format!("allocating {len} bytes"))?,
        };
        let mut spare: u64 = st.spare.iter().map(|b| b.len() as u64).sum();
        // Reads still queued are counted by the policy but hold no buffer yet: the spare
        // buffers they will take are not over the budget.
        let queued: u64 = st
            .queue
            .iter()
            .filter_map(|&q| self.layout(q))
            .map(|l| l.bytes)
            .sum();
        let mapped = st.policy.used().saturating_sub(queued);
        let budget = st.policy.budget();
        let mut i = 0;
        while mapped + spare > budget && i < st.spare.len() {
            if Arc::strong_count(&st.spare[i]) == 1 {
                spare -= st.spare[i].len() as u64;
                st.spare.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(buf)
    }

    /// Reads expert `id`'s three matrices from disk into `buf` (its length, from
    /// [`Shared::take_buffer`]).
    fn read(
        &self,
        id: ExpertId,
        mut buf: AlignedBuf,
    ) -> Result<(FfnWeights, Arc<AlignedBuf>), String> {
        let lay = self
            .layout(id)
            .ok_or_else(|| format!("{id} is not stored"))?;
        let w = &self.layers[id.layer as usize][id.expert as usize];
        let f = &self.files[lay.file];
        let mut at = 0;
        for (span, &need) in lay.spans.iter().zip(&lay.need) {
            let dst = &mut buf.as_mut_slice()[at..at + span.len()];
            let n = read_fully(&f.file, dst, span.start as u64)
                .map_err(|e| format!("{}: read at {}: {e}", f.path.display(), span.start))?;
            if n < need {
                return Err(format!(
                    "{}: short read at {} ({n} of {need} bytes)",
                    f.path.display(),
                    span.start
                ));
            }
            // The page padding past the file's end: no stale bytes of a reused buffer.
            dst[n..].fill(0);
            if !f.direct {
                drop_cached(&f.file, span.start, span.len());
            }
            at += span.len();
        }
        let starts = lay.starts;
        let buf = Arc::new(buf);
        let e = |e: ComputeError| e.to_string();
        let w = FfnWeights {
            gate: w.gate.rebind(&buf, starts[0]).map_err(e)?,
            up: w.up.rebind(&buf, starts[1]).map_err(e)?,
            down: w.down.rebind(&buf, starts[2]).map_err(e)?,
            act: w.act,
            routed: w.routed,
        };
        Ok((w, buf))
    }

    /// Demands `id` (pinning it), waiting while reads in flight fill the budget: they land
    /// and become evictable. Errors when pinned experts alone fill it.
    fn demand_blocking(&self, id: ExpertId) -> Result<(), PolicyError> {
        let bytes = self.layout(id).map_or(0, |l| l.bytes);
        let mut st = self.lock();
        loop {
            match st.policy.demand(id, bytes, Instant::now()) {
                Ok(Demand::Read { evict }) => {
                    self.queue(&mut st, id, &evict, true);
                    return Ok(());
                }
                Ok(_) => return Ok(()),
                Err(PolicyError::Full { reading, .. }) if reading > 0 => {
                    st = self.landed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Moves `id`'s read to the front of the queue if it has not started.
    fn to_front(&self, st: &mut State, id: ExpertId) {
        if let Some(i) = st.queue.iter().position(|&q| q == id) {
            st.queue.remove(i);
            st.queue.push_front(id);
        }
    }

    /// `layer` has demanded its experts: the policy ends the protection of its hints, and
    /// hinted reads for it that have not started are dropped from the queue.
    fn finish_layer(&self, st: &mut State, layer: usize) {
        for id in st.policy.layer_ran(layer as u32) {
            if let Some(i) = st.queue.iter().position(|&q| q == id) {
                if st.policy.cancel(id) {
                    st.queue.remove(i);
                }
            }
        }
    }

    /// Takes from `todo` an expert of `layer` whose weights are ready (mapped, resident, or
    /// whose read failed), waiting for a read to land when none is; `None` once `todo` is
    /// empty.
    fn next_ready(&self, layer: usize, todo: &Mutex<Vec<usize>>) -> Option<(usize, Loaded)> {
        let mut st = self.lock();
        loop {
            {
                let mut todo = todo.lock().unwrap_or_else(|p| p.into_inner());
                if todo.is_empty() {
                    return None;
                }
                let found = todo
                    .iter()
                    .enumerate()
                    .find_map(|(i, &e)| Some((i, self.loaded(&st, layer, e)?)));
                if let Some((i, r)) = found {
                    return Some((todo.remove(i), r));
                }
            }
            st = self.landed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Expert `e` of `layer` if its weights are ready for compute (mapped, resident, or its
    /// read failed); `None` while its read is still to land.
    fn loaded(&self, st: &State, layer: usize, e: usize) -> Option<Loaded> {
        if self.layouts[layer][e].is_none() {
            return Some(Loaded::Mapped);
        }
        let id = Shared::id(layer, e);
        if let Some((w, _)) = st.resident.get(&id) {
            return Some(Loaded::Read(w.clone()));
        }
        if let Some(err) = st.failed.get(&id) {
            return Some(Loaded::Failed(err.clone()));
        }
        // Neither resident, failed nor being read: another request's failure released it (a
        // rare race); fail this batch (retryable) instead of waiting for a read that will
        // not come.
        (!st.policy.is_known(id))
            .then(|| Loaded::Failed("released before its read landed".to_string()))
    }
}

/// One expert's output rows for a batch, or why it has none.
type ExpertOutput = Result<Vec<f32>, ExpertError>;

/// An expert's weights, ready for compute.
enum Loaded {
    /// Not stored: used from the map.
    Mapped,
    /// Read into memory.
    Read(Arc<FfnWeights>),
    /// Its read failed.
    Failed(String),
}

/// `pread` until `buf` is full or the file ends; returns the bytes read.
fn read_fully(f: &File, buf: &mut [u8], mut off: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                off += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Asks the kernel to drop `len` bytes at `off` of `f` from the page cache (buffered reads).
fn drop_cached(f: &File, off: usize, len: usize) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain advice call on an open descriptor; it reads no memory of ours.
    unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            off as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

impl StoreExperts {
    fn run(&self, b: &ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        let s = &*self.shared;
        let layer = b.layer;
        // Shapes, routes and input type: the checks of the in-process backend.
        self.local.check(b)?;
        let experts = &s.layers[layer];
        let d = experts[0].n_embd();
        let mut mine: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
        for (i, r) in b.routes.iter().enumerate() {
            mine[r.expert as usize].push(i);
        }
        let active: Vec<usize> = (0..experts.len())
            .filter(|&e| !mine[e].is_empty())
            .collect();
        // Demand every stored expert of the batch at once, so every read starts now.
        let stored: Vec<usize> = active
            .iter()
            .copied()
            .filter(|&e| s.layouts[layer][e].is_some())
            .collect();
        let mut pinned = Vec::new();
        let mut one_by_one = false;
        {
            let mut st = s.lock();
            let now = Instant::now();
            for &e in &stored {
                let id = Shared::id(layer, e);
                let bytes = s.layout(id).map_or(0, |l| l.bytes);
                match st.policy.demand(id, bytes, now) {
                    Ok(Demand::Read { evict }) => {
                        s.queue(&mut st, id, &evict, true);
                        pinned.push(id);
                    }
                    Ok(Demand::Wait) => {
                        // A hinted read not yet started goes ahead of other hints.
                        s.to_front(&mut st, id);
                        pinned.push(id);
                    }
                    Ok(Demand::Hit) => pinned.push(id),
                    Err(PolicyError::Full { .. }) => {
                        // The budget cannot hold the whole layer's share at once: let go
                        // and take the experts one at a time below.
                        one_by_one = true;
                        break;
                    }
                    Err(e) => {
                        for id in pinned.drain(..) {
                            st.policy.release(id);
                        }
                        s.finish_layer(&mut st, layer);
                        return Err(unavailable(layer, e.to_string()));
                    }
                }
            }
            if one_by_one {
                for id in pinned.drain(..) {
                    st.policy.release(id);
                }
            } else {
                s.finish_layer(&mut st, layer);
            }
        }
        let compute = |source| ExpertError::Compute { layer, source };
        let run_one = |e: usize, w: &FfnWeights| -> Result<Vec<f32>, ExpertError> {
            let rows: Vec<usize> = mine[e]
                .iter()
                .map(|&r| b.routes[r].token as usize)
                .collect();
            let mut x = Activations::new();
            x.gather(b.input, &rows);
            let mut y = vec![0f32; rows.len() * d];
            run_ffn(w, &x, b.numerics, &mut y).map_err(compute)?;
            Ok(y)
        };
        let run_loaded = |e: usize, w: Loaded| -> ExpertOutput {
            match w {
                Loaded::Mapped => run_one(e, &experts[e]),
                Loaded::Read(w) => run_one(e, &w),
                Loaded::Failed(err) => Err(unavailable(
                    layer,
                    format!("reading {}: {err}", Shared::id(layer, e)),
                )),
            }
        };
        let outputs: Result<Vec<Vec<f32>>, ExpertError> = if one_by_one {
            let r = active
                .iter()
                .map(|&e| {
                    let stored = s.layouts[layer][e].is_some();
                    let id = Shared::id(layer, e);
                    if stored {
                        s.demand_blocking(id)
                            .map_err(|err| unavailable(layer, err.to_string()))?;
                    }
                    let out = match s.next_ready(layer, &Mutex::new(vec![e])) {
                        Some((e, w)) => run_loaded(e, w),
                        None => Err(unavailable(layer, format!("expert {e} not run"))),
                    };
                    if stored {
                        s.lock().policy.release(id);
                    }
                    out
                })
                .collect();
            s.finish_layer(&mut s.lock(), layer);
            r
        } else {
            // Experts in the order their weights are ready: resident ones while the misses
            // are read, each miss as soon as it lands, on every compute thread.
            let todo = Mutex::new(active.clone());
            let workers = rayon::current_num_threads().clamp(1, active.len().max(1));
            // One slot per expert of `active`, filled by whichever worker ran it.
            let slots: Vec<Mutex<Option<ExpertOutput>>> =
                active.iter().map(|_| Mutex::new(None)).collect();
            (0..workers).into_par_iter().for_each(|_| {
                while let Some((e, w)) = s.next_ready(layer, &todo) {
                    let y = run_loaded(e, w);
                    if let Some(i) = active.iter().position(|&a| a == e) {
                        *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(y);
                    }
                }
            });
            active
                .iter()
                .zip(slots)
                .map(|(e, slot)| {
                    slot.into_inner()
                        .unwrap_or_else(|p| p.into_inner())
                        .unwrap_or_else(|| Err(unavailable(layer, format!("expert {e} not run"))))
                })
                .collect()
        };
        {
            let mut st = s.lock();
            for id in pinned {
                st.policy.release(id);
            }
        }
        let outputs = outputs?;
        let mut ys = vec![0f32; b.routes.len() * d];
        for (&e, y) in active.iter().zip(&outputs) {
            for (i, &r) in mine[e].iter().enumerate() {
                ys[r * d..(r + 1) * d].copy_from_slice(&y[i * d..(i + 1) * d]);
            }
        }
        Ok(ys)
    }
}

fn unavailable(layer: usize, reason: String) -> ExpertError {
    ExpertError::Unavailable { layer, reason }
}

impl ExpertBackend for StoreExperts {
    fn input_type(&self, layer: usize) -> Result<GgmlType, ExpertError> {
        self.local.input_type(layer)
    }

    fn submit(&self, batch: &ExpertBatch<'_>) -> Result<Box<dyn InFlight>, ExpertError> {
        Ok(Box::new(Ready(self.run(batch))))
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        let s = &*self.shared;
        let mut st = s.lock();
        let now = Instant::now();
        // Hints queue behind every demand (demands go to the front); those whose layer runs
        // before they start are cancelled (`finish_layer`). Dropping hints while reads wait
        // (session 7's rule) measured slower on Intel in session 29 (MoEfied Gemma, 25 %
        // resident, learned hints 1 ahead: 27-31 t/s against 31-33; docs/moe-scale.md).
        for &e in experts {
            let id = Shared::id(layer, e as usize);
            let Some(bytes) = s.layout(id).map(|l| l.bytes) else {
                continue;
            };
            if let Some(evict) = st.policy.hint(id, bytes, now) {
                s.queue(&mut st, id, &evict, false);
            }
        }
    }

    fn wants_hints(&self) -> bool {
        true
    }

    fn store_stats(&self) -> Option<StoreStats> {
        Some(self.stats())
    }
}
