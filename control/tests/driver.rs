//! The driver thread in real time over file-backed stores: three members elect a leader,
//! commit writes, serve linearizable reads; the leader is stopped and a new one takes over
//! within the goal (< 5 s); the stopped member restarts from its files and catches up. The
//! transport is in memory (behind the same trait as the QUIC one), delivering at once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ternfleet_control::driver::{ControlError, ControlHandle, Driver, DriverConfig, RaftTransport};
use ternfleet_control::replica::{Outgoing, Replica, ReplicaConfig};
use ternfleet_control::state::NodeCaps;
use ternfleet_control::{Command, Outcome, RaftStore};

#[derive(Default)]
struct MemNet {
    peers: Mutex<BTreeMap<u64, ControlHandle>>,
}

impl RaftTransport for MemNet {
    fn send(&self, from: u64, msg: Outgoing) {
        let peers = self.peers.lock().unwrap();
        let delivered = peers
            .get(&msg.to)
            .is_some_and(|h| h.deliver(msg.bytes).is_ok());
        if msg.snapshot {
            if let Some(h) = peers.get(&from) {
                h.report_snapshot(msg.to, delivered);
            }
        }
    }
}

fn start(dir: &std::path::Path, id: u64, net: &Arc<MemNet>, bootstrap: bool) -> Driver {
    let store = RaftStore::open(&dir.join(format!("m{id}/raft.redb"))).unwrap();
    if bootstrap {
        Replica::bootstrap(&store, &[1, 2, 3]).unwrap();
    }
    let replica = Replica::open(&ReplicaConfig::new(id), store).unwrap();
    let d = Driver::spawn(replica, net.clone(), DriverConfig::default()).unwrap();
    net.peers.lock().unwrap().insert(id, d.handle.clone());
    d
}

async fn leader(handles: &BTreeMap<u64, ControlHandle>, within: Duration) -> (u64, Duration) {
    let t0 = Instant::now();
    loop {
        for (&id, h) in handles {
            if let Ok(s) = h.status().await {
                if s.leader == Some(id) {
                    return (id, t0.elapsed());
                }
            }
        }
        assert!(t0.elapsed() < within, "no leader within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn write(seq: u64) -> Command {
    Command::Register {
        id: format!("w{seq}"),
        raft_id: 0,
        addr: "10.0.0.1:7000".into(),
        caps: NodeCaps::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_stopped_new_leader_within_goal_and_restart_catches_up() {
    let dir = tempfile::tempdir().unwrap();
    let net = Arc::new(MemNet::default());
    let mut drivers: BTreeMap<u64, Driver> = (1..=3)
        .map(|id| (id, start(dir.path(), id, &net, true)))
        .collect();
    let handles = |d: &BTreeMap<u64, Driver>| -> BTreeMap<u64, ControlHandle> {
        d.iter().map(|(k, v)| (*k, v.handle.clone())).collect()
    };
    let (l, first) = leader(&handles(&drivers), Duration::from_secs(10)).await;
    eprintln!("first leader {l} after {first:?}");
    for seq in 1..=20 {
        let out = drivers[&l].handle.propose(write(seq)).await.unwrap();
        assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    }
    // A follower forwards a proposal to the leader and is answered once it applied it.
    let f = (1..=3).find(|&i| i != l).unwrap();
    let out = drivers[&f].handle.propose(write(99)).await.unwrap();
    assert!(matches!(out, Outcome::Applied { .. }), "{out:?}");
    // A membership change is the leader's alone.
    let cc = ternfleet_control::conf_change(9, ternfleet_control::ConfChangeType::AddLearnerNode);
    match drivers[&f].handle.change_membership(cc).await {
        Err(ControlError::NotLeader { leader }) => assert_eq!(leader, Some(l)),
        r => panic!("a follower proposed a membership change: {r:?}"),
    }
    // Linearizable read on the leader sees all 20.
    let s = drivers[&l].handle.read().await.unwrap();
    assert!((1..=20).all(|i| s.nodes.contains_key(&format!("w{i}"))));

    // Stop the leader: the others elect a new one within the goal.
    let t0 = Instant::now();
    net.peers.lock().unwrap().remove(&l);
    drivers.remove(&l).unwrap().stop().unwrap();
    let (l2, _) = leader(&handles(&drivers), Duration::from_secs(5)).await;
    let failover = t0.elapsed();
    eprintln!("leader {l} stopped: member {l2} leads after {failover:?}");
    assert_ne!(l2, l);
    assert!(
        failover < Duration::from_secs(5),
        "failover took {failover:?}"
    );
    for seq in 21..=30 {
        drivers[&l2].handle.propose(write(seq)).await.unwrap();
    }

    // The old leader restarts from its files and catches up.
    drivers.insert(l, start(dir.path(), l, &net, false));
    let t0 = Instant::now();
    loop {
        let st = drivers[&l].handle.applied().borrow().clone();
        if (1..=30).all(|i| st.nodes.contains_key(&format!("w{i}"))) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "restarted member did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every member comes to hold the same state.
    let t0 = Instant::now();
    loop {
        let digests: std::collections::BTreeSet<_> = drivers
            .values()
            .map(|d| d.handle.applied().borrow().digest())
            .collect();
        if digests.len() == 1 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "members hold different states"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
