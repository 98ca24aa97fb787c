//! `compute::populate` brings every page of a mapped file into memory: a node that says ready
//! must not serve its first calls from disk.
use std::io::Write;
use std::os::fd::AsRawFd;

/// For each page of `m`, whether the kernel holds it in memory (`mincore`).
fn resident(m: &memmap2::Mmap) -> Vec<bool> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut v = vec![0u8; m.len().div_ceil(page)];
    // SAFETY: `m` is a live mapping of `m.len()` bytes starting at a page boundary; `v` has a
    // byte per page.
    let r = unsafe { libc::mincore(m.as_ptr() as *mut libc::c_void, m.len(), v.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    v.iter().map(|&b| b & 1 == 1).collect()
}

/// A file of `bytes` bytes on the target directory's disk (a tmpfs /tmp keeps every page in
/// memory whatever we ask), its pages dropped from the page cache, mapped. `None` where the
/// filesystem keeps them anyway (the test cannot tell populate working from not).
fn cold(dir: &std::path::Path, bytes: usize) -> Option<(memmap2::Mmap, Vec<u8>)> {
    let path = dir.join("blob");
    let mut f = std::fs::File::create(&path).unwrap();
    let data: Vec<u8> = (0..bytes).map(|i| (i * 7 + 3) as u8).collect();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let f = std::fs::File::open(&path).unwrap();
    // SAFETY: advice on an open descriptor; it changes no bytes.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    // SAFETY: a private read-only mapping of a file this test owns and does not change.
    let m = unsafe { memmap2::MmapOptions::new().map(&f) }.unwrap();
    // No readahead around a fault: only the pages read come in.
    // SAFETY: advice on this live mapping; it changes no bytes.
    unsafe { libc::madvise(m.as_ptr() as *mut libc::c_void, m.len(), libc::MADV_RANDOM) };
    if resident(&m).iter().all(|&r| r) {
        ternfleet_shared::testing::skip(
            "populate",
            "this filesystem keeps a synced file's pages cached after POSIX_FADV_DONTNEED",
        );
        return None;
    }
    Some((m, data))
}

#[test]
fn populate_reads_a_cold_mapping_into_memory() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let Some((m, data)) = cold(dir.path(), 8 << 20) else {
        return;
    };
    ternfleet_shared::compute::populate(&m[..]).unwrap();
    let r = resident(&m);
    let after = r.iter().filter(|&&x| x).count();
    assert_eq!(
        after,
        r.len(),
        "{after} of {} pages resident after populate",
        r.len()
    );
    assert_eq!(&m[..], &data[..], "populate changed no byte");
}

/// A tensor's bytes start anywhere in a page (32-byte aligned in GGUF): every page the slice
/// touches must come in, by the advice and by the fallback that reads a byte per page.
#[test]
fn an_unaligned_slice_brings_every_page_it_spans() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    for (name, f) in [
        (
            "populate",
            (|b: &[u8]| ternfleet_shared::compute::populate(b).unwrap()) as fn(&[u8]),
        ),
        (
            "touch_pages",
            ternfleet_shared::compute::touch_pages as fn(&[u8]),
        ),
    ] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let Some((m, _)) = cold(dir.path(), 6 * page) else {
            return;
        };
        // From 32 bytes before the end of page 1 to 32 bytes into page 4: pages 1 to 4.
        let (a, b) = (2 * page - 32, 4 * page + 32);
        f(&m[a..b]);
        let r = resident(&m);
        for (p, &on) in r.iter().enumerate().take(5).skip(1) {
            assert!(
                on,
                "{name}: page {p} of the slice's pages 1..=4 not resident"
            );
        }
    }
}
