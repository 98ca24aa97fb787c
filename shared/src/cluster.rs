//! The cluster file: a static placement of a bundle's routed experts on nodes (`--cluster
//! FILE`), written by hand or by `ternfleet cluster plan`. The control-plane issue replaces it
//! with Raft-replicated state; until then every process of a cluster reads the same file.
//!
//! ```toml
//! coordinators = ["coordinator"]     # ids allowed to call the nodes (default: coordinator)
//! bundle = "3f5a…"                   # optional: the manifest's SHA-256 the plan was made for
//!
//! [[node]]
//! id = "n1"                          # the id in the node's certificate
//! addr = "127.0.0.1:7401"            # its QUIC address (host:port)
//! experts = ["0-17:0-5,12", "18:*"]  # LAYERS:EXPERTS, each a list of numbers and ranges or *
//! ```
//!
//! An expert held by several nodes has replicas: the coordinator sends its rows to one
//! ([`Placement::holders`], the first listed is preferred) and to another when that one fails.

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::bundle::Manifest;

/// Errors reading or checking a cluster file.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("{path}: {msg}")]
    File { path: String, msg: String },
    #[error("cluster file: {0}")]
    Invalid(String),
}

fn invalid(msg: impl Into<String>) -> ClusterError {
    ClusterError::Invalid(msg.into())
}

/// The file as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// Ids whose certificates may call the nodes.
    #[serde(default = "default_coordinators")]
    pub coordinators: Vec<String>,
    /// SHA-256 of the bundle's manifest the placement was planned for (checked when set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<String>,
    #[serde(rename = "node", default)]
    pub nodes: Vec<NodeEntry>,
}

fn default_coordinators() -> Vec<String> {
    vec!["coordinator".into()]
}

/// One node of the file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    pub id: String,
    /// `host:port` of its QUIC endpoint.
    pub addr: String,
    /// `LAYERS:EXPERTS` specs (`3:0-7,9`, `0-47:*`).
    #[serde(default)]
    pub experts: Vec<String>,
}

/// Checks a node or coordinator id: 1 to 63 of `a-z 0-9 -`, starting with a letter, not
/// ending with `-` (it is the DNS name in the certificate; an all-digit name is not one).
pub fn check_id(id: &str) -> Result<(), String> {
    let ok = id.as_bytes().first().is_some_and(u8::is_ascii_lowercase)
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "id {id:?}: use 1 to 63 lowercase letters, digits and '-', starting with a letter and not ending with '-'"
        ))
    }
}

