//! Threaded matrix products over weights that live in a memory-mapped model file: the matmul
//! helpers the coordinator (attention, LM head) and the nodes (expert FFNs) both use.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::gguf::{GgufFile, TensorInfo};
use rayon::prelude::*;
use ternfleet_kernels::tf1_lut::{Tf1Lut, Tf1Tables};
use ternfleet_kernels::{Activations, GgmlType, KernelError, Numerics, QMatrix};

/// Errors from building or running a [`Linear`].
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    #[error("tensor {name}: {msg}")]
    Tensor { name: String, msg: String },
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Bytes in memory aligned to [`AlignedBuf::ALIGN`] (what `O_DIRECT` reads need): an expert
/// read from disk by the expert store. Its own anonymous mapping, unmapped on drop, so an
/// evicted expert's memory goes back to the system at once (the allocator would keep freed
/// multi-megabyte blocks in its arenas, and the process would outgrow its budget).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: an owned private mapping with no interior mutability once shared.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` hands out `&[u8]`, and `base_ptr` only to the arena, whose
// slices write disjoint ranges through it (`ArenaSlice`).
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Alignment of the start (and, for `O_DIRECT`, of every offset and length read).
    pub const ALIGN: usize = 4096;

    /// `len` zeroed bytes; `None` when the mapping fails.
    pub fn zeroed(len: usize) -> Option<AlignedBuf> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        std::ptr::NonNull::new(p.cast()).map(|ptr| AlignedBuf { ptr, len })
    }

    /// The same mapping resized to `len` bytes (moved if it must grow in place and cannot):
    /// pages kept keep their bytes, pages added are zero, pages cut go back to the system.
    /// `Err(self)` unchanged when the kernel refuses.
    pub fn resized(self, len: usize) -> Result<AlignedBuf, AlignedBuf> {
        if len == self.len {
            return Ok(self);
        }
        // SAFETY: `ptr` is a mapping of `len` bytes that this value owns alone (it is moved
        // in); on success the old range is no longer ours and `forget` keeps Drop off it.
        let p = unsafe {
            libc::mremap(
                self.ptr.as_ptr().cast(),
                self.len.max(1),
                len.max(1),
                libc::MREMAP_MAYMOVE,
            )
        };
        // (A successful mremap never returns address 0: Linux does not map the zero page.)
        let Some(ptr) = std::ptr::NonNull::new(p.cast()).filter(|_| p != libc::MAP_FAILED) else {
            return Err(self);
        };
        std::mem::forget(self);
        Ok(AlignedBuf { ptr, len })
    }

    /// The start of the mapping, without borrowing it (for disjoint parts handed out apart).
    fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `len` bytes and uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised (zero-filled or written) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: mapped in `zeroed` with this length; no borrow outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len.max(1)) };
    }
}

/// Where a [`Linear`]'s bytes live.
#[derive(Clone)]
enum Backing {
    /// A memory-mapped model file (`bytes` are file offsets).
    File(Arc<GgufFile>),
    /// A buffer the expert store read (`bytes` are offsets in it).
    Owned(Arc<AlignedBuf>),
}

/// A 2-D weight matrix (`rows` outputs × `cols` inputs, ggml row-major) borrowed from a mapped
/// file, or held in a buffer the expert store read from it. Holding the `Arc` keeps the
/// mapping (or buffer) alive.
#[derive(Clone)]
pub struct Linear {
    file: Backing,
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Range<usize>,
    /// A TF1 matrix's repacked copy ([`Tf1Lut`]), made on first use and shared by clones.
    tf1: Arc<OnceLock<Option<Tf1Lut>>>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Linear({} {:?} {}x{})",
            self.name, self.ty, self.rows, self.cols
        )
    }
}

