//! The control plane across processes: three `ternfleet node` processes on loopback (port 0,
//! addresses from their start-up lines, every child killed by pid on every exit path) form a
//! Raft group over their QUIC endpoints — the first with `--init-cluster` (seeding the
//! placement from the cluster file), the others with `--join` — and:
//!
//! - a member's certificate cannot join another id into the group nor speak Raft for another
//!   member, a non-coordinator cannot call experts, garbage on a Raft stream is dropped;
//! - every node heartbeats; a SIGKILLed follower is marked down by the leader within 5 s of
//!   silence and up again when it returns;
//! - SIGKILL the leader: the other two elect a new one within the goal (< 5 s), measured;
//! - the killed node restarts from its Raft store (no flags) and rejoins as a voter;
//! - SIGKILL every node and restart them all: the same members and the same committed
//!   placement version come back (nothing acknowledged lost).
//!
//! The nodes' membership is read from their log lines ("control: membership ...", written on
//! every change of leader, term or members).

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ternfleet_shared::bundle::Manifest;
use ternfleet_shared::cluster::ClusterFile;
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::mtls;
use ternfleet_shared::wire::Frame;

struct Group {
    /// The network namespace each node runs in (`None`: this one).
    netns: Vec<Option<String>>,
    /// The `ternfleet` each node runs (this build's, or a previous release's).
    bins: Vec<PathBuf>,
    dir: tempfile::TempDir,
    bundle: PathBuf,
    ids: Vec<String>,
    addrs: Vec<String>,
    procs: Vec<Option<Proc>>,
    logs: Vec<PathBuf>,
    /// Each node's metrics address, from its start-up line (empty: none).
    metrics: Vec<String>,
}

/// What a node's latest "control: membership" line says.
#[derive(Debug, Clone, PartialEq)]
struct View {
    term: u64,
    leader: String,
    voters: Vec<String>,
    placement_version: u64,
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..].split(' ').next()
}

impl Group {
    fn new(bundle: &Path) -> Group {
        Group::sized(bundle, 3)
    }

    /// `n` nodes, n1 … nN.
    fn sized(bundle: &Path, n: usize) -> Group {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        mtls::init_ca(&certs).unwrap();
        let ids: Vec<String> = (1..=n).map(|i| format!("n{i}")).collect();
        for id in &ids {
            mtls::issue(&certs, id).unwrap();
        }
        let man = Manifest::read(bundle).unwrap();
        // Placeholder addresses: each node registers the address it bound.
        let list: Vec<(String, String)> = ids
            .iter()
            .map(|i| (i.clone(), "127.0.0.1:1".to_string()))
            .collect();
        let mut plan = ClusterFile::plan(&man, &list, 2).unwrap();
        // Two coordinators may serve from the control plane's placement at once.
        plan.coordinators = vec!["coordinator".into(), "c2".into()];
        std::fs::write(dir.path().join("cluster.toml"), plan.to_toml()).unwrap();
        let logs = ids
            .iter()
            .map(|id| dir.path().join(format!("{id}.log")))
            .collect();
        Group {
            netns: vec![None; n],
            bins: vec![PathBuf::from(bin()); n],
            dir,
            bundle: bundle.to_owned(),
            addrs: vec![String::new(); n],
            procs: (0..n).map(|_| None).collect(),
            metrics: vec![String::new(); n],
            ids,
            logs,
        }
    }

