//! Allocation cap: parsing a hostile file never allocates more than a small multiple of the
//! file's own size, whatever counts and lengths it declares (TESTING.md: "no allocation above a
//! fixed cap"). A counting global allocator measures the peak of live heap bytes during each
//! `from_bytes` call; this binary has a single test so nothing else allocates meanwhile.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::Relaxed};

use ternfleet_shared::gguf::GgufFile;

struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn record(delta: isize) {
    if ARMED.load(Relaxed) {
        let live = LIVE.fetch_add(delta, Relaxed) + delta;
        PEAK.fetch_max(live, Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's layout unchanged and only
// updates counters, so `System`'s guarantees carry over.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        record(layout.size() as isize);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` shares.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        record(-(layout.size() as isize));
        // SAFETY: `ptr` was allocated by `System` with `layout` (see `alloc`).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        record(new_size as isize - layout.size() as isize);
        // SAFETY: as for `dealloc`; `new_size` is the caller's, per `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Peak live heap bytes while parsing `bytes` (the input itself is allocated before).
fn peak_while_parsing(bytes: Vec<u8>) -> (usize, bool) {
    LIVE.store(0, Relaxed);
    PEAK.store(0, Relaxed);
    ARMED.store(true, Relaxed);
    let ok = GgufFile::from_bytes(bytes).is_ok();
    ARMED.store(false, Relaxed);
    (PEAK.load(Relaxed).max(0) as usize, ok)
}

/// Allowed: 4 bytes of heap per file byte (a string array's `Vec<String>` takes 24 bytes per
/// 8-byte length prefix, the most of any structure) plus 64 KiB of fixed overhead.
fn cap(file_len: usize) -> usize {
    4 * file_len + (64 << 10)
}

#[test]
fn hostile_counts_and_lengths_never_drive_allocation() {
    let mut cases: Vec<(String, Vec<u8>)> = common::hostile_cases()
        .into_iter()
        .map(|c| (c.name.to_owned(), c.bytes))
        .collect();
    // Counts at the caps, backed by just enough bytes to pass the "bytes left" check.
    let max_kvs = common::Raw::header(3, 0, 65_536).zeros(65_536 * 14).done();
    let max_tensors = common::Raw::header(3, 65_536, 0).zeros(65_536 * 33).done();
    let strings = common::Raw::header(3, 0, 1)
        .str("k")
        .u32(common::ty::ARRAY)
        .u32(common::ty::STRING)
        .u64(100_000)
        .zeros(100_000 * 8 - 1)
        .done();
    let max_array = common::Raw::header(3, 0, 1)
        .str("k")
        .u32(common::ty::ARRAY)
        .u32(common::ty::U64)
        .u64(4 << 20)
        .zeros(64)
        .done();
    // The worst legal ratio: 100,000 empty strings (8 bytes each in the file, 24 as `String`),
    // then a second pair cut off.
    let empty_strings = common::Raw::header(3, 0, 2)
        .str("k")
        .u32(common::ty::ARRAY)
        .u32(common::ty::STRING)
        .u64(100_000)
        .zeros(100_000 * 8)
        .zeros(13)
        .done();
    cases.push(("100000 empty strings then EOF".into(), empty_strings));
    cases.push(("65536 KVs of zeros".into(), max_kvs));
    cases.push(("65536 tensor infos of zeros".into(), max_tensors));
    cases.push(("100000-string array, one byte short".into(), strings));
    cases.push(("4 Mi-element u64 array in 64 bytes".into(), max_array));

    let total = cases.len();
    let mut worst = (0.0f64, String::new());
    let mut failed = Vec::new();
    for (name, bytes) in cases {
        let len = bytes.len();
        let (peak, ok) = peak_while_parsing(bytes);
        assert!(!ok, "{name}: accepted");
        let ratio = peak as f64 / cap(len) as f64;
        if ratio > worst.0 {
            worst = (ratio, format!("{name}: {peak} bytes for a {len}-byte file"));
        }
        if peak > cap(len) {
            failed.push(format!("{name}: peak {peak} bytes > cap {}", cap(len)));
        }
    }
    println!(
        "allocation within cap: {}/{total} cases; closest to the cap: {} ({:.0}% of cap)",
        total - failed.len(),
        worst.1,
        worst.0 * 100.0
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