impl Linear {
    /// Wraps tensor `t` of `file` as a matrix with `t.dims[0]` columns. Errors when the tensor
    /// has more than two non-trivial dimensions or its type has no kernel.
    pub fn new(file: &Arc<GgufFile>, t: &TensorInfo) -> Result<Linear, ComputeError> {
        let err = |msg: String| ComputeError::Tensor {
            name: t.name.clone(),
            msg,
        };
        if t.dims.iter().skip(2).any(|&d| d != 1) {
            return Err(err(format!("expected a 2-D matrix, got dims {:?}", t.dims)));
        }
        if ternfleet_kernels::vec_dot_type(t.ty).is_none() {
            return Err(err(format!("type {} has no matmul kernel", t.ty.name())));
        }
        let cols = usize::try_from(t.cols()).map_err(|_| err("too many columns".into()))?;
        let rows = usize::try_from(t.rows()).map_err(|_| err("too many rows".into()))?;
        let start = usize::try_from(t.offset).map_err(|_| err("offset too large".into()))?;
        let len = usize::try_from(t.size).map_err(|_| err("size too large".into()))?;
        let end = start
            .checked_add(len)
            .ok_or_else(|| err("offset + size overflows".into()))?;
        if end > file.data().len() {
            return Err(err(format!("data {start}..{end} past end of file")));
        }
        let lin = Linear {
            file: Backing::File(file.clone()),
            name: t.name.clone(),
            ty: t.ty,
            rows,
            cols,
            bytes: start..end,
            tf1: Arc::default(),
        };
        // Validate the geometry once; later `matrix()` calls cannot fail.
        QMatrix::new(lin.ty, rows, cols, lin.data()).map_err(|e| err(e.to_string()))?;
        Ok(lin)
    }

    /// Matrix `index` of a 3-D tensor of stacked matrices (dims `[cols, rows, n]`, as ggml
    /// stores MoE expert weights `ffn_{gate,up,down}_exps`): a view, nothing copied.
    pub fn stacked(
        file: &Arc<GgufFile>,
        t: &TensorInfo,
        index: usize,
    ) -> Result<Linear, ComputeError> {
        let err = |msg: String| ComputeError::Tensor {
            name: t.name.clone(),
            msg,
        };
        if t.dims.len() != 3 {
            return Err(err(format!(
                "expected stacked matrices [cols, rows, n], got dims {:?}",
                t.dims
            )));
        }
        let n = usize::try_from(t.dims[2]).map_err(|_| err("too many matrices".into()))?;
        if index >= n {
            return Err(err(format!("matrix {index} of {n}")));
        }
        if ternfleet_kernels::vec_dot_type(t.ty).is_none() {
            return Err(err(format!("type {} has no matmul kernel", t.ty.name())));
        }
        let size = usize::try_from(t.size).map_err(|_| err("size too large".into()))?;
        if size % n != 0 {
            return Err(err(format!("{size} bytes do not split into {n} matrices")));
        }
        let per = size / n;
        let start = usize::try_from(t.offset)
            .ok()
            .and_then(|o| o.checked_add(per * index))
            .ok_or_else(|| err("offset too large".into()))?;
        let end = start + per;
        if end > file.data().len() {
            return Err(err(format!("data {start}..{end} past end of file")));
        }
        let lin = Linear {
            file: Backing::File(file.clone()),
            name: format!("{}[{index}]", t.name),
            ty: t.ty,
            rows: usize::try_from(t.dims[1]).map_err(|_| err("too many rows".into()))?,
            cols: usize::try_from(t.dims[0]).map_err(|_| err("too many columns".into()))?,
            bytes: start..end,
            tf1: Arc::default(),
        };
        QMatrix::new(lin.ty, lin.rows, lin.cols, lin.data()).map_err(|e| err(e.to_string()))?;
        Ok(lin)
    }

    /// The tensor name in the model file.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Element type of the weights.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Raw weight bytes.
    pub fn data(&self) -> &[u8] {
        match &self.file {
            Backing::File(f) => &f.data()[self.bytes.clone()],
            Backing::Owned(b) => &b[self.bytes.clone()],
        }
    }

