//! The placement planner (`ctl placement plan`): pure logic over the replicated state, no I/O.
//!
//! Given the committed state, each expert's size and its observed routing frequency, it
//! proposes a target assignment and the moves that reach it:
//!
//! 1. **Replica counts.** Every expert gets `replicas` holders (at most the nodes in service);
//!    a *hot* expert — routed at least `hot_factor` times the mean — gets one more, so its load
//!    splits over more nodes.
//! 2. **Fewest moves.** Current holders in service are kept (up to the count); an expert
//!    short of holders is added to the least-loaded node (load = routing share over the
//!    node's bandwidth) that fits it in RAM and disk.
//! 3. **Balance.** While the most loaded node is more than `tolerance` above the mean, the
//!    replica on it that best closes the gap moves to the least loaded node that can take it
//!    (bounded rounds; each move counted).
//!
//! Load is routing-weighted: an expert's share of the routed rows, split evenly over its
//! replicas (the coordinator rotates the preferred replica per expert). Co-locating experts
//! that fire together is not attempted yet (the quality figures in docs/control-plane.md say
//! what it would save).

use std::collections::{BTreeMap, BTreeSet};

use crate::state::{ClusterState, Move};

/// What the planner is given besides the state.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub n_layer: usize,
    pub n_expert: usize,
    /// `sizes[layer][expert]`: bytes of the expert's blob.
    pub sizes: Vec<Vec<u64>>,
    /// `load[layer][expert]`: how often it was routed (any unit); empty = uniform.
    pub load: Vec<Vec<u64>>,
    /// Holders per expert (at least 1).
    pub replicas: usize,
    /// An expert routed at least this many times the mean gets one more replica.
    pub hot_factor: f64,
    /// Balance until max node load ≤ (1 + tolerance) × mean.
    pub tolerance: f64,
}

impl Default for PlanInput {
    fn default() -> Self {
        PlanInput {
            n_layer: 0,
            n_expert: 0,
            sizes: Vec::new(),
            load: Vec::new(),
            replicas: 2,
            hot_factor: 2.0,
            tolerance: 0.10,
        }
    }
}

/// A proposed placement.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Per node in service: per layer, the experts it holds after the plan.
    pub target: BTreeMap<String, BTreeMap<u32, BTreeSet<u32>>>,
    /// The copies to make: `from: None` a new replica, `Some(node)` a relocation (the source
    /// drops its copy at the switch).
    pub moves: Vec<Move>,
    /// Routing-weighted load per node (share of routed rows over relative bandwidth), before
    /// and after.
    pub load_before: BTreeMap<String, f64>,
    pub load_after: BTreeMap<String, f64>,
    /// Experts that got a hot replica.
    pub hot: Vec<(u32, u32)>,
    /// Bytes each node holds after the plan.
    pub bytes_after: BTreeMap<String, u64>,
}

impl Plan {
    /// max / mean of a load map (1.0 = perfectly even).
    pub fn imbalance(load: &BTreeMap<String, f64>) -> f64 {
        let n = load.len().max(1) as f64;
        let mean = load.values().sum::<f64>() / n;
        let max = load.values().copied().fold(0.0, f64::max);
        if mean > 0.0 {
            max / mean
        } else {
            1.0
        }
    }
}

/// Why no plan can be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("no node is in service")]
    NoNodes,
    #[error("layer {layer} expert {expert} ({bytes} bytes) fits on no node in service (RAM and disk budgets)")]
    NoRoom { layer: u32, expert: u32, bytes: u64 },
    #[error("{0}")]
    Input(String),
}

struct Node {
    id: String,
    /// Relative bandwidth (1.0 = the mean of those known).
    speed: f64,
    room: u64,
    used: u64,
    load: f64,
    held: BTreeSet<(u32, u32)>,
}