/// Parses `a-b,c,*` into a sorted set within `0..n`.
fn parse_set(s: &str, n: usize, what: &str) -> Result<BTreeSet<usize>, String> {
    let mut out = BTreeSet::new();
    for part in s.split(',').map(str::trim) {
        if part == "*" {
            out.extend(0..n);
            continue;
        }
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let num = |t: &str| {
            t.parse::<usize>()
                .map_err(|_| format!("{what} {part:?}: not a number, range or *"))
        };
        let (a, b) = (num(a)?, num(b)?);
        if a > b || b >= n {
            return Err(format!("{what} {part:?}: outside 0..{n}"));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// `*` for all `n` experts, else [`format_ranges`].
fn format_set(s: &BTreeSet<usize>, n: usize) -> String {
    if s.len() == n && n > 0 {
        return "*".into();
    }
    format_ranges(s.iter().copied())
}

/// `0-5,9,12-13` for ascending numbers.
pub fn format_ranges(s: impl IntoIterator<Item = usize>) -> String {
    let mut parts = Vec::new();
    let mut it = s.into_iter().peekable();
    while let Some(a) = it.next() {
        let mut b = a;
        while it.peek() == Some(&(b + 1)) {
            b += 1;
            it.next();
        }
        parts.push(if a == b {
            a.to_string()
        } else {
            format!("{a}-{b}")
        });
    }
    parts.join(",")
}

/// One node of a placement.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacedNode {
    pub id: String,
    pub addr: String,
    /// Per layer, the experts it holds.
    pub experts: Vec<BTreeSet<usize>>,
}

/// A checked placement for a model of `n_layer` layers of `n_expert` routed experts.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub coordinators: Vec<String>,
    pub nodes: Vec<PlacedNode>,
    /// `holders[layer][expert]`: node indices, preferred first.
    holders: Vec<Vec<Vec<usize>>>,
}

impl ClusterFile {
    /// Reads and parses a file (not yet checked against a model: [`ClusterFile::placement`]).
    pub fn read(path: &Path) -> Result<ClusterFile, ClusterError> {
        let file_err = |msg: String| ClusterError::File {
            path: path.display().to_string(),
            msg,
        };
        let meta = std::fs::metadata(path).map_err(|e| file_err(format!("cannot read it: {e}")))?;
        if meta.len() > 16 << 20 {
            return Err(file_err(format!(
                "{} bytes, the limit is 16 MiB",
                meta.len()
            )));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| file_err(format!("cannot read it: {e}")))?;
        toml::from_str(&text).map_err(|e| file_err(e.to_string()))
    }

    /// The file's text.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string_pretty(self).unwrap_or_default();
        format!(
            "# ternfleet cluster file: which node holds which routed experts (LAYERS:EXPERTS).\n\
             # Written by `ternfleet cluster plan`; every coordinator and node reads it.\n{body}"
        )
    }

    /// Checks ids and addresses, and places every (layer, expert) of a model with
    /// `n_layer` layers of `n_expert` routed experts; every expert needs at least one holder.
    pub fn placement(&self, n_layer: usize, n_expert: usize) -> Result<Placement, ClusterError> {
        self.build(n_layer, n_expert, true)
    }

    /// As [`ClusterFile::placement`], but an expert may have no holder (the replicated
    /// placement while an operator drains the last copy, or nodes are down: calls to it
    /// fail as unavailable instead of the whole placement being refused), and the file may
    /// list no node.
    pub fn placement_with_gaps(
        &self,
        n_layer: usize,
        n_expert: usize,
    ) -> Result<Placement, ClusterError> {
        self.build(n_layer, n_expert, false)
    }

    fn build(
        &self,
        n_layer: usize,
        n_expert: usize,
        require_cover: bool,
    ) -> Result<Placement, ClusterError> {
        if self.coordinators.is_empty() {
            return Err(invalid("coordinators is empty: name at least one id"));
        }
        for c in &self.coordinators {
            check_id(c).map_err(invalid)?;
        }
        if self.nodes.is_empty() && require_cover {
            return Err(invalid("no [[node]] entries"));
        }
        let mut seen = BTreeSet::new();
        let mut nodes = Vec::new();
        let mut holders = vec![vec![Vec::new(); n_expert]; n_layer];
        for (i, n) in self.nodes.iter().enumerate() {
            check_id(&n.id).map_err(|e| invalid(format!("node {}: {e}", i + 1)))?;
            if !seen.insert(n.id.clone()) || self.coordinators.contains(&n.id) {
                return Err(invalid(format!("id {:?} is used twice", n.id)));
            }
            match n.addr.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {}
                _ => {
                    return Err(invalid(format!(
                        "node {}: addr {:?} is not host:port",
                        n.id, n.addr
                    )))
                }
            }
            let mut experts = vec![BTreeSet::new(); n_layer];
            for spec in &n.experts {
                let (l, e) = spec.split_once(':').ok_or_else(|| {
                    invalid(format!(
                        "node {}: experts {spec:?} is not LAYERS:EXPERTS",
                        n.id
                    ))
                })?;
                let ctx = |e: String| invalid(format!("node {}: {e}", n.id));
                let ls = parse_set(l, n_layer, "layers").map_err(ctx)?;
                let es = parse_set(e, n_expert, "experts").map_err(ctx)?;
                for &l in &ls {
                    experts[l].extend(es.iter().copied());
                }
            }
            for (l, es) in experts.iter().enumerate() {
                for &e in es {
                    holders[l][e].push(i);
                }
            }
            nodes.push(PlacedNode {
                id: n.id.clone(),
                addr: n.addr.clone(),
                experts,
            });
        }
        // Spread the preferred replica: rotate each expert's holders by (layer + expert), so
        // with replicas every node is preferred for its share of the experts.
        for (l, layer) in holders.iter_mut().enumerate() {
            for (e, h) in layer.iter_mut().enumerate() {
                if h.is_empty() {
                    if !require_cover {
                        continue;
                    }
                    return Err(invalid(format!(
                        "layer {l} expert {e} is held by no node (every expert needs one)"
                    )));
                }
                let k = (l + e) % h.len();
                h.rotate_left(k);
            }
        }
        Ok(Placement {
            coordinators: self.coordinators.clone(),
            nodes,
            holders,
        })
    }

    /// Plans a placement of `man`'s routed experts on `nodes` (id, address), each expert on
    /// `replicas` distinct nodes, balanced by expert bytes (largest first, each to the
    /// nodes holding the fewest bytes so far).
    pub fn plan(
        man: &Manifest,
        nodes: &[(String, String)],
        replicas: usize,
    ) -> Result<ClusterFile, ClusterError> {
        if replicas == 0 || replicas > nodes.len() {
            return Err(invalid(format!(
                "--replicas {replicas}: needs 1 to {} (the number of nodes)",
                nodes.len()
            )));
        }
        let mut by_size: Vec<_> = man.experts.iter().collect();
        by_size.sort_by_key(|e| (std::cmp::Reverse(e.part.bytes), e.layer, e.expert));
        let mut load = vec![0u64; nodes.len()];
        let mut held = vec![vec![BTreeSet::new(); man.n_layer]; nodes.len()];
        for e in by_size {
            let mut order: Vec<usize> = (0..nodes.len()).collect();
            order.sort_by_key(|&i| (load[i], i));
            for &i in &order[..replicas] {
                load[i] += e.part.bytes;
                if let Some(layer) = held[i].get_mut(e.layer) {
                    layer.insert(e.expert);
                }
            }
        }
        let n_expert = man.moe.n_expert;
        let file = ClusterFile {
            coordinators: default_coordinators(),
            bundle: None,
            nodes: nodes
                .iter()
                .zip(&held)
                .map(|((id, addr), layers)| NodeEntry {
                    id: id.clone(),
                    addr: addr.clone(),
                    experts: layers
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| !s.is_empty())
                        .map(|(l, s)| format!("{l}:{}", format_set(s, n_expert)))
                        .collect(),
                })
                .collect(),
        };
        file.placement(man.n_layer, n_expert)?;
        Ok(file)
    }
}