    /// The file the weights are mapped from and their byte range in it (`None` once rebound
    /// to a buffer, or for a file parsed from memory).
    pub fn file_range(&self) -> Option<(&std::path::Path, Range<usize>)> {
        match &self.file {
            Backing::File(f) => Some((f.path()?, self.bytes.clone())),
            Backing::Owned(_) => None,
        }
    }

    /// The same matrix over `buf[at..at + len]`, where the caller copied this matrix's bytes.
    pub fn rebind(&self, buf: &Arc<AlignedBuf>, at: usize) -> Result<Linear, ComputeError> {
        let len = self.bytes.len();
        if at.checked_add(len).is_none_or(|end| end > buf.len()) {
            return Err(ComputeError::Tensor {
                name: self.name.clone(),
                msg: format!("rebind at {at}: {len} bytes past a buffer of {}", buf.len()),
            });
        }
        Ok(Linear {
            file: Backing::Owned(buf.clone()),
            bytes: at..at + len,
            tf1: Arc::default(),
            ..self.clone()
        })
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }

    /// The kernel view of this matrix.
    pub fn matrix(&self) -> QMatrix<'_> {
        QMatrix::new(self.ty, self.rows, self.cols, self.data())
            .expect("Linear geometry was validated in Linear::new")
    }

    /// Dequantizes row `r` into `out` (`out.len() == cols`): embedding lookups.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), ComputeError> {
        let rb = self.row_bytes();
        let src = &self.data()[r * rb..(r + 1) * rb];
        ternfleet_kernels::dequantize_row(self.ty, src, out)?;
        Ok(())
    }

    /// `out[t * rows + r] = W[r] · x[t]` for every token `t` of `x`, rows split across the rayon
    /// pool, in the float order `numerics` selects. `x` must have been quantized for `self.ty()`.
    ///
    /// A TF1 matrix mapped from a file runs from its repacked copy where the CPU has the
    /// kernels ([`Self::tf1_repacked`]): the same bits, faster.
    pub fn forward(
        &self,
        x: &Activations,
        out: &mut [f32],
        numerics: Numerics,
    ) -> Result<(), ComputeError> {
        match self.tf1_repacked() {
            Some(lut) => tf1_par(lut, x, out),
            None => matmul_par(&self.matrix(), x, out, numerics),
        }
    }

    /// The repacked copy of a TF1 matrix (`ternfleet_kernels::tf1_lut`: the table GEMV, 1.3–1.6x
    /// the plain TF1 GEMV in cache, and a GEMM 1.7–1.8x the plain one from 16 tokens; AVX-512
    /// VBMI and VNNI), made on the first call: only for matrices mapped from a file (whose pages
    /// the kernel may then drop), not for buffers the expert store holds within its budget, and
    /// only where the AVX-512 kernels run and `TERNFLEET_TF1_REPACK` is not `0`. The copy has
    /// as many bytes as the TF1 matrix.
    pub fn tf1_repacked(&self) -> Option<&Tf1Lut> {
        if self.ty != GgmlType::TF1 || !matches!(self.file, Backing::File(_)) || !tf1_repack_on() {
            return None;
        }
        self.tf1
            .get_or_init(|| Tf1Lut::pack_in(&self.matrix(), arena_alloc).ok())
            .as_ref()
    }
}

/// Repacked copies live in chunks of memory backed by 2 MiB pages where the kernel gives them
/// (`MADV_HUGEPAGE`): a mapped model file is read through 2 MiB pages, and an expert's copy on
/// 4 KiB pages of its own (a few hundred KiB) would cost a TLB miss every 4 KiB of its stream.
/// A chunk is unmapped when the last copy in it is dropped.
struct ArenaSlice {
    chunk: Arc<AlignedBuf>,
    at: usize,
    len: usize,
}

