//! `ternfleet ctl`: the operator's client of the admin API (`admin`), over mutual TLS with
//! the `operator` certificate. Tables by default; `--json` prints the admin API's response
//! as JSON (field names as in proto/ternfleet/v1/admin.proto).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;

use ternfleet_shared::proto::v1::admin_client::AdminClient;
use ternfleet_shared::proto::v1::{
    ListNodesRequest, NodeRequest, PlanPlacementRequest, RestoreSnapshotRequest,
    SaveSnapshotRequest, ShowPlacementRequest, StatusRequest,
};

/// `ternfleet ctl`.
#[derive(Args, Debug)]
pub struct CtlArgs {
    /// The admin API of a seated coordinator (`serve --join`: its start-up line's `admin`).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50052")]
    pub addr: String,
    /// The cluster CA and this operator's certificate (ternfleet certs issue --name operator).
    #[arg(long)]
    pub certs: PathBuf,
    /// The certificate to present.
    #[arg(long, default_value = crate::admin::OPERATOR)]
    pub id: String,
    /// The coordinator's id (the name its certificate must carry).
    #[arg(long = "coordinator-id", default_value = "coordinator")]
    pub coordinator_id: String,
    /// Print the admin API's response as JSON.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub cmd: CtlCmd,
}

/// `ternfleet ctl` subcommands.
#[derive(Subcommand, Debug)]
pub enum CtlCmd {
    /// Members (role, state, experts held, RAM, heartbeat age), leader, term, commit and
    /// applied indexes, placement version.
    Status,
    /// Nodes: list, drain, recommission, decommission.
    Node {
        #[command(subcommand)]
        cmd: NodeCmd,
    },
    /// The committed placement.
    Placement {
        #[command(subcommand)]
        cmd: PlacementCmd,
    },
    /// Save or restore the replicated state (checksummed, format-versioned).
    Snapshot {
        #[command(subcommand)]
        cmd: SnapshotCmd,
    },
}

/// `ternfleet ctl node`.
#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Every node: address, status, kernels, experts, RAM, heartbeat age, voter.
    List,
    /// Stop routing to the node; it keeps its files. Refused when an expert would be left on
    /// no node in service.
    Drain { id: String },
    /// Route to a drained or decommissioned node again (loading, then up).
    Recommission { id: String },
    /// Take the node out for good: it gets no experts, moves copy the experts it holds to
    /// other nodes (it serves those only it holds until then), then it is removed from the
    /// cluster and the Raft group. Resumable: run it again after an interruption.
    Decommission {
        id: String,
        /// Holders each of its experts should keep.
        #[arg(long, default_value_t = 2)]
        replicas: u32,
        /// Return once the moves are started; run it again to remove the node after them.
        #[arg(long = "no-wait")]
        no_wait: bool,
        /// Give up waiting after this many seconds (the moves go on).
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
}

