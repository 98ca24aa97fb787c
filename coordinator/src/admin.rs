//! The admin API (`ternfleet.v1.Admin`, proto/ternfleet/v1/admin.proto) of a seated
//! coordinator: what `ternfleet ctl` talks to. Always over mutual TLS on its own address
//! (`serve --admin`, default 127.0.0.1:50052): the client's certificate must come from the
//! cluster CA and name [`OPERATOR`]. The inference gRPC API may run without TLS behind API
//! keys, so the two do not share a port.
//!
//! Reads are linearizable (a Raft ReadIndex through the seat, answered once the seat applied
//! that far); writes are proposed through the seat (forwarded to the leader) and answered
//! with their outcome: a command the state machine refuses is `FAILED_PRECONDITION` with its
//! reason, no leader or no quorum within the control plane's timeout is `UNAVAILABLE`.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use tonic::{Request, Response, Status};

use ternfleet_control::{ClusterState, Command, ControlError, Outcome};
use ternfleet_shared::cluster::format_ranges;
use ternfleet_shared::proto::v1::admin_server::{Admin, AdminServer};
use ternfleet_shared::proto::v1::{
    ListNodesRequest, ListNodesResponse, Member, Node, NodeActionResponse, NodePlacement,
    NodeRequest, SaveSnapshotRequest, SaveSnapshotResponse, ShowPlacementRequest,
    ShowPlacementResponse, StatusRequest, StatusResponse,
};

use crate::seat::Seat;

/// The certificate id the admin API accepts.
pub const OPERATOR: &str = "operator";

/// The admin service over a seat.
pub struct AdminService {
    pub seat: Arc<Seat>,
    /// The bundle's shape (for placement gaps).
    pub n_layer: usize,
    pub n_expert: usize,
    /// `sizes[layer][expert]`: bytes of each routed expert's blob (the bundle manifest).
    pub sizes: Vec<Vec<u64>>,
}

fn control_status(e: ControlError) -> Status {
    match e {
        ControlError::Timeout(_) | ControlError::NotLeader { .. } | ControlError::Stopped(_) => {
            Status::unavailable(e.to_string())
        }
        ControlError::Busy(_) => Status::resource_exhausted(e.to_string()),
        ControlError::Failed(m) => Status::internal(m),
    }
}

fn check_operator<T>(req: &Request<T>) -> Result<(), Status> {
    let certs = req
        .peer_certs()
        .ok_or_else(|| Status::unauthenticated("no client certificate"))?;
    let leaf = certs
        .first()
        .ok_or_else(|| Status::unauthenticated("empty certificate chain"))?;
    if ternfleet_shared::mtls::cert_names(leaf, OPERATOR) {
        Ok(())
    } else {
        Err(Status::permission_denied(format!(
            "the admin API takes the {OPERATOR:?} certificate (ternfleet certs issue --name {OPERATOR})"
        )))
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Experts a node holds.
fn count(n: &ternfleet_control::NodeRecord) -> u64 {
    n.experts.values().map(|s| s.len() as u64).sum()
}

/// `LAYER:E,E-E` specs of a per-layer set.
fn specs<'a>(layers: impl Iterator<Item = (u32, &'a BTreeSet<u32>)>) -> Vec<String> {
    layers
        .filter(|(_, s)| !s.is_empty())
        .map(|(l, s)| format!("{l}:{}", format_ranges(s.iter().map(|&e| e as usize))))
        .collect()
}

/// Milliseconds since a node's last committed heartbeat (0: none yet).
fn heartbeat_age(n: &ternfleet_control::NodeRecord, now: u64) -> u64 {
    if n.last_heartbeat_ms > 0 {
        now.saturating_sub(n.last_heartbeat_ms)
    } else {
        0
    }
}

impl AdminService {
    async fn state(&self) -> Result<Arc<ClusterState>, Status> {
        self.seat.member.handle.read().await.map_err(control_status)
    }

    /// The seat's Raft status (term, leader, indexes, members).
    async fn replica(&self) -> Result<ternfleet_control::replica::ReplicaStatus, Status> {
        self.seat
            .member
            .handle
            .status()
            .await
            .map_err(control_status)
    }

