//! Every hostile file of TESTING.md "GGUF and bundles: hostile files" (items 1–10) is rejected
//! with its specific error variant, without a panic.

mod common;

use ternfleet_shared::gguf::GgufFile;

#[test]
fn hostile_files_are_rejected_with_their_error_variant() {
    let cases = common::hostile_cases();
    let total = cases.len();
    let mut failed = Vec::new();
    for case in cases {
        match GgufFile::from_bytes(case.bytes) {
            Ok(_) => failed.push(format!("{}: accepted", case.name)),
            Err(e) if (case.expect)(&e) => println!("ok   {:<55} {e}", case.name),
            Err(e) => failed.push(format!("{}: wrong error {e:?}", case.name)),
        }
    }
    println!(
        "hostile GGUF cases rejected as expected: {}/{total}",
        total - failed.len()
    );
    assert!(failed.is_empty(), "failed cases:\n{}", failed.join("\n"));
    assert!(total >= 20);
}

#[test]
fn the_valid_base_file_reads() {
    let f = GgufFile::from_bytes(common::valid_small()).expect("valid_small is valid");
    assert_eq!(f.tensors().len(), 2);
    let b = f.tensor("b").expect("tensor b");
    assert_eq!((b.cols(), b.rows(), b.size), (8, 2, 64));
    assert_eq!(f.tensor_data(b), &[2; 64][..]);
    assert_eq!(f.tensor_data(f.tensor("a").unwrap()), &[1; 16][..]);
}

/// Writes the hostile files, the valid base and the gguf-py fixtures as the seed corpus of the
/// cargo-fuzz target (`shared/fuzz/corpus/gguf_reader/`). Run after changing the cases:
/// `cargo test -p ternfleet-shared --test gguf_hostile -- --ignored write_fuzz_seed_corpus`.
#[test]
#[ignore = "writes files into shared/fuzz; run by hand"]
fn write_fuzz_seed_corpus() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("fuzz/corpus/gguf_reader");
    std::fs::create_dir_all(&dir).unwrap();
    let slug = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect()
    };
    let mut n = 0;
    for (i, case) in common::hostile_cases().into_iter().enumerate() {
        std::fs::write(
            dir.join(format!("hostile-{i:02}-{}", slug(case.name))),
            case.bytes,
        )
        .unwrap();
        n += 1;
    }
    std::fs::write(dir.join("valid-small"), common::valid_small()).unwrap();
    for name in ["gguf-py-small", "gguf-py-align"] {
        let bytes = std::fs::read(root.join(format!("tests/data/{name}.gguf"))).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    println!("wrote {} seeds to {}", n + 3, dir.display());
}
