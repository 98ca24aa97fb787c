//! The coordinator's seat in the control plane (`ternfleet serve -m BUNDLE --join ADDR`): a
//! Raft learner (never a voter: see `ternfleet_control::replica::Replica::learner_to_promote`)
//! that follows the committed placement and routes with it.
//!
//! The coordinator keeps no placement of its own: at start it waits until its replica holds
//! the cluster's state (the leader's snapshot; at a restart, its own store at once), checks
//! the bundle, and from then on every committed placement version reaches the remote backend
//! through a `remote::PlacementFeed` (nodes drained or decommissioned by an operator leave the
//! routing file; nodes new to it are connected and probed before they are used).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::sync::watch;

use ternfleet_control::ClusterState;
use ternfleet_node::control::{ControlOptions, Member, Role};
use ternfleet_shared::cluster::ClusterFile;
use ternfleet_shared::mtls::Identity;

/// How long start-up waits for the cluster's state (the leader's snapshot).
pub const STATE_WAIT: Duration = Duration::from_secs(60);

/// A running seat.
pub struct Seat {
    pub member: Arc<Member>,
    /// The QUIC address the group reaches this coordinator at.
    pub quic: std::net::SocketAddr,
    identity: Identity,
    id: String,
    /// Rows routed to each expert by this coordinator (the planner's load).
    pub routed: crate::remote::RoutingCounts,
}

/// Where a process keeps its Raft store unless told: `$XDG_STATE_HOME/ternfleet` or
/// `~/.local/state/ternfleet`.
pub fn default_state_dir() -> Option<PathBuf> {
    std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .map(|d| d.join("ternfleet"))
}

impl Seat {
    /// Binds the seat's QUIC endpoint at `listen` and joins the group through `join` (any
    /// member; at a restart the members the store knows are asked too); the members reach it
    /// at `advertise` (empty: the bound address). Call inside a tokio runtime.
    pub fn start(
        certs: &Path,
        id: &str,
        listen: &str,
        advertise: &str,
        join: Option<String>,
        state_dir: PathBuf,
    ) -> Result<Seat> {
        let identity = Identity::load(certs, id)?;
        let addr: std::net::SocketAddr = listen
            .parse()
            .with_context(|| format!("--listen {listen:?}: expected HOST:PORT"))?;
        let server = identity.server_config()?;
        let endpoint = ternfleet_shared::net::endpoint(addr, Some(server))
            .with_context(|| format!("binding the control plane's QUIC endpoint to {addr}"))?;
        let quic = endpoint
            .local_addr()
            .context("reading the bound QUIC address")?;
        let rt = tokio::runtime::Handle::current();
        let reach = if advertise.is_empty() {
            quic.to_string()
        } else {
            advertise.to_string()
        };
        let member = ternfleet_node::control::start(
            &identity,
            id,
            &reach,
            state_dir,
            endpoint.clone(),
            &rt,
            &ControlOptions {
                init_cluster: false,
                join,
            },
            Role::Coordinator,
        )
        .map_err(|e| anyhow::anyhow!("control plane: {e}"))?;
        rt.spawn(ternfleet_node::control::accept_members(
            endpoint,
            member.clone(),
        ));
        Ok(Seat {
            member,
            quic,
            identity,
            id: id.to_string(),
            routed: Default::default(),
        })
    }

    /// This coordinator's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Waits (at most [`STATE_WAIT`]) for the cluster's state, checks it serves `model`, and
    /// returns the cluster to route with: the committed placement now and a feed of newer
    /// ones. Blocking: call from a thread that is not the runtime's.
    pub fn cluster_spec(
        &self,
        rt: &tokio::runtime::Handle,
        model: &Path,
        step_deadline_ms: u64,
    ) -> Result<crate::model::ClusterSpec> {
        let (man, digest) = crate::cli::read_bundle(model, "--join")?;
        let mut applied = self.member.handle.applied();
        let t = Instant::now();
        let state = rt.block_on(async {
            tokio::time::timeout(
                STATE_WAIT,
                applied.wait_for(|s| s.bundle.is_some() && !s.nodes.is_empty()),
            )
            .await
            .map(|r| r.map(|s| s.clone()))
        });
        let state = match state {
            Ok(Ok(s)) => s,
            Ok(Err(_)) => bail!("the control plane stopped before the cluster's state arrived"),
            Err(_) => bail!(
                "no cluster state within {STATE_WAIT:?}: is a member reachable at --join, and \
                 does it list {:?} among the coordinators of its placement?",
                self.id
            ),
        };
        tracing::info!(
            placement_version = state.placement_version,
            nodes = state.nodes.len(),
            "cluster: the committed placement arrived after {:.2}s",
            t.elapsed().as_secs_f64()
        );
        if let Some(want) = state.bundle.as_deref().filter(|w| *w != digest) {
            bail!(
                "the cluster serves bundle {want}, {} is {digest}",
                model.display()
            );
        }
        let file = state.to_cluster_file();
        let placement = file.placement_with_gaps(man.n_layer, man.moe.n_expert)?;
        let mut spec = crate::cli::quic_cluster(&self.identity, placement, step_deadline_ms)?;
        let (tx, rx) = watch::channel((state.placement_version, file));
        rt.spawn(publish(self.member.handle.applied(), tx));
        spec.follow = Some(rx);
        spec.routed = self.routed.clone();
        Ok(spec)
    }
}

/// Sends the routing file of every new placement version (heartbeats change the state every
/// second, the placement only when someone moves, drains or fails).
async fn publish(
    mut applied: watch::Receiver<Arc<ClusterState>>,
    tx: watch::Sender<(u64, ClusterFile)>,
) {
    let mut version = tx.borrow().0;
    loop {
        let s = applied.borrow_and_update().clone();
        if s.placement_version != version {
            version = s.placement_version;
            if tx.send((version, s.to_cluster_file())).is_err() {
                return; // the backend is gone
            }
        }
        tokio::select! {
            r = applied.changed() => if r.is_err() { return },
            () = tx.closed() => return,
        }
    }
}