    /// An operator's command on one node (`req` names it), answered with its status after.
    async fn node_command(
        &self,
        req: Request<NodeRequest>,
        cmd: impl FnOnce(String) -> Command,
    ) -> Result<Response<NodeActionResponse>, Status> {
        check_operator(&req)?;
        let id = req.into_inner().id;
        ternfleet_shared::cluster::check_id(&id).map_err(Status::invalid_argument)?;
        let outcome = self
            .seat
            .member
            .handle
            .propose(cmd(id.clone()))
            .await
            .map_err(control_status)?;
        let version = match outcome {
            Outcome::Rejected(why) => return Err(Status::failed_precondition(why)),
            Outcome::Applied { placement_version }
            | Outcome::MoveStarted {
                placement_version, ..
            }
            | Outcome::MovesStarted {
                placement_version, ..
            } => placement_version,
        };
        // The node's status as of this command (a read through the leader: the seat may not
        // have applied it yet when the proposal is answered).
        let state = self.state().await?;
        Ok(Response::new(NodeActionResponse {
            status: state
                .nodes
                .get(&id)
                .map_or("removed", |n| n.status.name())
                .to_string(),
            id,
            placement_version: version,
            moves: Vec::new(),
        }))
    }

    /// Refuses to take a node out of service when the other holders of some of its experts
    /// are all marked down (the state machine counts a down node as a holder: it may return):
    /// the experts would be served by no one until it does. Checked against the state read
    /// just before the proposal; a node marked down between the read and the commit is not
    /// caught.
    async fn check_live_holders(
        &self,
        req: &Request<NodeRequest>,
        what: &str,
        keeps_sole: bool,
    ) -> Result<(), Status> {
        check_operator(req)?;
        let id = &req.get_ref().id;
        let state = self.state().await?;
        match state.uncovered_without(id, keeps_sole) {
            Some(why) => Err(Status::failed_precondition(format!("{what} {id} {why}"))),
            None => Ok(()),
        }
    }

    /// What the coordinator routed: rows per expert and recent tokens' experts, by layer.
    fn routed(&self) -> crate::remote::RoutingStats {
        self.seat
            .routed
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default()
    }

    /// A plan over `state` by the routing observed so far (uniform before any); zero or
    /// non-finite options take the planner's defaults.
    fn plan(
        &self,
        state: &ClusterState,
        replicas: u32,
        hot_factor: f64,
        tolerance: f64,
        colocate_min: f64,
    ) -> Result<ternfleet_control::planner::Plan, Status> {
        use ternfleet_control::planner::{plan, PlanInput};
        let defaults = PlanInput::default();
        let pick = |v: f64, d: f64| if v > 0.0 && v.is_finite() { v } else { d };
        let routed = self.routed();
        let routed_rows: u64 = routed.rows.iter().flatten().sum();
        let mut load_full = vec![vec![0u64; self.n_expert]; self.n_layer];
        for (l, row) in routed.rows.iter().enumerate().take(self.n_layer) {
            for (e, &c) in row.iter().enumerate().take(self.n_expert) {
                load_full[l][e] = c;
            }
        }
        let mut samples = routed.recent;
        if samples.iter().all(Vec::is_empty) {
            samples.clear();
        } else {
            samples.resize(self.n_layer, Vec::new());
        }
        let input = PlanInput {
            n_layer: self.n_layer,
            n_expert: self.n_expert,
            sizes: self.sizes.clone(),
            load: if routed_rows > 0 {
                load_full
            } else {
                Vec::new()
            },
            replicas: if replicas > 0 {
                replicas as usize
            } else {
                defaults.replicas
            },
            hot_factor: pick(hot_factor, defaults.hot_factor),
            tolerance: if tolerance.is_infinite() {
                tolerance
            } else {
                pick(tolerance, defaults.tolerance)
            },
            samples,
            // Negative: never co-locate; 0: the default.
            colocate_min: if colocate_min < 0.0 {
                f64::INFINITY
            } else {
                pick(colocate_min, defaults.colocate_min)
            },
        };
        plan(state, &input).map_err(|e| Status::failed_precondition(e.to_string()))
    }

