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

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate lives in the workspace")
        .to_path_buf()
}

/// Runs the binary, asserting exit code `code` and no panic; returns stdout.
fn run(args: &[&str], code: i32) -> String {
    let out = bin().args(args).output().expect("binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_subcommand_runs_on_a_tiny_model() {
    let m = tiny();
    let gpl = root().join("tests/data/text/gpl-3.txt");
    let gpl = gpl.to_str().unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&run(&["tokenize", "-m", &m, "-p", "hello", "--json"], 0)).unwrap();
    assert!(v["ids"].as_array().is_some_and(|a| !a.is_empty()));
    let text = run(&["info", "-m", &m], 0);
    assert!(text.contains("arch") && text.contains("weights"), "{text}");
    let v: serde_json::Value =
        serde_json::from_str(&run(&["info", "-m", &m, "--json"], 0)).unwrap();
    let file_bytes = std::fs::metadata(&m).unwrap().len();
    assert_eq!(v["file_bytes"].as_u64(), Some(file_bytes));
    let weights = v["weights"].as_array().expect("weights");
    let tensor_bytes: u64 = weights.iter().filter_map(|w| w["bytes"].as_u64()).sum();
    assert!(tensor_bytes > 0 && tensor_bytes <= file_bytes, "{v}");
    assert!(v["n_embd"].as_u64().is_some_and(|n| n > 0) && v["layers"].as_u64() > Some(0));
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "perplexity",
            "-m",
            &m,
            "-f",
            gpl,
            "-c",
            "64",
            "--chunks",
            "2",
            "--json",
            "-t",
            "2",
        ],
        0,
    ))
    .unwrap();
    assert!(v["ppl"].as_f64().is_some_and(|p| p.is_finite() && p > 1.0));
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "bench",
            "-m",
            &m,
            "--prompt",
            "16",
            "--gen",
            "4",
            "--reps",
            "2",
            "--parallel",
            "3",
            "--json",
            "-t",
            "2",
        ],
        0,
    ))
    .unwrap();
    for k in ["pp_tps", "tg_tps", "agg_tg_tps"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {v}");
    }
    // Each timed run's rate; the mean is tokens over total time, their harmonic mean.
    for (k, mean) in [("pp_tps_runs", "pp_tps"), ("tg_tps_runs", "tg_tps")] {
        let runs: Vec<f64> = v[k]
            .as_array()
            .unwrap_or_else(|| panic!("{k}: {v}"))
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(runs.len(), 2, "{k}: {v}");
        let m = v[mean].as_f64().unwrap();
        let harmonic = 2.0 / runs.iter().map(|r| 1.0 / r).sum::<f64>();
        assert!(
            (harmonic - m).abs() <= 1e-9 * m,
            "{k} {runs:?} against {mean} {m}"
        );
    }
    let moe = root().join("tests/data/models/tiny-qwen3moe-q8_0.gguf");
    let moe = moe.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("b");
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "convert",
            "-m",
            moe,
            "-o",
            out.to_str().unwrap(),
            "--json",
            "-t",
            "2",
        ],
        0,
    ))
    .unwrap();
    assert_eq!(v["moe"]["n_expert"].as_u64(), Some(16));
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "compare",
            "-m",
            out.to_str().unwrap(),
            "--ref",
            moe,
            "-f",
            gpl,
            "-c",
            "64",
            "--chunks",
            "2",
            "--json",
            "-t",
            "2",
        ],
        0,
    ))
    .unwrap();
    // A bundle of a native MoE model is the same model: full agreement.
    assert_eq!(v["top1_agreement"].as_f64(), Some(1.0), "{v}");
    // Routing spread, predictor recall and store replay of an MoE model.
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "routing", "-m", moe, "-f", gpl, "--tokens", "128", "-c", "64", "--json", "-t", "2",
        ],
        0,
    ))
    .unwrap();
    assert_eq!(v["tokens"].as_u64(), Some(128), "{v}");
    assert_eq!(v["n_expert"].as_u64(), Some(16), "{v}");
    let distinct = v["distinct_min"].as_u64().unwrap();
    assert!((1..=16).contains(&distinct), "{v}");
    assert!(
        v["entropy_mean_bits"].as_f64().unwrap() <= 4.0 + 1e-9,
        "{v}"
    );
    // Two layers: one layer of lookahead is measurable, more is not.
    let recall = v["recall"].as_array().unwrap();
    assert!(
        recall[0].as_f64().is_some_and(|r| (0.0..=1.0).contains(&r)),
        "{v}"
    );
    assert!(recall[1].is_null(), "{v}");
    assert_eq!(v["store"].as_array().map(|a| a.len()), Some(8), "{v}");
    assert!(v["recall_learned"].is_null(), "{v}");
    // The learned predictor: fitted into the bundle, then measured beside the router one.
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "fit-predictor",
            "-m",
            out.to_str().unwrap(),
            "--calib",
            gpl,
            "--tokens",
            "1024",
            "-c",
            "64",
            "--holdout",
            "0.25",
            "--json",
            "-t",
            "2",
        ],
        0,
    ))
    .unwrap();
    assert_eq!(v["holdout_tokens"].as_u64(), Some(256), "{v}");
    assert!(out.join("predictor.gguf").exists());
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "routing",
            "-m",
            out.to_str().unwrap(),
            "--prefetch",
            "learned",
            "-f",
            gpl,
            "--tokens",
            "128",
            "-c",
            "64",
            "--json",
            "-t",
            "2",
        ],
        0,
    ))
    .unwrap();
    let learned = v["recall_learned"].as_array().expect("learned recall");
    assert!(
        learned[0]
            .as_f64()
            .is_some_and(|r| (0.0..=1.0).contains(&r)),
        "{v}"
    );
    assert_eq!(v["store"].as_array().map(|a| a.len()), Some(12), "{v}");
    // Without a predictor file, --prefetch learned says how to make one.
    let err = String::from_utf8_lossy(
        &bin()
            .args(["routing", "-m", moe, "--prefetch", "learned"])
            .output()
            .expect("binary runs")
            .stderr,
    )
    .into_owned();
    assert!(err.contains("ternfleet fit-predictor"), "{err}");
    // The expert store: counters in bench --json; a dense model is refused with a reason.
    let v: serde_json::Value = serde_json::from_str(&run(
        &[
            "bench",
            "-m",
            moe,
            "--prompt",
            "16",
            "--gen",
            "4",
            "--reps",
            "1",
            "--ram-budget",
            "200KiB",
            "--prefetch",
            "router",
            "--json",
            "-t",
            "2",
        ],
        0,
    ))
    .unwrap();
    assert!(v["store"]["misses"].as_u64().is_some_and(|m| m > 0), "{v}");
    assert!(
        v["store"]["bytes_read"].as_u64().is_some_and(|b| b > 0),
        "{v}"
    );
    let err = bin()
        .args(["bench", "-m", &m, "--ram-budget", "1GiB", "--gen", "2"])
        .output()
        .unwrap();
    assert_eq!(err.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&err.stderr).contains("no routed experts"));
}