impl ternfleet_kernels::tf1_lut::PackedBytes for ArenaSlice {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `at..at + len` lies inside the chunk's mapping (`arena_alloc`), which the
        // `Arc` keeps alive; no reference to the whole mapping is ever made while it is shared.
        unsafe { std::slice::from_raw_parts(self.chunk.base_ptr().add(self.at), self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `arena_alloc` hands each range to one slice only, so this
        // borrow of `&mut self` is the only access to these bytes.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.base_ptr().add(self.at), self.len) }
    }
}

/// Brings every page of `bytes` (a read-only file mapping) into memory now, from disk if it
/// is not in the page cache, so that the first matmul over it does not wait on the disk:
/// `MADV_POPULATE_READ` (Linux 5.14+), or [`touch_pages`] where the kernel lacks it. Never
/// changes the bytes. An I/O error reading the file (a truncated or failing disk) is returned,
/// not met later as a fault in the middle of a call.
pub fn populate(bytes: &[u8]) -> std::io::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    let page = page_size();
    let start = bytes.as_ptr() as usize & !(page - 1);
    let len = bytes.as_ptr() as usize + bytes.len() - start;
    // SAFETY: advice on whole pages that hold part of `bytes`, a live mapping of this
    // process; populating reads them and changes nothing.
    let r = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINVAL) {
        // A kernel before 5.14 (the advice unknown): read the pages instead.
        touch_pages(bytes);
        return Ok(());
    }
    Err(e)
}

/// Reads one byte of every page `bytes` spans (the first byte, then each page boundary inside
/// it), which faults each page in: [`populate`]'s fallback.
pub fn touch_pages(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let page = page_size();
    let first = (page - (bytes.as_ptr() as usize & (page - 1))) & (page - 1);
    let mut sum = bytes[0];
    for i in (first..bytes.len()).step_by(page) {
        sum ^= bytes[i];
    }
    std::hint::black_box(sum);
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|&p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Bytes per arena chunk (a request larger than this gets a chunk of its own).
const ARENA_CHUNK: usize = 64 << 20;

/// The chunk being filled, its size and the bytes of it already handed out. (The size is kept
/// here: `len()` through `Deref` would borrow the whole mapping while slices write parts of it.)
static ARENA: Mutex<Option<(Arc<AlignedBuf>, usize, usize)>> = Mutex::new(None);

/// `len` zeroed bytes, 64-byte aligned, from the arena.
fn arena_alloc(len: usize) -> Option<ArenaSlice> {
    let mut cur = ARENA.lock().ok()?;
    let fits = cur
        .as_ref()
        .is_some_and(|&(_, size, used)| used.next_multiple_of(64) + len <= size);
    if !fits {
        let size = len.max(ARENA_CHUNK).next_multiple_of(2 << 20);
        let chunk = AlignedBuf::zeroed(size)?;
        // SAFETY: advice on a mapping this process just made and owns; it changes only how
        // the kernel backs the pages (huge pages where it can), never their contents.
        unsafe {
            libc::madvise(chunk.base_ptr().cast(), size, libc::MADV_HUGEPAGE);
        }
        *cur = Some((Arc::new(chunk), size, 0));
    }
    let (chunk, _, used) = cur.as_mut()?;
    let at = used.next_multiple_of(64);
    *used = at + len;
    Some(ArenaSlice {
        chunk: chunk.clone(),
        at,
        len,
    })
}

/// Whether TF1 matrices run repacked: the CPU has the kernels, the AVX-512 table is the one in
/// use (`TERNFLEET_KERNELS` not forcing another) and `TERNFLEET_TF1_REPACK` is not `0`.
fn tf1_repack_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        Tf1Lut::supported()
            && ternfleet_kernels::isa() == ternfleet_kernels::Isa::Avx512
            && std::env::var("TERNFLEET_TF1_REPACK").map_or(true, |v| v.trim() != "0")
    })
}

/// Numbers one-token repacked calls, so a thread's tables ([`TF1_OWN`]) know which call's
/// token they hold.
static TF1_CALL: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's activation tables of a repacked one-token call, and that call's number
    /// (a wide matrix's tables take most of a MiB, so the buffer is kept between calls).
    static TF1_OWN: RefCell<(u64, Tf1Tables)> = RefCell::new((u64::MAX, Tf1Tables::default()));
}

