//! The distributed runtime end to end: real `ternfleet node` processes on loopback (port 0,
//! addresses read from their start-up lines, killed by pid on every exit path) serving a
//! bundle's experts over QUIC with mutual TLS, and a coordinator (`generate` or `serve`) that
//! must give the single process's tokens and logits bit for bit — through node deaths and
//! stalls when replicas exist, with a clear `UNAVAILABLE` when none is left. And the nodes'
//! door: no certificate, another CA's certificate, a certificate for another id, a hello that
//! lies about its id and garbage frames are all refused, and the node keeps serving.

mod common;
use common::*;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use ternfleet_coordinator::convert::{convert, ConvertOptions, ExpertType};
use ternfleet_shared::bundle::Manifest;
use ternfleet_shared::cluster::ClusterFile;
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::mtls::{self, Identity};
use ternfleet_shared::testing::skip;
use ternfleet_shared::wire::{Frame, NodeState};

struct Node {
    id: String,
    addr: String,
    proc: Option<Proc>,
}

/// Certificates, a cluster file and `n` node processes serving a bundle.
struct Cluster {
    dir: tempfile::TempDir,
    bundle: PathBuf,
    file: PathBuf,
    certs: PathBuf,
    nodes: Vec<Node>,
    name: String,
    /// Extra flags for every `ternfleet node`.
    node_args: Vec<String>,
}

impl Cluster {
    /// Starts `n` nodes on loopback with each expert on `replicas` of them.
    fn start(name: &str, bundle: &Path, n: usize, replicas: usize) -> Cluster {
        let man = Manifest::read(bundle).unwrap();
        // Placeholder addresses: the nodes bind port 0, the real ones are written later.
        let list: Vec<(String, String)> = (1..=n)
            .map(|i| (format!("n{i}"), "127.0.0.1:1".to_string()))
            .collect();
        Cluster::start_placed(
            name,
            bundle,
            ClusterFile::plan(&man, &list, replicas).unwrap(),
        )
    }

    /// Starts the nodes of `plan` (its addresses are replaced by the bound ones).
    fn start_placed(name: &str, bundle: &Path, plan: ClusterFile) -> Cluster {
        Cluster::start_placed_with(name, bundle, plan, &[])
    }

    /// [`Cluster::start_placed`] with extra flags for every node.
    fn start_placed_with(
        name: &str,
        bundle: &Path,
        plan: ClusterFile,
        node_args: &[&str],
    ) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        mtls::init_ca(&certs).unwrap();
        mtls::issue(&certs, "coordinator").unwrap();
        for n in &plan.nodes {
            mtls::issue(&certs, &n.id).unwrap();
        }
        let file = dir.path().join("cluster.toml");
        std::fs::write(&file, plan.to_toml()).unwrap();
        let mut c = Cluster {
            dir,
            bundle: bundle.to_owned(),
            file,
            certs,
            nodes: plan
                .nodes
                .iter()
                .map(|n| Node {
                    id: n.id.clone(),
                    addr: String::new(),
                    proc: None,
                })
                .collect(),
            name: name.to_string(),
            node_args: node_args.iter().map(|a| a.to_string()).collect(),
        };
        for i in 0..c.nodes.len() {
            c.spawn_node(i, "127.0.0.1:0");
        }
        c.write_file();
        c
    }

    fn spawn_node(&mut self, i: usize, listen: &str) {
        let id = self.nodes[i].id.clone();
        let log = log_dir().join(format!("{}-{id}.log", self.name));
        if listen.ends_with(":0") {
            let _ = std::fs::remove_file(&log);
        }
        let child = Command::new(bin())
            .args(["node", "-m"])
            .arg(&self.bundle)
            .args(["--id", &id, "--certs"])
            .arg(&self.certs)
            .arg("--cluster")
            .arg(&self.file)
            .args(["--listen", listen, "-t", "1", "--state-dir"])
            .arg(self.dir.path().join("state"))
            .args(&self.node_args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(append_to(&log))
            .spawn()
            .expect("spawning ternfleet node");
        // Owned (killed on drop) before anything below can fail.
        let mut proc = Proc(child);
        let v = startup_line(&mut proc.0, 30);
        assert_eq!(v["role"], "node");
        assert_eq!(v["id"], id.as_str());
        self.nodes[i].addr = v["quic"].as_str().expect("quic address").to_string();
        self.nodes[i].proc = Some(proc);
    }

    /// The cluster file with the nodes' real addresses.
    fn write_file(&self) {
        let mut f = ClusterFile::read(&self.file).unwrap();
        for (e, n) in f.nodes.iter_mut().zip(&self.nodes) {
            e.addr.clone_from(&n.addr);
        }
        std::fs::write(&self.file, f.to_toml()).unwrap();
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].proc.take() {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
    }

    fn child(&self, i: usize) -> &Child {
        &self.nodes[i].proc.as_ref().expect("node is running").0
    }

    /// Restarts a killed node on its old address.
    fn restart(&mut self, i: usize) {
        let addr = self.nodes[i].addr.clone();
        self.spawn_node(i, &addr);
        assert_eq!(self.nodes[i].addr, addr, "restarted on its old address");
    }

    fn cluster_args(&self) -> Vec<String> {
        vec![
            "--cluster".into(),
            self.file.display().to_string(),
            "--certs".into(),
            self.certs.display().to_string(),
        ]
    }
}

/// `ternfleet generate --json --logits-digest` on `model` with `extra` flags: (tokens, digest).
fn generate(model: &Path, prompt: &str, n: usize, extra: &[String]) -> (Vec<u64>, String) {
    generate_logged(model, prompt, n, extra).0
}