/// `ternfleet ctl placement`.
#[derive(Subcommand, Debug)]
pub enum PlacementCmd {
    /// Who holds which experts, and experts on no node in service.
    Show,
    /// Propose a placement (a dry run: nothing moves): --replicas holders per expert, one
    /// more for hot experts (by the rows the coordinator routed), balanced by routing-weighted
    /// load over node bandwidth within RAM and disk budgets, with the fewest moves.
    Plan(PlanOpts),
    /// Plan, then carry the moves out while the cluster serves: each target node copies the
    /// expert's blob from a holder over QUIC (checksummed, resumable, --move-rate), starts
    /// serving it, and the switch is committed through Raft; the source drops its copy
    /// after. Waits for the moves with progress, then shows the resulting balance.
    Apply {
        #[command(flatten)]
        plan: PlanOpts,
        /// Return once the moves are started (they go on; `placement show` lists them).
        #[arg(long = "no-wait")]
        no_wait: bool,
        /// Give up waiting after this many seconds (the moves go on).
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
}

/// How `placement plan` and `placement apply` plan.
#[derive(Args, Debug, Clone, Copy)]
pub struct PlanOpts {
    /// Holders per expert.
    #[arg(long, default_value_t = 2)]
    replicas: u32,
    /// An expert routed at least this many times the mean gets one more replica.
    #[arg(long = "hot-factor", default_value_t = 2.0)]
    hot_factor: f64,
    /// Balance when the most loaded node is more than this fraction above the mean, down to
    /// half of it (or until no move helps).
    #[arg(long, default_value_t = 0.10)]
    tolerance: f64,
    /// Co-location: move experts that fire together (in the tokens this coordinator routed
    /// last) onto one node where each moved expert saves at least this many round trips
    /// per token, summed over layers.
    #[arg(long = "colocate-min", default_value_t = 0.01)]
    colocate_min: f64,
    /// Never move an expert for co-location.
    #[arg(long = "no-colocate")]
    no_colocate: bool,
}

impl PlanOpts {
    fn request(&self, apply: bool) -> PlanPlacementRequest {
        PlanPlacementRequest {
            replicas: self.replicas,
            hot_factor: self.hot_factor,
            tolerance: self.tolerance,
            apply,
            colocate_min: if self.no_colocate {
                -1.0
            } else {
                self.colocate_min
            },
        }
    }
}

/// `ternfleet ctl snapshot`.
#[derive(Subcommand, Debug)]
pub enum SnapshotCmd {
    /// Write the replicated state to a file.
    Save {
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Replace the replicated state with a saved one (checksum and format checked first).
    Restore { file: PathBuf },
}

async fn connect(a: &CtlArgs) -> Result<AdminClient<tonic::transport::Channel>> {
    ternfleet_shared::mtls::Identity::load(&a.certs, &a.id)?;
    let read = |name: String| {
        let p = a.certs.join(&name);
        std::fs::read(&p).with_context(|| format!("reading {}", p.display()))
    };
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(read(
            "ca.pem".into(),
        )?))
        .identity(tonic::transport::Identity::from_pem(
            read(format!("{}.pem", a.id))?,
            read(format!("{}.key", a.id))?,
        ))
        .domain_name(a.coordinator_id.clone());
    let channel = tonic::transport::Channel::from_shared(format!("https://{}", a.addr))
        .with_context(|| format!("--addr {:?}: expected HOST:PORT", a.addr))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .with_context(|| format!("cannot reach the admin API at {}", a.addr))?;
    Ok(AdminClient::new(channel))
}

fn status_err(addr: &str) -> impl Fn(tonic::Status) -> anyhow::Error + '_ {
    move |s| anyhow::anyhow!("{addr}: {:?}: {}", s.code(), s.message())
}