impl Placement {
    /// Nodes holding `expert` of `layer`, preferred first (empty when out of range).
    pub fn holders(&self, layer: usize, expert: usize) -> &[usize] {
        self.holders
            .get(layer)
            .and_then(|l| l.get(expert))
            .map_or(&[], Vec::as_slice)
    }

    /// The node with this id.
    pub fn node(&self, id: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    /// Layers placed.
    pub fn n_layer(&self) -> usize {
        self.holders.len()
    }
}

/// Which node each of one token's experts goes to: the fewest nodes that hold them all (greedy
/// set cover: the node holding most of the experts not yet placed, then the next), so experts
/// that fire together and sit on one node cost one round trip. `holders(i)` lists the live
/// nodes holding the token's expert `i`, preferred first; ties go to the node met first when
/// the experts' holder lists are read in order, each rotated left by `turn` (advance it per
/// step and replicas share the load). Greedy, so not always the fewest (the shared test
/// shows a case). Returns, per expert, its node; `None` where it has no holder.
pub fn cover<'a>(
    n: usize,
    holders: impl Fn(usize) -> &'a [usize],
    turn: usize,
) -> Vec<Option<usize>> {
    let mut out = vec![None; n];
    let mut left: Vec<usize> = (0..n).filter(|&i| !holders(i).is_empty()).collect();
    let mut order: Vec<usize> = Vec::new();
    while !left.is_empty() {
        // Candidates in preference order (first seen wins a tie).
        order.clear();
        for &i in &left {
            let h = holders(i);
            let k = turn % h.len();
            for &node in h[k..].iter().chain(&h[..k]) {
                if !order.contains(&node) {
                    order.push(node);
                }
            }
        }
        let count = |node: usize| left.iter().filter(|&&i| holders(i).contains(&node)).count();
        let mut best = order[0];
        let mut best_n = count(best);
        for &node in &order[1..] {
            let c = count(node);
            if c > best_n {
                (best, best_n) = (node, c);
            }
        }
        left.retain(|&i| {
            if holders(i).contains(&best) {
                out[i] = Some(best);
                false
            } else {
                true
            }
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cover_takes_the_fewest_nodes_and_rotates_ties() {
        // Experts 0..3 of one token: 0 on {a=0, b=1}, 1 on {b}, 2 and 3 on {c=2}.
        let h: Vec<Vec<usize>> = vec![vec![0, 1], vec![1], vec![2], vec![2]];
        // b takes 0 and 1 (a, preferred for 0, holds one), then c takes 2 and 3: two nodes.
        assert_eq!(
            cover(4, |i| &h[i], 0),
            vec![Some(1), Some(1), Some(2), Some(2)]
        );
        // Greedy, not exact: with 3 also on a, a ties b and c and is met first, so three
        // nodes are called where two (b, c) would do.
        let g: Vec<Vec<usize>> = vec![vec![0, 1], vec![1], vec![2], vec![0, 2]];
        assert_eq!(
            cover(4, |i| &g[i], 0),
            vec![Some(0), Some(1), Some(2), Some(0)]
        );
        // One expert on two replicas: the turn picks which.
        let r: Vec<Vec<usize>> = vec![vec![4, 7]];
        assert_eq!(cover(1, |i| &r[i], 0), vec![Some(4)]);
        assert_eq!(cover(1, |i| &r[i], 1), vec![Some(7)]);
        assert_eq!(cover(1, |i| &r[i], 2), vec![Some(4)]);
        // No holder: None, the rest still placed.
        let g: Vec<Vec<usize>> = vec![vec![], vec![3]];
        assert_eq!(cover(2, |i| &g[i], 5), vec![None, Some(3)]);
    }

    fn file(text: &str) -> Result<ClusterFile, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn specs_place_experts_and_replicas_rotate_the_preferred_holder() {
        let f = file(
            r#"
            [[node]]
            id = "n1"
            addr = "127.0.0.1:7401"
            experts = ["0-1:0-3"]
            [[node]]
            id = "n2"
            addr = "h2:7402"
            experts = ["0:2-3", "1:*"]
            "#,
        )
        .unwrap();
        let p = f.placement(2, 4).unwrap();
        assert_eq!(p.coordinators, ["coordinator"]);
        assert_eq!(p.holders(0, 0), [0]);
        // Layer 0 expert 2: held by both; (0 + 2) % 2 = 0 → n1 first. Expert 3: n2 first.
        assert_eq!(p.holders(0, 2), [0, 1]);
        assert_eq!(p.holders(0, 3), [1, 0]);
        assert_eq!(p.holders(1, 0), [1, 0]);
        assert!(p.holders(5, 0).is_empty());
    }

    #[test]
    fn an_unplaced_expert_and_bad_specs_are_named() {
        let f = file("[[node]]\nid = \"n1\"\naddr = \"a:1\"\nexperts = [\"0:0-2\"]\n").unwrap();
        let e = f.placement(1, 4).unwrap_err().to_string();
        assert!(e.contains("layer 0 expert 3 is held by no node"), "{e}");
        for (spec, want) in [
            ("0:0-9", "outside 0..4"),
            ("0:x", "not a number"),
            ("0-3", "not LAYERS:EXPERTS"),
            ("2:1", "outside 0..1"),
        ] {
            let f = ClusterFile {
                nodes: vec![NodeEntry {
                    id: "n1".into(),
                    addr: "a:1".into(),
                    experts: vec![spec.into()],
                }],
                ..file("").unwrap()
            };
            let e = f.placement(1, 4).unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
        let dup = file("[[node]]\nid=\"n1\"\naddr=\"a:1\"\nexperts=[\"0:*\"]\n[[node]]\nid=\"n1\"\naddr=\"a:2\"\n")
            .unwrap();
        assert!(dup
            .placement(1, 4)
            .unwrap_err()
            .to_string()
            .contains("used twice"));
        let bad = file("[[node]]\nid=\"N1\"\naddr=\"a:1\"\n").unwrap();
        assert!(bad
            .placement(1, 4)
            .unwrap_err()
            .to_string()
            .contains("lowercase"));
        let noport = file("[[node]]\nid=\"n1\"\naddr=\"a\"\nexperts=[\"0:*\"]\n").unwrap();
        assert!(noport
            .placement(1, 4)
            .unwrap_err()
            .to_string()
            .contains("host:port"));
        assert!(file("[[node]]\nid=\"n1\"\naddr=\"a:1\"\nrole=\"x\"\n").is_err());
    }

    #[test]
    fn sets_format_back_to_what_they_parse_from() {
        for s in ["0-5,9,12-13", "3", "*", "0,2,4"] {
            let set = parse_set(s, 16, "experts").unwrap();
            let back = format_set(&set, 16);
            assert_eq!(
                parse_set(&back, 16, "experts").unwrap(),
                set,
                "{s} → {back}"
            );
        }
        assert_eq!(format_set(&(0..16).collect(), 16), "*");
    }
}