/// [`generate`] and its log (stderr).
fn generate_logged(
    model: &Path,
    prompt: &str,
    n: usize,
    extra: &[String],
) -> ((Vec<u64>, String), String) {
    let mut child = Command::new(bin())
        .args(["generate", "-m"])
        .arg(model)
        .args(["-p", prompt, "-n", &n.to_string(), "-t", "2"])
        .args(["--json", "--logits-digest", "--ignore-eos"])
        .args(extra)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning ternfleet generate");
    let mut out = String::new();
    let mut so = child.stdout.take().expect("piped");
    let mut se = child.stderr.take().expect("piped");
    let t_err = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = se.read_to_string(&mut err);
        err
    });
    let _ = so.read_to_string(&mut out);
    let st = wait_bounded(&mut child, 120, "generate");
    let err = t_err.join().unwrap_or_default();
    assert!(st.success(), "generate {extra:?} failed:\n{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{out}: {e}"));
    let toks = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().unwrap_or(u64::MAX))
        .collect();
    (
        (
            toks,
            v["logits_sha256"].as_str().expect("digest").to_string(),
        ),
        err,
    )
}

/// Converts a test model (or Gemma) into a bundle under target/ (reused: convert resumes).
fn bundle(src: &Path, name: &str, experts: Option<usize>, ty: &str) -> PathBuf {
    let out = log_dir().join(format!("bundle-{name}"));
    // Tests run in parallel and share bundles: one conversion at a time (the second finds
    // the first's finished bundle and returns at once).
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    convert(
        &ConvertOptions {
            model: src.to_owned(),
            out: out.clone(),
            experts,
            top_k: None,
            calib: experts.map(|_| root().join("tests/data/text/python-reference.txt")),
            calib_tokens: 1024,
            expert_type: ExpertType::parse(ty).unwrap(),
            seed: 0,
            grouping: Default::default(),
        },
        &|_: &str, _: u64, _: u64| {},
    )
    .unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    out
}

fn tiny(name: &str) -> PathBuf {
    root().join("tests/data/models").join(name)
}

fn gemma() -> Option<PathBuf> {
    let p = root().join("models/gemma-3-270m-q4_k_m.gguf");
    if p.exists() {
        Some(p)
    } else {
        skip(
            "cluster tests on Gemma",
            "models/gemma-3-270m-q4_k_m.gguf missing (scripts/fetch-model.sh)",
        );
        None
    }
}

const PROMPT: &str = "The capital of France is";

#[test]
fn three_nodes_give_the_single_process_tokens_and_logits_bit_for_bit() {
    let mut cases: Vec<(String, PathBuf, Vec<String>)> = Vec::new();
    for (m, name) in [
        ("tiny-qwen3moe-q8_0.gguf", "qwen3moe"),
        ("tiny-qwen2moe-q8_0.gguf", "qwen2moe-shared-expert"),
        ("tiny-mixtral-q8_0.gguf", "mixtral"),
        ("tiny-qwen3moe-tq2_0.gguf", "qwen3moe-tq2_0"),
    ] {
        cases.push((name.into(), bundle(&tiny(m), name, None, "keep"), vec![]));
    }
    if let Some(g) = gemma() {
        let moe = bundle(&g, "gemma-moe8", Some(8), "keep");
        cases.push(("gemma-moe8 top-4".into(), moe.clone(), vec![]));
        cases.push((
            "gemma-moe8 every expert".into(),
            moe,
            vec!["--top-experts".into(), "8".into()],
        ));
        cases.push((
            "gemma-moe8 ternary experts".into(),
            bundle(&g, "gemma-moe8-tq2_0", Some(8), "tq2_0"),
            vec![],
        ));
    }
    for (name, b, extra) in &cases {
        let replicas = if name == "qwen3moe" { 2 } else { 1 };
        let c = Cluster::start(&format!("bits-{}", name.replace(' ', "-")), b, 3, replicas);
        for numerics in ["parity", "invariant"] {
            let mut args = extra.clone();
            args.extend(["--numerics".to_string(), numerics.to_string()]);
            let one = generate(b, PROMPT, 24, &args);
            args.extend(c.cluster_args());
            let three = generate(b, PROMPT, 24, &args);
            assert_eq!(one.0.len(), 24, "{name} {numerics}");
            assert_eq!(
                one, three,
                "{name} {numerics}: 3 nodes differ from one process"
            );
        }
    }
}

/// `ternfleet generate --prompts FILE --parallel N --json --logits-digest`: per prompt, its
/// tokens and logits digest; and the log.
fn generate_many(
    model: &Path,
    prompts: &Path,
    extra: &[String],
) -> (Vec<(Vec<u64>, String)>, String) {
    let mut out = Command::new(bin())
        .args(["generate", "-m"])
        .arg(model)
        .arg("--prompts")
        .arg(prompts)
        .args(["-n", "12", "-t", "2", "--temp", "0"])
        .args(["--json", "--logits-digest", "--ignore-eos"])
        .args(extra)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning ternfleet generate");
    let mut se = out.stderr.take().expect("piped");
    let t_err = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = se.read_to_string(&mut err);
        err
    });
    let mut stdout = String::new();
    let _ = out
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut stdout);
    let st = wait_bounded(&mut out, 120, "generate --prompts");
    let log = t_err.join().unwrap_or_default();
    assert!(st.success(), "generate --prompts {extra:?} failed:\n{log}");
    let rows = stdout
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"));
            let toks = v["tokens"].as_array().expect("tokens").iter();
            (
                toks.map(|t| t.as_u64().unwrap_or(u64::MAX)).collect(),
                v["logits_sha256"].as_str().expect("digest").to_string(),
            )
        })
        .collect();
    (rows, log)
}

#[test]
fn concurrent_sequences_in_two_micro_batches_give_single_process_bits() {
    // Several sequences in one step over 3 nodes, invariant numerics: the coordinator splits
    // each step in two micro-batches (one's attention while the other's experts are on the
    // nodes). Every sequence's tokens and logits equal one process running the same prompts.
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(
        &prompts,
        "The capital of France is\nOnce upon a time, in a land far away, there lived\n1, 2, 3,\nRust is a language that\nThe quick brown fox\n",
    )
    .unwrap();
    let mut cases = vec![(
        "qwen3moe",
        bundle(&tiny("tiny-qwen3moe-q8_0.gguf"), "qwen3moe", None, "keep"),
    )];
    if let Some(g) = gemma() {
        cases.push(("gemma-moe8", bundle(&g, "gemma-moe8", Some(8), "keep")));
    }
    for (name, b) in cases {
        let c = Cluster::start(&format!("micro-{name}"), &b, 3, 1);
        let args: Vec<String> = ["--numerics", "invariant", "--parallel", "5"]
            .map(String::from)
            .to_vec();
        let (one, _) = generate_many(&b, &prompts, &args);
        let mut clustered = args.clone();
        clustered.extend(c.cluster_args());
        let (three, log) = generate_many(&b, &prompts, &clustered);
        assert_eq!(one.len(), 5, "{name}");
        assert!(one.iter().all(|(t, _)| t.len() == 12), "{name}: {one:?}");
        assert_eq!(
            one, three,
            "{name}: micro-batched cluster differs from one process"
        );
        assert!(
            log.contains("micro-batches:"),
            "{name}: the steps were not split:\n{log}"
        );
    }
}

