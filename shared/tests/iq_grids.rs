//! The IQ lookup tables ternfleet carries as data (`ternfleet_kernels::iq_grids`, written by
//! `scripts/make-iq-grids.py`) equal the ones in llama.cpp's source, `ggml/src/ggml-common.h`
//! of the reference build (`scripts/build-llama-cpp.sh --source-only` unpacks it; test.sh does).
//! This parser is independent of the script's: it reads each `GGML_TABLE_BEGIN(type, name, n)`
//! block's numbers in order.

use std::path::PathBuf;

fn ggml_common_h() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/llama.cpp/src/vendor/llama.cpp/ggml/src/ggml-common.h")
}

/// The numbers of table `name` in `text`, comments skipped.
fn table(text: &str, name: &str) -> Option<Vec<u64>> {
    let start = text.find(&format!(", {name}, "))?;
    let body = &text[start..];
    let body = &body[body.find(')')? + 1..body.find("GGML_TABLE_END")?];
    let mut out = Vec::new();
    for line in body.lines() {
        let line = line.split("//").next().unwrap_or("");
        for tok in line.split(|c: char| c == ',' || c.is_whitespace()) {
            if tok.is_empty() {
                continue;
            }
            let v = match tok.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => tok.parse(),
            };
            out.push(v.unwrap_or_else(|e| panic!("{name}: bad number {tok:?}: {e}")));
        }
    }
    Some(out)
}

#[test]
fn iq_tables_equal_llama_cpp_source() {
    let path = ggml_common_h();
    let Ok(text) = std::fs::read_to_string(&path) else {
        ternfleet_shared::testing::skip(
            "IQ tables against ggml-common.h",
            &format!(
                "{} missing: run scripts/build-llama-cpp.sh --source-only",
                path.display()
            ),
        );
        return;
    };
    let tables = ternfleet_kernels::iq_grids::all();
    for (name, ours) in &tables {
        let theirs =
            table(&text, name).unwrap_or_else(|| panic!("{name} not in {}", path.display()));
        assert_eq!(ours.len(), theirs.len(), "{name}: length");
        if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!("{name}[{i}]: ours {:#x}, ggml's {:#x}", ours[i], theirs[i]);
        }
    }
    assert_eq!(tables.len(), 7);
}
