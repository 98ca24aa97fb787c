//! The remote backend's failover logic without sockets: nodes are the real `node::Service`
//! over real shards of a bundle, reached through an in-memory `Transport` that drops, delays
//! and partitions (seeded). Whatever the faults, a layer's result is the single process's bits
//! while a replica is left; with none left the step fails `Unavailable`, naming the node and
//! the experts, and leaves the KV cache as it was.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ternfleet_coordinator::kv_cache::SeqOptions;
use ternfleet_coordinator::model::{ClusterSpec, ForwardError, Logits, Model, OpenOptions};
use ternfleet_coordinator::remote::{RemoteOptions, RoutingCounts};
use ternfleet_kernels::Numerics;
use ternfleet_node::expert::LocalExperts;
use ternfleet_node::service::{Service, Shard};
use ternfleet_node::shard::{open_experts, ExpertShape};
use ternfleet_shared::bundle::{Gating, Manifest};
use ternfleet_shared::cluster::{ClusterFile, Placement};
use ternfleet_shared::expert::{ExpertError, Health};
use ternfleet_shared::net::{NetError, Reply, Transport};
use ternfleet_shared::wire::Frame;

/// One test at a time: their per-call deadlines are short (150 ms, so faults are quick to
/// test) and, run side by side on a 2-core machine, an innocent node's call overran them.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The tiny qwen3moe test model as a bundle (2 layers × 16 experts, top-4).
fn bundle() -> PathBuf {
    tiny_moe_bundle("mem-qwen3moe")
}

/// Faults the transport injects.
#[derive(Default)]
struct Faults {
    /// Probability that a call is lost (no answer ever comes). Status polls are never lost.
    drop: f64,
    rng: Mutex<u64>,
    /// Extra latency per node, each way.
    delay: Vec<Mutex<Duration>>,
    /// Partitioned nodes: every send fails at once (connection refused).
    cut: Vec<AtomicBool>,
}

/// The in-memory transport: node `i` is `nodes[i]`, answering on a thread of its own.
struct MemTransport {
    nodes: Vec<Arc<Service>>,
    faults: Faults,
    /// Calls each node computed.
    served: Vec<AtomicU64>,
    dropped: AtomicU64,
}