#[test]
fn prefetch_hints_to_nodes_with_an_expert_store_change_no_bit() {
    // Nodes keep a few experts in RAM (the expert store) and read the rest from disk; the
    // coordinator's shadow predictor sends them hints two layers ahead. Output unchanged.
    let b = bundle(&tiny("tiny-qwen3moe-q8_0.gguf"), "qwen3moe", None, "keep");
    let man = Manifest::read(&b).unwrap();
    let list: Vec<(String, String)> = (1..=3)
        .map(|i| (format!("n{i}"), "127.0.0.1:1".to_string()))
        .collect();
    let plan = ClusterFile::plan(&man, &list, 1).unwrap();
    let c = Cluster::start_placed_with(
        "hints",
        &b,
        plan,
        &["--ram-budget", "200KiB", "--io-threads", "2"],
    );
    for numerics in ["parity", "invariant"] {
        let args = vec!["--numerics".to_string(), numerics.to_string()];
        let one = generate(&b, PROMPT, 24, &args);
        let mut hinted = args.clone();
        hinted.extend(c.cluster_args());
        hinted.extend(["--prefetch", "router", "--lookahead", "2"].map(String::from));
        let (got, log) = generate_logged(&b, PROMPT, 24, &hinted);
        assert_eq!(
            got, one,
            "{numerics}: hinted cluster differs from one process\n{log}"
        );
    }
    // The nodes read experts from disk (the store is in use).
    let log = std::fs::read_to_string(log_dir().join("hints-n1.log")).unwrap_or_default();
    assert!(log.contains("expert store"), "{log}");
}

/// A `ternfleet serve` process with its HTTP address; its stderr goes to `log`.
#[test]
fn a_served_cluster_batches_requests_and_survives_sigkill_and_sigstop_with_identical_output() {
    let Some(g) = gemma() else { return };
    let b = bundle(&g, "gemma-moe8", Some(8), "keep");
    let mut c = Cluster::start("serve-faults", &b, 3, 2);
    let single = Server::start(&b, &[], "serve-faults-single");
    let coord = Server::start(&b, &c.cluster_args(), "serve-faults-coordinator");

    // Concurrent requests, batched into the same steps across the nodes.
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 1, 2, 3, 5, 8,",
    ];
    let want: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| completion(&single.url, &request(p, 16, i as u64)))
        .collect();
    let got: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let u = coord.url.clone();
                s.spawn(move || completion(&u, &request(p, 16, i as u64)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).collect()
    });
    assert_eq!(got, want, "concurrent requests on 3 nodes vs one process");

    // SIGKILL a node mid-generation: its replicas take over, nothing changes.
    let body = request("Explain photosynthesis in simple terms:", 64, 7);
    let reference = completion(&single.url, &body);
    let (toks, lps, gap) = stream_with_fault(&coord.url, &body, 8, || c.kill(0));
    assert_eq!((toks, lps), reference, "output after SIGKILL of n1 differs");
    assert!(
        coord.log_text().contains("node marked down: node n1"),
        "n1's death was not noticed"
    );
    let stall = metric(&coord.url, "ternfleet_cluster_failover_stall_max_seconds");
    assert!(
        metric(&coord.url, "ternfleet_cluster_failovers_total") >= 1.0 && stall > 0.0,
        "no failover in /metrics"
    );
    eprintln!("SIGKILL n1: longest gap between tokens {gap:?}, failover stall {stall:.3} s");
    assert!(gap < Duration::from_secs(5), "stall {gap:?}");

    // It comes back on its address: used again.
    let back = "node is ready: routing to it node=n1";
    let seen = coord.log_count(back);
    c.restart(0);
    wait_for_log(&coord, back, seen + 1, 15);

    // SIGSTOP a node past the step deadline: detected, rerouted, same output.
    let body = request("Le café de la gare était", 64, 9);
    let reference = completion(&single.url, &body);
    let stopped = c.child(1).id();
    let (toks, lps, gap) = stream_with_fault(&coord.url, &body, 8, || {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(stopped as i32, libc::SIGSTOP);
        }
    });
    signal(c.child(1), libc::SIGCONT);
    assert_eq!((toks, lps), reference, "output after SIGSTOP of n2 differs");
    wait_for_log(&coord, "node marked down: node n2", 1, 1);
    eprintln!("SIGSTOP n2: longest gap between tokens {gap:?}");
    assert!(gap < Duration::from_secs(5), "stall {gap:?}");
    assert_eq!(metric(&coord.url, "ternfleet_kv_blocks_used"), 0.0);
    drop(coord);
    drop(single);
}

