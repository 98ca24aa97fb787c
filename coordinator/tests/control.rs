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
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ternfleet_shared::bundle::Manifest;
use ternfleet_shared::cluster::ClusterFile;
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::mtls;
use ternfleet_shared::wire::Frame;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_ternfleet")
}

/// A process killed (and reaped) when dropped, whatever the test's outcome.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Group {
    dir: tempfile::TempDir,
    bundle: PathBuf,
    ids: Vec<String>,
    addrs: Vec<String>,
    procs: Vec<Option<Proc>>,
    logs: Vec<PathBuf>,
}

/// What a node's latest "control: membership" line says.
#[derive(Debug, Clone, PartialEq)]
struct View {
    term: u64,
    leader: String,
    voters: Vec<String>,
    placement_version: u64,
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
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

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..].split(' ').next()
}

impl Group {
    fn new(bundle: &Path) -> Group {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        mtls::init_ca(&certs).unwrap();
        let ids: Vec<String> = (1..=3).map(|i| format!("n{i}")).collect();
        for id in &ids {
            mtls::issue(&certs, id).unwrap();
        }
        let man = Manifest::read(bundle).unwrap();
        // Placeholder addresses: each node registers the address it bound.
        let list: Vec<(String, String)> = ids
            .iter()
            .map(|i| (i.clone(), "127.0.0.1:1".to_string()))
            .collect();
        let plan = ClusterFile::plan(&man, &list, 2).unwrap();
        std::fs::write(dir.path().join("cluster.toml"), plan.to_toml()).unwrap();
        let logs = ids
            .iter()
            .map(|id| dir.path().join(format!("{id}.log")))
            .collect();
        Group {
            dir,
            bundle: bundle.to_owned(),
            addrs: vec![String::new(); 3],
            procs: (0..3).map(|_| None).collect(),
            ids,
            logs,
        }
    }

    fn spawn(&mut self, i: usize, listen: &str, extra: &[&str]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.logs[i])
            .unwrap();
        let child = Command::new(bin())
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
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawning ternfleet node");
        let mut p = Proc(child);
        let v = startup_line(&mut p.0, 30);
        let addr = v["quic"].as_str().expect("quic address").to_string();
        if !self.addrs[i].is_empty() {
            assert_eq!(addr, self.addrs[i], "restarted on its old address");
        }
        self.addrs[i] = addr;
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
        vec![join, hello]
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
    g.wait_log(1, 0, "added this node to the cluster", 15);
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
    match &answers[1] {
        Ok(Frame::Error { class, message }) => {
            assert_eq!(*class, ErrorClass::BadRequest);
            assert!(message.contains("Join or Raft"), "{message}");
        }
        other => panic!("a data-plane frame from a non-coordinator was not refused: {other:?}"),
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
