//! The `ternfleet` binary end to end: JSON output shapes, and clear errors (exit code 1, never a
//! panic's 101) for missing or malformed models.

use std::path::Path;
use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ternfleet"));
    c.env("RUST_LOG", "warn");
    c
}

fn tiny() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/models/tiny-qwen3-f16.gguf")
        .display()
        .to_string()
}

#[test]
fn generate_json_has_prompt_tokens_tokens_and_continuation_text() {
    let out = bin()
        .args([
            "generate",
            "-m",
            &tiny(),
            "-p",
            "This License",
            "-n",
            "8",
            "--temp",
            "0",
            "--json",
            "-t",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    let toks = v["tokens"].as_array().expect("tokens");
    assert!(!toks.is_empty() && toks.len() <= 8);
    assert!(!v["prompt_tokens"]
        .as_array()
        .expect("prompt_tokens")
        .is_empty());
    assert!(v["text"].is_string());
}

#[test]
fn tokenize_json_prints_ids() {
    let out = bin()
        .args(["tokenize", "-m", &tiny(), "-p", "This License", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!v["ids"].as_array().unwrap().is_empty());
}

#[test]
fn malformed_and_missing_models_fail_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], &str); 3] = [
        (
            "garbage.gguf",
            b"this is not a model at all",
            "not a GGUF file",
        ),
        ("truncated.gguf", b"GGUF\x03\x00\x00\x00", "truncated"),
        (
            "v1.gguf",
            b"GGUF\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
            "version",
        ),
    ];
    for (name, bytes, want) in cases {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let out = bin()
            .args(["generate", "-m", p.to_str().unwrap(), "-p", "hi"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains(want), "{name}: stderr {err:?} lacks {want:?}");
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
    let out = bin()
        .args(["generate", "-m", "/definitely/not/here.gguf", "-p", "hi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
}

#[test]
fn invalid_sampling_parameters_are_rejected_before_generating() {
    let out = bin()
        .args(["generate", "-m", &tiny(), "-p", "hi", "--temp", "NaN"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("temperature"));
}