    fn spawn(&mut self, i: usize, listen: &str, extra: &[&str]) {
        let mut cmd = match &self.netns[i] {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.bins[i]);
                c
            }
            None => Command::new(&self.bins[i]),
        };
        let child = cmd
            .args(["node", "-m"])
            .arg(&self.bundle)
            .args(["--id", &self.ids[i], "--certs"])
            .arg(self.dir.path().join("certs"))
            .arg("--cluster")
            .arg(self.dir.path().join("cluster.toml"))
            .args(["--listen", listen, "-t", "1", "--state-dir"])
            .arg(self.dir.path().join("state"))
            .args(extra)
            .env("RUST_LOG", "info,raft=warn")
            .stdout(Stdio::piped())
            .stderr(append_to(&self.logs[i]))
            .spawn()
            .expect("spawning ternfleet node");
        let mut p = Proc(child);
        let v = startup_line(&mut p.0, 30);
        let addr = v["quic"].as_str().expect("quic address").to_string();
        if !self.addrs[i].is_empty() {
            assert_eq!(addr, self.addrs[i], "restarted on its old address");
        }
        self.addrs[i] = addr;
        self.metrics[i] = v["metrics"].as_str().unwrap_or_default().to_string();
        self.procs[i] = Some(p);
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.procs[i].take() {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
    }

    /// Node `i`'s latest membership line written after byte `from` of its log.
    fn view(&self, i: usize, from: usize) -> Option<View> {
        let text = std::fs::read_to_string(&self.logs[i]).unwrap_or_default();
        let line = text
            .get(from.min(text.len())..)?
            .lines()
            .rev()
            .map(strip_ansi)
            .find(|l| l.contains("control: membership"))?;
        let mut voters: Vec<String> = field(&line, "voters")?
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        voters.sort();
        Some(View {
            term: field(&line, "term")?.parse().ok()?,
            leader: field(&line, "leader")?.to_string(),
            voters,
            placement_version: field(&line, "placement_version")?.parse().ok()?,
        })
    }

    /// The highest placement version node `i` logged after byte `from`.
    fn max_version(&self, i: usize, from: usize) -> u64 {
        let text = std::fs::read_to_string(&self.logs[i]).unwrap_or_default();
        text.get(from.min(text.len())..)
            .unwrap_or("")
            .lines()
            .map(strip_ansi)
            .filter_map(|l| field(&l, "placement_version")?.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
    }

    /// Waits until node `i` logs `needle` after byte `from`; how long it took.
    fn wait_log(&self, i: usize, from: usize, needle: &str, secs: u64) -> Duration {
        let t0 = Instant::now();
        loop {
            let text = std::fs::read_to_string(&self.logs[i]).unwrap_or_default();
            if strip_ansi(text.get(from.min(text.len())..).unwrap_or("")).contains(needle) {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "node {} did not log {needle:?} within {secs} s:\n{}",
                self.ids[i],
                strip_ansi(&text)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_len(&self, i: usize) -> usize {
        std::fs::metadata(&self.logs[i]).map_or(0, |m| m.len() as usize)
    }

    /// Waits until every running node in `nodes` reports the same leader (not `not`) over
    /// all three voters; returns that view and how long it took.
    fn agree(
        &self,
        nodes: &[usize],
        not: Option<&str>,
        from: &[usize],
        secs: u64,
    ) -> (View, Duration) {
        let t0 = Instant::now();
        loop {
            let views: Vec<Option<View>> = nodes.iter().map(|&i| self.view(i, from[i])).collect();
            if let Some(Some(v)) = views.first() {
                let all = views.iter().all(|w| {
                    w.as_ref()
                        .is_some_and(|w| w.leader == v.leader && w.voters == self.ids)
                });
                if all && v.leader != "none" && Some(v.leader.as_str()) != not {
                    return (v.clone(), t0.elapsed());
                }
            }
            if t0.elapsed() > Duration::from_secs(secs) {
                let logs: Vec<String> = nodes
                    .iter()
                    .map(|&i| std::fs::read_to_string(&self.logs[i]).unwrap_or_default())
                    .map(|t| strip_ansi(&t))
                    .collect();
                panic!(
                    "no agreement within {secs} s: {views:?}\n{}",
                    logs.join("\n----\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn index_of(&self, id: &str) -> usize {
        self.ids.iter().position(|i| i == id).expect("a member id")
    }
}

/// As member n2, asks `addr` (member `name`) to add n9, sends a data-plane Hello, a Raft frame
/// claiming to come from n3 and garbage on Raft streams: the two answers. The connection stays
/// open until the member's log (`log`) shows the forged frame refused (at most 10 s).
fn door(certs: &Path, addr: &str, name: &str, log: &Path) -> Vec<Result<Frame, String>> {
    let n2 = mtls::Identity::load(certs, "n2").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = ep
            .connect_with(n2.client_config().unwrap(), addr.parse().unwrap(), name)
            .unwrap();
        let conn = tokio::time::timeout(Duration::from_secs(5), conn)
            .await
            .expect("handshake in 5 s")
            .expect("n2's certificate is a member's");
        let ask = |f: Frame| {
            let conn = conn.clone();
            async move {
                let r = async {
                    let (mut s, mut r) = conn.open_bi().await.map_err(|e| e.to_string())?;
                    s.write_all(&f.encode().unwrap())
                        .await
                        .map_err(|e| e.to_string())?;
                    s.finish().map_err(|e| e.to_string())?;
                    let b = r.read_to_end(1 << 20).await.map_err(|e| e.to_string())?;
                    Frame::decode(&b).map_err(|e| e.to_string())
                };
                tokio::time::timeout(Duration::from_secs(5), r)
                    .await
                    .unwrap_or(Err("no answer in 5 s".into()))
            }
        };
        let join = ask(Frame::Join {
            id: "n9".into(),
            addr: "127.0.0.1:9".into(),
        })
        .await;
        let hello = ask(Frame::Hello { id: "n2".into() }).await;
        let forged_hello = ask(Frame::Hello { id: "n3".into() }).await;
        let forged = Frame::Raft {
            from: "n3".into(),
            to: 1,
            msg: vec![8, 1, 16, 2],
        }
        .encode()
        .unwrap();
        for bytes in [forged, b"TF\x01\x07garbage".to_vec(), vec![0xff; 64]] {
            let mut s = conn.open_uni().await.unwrap();
            s.write_all(&bytes).await.unwrap();
            s.finish().unwrap();
        }
        let t0 = Instant::now();
        loop {
            let text = strip_ansi(&std::fs::read_to_string(log).unwrap_or_default());
            if text.contains("Raft frame from \"n3\"") {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the forged Raft frame was not refused within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        conn.close(0u32.into(), b"done");
        vec![join, hello, forged_hello]
    })
}

#[test]
fn three_voters_survive_leader_sigkill_and_a_full_restart() {
    let bundle = tiny_moe_bundle("control-qwen3moe");
    let mut g = Group::new(&bundle);
    g.spawn(0, "127.0.0.1:0", &["--init-cluster"]);
    let first = g.addrs[0].clone();
    g.spawn(1, "127.0.0.1:0", &["--join", &first]);
    // The third joins through a follower (once n2 is one), which points it to the leader.
    g.wait_log(1, 0, "added this member to the cluster", 15);
    let second = g.addrs[1].clone();
    g.spawn(2, "127.0.0.1:0", &["--join", &second]);
    let (v, formed) = g.agree(&[0, 1, 2], None, &[0, 0, 0], 30);
    eprintln!("group formed in {formed:?}: {v:?}");
    assert_eq!(v.leader, "n1", "the --init-cluster node leads first");
    assert!(v.placement_version >= 4, "seed + 3 registrations: {v:?}");

    // The control plane's door: a member's valid certificate cannot speak for another
    // member, and garbage on a Raft stream harms nothing.
    let l = g.index_of(&v.leader);
    let answers = door(
        &g.dir.path().join("certs"),
        &g.addrs[l],
        &v.leader,
        &g.logs[l],
    );
    match &answers[0] {
        Ok(Frame::Joined {
            accepted: false,
            message,
            ..
        }) => assert!(message.contains("\"n9\""), "{message}"),
        other => panic!("a join for another id was not refused: {other:?}"),
    }
    // A member asking the node's state in its own name (the healthcheck) is answered; in
    // another's name, refused.
    match &answers[1] {
        Ok(Frame::Status { id, .. }) => assert_eq!(id, &g.ids[l], "{:?}", answers[1]),
        other => panic!("a member's Hello was not answered with the node's status: {other:?}"),
    }
    match &answers[2] {
        Ok(Frame::Error { class, message }) => {
            assert_eq!(*class, ErrorClass::Unauthenticated);
            assert!(message.contains("\"n3\""), "{message}");
        }
        other => panic!("a Hello in another member's name was not refused: {other:?}"),
    }
    let (same, _) = g.agree(&[0, 1, 2], None, &[0, 0, 0], 10);
    assert_eq!(
        (same.leader.as_str(), same.term),
        (v.leader.as_str(), v.term)
    );

    // Liveness: every node heartbeats; a killed follower is marked down by the leader within
    // the heartbeat timeout (5 s), and up again when it returns.
    for id in ["n1", "n2", "n3"] {
        g.wait_log(l, 0, &format!("control: node {id} is up"), 10);
    }
    let f = (0..3).find(|&i| i != l).unwrap();
    let mark = g.log_len(l);
    g.kill(f);
    let down = g.wait_log(l, mark, &format!("control: node {} is down", g.ids[f]), 15);
    eprintln!("follower {} killed: marked down after {down:?}", g.ids[f]);
    let addr = g.addrs[f].clone();
    let mark = g.log_len(l);
    g.spawn(f, &addr, &[]);
    g.wait_log(l, mark, &format!("control: node {} is up", g.ids[f]), 15);
    let (v, _) = g.agree(&[0, 1, 2], None, &[0, 0, 0], 10);
    let l = g.index_of(&v.leader);

    // SIGKILL the leader: a new one within the goal.
    let before: u64 = (0..3).map(|i| g.max_version(i, 0)).max().unwrap();
    let others: Vec<usize> = (0..3).filter(|&i| i != l).collect();
    let marks: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    let t0 = Instant::now();
    g.kill(l);
    let (v2, _) = g.agree(&others, Some(&v.leader), &marks, 10);
    let failover = t0.elapsed();
    eprintln!(
        "leader {} killed: {} leads term {} after {failover:?}",
        v.leader, v2.leader, v2.term
    );
    assert!(
        failover < Duration::from_secs(5),
        "new leader after {failover:?}"
    );
    assert!(v2.term > v.term);
    assert!(
        v2.placement_version >= before,
        "the new leader's placement is older: {} < {before}",
        v2.placement_version
    );

    // The killed node restarts from its store alone and rejoins.
    let addr = g.addrs[l].clone();
    // The others write no new line (nothing changes for them): read their latest.
    let mut marks = vec![0; 3];
    marks[l] = g.log_len(l);
    g.spawn(l, &addr, &[]);
    let (v3, _) = g.agree(&[0, 1, 2], None, &marks, 15);
    assert_eq!(
        v3.leader, v2.leader,
        "a returning member does not disrupt the leader"
    );

    // SIGKILL everyone, restart everyone: the committed state comes back (placement version
    // never behind what was committed before).
    let before: u64 = (0..3).map(|i| g.max_version(i, 0)).max().unwrap();
    for i in 0..3 {
        g.kill(i);
    }
    let marks: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    for i in 0..3 {
        let addr = g.addrs[i].clone();
        g.spawn(i, &addr, &[]);
    }
    let (v4, back) = g.agree(&[0, 1, 2], None, &marks, 20);
    eprintln!(
        "all killed and restarted: {} leads term {} after {back:?}",
        v4.leader, v4.term
    );
    assert!(v4.term > v3.term);
    let t0 = Instant::now();
    while (0..3).any(|i| g.max_version(i, marks[i]) < before) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "restarted with older placement versions: {:?} < {before}",
            (0..3)
                .map(|i| g.max_version(i, marks[i]))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A coordinator with a seat (`serve --join`): a learner (the voters stay the three nodes)
/// that serves the single process's tokens from the committed placement (and a second one
/// beside it, from the same placement), through a SIGKILL
/// of the Raft leader mid-stream (no failed request), follows the placement the leader
/// changes (the dead node marked down), and restarted after a SIGKILL serves again within
/// the goal (10 s) from the committed placement.
#[test]
fn a_seated_coordinator_serves_through_a_leader_sigkill_and_restarts_within_10s() {
    let bundle = tiny_moe_bundle("control-seat-qwen3moe");
    let mut g = Group::new(&bundle);
    let certs = g.dir.path().join("certs");
    mtls::issue(&certs, "coordinator").unwrap();
    form(&mut g);
    let first = g.addrs[0].clone();

    let single = Server::start(&bundle, &[], "seat-single");
    let mut args = seat_args(&g, &first);
    args.extend(["--grpc".to_string(), "127.0.0.1:0".to_string()]);
    let t = Instant::now();
    let coord = Server::start(&bundle, &args, "seat-coordinator");
    eprintln!("coordinator joined and ready in {:?}", t.elapsed());
    assert!(coord
        .log_text()
        .contains("cluster: the committed placement arrived"));
    let prompts = ["The capital of France is", "def fibonacci(n):"];
    for (i, p) in prompts.iter().enumerate() {
        let body = request(p, 12, i as u64);
        assert_eq!(
            completion(&coord.url, &body),
            completion(&single.url, &body),
            "{p:?}: seated coordinator vs one process"
        );
    }
    // A second coordinator, joining through another node, serves beside the first from the
    // same placement.
    mtls::issue(&certs, "c2").unwrap();
    let mut args2 = seat_args(&g, &g.addrs[1]);
    args2.extend(["--id".to_string(), "c2".to_string()]);
    let c2 = Server::start(&bundle, &args2, "seat-coordinator-2");
    let body = request(prompts[1], 12, 5);
    let want = completion(&single.url, &body);
    assert_eq!(completion(&coord.url, &body), want, "first coordinator");
    assert_eq!(completion(&c2.url, &body), want, "second coordinator");
    drop(c2);
    // Learners: the voters are still the three nodes (agree() checks them).
    let (v, _) = g.agree(&[0, 1, 2], None, &[0, 0, 0], 10);
    let l = g.index_of(&v.leader);
    g.wait_log(l, 0, "control: coordinator joined as a learner", 5);
    g.wait_log(l, 0, "control: c2 joined as a learner", 5);

    // SIGKILL the Raft leader (a node holding experts) mid-stream: same tokens, no error.
    let body = request("Explain photosynthesis in simple terms:", 160, 7);
    let reference = completion(&single.url, &body);
    let others: Vec<usize> = (0..3).filter(|&i| i != l).collect();
    let marks: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    let routed = coord.log_count("cluster: routing with placement version");
    let (toks, lps, gap) = stream_with_fault(&coord.url, &body, 4, || g.kill(l));
    assert_eq!((toks, lps), reference, "output after SIGKILL of the leader");
    eprintln!("leader {} killed mid-stream: longest gap {gap:?}", v.leader);
    let (v2, _) = g.agree(&others, Some(&v.leader), &marks, 10);
    // The new leader marks the dead node down; the coordinator routes with that version.
    g.wait_log(
        g.index_of(&v2.leader),
        marks[g.index_of(&v2.leader)],
        &format!("control: node {} is down", v.leader),
        15,
    );
    wait_for_log(
        &coord,
        "cluster: routing with placement version",
        routed + 1,
        10,
    );

    // The dead node returns; then SIGKILL the coordinator and restart it: it serves again
    // from its store's committed placement within the goal.
    let addr = g.addrs[l].clone();
    g.spawn(l, &addr, &[]);
    // A gRPC client's request in flight when the coordinator is SIGKILLed fails with
    // UNAVAILABLE (the connection's end, as the client's transport reports it).
    let code = grpc_stream_cut_by(&coord, || signal(&coord.proc.0, libc::SIGKILL));
    assert_eq!(code, "UNAVAILABLE", "an in-flight gRPC request");
    drop(coord);
    let t = Instant::now();
    let coord = Server::start(&bundle, &args, "seat-coordinator-restarted");
    let back = t.elapsed();
    eprintln!("coordinator restarted: ready after {back:?} (goal < 10 s)");
    assert!(back < Duration::from_secs(10), "ready after {back:?}");
    let body = request(prompts[0], 12, 0);
    assert_eq!(
        completion(&coord.url, &body),
        completion(&single.url, &body)
    );
}

/// A coordinator seated while the other nodes are still to join holds the placement the first
/// voter seeded, with those nodes at their cluster-file addresses (nothing listens there); it
/// takes their bound addresses from the versions their registrations commit while it waits
/// for its experts, and serves what one process serves. (It used to probe the seeded
/// addresses until its load timeout, 10 minutes.)
#[test]
fn a_coordinator_seated_before_the_nodes_join_routes_to_them_once_they_register() {
    let bundle = tiny_moe_bundle("control-early-qwen3moe");
    let mut g = Group::new(&bundle);
    let certs = g.dir.path().join("certs");
    mtls::issue(&certs, "coordinator").unwrap();
    g.spawn(0, "127.0.0.1:0", &["--init-cluster"]);
    let first = g.addrs[0].clone();
    let args = seat_args(&g, &first);
    let log = log_dir().join("early-coordinator.log");
    let _ = std::fs::remove_file(&log);
    let coord = std::thread::scope(|s| {
        let g = &mut g;
        s.spawn(move || {
            let t = Instant::now();
            while !std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("cluster: the committed placement arrived")
            {
                assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "the coordinator did not get the seeded placement in 60 s"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            g.spawn(1, "127.0.0.1:0", &["--join", &first]);
            g.spawn(2, "127.0.0.1:0", &["--join", &first]);
        });
        Server::start(&bundle, &args, "early-coordinator")
    });
    let text = coord.log_text();
    let seeded = text
        .lines()
        .find(|l| l.contains("cluster: the committed placement arrived"))
        .and_then(|l| field(l, "placement_version"))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("the placement version the coordinator started from");
    // It routed with a placement newer than the seeded one before it was ready.
    let taken = text
        .lines()
        .filter(|l| l.contains("cluster: routing with placement version"))
        .filter_map(|l| field(l, "placement_version")?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    assert!(
        taken > seeded,
        "routed only with versions up to {taken}, seeded {seeded}:\n{text}"
    );
    let single = Server::start(&bundle, &[], "early-single");
    let body = request("The capital of France is", 12, 3);
    assert_eq!(
        completion(&coord.url, &body),
        completion(&single.url, &body),
        "early coordinator vs one process"
    );
}

/// Starts a long gRPC `Generate` stream on `coord` from Python's grpcio (the C-core client,
/// which maps a transport failure to UNAVAILABLE as the gRPC spec says; tonic reports a
/// connection dying mid-body as UNKNOWN), calls `cut` after its first message and returns the
/// status code name the call then ends with (bounded: 30 s).
fn grpc_stream_cut_by(coord: &Server, cut: impl FnOnce()) -> String {
    use prost::Message;
    use std::io::BufRead;
    use ternfleet_shared::proto::v1::generate_request::Input;
    use ternfleet_shared::proto::v1::GenerateRequest;
    const CLIENT: &str = r#"
import sys, grpc
addr, req = sys.argv[1], bytes.fromhex(sys.argv[2])
ch = grpc.insecure_channel(addr)
gen = ch.unary_stream("/ternfleet.v1.Inference/Generate",
                      request_serializer=lambda b: b, response_deserializer=lambda b: b)
n = 0
try:
    for m in gen(req, timeout=60):
        n += 1
        if n == 1:
            print("FIRST", flush=True)
    print("FINISHED", flush=True)
except grpc.RpcError as e:
    print("CODE", e.code().name, e.details(), flush=True)
"#;
    let req = GenerateRequest {
        input: Some(Input::Prompt("Tell me a long story:".into())),
        max_tokens: 2000,
        ignore_eos: true,
        ..Default::default()
    }
    .encode_to_vec();
    let hex: String = req.iter().map(|b| format!("{b:02x}")).collect();
    let addr = coord.line["grpc"]
        .as_str()
        .expect("grpc address")
        .to_string();
    let mut child = Proc(
        Command::new("python3")
            .args(["-c", CLIENT, &addr, &hex])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 with grpcio"),
    );
    let out = child.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let limit = Duration::from_secs(30);
    let first = rx.recv_timeout(limit).expect("a first message within 30 s");
    assert_eq!(first, "FIRST", "{first}");
    cut();
    let end = rx
        .recv_timeout(limit)
        .expect("the call ends within 30 s of the cut");
    eprintln!("in-flight gRPC request (grpcio): {end}");
    end.split(' ').nth(1).unwrap_or(&end).to_string()
}

/// Seated coordinator `args` for group `g`, admin API on port 0.
fn seat_args(g: &Group, join: &str) -> Vec<String> {
    vec![
        "--join".into(),
        join.into(),
        "--certs".into(),
        g.dir.path().join("certs").display().to_string(),
        "--state-dir".into(),
        g.dir.path().join("state").display().to_string(),
        "--admin".into(),
        "127.0.0.1:0".into(),
    ]
}

/// Forms the three-node group of `g` (n1 --init-cluster, the others join it).
/// Only what the new processes log counts: a group formed again (a wiped store, a new
/// cluster) appends to the old logs, whose last lines name the old cluster's leader.
fn form(g: &mut Group) {
    let from: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    g.spawn(0, "127.0.0.1:0", &["--init-cluster"]);
    let first = g.addrs[0].clone();
    g.spawn(1, "127.0.0.1:0", &["--join", &first]);
    g.spawn(2, "127.0.0.1:0", &["--join", &first]);
    g.agree(&[0, 1, 2], None, &from, 30);
}

/// The operator's commands through `ternfleet ctl`: status (leader, voters, the learner
/// seat), node list; drain, recommission and decommission under a load of concurrent
/// requests (zero failed, every output the single process's); a drain that would leave
/// experts on no node refused with the reason, and one that would leave them only on a node
/// marked down; a non-operator certificate refused; snapshot
/// save, wipe every store, a new cluster, restore: the same placement.
#[test]
fn ctl_drains_and_recommissions_under_load_with_no_failed_request_and_restores_a_snapshot() {
    let bundle = tiny_moe_bundle("control-ctl-qwen3moe");
    let mut g = Group::new(&bundle);
    let certs = g.dir.path().join("certs");
    for id in ["coordinator", "operator"] {
        mtls::issue(&certs, id).unwrap();
    }
    form(&mut g);
    let single = Server::start(&bundle, &[], "ctl-single");
    let coord = Server::start(&bundle, &seat_args(&g, &g.addrs[0]), "ctl-coordinator");
    let admin = coord.line["admin"]
        .as_str()
        .expect("admin address")
        .to_string();

    let st = ctl_json(&admin, &certs, &["status"]);
    let members = st["members"].as_array().unwrap();
    let voters: Vec<&str> = members
        .iter()
        .filter(|m| m["role"] == "voter")
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(voters, ["n1", "n2", "n3"], "{st}");
    assert!(
        ["n1", "n2", "n3"].contains(&st["leader"].as_str().unwrap()),
        "{st}"
    );
    assert!(
        members
            .iter()
            .any(|m| m["id"] == "coordinator" && m["role"] == "learner" && m["state"] == "seat"),
        "{st}"
    );
    let (ok, table, _) = ctl(&admin, &certs, &["node", "list"]);
    assert!(
        ok && table.starts_with("ID") && table.contains("n3"),
        "{table}"
    );
    // Only the operator's certificate is taken.
    let (ok, _, err) = ctl(&admin, &certs, &["--id", "n1", "status"]);
    assert!(!ok && err.contains("PermissionDenied"), "{err}");

    // Load: three clients, requests of fixed seeds whose outputs are known.
    let bodies: Vec<serde_json::Value> = (0..6)
        .map(|i| request(&format!("Request number {i} says"), 24, i))
        .collect();
    let want: Vec<_> = bodies.iter().map(|b| completion(&single.url, b)).collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (done, failed) = std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        let clients: Vec<_> = (0..3)
            .map(|c| {
                let (url, bodies, want, stop) = (&coord.url, &bodies, &want, &stop);
                s.spawn(move || {
                    let (mut done, mut failed) = (0usize, Vec::new());
                    let mut k = c;
                    let t0 = Instant::now();
                    while !stop.load(std::sync::atomic::Ordering::SeqCst)
                        && t0.elapsed() < Duration::from_secs(120)
                    {
                        let i = k % bodies.len();
                        if let Some(why) = check_completion(url, &bodies[i], &want[i]) {
                            failed.push(format!("request {i}: {why}"));
                        }
                        done += 1;
                        k += 1;
                    }
                    (done, failed)
                })
            })
            .collect();
        let routed = |n| wait_for_log(&coord, "cluster: routing with placement version", n, 10);
        let count = || coord.log_count("cluster: routing with placement version");
        // Drain n2: refused for n1 afterwards (its experts' other copies are on n2). Every
        // node up first (one marked down while it joined would make the drain refuse).
        for id in ["n1", "n2", "n3"] {
            wait_node_status(&admin, &certs, id, "up", 20);
        }
        let n = count();
        let r = ctl_json(&admin, &certs, &["node", "drain", "n2"]);
        assert_eq!(r["status"], "draining", "{r}");
        routed(n + 1);
        let (ok, _, err) = ctl(&admin, &certs, &["node", "drain", "n1"]);
        assert!(
            !ok && err.contains("FailedPrecondition") && err.contains("place replicas elsewhere"),
            "{err}"
        );
        let p = ctl_json(&admin, &certs, &["placement", "show"]);
        assert_eq!(p["uncovered"], serde_json::json!([]), "{p}");
        std::thread::sleep(Duration::from_millis(500));
        let saved = g.dir.path().join("drained.snapshot");
        let (ok, out, err) = ctl(
            &admin,
            &certs,
            &["snapshot", "save", "-o", saved.to_str().unwrap()],
        );
        assert!(ok, "{err}");
        eprintln!("{}", out.trim());
        // Recommission: loading, then up (its heartbeat), routed again. The answer reads the
        // state after the command is applied, and n2's next heartbeat may be applied first.
        let from = g.log_len(0);
        let r = ctl_json(&admin, &certs, &["node", "recommission", "n2"]);
        assert!(r["status"] == "loading" || r["status"] == "up", "{r}");
        g.wait_log(0, from, "control: node n2 is up", 10);
        // Decommission n3 (n1 and n2 hold its experts' other copies), then bring it back.
        let r = ctl_json(&admin, &certs, &["node", "decommission", "n3", "--no-wait"]);
        assert_eq!(r["status"], "decommissioning", "{r}");
        std::thread::sleep(Duration::from_millis(500));
        ctl_json(&admin, &certs, &["node", "recommission", "n3"]);
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut done = 0;
        let mut failed = Vec::new();
        for c in clients {
            let (d, f) = c.join().expect("client");
            done += d;
            failed.extend(f);
        }
        (done, failed)
    });
    eprintln!("{done} requests during drain, recommission and decommission");
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(done >= 6, "the load did not run ({done} requests)");
    let before = ctl_json(&admin, &certs, &["placement", "show"]);
    // A plan from the rows the coordinator routed: within the tolerance (10 %) or better
    // balanced than now.
    let plan = ctl_json(&admin, &certs, &["placement", "plan"]);
    let (b, a) = (
        plan["imbalance_before"].as_f64().unwrap(),
        plan["imbalance_after"].as_f64().unwrap(),
    );
    assert!(plan["routed_rows"].as_u64().unwrap() > 0, "{plan}");
    assert!(a <= b.max(1.10) + 1e-9, "{plan}");
    // Co-location is planned from the tokens routed: every token calls at least one node.
    assert!(plan["sampled_tokens"].as_u64().unwrap() > 0, "{plan}");
    let (rb, ra) = (
        plan["round_trips_before"].as_f64().unwrap(),
        plan["round_trips_after"].as_f64().unwrap(),
    );
    assert!(rb >= 1.0 && ra >= 1.0, "{plan}");
    eprintln!(
        "placement plan on the observed routing: max/mean load {b:.3} -> {a:.3}, round trips per token and layer {rb:.3} -> {ra:.3} ({} co-location moves), {} moves, hot {}",
        plan["colocation_moves"],
        plan["moves"].as_array().unwrap().len(),
        plan["hot"]
    );

    // A follower SIGKILLed and marked down: draining a node that shares experts with it is
    // refused by the admin (the state machine would take it: a down node still counts as a
    // holder), naming the down node.
    let leader = ctl_json(&admin, &certs, &["status"])["leader"]
        .as_str()
        .unwrap()
        .to_string();
    let dead = (0..3).find(|&i| g.ids[i] != leader).unwrap();
    let other = (0..3).find(|&i| i != dead).unwrap();
    g.kill(dead);
    wait_node_status(&admin, &certs, &g.ids[dead], "down", 20);
    let (ok, _, err) = ctl(&admin, &certs, &["node", "drain", &g.ids[other]]);
    assert!(
        !ok && err.contains("FailedPrecondition")
            && err.contains(&format!("no live holder ({} marked down)", g.ids[dead])),
        "{err}"
    );

    // Snapshot save happened with n2 drained; wipe every store, start a new cluster (seeded
    // from the cluster file), restore: the saved placement is back.
    let saved = g.dir.path().join("drained.snapshot");
    let want_nodes = {
        let bytes = std::fs::read(&saved).unwrap();
        let s = ternfleet_control::ClusterState::from_snapshot_file(&bytes).unwrap();
        assert_eq!(
            s.nodes["n2"].status,
            ternfleet_control::NodeStatus::Draining
        );
        s.nodes
            .iter()
            .map(|(id, n)| (id.clone(), n.experts.clone()))
            .collect::<Vec<_>>()
    };
    drop(coord);
    for i in 0..3 {
        g.kill(i);
    }
    std::fs::remove_dir_all(g.dir.path().join("state")).unwrap();
    g.addrs = vec![String::new(); 3];
    form(&mut g);
    let coord = Server::start(&bundle, &seat_args(&g, &g.addrs[0]), "ctl-coordinator-new");
    let admin = coord.line["admin"].as_str().unwrap().to_string();
    let fresh = ctl_json(&admin, &certs, &["placement", "show"]);
    assert!(
        fresh["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["status"] != "draining"),
        "{fresh}"
    );
    let r = ctl_json(
        &admin,
        &certs,
        &["snapshot", "restore", saved.to_str().unwrap()],
    );
    // Versions never go back: past the new cluster's and the snapshot's.
    let restored = r["placement_version"].as_u64().unwrap();
    assert!(
        restored > fresh["placement_version"].as_u64().unwrap(),
        "{r} {fresh}"
    );
    assert!(
        restored > 7.min(before["placement_version"].as_u64().unwrap()),
        "{r}"
    );
    let after = ctl_json(&admin, &certs, &["placement", "show"]);
    let n2 = after["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == "n2")
        .unwrap()
        .clone();
    assert_eq!(n2["status"], "draining", "{after}");
    let got: Vec<(String, serde_json::Value)> = after["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["id"].as_str().unwrap().to_string(), n["experts"].clone()))
        .collect();
    let fresh_specs: Vec<(String, serde_json::Value)> = fresh["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["id"].as_str().unwrap().to_string(), n["experts"].clone()))
        .collect();
    assert_eq!(got.len(), want_nodes.len());
    assert_eq!(got, fresh_specs, "the same experts per node as the seed");
    // A damaged snapshot is refused before it is sent.
    let mut bad = std::fs::read(&saved).unwrap();
    let last = bad.len() - 2;
    bad[last] ^= 1;
    let badf = g.dir.path().join("bad.snapshot");
    std::fs::write(&badf, bad).unwrap();
    let (ok, _, err) = ctl(
        &admin,
        &certs,
        &["snapshot", "restore", badf.to_str().unwrap()],
    );
    assert!(!ok && err.contains("checksum"), "{err}");
    // The restored state routes: n2 drained, requests still the single process's.
    let body = request("The capital of France is", 12, 0);
    assert_eq!(
        completion(&coord.url, &body),
        completion(&single.url, &body)
    );
}

/// A rolling upgrade: three nodes of the previous release (scripts/build-previous.sh) and
/// this build's coordinator serve; each node in turn is stopped (SIGTERM) and started again
/// as this build, from its store, while a client streams requests: none fails, every output
/// the single process's; the group ends with three voters and a leader.
#[test]
fn nodes_of_the_previous_release_upgrade_one_by_one_under_load() {
    let prev = std::env::var_os("TERNFLEET_PREVIOUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/previous/ternfleet"));
    if !prev.exists() {
        ternfleet_shared::testing::skip(
            "the rolling-upgrade test",
            &format!(
                "no previous release at {} (scripts/build-previous.sh)",
                prev.display()
            ),
        );
        return;
    }
    let bundle = tiny_moe_bundle("control-upgrade-qwen3moe");
    let mut g = Group::new(&bundle);
    let certs = g.dir.path().join("certs");
    mtls::issue(&certs, "coordinator").unwrap();
    g.bins = vec![prev; 3];
    form(&mut g);
    let single = Server::start(&bundle, &[], "upgrade-single");
    let coord = Server::start(&bundle, &seat_args(&g, &g.addrs[0]), "upgrade-coordinator");
    mtls::issue(&certs, "operator").unwrap();
    let admin = coord.line["admin"].as_str().expect("admin").to_string();
    // Moves need every node at command level 2: refused while any runs the old release.
    let (ok, _, err) = ctl(&admin, &certs, &["placement", "apply", "--replicas", "3"]);
    assert!(!ok && err.contains("upgrade every node first"), "{err}");
    let bodies: Vec<serde_json::Value> = (0..3)
        .map(|i| request(&format!("Upgrade story {i}:"), 24, 40 + i))
        .collect();
    let want: Vec<_> = bodies.iter().map(|b| completion(&single.url, b)).collect();
    drop(single);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (done, failed) = std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        let client = s.spawn(|| {
            let (mut done, mut failed) = (0usize, Vec::new());
            let t0 = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::SeqCst)
                && t0.elapsed() < Duration::from_secs(240)
            {
                let i = done % bodies.len();
                if let Some(why) = check_completion(&coord.url, &bodies[i], &want[i]) {
                    failed.push(format!("request {i}: {why}"));
                }
                done += 1;
            }
            (done, failed)
        });
        std::thread::sleep(Duration::from_secs(2));
        for i in 0..3 {
            let marks: Vec<usize> = (0..3).map(|j| g.log_len(j)).collect();
            if let Some(p) = &g.procs[i] {
                signal(&p.0, libc::SIGTERM);
            }
            if let Some(mut p) = g.procs[i].take() {
                wait_bounded(&mut p.0, 20, "a node stopping on SIGTERM");
            }
            g.bins[i] = PathBuf::from(bin());
            let addr = g.addrs[i].clone();
            g.spawn(i, &addr, &[]);
            // Serving again, as this build, and a member of the group with the others.
            let t = Instant::now();
            g.wait_log(i, marks[i], "node: ready in", 30);
            let mut from = vec![0; 3];
            from[i] = marks[i];
            g.agree(&[0, 1, 2], None, &from, 30);
            eprintln!(
                "{} upgraded: serving and in the group after {:?}",
                g.ids[i],
                t.elapsed()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        client.join().expect("client")
    });
    eprintln!("{done} requests during the rolling upgrade");
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    assert!(done >= 3, "the load did not run");
    g.agree(&[0, 1, 2], None, &[0, 0, 0], 10);
    // Upgraded (each node registered again at its new level): moves are allowed, and done.
    let t = Instant::now();
    let applied = loop {
        let (ok, out, err) = ctl(
            &admin,
            &certs,
            &[
                "--json",
                "placement",
                "apply",
                "--replicas",
                "3",
                "--timeout",
                "60",
            ],
        );
        if ok {
            break serde_json::from_str::<serde_json::Value>(out.trim()).unwrap();
        }
        assert!(
            err.contains("upgrade every node first") && t.elapsed() < Duration::from_secs(15),
            "{err}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(
        !applied["started"].as_array().unwrap().is_empty(),
        "{applied}"
    );
    let show = ctl_json(&admin, &certs, &["placement", "show"]);
    let n_experts: u64 = show["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["count"].as_u64().unwrap())
        .sum();
    let (l, e) = (
        show["n_layer"].as_u64().unwrap(),
        show["n_expert"].as_u64().unwrap(),
    );
    assert_eq!(
        n_experts,
        3 * l * e,
        "three replicas of every expert: {show}"
    );
}

/// Five voters: the leader SIGKILLed, then the next one — a new leader each time among the
/// remaining majority; a third killed — the two left elect no leader; the three restarted
/// — a leader again, the committed placement version not behind.
#[test]
fn five_voters_lose_two_leaders_and_keep_going_then_stop_without_a_majority() {
    let bundle = tiny_moe_bundle("control-five-qwen3moe");
    let mut g = Group::sized(&bundle, 5);
    g.spawn(0, "127.0.0.1:0", &["--init-cluster"]);
    let first = g.addrs[0].clone();
    for i in 1..5 {
        g.spawn(i, "127.0.0.1:0", &["--join", &first]);
    }
    let all: Vec<usize> = (0..5).collect();
    let (v, formed) = g.agree(&all, None, &[0; 5], 30);
    eprintln!("five voters formed in {formed:?}: leader {}", v.leader);
    let mut alive = all.clone();
    let mut killed = Vec::new();
    let mut version = v.placement_version;
    let mut leader = v.leader;
    for round in 0..2 {
        let l = g.index_of(&leader);
        let marks: Vec<usize> = (0..5).map(|i| g.log_len(i)).collect();
        g.kill(l);
        killed.push(l);
        alive.retain(|&i| i != l);
        let (v, took) = g.agree(&alive, Some(&leader), &marks, 10);
        eprintln!(
            "round {round}: leader {leader} killed, {} leads after {took:?} ({} of 5 alive)",
            v.leader,
            alive.len()
        );
        assert!(took < Duration::from_secs(5), "new leader after {took:?}");
        assert!(v.placement_version >= version);
        version = v.placement_version;
        leader = v.leader;
    }
    // A third gone: two of five are no majority.
    let l = g.index_of(&leader);
    g.kill(l);
    killed.push(l);
    alive.retain(|&i| i != l);
    std::thread::sleep(Duration::from_secs(8));
    for &i in &alive {
        let v = g.view(i, 0).expect("a membership line");
        let ok = v.leader == "none" || killed.iter().any(|&k| g.ids[k] == v.leader);
        assert!(
            ok,
            "{} sees {} lead with two of five alive",
            g.ids[i], v.leader
        );
    }
    let max_before: Vec<u64> = alive.iter().map(|&i| g.max_version(i, 0)).collect();
    // Back: a leader again, nothing committed lost.
    let marks: Vec<usize> = (0..5).map(|i| g.log_len(i)).collect();
    for &k in &killed {
        let addr = g.addrs[k].clone();
        g.spawn(k, &addr, &[]);
    }
    let (v, took) = g.agree(&all, None, &marks, 20);
    eprintln!("three restarted: {} leads after {took:?}", v.leader);
    assert!(v.placement_version >= version, "{v:?} < {version}");
    assert!(max_before.iter().all(|&m| v.placement_version >= m));
}

/// Three namespaces, one node each, joined by a bridge in a fourth: taking a node's link down
/// partitions it from the others (both ways, every packet), bringing it up heals.
struct Lan {
    ns: Netns,
    tag: u32,
}

impl Lan {
    fn new() -> Result<Lan, String> {
        let tag = std::process::id() % 100_000;
        let mut ns = Netns { names: Vec::new() };
        let hub = format!("tfh{tag}");
        Netns::ip(&["netns", "add", &hub])?;
        ns.names.push(hub.clone());
        Netns::ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        Netns::ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 1..=3 {
            let name = format!("tfp{i}x{tag}");
            Netns::ip(&["netns", "add", &name])?;
            ns.names.push(name.clone());
            Netns::ip(&["-n", &name, "link", "set", "lo", "up"])?;
            let (h, n) = (format!("tfq{i}x{tag}h"), format!("tfq{i}x{tag}n"));
            Netns::ip(&["link", "add", &h, "type", "veth", "peer", "name", &n])?;
            Netns::ip(&["link", "set", &h, "netns", &hub])?;
            Netns::ip(&["link", "set", &n, "netns", &name])?;
            Netns::ip(&["-n", &hub, "link", "set", &h, "master", "br0", "up"])?;
            let addr = format!("10.232.0.{i}/24");
            Netns::ip(&["-n", &name, "addr", "add", &addr, "dev", &n])?;
            Netns::ip(&["-n", &name, "link", "set", &n, "up"])?;
        }
        Ok(Lan { ns, tag })
    }

    fn ns(&self, i: usize) -> String {
        self.ns.names[i + 1].clone()
    }

    fn addr(i: usize) -> String {
        format!("10.232.0.{}:7400", i + 1)
    }

    /// Cuts (or heals) node `i`'s link to the bridge.
    fn cut(&self, i: usize, cut: bool) {
        let h = format!("tfq{}x{}h", i + 1, self.tag);
        let state = if cut { "down" } else { "up" };
        Netns::ip(&["-n", &self.ns.names[0], "link", "set", &h, state]).unwrap();
    }
}

/// Partitions on a real network (namespaces): one follower cut off — the majority commits
/// (marks it down), the minority commits nothing (no leader, its placement version stands
/// still), and healed it catches up with the leader undisturbed (pre-vote); then the leader
/// cut off — the majority elects a new one within the goal (< 5 s) and the old leader steps
/// down (check-quorum), healed it follows.
#[test]
fn a_partitioned_voter_commits_nothing_the_majority_goes_on_and_both_heal() {
    let bundle = tiny_moe_bundle("control-lan-qwen3moe");
    let lan = match Lan::new() {
        Ok(l) => l,
        Err(e) => {
            ternfleet_shared::testing::skip(
                "partition test",
                &format!("cannot make namespaces: {e}"),
            );
            return;
        }
    };
    let mut g = Group::new(&bundle);
    g.netns = (0..3).map(|i| Some(lan.ns(i))).collect();
    g.spawn(0, &Lan::addr(0), &["--init-cluster"]);
    g.spawn(1, &Lan::addr(1), &["--join", &Lan::addr(0)]);
    g.spawn(2, &Lan::addr(2), &["--join", &Lan::addr(0)]);
    let (v, _) = g.agree(&[0, 1, 2], None, &[0, 0, 0], 30);
    for id in ["n1", "n2", "n3"] {
        g.wait_log(0, 0, &format!("control: node {id} is up"), 15);
    }
    let l = g.index_of(&v.leader);
    let f = (0..3).find(|&i| i != l).unwrap();
    let other = 3 - l - f;
    // A coordinator seated beside the follower (in its namespace): cut off with it.
    let certs = g.dir.path().join("certs");
    for id in ["coordinator", "operator"] {
        mtls::issue(&certs, id).unwrap();
    }
    let seat_log = g.dir.path().join("seat.log");
    let mut seat = Proc(
        Command::new("ip")
            .args(["netns", "exec", &lan.ns(f), bin(), "serve", "-m"])
            .arg(&bundle)
            .args([
                "--http",
                "127.0.0.1:0",
                "--grpc",
                "",
                "-t",
                "1",
                "--join",
                &Lan::addr(f),
            ])
            .args([
                "--listen",
                &Lan::addr(f).replace(":7400", ":7500"),
                "--certs",
            ])
            .arg(&certs)
            .arg("--state-dir")
            .arg(g.dir.path().join("state"))
            .args(["--admin", "127.0.0.1:0"])
            .env("RUST_LOG", "info,raft=warn")
            .stdout(Stdio::piped())
            .stderr(append_to(&seat_log))
            .spawn()
            .expect("spawning the seated coordinator"),
    );
    let line = startup_line(&mut seat.0, 60);
    let admin = line["admin"].as_str().expect("admin").to_string();
    let ctl_in_ns = |args: &[&str]| -> (bool, String) {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &lan.ns(f),
                bin(),
                "ctl",
                "--addr",
                &admin,
                "--certs",
            ])
            .arg(&certs)
            .args(args)
            .output()
            .expect("running ternfleet ctl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let t0 = Instant::now();
    while !ctl_in_ns(&["status"]).0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the seat's admin API never answered"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A follower cut off.
    let marks: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    let before = g.max_version(f, 0);
    lan.cut(f, true);
    let t0 = Instant::now();
    g.wait_log(
        l,
        marks[l],
        &format!("control: node {} is down", g.ids[f]),
        15,
    );
    let majority = t0.elapsed();
    // The minority: no leader (pre-vote finds no quorum), nothing committed.
    g.wait_log(f, marks[f], "leader=none", 15);
    // What the majority committed after the cut (marking it down) never reaches it. (An
    // entry committed just before the cut may still be applied there: not compared.)
    let during = g.max_version(f, marks[f]);
    let majority_version = g.max_version(l, marks[l]);
    assert!(majority_version > before, "the majority committed nothing");
    assert!(
        during < majority_version,
        "the cut-off node applied placement version {during} (the majority's {majority_version}) with no quorum"
    );
    eprintln!(
        "follower {} cut off: majority marked it down after {majority:?}, its version stayed {before}, the majority's reached {majority_version}",
        g.ids[f]
    );
    // An operator's write through the minority (the seat beside it) is refused, not applied.
    let t = Instant::now();
    let (ok, err) = ctl_in_ns(&["node", "drain", &g.ids[other]]);
    assert!(
        !ok && err.contains("Unavailable"),
        "a write through the minority: {err}"
    );
    eprintln!(
        "a drain through the minority: refused after {:?} ({})",
        t.elapsed(),
        err.trim()
    );
    // A timed-out write's outcome is unknown until the forwarded proposal's last send attempt
    // (a 3 s connect) has ended: heal after that, and it must never be applied.
    std::thread::sleep(Duration::from_secs(4));
    // Healed: it catches up and is up again; the leader keeps leading.
    let marks: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    lan.cut(f, false);
    let t0 = Instant::now();
    g.wait_log(
        l,
        marks[l],
        &format!("control: node {} is up", g.ids[f]),
        15,
    );
    while g.max_version(f, marks[f]) < majority_version {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the healed node did not catch up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("healed: caught up and up again after {:?}", t0.elapsed());
    let drained = format!("control: node {} is draining", g.ids[other]);
    for i in 0..3 {
        let text = strip_ansi(&std::fs::read_to_string(&g.logs[i]).unwrap_or_default());
        assert!(
            !text.contains(&drained),
            "the refused drain was applied on {}",
            g.ids[i]
        );
    }
    drop(seat);
    let (v2, _) = g.agree(&[0, 1, 2], None, &[0, 0, 0], 10);
    assert_eq!(
        v2.leader, v.leader,
        "the returning member disrupted the leader"
    );

    // The leader cut off: a new one on the majority side, the old one steps down.
    let marks: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    lan.cut(l, true);
    let t0 = Instant::now();
    let (v3, _) = g.agree(&[f, other], Some(&v.leader), &marks, 10);
    let failover = t0.elapsed();
    g.wait_log(l, marks[l], "leader=none", 10);
    eprintln!(
        "leader {} cut off: {} leads term {} after {failover:?}; the old leader stepped down",
        v.leader, v3.leader, v3.term
    );
    assert!(failover < Duration::from_secs(5), "{failover:?}");
    let marks: Vec<usize> = (0..3).map(|i| g.log_len(i)).collect();
    lan.cut(l, false);
    let mut from = vec![0; 3];
    from[l] = marks[l];
    let (v4, _) = g.agree(&[0, 1, 2], None, &from, 15);
    assert_eq!(
        v4.leader, v3.leader,
        "the old leader took over again on its return"
    );
}

/// Debian's Prometheus, on a free loopback port, scraping `targets` (job → addresses) every
/// second; killed on drop.
struct Prometheus {
    url: String,
    _proc: Proc,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(targets: &[(&str, Vec<String>)]) -> Option<Prometheus> {
        if Command::new("prometheus")
            .arg("--version")
            .output()
            .is_err()
        {
            ternfleet_shared::testing::skip(
                "the Prometheus scrape test",
                "no prometheus binary (apt-get install prometheus)",
            );
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n",
        );
        for (job, addrs) in targets {
            let list: Vec<String> = addrs.iter().map(|a| format!("'{a}'")).collect();
            cfg += &format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                list.join(", ")
            );
        }
        let file = dir.path().join("prometheus.yml");
        std::fs::write(&file, cfg).unwrap();
        // Prometheus prints no bound port: take a free one (bind port 0, release it).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(append_to(&log_dir().join("prometheus.log")))
            .spawn()
            .expect("spawning prometheus");
        let p = Prometheus {
            url: format!("http://127.0.0.1:{port}"),
            _proc: Proc(child),
            _dir: dir,
        };
        let t = Instant::now();
        while get(&p.url, "/-/ready").0 != 200 {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "prometheus not ready"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(p)
    }

    /// `query`'s samples: (job, instance, the other labels, value).
    fn query(&self, query: &str) -> Vec<(String, String, serde_json::Value, f64)> {
        let (code, body) = get(&self.url, &format!("/api/v1/query?query={query}"));
        assert_eq!(code, 200, "{query}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|r| {
                let m = &r["metric"];
                (
                    m["job"].as_str().unwrap_or_default().to_string(),
                    m["instance"].as_str().unwrap_or_default().to_string(),
                    m.clone(),
                    r["value"][1]
                        .as_str()
                        .and_then(|x| x.parse().ok())
                        .unwrap_or(f64::NAN),
                )
            })
            .collect()
    }

    /// The targets' health: (job, instance, "up" / "down" / "unknown").
    fn targets(&self) -> Vec<(String, String, String)> {
        let (_, body) = get(&self.url, "/api/v1/targets");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["data"]["activeTargets"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|t| {
                (
                    t["labels"]["job"].as_str().unwrap_or_default().to_string(),
                    t["labels"]["instance"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    t["health"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect()
    }
}

/// A real Prometheus scrapes a running control-plane cluster (three nodes with an expert
/// store each, a seated coordinator): every target up; the coordinator's per-node series
/// (calls, routes, bytes, round-trip histograms), failovers, placement version and Raft
/// gauges, and the nodes' store, per-expert, queue and Raft series present; and under load
/// the per-node series grow on every node, as seen through Prometheus's own query API.
#[test]
fn prometheus_scrapes_the_coordinator_and_every_node_and_sees_the_load() {
    let bundle = tiny_moe_bundle("control-prom-qwen3moe");
    let mut g = Group::new(&bundle);
    mtls::issue(&g.dir.path().join("certs"), "coordinator").unwrap();
    // A RAM budget of a few experts: the store reads and evicts under load.
    let flags = ["--metrics", "127.0.0.1:0", "--ram-budget", "256KiB"];
    g.spawn(
        0,
        "127.0.0.1:0",
        &[&["--init-cluster"][..], &flags].concat(),
    );
    let first = g.addrs[0].clone();
    for i in [1, 2] {
        g.spawn(
            i,
            "127.0.0.1:0",
            &[&["--join", first.as_str()][..], &flags].concat(),
        );
    }
    g.agree(&[0, 1, 2], None, &[0, 0, 0], 30);
    assert!(g.metrics.iter().all(|m| !m.is_empty()), "{:?}", g.metrics);
    let coord = Server::start(&bundle, &seat_args(&g, &g.addrs[0]), "prom-coordinator");
    // The node's own side port: health, readiness, text.
    for m in &g.metrics {
        let url = format!("http://{m}");
        assert_eq!(get(&url, "/health").0, 200);
        let (code, text) = get(&url, "/metrics");
        assert_eq!(code, 200);
        assert!(text.contains("ternfleet_node_ready 1"), "{text}");
    }
    let coord_addr = coord.url.trim_start_matches("http://").to_string();
    let Some(prom) = Prometheus::start(&[
        ("coordinator", vec![coord_addr.clone()]),
        ("nodes", g.metrics.clone()),
    ]) else {
        return;
    };
    let t = Instant::now();
    loop {
        let ts = prom.targets();
        if ts.len() == 4 && ts.iter().all(|t| t.2 == "up") {
            eprintln!("prometheus: 4 targets up after {:?}", t.elapsed());
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "targets: {ts:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Raft gauges refresh every second; a scrape every second after that.
    let per_instance = |q: &str| -> std::collections::BTreeMap<String, f64> {
        prom.query(q)
            .into_iter()
            .map(|(job, inst, m, v)| {
                let node = m["node"].as_str().map(str::to_string);
                (node.unwrap_or(format!("{job}/{inst}")), v)
            })
            .collect()
    };
    let wait_for = |q: &str, n: usize| {
        let t = Instant::now();
        loop {
            let got = per_instance(q);
            if got.len() >= n {
                return got;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{q}: {got:?} (want {n} series)"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    // Present on every process before any request: Raft and placement.
    for q in [
        "ternfleet_raft_term",
        "ternfleet_raft_commit_index",
        "ternfleet_raft_applied_index",
        "ternfleet_raft_apply_lag",
        "ternfleet_placement_version",
    ] {
        let got = wait_for(q, 4);
        assert!(got.values().all(|v| *v >= 0.0), "{q}: {got:?}");
    }
    let versions = wait_for("ternfleet_placement_version", 4);
    assert!(versions.values().all(|v| *v >= 1.0), "{versions:?}");
    assert_eq!(
        wait_for("ternfleet_raft_leader", 4).values().sum::<f64>(),
        1.0,
        "exactly one leader"
    );

    let before_tokens = wait_for("ternfleet_generated_tokens_total", 1);
    for i in 0..4 {
        completion(
            &coord.url,
            &request(&format!("Scraped request {i} says"), 12, i),
        );
    }
    // Every node's series grew (seen at a later scrape), the coordinator's per node too.
    let grew = |q: &str, before: &std::collections::BTreeMap<String, f64>, n: usize| {
        let t = Instant::now();
        loop {
            let now = per_instance(q);
            let up = now
                .iter()
                .filter(|(k, v)| **v > before.get(*k).copied().unwrap_or(0.0))
                .count();
            if up >= n {
                return now;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{q}: {now:?}, before {before:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    let none = std::collections::BTreeMap::new();
    grew("ternfleet_generated_tokens_total", &before_tokens, 1);
    let rtt = grew("ternfleet_cluster_node_round_trip_seconds_count", &none, 3);
    assert_eq!(
        rtt.keys().cloned().collect::<Vec<_>>(),
        ["n1", "n2", "n3"],
        "per-node round trips"
    );
    for q in [
        "ternfleet_cluster_node_calls_total",
        "ternfleet_cluster_node_routes_total",
        "ternfleet_cluster_node_sent_bytes_total",
        "ternfleet_cluster_node_received_bytes_total",
    ] {
        grew(q, &none, 3);
    }
    wait_for("ternfleet_cluster_failovers_total", 1);
    wait_for("ternfleet_cluster_node_failures_total", 3);
    // The nodes: calls, routes, per-expert rows, compute time, the store's reads.
    for q in [
        "ternfleet_node_routes_total",
        "ternfleet_node_call_seconds_count",
        "ternfleet_expert_store_read_bytes_total",
        "ternfleet_expert_store_reads_total",
        "ternfleet_expert_store_read_seconds_total",
    ] {
        grew(q, &none, 3);
    }
    let hits = prom.query("ternfleet_expert_store_demands_total");
    for r in ["hit", "miss"] {
        assert_eq!(
            hits.iter().filter(|h| h.2["result"] == r).count(),
            3,
            "{r}: {hits:?}"
        );
    }
    let experts = prom.query("ternfleet_node_expert_routes_total");
    assert!(experts.len() > 3, "per-expert series: {experts:?}");
    for q in [
        "ternfleet_expert_store_resident_experts",
        "ternfleet_expert_store_budget_bytes",
        "ternfleet_node_queue_depth",
        "ternfleet_node_held_experts",
        "ternfleet_queue_depth",
        "ternfleet_kv_blocks_used",
    ] {
        assert!(!prom.query(q).is_empty(), "{q} missing");
    }
    let budget = per_instance("ternfleet_expert_store_budget_bytes");
    assert!(budget.values().all(|b| *b == 262144.0), "{budget:?}");
}