impl MemTransport {
    fn roll(&self) -> f64 {
        let mut r = self.faults.rng.lock().unwrap();
        *r ^= *r >> 12;
        *r ^= *r << 25;
        *r ^= *r >> 27;
        (r.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The transport handed to the model (the test keeps the `Arc` to steer faults).
struct Link(Arc<MemTransport>);

impl Transport for Link {
    fn send(&self, node: usize, request: Arc<Vec<u8>>, deadline: Instant) -> Receiver<Reply> {
        let (tx, rx) = sync_channel(1);
        let id = self.0.nodes[node].id.clone();
        if self.0.faults.cut[node].load(Ordering::SeqCst) {
            let _ = tx.send(Err(NetError::Connect {
                node: id,
                addr: "mem".into(),
                msg: "partitioned".into(),
            }));
            return rx;
        }
        let frame = Frame::decode(&request).expect("the coordinator sends valid frames");
        let is_call = matches!(frame, Frame::Call(_));
        if is_call && self.0.roll() < self.0.faults.drop {
            self.0.dropped.fetch_add(1, Ordering::SeqCst);
            // Lost: nothing answers; the sender lives until the deadline has passed.
            std::thread::spawn(move || {
                std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
                std::thread::sleep(Duration::from_millis(20));
                drop(tx);
            });
            return rx;
        }
        let me = self.0.clone();
        let delay = *self.0.faults.delay[node].lock().unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            let reply = me.nodes[node]
                .handle("coordinator", frame)
                .unwrap_or_else(|f| f);
            if is_call {
                me.served[node].fetch_add(1, Ordering::SeqCst);
            }
            std::thread::sleep(delay);
            let _ = tx.send(Ok(reply));
        });
        rx
    }

    fn hint(&self, node: usize, frame: Vec<u8>) {
        if let Ok(f) = Frame::decode(&frame) {
            let _ = self.0.nodes[node].handle("coordinator", f);
        }
    }
}

struct Setup {
    transport: Arc<MemTransport>,
    model: Model,
    /// The placement (version 1 of a followed feed).
    plan: ClusterFile,
    /// Newer placements (when the model follows a feed).
    feed: Option<tokio::sync::watch::Sender<(u64, ClusterFile)>>,
    /// What the model routed (the planner's input).
    routed: RoutingCounts,
}

/// `n` in-memory nodes holding a plan with `replicas`, and a model whose experts run on them.
fn setup(b: &Path, n: usize, replicas: usize, drop: f64, seed: u64) -> Setup {
    setup_with(b, n, replicas, drop, seed, false)
}

fn setup_with(b: &Path, n: usize, replicas: usize, drop: f64, seed: u64, follow: bool) -> Setup {
    let man = Manifest::read(b).unwrap();
    let ids: Vec<(String, String)> = (1..=n).map(|i| (format!("n{i}"), "mem:1".into())).collect();
    let plan = ClusterFile::plan(&man, &ids, replicas).unwrap();
    let placement: Placement = plan.placement(man.n_layer, man.moe.n_expert).unwrap();
    let digest = ternfleet_shared::bundle::manifest_digest(b).unwrap();
    let nodes = placement
        .nodes
        .iter()
        .map(|pn| {
            let held: Vec<Vec<usize>> = pn
                .experts
                .iter()
                .map(|s| s.iter().copied().collect())
                .collect();
            let svc = Service::new(&pn.id, "mem", true, &digest, 0);
            svc.ready(shard(b, &held));
            Arc::new(svc)
        })
        .collect::<Vec<_>>();
    let transport = Arc::new(MemTransport {
        faults: Faults {
            drop,
            rng: Mutex::new(seed | 1),
            delay: (0..n).map(|_| Mutex::new(Duration::ZERO)).collect(),
            cut: (0..n).map(|_| AtomicBool::new(false)).collect(),
        },
        served: (0..n).map(|_| AtomicU64::new(0)).collect(),
        dropped: AtomicU64::new(0),
        nodes,
    });
    let routed = RoutingCounts::default();
    let (feed, follow) = if follow {
        let (tx, rx) = tokio::sync::watch::channel((1, plan.clone()));
        (Some(tx), Some(rx))
    } else {
        (None, None)
    };
    let model = Model::open_with(
        b,
        &OpenOptions {
            cluster: Some(ClusterSpec {
                follow,
                routed: routed.clone(),
                placement,
                transport: Arc::new(Link(transport.clone())),
                me: "coordinator".into(),
                opts: RemoteOptions {
                    step_base: Duration::from_millis(150),
                    per_route: Duration::from_micros(100),
                    load_timeout: Duration::from_secs(10),
                },
            }),
            ..OpenOptions::default()
        },
    )
    .unwrap();
    Setup {
        transport,
        model,
        plan,
        feed,
        routed,
    }
}

/// A node's shard of bundle `b`: `held[layer]` the experts it holds, ascending.
fn shard(b: &Path, held: &[Vec<usize>]) -> Shard {
    let man = Manifest::read(b).unwrap();
    // The hidden width: the up matrix's rows (ggml ne[0]).
    let n_embd = man.experts[0]
        .tensors
        .iter()
        .find(|t| t.name == ternfleet_node::shard::BLOB_TENSORS[1])
        .map(|t| t.dims[0] as usize)
        .unwrap();
    let arch = ternfleet_coordinator::model::config::Arch::from_name(&man.architecture).unwrap();
    let shape = ExpertShape {
        n_embd,
        n_ff: man.moe.n_ff_exp,
        act: ternfleet_coordinator::model::weights::activation(arch),
        routed: man.moe.gating != Gating::TopKUnit,
    };
    let blobs = open_experts(b, &man, shape, |l, e| held[l].contains(&e)).unwrap();
    let mut layers = vec![Vec::new(); man.n_layer];
    for (l, _, w) in blobs {
        layers[l].push(w);
    }
    Shard::new(Box::new(LocalExperts::new(layers)), held, man.moe.n_expert)
}

const PROMPT: &str = "This License applies to any program";

#[test]
fn seeded_call_losses_with_replicas_change_no_bit() {
    let _serial = serial();
    let b = bundle();
    let local = Model::open(&b).unwrap();
    for numerics in [Numerics::Parity, Numerics::Invariant] {
        let want = run(&local, numerics, PROMPT, 12).unwrap();
        for seed in 1..=4u64 {
            // Every node holds every expert: a lost call always has two more holders.
            let s = setup(&b, 3, 3, 0.03, seed);
            let got = run(&s.model, numerics, PROMPT, 12).unwrap();
            assert!(got == want, "seed {seed} {numerics:?}: output differs");
            let served: u64 = s
                .transport
                .served
                .iter()
                .map(|c| c.load(Ordering::SeqCst))
                .sum();
            assert!(served > 0, "no node served anything");
        }
    }
    // Over the seeds, losses happened and were survived.
    let s = setup(&b, 3, 3, 0.1, 99);
    let want = run(&local, Numerics::Invariant, PROMPT, 6).unwrap();
    assert!(run(&s.model, Numerics::Invariant, PROMPT, 6).unwrap() == want);
    assert!(
        s.transport.dropped.load(Ordering::SeqCst) > 0,
        "the fault was not exercised"
    );
}

#[test]
fn a_partitioned_or_slow_node_fails_over_and_is_used_again_when_it_returns() {
    let _serial = serial();
    let b = bundle();
    let local = Model::open(&b).unwrap();
    let want = run(&local, Numerics::Invariant, PROMPT, 8).unwrap();
    let s = setup(&b, 3, 2, 0.0, 7);
    // Partitioned: refused at once, its replicas answer.
    s.transport.faults.cut[0].store(true, Ordering::SeqCst);
    let before = s.transport.served[0].load(Ordering::SeqCst);
    assert!(run(&s.model, Numerics::Invariant, PROMPT, 8).unwrap() == want);
    assert_eq!(
        s.transport.served[0].load(Ordering::SeqCst),
        before,
        "a cut node served"
    );
    // Healed: the prober finds it and it serves again (bounded: a few probe rounds).
    s.transport.faults.cut[0].store(false, Ordering::SeqCst);
    let t = Instant::now();
    while s.transport.served[0].load(Ordering::SeqCst) == before {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the returned node was not used again within 5 s"
        );
        assert!(run(&s.model, Numerics::Invariant, PROMPT, 8).unwrap() == want);
    }
    // Slower than the step deadline: detected, rerouted, same bits.
    *s.transport.faults.delay[1].lock().unwrap() = Duration::from_millis(400);
    let t = Instant::now();
    assert!(run(&s.model, Numerics::Invariant, PROMPT, 8).unwrap() == want);
    eprintln!("with a node past the deadline: {:?}", t.elapsed());
}