#[test]
fn losing_the_last_replica_fails_requests_with_unavailable_within_5s_and_serving_resumes() {
    let b = bundle(&tiny("tiny-qwen3moe-q8_0.gguf"), "qwen3moe", None, "keep");
    let mut c = Cluster::start("last-replica", &b, 3, 1);
    let coord = Server::start(&b, &c.cluster_args(), "last-replica-coordinator");
    let body = request("The capital of France is", 16, 3);
    let before = completion(&coord.url, &body);
    c.kill(0);
    // Even with no traffic, the heartbeat notices: /ready says why it is not ready.
    let t = Instant::now();
    loop {
        let (code, text) = get(&coord.url, "/ready");
        if code == 503 && text.contains("degraded") && text.contains("no live node") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "/ready still {code} {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "idle cluster: /ready 503 {:?} after the node died",
        t.elapsed()
    );
    let t = Instant::now();
    let (s, v) = post(&coord.url, &body);
    let took = t.elapsed();
    eprintln!("last replica lost: {s} after {took:?}: {v}");
    assert_eq!(s, ErrorClass::Unavailable.http_status(), "{v}");
    let msg = v.to_string();
    assert!(
        msg.contains("n1") && msg.contains("no live replica"),
        "{msg}"
    );
    assert!(took < Duration::from_secs(5), "error after {took:?}");
    assert_eq!(get(&coord.url, "/health").0, 200);
    assert_eq!(
        metric(&coord.url, "ternfleet_kv_blocks_used"),
        0.0,
        "leaked KV"
    );
    // The node returns: the same request gives the same answer as before.
    let back = "node is ready: routing to it node=n1";
    let seen = coord.log_count(back);
    c.restart(0);
    wait_for_log(&coord, back, seen + 1, 15);
    assert_eq!(completion(&coord.url, &body), before);
    let t = Instant::now();
    while get(&coord.url, "/ready").0 != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "/ready not back to 200"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its blobs were verified at its first start: not hashed again.
    let log = std::fs::read_to_string(log_dir().join("last-replica-n1.log")).unwrap_or_default();
    assert!(log.contains("(0 blobs hashed, "), "{log}");
}

#[test]
fn only_the_requests_whose_rows_need_a_lost_expert_fail() {
    let b = bundle(&tiny("tiny-qwen3moe-q8_0.gguf"), "qwen3moe", None, "keep");
    // n1 holds one expert (layer 1, expert 0) and nothing else; n2 the rest.
    let plan: ClusterFile = toml::from_str(
        r#"
        [[node]]
        id = "n1"
        addr = "127.0.0.1:1"
        experts = ["1:0"]
        [[node]]
        id = "n2"
        addr = "127.0.0.1:1"
        experts = ["0:*", "1:1-15"]
        "#,
    )
    .unwrap();
    let mut c = Cluster::start_placed("isolate", &b, plan);
    let single = Server::start(&b, &[], "isolate-single");
    let coord = Server::start(&b, &c.cluster_args(), "isolate-coordinator");
    let prompts = [
        "Hello", "The", "A cat", "1", "def", "Once", "Paris", "yes", "blue", "tree", "x", "go",
    ];
    let body = |p: &str| request(p, 2, 5);
    let want: Vec<_> = prompts
        .iter()
        .map(|p| completion(&single.url, &body(p)))
        .collect();
    c.kill(0);
    let got: Vec<(u16, Value)> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let u = coord.url.clone();
                s.spawn(move || post(&u, &body(p)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).collect()
    });
    let (mut ok, mut failed) = (0, 0);
    for ((p, (status, v)), w) in prompts.iter().zip(&got).zip(&want) {
        match status {
            200 => {
                ok += 1;
                let lp = &v["choices"][0]["logprobs"];
                let toks: Vec<String> = lp["tokens"]
                    .as_array()
                    .expect("tokens")
                    .iter()
                    .map(|t| t.as_str().unwrap_or_default().to_string())
                    .collect();
                assert_eq!(
                    &toks, &w.0,
                    "{p:?}: a request that avoided the lost expert changed"
                );
            }
            503 => {
                failed += 1;
                assert!(v.to_string().contains("n1"), "{v}");
            }
            s => panic!("{p:?}: status {s}: {v}"),
        }
    }
    eprintln!(
        "lost expert (layer 1, expert 0): {failed} requests failed, {ok} completed unchanged"
    );
    assert!(
        ok > 0 && failed > 0,
        "{ok} completed, {failed} failed: the split was not exercised"
    );
    assert_eq!(
        metric(&coord.url, "ternfleet_kv_blocks_used"),
        0.0,
        "leaked KV"
    );
}

// ---- the nodes' door -------------------------------------------------------------------

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One exchange with a node as `cfg`'s client, under TLS server name `name`: the answer, or
/// why there was none.
async fn exchange(
    addr: &str,
    name: &str,
    cfg: quinn::ClientConfig,
    payloads: &[Vec<u8>],
) -> Vec<Result<Frame, String>> {
    let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut out = Vec::new();
    let conn = match ep
        .connect_with(cfg, addr.parse().unwrap(), name)
        .map_err(|e| e.to_string())
    {
        Ok(c) => match tokio::time::timeout(Duration::from_secs(5), c).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return vec![Err(e.to_string())],
            Err(_) => return vec![Err("handshake timed out".into())],
        },
        Err(e) => return vec![Err(e)],
    };
    for p in payloads {
        let r = async {
            let (mut s, mut r) = conn.open_bi().await.map_err(|e| e.to_string())?;
            s.write_all(p).await.map_err(|e| e.to_string())?;
            s.finish().map_err(|e| e.to_string())?;
            let b = r.read_to_end(1 << 20).await.map_err(|e| e.to_string())?;
            Frame::decode(&b).map_err(|e| e.to_string())
        };
        out.push(
            tokio::time::timeout(Duration::from_secs(5), r)
                .await
                .unwrap_or(Err("no answer in 5 s".into())),
        );
    }
    out
}

fn hello(id: &str) -> Vec<u8> {
    Frame::Hello { id: id.into() }.encode().unwrap()
}

/// A client configuration trusting `ca_dir`'s CA and presenting no certificate.
fn no_client_cert(ca_dir: &Path) -> quinn::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca_dir.join("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![mtls::ALPN.to_vec()];
    quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(cfg).unwrap(),
    ))
}