/// Waits until none of the moves `ids` is in flight, with a progress bar (hidden with
/// `--json`).
async fn wait_moves(
    c: &mut AdminClient<tonic::transport::Channel>,
    ids: &[u64],
    timeout: u64,
    json: bool,
    addr: &str,
) -> Result<()> {
    let t0 = std::time::Instant::now();
    let bar = crate::cli::progress_bar("moves {bar:40} {pos}/{len} [{elapsed_precise}]");
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_length(ids.len() as u64);
    loop {
        let show = c
            .show_placement(ShowPlacementRequest {})
            .await
            .map_err(status_err(addr))?
            .into_inner();
        let left = show.moves.iter().filter(|m| ids.contains(&m.id)).count();
        bar.set_position((ids.len() - left) as u64);
        if left == 0 {
            bar.finish_and_clear();
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(timeout) {
            bar.abandon();
            bail!(
                "{left} of {} moves still in flight after {timeout} s (they go on: ctl placement show)",
                ids.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A move's columns: the expert, where from (an empty source: a new replica), where to.
fn move_row(layer: u32, expert: u32, from: &str, to: &str) -> Vec<String> {
    vec![
        format!("{layer}:{expert}"),
        if from.is_empty() {
            "(new replica)".into()
        } else {
            from.to_string()
        },
        to.to_string(),
    ]
}

/// Prints a plan: balance before and after, hot experts, each node's load, the moves.
fn print_plan(r: &ternfleet_shared::proto::v1::PlanPlacementResponse) {
    println!(
        "plan at placement version {}: {} moves, max/mean load {:.2} -> {:.2} ({})",
        r.placement_version,
        r.moves.len(),
        r.imbalance_before,
        r.imbalance_after,
        if r.routed_rows > 0 {
            format!("{} routed rows observed", r.routed_rows)
        } else {
            "no routing observed yet: uniform load assumed".into()
        }
    );
    if !r.hot.is_empty() {
        println!("hot experts (one more replica): {}", r.hot.join(" "));
    }
    if r.sampled_tokens > 0 {
        println!(
            "round trips per token and layer {:.3} -> {:.3} ({} moves co-locate experts that fire together; {} token-layers sampled)",
            r.round_trips_before, r.round_trips_after, r.colocation_moves, r.sampled_tokens
        );
    }
    let rows: Vec<Vec<String>> = r
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.id.clone(),
                format!("{:.3}", n.before),
                format!("{:.3}", n.after),
                mib(n.bytes_after),
            ]
        })
        .collect();
    table(&["NODE", "LOAD BEFORE", "LOAD AFTER", "BYTES AFTER"], &rows);
    let rows: Vec<Vec<String>> = r
        .moves
        .iter()
        .map(|m| move_row(m.layer, m.expert, &m.from, &m.to))
        .collect();
    if !rows.is_empty() {
        table(&["EXPERT", "FROM", "TO"], &rows);
    }
}

/// Prints rows as a table with a header, columns padded.
fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}

fn mib(b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    }
}

fn age(ms: u64) -> String {
    if ms == 0 {
        "-".into()
    } else {
        format!("{:.1}s", ms as f64 / 1e3)
    }
}

/// Prints an admin API response as JSON (the proto's field names).
fn print_json<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string(v)?);
    Ok(())
}

/// Runs `ternfleet ctl`.
pub fn run(a: CtlArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(run_async(a))
}