#[test]
fn a_prompt_that_starts_with_a_hyphen_is_text() {
    for p in ["- item one", "--help me"] {
        let v: serde_json::Value = serde_json::from_str(&run(
            &[
                "generate",
                "-m",
                &tiny(),
                "-p",
                p,
                "-n",
                "2",
                "--temp",
                "0",
                "--json",
            ],
            0,
        ))
        .unwrap();
        assert!(
            v["prompt_tokens"].as_array().is_some_and(|a| a.len() > 1),
            "{p:?}: {v}"
        );
        let v: serde_json::Value =
            serde_json::from_str(&run(&["tokenize", "-m", &tiny(), "-p", p, "--json"], 0)).unwrap();
        assert!(v["ids"].as_array().is_some_and(|a| a.len() > 1), "{p:?}");
    }
}

#[test]
fn huge_sizes_are_errors_not_panics() {
    let m = tiny();
    let huge = u64::MAX.to_string();
    let err = |args: &[&str]| {
        let out = bin().args(args).output().unwrap();
        let e = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{args:?}: {e}");
        e
    };
    assert!(err(&["generate", "-m", &m, "-p", "hi", "-n", &huge]).contains("-n"));
    assert!(err(&["generate", "-m", &m, "-p", "hi", "-n", "4", "--ctx", &huge]).contains("--ctx"));
    assert!(err(&["bench", "-m", &m, "--prompt", &huge, "--gen", "4"]).contains("--prompt"));
    assert!(err(&["bench", "-m", &m, "--prompt", "8", "--gen", &huge]).contains("--gen"));
}

#[test]
fn generate_prompts_file_runs_every_line_in_order_like_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.txt");
    std::fs::write(
        &file,
        "This License\nThe capital\\nof France\n- a list item\nback\\\\slash\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let lines: Vec<serde_json::Value> = run(
        &[
            "generate",
            "-m",
            &tiny(),
            "--prompts",
            f,
            "--parallel",
            "3",
            "-n",
            "6",
            "--temp",
            "0",
            "--json",
            "--numerics",
            "invariant",
        ],
        0,
    )
    .lines()
    .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
    .collect();
    assert_eq!(lines.len(), 4);
    for (i, (v, p)) in lines
        .iter()
        .zip([
            "This License",
            "The capital\nof France",
            "- a list item",
            "back\\slash",
        ])
        .enumerate()
    {
        assert_eq!(v["index"].as_u64(), Some(i as u64));
        // The same prompt alone, one at a time.
        let alone = run(
            &[
                "generate",
                "-m",
                &tiny(),
                "--prompts",
                f,
                "--parallel",
                "1",
                "-n",
                "6",
                "--temp",
                "0",
                "--json",
                "--numerics",
                "invariant",
            ],
            0,
        );
        let a: serde_json::Value = serde_json::from_str(alone.lines().nth(i).unwrap()).unwrap();
        assert_eq!(v["tokens"], a["tokens"], "{p:?}");
        let toks = run(&["tokenize", "-m", &tiny(), "-p", p, "--json"], 0);
        let t: serde_json::Value = serde_json::from_str(&toks).unwrap();
        assert_eq!(
            v["prompt_tokens"].as_u64(),
            t["ids"].as_array().map(|a| a.len() as u64),
            "{p:?}: the line was unescaped"
        );
    }
}