#[test]
fn nodes_refuse_unauthenticated_and_mismatched_peers_and_survive_bad_frames() {
    let b = bundle(&tiny("tiny-qwen3moe-q8_0.gguf"), "qwen3moe", None, "keep");
    let c = Cluster::start("door", &b, 2, 1);
    let addr = c.nodes[0].addr.clone();
    let rt = rt();
    let ok = |r: &Result<Frame, String>| {
        matches!(
            r,
            Ok(Frame::Status { id, state: NodeState::Ready, .. }) if id == "n1"
        )
    };
    let coordinator = Identity::load(&c.certs, "coordinator").unwrap();

    // The real coordinator identity: a status from n1.
    let r = rt.block_on(exchange(
        &addr,
        "n1",
        coordinator.client_config().unwrap(),
        &[hello("coordinator")],
    ));
    assert!(ok(&r[0]), "{r:?}");

    // No client certificate.
    let r = rt.block_on(exchange(
        &addr,
        "n1",
        no_client_cert(&c.certs),
        &[hello("coordinator")],
    ));
    eprintln!(
        "refused ({})",
        r[0].as_ref().err().map_or("NOT REFUSED", |e| e.as_str())
    );
    assert!(r[0].is_err(), "no client certificate was accepted: {r:?}");

    // A certificate from another CA, for the right id.
    let other = c.dir.path().join("other-ca");
    mtls::init_ca(&other).unwrap();
    mtls::issue(&other, "coordinator").unwrap();
    // Trust our CA for the server, present the other CA's certificate.
    let mixed = c.dir.path().join("mixed");
    std::fs::create_dir_all(&mixed).unwrap();
    std::fs::copy(c.certs.join("ca.pem"), mixed.join("ca.pem")).unwrap();
    std::fs::copy(other.join("coordinator.pem"), mixed.join("coordinator.pem")).unwrap();
    std::fs::copy(other.join("coordinator.key"), mixed.join("coordinator.key")).unwrap();
    let foreign = Identity::load(&mixed, "coordinator").unwrap();
    let r = rt.block_on(exchange(
        &addr,
        "n1",
        foreign.client_config().unwrap(),
        &[hello("coordinator")],
    ));
    eprintln!(
        "refused ({})",
        r[0].as_ref().err().map_or("NOT REFUSED", |e| e.as_str())
    );
    assert!(
        r[0].is_err(),
        "another CA's certificate was accepted: {r:?}"
    );

    // A valid certificate whose identity is not an allowed coordinator (a node's).
    let n2 = Identity::load(&c.certs, "n2").unwrap();
    let r = rt.block_on(exchange(
        &addr,
        "n1",
        n2.client_config().unwrap(),
        &[hello("n2")],
    ));
    eprintln!(
        "refused ({})",
        r[0].as_ref().err().map_or("NOT REFUSED", |e| e.as_str())
    );
    assert!(
        r[0].is_err(),
        "a node's certificate was let in as a coordinator: {r:?}"
    );

    // An expired certificate from the right CA for the right id.
    let expired = c.dir.path().join("expired");
    std::fs::create_dir_all(&expired).unwrap();
    std::fs::copy(c.certs.join("ca.pem"), expired.join("ca.pem")).unwrap();
    {
        let ca_key =
            rcgen::KeyPair::from_pem(&std::fs::read_to_string(c.certs.join("ca.key")).unwrap())
                .unwrap();
        let ca = rcgen::CertificateParams::from_ca_cert_pem(
            &std::fs::read_to_string(c.certs.join("ca.pem")).unwrap(),
        )
        .unwrap()
        .self_signed(&ca_key)
        .unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["coordinator".to_string()]).unwrap();
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(expired.join("coordinator.pem"), cert.pem()).unwrap();
        std::fs::write(expired.join("coordinator.key"), key.serialize_pem()).unwrap();
    }
    let old = Identity::load(&expired, "coordinator").unwrap();
    let r = rt.block_on(exchange(
        &addr,
        "n1",
        old.client_config().unwrap(),
        &[hello("coordinator")],
    ));
    eprintln!(
        "refused ({})",
        r[0].as_ref().err().map_or("NOT REFUSED", |e| e.as_str())
    );
    assert!(r[0].is_err(), "an expired certificate was accepted: {r:?}");

    // The right certificate, a hello that claims another id.
    let r = rt.block_on(exchange(
        &addr,
        "n1",
        coordinator.client_config().unwrap(),
        &[hello("n2")],
    ));
    assert!(
        matches!(
            &r[0],
            Ok(Frame::Error {
                class: ErrorClass::Unauthenticated,
                ..
            })
        ),
        "{r:?}"
    );

    // A node presenting a certificate for another id than the one the coordinator dialled.
    let r = rt.block_on(exchange(
        &addr,
        "n2",
        coordinator.client_config().unwrap(),
        &[hello("coordinator")],
    ));
    eprintln!(
        "refused ({})",
        r[0].as_ref().err().map_or("NOT REFUSED", |e| e.as_str())
    );
    assert!(r[0].is_err(), "n1's certificate passed for n2: {r:?}");

    // Garbage and oversized frames fail their stream only; the connection and node go on.
    let mut huge = hello("coordinator");
    huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let r = rt.block_on(exchange(
        &addr,
        "n1",
        coordinator.client_config().unwrap(),
        &[b"not a frame at all".to_vec(), huge, hello("coordinator")],
    ));
    assert!(
        matches!(
            &r[0],
            Ok(Frame::Error {
                class: ErrorClass::BadRequest,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(
        matches!(
            &r[1],
            Ok(Frame::Error {
                class: ErrorClass::BadRequest,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(ok(&r[2]), "{r:?}");
    // The node says why it refused each one.
    let log = std::fs::read_to_string(log_dir().join("door-n1.log")).unwrap_or_default();
    for why in [
        "peer sent no certificates",     // no client certificate
        "invalid peer certificate",      // another CA's
        "names none of the allowed ids", // a node's certificate as a coordinator
        "broke the protocol",            // a hello naming another id
    ] {
        assert!(log.contains(why), "the node never said {why:?}:\n{log}");
    }
}

// ---- impaired links ----------------------------------------------------------------------

/// A seeded userspace UDP fault proxy between one client and one upstream address (`tc
/// netem` does not exist here): every datagram, either way, is dropped with probability
/// `loss`, else delivered after `delay` plus a uniform `jitter` (which reorders). Decisions
/// come from one xorshift stream seeded per proxy.
struct UdpProxy {
    addr: std::net::SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    stats: Arc<std::sync::Mutex<(u64, u64)>>,
}

struct Pending {
    at: Instant,
    seq: u64,
    up: bool,
    data: Vec<u8>,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq)) // min-heap on (time, arrival)
    }
}

struct Queue {
    heap: std::collections::BinaryHeap<Pending>,
    rng: u64,
    seq: u64,
    client: Option<std::net::SocketAddr>,
}

impl UdpProxy {
    fn start(
        upstream: std::net::SocketAddr,
        seed: u64,
        delay: Duration,
        jitter: Duration,
        loss: f64,
    ) -> UdpProxy {
        use std::net::UdpSocket;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Condvar, Mutex};
        let front = UdpSocket::bind("127.0.0.1:0").unwrap();
        let back = UdpSocket::bind("127.0.0.1:0").unwrap();
        back.connect(upstream).unwrap();
        for s in [&front, &back] {
            s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        }
        let addr = front.local_addr().unwrap();
        let (front, back) = (Arc::new(front), Arc::new(back));
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new((0u64, 0u64)));
        let q = Arc::new((
            Mutex::new(Queue {
                heap: Default::default(),
                rng: seed | 1,
                seq: 0,
                client: None,
            }),
            Condvar::new(),
        ));
        let mut threads = Vec::new();
        for up in [true, false] {
            let (sock, q, stop, stats) = (
                if up { front.clone() } else { back.clone() },
                q.clone(),
                stop.clone(),
                stats.clone(),
            );
            threads.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while !stop.load(Ordering::Relaxed) {
                    let (n, from) = match sock.recv_from(&mut buf) {
                        Ok(x) => x,
                        Err(_) => continue,
                    };
                    let mut g = q.0.lock().unwrap();
                    if up {
                        g.client = Some(from);
                    }
                    // xorshift64*
                    let mut next = || {
                        g.rng ^= g.rng >> 12;
                        g.rng ^= g.rng << 25;
                        g.rng ^= g.rng >> 27;
                        (g.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64
                            / (1u64 << 53) as f64
                    };
                    let (drop_it, j) = (next() < loss, next());
                    let mut s = stats.lock().unwrap();
                    s.0 += 1;
                    if drop_it {
                        s.1 += 1;
                        continue;
                    }
                    g.seq += 1;
                    let seq = g.seq;
                    g.heap.push(Pending {
                        at: Instant::now() + delay + jitter.mul_f64(j),
                        seq,
                        up,
                        data: buf[..n].to_vec(),
                    });
                    q.1.notify_one();
                }
            }));
        }
        {
            let (q, stop) = (q.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut g = q.0.lock().unwrap();
                while !stop.load(Ordering::Relaxed) {
                    let now = Instant::now();
                    match g.heap.peek() {
                        Some(p) if p.at <= now => {
                            let p = g.heap.pop().expect("peeked");
                            let client = g.client;
                            drop(g);
                            if p.up {
                                let _ = back.send(&p.data);
                            } else if let Some(c) = client {
                                let _ = front.send_to(&p.data, c);
                            }
                            g = q.0.lock().unwrap();
                        }
                        Some(p) => {
                            let wait = p.at - now;
                            g = q.1.wait_timeout(g, wait).unwrap().0;
                        }
                        None => {
                            g = q.1.wait_timeout(g, Duration::from_millis(20)).unwrap().0;
                        }
                    }
                }
            }));
        }
        UdpProxy {
            addr,
            stop,
            threads,
            stats,
        }
    }
}

