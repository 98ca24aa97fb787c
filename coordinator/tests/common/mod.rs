//! Helpers shared by the multi-process and engine tests (each test binary uses some).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
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

// ---- processes and the HTTP API (the multi-process tests) ----

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_ternfleet")
}

pub fn log_dir() -> PathBuf {
    let d = root().join("target/cluster-test");
    let _ = std::fs::create_dir_all(&d);
    d
}

pub fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid; no memory is touched.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

/// A process killed (and reaped) when dropped, whatever the test's outcome.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        signal(&self.0, libc::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub struct Server {
    pub proc: Proc,
    pub url: String,
    pub log: PathBuf,
    /// The start-up line.
    pub line: Value,
}

impl Server {
    pub fn start(model: &Path, extra: &[String], name: &str) -> Server {
        let log = log_dir().join(format!("{name}.log"));
        let child = Command::new(bin())
            .args(["serve", "-m"])
            .arg(model)
            .args(["--http", "127.0.0.1:0", "-t", "2"])
            // gRPC off unless the caller asks for it.
            .args(if extra.iter().any(|a| a == "--grpc") {
                &[][..]
            } else {
                &["--grpc", ""][..]
            })
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).map_or(Stdio::null(), Stdio::from))
            .spawn()
            .expect("spawning ternfleet serve");
        let mut proc = Proc(child);
        let v = startup_line(&mut proc.0, 60);
        let url = format!("http://{}", v["http"].as_str().expect("http"));
        let s = Server {
            proc,
            url,
            log,
            line: v,
        };
        let t = Instant::now();
        loop {
            let (code, body) = get(&s.url, "/ready");
            if code == 200 {
                break;
            }
            if t.elapsed() > Duration::from_secs(120) {
                // What the server said and did: the last of its log.
                let log = s.log_text();
                let tail: Vec<&str> = log.lines().rev().take(60).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!(
                    "{name}: not ready in 120 s (/ready: {code} {body})\n{}",
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    /// The log without colour codes.
    pub fn log_text(&self) -> String {
        let raw = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut out = String::with_capacity(raw.len());
        let mut it = raw.chars();
        while let Some(ch) = it.next() {
            if ch == '\u{1b}' {
                // CSI: ESC [ ... final byte in @..~
                for c in it.by_ref() {
                    if ('@'..='~').contains(&c) && c != '[' {
                        break;
                    }
                }
            } else {
                out.push(ch);
            }
        }
        out
    }

    pub fn log_count(&self, needle: &str) -> usize {
        self.log_text().matches(needle).count()
    }
}

pub fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = agent()
        .post(&format!("{url}/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string());
    let (s, b) = match r {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    };
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

pub fn request(prompt: &str, max_tokens: usize, seed: u64) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
           "logprobs": 0, "ignore_eos": true})
}

/// (token pieces, logprobs as f32 bits) of a completion.
pub fn completion(url: &str, body: &Value) -> (Vec<String>, Vec<u32>) {
    let (s, v) = post(url, body);
    assert_eq!(s, 200, "{v}");
    let (toks, lps) = logprobs_of(&v);
    (toks, lps.iter().map(|&x| (x as f32).to_bits()).collect())
}

/// Streams a completion; after `after` tokens calls `fault` once. Returns the tokens,
/// logprobs and the longest gap between two events.
pub fn stream_with_fault(
    url: &str,
    body: &Value,
    after: usize,
    fault: impl FnOnce(),
) -> (Vec<String>, Vec<u32>, Duration) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = agent()
        .post(&format!("{url}/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .expect("the stream starts");
    let mut reader = BufReader::new(r.into_reader());
    let (mut toks, mut lps) = (Vec::new(), Vec::new());
    let mut fault = Some(fault);
    let mut last = Instant::now();
    let mut gap = Duration::ZERO;
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).expect("reading the stream") == 0 {
            break;
        }
        let Some(data) = line.trim().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{data}: {e}"));
        assert!(v.get("error").is_none(), "stream error: {v}");
        let lp = &v["choices"][0]["logprobs"];
        if let (Some(t), Some(l)) = (lp["tokens"].as_array(), lp["token_logprobs"].as_array()) {
            let now = Instant::now();
            if !toks.is_empty() {
                gap = gap.max(now - last);
            }
            last = now;
            toks.extend(t.iter().map(|x| x.as_str().unwrap_or_default().to_string()));
            lps.extend(
                l.iter()
                    .map(|x| (x.as_f64().unwrap_or(f64::NAN) as f32).to_bits()),
            );
        }
        if toks.len() >= after {
            if let Some(f) = fault.take() {
                f();
            }
        }
    }
    assert!(
        fault.is_none(),
        "the stream ended before the fault was injected"
    );
    (toks, lps, gap)
}

/// Sets its flag when dropped: clients in a `thread::scope` stop however the scope ends (a
/// failed assertion included).
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Posts a completion and compares it with `want` (tokens, logprob bits): why it failed, if
/// it did.
pub fn check_completion(url: &str, body: &Value, want: &(Vec<String>, Vec<u32>)) -> Option<String> {
    let (status, v) = post(url, body);
    if status != 200 {
        return Some(format!("{status}: {v}"));
    }
    let (t, l) = logprobs_of(&v);
    let got = (
        t,
        l.iter()
            .map(|&x| (x as f32).to_bits())
            .collect::<Vec<u32>>(),
    );
    (got != *want).then(|| "output differs".to_string())
}

/// `ternfleet ctl` against a seated coordinator's admin API: (success, stdout, stderr).
pub fn ctl(admin: &str, certs: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin())
        .args(["ctl", "--addr", admin, "--certs"])
        .arg(certs)
        .args(args)
        .output()
        .expect("running ternfleet ctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `ternfleet ctl --json …`: the admin API's response (asserting the command succeeded).
pub fn ctl_json(admin: &str, certs: &Path, args: &[&str]) -> Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let (ok, out, err) = ctl(admin, certs, &a);
    assert!(ok, "ctl {args:?} failed: {err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("ctl {args:?}: {e}: {out}"))
}

/// Waits (at most `secs`) until `ctl node list` shows node `id` with `status`.
pub fn wait_node_status(admin: &str, certs: &Path, id: &str, status: &str, secs: u64) {
    let t = std::time::Instant::now();
    while !ctl_json(admin, certs, &["node", "list"])["nodes"]
        .as_array()
        .is_some_and(|ns| ns.iter().any(|n| n["id"] == id && n["status"] == status))
    {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(secs),
            "node {id} not {status} within {secs} s"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// A child's stderr appended to `log` (a restarted process keeps the earlier lines).
pub fn append_to(log: &Path) -> Stdio {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_or(Stdio::null(), Stdio::from)
}

/// `s` without ANSI colour codes (tracing colours its fields).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            for d in it.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Waits until `needle` appears in the coordinator's log at least `n` times.
pub fn wait_for_log(s: &Server, needle: &str, n: usize, secs: u64) {
    let t = Instant::now();
    while s.log_count(needle) < n {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "no {needle:?} in the coordinator's log within {secs} s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Network namespaces deleted when dropped.
pub struct Netns {
    pub names: Vec<String>,
}

impl Netns {
    /// Runs `ip ARGS`.
    pub fn ip(args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip")
            .args(args)
            .output()
            .map_err(|e| format!("ip: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Netns::ip(&["netns", "del", n]);
        }
    }
}