/// [`matmul_par`] for a repacked TF1 matrix: one token builds its activation tables
/// ([`tf1_one_token`]) and its row groups split across the pool; several tokens run the
/// repacked GEMM per task. A matrix whose groups × blocks × tokens stay under [`TF1_SPLIT`]
/// runs on the calling thread: an expert's matmul takes tens of microseconds, and the experts
/// of a layer already run in parallel.
fn tf1_par(lut: &Tf1Lut, x: &Activations, out: &mut [f32]) -> Result<(), ComputeError> {
    let (rows, n, nb) = (lut.rows(), x.n(), lut.blocks());
    check_out(rows, n, out)?;
    let split = tf1_split(lut.groups() * nb * n);
    if n == 1 {
        return tf1_one_token(x, split, &mut [(lut, out)]);
    }
    if !split {
        lut.gemm(x, 0..lut.groups(), out)?;
        return Ok(());
    }
    let per = tf1_per(lut, split);
    let tiles: Vec<(usize, Vec<f32>)> = (0..lut.groups().div_ceil(per))
        .into_par_iter()
        .map(|i| {
            let g = i * per..((i + 1) * per).min(lut.groups());
            let r0 = g.start * Tf1Lut::GROUP;
            let len = (g.end * Tf1Lut::GROUP).min(rows) - r0;
            let mut tile = vec![0f32; len * n];
            lut.gemm(x, g, &mut tile).map(|_| (r0, tile))
        })
        .collect::<Result<_, _>>()?;
    scatter_tiles(tiles, rows, n, out);
    Ok(())
}

/// Whether a repacked matmul of `work` groups × blocks × tokens splits across the pool.
fn tf1_split(work: usize) -> bool {
    work >= TF1_SPLIT && rayon::current_num_threads() > 1
}

/// Row groups per task of a repacked matmul: [`rows_per_task`]'s rows when it splits, else all.
fn tf1_per(lut: &Tf1Lut, split: bool) -> usize {
    if split {
        rows_per_task(lut.rows(), rayon::current_num_threads()).div_ceil(Tf1Lut::GROUP)
    } else {
        lut.groups().max(1)
    }
}

/// Pools of up to this many threads build a token's tables on each thread that runs part of a
/// one-token matmul ([`TF1_OWN`]); larger pools build them in parts and share them. Measured
/// on AMD Zen 4 at two threads (session 39): the shared tables cost more in the barrier after
/// building them and in reading the other core's half than building all of them does (2048 ×
/// 5632: 82 against 71 µs). With many threads each thread's share of the rows shrinks while
/// the whole tables stay as costly (about two groups' GEMV), so there they are shared.
const TF1_OWN_TABLES_MAX_THREADS: usize = 2;

/// Table buffers of earlier one-token calls that shared their tables, reused (a wide matrix's
/// take most of a MiB).
static TF1_TABLES: Mutex<Vec<Vec<Tf1Tables>>> = Mutex::new(Vec::new());

/// Where the threads of a one-token repacked matmul find the token's tables.
#[derive(Clone, Copy)]
enum TablesOf<'a> {
    /// Each thread builds them in [`TF1_OWN`] for this token and call number.
    Own(&'a Activations, u64),
    /// Built in parts beforehand, shared.
    Shared(&'a [&'a Tf1Tables]),
}