/// A one-shot HTTP server on loopback answering every request with `status`; its address.
fn answer_with(status: &'static str) -> String {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept() {
            // The whole request (up to its blank line), then the answer.
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let _ = write!(s, "HTTP/1.1 {status}\r\ncontent-length: 9\r\n\r\nnot ready");
        }
    });
    addr
}

#[test]
fn probe_exits_0_on_200_and_1_with_the_answer_otherwise() {
    let ok = bin()
        .args(["probe", &format!("http://{}/ready", answer_with("200 OK"))])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let busy = bin()
        .args([
            "probe",
            &format!("http://{}/ready", answer_with("503 Service Unavailable")),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&busy.stderr);
    assert_eq!(busy.status.code(), Some(1), "{err}");
    assert!(err.contains("503") && err.contains("not ready"), "{err}");
    // Nothing listening; not http.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let gone = bin()
        .args([
            "probe",
            "--timeout",
            "2",
            &format!("http://127.0.0.1:{port}/"),
        ])
        .output()
        .unwrap();
    assert_eq!(gone.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&gone.stderr).contains("cannot connect"));
    let https = bin().args(["probe", "https://x:1/"]).output().unwrap();
    assert!(String::from_utf8_lossy(&https.stderr).contains("only http://"));
}

#[test]
fn certs_init_issues_and_with_keep_keeps_what_is_there() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("certs");
    let dir = dir.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "certs", "init", "--dir", dir, "--issue", "n1", "--issue", "operator",
        ];
        a.extend_from_slice(extra);
        bin().args(&a).output().unwrap()
    };
    let first = run(&[]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let ca = std::fs::read(d.path().join("certs/ca.pem")).unwrap();
    let n1 = std::fs::read(d.path().join("certs/n1.pem")).unwrap();
    assert!(d.path().join("certs/operator.key").exists());
    // Again without --keep: an existing CA is an error, nothing replaced.
    let again = run(&[]);
    assert!(!again.status.success());
    // With --keep: kept, and a new id issued beside them.
    let kept = run(&["--keep", "--issue", "n2"]);
    assert!(
        kept.status.success(),
        "{}",
        String::from_utf8_lossy(&kept.stderr)
    );
    assert!(String::from_utf8_lossy(&kept.stdout).contains("(kept)"));
    assert_eq!(std::fs::read(d.path().join("certs/ca.pem")).unwrap(), ca);
    assert_eq!(std::fs::read(d.path().join("certs/n1.pem")).unwrap(), n1);
    assert!(d.path().join("certs/n2.pem").exists());
}

/// `--log-format json` (a global flag): every line on stderr is one JSON object with a
/// timestamp, level and message; the default is text. A bad `--otlp-endpoint` is a clear
/// error at start, not a panic.
#[test]
fn logs_are_json_lines_on_request() {
    let m = tiny();
    let out = Command::new(env!("CARGO_BIN_EXE_ternfleet"))
        .env("RUST_LOG", "info")
        .args([
            "generate",
            "-m",
            &m,
            "-p",
            "hello",
            "-n",
            "2",
            "--log-format",
            "json",
        ])
        .output()
        .expect("binary runs");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "no log lines");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(
            v["timestamp"].is_string() && v["level"].is_string() && v["fields"].is_object(),
            "{l}"
        );
    }
    assert!(
        lines.iter().any(|l| l.contains("kernels")),
        "the kernels line: {err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ternfleet"))
        .env("RUST_LOG", "info")
        .args(["generate", "-m", &m, "-p", "hello", "-n", "1"])
        .output()
        .expect("binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines()
            .any(|l| l.contains("INFO") && !l.starts_with('{')),
        "text by default: {err}"
    );
    let out = bin()
        .args(["generate", "-m", &m, "-p", "hello", "-n", "1"])
        .args(["--otlp-endpoint", "not a url"])
        .output()
        .expect("binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--otlp-endpoint not a url") && !err.contains("panicked"),
        "{err}"
    );
}
