//! Reads the real Gemma 3 270M Q4_K_M model (models/, not committed) and checks its directory
//! against what gguf-py's GGUFReader reports for the same file.

use std::path::PathBuf;

use ternfleet_shared::gguf::{ArrayValue, GgmlType, GgufFile};

#[test]
fn gemma3_270m_q4_k_m_parses_completely() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        ternfleet_shared::testing::skip(
            "Gemma GGUF parse",
            &format!("model not present ({})", path.display()),
        );
        return;
    }
    let start = std::time::Instant::now();
    let f = GgufFile::open(&path).expect("the model parses");
    let elapsed = start.elapsed();
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 236);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.get_str("general.architecture").unwrap(), Some("gemma3"));
    assert_eq!(f.get_u32("gemma3.block_count").unwrap(), Some(18));
    assert_eq!(f.get_u64("gemma3.context_length").unwrap(), Some(32768));
    match f.get_array("tokenizer.ggml.tokens").unwrap() {
        Some(ArrayValue::String(tokens)) => assert_eq!(tokens.len(), 262_144),
        other => panic!("tokenizer.ggml.tokens: {other:?}"),
    }
    assert_eq!(
        f.get_array("tokenizer.ggml.scores")
            .unwrap()
            .map(ArrayValue::len),
        Some(262_144)
    );
    let emb = f.tensor("token_embd.weight").expect("token_embd.weight");
    assert_eq!(emb.dims, vec![640, 262_144]);
    assert_eq!(emb.ty, GgmlType::Q8_0);
    assert_eq!(emb.size, 262_144 * 20 * 34);
    assert_eq!(f.tensor_data(emb).len() as u64, emb.size);
    let total: u64 = f.tensors().iter().map(|t| t.size).sum();
    let last_end = f.tensors().iter().map(|t| t.offset + t.size).max().unwrap();
    assert!(last_end <= f.data().len() as u64);
    // Peak RSS of this test process (the map is demand-paged; parsing touches only the
    // metadata and tensor directory, a few MB).
    let peak_rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "VmHWM: unknown".into());
    println!(
        "gemma-3-270m: {} tensors, {} KVs, {} tensor bytes, parsed in {:.1} ms; peak RSS {}",
        f.tensors().len(),
        f.metadata().len(),
        total,
        elapsed.as_secs_f64() * 1e3,
        peak_rss.trim_start_matches("VmHWM:").trim()
    );
}