/// The one-token GEMVs of `mats` (matrices of one width, each with its output) for token `x`,
/// row groups split across the pool when `split`; the token's tables built once for all of
/// them (per thread or in shared parts: [`TF1_OWN_TABLES_MAX_THREADS`]).
fn tf1_one_token(
    x: &Activations,
    split: bool,
    mats: &mut [(&Tf1Lut, &mut [f32])],
) -> Result<(), ComputeError> {
    let Some(&(first, _)) = mats.first() else {
        return Ok(());
    };
    let threads = rayon::current_num_threads();
    if split && threads > TF1_OWN_TABLES_MAX_THREADS {
        let nb = first.blocks();
        let mut parts = TF1_TABLES
            .lock()
            .ok()
            .and_then(|mut p| p.pop())
            .unwrap_or_default();
        parts.resize_with(threads.min(nb).max(1), Tf1Tables::default);
        let per_b = nb.div_ceil(parts.len());
        parts.par_iter_mut().enumerate().try_for_each(|(i, t)| {
            first.tables(x, (i * per_b).min(nb)..((i + 1) * per_b).min(nb), t)
        })?;
        let refs: Vec<&Tf1Tables> = parts.iter().collect();
        let r = mats
            .iter_mut()
            .try_for_each(|(lut, out)| tf1_gemv(lut, TablesOf::Shared(&refs), out, split));
        drop(refs);
        if let Ok(mut p) = TF1_TABLES.lock() {
            p.push(parts);
        }
        return r;
    }
    let own = TablesOf::Own(x, TF1_CALL.fetch_add(1, Ordering::Relaxed));
    mats.iter_mut()
        .try_for_each(|(lut, out)| tf1_gemv(lut, own, out, split))
}

/// The one-token GEMV of `lut` from `tables`, its row groups split across the pool when
/// `split`.
fn tf1_gemv(
    lut: &Tf1Lut,
    tables: TablesOf<'_>,
    out: &mut [f32],
    split: bool,
) -> Result<(), ComputeError> {
    let per = tf1_per(lut, split);
    let run = |(i, o): (usize, &mut [f32])| {
        let groups = i * per..i * per + o.len().div_ceil(Tf1Lut::GROUP);
        match tables {
            TablesOf::Shared(parts) => lut.gemv(parts, groups, o),
            TablesOf::Own(x, call) => TF1_OWN.with(|own| {
                let mut own = own.borrow_mut();
                let (built, t) = &mut *own;
                if *built != call {
                    *built = u64::MAX;
                    lut.tables(x, 0..lut.blocks(), t)?;
                    *built = call;
                }
                lut.gemv(&[t], groups, o)
            }),
        }
    };
    if split {
        out.par_chunks_mut(per * Tf1Lut::GROUP)
            .enumerate()
            .try_for_each(run)?;
    } else {
        run((0, out))?;
    }
    Ok(())
}

/// `a.forward(x, out_a)` and `b.forward(x, out_b)` (an FFN's gate and up matrices): where both
/// run repacked TF1 for one token of the same width, the activation tables are built once for
/// both.
pub fn forward_pair(
    a: &Linear,
    b: &Linear,
    x: &Activations,
    out_a: &mut [f32],
    out_b: &mut [f32],
    numerics: Numerics,
) -> Result<(), ComputeError> {
    if let (Some(la), Some(lb)) = (a.tf1_repacked(), b.tf1_repacked()) {
        let split = tf1_split((la.rows() + lb.rows()).div_ceil(Tf1Lut::GROUP) * la.blocks());
        if x.n() == 1
            && a.cols() == b.cols()
            && out_a.len() == la.rows()
            && out_b.len() == lb.rows()
        {
            return tf1_one_token(x, split, &mut [(la, out_a), (lb, out_b)]);
        }
    }
    a.forward(x, out_a, numerics)?;
    b.forward(x, out_b, numerics)
}

/// Groups × blocks × tokens from which [`tf1_par`] splits a matmul across the pool (about
/// 100 µs of work on one core).
const TF1_SPLIT: usize = 1024;

/// A matmul's output holds `rows` × `n` floats.
fn check_out(rows: usize, n: usize, out: &[f32]) -> Result<(), ComputeError> {
    if out.len() != rows * n {
        return Err(ComputeError::Shape(format!(
            "matmul output has {} floats, need {rows} rows x {n} tokens",
            out.len()
        )));
    }
    Ok(())
}