impl Drop for UdpProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Tokens/s of a `generate` run, from its log line.
fn generate_rate(
    model: &Path,
    prompt: &str,
    n: usize,
    extra: &[String],
) -> ((Vec<u64>, String), f64) {
    let t = Instant::now();
    let out = generate(model, prompt, n, extra);
    (out, n as f64 / t.elapsed().as_secs_f64())
}

#[test]
fn a_lossy_delayed_link_completes_with_identical_output() {
    let Some(g) = gemma() else { return };
    let b = bundle(&g, "gemma-moe8", Some(8), "keep");
    let c = Cluster::start("lossy", &b, 3, 2);
    // The coordinator's view: every node behind its own proxy (1 ms, 0.5 ms jitter, 1 % loss).
    let proxies: Vec<UdpProxy> = c
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            UdpProxy::start(
                n.addr.parse().unwrap(),
                0x5eed + i as u64,
                Duration::from_millis(1),
                Duration::from_micros(500),
                0.01,
            )
        })
        .collect();
    let mut f = ClusterFile::read(&c.file).unwrap();
    for (e, p) in f.nodes.iter_mut().zip(&proxies) {
        e.addr = p.addr.to_string();
    }
    let proxied = c.dir.path().join("proxied.toml");
    std::fs::write(&proxied, f.to_toml()).unwrap();
    let args = |file: &Path| {
        vec![
            "--numerics".to_string(),
            "invariant".into(),
            "--cluster".into(),
            file.display().to_string(),
            "--certs".into(),
            c.certs.display().to_string(),
        ]
    };
    let one = generate(&b, PROMPT, 48, &["--numerics".into(), "invariant".into()]);
    let (clean, clean_rate) = generate_rate(&b, PROMPT, 48, &args(&c.file));
    let (lossy, lossy_rate) = generate_rate(&b, PROMPT, 48, &args(&proxied));
    let (sent, dropped) = proxies
        .iter()
        .map(|p| *p.stats.lock().unwrap())
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    eprintln!(
        "impaired link (1 ms + 0.5 ms jitter, 1 % loss; {dropped} of {sent} datagrams dropped): \
         {lossy_rate:.1} tok/s vs {clean_rate:.1} clean (whole runs, load included)"
    );
    assert!(
        dropped > 0,
        "the proxy dropped nothing: the loss was not exercised"
    );
    assert_eq!(clean, one, "3 clean nodes differ from one process");
    assert_eq!(
        lossy, one,
        "3 nodes behind a lossy link differ from one process"
    );
}