#[test]
fn with_every_holder_gone_the_step_fails_unavailable_and_the_cache_is_unchanged() {
    let _serial = serial();
    let b = bundle();
    let local = Model::open(&b).unwrap();
    let s = setup(&b, 3, 1, 0.0, 3);
    let toks = local.tokenizer.encode(PROMPT, true, true);
    let opts = SeqOptions {
        numerics: Numerics::Invariant,
        ..SeqOptions::default()
    };
    let mut want_cache = local.new_cache_with(toks.len() + 1, opts);
    let want = local.forward(&mut want_cache, &toks, Logits::Last).unwrap();
    let mut cache = s.model.new_cache_with(toks.len() + 1, opts);
    s.transport.faults.cut[1].store(true, Ordering::SeqCst);
    let t = Instant::now();
    let e = s
        .model
        .forward(&mut cache, &toks, Logits::Last)
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, ForwardError::Expert(ExpertError::Unavailable { .. })),
        "{msg}"
    );
    assert!(
        msg.contains("n2") && msg.contains("no live replica"),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // Nothing was written: healed, the same call gives the single process's logits.
    s.transport.faults.cut[1].store(false, Ordering::SeqCst);
    let t = Instant::now();
    while s.model.experts.health() != Health::Ready {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "n2 not back within 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let got = s.model.forward(&mut cache, &toks, Logits::Last).unwrap();
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn a_newer_placement_is_followed_a_drained_node_gets_no_call_and_comes_back() {
    let _serial = serial();
    let b = bundle();
    let local = Model::open(&b).unwrap();
    let want = run(&local, Numerics::Invariant, PROMPT, 6).unwrap();
    // Every node holds every expert; version 2 drains n1 (it leaves the routing file).
    let s = setup_with(&b, 3, 3, 0.0, 5, true);
    assert!(run(&s.model, Numerics::Invariant, PROMPT, 6).unwrap() == want);
    let served = |i: usize| s.transport.served[i].load(Ordering::SeqCst);
    assert!(served(0) > 0, "n1 served nothing before the drain");
    let mut drained = s.plan.clone();
    drained.nodes.retain(|n| n.id != "n1");
    let feed = s.feed.as_ref().unwrap();
    feed.send((2, drained)).unwrap();
    // The follower takes it at once; a bounded wait for the first step without n1.
    let t = Instant::now();
    loop {
        let before = served(0);
        assert!(run(&s.model, Numerics::Invariant, PROMPT, 6).unwrap() == want);
        if served(0) == before {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "n1 still called 5 s after its drain"
        );
    }
    let before = served(0);
    for _ in 0..3 {
        assert!(run(&s.model, Numerics::Invariant, PROMPT, 6).unwrap() == want);
    }
    assert_eq!(served(0), before, "a drained node was called");
    // A placement in which layer 0 expert 0 has no holder: calls that need it fail
    // unavailable, naming the expert; the rest of the placement is taken.
    let mut gap = s.plan.clone();
    for n in &mut gap.nodes {
        n.experts = vec!["0:1-15".into(), "1:*".into()];
    }
    feed.send((3, gap)).unwrap();
    let t = Instant::now();
    while s.model.experts.health() == Health::Ready {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the gap was not taken"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        matches!(s.model.experts.health(), Health::Unavailable(m) if m.contains("[0]")),
        "{:?}",
        s.model.experts.health()
    );
    // Recommissioned: n1 is called again. The follower takes the placement on its own
    // thread: wait for it (a step before then still sees the gap and fails unavailable, as it
    // should; seen on a loaded machine).
    feed.send((4, s.plan.clone())).unwrap();
    let t = Instant::now();
    while s.model.experts.health() != Health::Ready {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the recommission was not taken"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let t = Instant::now();
    let before = served(0);
    while served(0) == before {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "n1 not called again within 5 s"
        );
        assert!(run(&s.model, Numerics::Invariant, PROMPT, 6).unwrap() == want);
    }
}

/// Round trips per layer step of the runs of `prompts` (`n` decode steps each), checking
/// each run against `want`.
fn round_trips(s: &Setup, prompts: &[&str], n: usize, want: &[Vec<u32>]) -> f64 {
    let stats = || s.model.experts.remote_stats().unwrap();
    let before = stats();
    for (p, w) in prompts.iter().zip(want) {
        let got = run(&s.model, Numerics::Invariant, p, n).unwrap();
        let first = got.iter().zip(w).position(|(a, b)| a != b);
        assert!(
            got == *w,
            "output differs: {p}: len {} vs {}, first at {first:?}: {:?}",
            got.len(),
            w.len(),
            first.map(|i| (f32::from_bits(got[i]), f32::from_bits(w[i])))
        );
    }
    let after = stats();
    (after.calls - before.calls) as f64 / (after.layer_steps - before.layer_steps) as f64
}

const PROMPTS: [&str; 4] = [
    PROMPT,
    "The quick brown fox jumps over the lazy dog",
    "In the beginning was the word",
    "Once upon a time there lived a king",
];

#[test]
fn co_located_experts_cost_fewer_round_trips_and_change_no_bit() {
    let _serial = serial();
    let (blind, colocated) = colocation(&bundle(), 2, 24);
    assert!(colocated < blind, "{colocated} !< {blind}");
}

/// The co-location figure on another bundle (`TERNFLEET_BUNDLE=DIR`, `TERNFLEET_NODES=N`):
/// `cargo test --release -p ternfleet-coordinator --test cluster_mem -- --ignored
/// --nocapture`.
#[test]
#[ignore = "a measurement: needs TERNFLEET_BUNDLE"]
fn co_location_on_a_bundle() {
    let _serial = serial();
    let b = PathBuf::from(std::env::var("TERNFLEET_BUNDLE").expect("TERNFLEET_BUNDLE=DIR"));
    let nodes = std::env::var("TERNFLEET_NODES").map_or(2, |n| n.parse().unwrap());
    let (blind, colocated) = colocation(&b, nodes, 32);
    assert!(colocated <= blind, "{colocated} > {blind}");
}

/// Runs [`PROMPTS`] (`n` decode steps each) on `nodes` in-memory nodes placed by bytes (one
/// replica, blind to routing), plans from what was routed as the admin API does, moves the
/// experts, follows the new placement and runs them again: every logit the single
/// process's both times. Returns the round trips per layer step before and after.
fn colocation(b: &Path, nodes: usize, n: usize) -> (f64, f64) {
    use ternfleet_control::planner::{plan, PlanInput};
    use ternfleet_control::state::{ClusterState, Command, NodeStatus};
    let man = Manifest::read(b).unwrap();
    let local = Model::open(b).unwrap();
    let prompts = PROMPTS;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&local, Numerics::Invariant, p, n).unwrap())
        .collect();
    let s = setup_with(b, nodes, 1, 0.0, 7, true);
    let blind = round_trips(&s, &prompts, n, &want);
    // Plan from what was routed, as the admin API does.
    let mut state = ClusterState::default();
    state.apply(&Command::Seed {
        bundle: None,
        file: s.plan.clone(),
        n_layer: man.n_layer as u32,
        n_expert: man.moe.n_expert as u32,
    });
    for n in state.nodes.values_mut() {
        n.status = NodeStatus::Up;
    }
    let routed = s.routed.lock().unwrap().clone();
    let input = PlanInput {
        n_layer: man.n_layer,
        n_expert: man.moe.n_expert,
        sizes: vec![vec![1; man.moe.n_expert]; man.n_layer],
        load: routed.rows.clone(),
        replicas: 1,
        samples: routed.recent.clone(),
        ..PlanInput::default()
    };
    let p = plan(&state, &input).unwrap();
    assert!(p.colocation_moves > 0, "nothing to co-locate: {p:?}");
    assert!(p.round_trips_after < p.round_trips_before, "{p:?}");
    // The nodes take the new experts (keeping the old: whichever placement routes, every
    // call finds its expert), then the coordinator follows the new placement.
    for (i, svc) in s.transport.nodes.iter().enumerate() {
        let id = format!("n{}", i + 1);
        let old = s.plan.placement(man.n_layer, man.moe.n_expert).unwrap();
        let mut held: Vec<Vec<usize>> = old.nodes[i]
            .experts
            .iter()
            .map(|x| x.iter().copied().collect())
            .collect();
        for (&l, es) in &p.target[&id] {
            for &e in es {
                if !held[l as usize].contains(&(e as usize)) {
                    held[l as usize].push(e as usize);
                }
            }
        }
        for h in &mut held {
            h.sort_unstable();
        }
        svc.ready(shard(b, &held));
    }
    for (id, t) in &p.target {
        state.nodes.get_mut(id).unwrap().experts = t.clone();
    }
    s.feed
        .as_ref()
        .unwrap()
        .send((2, state.to_cluster_file()))
        .unwrap();
    // Bounded wait for the first run routed with it (the follower takes it at once).
    let t = Instant::now();
    while (round_trips(&s, &prompts[..1], n, &want[..1]) - blind).abs() < 1e-9 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the co-located placement was not taken"
        );
    }
    let colocated = round_trips(&s, &prompts, n, &want);
    eprintln!(
        "co-location ({} layers x {} experts, top-{}, {nodes} nodes): round trips per layer step {blind:.3} -> {colocated:.3} measured; planner's estimate per token {:.3} -> {:.3}; {} moves, max/mean load {:.3} -> {:.3}",
        man.n_layer,
        man.moe.n_expert,
        man.moe.n_expert_used,
        p.round_trips_before,
        p.round_trips_after,
        p.moves.len(),
        ternfleet_control::planner::Plan::imbalance(&p.load_before),
        ternfleet_control::planner::Plan::imbalance(&p.load_after),
    );
    (blind, colocated)
}