async fn run_async(a: CtlArgs) -> Result<()> {
    let mut c = connect(&a).await?;
    let err = status_err(&a.addr);
    match &a.cmd {
        CtlCmd::Status => {
            let r = c.status(StatusRequest {}).await.map_err(&err)?.into_inner();
            if a.json {
                return print_json(&r);
            }
            println!(
                "leader {}  term {}  commit {}  applied {} (lag {})  placement version {}  moves {}",
                if r.leader.is_empty() { "none" } else { &r.leader },
                r.term,
                r.commit,
                r.applied,
                r.commit.saturating_sub(r.applied),
                r.placement_version,
                r.moves
            );
            println!(
                "bundle {}  answered by {}",
                r.bundle.chars().take(16).collect::<String>(),
                r.coordinator
            );
            let rows: Vec<Vec<String>> = r
                .members
                .iter()
                .map(|m| {
                    vec![
                        m.id.clone(),
                        m.kind.clone(),
                        format!("{}{}", m.role, if m.leader { " (leader)" } else { "" }),
                        m.state.clone(),
                        m.experts.to_string(),
                        mib(m.ram_bytes),
                        if m.applied == 0 {
                            "-".into()
                        } else {
                            format!("{} ({})", m.applied, m.lag)
                        },
                        age(m.heartbeat_age_ms),
                        m.addr.clone(),
                    ]
                })
                .collect();
            table(
                &[
                    "ID",
                    "KIND",
                    "ROLE",
                    "STATE",
                    "EXPERTS",
                    "RAM",
                    "APPLIED (LAG)",
                    "HEARTBEAT",
                    "ADDRESS",
                ],
                &rows,
            );
        }
        CtlCmd::Node { cmd: NodeCmd::List } => {
            let r = c
                .list_nodes(ListNodesRequest {})
                .await
                .map_err(&err)?
                .into_inner();
            if a.json {
                return print_json(&r);
            }
            let rows: Vec<Vec<String>> = r
                .nodes
                .iter()
                .map(|n| {
                    vec![
                        n.id.clone(),
                        n.status.clone(),
                        n.experts.to_string(),
                        n.kernels.clone(),
                        mib(n.ram_bytes),
                        age(n.heartbeat_age_ms),
                        if n.voter { "yes" } else { "no" }.into(),
                        n.addr.clone(),
                    ]
                })
                .collect();
            table(
                &[
                    "ID",
                    "STATUS",
                    "EXPERTS",
                    "KERNELS",
                    "RAM",
                    "HEARTBEAT",
                    "VOTER",
                    "ADDRESS",
                ],
                &rows,
            );
        }
        CtlCmd::Node {
            cmd:
                NodeCmd::Decommission {
                    id,
                    replicas,
                    no_wait,
                    timeout,
                },
        } => {
            let fail = |verb: &str, s: tonic::Status| {
                anyhow::anyhow!("{verb} {id}: {:?}: {}", s.code(), s.message())
            };
            let r = c
                .decommission(NodeRequest {
                    id: id.clone(),
                    replicas: *replicas,
                })
                .await
                .map_err(|s| fail("decommission", s))?
                .into_inner();
            if *no_wait {
                if a.json {
                    return print_json(&r);
                }
                println!(
                    "{}: {}, {} moves off it in flight (placement version {})",
                    r.id,
                    r.status,
                    r.moves.len(),
                    r.placement_version
                );
                return Ok(());
            }
            if !a.json {
                println!("{}: {}, {} moves off it", r.id, r.status, r.moves.len());
            }
            wait_moves(&mut c, &r.moves, *timeout, a.json, &a.addr).await?;
            let mut gone = c
                .remove(NodeRequest {
                    id: id.clone(),
                    replicas: 0,
                })
                .await
                .map_err(|s| fail("remove", s))?
                .into_inner();
            gone.moves = r.moves;
            if a.json {
                print_json(&gone)?;
            } else {
                println!(
                    "{}: {} (placement version {})",
                    gone.id, gone.status, gone.placement_version
                );
            }
        }
        CtlCmd::Node { cmd } => {
            let (verb, id) = match cmd {
                NodeCmd::Drain { id } => ("drain", id),
                NodeCmd::Recommission { id } => ("recommission", id),
                NodeCmd::List | NodeCmd::Decommission { .. } => unreachable!("handled above"),
            };
            let req = NodeRequest {
                id: id.clone(),
                replicas: 0,
            };
            let r = match cmd {
                NodeCmd::Drain { .. } => c.drain(req).await,
                _ => c.recommission(req).await,
            }
            .map_err(|s| anyhow::anyhow!("{verb} {id}: {:?}: {}", s.code(), s.message()))?
            .into_inner();
            if a.json {
                print_json(&r)?;
            } else {
                println!(
                    "{}: {} (placement version {})",
                    r.id, r.status, r.placement_version
                );
            }
        }
        CtlCmd::Placement {
            cmd: PlacementCmd::Show,
        } => {
            let r = c
                .show_placement(ShowPlacementRequest {})
                .await
                .map_err(&err)?
                .into_inner();
            if a.json {
                return print_json(&r);
            }
            println!(
                "placement version {}: {} layers x {} routed experts",
                r.placement_version, r.n_layer, r.n_expert
            );
            let rows: Vec<Vec<String>> = r
                .nodes
                .iter()
                .map(|n| {
                    vec![
                        n.id.clone(),
                        n.status.clone(),
                        n.count.to_string(),
                        n.experts.join(" "),
                    ]
                })
                .collect();
            table(&["ID", "STATUS", "COUNT", "EXPERTS"], &rows);
            if r.uncovered.is_empty() {
                println!("every expert has a holder in service");
            } else {
                println!("on no node in service: {}", r.uncovered.join(" "));
            }
            if !r.moves.is_empty() {
                println!("moves in flight:");
                let rows: Vec<Vec<String>> = r
                    .moves
                    .iter()
                    .map(|m| {
                        let mut row = vec![m.id.to_string()];
                        row.extend(move_row(m.layer, m.expert, &m.from, &m.to));
                        row
                    })
                    .collect();
                table(&["MOVE", "EXPERT", "FROM", "TO"], &rows);
            }
        }
        CtlCmd::Placement {
            cmd: PlacementCmd::Plan(opts),
        } => {
            let r = c
                .plan_placement(opts.request(false))
                .await
                .map_err(&err)?
                .into_inner();
            if a.json {
                return print_json(&r);
            }
            print_plan(&r);
            println!("(a dry run: `placement apply` carries it out)");
        }
        CtlCmd::Placement {
            cmd:
                PlacementCmd::Apply {
                    plan,
                    no_wait,
                    timeout,
                },
        } => {
            let r = c
                .plan_placement(plan.request(true))
                .await
                .map_err(&err)?
                .into_inner();
            if !a.json {
                print_plan(&r);
            }
            if *no_wait || r.started.is_empty() {
                if a.json {
                    return print_json(&r);
                }
                println!("{} moves started", r.started.len());
                return Ok(());
            }
            let t0 = std::time::Instant::now();
            wait_moves(&mut c, &r.started, *timeout, a.json, &a.addr).await?;
            // The balance now (a dry plan: a move given up would show up again here).
            let after = c
                .plan_placement(plan.request(false))
                .await
                .map_err(&err)?
                .into_inner();
            if a.json {
                println!(
                    "{}",
                    json!({"started": r.started, "seconds": t0.elapsed().as_secs_f64(),
                           "plan": serde_json::to_value(&r)?, "after": serde_json::to_value(&after)?})
                );
                return Ok(());
            }
            println!(
                "{} moves done in {:.1}s; placement version {}: max/mean load {:.2}, {} moves left to propose",
                r.started.len(),
                t0.elapsed().as_secs_f64(),
                after.placement_version,
                after.imbalance_before,
                after.moves.len()
            );
        }
        CtlCmd::Snapshot {
            cmd: SnapshotCmd::Save { output },
        } => {
            let r = c
                .save_snapshot(SaveSnapshotRequest {})
                .await
                .map_err(&err)?
                .into_inner();
            // Checked before it is written: a damaged transfer never becomes a file.
            ternfleet_control::ClusterState::from_snapshot_file(&r.snapshot)
                .map_err(|e| anyhow::anyhow!("the snapshot received is damaged: {e}"))?;
            if output.exists() {
                bail!("{} exists: not replaced", output.display());
            }
            std::fs::write(output, &r.snapshot)
                .with_context(|| format!("writing {}", output.display()))?;
            if a.json {
                println!(
                    "{}",
                    json!({"file": output.display().to_string(), "bytes": r.snapshot.len(),
                           "placement_version": r.placement_version, "applied": r.applied})
                );
            } else {
                println!(
                    "saved {} ({} bytes, placement version {}, applied index {})",
                    output.display(),
                    r.snapshot.len(),
                    r.placement_version,
                    r.applied
                );
            }
        }
        CtlCmd::Snapshot {
            cmd: SnapshotCmd::Restore { file },
        } => {
            let bytes =
                std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            ternfleet_control::ClusterState::from_snapshot_file(&bytes)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let r = c
                .restore_snapshot(RestoreSnapshotRequest { snapshot: bytes })
                .await
                .map_err(&err)?
                .into_inner();
            if a.json {
                print_json(&r)?;
            } else {
                println!(
                    "restored {} (placement version {} now)",
                    file.display(),
                    r.placement_version
                );
            }
        }
    }
    Ok(())
}