/// Network namespaces joined by veth pairs (deleted on drop, with everything in them).
#[test]
fn coordinator_and_two_nodes_in_their_own_network_namespaces() {
    let b = bundle(&tiny("tiny-qwen3moe-q8_0.gguf"), "qwen3moe", None, "keep");
    let tag = std::process::id() % 100_000;
    let mut ns = Netns { names: Vec::new() };
    let mut setup = || -> Result<(), String> {
        for who in ["c", "a", "b"] {
            let name = format!("tf{who}{tag}");
            Netns::ip(&["netns", "add", &name])?;
            ns.names.push(name.clone());
            Netns::ip(&["-n", &name, "link", "set", "lo", "up"])?;
        }
        for (k, who) in ["a", "b"].iter().enumerate() {
            let (vc, vn) = (format!("tfv{who}{tag}c"), format!("tfv{who}{tag}n"));
            let (cns, nns) = (format!("tfc{tag}"), format!("tf{who}{tag}"));
            Netns::ip(&["link", "add", &vc, "type", "veth", "peer", "name", &vn])?;
            Netns::ip(&["link", "set", &vc, "netns", &cns])?;
            Netns::ip(&["link", "set", &vn, "netns", &nns])?;
            let net = format!("10.231.{}", k + 1);
            Netns::ip(&[
                "-n",
                &cns,
                "addr",
                "add",
                &format!("{net}.1/24"),
                "dev",
                &vc,
            ])?;
            Netns::ip(&[
                "-n",
                &nns,
                "addr",
                "add",
                &format!("{net}.2/24"),
                "dev",
                &vn,
            ])?;
            Netns::ip(&["-n", &cns, "link", "set", &vc, "up"])?;
            Netns::ip(&["-n", &nns, "link", "set", &vn, "up"])?;
        }
        Ok(())
    };
    if let Err(e) = setup() {
        skip(
            "network-namespace cluster test",
            &format!("cannot make namespaces: {e}"),
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    mtls::init_ca(&certs).unwrap();
    for id in ["coordinator", "n1", "n2"] {
        mtls::issue(&certs, id).unwrap();
    }
    let man = Manifest::read(&b).unwrap();
    let file = dir.path().join("cluster.toml");
    let mut plan = ClusterFile::plan(
        &man,
        &[
            ("n1".into(), "10.231.1.2:1".into()),
            ("n2".into(), "10.231.2.2:1".into()),
        ],
        1,
    )
    .unwrap();
    std::fs::write(&file, plan.to_toml()).unwrap();
    let mut nodes = Vec::new();
    for (i, who) in ["a", "b"].iter().enumerate() {
        let id = format!("n{}", i + 1);
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &format!("tf{who}{tag}"),
                bin(),
                "node",
                "-m",
            ])
            .arg(&b)
            .args(["--id", &id, "--certs"])
            .arg(&certs)
            .arg("--cluster")
            .arg(&file)
            .args([
                "--listen",
                &format!("10.231.{}.2:0", i + 1),
                "-t",
                "1",
                "--state-dir",
            ])
            .arg(dir.path().join("state"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ip netns exec ternfleet node");
        nodes.push(Proc(child));
        let last = nodes.last_mut().expect("just pushed");
        let v = startup_line(&mut last.0, 30);
        plan.nodes[i].addr = v["quic"].as_str().expect("quic").to_string();
    }
    std::fs::write(&file, plan.to_toml()).unwrap();
    let run = |inside: bool| -> String {
        let mut cmd = if inside {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &format!("tfc{tag}"), bin()]);
            c
        } else {
            Command::new(bin())
        };
        cmd.args(["generate", "-m"]).arg(&b).args([
            "-p",
            PROMPT,
            "-n",
            "16",
            "--json",
            "--logits-digest",
            "--ignore-eos",
            "-t",
            "2",
        ]);
        if inside {
            cmd.arg("--cluster").arg(&file).arg("--certs").arg(&certs);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("generate");
        let mut out = String::new();
        let _ = child.stdout.take().expect("piped").read_to_string(&mut out);
        let st = wait_bounded(&mut child, 60, "generate in a namespace");
        let mut err = String::new();
        let _ = child.stderr.take().expect("piped").read_to_string(&mut err);
        assert!(
            st.success(),
            "generate (namespace: {inside}) failed:\n{err}"
        );
        out
    };
    let local = run(false);
    let across = run(true);
    assert!(local.contains("logits_sha256"), "{local}");
    assert_eq!(across, local, "over veth between namespaces vs one process");
    drop(nodes);
}

/// The web console in headless Chromium (`tests/console/console_test.py`, selenium and
/// Debian's chromium + chromium-driver): the page loads from the coordinator, the API key
/// entered opens the `/admin/v1/` mirrors (refused without it), every node shows up, a chat
/// message streams its reply in pieces, tokens/s and TTFT show; a node SIGKILLed is shown down
/// within the heartbeat timeout plus one refresh. Screenshots land in
/// target/cluster-test/console/ (the ones in docs/ come from here).
#[test]
fn the_web_console_chats_and_shows_a_killed_node_down_in_chromium() {
    let script = root().join("tests/console/console_test.py");
    let have = |c: &str| Path::new(c).exists();
    let selenium = Command::new("python3")
        .args(["-c", "import selenium"])
        .status()
        .is_ok_and(|s| s.success());
    if !(have("/usr/bin/chromium") && have("/usr/bin/chromedriver") && selenium) {
        skip(
            "the web console test",
            "needs chromium, chromium-driver (apt) and selenium (pip)",
        );
        return;
    }
    // MoEfied Gemma: a real model, so the chat (and the screenshots) read as text.
    let Some(g) = gemma() else { return };
    let b = bundle(&g, "gemma-moe8", Some(8), "keep");
    let mut c = Cluster::start("console", &b, 3, 2);
    let key = "console-test-key";
    let mut args = c.cluster_args();
    // Every expert of a token's layer (the dense model's answer, split across the nodes), in
    // Gemma's chat format (the GGUF carries no template).
    args.extend(["--api-key", key, "--chat-template", "gemma"].map(String::from));
    let coord = Server::start(&b, &args, "console-coordinator");
    // The mirrors need the key; the page itself is public (it holds no data).
    assert_eq!(get(&coord.url, "/admin/v1/cluster").0, 401);
    let (code, page) = get(&coord.url, "/");
    assert!(code == 200 && page.contains("ternfleet console"), "{code}");
    let shots = log_dir().join("console");
    // Heartbeat every second, a probe answered within one; the page refreshes every second.
    let down_within = 1.0 + 1.0 + 0.25 + 1.0 + 0.75;
    let mut py = Command::new("python3")
        .arg(&script)
        .args(["--url", &coord.url, "--key", key, "--nodes", "n1,n2,n3"])
        .args(["--kill", "n2", "--down-within", &down_within.to_string()])
        .arg("--shots")
        .arg(&shots)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(append_to(&log_dir().join("console-test.log")))
        .spawn()
        .expect("python3");
    let mut stdin = py.stdin.take().expect("piped");
    let stdout = py.stdout.take().expect("piped");
    let py = Proc(py);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let t = Instant::now();
    let mut result = None;
    let mut py = py;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) if l == "kill n2" => {
                c.kill(1);
                use std::io::Write;
                stdin.write_all(b"killed\n").expect("writing to the script");
                stdin.flush().expect("writing to the script");
            }
            Ok(l) => result = Some(l),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
        assert!(
            t.elapsed() < Duration::from_secs(180),
            "the console test hangs"
        );
    }
    let st = wait_bounded(&mut py.0, 10, "the console script");
    let log = std::fs::read_to_string(log_dir().join("console-test.log")).unwrap_or_default();
    assert!(st.success(), "the console script failed:\n{log}");
    let v: Value = serde_json::from_str(result.as_deref().unwrap_or("")).expect("its results");
    eprintln!("web console: {v}");
    assert!(v["down_shown_after_s"].as_f64().unwrap_or(f64::MAX) <= down_within);
    assert!(shots.join("console.png").exists() && shots.join("console-node-down.png").exists());
}

