//! Helpers shared by the multi-process and engine tests (each test binary uses some).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use ternfleet_coordinator::kv_cache::SeqOptions;
use ternfleet_coordinator::model::{ForwardError, Logits, Model};
use ternfleet_kernels::Numerics;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Converts the tiny qwen3moe test model (2 layers × 16 experts, top-4) into a bundle under
/// target/cluster-test/bundle-NAME, experts kept in their type; reused (convert resumes).
pub fn tiny_moe_bundle(name: &str) -> PathBuf {
    use ternfleet_coordinator::convert::{convert, ConvertOptions, ExpertType};
    let out = root()
        .join("target/cluster-test")
        .join(format!("bundle-{name}"));
    // Tests run in parallel and share bundles: one conversion at a time (the second finds
    // the first's finished bundle and returns at once).
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    convert(
        &ConvertOptions {
            model: root().join("tests/data/models/tiny-qwen3moe-q8_0.gguf"),
            out: out.clone(),
            experts: None,
            top_k: None,
            calib: None,
            calib_tokens: 1024,
            expert_type: ExpertType::Keep,
            seed: 0,
            grouping: Default::default(),
        },
        &|_: &str, _: u64, _: u64| {},
    )
    .unwrap();
    out
}

/// An HTTP client with a bounded wait.
pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .build()
}

/// (status, body) of a GET.
pub fn get(url: &str, path: &str) -> (u16, String) {
    match agent().get(&format!("{url}{path}")).call() {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

/// A sample's value from `/metrics` (NaN when absent).
pub fn metric(url: &str, name: &str) -> f64 {
    let (_, text) = get(url, "/metrics");
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Reads a child's first stdout line within `secs` (its start-up line), as JSON.
pub fn startup_line(child: &mut Child, secs: u64) -> Value {
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
        // Keep draining so the child never blocks on a full pipe.
        let mut sink = Vec::new();
        let _ = r.read_to_end(&mut sink);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(secs))
        .expect("a start-up line in time");
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    assert_eq!(v["ternfleet"], "listening", "{line}");
    v
}

/// Waits for a child at most `secs` seconds (killing it and failing past that).
pub fn wait_bounded(child: &mut Child, secs: u64, what: &str) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        if t.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ran over {secs} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every logit (as bits) of a prefill and `n` greedy decode steps.
pub fn run(
    m: &Model,
    numerics: Numerics,
    prompt: &str,
    n: usize,
) -> Result<Vec<u32>, ForwardError> {
    let toks = m.tokenizer.encode(prompt, true, true);
    let opts = SeqOptions {
        numerics,
        ..SeqOptions::default()
    };
    let mut cache = m.new_cache_with(toks.len() + n, opts);
    let mut all = m.forward(&mut cache, &toks, Logits::From(0))?;
    let nv = m.cfg.n_vocab;
    for _ in 0..n {
        let last = &all[all.len() - nv..];
        let best = (0..nv).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        all.extend(m.forward(&mut cache, &[best as u32], Logits::Last)?);
    }
    Ok(all.iter().map(|v| v.to_bits()).collect())
}

/// The token pieces and log-probabilities of a completions answer (`"logprobs": 0`).
pub fn logprobs_of(v: &serde_json::Value) -> (Vec<String>, Vec<f64>) {
    let lp = &v["choices"][0]["logprobs"];
    let toks = lp["tokens"]
        .as_array()
        .expect("logprobs.tokens")
        .iter()
        .map(|t| t.as_str().unwrap_or_default().to_string())
        .collect();
    let lps = lp["token_logprobs"]
        .as_array()
        .expect("logprobs.token_logprobs")
        .iter()
        .map(|x| x.as_f64().unwrap_or(f64::NAN))
        .collect();
    (toks, lps)
}
