//! `compute::populate` brings every page of a mapped file into memory: a node that says ready
//! must not serve its first calls from disk.
use std::io::Write;
use std::os::fd::AsRawFd;

/// Pages of `m` the kernel holds in memory (`mincore`).
fn resident(m: &memmap2::Mmap) -> (usize, usize) {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let pages = m.len().div_ceil(page);
    let mut v = vec![0u8; pages];
    // SAFETY: `m` is a live mapping of `m.len()` bytes starting at a page boundary; `v` has a
    // byte per page.
    let r = unsafe { libc::mincore(m.as_ptr() as *mut libc::c_void, m.len(), v.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    (v.iter().filter(|&&b| b & 1 == 1).count(), pages)
}

#[test]
fn populate_reads_a_cold_mapping_into_memory() {
    // On the target directory's disk (a tmpfs /tmp keeps every page in memory whatever we ask).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("blob");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 3) as u8).collect();
    for _ in 0..8 {
        f.write_all(&chunk).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    let f = std::fs::File::open(&path).unwrap();
    // Clean pages dropped from the page cache: the mapping starts cold.
    // SAFETY: advice on an open descriptor; it changes no bytes.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    // SAFETY: a private read-only mapping of a file this test owns and does not change.
    let m = unsafe { memmap2::MmapOptions::new().map(&f) }.unwrap();
    let (before, pages) = resident(&m);
    assert!(
        before < pages,
        "the file's pages stayed cached ({before} of {pages}): this filesystem cannot show populate working"
    );
    ternfleet_shared::compute::populate(&m[..]);
    let (after, _) = resident(&m);
    assert_eq!(
        after, pages,
        "{after} of {pages} pages resident after populate"
    );
    assert_eq!(&m[..chunk.len()], &chunk[..], "populate changed no byte");
}