/// Traces across processes: a coordinator (`serve`) and three nodes export their spans over
/// OTLP/gRPC to `ternfleet otlp-sink`; one completion gives one trace id that covers the
/// coordinator's request, step, layer and node-call spans and every node's expert-execution
/// spans, each of those a child of one of the coordinator's node-call spans (the context
/// crossed QUIC in the call frame).
#[test]
fn one_trace_covers_the_coordinator_and_every_node_over_otlp() {
    let b = bundle(&tiny("tiny-qwen3moe-q8_0.gguf"), "qwen3moe", None, "keep");
    let mut sink = Command::new(bin())
        .args(["otlp-sink", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(append_to(&log_dir().join("otlp-sink.log")))
        .spawn()
        .expect("spawning the sink");
    let stdout = sink.stdout.take().expect("piped");
    let _sink = Proc(sink);
    let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    {
        let lines = lines.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                lines.lock().unwrap_or_else(|e| e.into_inner()).push(l);
            }
        });
    }
    let t = Instant::now();
    let first = loop {
        if let Some(l) = lines.lock().unwrap().first().cloned() {
            break l;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no sink start-up line"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let v: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(v["role"], "otlp-sink");
    let ep = format!("http://{}", v["grpc"].as_str().unwrap());
    let man = Manifest::read(&b).unwrap();
    let list: Vec<(String, String)> = (1..=3)
        .map(|i| (format!("n{i}"), "127.0.0.1:1".to_string()))
        .collect();
    let c = Cluster::start_placed_with(
        "otlp",
        &b,
        ClusterFile::plan(&man, &list, 1).unwrap(),
        &["--otlp-endpoint", &ep],
    );
    let mut args = c.cluster_args();
    args.extend(["--otlp-endpoint".to_string(), ep.clone()]);
    let coord = Server::start(&b, &args, "otlp-coordinator");
    completion(&coord.url, &request("The capital of France is", 4, 1));

    // Spans arrive within a batch delay (0.5 s) of ending.
    let spans = |lines: &[String]| -> Vec<Value> {
        lines[1..]
            .iter()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let t = Instant::now();
    let (trace, got) = loop {
        let all = spans(&lines.lock().unwrap());
        let found = all
            .iter()
            .filter(|s| s["name"] == "request" && s["service"] == "ternfleet-coordinator")
            .map(|s| s["trace_id"].as_str().unwrap_or_default().to_string())
            .find(|tid| {
                let of: Vec<&Value> = all.iter().filter(|s| s["trace_id"] == *tid).collect();
                let nodes: std::collections::BTreeSet<&str> = of
                    .iter()
                    .filter(|s| s["name"] == "expert_execution")
                    .filter_map(|s| s["id"].as_str())
                    .collect();
                nodes.len() == 3
            });
        if let Some(tid) = found {
            let of: Vec<Value> = all.into_iter().filter(|s| s["trace_id"] == tid).collect();
            break (tid, of);
        }
        if t.elapsed() > Duration::from_secs(20) {
            let all = spans(&lines.lock().unwrap());
            let kinds: std::collections::BTreeMap<String, usize> =
                all.iter().fold(Default::default(), |mut m, s| {
                    *m.entry(format!(
                        "{} {} {} trace {}",
                        s["service"], s["id"], s["name"], s["trace_id"]
                    ))
                    .or_default() += 1;
                    m
                });
            panic!("no trace covering the coordinator and n1-n3: {kinds:#?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let count = |name: &str, service: &str| {
        got.iter()
            .filter(|s| s["name"] == name && s["service"] == service)
            .count()
    };
    for name in ["request", "step", "layer", "node_call"] {
        assert!(count(name, "ternfleet-coordinator") > 0, "{name}: {got:?}");
    }
    let calls: std::collections::BTreeSet<&str> = got
        .iter()
        .filter(|s| s["name"] == "node_call")
        .filter_map(|s| s["span_id"].as_str())
        .collect();
    for s in got.iter().filter(|s| s["name"] == "expert_execution") {
        assert_eq!(s["service"], "ternfleet-node", "{s}");
        assert!(
            calls.contains(s["parent"].as_str().unwrap_or_default()),
            "an expert execution whose parent is no node call of the trace: {s}"
        );
    }
    eprintln!(
        "trace {trace}: {} spans (request {}, steps {}, layers {}, node calls {}, expert executions on n1-n3 {})",
        got.len(),
        count("request", "ternfleet-coordinator"),
        count("step", "ternfleet-coordinator"),
        count("layer", "ternfleet-coordinator"),
        count("node_call", "ternfleet-coordinator"),
        count("expert_execution", "ternfleet-node"),
    );
}
