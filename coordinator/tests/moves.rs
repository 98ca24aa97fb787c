//! Expert moves across processes: rebalancing a serving cluster.
//!
//! Two `ternfleet node` processes hold every expert (each its own bundle directory, the
//! whole bundle); two more join with bundle directories that hold no expert blob at all. While
//! streaming clients run, `ternfleet ctl placement apply` plans and carries out the moves: the
//! new nodes copy their experts' blobs from the old ones over QUIC (paced by `--move-rate`),
//! verify them against the manifest, serve them, and the switch is committed through Raft;
//! the sources drop (and, with `--prune`, delete) their copies. Checked:
//!
//! - zero failed requests, every output the single process's (same seeds);
//! - the inter-token latency during the moves against the steady state before them (p99,
//!   printed; at most 2x);
//! - every blob a new node holds is the manifest's (size and SHA-256, checked here again
//!   from the files), every copy logged as verified, the sources' moved blobs deleted;
//! - the placement after: routing-weighted load within 25 % of the mean on every node, and
//!   a new plan without co-location proposes no move (co-location's round trips printed).

mod common;
use common::*;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use ternfleet_shared::bundle::Manifest;
use ternfleet_shared::cluster::ClusterFile;
use ternfleet_shared::mtls;

struct Fleet {
    dir: tempfile::TempDir,
    procs: std::collections::BTreeMap<String, Proc>,
    /// `--move-rate` of the nodes started from now on.
    rate: &'static str,
}

impl Fleet {
    /// Certificates for every id, the coordinator and the operator; a cluster file where
    /// the nodes `full` hold every expert (2 replicas); a bundle directory per node, the
    /// nodes `empty` with only the manifest (no expert blob).
    fn new(bundle: &Path, full: &[&str], empty: &[&str]) -> Fleet {
        let man = Manifest::read(bundle).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        mtls::init_ca(&certs).unwrap();
        for id in full.iter().chain(empty).chain(&["coordinator", "operator"]) {
            mtls::issue(&certs, id).unwrap();
        }
        let list: Vec<(String, String)> = full
            .iter()
            .map(|id| (id.to_string(), "127.0.0.1:1".to_string()))
            .collect();
        let plan = ClusterFile::plan(&man, &list, 2).unwrap();
        std::fs::write(dir.path().join("cluster.toml"), plan.to_toml()).unwrap();
        for id in full.iter().chain(empty) {
            copy_dir(bundle, &dir.path().join(format!("bundle-{id}")));
        }
        for id in empty {
            for e in &man.experts {
                std::fs::remove_file(dir.path().join(format!("bundle-{id}")).join(&e.part.file))
                    .unwrap();
            }
        }
        Fleet {
            dir,
            procs: Default::default(),
            rate: "256KiB",
        }
    }

    /// The seated coordinator's arguments (joining through `first`).
    fn seat(&self, first: &str) -> Vec<String> {
        vec![
            "--join".to_string(),
            first.to_string(),
            "--certs".into(),
            self.certs().display().to_string(),
            "--state-dir".into(),
            self.dir.path().join("state").display().to_string(),
            "--admin".into(),
            "127.0.0.1:0".into(),
        ]
    }

    fn certs(&self) -> PathBuf {
        self.dir.path().join("certs")
    }

    fn bundle(&self, id: &str) -> PathBuf {
        self.dir.path().join(format!("bundle-{id}"))
    }

    fn log(&self, id: &str) -> String {
        let p = self.dir.path().join(format!("{id}.log"));
        strip_ansi(&std::fs::read_to_string(p).unwrap_or_default())
    }

    fn spawn(&mut self, id: &str, extra: &[&str]) -> String {
        self.spawn_at(id, "127.0.0.1:0", extra)
    }

