//! Honest skips for tests whose reference is not on this machine (a model not fetched,
//! python's gguf package missing): a skip is never a pass.
//!
//! [`skip`] prints the reason and appends it to the file named by `TERNFLEET_SKIP_LOG`, which
//! `scripts/test.sh` counts as skipped tests in its summary line; with
//! `TERNFLEET_REQUIRE_REFS=1` (set by `scripts/test.sh`, which installs every reference) the
//! skip fails the test instead.

use std::io::Write;

/// Records that the calling test could not run `what` because of `why`. Panics (fails the
/// test) when `TERNFLEET_REQUIRE_REFS=1`.
pub fn skip(what: &str, why: &str) {
    let line = format!("skipped: {what}: {why}");
    if std::env::var("TERNFLEET_REQUIRE_REFS").is_ok_and(|v| v == "1") {
        panic!("{line} (TERNFLEET_REQUIRE_REFS=1: every reference must be present)");
    }
    println!("{line}");
    if let Some(path) = std::env::var_os("TERNFLEET_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
}