/// Makes a plan (see the module docs).
pub fn plan(state: &ClusterState, input: &PlanInput) -> Result<Plan, PlanError> {
    let (nl, ne) = (input.n_layer, input.n_expert);
    if input.sizes.len() != nl || input.sizes.iter().any(|l| l.len() != ne) {
        return Err(PlanError::Input(format!(
            "sizes must be {nl} layers x {ne} experts"
        )));
    }
    let uniform = input.load.is_empty();
    if !uniform && (input.load.len() != nl || input.load.iter().any(|l| l.len() != ne)) {
        return Err(PlanError::Input(format!(
            "load must be {nl} layers x {ne} experts"
        )));
    }
    // Each expert's share of the routed rows.
    let total: f64 = if uniform {
        (nl * ne) as f64
    } else {
        input.load.iter().flatten().map(|&x| x as f64).sum::<f64>()
    };
    let share = |l: usize, e: usize| -> f64 {
        if total <= 0.0 {
            0.0
        } else if uniform {
            1.0 / total
        } else {
            input.load[l][e] as f64 / total
        }
    };
    let bws: Vec<u64> = state
        .nodes
        .values()
        .filter(|n| n.status.in_service())
        .map(|n| n.caps.mem_bw_mbs)
        .filter(|&b| b > 0)
        .collect();
    let mean_bw = if bws.is_empty() {
        1.0
    } else {
        bws.iter().sum::<u64>() as f64 / bws.len() as f64
    };
    let mut nodes: Vec<Node> = state
        .nodes
        .iter()
        .filter(|(_, n)| n.status.in_service())
        .map(|(id, n)| {
            let room = [n.caps.ram_bytes, n.caps.disk_bytes]
                .into_iter()
                .filter(|&b| b > 0)
                .min()
                .unwrap_or(u64::MAX);
            Node {
                id: id.clone(),
                speed: if n.caps.mem_bw_mbs > 0 {
                    n.caps.mem_bw_mbs as f64 / mean_bw
                } else {
                    1.0
                },
                room,
                used: 0,
                load: 0.0,
                held: BTreeSet::new(),
            }
        })
        .collect();
    if nodes.is_empty() {
        return Err(PlanError::NoNodes);
    }
    let base = input.replicas.clamp(1, nodes.len());
    let mean_share = 1.0 / (nl * ne).max(1) as f64;
    let mut want = vec![vec![base; ne]; nl];
    let mut hot = Vec::new();
    for (l, w) in want.iter_mut().enumerate() {
        for (e, c) in w.iter_mut().enumerate() {
            if !uniform && share(l, e) >= input.hot_factor * mean_share && base < nodes.len() {
                *c = base + 1;
                hot.push((l as u32, e as u32));
            }
        }
    }
    // The current holders in service.
    let mut holders: Vec<Vec<Vec<usize>>> = vec![vec![Vec::new(); ne]; nl];
    for (i, n) in nodes.iter().enumerate() {
        if let Some(rec) = state.nodes.get(&n.id) {
            for (&l, es) in &rec.experts {
                for &e in es {
                    if let Some(h) = holders
                        .get_mut(l as usize)
                        .and_then(|x| x.get_mut(e as usize))
                    {
                        h.push(i);
                    }
                }
            }
        }
    }
    let recompute = |nodes: &mut [Node], holders: &[Vec<Vec<usize>>]| {
        for n in nodes.iter_mut() {
            n.load = 0.0;
            n.used = 0;
            n.held.clear();
        }
        for (l, layer) in holders.iter().enumerate() {
            for (e, h) in layer.iter().enumerate() {
                for &i in h {
                    let per = share(l, e) / h.len() as f64;
                    nodes[i].load += per / nodes[i].speed;
                    nodes[i].used += input.sizes[l][e];
                    nodes[i].held.insert((l as u32, e as u32));
                }
            }
        }
    };
    recompute(&mut nodes, &holders);
    let load_before: BTreeMap<String, f64> = nodes.iter().map(|n| (n.id.clone(), n.load)).collect();
    let current = holders.clone();
    // Trim to the wanted count (keep the first holders: fewest changes), then fill, hottest
    // experts first.
    for (l, layer) in holders.iter_mut().enumerate() {
        for (e, h) in layer.iter_mut().enumerate() {
            h.truncate(want[l][e]);
        }
    }
    recompute(&mut nodes, &holders);
    let mut order: Vec<(usize, usize)> =
        (0..nl).flat_map(|l| (0..ne).map(move |e| (l, e))).collect();
    order.sort_by(|a, b| share(b.0, b.1).total_cmp(&share(a.0, a.1)).then(a.cmp(b)));
    for &(l, e) in &order {
        while holders[l][e].len() < want[l][e] {
            let bytes = input.sizes[l][e];
            let pick = (0..nodes.len())
                .filter(|i| !holders[l][e].contains(i))
                .filter(|&i| nodes[i].used.saturating_add(bytes) <= nodes[i].room)
                .min_by(|&a, &b| {
                    nodes[a]
                        .load
                        .total_cmp(&nodes[b].load)
                        .then(nodes[a].used.cmp(&nodes[b].used))
                        .then(a.cmp(&b))
                });
            let Some(i) = pick else {
                if holders[l][e].is_empty() {
                    return Err(PlanError::NoRoom {
                        layer: l as u32,
                        expert: e as u32,
                        bytes,
                    });
                }
                break; // fewer replicas than wanted: no room for more
            };
            holders[l][e].push(i);
            recompute(&mut nodes, &holders);
        }
    }
    // Balance: move the replica that best closes the gap from the most to the least loaded.
    for _ in 0..(nl * ne * 2).max(16) {
        let mean = nodes.iter().map(|n| n.load).sum::<f64>() / nodes.len() as f64;
        let hi = (0..nodes.len())
            .max_by(|&a, &b| nodes[a].load.total_cmp(&nodes[b].load))
            .unwrap_or(0);
        if nodes[hi].load <= mean * (1.0 + input.tolerance) {
            break;
        }
        let lo = (0..nodes.len())
            .min_by(|&a, &b| nodes[a].load.total_cmp(&nodes[b].load))
            .unwrap_or(0);
        let gap = (nodes[hi].load - nodes[lo].load) / 2.0;
        let best = nodes[hi]
            .held
            .iter()
            .copied()
            .filter(|&(l, e)| !holders[l as usize][e as usize].contains(&lo))
            .filter(|&(l, e)| {
                nodes[lo]
                    .used
                    .saturating_add(input.sizes[l as usize][e as usize])
                    <= nodes[lo].room
            })
            .map(|(l, e)| {
                let per =
                    share(l as usize, e as usize) / holders[l as usize][e as usize].len() as f64;
                ((l, e), per)
            })
            .filter(|(_, per)| *per / nodes[hi].speed < 2.0 * gap)
            .min_by(|a, b| (a.1 - gap).abs().total_cmp(&(b.1 - gap).abs()));
        let Some(((l, e), _)) = best else { break };
        let h = &mut holders[l as usize][e as usize];
        if let Some(pos) = h.iter().position(|&x| x == hi) {
            h[pos] = lo;
        }
        recompute(&mut nodes, &holders);
    }
    // The moves: per expert, new holders; a new holder replaces a dropped one where there
    // is one (a relocation), else it is a new replica.
    // A node being decommissioned is a source first: each of its experts leaves it by a
    // relocation (so it ends up holding nothing and can be removed).
    let leaving: Vec<(&String, &crate::state::NodeRecord)> = state
        .nodes
        .iter()
        .filter(|(_, n)| n.status == crate::state::NodeStatus::Decommissioning)
        .collect();
    let mut moves = Vec::new();
    for l in 0..nl {
        for e in 0..ne {
            let was: BTreeSet<usize> = current[l][e].iter().copied().collect();
            let now: BTreeSet<usize> = holders[l][e].iter().copied().collect();
            let mut gone: Vec<String> =
                was.difference(&now).map(|&i| nodes[i].id.clone()).collect();
            gone.extend(
                leaving
                    .iter()
                    .filter(|(_, n)| {
                        n.experts
                            .get(&(l as u32))
                            .is_some_and(|s| s.contains(&(e as u32)))
                    })
                    .map(|(id, _)| (*id).clone()),
            );
            for &to in now.difference(&was) {
                moves.push(Move {
                    layer: l as u32,
                    expert: e as u32,
                    from: gone.pop(),
                    to: nodes[to].id.clone(),
                });
            }
        }
    }
    let mut target: BTreeMap<String, BTreeMap<u32, BTreeSet<u32>>> = nodes
        .iter()
        .map(|n| (n.id.clone(), BTreeMap::new()))
        .collect();
    for n in &nodes {
        let t = target.entry(n.id.clone()).or_default();
        for &(l, e) in &n.held {
            t.entry(l).or_default().insert(e);
        }
    }
    Ok(Plan {
        target,
        moves,
        load_before,
        load_after: nodes.iter().map(|n| (n.id.clone(), n.load)).collect(),
        hot,
        bytes_after: nodes.iter().map(|n| (n.id.clone(), n.used)).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{NodeCaps, NodeRecord, NodeStatus};

    fn node(experts: &[(u32, &[u32])]) -> NodeRecord {
        NodeRecord {
            raft_id: 0,
            addr: "127.0.0.1:1".into(),
            caps: NodeCaps::default(),
            status: NodeStatus::Up,
            last_heartbeat_ms: 0,
            experts: experts
                .iter()
                .map(|(l, es)| (*l, es.iter().copied().collect()))
                .collect(),
            applied: 0,
        }
    }

    /// 2 layers x 8 experts, all on n1 and n2 (two replicas), n3 and n4 empty.
    fn two_full_two_empty() -> ClusterState {
        let mut s = ClusterState::default();
        let all: Vec<u32> = (0..8).collect();
        for id in ["n1", "n2"] {
            s.nodes.insert(id.into(), node(&[(0, &all), (1, &all)]));
        }
        for id in ["n3", "n4"] {
            s.nodes.insert(id.into(), node(&[]));
        }
        s
    }

    fn input(load: Vec<Vec<u64>>) -> PlanInput {
        PlanInput {
            n_layer: 2,
            n_expert: 8,
            sizes: vec![vec![1000; 8]; 2],
            load,
            ..PlanInput::default()
        }
    }

    fn check_valid(s: &ClusterState, p: &Plan, inp: &PlanInput) {
        // Every expert held, by distinct nodes, and the moves lead from the state to it.
        for l in 0..inp.n_layer as u32 {
            for e in 0..inp.n_expert as u32 {
                let n = p
                    .target
                    .values()
                    .filter(|t| t.get(&l).is_some_and(|x| x.contains(&e)))
                    .count();
                assert!(n >= 1, "layer {l} expert {e} unheld");
            }
        }
        let mut after: BTreeMap<String, BTreeSet<(u32, u32)>> = s
            .nodes
            .iter()
            .map(|(id, n)| {
                let set = n
                    .experts
                    .iter()
                    .flat_map(|(l, es)| es.iter().map(move |e| (*l, *e)))
                    .collect();
                (id.clone(), set)
            })
            .collect();
        for m in &p.moves {
            assert!(after.get_mut(&m.to).unwrap().insert((m.layer, m.expert)));
            if let Some(f) = &m.from {
                assert!(after.get_mut(f).unwrap().remove(&(m.layer, m.expert)));
            }
        }
        for (id, t) in &p.target {
            let want: BTreeSet<(u32, u32)> = t
                .iter()
                .flat_map(|(l, es)| es.iter().map(move |e| (*l, *e)))
                .collect();
            // Holders trimmed (over-replicated) are not moves: target ⊆ after.
            assert!(want.is_subset(&after[id]), "{id}");
        }
    }

    #[test]
    fn adding_two_nodes_spreads_the_load_within_tolerance_with_few_moves() {
        let s = two_full_two_empty();
        let inp = input(Vec::new());
        let p = plan(&s, &inp).unwrap();
        check_valid(&s, &p, &inp);
        assert!((Plan::imbalance(&p.load_before) - 2.0).abs() < 1e-9);
        let after = Plan::imbalance(&p.load_after);
        assert!(after <= 1.1 + 1e-9, "max/mean {after}");
        eprintln!(
            "uniform: max/mean 2.000 -> {after:.3}, {} moves",
            p.moves.len()
        );
        // 32 replicas over 4 nodes: 16 relocations are the least that balances it.
        assert_eq!(p.moves.len(), 16, "{:?}", p.moves);
        assert!(p.moves.iter().all(|m| m.from.is_some()));
        assert!(p.hot.is_empty());
    }

    #[test]
    fn a_skewed_histogram_gives_hot_experts_an_extra_replica() {
        let s = two_full_two_empty();
        let mut load = vec![vec![10u64; 8]; 2];
        load[0][3] = 400;
        load[1][5] = 250;
        let inp = input(load);
        let p = plan(&s, &inp).unwrap();
        check_valid(&s, &p, &inp);
        assert_eq!(p.hot, vec![(0, 3), (1, 5)]);
        for (l, e) in [(0u32, 3u32), (1, 5)] {
            let n = p
                .target
                .values()
                .filter(|t| t.get(&l).is_some_and(|x| x.contains(&e)))
                .count();
            assert_eq!(n, 3, "hot expert {l}/{e}");
        }
        let after = Plan::imbalance(&p.load_after);
        assert!(after < Plan::imbalance(&p.load_before), "{after}");
        eprintln!(
            "skewed: max/mean {:.3} -> {:.3}, {} moves",
            Plan::imbalance(&p.load_before),
            after,
            p.moves.len()
        );
    }

    #[test]
    fn a_decommissioned_node_is_the_source_of_every_copy_of_its_experts() {
        let mut s = two_full_two_empty();
        s.nodes.get_mut("n1").unwrap().status = NodeStatus::Decommissioning;
        let inp = PlanInput {
            tolerance: f64::INFINITY,
            ..input(Vec::new())
        };
        let p = plan(&s, &inp).unwrap();
        check_valid(&s, &p, &inp);
        assert!(!p.target.contains_key("n1"));
        // n2 keeps its copies; each expert's second copy leaves n1 for n3 or n4.
        assert_eq!(p.moves.len(), 16, "{:?}", p.moves);
        assert!(p
            .moves
            .iter()
            .all(|m| m.from.as_deref() == Some("n1") && m.to != "n2"));
    }

    #[test]
    fn budgets_are_respected_and_a_drained_node_gets_nothing() {
        let mut s = two_full_two_empty();
        s.nodes.get_mut("n3").unwrap().caps.ram_bytes = 3000;
        s.nodes.get_mut("n4").unwrap().status = NodeStatus::Draining;
        let inp = input(Vec::new());
        let p = plan(&s, &inp).unwrap();
        check_valid(&s, &p, &inp);
        assert!(p.bytes_after["n3"] <= 3000);
        assert!(!p.target.contains_key("n4"));
        assert!(p.moves.iter().all(|m| m.to != "n4"));
        // Nowhere to go at all.
        let mut tiny = two_full_two_empty();
        for n in tiny.nodes.values_mut() {
            n.experts.clear();
            n.caps.disk_bytes = 500;
        }
        assert!(matches!(plan(&tiny, &inp), Err(PlanError::NoRoom { .. })));
    }

    #[test]
    fn a_balanced_placement_moves_nothing() {
        let s = two_full_two_empty();
        let inp = input(Vec::new());
        let p = plan(&s, &inp).unwrap();
        let mut s2 = s.clone();
        for n in s2.nodes.values_mut() {
            n.experts.clear();
        }
        for (id, t) in &p.target {
            s2.nodes.get_mut(id).unwrap().experts = t.clone();
        }
        let again = plan(&s2, &inp).unwrap();
        assert!(again.moves.is_empty(), "{:?}", again.moves);
    }
}