/// Token-major tiles of rows `r0..` into `out[t * rows + r]`.
fn scatter_tiles(tiles: Vec<(usize, Vec<f32>)>, rows: usize, n: usize, out: &mut [f32]) {
    for (r0, tile) in tiles {
        let len = tile.len() / n;
        for t in 0..n {
            out[t * rows + r0..t * rows + r0 + len].copy_from_slice(&tile[t * len..(t + 1) * len]);
        }
    }
}

/// Rows per parallel task: a multiple of 16 so SIMD kernels that take several rows at once get
/// whole groups, small enough to balance 2–16 threads.
fn rows_per_task(rows: usize, threads: usize) -> usize {
    let tasks = threads.max(1) * 4;
    rows.div_ceil(tasks).next_multiple_of(16).max(16)
}

/// Runs `f` on a thread of the current rayon pool (the global one when called from outside any
/// pool) and returns its result. A pass of many parallel loops run this way wakes the pool
/// once: called from outside, every loop would inject its work and put the caller to sleep
/// until done, two context switches per loop (a fifth of a small model's decode time).
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// Runs `matmul` over all rows of `w`, split across the current rayon pool. For one token the
/// output chunks are written in place; for several, each task writes a token-major tile that is
/// scattered into `out` (the tile costs far less than the GEMM that fills it).
pub fn matmul_par(
    w: &QMatrix<'_>,
    x: &Activations,
    out: &mut [f32],
    numerics: Numerics,
) -> Result<(), ComputeError> {
    let rows = w.rows();
    let n = x.n();
    check_out(rows, n, out)?;
    let chunk = rows_per_task(rows, rayon::current_num_threads());
    if n == 1 {
        out.par_chunks_mut(chunk)
            .enumerate()
            .try_for_each(|(i, o)| {
                let r0 = i * chunk;
                ternfleet_kernels::matmul(w, x, r0..r0 + o.len(), o, numerics)
            })?;
        return Ok(());
    }
    let tiles: Vec<(usize, Vec<f32>)> = (0..rows.div_ceil(chunk))
        .into_par_iter()
        .map(|i| {
            let r = i * chunk..((i + 1) * chunk).min(rows);
            let mut tile = vec![0f32; r.len() * n];
            ternfleet_kernels::matmul(w, x, r.clone(), &mut tile, numerics).map(|_| (r.start, tile))
        })
        .collect::<Result<_, _>>()?;
    scatter_tiles(tiles, rows, n, out);
    Ok(())
}

/// [`Activations::quantize_for`] with several tokens' rows quantized in parallel on the rayon
/// pool (one token: in place, no fork). Same bytes either way.
pub fn quantize_par(
    act: &mut Activations,
    weight_ty: GgmlType,
    x: &[f32],
    n: usize,
    cols: usize,
) -> Result<(), KernelError> {
    if n < 8 {
        return act.quantize_for(weight_ty, x, n, cols);
    }
    act.quantize_for_with(weight_ty, x, n, cols, |x, y, cols, rb, quantize| {
        let per = n.div_ceil(rayon::current_num_threads() * 2).max(1);
        x.par_chunks(per * cols)
            .zip(y.par_chunks_mut(per * rb))
            .for_each(|(xs, ys)| quantize(xs, ys));
    })
}

/// Quantizes `n` rows of `x` to the activation type `act_ty` itself (what an expert backend
/// declares it reads), in parallel as [`quantize_par`].
pub fn quantize_as(
    act: &mut Activations,
    act_ty: GgmlType,
    x: &[f32],
    n: usize,
    cols: usize,
) -> Result<(), KernelError> {
    // A weight type whose dot type `act_ty` is (kernels pick activations by weight type).
    let weight_ty = match act_ty {
        GgmlType::Q8_K => GgmlType::Q4_K,
        GgmlType::Q8_1 => GgmlType::Q4_1,
        GgmlType::Q8_TF => GgmlType::TF2,
        t => t,
    };
    if ternfleet_kernels::vec_dot_type(weight_ty) != Some(act_ty) {
        return Err(KernelError::Unsupported {
            ty: act_ty,
            op: "activation quantization",
        });
    }
    quantize_par(act, weight_ty, x, n, cols)
}
