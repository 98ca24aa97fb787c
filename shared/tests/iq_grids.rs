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

/// The value of `#define NAME value` in `text`, for a table size given by a macro.
fn define(text: &str, name: &str) -> Option<usize> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("#define") && w.next() == Some(name)).then(|| w.next()?.parse().ok())?
    })
}

/// (C element type, declared size, numbers) of table `name` in `text`, `//` comments skipped.
/// Panics on anything it could misread: a block comment or a preprocessor line inside the table.
fn table(text: &str, name: &str) -> Option<(String, usize, Vec<i128>)> {
    let begin = text.find(&format!(", {name}, "))?;
    let head_start = text[..begin].rfind("GGML_TABLE_BEGIN(")? + "GGML_TABLE_BEGIN(".len();
    let close = begin + text[begin..].find(')')?;
    let head: Vec<&str> = text[head_start..close].split(',').map(str::trim).collect();
    let (ty, size) = (head[0].to_string(), head[2]);
    let size = size.parse().ok().or_else(|| define(text, size))?;
    let body = &text[close + 1..close + text[close..].find("GGML_TABLE_END")?];
    assert!(
        !body.contains("/*") && !body.contains('#'),
        "{name}: block comment or preprocessor line inside the table"
    );
    let mut out = Vec::new();
    for line in body.lines() {
        let line = line.split("//").next().unwrap_or("");
        for tok in line.split(|c: char| c == ',' || c.is_whitespace()) {
            if tok.is_empty() {
                continue;
            }
            let (neg, digits) = match tok.strip_prefix('-') {
                Some(d) => (true, d),
                None => (false, tok),
            };
            let v = match digits.strip_prefix("0x") {
                Some(hex) => i128::from_str_radix(hex, 16),
                None => digits.parse(),
            }
            .unwrap_or_else(|e| panic!("{name}: bad number {tok:?}: {e}"));
            out.push(if neg { -v } else { v });
        }
    }
    Some((ty, size, out))
}

/// The range of a C element type.
fn range(ty: &str) -> std::ops::RangeInclusive<i128> {
    match ty {
        "int8_t" => -128..=127,
        "uint8_t" => 0..=0xFF,
        "uint32_t" => 0..=0xFFFF_FFFF,
        "uint64_t" => 0..=0xFFFF_FFFF_FFFF_FFFF,
        other => panic!("unexpected element type {other}"),
    }
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
        let (ty, size, theirs) =
            table(&text, name).unwrap_or_else(|| panic!("{name} not in {}", path.display()));
        assert_eq!(
            theirs.len(),
            size,
            "{name}: ggml's table has {size} entries declared"
        );
        assert_eq!(ours.len(), size, "{name}: length");
        let r = range(&ty);
        assert!(
            theirs.iter().all(|v| r.contains(v)),
            "{name}: a value outside {ty}"
        );
        if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
            panic!("{name}[{i}]: ours {}, ggml's {}", ours[i], theirs[i]);
        }
    }
    let names: Vec<&str> = tables.iter().map(|(n, _)| *n).collect();
    for want in [
        "kvalues_iq4nl",
        "ksigns_iq2xs",
        "iq2xxs_grid",
        "iq3xxs_grid",
        "iq1s_grid",
    ] {
        assert!(names.contains(&want), "{want} is not checked");
    }
}