    /// Starts `moves` in one `begin_moves` (all or none), guarded by the placement version
    /// they were planned at. The ids of the moves started.
    async fn start_moves(
        &self,
        state: &ClusterState,
        moves: &[ternfleet_control::Move],
    ) -> Result<Vec<u64>, Status> {
        if moves.is_empty() {
            return Ok(Vec::new());
        }
        if let Some((level, id)) = state.min_level().filter(|(l, _)| *l < 2) {
            let why = match state.nodes.get(id) {
                Some(n) if n.raft_id == 0 => format!("node {id} has not joined yet"),
                _ => format!(
                    "node {id} runs a release of command level {level}, which cannot apply moves: upgrade every node first"
                ),
            };
            return Err(Status::failed_precondition(why));
        }
        let cmd = Command::BeginMoves {
            moves: moves.to_vec(),
            expect_version: Some(state.placement_version),
        };
        let outcome = self
            .seat
            .member
            .handle
            .propose(cmd)
            .await
            .map_err(control_status)?;
        match outcome {
            Outcome::MovesStarted { first, count, .. } => {
                tracing::info!(moves = count, "admin: started {count} moves");
                Ok((first..first + count).collect())
            }
            Outcome::Rejected(why) => Err(Status::failed_precondition(why)),
            other => Err(Status::internal(format!("begin_moves answered {other:?}"))),
        }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn status(
        &self,
        req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        check_operator(&req)?;
        let state = self.state().await?;
        let st = self.replica().await?;
        let now = now_ms();
        let mut members = Vec::new();
        let roles = st
            .voters
            .iter()
            .map(|&r| (r, "voter"))
            .chain(st.learners.iter().map(|&r| (r, "learner")));
        for (raft, role) in roles {
            let (id, addr) = state
                .raft_member(raft)
                .unwrap_or_else(|| (format!("raft-{raft}"), String::new()));
            let node = state.nodes.get(&id);
            let applied = match node {
                Some(n) => n.applied,
                None if raft == st.id => st.applied,
                None => 0,
            };
            members.push(Member {
                role: role.into(),
                state: node.map_or("seat", |n| n.status.name()).into(),
                kind: if node.is_some() {
                    "node"
                } else {
                    "coordinator"
                }
                .into(),
                leader: st.leader == Some(raft),
                addr,
                experts: node.map_or(0, count),
                ram_bytes: node.map_or(0, |n| n.caps.ram_bytes),
                heartbeat_age_ms: node.map_or(0, |n| heartbeat_age(n, now)),
                applied,
                lag: st.commit.saturating_sub(applied),
                id,
            });
        }
        members.sort_by(|a, b| (&a.kind, &a.id).cmp(&(&b.kind, &b.id)));
        Ok(Response::new(StatusResponse {
            leader: st
                .leader
                .and_then(|l| state.raft_member(l))
                .map(|(id, _)| id)
                .unwrap_or_default(),
            term: st.term,
            commit: st.commit,
            applied: st.applied,
            placement_version: state.placement_version,
            members,
            bundle: state.bundle.clone().unwrap_or_default(),
            coordinator: self.seat.id().to_string(),
            moves: state.moves.len() as u64,
        }))
    }

    async fn list_nodes(
        &self,
        req: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        check_operator(&req)?;
        let state = self.state().await?;
        let st = self.replica().await?;
        let now = now_ms();
        let nodes = state
            .nodes
            .iter()
            .map(|(id, n)| Node {
                id: id.clone(),
                addr: n.addr.clone(),
                status: n.status.name().into(),
                kernels: n.caps.kernels.clone(),
                experts: count(n),
                ram_bytes: n.caps.ram_bytes,
                disk_bytes: n.caps.disk_bytes,
                heartbeat_age_ms: heartbeat_age(n, now),
                voter: st.voters.contains(&n.raft_id),
            })
            .collect();
        Ok(Response::new(ListNodesResponse {
            nodes,
            placement_version: state.placement_version,
        }))
    }

    async fn drain(
        &self,
        req: Request<NodeRequest>,
    ) -> Result<Response<NodeActionResponse>, Status> {
        self.check_live_holders(&req, "draining", false).await?;
        self.node_command(req, |id| Command::Drain { id }).await
    }

    async fn recommission(
        &self,
        req: Request<NodeRequest>,
    ) -> Result<Response<NodeActionResponse>, Status> {
        self.node_command(req, |id| Command::Recommission { id })
            .await
    }

    /// Decommission: the node stops taking experts (it serves those only it holds), and its
    /// experts are re-replicated by moves off it (resumable: asked again, it starts what is
    /// missing or reports the moves still in flight). `Remove` takes it out once they are
    /// done.
    async fn decommission(
        &self,
        req: Request<NodeRequest>,
    ) -> Result<Response<NodeActionResponse>, Status> {
        let replicas = req.get_ref().replicas;
        self.check_live_holders(&req, "decommissioning", true)
            .await?;
        let mut r = self
            .node_command(req, |id| Command::Decommission { id })
            .await?
            .into_inner();
        let state = self.state().await?;
        let id = r.id.clone();
        let involved = |m: &ternfleet_control::Move| m.from.as_deref() == Some(id.as_str());
        let in_flight: Vec<u64> = state
            .moves
            .iter()
            .filter(|(_, m)| involved(m))
            .map(|(&k, _)| k)
            .collect();
        r.moves = if !in_flight.is_empty() || !state.moves.is_empty() {
            // Moves in flight: the plan would be made against a placement about to change.
            in_flight
        } else {
            let p = self.plan(&state, replicas, 0.0, f64::INFINITY, -1.0)?;
            let off: Vec<ternfleet_control::Move> =
                p.moves.into_iter().filter(|m| involved(m)).collect();
            self.start_moves(&state, &off).await?
        };
        Ok(Response::new(r))
    }

    async fn remove(
        &self,
        req: Request<NodeRequest>,
    ) -> Result<Response<NodeActionResponse>, Status> {
        self.node_command(req, |id| Command::Remove { id }).await
    }

    async fn show_placement(
        &self,
        req: Request<ShowPlacementRequest>,
    ) -> Result<Response<ShowPlacementResponse>, Status> {
        check_operator(&req)?;
        let state = self.state().await?;
        let nodes = state
            .nodes
            .iter()
            .map(|(id, n)| NodePlacement {
                id: id.clone(),
                status: n.status.name().into(),
                experts: specs(n.experts.iter().map(|(l, s)| (*l, s))),
                count: count(n),
            })
            .collect();
        let mut held = vec![BTreeSet::new(); self.n_layer];
        for n in state.nodes.values().filter(|n| n.status.in_service()) {
            for (l, s) in &n.experts {
                if let Some(h) = held.get_mut(*l as usize) {
                    h.extend(s.iter().copied());
                }
            }
        }
        let missing: Vec<(u32, BTreeSet<u32>)> = held
            .iter()
            .enumerate()
            .map(|(l, h)| {
                let all: BTreeSet<u32> = (0..self.n_expert as u32).collect();
                (l as u32, all.difference(h).copied().collect())
            })
            .collect();
        Ok(Response::new(ShowPlacementResponse {
            placement_version: state.placement_version,
            nodes,
            uncovered: specs(missing.iter().map(|(l, s)| (*l, s))),
            n_layer: self.n_layer as u32,
            n_expert: self.n_expert as u32,
            moves: state
                .moves
                .iter()
                .map(|(&id, m)| ternfleet_shared::proto::v1::MoveInFlight {
                    id,
                    layer: m.layer,
                    expert: m.expert,
                    from: m.from.clone().unwrap_or_default(),
                    to: m.to.clone(),
                })
                .collect(),
        }))
    }

    async fn plan_placement(
        &self,
        req: Request<ternfleet_shared::proto::v1::PlanPlacementRequest>,
    ) -> Result<Response<ternfleet_shared::proto::v1::PlanPlacementResponse>, Status> {
        use ternfleet_control::planner::Plan;
        use ternfleet_shared::proto::v1::{NodeLoad, PlanPlacementResponse, PlannedMove};
        check_operator(&req)?;
        let r = req.into_inner();
        let state = self.state().await?;
        let p = self.plan(
            &state,
            r.replicas,
            r.hot_factor,
            r.tolerance,
            r.colocate_min,
        )?;
        let mut started = Vec::new();
        if r.apply {
            if !state.moves.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "{} moves are in flight: let them finish (ctl placement show), then plan again",
                    state.moves.len()
                )));
            }
            started = self.start_moves(&state, &p.moves).await?;
        }
        let routed_rows = self.routed().rows.iter().flatten().sum();
        Ok(Response::new(PlanPlacementResponse {
            started,
            placement_version: state.placement_version,
            moves: p
                .moves
                .iter()
                .map(|m| PlannedMove {
                    layer: m.layer,
                    expert: m.expert,
                    from: m.from.clone().unwrap_or_default(),
                    to: m.to.clone(),
                })
                .collect(),
            nodes: p
                .load_after
                .iter()
                .map(|(id, after)| NodeLoad {
                    id: id.clone(),
                    before: p.load_before.get(id).copied().unwrap_or(0.0),
                    after: *after,
                    bytes_after: p.bytes_after.get(id).copied().unwrap_or(0),
                })
                .collect(),
            hot: p.hot.iter().map(|(l, e)| format!("{l}:{e}")).collect(),
            imbalance_before: Plan::imbalance(&p.load_before),
            imbalance_after: Plan::imbalance(&p.load_after),
            routed_rows,
            round_trips_before: p.round_trips_before,
            round_trips_after: p.round_trips_after,
            sampled_tokens: p.sampled_tokens as u64,
            colocation_moves: p.colocation_moves as u64,
        }))
    }

    async fn save_snapshot(
        &self,
        req: Request<SaveSnapshotRequest>,
    ) -> Result<Response<SaveSnapshotResponse>, Status> {
        check_operator(&req)?;
        let state = self.state().await?;
        let applied = self.replica().await?.applied;
        Ok(Response::new(SaveSnapshotResponse {
            snapshot: state.to_snapshot_file(),
            placement_version: state.placement_version,
            applied,
        }))
    }

    async fn restore_snapshot(
        &self,
        req: Request<ternfleet_shared::proto::v1::RestoreSnapshotRequest>,
    ) -> Result<Response<ternfleet_shared::proto::v1::RestoreSnapshotResponse>, Status> {
        check_operator(&req)?;
        let bytes = req.into_inner().snapshot;
        let state = ClusterState::from_snapshot_file(&bytes).map_err(Status::invalid_argument)?;
        let outcome = self
            .seat
            .member
            .handle
            .propose(Command::Restore {
                state: String::from_utf8_lossy(&state.encode()).into_owned(),
            })
            .await
            .map_err(control_status)?;
        match outcome {
            Outcome::Rejected(why) => Err(Status::failed_precondition(why)),
            Outcome::Applied { placement_version }
            | Outcome::MoveStarted {
                placement_version, ..
            }
            | Outcome::MovesStarted {
                placement_version, ..
            } => Ok(Response::new(
                ternfleet_shared::proto::v1::RestoreSnapshotResponse { placement_version },
            )),
        }
    }
}

/// The admin API's TLS: this coordinator's certificate, clients verified against the
/// cluster CA (a certificate is required).
pub fn tls(certs: &Path, id: &str) -> Result<tonic::transport::ServerTlsConfig> {
    // Checks the files and that the certificate names `id`.
    ternfleet_shared::mtls::Identity::load(certs, id)?;
    let read = |name: String| {
        let p = certs.join(&name);
        std::fs::read(&p).with_context(|| format!("reading {}", p.display()))
    };
    Ok(tonic::transport::ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(
            read(format!("{id}.pem"))?,
            read(format!("{id}.key"))?,
        ))
        .client_ca_root(tonic::transport::Certificate::from_pem(read(
            "ca.pem".into(),
        )?)))
}

/// Serves the admin API on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    svc: AdminService,
    tls: tonic::transport::ServerTlsConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .tls_config(tls)?
        .add_service(AdminServer::new(svc))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}