    /// Starts node `id` bound to `listen`; its QUIC address.
    fn spawn_at(&mut self, id: &str, listen: &str, extra: &[&str]) -> String {
        let log = self.dir.path().join(format!("{id}.log"));
        let child = Command::new(bin())
            .args(["node", "-m"])
            .arg(self.bundle(id))
            .args(["--id", id, "--certs"])
            .arg(self.certs())
            .arg("--cluster")
            .arg(self.dir.path().join("cluster.toml"))
            .args(["--listen", listen, "-t", "1", "--state-dir"])
            .arg(self.dir.path().join("state"))
            .args(["--prune", "--move-rate", self.rate])
            .args(extra)
            .env("RUST_LOG", "info,raft=warn")
            .stdout(Stdio::piped())
            .stderr(append_to(&log))
            .spawn()
            .expect("spawning ternfleet node");
        let mut p = Proc(child);
        let v = startup_line(&mut p.0, 30);
        let addr = v["quic"].as_str().expect("quic address").to_string();
        self.procs.insert(id.to_string(), p);
        addr
    }

    /// Waits until node `id`'s log contains `needle`.
    fn wait_log(&self, id: &str, needle: &str, secs: u64) {
        let t0 = Instant::now();
        while !self.log(id).contains(needle) {
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "{id} did not log {needle:?} within {secs} s:\n{}",
                self.log(id)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// One streamed completion: (token pieces, logprobs as f32 bits, the instant each token
/// event arrived), or why it failed.
type Streamed = (Vec<String>, Vec<u32>, Vec<Instant>);

fn stream(url: &str, body: &Value) -> Result<Streamed, String> {
    let mut body = body.clone();
    body["stream"] = serde_json::json!(true);
    let r = agent()
        .post(&format!("{url}/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .map_err(|e| format!("the stream did not start: {e}"))?;
    let mut reader = std::io::BufReader::new(r.into_reader());
    let (mut toks, mut lps, mut at) = (Vec::new(), Vec::new(), Vec::new());
    let mut line = String::new();
    loop {
        line.clear();
        if reader
            .read_line(&mut line)
            .map_err(|e| format!("reading the stream: {e}"))?
            == 0
        {
            return Err("the stream ended without [DONE]".into());
        }
        let Some(data) = line.trim().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Ok((toks, lps, at));
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{data}: {e}"))?;
        if v.get("error").is_some() {
            return Err(format!("stream error: {v}"));
        }
        let lp = &v["choices"][0]["logprobs"];
        if let (Some(t), Some(l)) = (lp["tokens"].as_array(), lp["token_logprobs"].as_array()) {
            at.push(Instant::now());
            toks.extend(t.iter().map(|x| x.as_str().unwrap_or_default().to_string()));
            lps.extend(
                l.iter()
                    .map(|x| (x.as_f64().unwrap_or(f64::NAN) as f32).to_bits()),
            );
        }
    }
}

/// Whether every node of `show` (a `placement show`) has the blob files of exactly as many
/// experts as it holds.
fn files_match(f: &Fleet, man: &Manifest, show: &Value) -> bool {
    show["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .all(|n| Some(blob_files(f, man, n["id"].as_str().unwrap()) as u64) == n["count"].as_u64())
}

/// How many of the manifest's expert blobs node `id`'s bundle directory holds.
fn blob_files(f: &Fleet, man: &Manifest, id: &str) -> usize {
    man.experts
        .iter()
        .filter(|e| f.bundle(id).join(&e.part.file).exists())
        .count()
}

/// `0-5,9` → 0, 1, ..., 5, 9 (the admin API's expert specs).
fn ranges(s: &str) -> Vec<usize> {
    s.split(',')
        .flat_map(|p| {
            let (a, b) = p.split_once('-').unwrap_or((p, p));
            a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap()
        })
        .collect()
}

fn p99(mut v: Vec<f64>) -> f64 {
    assert!(!v.is_empty(), "no inter-token gaps measured");
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1]
}

#[test]
fn rebalancing_onto_two_new_nodes_under_load_fails_no_request() {
    let bundle = tiny_moe_bundle("moves-qwen3moe");
    let man = Manifest::read(&bundle).unwrap();
    let mut f = Fleet::new(&bundle, &["n1", "n2"], &["n3", "n4"]);
    let certs = f.certs();
    let first = f.spawn("n1", &["--init-cluster"]);
    f.spawn("n2", &["--join", &first]);
    f.wait_log("n1", "control: node n2 is up", 30);

    let single = Server::start(&bundle, &[], "moves-single");
    let coord = Server::start(&bundle, &f.seat(&first), "moves-coordinator");
    let admin = coord.line["admin"].as_str().expect("admin").to_string();

    let bodies: Vec<Value> = (0..4)
        .map(|i| request(&format!("Story number {i}:"), 40, 100 + i))
        .collect();
    let want: Vec<(Vec<String>, Vec<u32>)> =
        bodies.iter().map(|b| completion(&single.url, b)).collect();
    drop(single);

    let stop = AtomicBool::new(false);
    let (results, window, (applied, settled)) = std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        let clients: Vec<_> = (0..2)
            .map(|c| {
                let (url, bodies, want, stop) = (&coord.url, &bodies, &want, &stop);
                s.spawn(move || {
                    // (gap end instant, gap seconds) for every inter-token gap; failures.
                    let (mut gaps, mut failed, mut done) = (Vec::new(), Vec::new(), 0usize);
                    let mut k = c;
                    let t0 = Instant::now();
                    while !stop.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(300) {
                        let i = k % bodies.len();
                        match stream(url, &bodies[i]) {
                            Ok((toks, lps, at)) => {
                                if (toks, lps) != want[i] {
                                    failed.push(format!("request {i}: output differs"));
                                }
                                for w in at.windows(2) {
                                    gaps.push((w[1], (w[1] - w[0]).as_secs_f64()));
                                }
                            }
                            Err(e) => failed.push(e),
                        }
                        done += 1;
                        k += 1;
                    }
                    (gaps, failed, done)
                })
            })
            .collect();
        // Steady state on two nodes.
        std::thread::sleep(Duration::from_secs(8));
        f.spawn("n3", &["--join", &first]);
        f.spawn("n4", &["--join", &first]);
        for id in ["n1", "n2", "n3", "n4"] {
            wait_node_status(&admin, &certs, id, "up", 30);
        }
        // Two more seconds of steady state (the new nodes hold nothing, so nothing changes
        // for the requests).
        std::thread::sleep(Duration::from_secs(2));
        let t_apply = Instant::now();
        let applied = ctl_json(&admin, &certs, &["placement", "apply", "--timeout", "120"]);
        let t_done = Instant::now();
        let settled = ctl_json(&admin, &certs, &["placement", "plan", "--no-colocate"]);
        // The sources drop their copies after a grace: keep loading through it.
        std::thread::sleep(Duration::from_secs(7));
        // Decommission a node under the same load (not the leader: a leader does not take
        // itself out of the group).
        let st = ctl_json(&admin, &certs, &["status"]);
        let victim = ["n2", "n3", "n4"]
            .into_iter()
            .find(|v| st["leader"] != *v)
            .unwrap()
            .to_string();
        let t = Instant::now();
        let gone = ctl_json(&admin, &certs, &["node", "decommission", &victim]);
        eprintln!(
            "decommissioned {victim} in {:.2} s: {} moves off it",
            t.elapsed().as_secs_f64(),
            gone["moves"].as_array().map_or(0, Vec::len)
        );
        assert_eq!(gone["status"], "removed", "{gone}");
        let off = gone["moves"].as_array().map_or(0, Vec::len);
        // Out of the Raft group too (the leader removes members the state no longer names).
        let t = Instant::now();
        loop {
            let st = ctl_json(&admin, &certs, &["status"]);
            let members = st["members"].as_array().unwrap();
            let voters = members.iter().filter(|m| m["role"] == "voter").count();
            if voters == 3 && !members.iter().any(|m| m["id"] == victim.as_str()) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "{st}");
            std::thread::sleep(Duration::from_millis(250));
        }
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::SeqCst);
        let results: Vec<_> = clients
            .into_iter()
            .map(|c| c.join().expect("client"))
            .collect();
        (results, (t_apply, t_done, off), (applied, settled))
    });
    let (t_apply, t_done, off) = window;
    let mut steady = Vec::new();
    let mut moving = Vec::new();
    let mut failed = Vec::new();
    let mut done = 0;
    for (gaps, f, d) in results {
        failed.extend(f);
        done += d;
        for (at, g) in gaps {
            if at < t_apply {
                steady.push(g);
            } else if at <= t_done + Duration::from_secs(7) {
                moving.push(g);
            }
        }
    }
    let started = applied["started"].as_array().expect("started").len();
    let plan = &applied["plan"];
    let after = &applied["after"];
    eprintln!(
        "placement apply: {started} moves in {:.2} s; max/mean load {:.3} -> {:.3} (planned {:.3}); {} requests, {} gaps steady, {} during the moves",
        applied["seconds"].as_f64().unwrap(),
        plan["imbalance_before"].as_f64().unwrap(),
        after["imbalance_before"].as_f64().unwrap(),
        plan["imbalance_after"].as_f64().unwrap(),
        done,
        steady.len(),
        moving.len()
    );
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(started >= 4, "{applied}");
    let (ps, pm) = (p99(steady), p99(moving));
    eprintln!(
        "p99 inter-token latency: steady {:.2} ms, during the moves {:.2} ms ({:.2}x)",
        ps * 1e3,
        pm * 1e3,
        pm / ps
    );
    assert!(
        pm <= 2.0 * ps,
        "p99 ITL {pm} s during the moves, {ps} s steady"
    );
    // Balanced within 25 % of the mean, routing-weighted, and nothing left to move.
    for n in after["nodes"].as_array().unwrap() {
        let mean = 1.0 / 4.0;
        let before = n["before"].as_f64().unwrap();
        assert!(
            (before - mean).abs() <= 0.25 * mean + 1e-9,
            "node {} carries {before:.3} of the load: {after}",
            n["id"]
        );
    }
    // Balance is settled: planned again without co-location (whose samples keep changing
    // with the traffic), nothing moves.
    assert_eq!(settled["moves"].as_array().unwrap().len(), 0, "{settled}");
    eprintln!(
        "co-location: round trips per token and layer {:.3} -> {:.3} planned ({} moves), {:.3} on the tokens routed since",
        plan["round_trips_before"].as_f64().unwrap(),
        plan["round_trips_after"].as_f64().unwrap(),
        plan["colocation_moves"],
        after["round_trips_before"].as_f64().unwrap(),
    );
    // Every blob on the new nodes is the manifest's; every copy was logged verified; the
    // sources deleted what they gave away.
    let show = ctl_json(&admin, &certs, &["placement", "show"]);
    assert_eq!(show["moves"], serde_json::json!([]), "{show}");
    assert_eq!(show["nodes"].as_array().unwrap().len(), 3, "{show}");
    // Every member's applied index and lag (a node's from its heartbeats).
    let st = ctl_json(&admin, &certs, &["status"]);
    for m in st["members"].as_array().unwrap() {
        let (applied, lag) = (m["applied"].as_u64().unwrap(), m["lag"].as_u64().unwrap());
        assert!(applied > 0 && lag < 50, "{m}");
    }
    let mut copied = 0;
    for id in ["n1", "n2", "n3", "n4"] {
        copied += f.log(id).matches("sha256 verified").count();
        for e in &man.experts {
            let path = f.bundle(id).join(&e.part.file);
            if path.exists() {
                Manifest::verify_part(&f.bundle(id), &e.part)
                    .unwrap_or_else(|err| panic!("{id}: {err}"));
            }
        }
    }
    assert_eq!(
        copied,
        started + off,
        "every move (the rebalancing's, the decommission's) copied and verified once"
    );
    // Every expert on two nodes at least after the decommission (a hot one on three).
    let mut holders = std::collections::BTreeMap::<String, usize>::new();
    for n in show["nodes"].as_array().unwrap() {
        for spec in n["experts"].as_array().unwrap() {
            let (layers, experts) = spec.as_str().unwrap().split_once(':').unwrap();
            for l in ranges(layers) {
                for e in ranges(experts) {
                    *holders.entry(format!("{l}:{e}")).or_default() += 1;
                }
            }
        }
    }
    assert_eq!(holders.len(), man.experts.len(), "{show}");
    assert!(holders.values().all(|&c| c >= 2), "{holders:?}");
    // Each node has the blob files of exactly the experts it holds.
    for n in show["nodes"].as_array().unwrap() {
        let id = n["id"].as_str().unwrap();
        let files = blob_files(&f, &man, id);
        assert_eq!(
            files as u64,
            n["count"].as_u64().unwrap(),
            "{id}: blob files against experts held: {show}"
        );
    }
    drop(coord);
    drop(f.procs);
}

/// A node SIGKILLed in the middle of copying a blob: restarted, it resumes the partial file
/// where it ends, its moves finish, every blob verifies, and a client streaming throughout
/// sees no failed request.
#[test]
fn a_node_killed_mid_copy_resumes_its_partial_blob_after_restart() {
    let bundle = tiny_moe_bundle("moves-kill-qwen3moe");
    let man = Manifest::read(&bundle).unwrap();
    let mut f = Fleet::new(&bundle, &["n1", "n2"], &["n3"]);
    let certs = f.certs();
    let first = f.spawn("n1", &["--init-cluster"]);
    f.spawn("n2", &["--join", &first]);
    f.wait_log("n1", "control: node n2 is up", 30);
    let single = Server::start(&bundle, &[], "moves-kill-single");
    let coord = Server::start(&bundle, &f.seat(&first), "moves-kill-coordinator");
    let admin = coord.line["admin"].as_str().expect("admin").to_string();
    let body = request("Once upon a time", 24, 7);
    let want = completion(&single.url, &body);
    drop(single);
    // n3 copies slowly, in 16 KiB requests: a blob takes several.
    f.rate = "96KiB";
    let n3 = ["--join", &first, "--move-chunk", "16KiB"];
    let n3_addr = f.spawn("n3", &n3);
    f.wait_log("n1", "control: node n3 is up", 30);

    let stop = AtomicBool::new(false);
    let (failed, done) = std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        let client = s.spawn(|| {
            let (mut failed, mut done) = (Vec::new(), 0usize);
            let t0 = Instant::now();
            while !stop.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(300) {
                match stream(&coord.url, &body) {
                    Ok((t, l, _)) if (t.clone(), l.clone()) == want => {}
                    Ok(_) => failed.push("output differs".to_string()),
                    Err(e) => failed.push(e),
                }
                done += 1;
            }
            (failed, done)
        });
        let r = ctl_json(&admin, &certs, &["placement", "apply", "--no-wait"]);
        let started = r["started"].as_array().unwrap().len();
        assert!(started > 0, "{r}");
        // Kill n3 once a blob is partly copied.
        let dir = f.bundle("n3");
        let t = Instant::now();
        let partial = loop {
            let found = man.experts.iter().find_map(|e| {
                let p = PathBuf::from(format!("{}.partial", dir.join(&e.part.file).display()));
                std::fs::metadata(&p)
                    .is_ok_and(|m| m.len() > 0)
                    .then_some(p)
            });
            if let Some(p) = found {
                break p;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no partial copy in {dir:?}: {r}\n{}",
                f.log("n3")
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        if let Some(mut p) = f.procs.remove("n3") {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
        let cut = std::fs::metadata(&partial).map_or(0, |m| m.len());
        eprintln!("n3 killed with {} at {cut} bytes", partial.display());
        // Restarted where it was (its peers know that address).
        f.spawn_at("n3", &n3_addr, &n3);
        let t = Instant::now();
        loop {
            let show = ctl_json(&admin, &certs, &["placement", "show"]);
            if show["moves"].as_array().is_some_and(Vec::is_empty) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(120), "{show}");
            std::thread::sleep(Duration::from_millis(250));
        }
        eprintln!(
            "{started} moves finished {:.1} s after n3's restart",
            t.elapsed().as_secs_f64()
        );
        // Load on through the sources' drop grace: wait until every node holds the files of
        // exactly what it serves (the sources pruned theirs).
        let t = Instant::now();
        while !files_match(&f, &man, &ctl_json(&admin, &certs, &["placement", "show"])) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the sources never pruned"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        stop.store(true, Ordering::SeqCst);
        client.join().expect("client")
    });
    assert!(failed.is_empty(), "{done} requests, failed: {failed:?}");
    assert!(done > 0);
    let log = f.log("n3");
    assert!(log.contains("moves: resuming layer"), "{log}");
    let show = ctl_json(&admin, &certs, &["placement", "show"]);
    assert!(files_match(&f, &man, &show), "{show}");
    for id in ["n1", "n2", "n3"] {
        for e in &man.experts {
            if f.bundle(id).join(&e.part.file).exists() {
                Manifest::verify_part(&f.bundle(id), &e.part)
                    .unwrap_or_else(|err| panic!("{id}: {err}"));
            }
        }
    }
    let n3 = show["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == "n3")
        .unwrap();
    assert!(n3["count"].as_u64().unwrap() > 0, "{show}");
    drop(coord);
}
