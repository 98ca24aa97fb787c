//! Command-line interface of the `ternfleet` binary: argument types (clap derive) and one
//! function per subcommand. User-facing output goes to stdout; logs go to stderr.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use crate::generate::{generate, GenerateRequest};
use crate::kv_cache::SeqOptions;
use crate::model::Model;
use crate::sampler::{Sampler, SamplerParams};
use ternfleet_kernels::Numerics;

/// The user-facing default model (Qwen2.5-Coder 0.5B Instruct, `scripts/fetch-model.sh qwen`);
/// tests and parity scripts name Gemma 3 270M explicitly.
pub const DEFAULT_MODEL: &str = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// ternfleet: run Mixture-of-Experts language models across a fleet of ordinary machines.
///
/// This build runs GGUF models and ternfleet bundles on one machine (gemma3, llama, qwen2,
/// qwen3, and the MoE architectures qwen3moe, qwen2moe and Mixtral-style llama). Log verbosity
/// follows RUST_LOG (default: info, to stderr). Kernels are chosen from the CPU's features at
/// start-up; TERNFLEET_KERNELS=scalar|avx2|avx512 overrides the choice.
#[derive(Parser, Debug)]
#[command(name = "ternfleet", version, about, long_about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Logs on stderr as text lines or JSON objects (one per line). RUST_LOG filters them
    /// (default info).
    #[arg(long = "log-format", global = true, value_enum, default_value_t)]
    pub log_format: crate::telemetry::LogFormat,
    /// Export trace spans (request, step, layer, node call; expert execution on the nodes)
    /// over OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317. Off when unset.
    #[arg(long = "otlp-endpoint", global = true, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate a continuation of a prompt.
    ///
    /// The prompt is tokenized like llama.cpp (BOS added when the model asks for it, special
    /// tokens such as <start_of_turn> recognised), prefilled in batches, then decoded one token
    /// at a time until -n tokens or an end-of-generation token.
    Generate(GenerateArgs),
    /// Print the token ids of a text (`{"ids":[...]}` with --json), BOS included when the model adds it.
    Tokenize(TokenizeArgs),
    /// Perplexity of a text file, computed exactly as llama.cpp's llama-perplexity does:
    /// non-overlapping chunks of --ctx tokens, BOS first, the second half of each chunk scored.
    Perplexity(PerplexityArgs),
    /// Prefill and decode throughput, shaped like llama-bench's pp/tg tests.
    Bench(BenchArgs),
    /// How an MoE model routes a text: distinct experts and routing entropy per layer, the
    /// shadow predictor's recall of the true top-k 1 to 4 layers ahead, and the expert
    /// store's hit rate with and without its hints at 25 % and 50 % of the experts resident.
    ///
    /// Quote the spread (distinct experts, entropy) next to any memory or prefetch figure
    /// measured on a model: routing collapsed onto a few experts makes such figures
    /// meaningless. The store figures replay the routing trace through the store's policy
    /// with reads completing at once (an upper bound on what prefetch can achieve).
    Routing(RoutingArgs),
    /// Fit the learned shadow predictor of an MoE model on calibration text and store it (in
    /// a bundle: BUNDLE/predictor.gguf; beside a GGUF file: FILE.predictor.gguf).
    ///
    /// Per source layer and lookahead, a ridge regression from the residual stream to the
    /// later layer's router logits, pulled toward the router predictor; the last --holdout of
    /// the tokens choose the pull, so it never does worse there than the router predictor.
    /// Use it with --prefetch learned; `ternfleet routing --prefetch learned` measures it
    /// beside the router predictor (on a different text than the calibration one).
    FitPredictor(FitPredictorArgs),
    /// Print a model's summary: architecture, sizes, context, experts, chat template and the
    /// weight types it holds.
    Info(InfoArgs),
    /// Convert a GGUF model into a bundle (the directory nodes serve): a manifest, a
    /// coordinator part and one checksummed GGUF per routed expert.
    ///
    /// MoE models (qwen3moe, qwen2moe, Mixtral) are split as they are. Dense models are
    /// MoEfied with --experts E: each FFN's neurons are clustered into E equal experts by how
    /// they co-activate on the --calib text, and a router is fitted per layer. --expert-type
    /// turns the routed experts ternary (BitNet b1.58: tq2_0/tq1_0 as llama.cpp stores them,
    /// or ternfleet's tf2/tf1 with 128-wide blocks). Interrupted conversions resume: run the
    /// same command again.
    Convert(ConvertArgs),
    /// Compare a model (or bundle) with a reference on a text: perplexity of both, top-1
    /// agreement, and per-layer routing agreement for two MoE models with the same experts
    /// (--top-experts then applies to both).
    Compare(CompareArgs),
    /// Serve the model over an OpenAI-compatible HTTP API, many requests at once.
    ///
    /// POST /v1/completions, /v1/chat/completions (JSON or SSE streaming), GET /v1/models,
    /// POST /tokenize, /detokenize; GET /health (liveness), /ready (503 while loading or
    /// draining), /metrics (Prometheus). Prints one start-up line
    /// {"ternfleet":"listening",...,"http":ADDR} on stdout after binding, then loads the model.
    /// Every option can also come from a TOML file (--config; template in deploy/serve.toml);
    /// flags override it. SIGTERM drains: running requests finish within --grace seconds.
    Serve(Box<ServeArgs>),
    /// Cluster certificates: `certs init --dir DIR` makes the cluster CA (ca.pem, ca.key);
    /// `certs issue --dir DIR --name ID` a certificate for one node, coordinator or operator,
    /// its identity bound to ID (ID.pem, ID.key). Existing files are never replaced.
    Certs(CertsArgs),
    /// Cluster files: `cluster plan --bundle DIR --node ID=ADDR ... [--replicas R] -o FILE`
    /// places a bundle's routed experts on nodes, balanced by expert bytes, each expert on R
    /// nodes (replicas take over when a node fails).
    Cluster(ClusterArgs),
    /// Serve one node's shard of a bundle's routed experts to the coordinator over QUIC with
    /// mutual TLS: the experts the cluster file assigns to --id, read from the local bundle
    /// (no weights cross the network).
    ///
    /// Prints {"ternfleet":"listening","role":"node","id":..,"quic":ADDR} on stdout once
    /// bound, then opens its experts (reporting progress to the coordinator, which waits for
    /// it). SIGTERM stops it cleanly.
    Node(NodeArgs),
    /// Operate a cluster through a seated coordinator's admin API (mutual TLS, the
    /// `operator` certificate): `status`, `node list|drain|recommission|decommission`,
    /// `placement show`, `snapshot save|restore`. Tables by default; --json prints the admin
    /// API's response.
    Ctl(crate::ctl::CtlArgs),
    /// Readiness check for healthchecks (images without curl): exit 0 when the target is
    /// ready within --timeout, else print what it answered and exit 1.
    /// `probe http://127.0.0.1:8080/ready`: GET answers 200 (plain HTTP).
    /// `probe quic://127.0.0.1:7400 --certs DIR --id n1`: the node answers `Hello` from the
    /// certificate ID (any member's; mutual TLS) with its state Ready (loading, unavailable:
    /// exit 1 saying so).
    Probe(ProbeArgs),
    /// A minimal OTLP/gRPC trace receiver: prints every span it receives as a JSON line
    /// (trace id, span id, parent, name, service, ternfleet.id) — to look at a cluster's traces
    /// without a collector, and for the trace tests and the tracing-cost bench.
    OtlpSink(OtlpSinkArgs),
}

/// `ternfleet probe`.
#[derive(Args, Debug)]
pub struct ProbeArgs {
    /// http://HOST:PORT/PATH, or quic://HOST:PORT (a node).
    pub url: String,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 5)]
    pub timeout: u64,
    /// quic://: the cluster certificates (ca.pem, ID.pem, ID.key).
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// quic://: the certificate to speak as (the node's own, in its container).
    #[arg(long)]
    pub id: Option<String>,
    /// quic://: the node's id (its certificate's name; default: --id).
    #[arg(long)]
    pub node: Option<String>,
}

/// `ternfleet certs`.
#[derive(Args, Debug)]
pub struct CertsArgs {
    #[command(subcommand)]
    pub cmd: CertsCmd,
}

/// `ternfleet certs` subcommands.
#[derive(Subcommand, Debug)]
pub enum CertsCmd {
    /// Make a new cluster CA in DIR (ca.pem, and ca.key readable by the owner only), and
    /// with --issue certificates signed by it.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// Also issue a certificate for this id (repeat; as `certs issue`).
        #[arg(long = "issue")]
        issue: Vec<String>,
        /// Keep a CA and certificates DIR already holds (a set-up step run at every start,
        /// as docker-compose's init does); without it an existing CA is an error.
        #[arg(long)]
        keep: bool,
    },
    /// Issue a certificate for ID (a node, `coordinator` or `operator`), signed by DIR's CA.
    Issue {
        #[arg(long)]
        dir: PathBuf,
        /// The id: 1-63 lowercase letters, digits and '-'.
        #[arg(long)]
        name: String,
    },
}

/// `ternfleet cluster`.
#[derive(Args, Debug)]
pub struct ClusterArgs {
    #[command(subcommand)]
    pub cmd: ClusterCmd,
}

/// `ternfleet cluster` subcommands.
#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// Write a cluster file placing a bundle's routed experts on the given nodes.
    Plan {
        /// The bundle (ternfleet convert).
        #[arg(long)]
        bundle: PathBuf,
        /// A node as ID=HOST:PORT (repeat for each node).
        #[arg(long = "node", required = true)]
        nodes: Vec<String>,
        /// Nodes holding each expert (1: no failover).
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// The cluster file to write.
        #[arg(short = 'o', long = "out")]
        out: PathBuf,
    },
}

/// `ternfleet otlp-sink`.
#[derive(Args, Debug)]
pub struct OtlpSinkArgs {
    /// gRPC address to receive OTLP on (port 0 picks one; the start-up line says which).
    #[arg(long, default_value = "127.0.0.1:4317")]
    pub listen: String,
}

/// `ternfleet node`.
#[derive(Args, Debug)]
pub struct NodeArgs {
    /// The bundle directory (a local copy; the node reads only its own experts).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// This node's id (as in the cluster file and its certificate).
    #[arg(long)]
    pub id: String,
    /// Directory with ca.pem, ID.pem and ID.key (ternfleet certs).
    #[arg(long)]
    pub certs: PathBuf,
    /// The cluster file (which experts this node holds; which coordinators may call it).
    #[arg(long)]
    pub cluster: PathBuf,
    /// QUIC address to bind (default: this node's address in the cluster file; port 0
    /// picks one).
    #[arg(long)]
    pub listen: Option<String>,
    /// HTTP address of /metrics (Prometheus), /health and /ready [default: 127.0.0.1:9400;
    /// if that is taken, e.g. by another node on this machine, the node runs without it and
    /// warns]. Port 0 picks one (the start-up line says which); `off` turns it off.
    #[arg(long, value_name = "ADDR|off")]
    pub metrics: Option<String>,
    /// Allow --metrics on a non-loopback address (it is plaintext HTTP, read-only).
    #[arg(long = "listen-any")]
    pub listen_any: bool,
    /// Keep at most this much of the node's experts in RAM (e.g. 8GiB); the rest is read
    /// from disk on demand and on the coordinator's prefetch hints. Default: all mapped.
    #[arg(long = "ram-budget", value_parser = parse_size)]
    pub ram_budget: Option<u64>,
    /// With --ram-budget: threads reading experts from disk.
    #[arg(long = "io-threads", default_value_t = 4)]
    pub io_threads: usize,
    /// With --ram-budget: lfu (default) or lru.
    #[arg(long, default_value = "lfu")]
    pub evict: ternfleet_node::store::Evict,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Where the node remembers the expert blobs whose checksums it verified, so a restart
    /// does not hash them again (default: $XDG_STATE_HOME/ternfleet or
    /// ~/.local/state/ternfleet).
    #[arg(long = "state-dir")]
    pub state_dir: Option<PathBuf>,
    /// Start a new control plane (Raft group) with this node as its first voter; the cluster
    /// file seeds the replicated placement. Ignored when the node's Raft store
    /// (STATE_DIR/ID/raft.redb) already holds a cluster (a restart).
    #[arg(long = "init-cluster", conflicts_with = "join")]
    pub init_cluster: bool,
    /// Join the control plane through the member at ADDR (any member's QUIC host:port; a
    /// follower points to the leader): added as a learner, promoted to voter once caught up.
    #[arg(long, value_name = "ADDR")]
    pub join: Option<String>,
    /// With a control plane: delete the blob file of an expert that a move took off this
    /// node (only when the bundle directory is this node's own copy; default: keep it).
    #[arg(long)]
    pub prune: bool,
    /// With a control plane: copy experts that moves bring here at most this fast, per
    /// second (e.g. 100MiB; 0: unlimited), so copying leaves serving its network and disk.
    #[arg(long = "move-rate", value_parser = parse_size, default_value = "200MiB")]
    pub move_rate: u64,
    /// Bytes asked for per request of a move's copy (tests cut copies off mid-blob).
    #[arg(long = "move-chunk", value_parser = parse_size, default_value = "1MiB", hide = true)]
    pub move_chunk: u64,
}

/// `ternfleet serve` (flags override --config).
#[derive(Args, Debug, Default)]
pub struct ServeArgs {
    /// TOML configuration file (every option; see deploy/serve.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model: a GGUF file or a bundle directory.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// HTTP API address (default 127.0.0.1:8080; port 0 picks one).
    #[arg(long)]
    pub http: Option<String>,
    /// gRPC API address (default 127.0.0.1:50051; "" turns gRPC off; port 0 picks one).
    #[arg(long)]
    pub grpc: Option<String>,
    /// Allow a non-loopback --http / --grpc address without TLS (containers behind their own
    /// network set it; with --tls-cert/--tls-key it is not needed).
    #[arg(long)]
    pub listen_any: bool,
    /// Serve HTTPS and gRPC over TLS with this PEM certificate chain (leaf first); needs
    /// --tls-key.
    #[arg(long, value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// invariant (default: a request's tokens do not depend on what shares its steps) or parity.
    #[arg(long)]
    pub numerics: Option<String>,
    /// MoE models: experts per token.
    #[arg(long = "top-experts")]
    pub top_experts: Option<usize>,
    /// MoE models: keep at most this much of the routed experts in RAM (e.g. 8GiB); the rest
    /// is read from disk by the expert store (default: every expert memory-mapped).
    #[arg(long = "ram-budget")]
    pub ram_budget: Option<String>,
    /// With --ram-budget: none (default), router or learned hints (see `generate --help`).
    #[arg(long)]
    pub prefetch: Option<String>,
    /// With --prefetch: layers ahead hinted (default 1).
    #[arg(long)]
    pub lookahead: Option<usize>,
    /// With --prefetch learned: the predictor file (default: beside the model).
    #[arg(long)]
    pub predictor: Option<PathBuf>,
    /// With --ram-budget: threads reading experts (default 4).
    #[arg(long = "io-threads")]
    pub io_threads: Option<usize>,
    /// With --ram-budget: lfu (default) or lru.
    #[arg(long)]
    pub evict: Option<String>,
    /// Requests generating at once (default 16).
    #[arg(long)]
    pub parallel: Option<usize>,
    /// Requests waiting beyond --parallel; more get 429 at once (default 64).
    #[arg(long = "max-queue")]
    pub max_queue: Option<usize>,
    /// Positions per request, prompt + generated (default 4096; 0: the model's own).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// KV pool size (e.g. 2GiB; default: --parallel requests of --ctx positions).
    #[arg(long = "kv-budget")]
    pub kv_budget: Option<String>,
    /// Prompt tokens per request per step (default 256).
    #[arg(long)]
    pub chunk: Option<usize>,
    /// Rows per step (default 512).
    #[arg(long = "step-tokens")]
    pub step_tokens: Option<usize>,
    /// Largest request body (default 1MiB).
    #[arg(long = "max-body")]
    pub max_body: Option<String>,
    /// Prompt tokens per request (default: --ctx minus one).
    #[arg(long = "max-prompt-tokens")]
    pub max_prompt_tokens: Option<usize>,
    /// max_tokens of a request that sets none (default: up to the context).
    #[arg(long = "default-max-tokens")]
    pub default_max_tokens: Option<usize>,
    /// chatml, gemma, llama3 or a Jinja file (default: the model's own template).
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
    /// A bearer API key clients must send (repeat for several).
    #[arg(long = "api-key")]
    pub api_key: Vec<String>,
    /// A file of API keys, one per line.
    #[arg(long = "api-key-file")]
    pub api_key_file: Option<PathBuf>,
    /// A request's deadline in seconds (default 600).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Seconds running requests may finish after SIGTERM (default 30).
    #[arg(long)]
    pub grace: Option<f64>,
    /// Name the API reports for the model (default: the file name).
    #[arg(long = "model-name")]
    pub model_name: Option<String>,
    /// This process's id (default coordinator; with --cluster, the name in its certificate).
    #[arg(long)]
    pub id: Option<String>,
    /// Bundles: run the routed experts on the nodes of this cluster file.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// With --cluster: the cluster CA and this process's certificate (ternfleet certs).
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// With --cluster or --join: milliseconds a node call may take before a replica is tried
    /// (default 750, plus 0.5 ms per route).
    #[arg(long = "step-deadline")]
    pub step_deadline: Option<u64>,
    /// Bundles: take a seat in the control plane (a Raft learner) through the member at ADDR
    /// (any node's QUIC host:port) and route with the committed placement, following every
    /// change operators make; needs --certs. A restart rejoins by itself.
    #[arg(long, value_name = "ADDR", conflicts_with = "cluster")]
    pub join: Option<String>,
    /// With --join: the QUIC address the control plane reaches this coordinator at
    /// (default 127.0.0.1:0; give a routable address when nodes run on other machines).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// With --join: the HOST:PORT the other members reach this coordinator at, when --listen
    /// binds every interface (0.0.0.0:7500 in a container: --advertise coordinator:7500);
    /// default the bound address.
    #[arg(long, value_name = "ADDR")]
    pub advertise: Option<String>,
    /// With --join: the admin gRPC API's address for `ternfleet ctl` (mutual TLS against the
    /// cluster CA, the `operator` certificate only; default 127.0.0.1:50052; "" = none).
    #[arg(long, value_name = "ADDR")]
    pub admin: Option<String>,
    /// With --join: the directory of the Raft store (STATE_DIR/ID/raft.redb; default
    /// $XDG_STATE_HOME/ternfleet or ~/.local/state/ternfleet).
    #[arg(long = "state-dir")]
    pub state_dir: Option<PathBuf>,
}

impl ServeArgs {
    /// The configuration: the file (or the defaults), then these flags.
    pub fn config(self) -> Result<crate::serve::config::ServeConfig> {
        let mut c = match &self.config {
            Some(p) => crate::serve::config::ServeConfig::from_file(p)?,
            None => crate::serve::config::ServeConfig::default(),
        };
        macro_rules! set {
            ($($f:ident => $g:ident),*) => { $(if let Some(v) = self.$f { c.$g = v; })* };
        }
        set!(model => model, http => http, grpc => grpc, numerics => numerics, parallel => parallel,
             max_queue => max_queue, ctx => ctx, kv_budget => kv_budget, chunk => chunk,
             step_tokens => step_tokens, max_body => max_body,
             max_prompt_tokens => max_prompt_tokens, chat_template => chat_template,
             timeout => timeout_s, grace => grace_s, id => id, ram_budget => ram_budget,
             prefetch => prefetch, lookahead => lookahead, io_threads => io_threads,
             evict => evict, step_deadline => step_deadline_ms);
        if self.cluster.is_some() {
            c.cluster = self.cluster;
        }
        if self.join.is_some() {
            c.join = self.join;
        }
        if let Some(a) = self.advertise {
            c.advertise = a;
        }
        if let Some(l) = self.listen {
            c.listen = l;
        }
        if let Some(a) = self.admin {
            c.admin = a;
        }
        if self.state_dir.is_some() {
            c.state_dir = self.state_dir;
        }
        if self.certs.is_some() {
            c.certs = self.certs;
        }
        if self.predictor.is_some() {
            c.predictor = self.predictor;
        }
        if self.listen_any {
            c.listen_any = true;
        }
        if self.tls_cert.is_some() {
            c.tls_cert = self.tls_cert;
        }
        if self.tls_key.is_some() {
            c.tls_key = self.tls_key;
        }
        if self.threads.is_some() {
            c.threads = self.threads;
        }
        if self.top_experts.is_some() {
            c.top_experts = self.top_experts;
        }
        if self.default_max_tokens.is_some() {
            c.default_max_tokens = self.default_max_tokens;
        }
        if self.api_key_file.is_some() {
            c.api_key_file = self.api_key_file;
        }
        if self.model_name.is_some() {
            c.model_name = self.model_name;
        }
        c.api_keys.extend(self.api_key);
        Ok(c)
    }
}

/// `ternfleet convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Source model (GGUF).
    #[arg(short = 'm', long = "model", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Output bundle directory (created; a finished bundle there is replaced).
    #[arg(short = 'o', long = "out")]
    pub out: PathBuf,
    /// Dense models: experts per layer (the FFN width must divide by it).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts a token uses by default (MoEfied default: half; native: the model's).
    #[arg(long = "top-k")]
    pub top_k: Option<usize>,
    /// Dense models: calibration text for the clustering and the routers.
    #[arg(long)]
    pub calib: Option<PathBuf>,
    /// Calibration tokens to use at most.
    #[arg(long, default_value_t = 4096)]
    pub calib_tokens: usize,
    /// Routed experts' weight type: keep, tq2_0, tq1_0, tf2, tf1 or q8_0.
    #[arg(long = "expert-type", default_value = "keep")]
    pub expert_type: String,
    /// Seed of the clustering.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Dense models: how neurons form experts: coactivation (balanced k-means on the
    /// calibration activations) or contiguous (equal runs of neurons; with runs that are whole
    /// quantization blocks of ffn_down, all experts together compute exactly the dense FFN).
    #[arg(long, default_value = "coactivation")]
    pub grouping: String,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Print the manifest summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `ternfleet compare`.
#[derive(Args, Debug)]
pub struct CompareArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The reference model or bundle (e.g. the source of a conversion).
    #[arg(long = "ref")]
    pub reference: PathBuf,
    /// Float order of the reference (default: the model's --numerics). The same file with
    /// `--numerics invariant --ref-numerics parity` measures what batch invariance costs.
    #[arg(long = "ref-numerics")]
    pub ref_numerics: Option<Numerics>,
    #[command(flatten)]
    pub text: TextArgs,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The text a perplexity-style command scores, and how.
#[derive(Args, Debug)]
pub struct TextArgs {
    /// Text file.
    #[arg(short = 'f', long)]
    pub file: PathBuf,
    /// Tokens per chunk.
    #[arg(short = 'c', long, default_value_t = 512)]
    pub ctx: usize,
    /// Tokens per forward pass.
    #[arg(short = 'b', long, default_value_t = 512)]
    pub batch: usize,
    /// Score at most this many chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
}

/// Options every model command shares.
#[derive(Args, Debug)]
pub struct ModelArgs {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// MoE models: experts each token uses (default: the model's own).
    #[arg(long = "top-experts")]
    pub top_experts: Option<usize>,
    /// Float order: parity (llama.cpp's, which changes with the batch) or invariant (each
    /// row's arithmetic fixed whatever shares its step).
    #[arg(long, default_value = "parity")]
    pub numerics: Numerics,
    /// MoE GGUF models: keep at most this much of the routed experts in RAM (e.g. 8GiB,
    /// 512MiB); the rest is read from disk (O_DIRECT) on demand or ahead of time on the
    /// shadow predictor's hints. Default: every expert memory-mapped.
    #[arg(long = "ram-budget", value_parser = parse_size)]
    pub ram_budget: Option<u64>,
    /// With --ram-budget: what hints the expert store. `none`: demand reads only (the default:
    /// hints read about a third more bytes, so they pay only where the disk has time to
    /// spare: `learned` 1 ahead gained 5 % on one disk measured, lost on others;
    /// docs/moe-scale.md);
    /// `router`: later layers' routers on the current state, --lookahead layers ahead;
    /// `learned`: the predictor `ternfleet fit-predictor` fitted (--predictor, or the one in
    /// the bundle / beside the GGUF file), the router predictor where it has no map.
    #[arg(long, default_value = "none", value_parser = ["router", "learned", "none"])]
    pub prefetch: String,
    /// With --prefetch learned: the predictor file (default: BUNDLE/predictor.gguf or
    /// MODEL.predictor.gguf).
    #[arg(long)]
    pub predictor: Option<PathBuf>,
    /// With --ram-budget and --prefetch router: how many layers ahead to hint.
    #[arg(long, default_value_t = crate::model::predict::LOOKAHEAD)]
    pub lookahead: usize,
    /// With --ram-budget: threads reading experts from disk (reads in flight at once).
    #[arg(long = "io-threads", default_value_t = 4)]
    pub io_threads: usize,
    /// With --ram-budget: which resident expert goes first when room is needed: `lfu` (least
    /// frequently demanded, decayed counts; the default, measured better on real routing) or
    /// `lru` (least recently used, the baseline).
    #[arg(long, default_value = "lfu")]
    pub evict: ternfleet_node::store::Evict,
    #[command(flatten)]
    pub cluster: ClusterOpts,
}

/// Running a bundle's routed experts on cluster nodes (every model command and `serve`).
#[derive(Args, Debug, Default, Clone)]
pub struct ClusterOpts {
    /// Bundles: run the routed experts on the nodes of this cluster file (`ternfleet
    /// cluster plan`) instead of in this process; the output is the same bits.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// With --cluster: directory of the cluster CA and this process's certificate
    /// (`ternfleet certs`).
    #[arg(long)]
    pub certs: Option<PathBuf>,
    /// With --cluster: this process's id (the name in its certificate).
    #[arg(long = "cluster-id", default_value = "coordinator")]
    pub cluster_id: String,
    /// With --cluster: milliseconds a node call may take before its experts go to a replica
    /// (plus 0.5 ms per route it carries, so a long prefill is not cut short).
    #[arg(long = "step-deadline", default_value_t = 750)]
    pub step_deadline_ms: u64,
}

/// The cluster a model's experts run on: the file, the placement checked against the
/// bundle's manifest, this process's identity and a QUIC transport to the nodes.
pub fn cluster_spec(
    model: &std::path::Path,
    cluster: Option<&std::path::Path>,
    certs: Option<&std::path::Path>,
    id: &str,
    step_deadline_ms: u64,
) -> Result<Option<crate::model::ClusterSpec>> {
    let Some(file) = cluster else {
        if certs.is_some() {
            bail!("--certs needs --cluster");
        }
        return Ok(None);
    };
    let Some(certs) = certs else {
        bail!("--cluster needs --certs DIR (the cluster CA and this process's certificate: ternfleet certs)");
    };
    let (man, digest) = read_bundle(model, "--cluster")?;
    let cf = ternfleet_shared::cluster::ClusterFile::read(file)?;
    if let Some(want) = cf.bundle.as_deref().filter(|w| *w != digest) {
        bail!(
            "{}: the placement is for bundle {want}, {} is {digest}",
            file.display(),
            model.display()
        );
    }
    let placement = cf.placement(man.n_layer, man.moe.n_expert)?;
    if !placement.coordinators.iter().any(|c| c == id) {
        bail!(
            "--cluster-id {id}: {} lets only {:?} call its nodes",
            file.display(),
            placement.coordinators
        );
    }
    let me = ternfleet_shared::mtls::Identity::load(certs, id)?;
    tracing::info!(
        nodes = placement.nodes.len(),
        "cluster {}: connecting to the nodes",
        file.display()
    );
    Ok(Some(quic_cluster(&me, placement, step_deadline_ms)?))
}

/// A bundle's manifest and its digest; `flag` names the option that needs a bundle.
pub fn read_bundle(
    model: &std::path::Path,
    flag: &str,
) -> Result<(ternfleet_shared::bundle::Manifest, String)> {
    if !model.is_dir() {
        bail!(
            "{flag}: {} is not a bundle directory (make one: ternfleet convert -m {} -o DIR)",
            model.display(),
            model.display()
        );
    }
    Ok((
        ternfleet_shared::bundle::Manifest::read(model)?,
        ternfleet_shared::bundle::manifest_digest(model)?,
    ))
}

/// The cluster of `placement` reached over QUIC as `me`, with the step deadline; static
/// (no placement feed) until the caller gives it one.
pub fn quic_cluster(
    me: &ternfleet_shared::mtls::Identity,
    placement: ternfleet_shared::cluster::Placement,
    step_deadline_ms: u64,
) -> Result<crate::model::ClusterSpec> {
    let nodes: Vec<(String, String)> = placement
        .nodes
        .iter()
        .map(|n| (n.id.clone(), n.addr.clone()))
        .collect();
    let transport = ternfleet_shared::net::QuicTransport::new(me, &nodes)
        .map_err(|e| anyhow::anyhow!("cluster transport: {e}"))?;
    Ok(crate::model::ClusterSpec {
        placement,
        transport: std::sync::Arc::new(transport),
        me: me.id.clone(),
        opts: crate::remote::RemoteOptions {
            step_base: std::time::Duration::from_millis(step_deadline_ms.max(1)),
            ..Default::default()
        },
        follow: None,
        routed: Default::default(),
    })
}

/// `ternfleet generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (text, even when it starts with `-`).
    #[arg(
        short = 'p',
        long,
        allow_hyphen_values = true,
        required_unless_present = "prompts",
        conflicts_with = "prompts"
    )]
    pub prompt: Option<String>,
    /// A file of prompts, one per line (`\n` and `\\` in a line are unescaped), run through
    /// the batched engine --parallel at a time; prints one JSON object per prompt, in input
    /// order, with --json.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Sequences at once with --prompts.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// KV pool size with --prompts (e.g. 512MiB, 2GiB or bytes).
    #[arg(long = "kv-budget", default_value = "1GiB", value_parser = parse_size)]
    pub kv_budget: u64,
    /// Maximum tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n: usize,
    /// Temperature; 0 is greedy (deterministic).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the most likely one (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalise the last --repeat-last-n tokens by this factor (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Window of the repetition penalty.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Context size (prompt + generated tokens); default: prompt + n.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Prompt tokens per forward pass.
    #[arg(long, default_value_t = 512)]
    pub batch: usize,
    /// Print one JSON object {"prompt_tokens":[...],"tokens":[...],"text":"..."} (text is the continuation only).
    #[arg(long)]
    pub json: bool,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// With --json: add "logits_sha256", a hash of the bits of every logit vector a token was
    /// sampled from (equal hashes: bit-equal logits, e.g. cluster vs one process).
    #[arg(long)]
    pub logits_digest: bool,
}

/// `ternfleet tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to tokenize (text, even when it starts with `-`).
    #[arg(short = 'p', long, allow_hyphen_values = true)]
    pub prompt: String,
    /// Print {"ids":[...]}.
    #[arg(long)]
    pub json: bool,
    /// Do not add BOS/EOS.
    #[arg(long)]
    pub no_bos: bool,
    /// Treat special-token text (e.g. <bos>) as plain text.
    #[arg(long)]
    pub no_parse_special: bool,
}

/// `ternfleet perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub text: TextArgs,
    /// Print {"ppl":..,"chunks":..,"tokens":..}.
    #[arg(long)]
    pub json: bool,
}

/// `ternfleet info`.
#[derive(Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `ternfleet routing`.
#[derive(Args, Debug)]
pub struct RoutingArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file routed (run as `ternfleet perplexity` runs it, in chunks of --ctx tokens).
    #[arg(short = 'f', long, default_value = "tests/data/text/gpl-3.txt")]
    pub file: PathBuf,
    /// Tokens measured.
    #[arg(long, default_value_t = 1000)]
    pub tokens: usize,
    /// Tokens per chunk.
    #[arg(short = 'c', long, default_value_t = 512)]
    pub ctx: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `ternfleet fit-predictor`.
#[derive(Args, Debug)]
pub struct FitPredictorArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Calibration text (hold the text you measure on out of it).
    #[arg(long, default_value = "tests/data/text/python-reference.txt")]
    pub calib: PathBuf,
    /// Calibration tokens used, the held-out part included.
    #[arg(long, default_value_t = 16384)]
    pub tokens: usize,
    /// Fraction of the tokens held out to choose the ridge strength.
    #[arg(long, default_value_t = 0.1)]
    pub holdout: f64,
    /// Tokens per chunk.
    #[arg(short = 'c', long, default_value_t = 512)]
    pub ctx: usize,
    /// Where to write it (default: BUNDLE/predictor.gguf or MODEL.predictor.gguf).
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `ternfleet bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens (pp test).
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Generated tokens (tg test).
    #[arg(long, default_value_t = 128)]
    pub gen: usize,
    /// Prompt tokens per forward pass.
    #[arg(long, default_value_t = 512)]
    pub batch: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Also measure aggregate decode throughput with this many sequences decoding together
    /// (`agg_tg_tps`, after a --prompt-token prefill of each; llama-batched-bench's S_TG).
    #[arg(long)]
    pub parallel: Option<usize>,
    /// With --parallel, --cluster and --numerics invariant: split each step into at most
    /// this many micro-batches (1 or 2), so one's attention runs while the other's experts
    /// are on the nodes; 1 measures without the overlap.
    #[arg(long = "micro-batches", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=2))]
    pub micro_batches: u64,
    /// Print {"pp_tps":..,"tg_tps":..,"pp_tps_runs":[..],"tg_tps_runs":[..],..} (the means and
    /// each run's rate).
    #[arg(long)]
    pub json: bool,
}

impl TextArgs {
    /// The text file's contents.
    fn read(&self) -> Result<String> {
        std::fs::read_to_string(&self.file)
            .with_context(|| format!("reading {}", self.file.display()))
    }
}

fn init(args: &ModelArgs) -> Result<(Model, SeqOptions)> {
    init_runtime(args.threads)?;
    if !args.model.exists() {
        let hint = if args.model == std::path::Path::new(DEFAULT_MODEL) {
            " (run scripts/fetch-model.sh qwen to download the default model)"
        } else {
            ""
        };
        bail!("model file {} not found{hint}", args.model.display());
    }
    let t = std::time::Instant::now();
    let mut model = Model::open_with(
        &args.model,
        &crate::model::OpenOptions {
            ram_budget: args.ram_budget,
            io_threads: Some(args.io_threads.clamp(1, 256)),
            evict: args.evict,
            cluster: cluster_spec(
                &args.model,
                args.cluster.cluster.as_deref(),
                args.cluster.certs.as_deref(),
                &args.cluster.cluster_id,
                args.cluster.step_deadline_ms,
            )?,
        },
    )?;
    set_prefetch(
        &mut model,
        &args.model,
        &args.prefetch,
        args.lookahead,
        args.predictor.as_deref(),
    )?;
    let opts = SeqOptions {
        top_experts: args.top_experts,
        numerics: args.numerics,
    };
    if let Some(k) = args.top_experts {
        let Some(m) = &model.cfg.moe else {
            bail!(
                "--top-experts: {} is not a mixture-of-experts model",
                args.model.display()
            );
        };
        if k == 0 || k > m.n_expert {
            bail!(
                "--top-experts {k}: the model has {} experts per layer",
                m.n_expert
            );
        }
    }
    tracing::info!(
        arch = model.cfg.arch.name(),
        layers = model.cfg.n_layer,
        n_embd = model.cfg.n_embd,
        n_vocab = model.cfg.n_vocab,
        experts = ?model.cfg.moe.as_ref().map(|m| (m.n_expert, opts.top_experts.unwrap_or(m.n_expert_used))),
        numerics = opts.numerics.name(),
        threads = rayon::current_num_threads(),
        "loaded {} in {:.2}s",
        args.model.display(),
        t.elapsed().as_secs_f64()
    );
    Ok((model, opts))
}

/// Checks a `--prefetch` / `--lookahead` pair.
pub fn check_prefetch(prefetch: &str, lookahead: usize) -> Result<()> {
    if !["none", "router", "learned"].contains(&prefetch) {
        bail!("prefetch {prefetch:?}: expected none, router or learned");
    }
    if !(1..=8).contains(&lookahead) {
        bail!("--lookahead must be 1 to 8, got {lookahead}");
    }
    Ok(())
}

/// Turns the shadow predictor's hints on (`router`, `learned`) or off (`none`); a learned
/// predictor comes from `predictor` or its default place beside `path`.
pub fn set_prefetch(
    model: &mut Model,
    path: &std::path::Path,
    prefetch: &str,
    lookahead: usize,
    predictor: Option<&std::path::Path>,
) -> Result<()> {
    check_prefetch(prefetch, lookahead)?;
    model.lookahead = if prefetch == "none" { 0 } else { lookahead };
    if prefetch != "learned" {
        if predictor.is_some() {
            bail!("--predictor needs --prefetch learned");
        }
        return Ok(());
    }
    let file = predictor.map_or_else(
        || crate::model::predict::default_path(path),
        std::path::Path::to_path_buf,
    );
    if !file.exists() {
        bail!(
            "--prefetch learned: no predictor at {} (fit one: ternfleet fit-predictor -m {} --calib TEXT)",
            file.display(),
            path.display()
        );
    }
    let lp = crate::model::predict::LearnedPredictor::load(&file, &model.cfg)?;
    tracing::info!(
        lookahead = lp.lookahead(),
        "learned predictor {}",
        file.display()
    );
    model.learned = Some(std::sync::Arc::new(lp));
    Ok(())
}

/// Logging, the compute thread pool and the kernel choice.
fn init_runtime(threads: Option<usize>) -> Result<()> {
    crate::telemetry::init()?;
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    // Ignore the error of a second initialisation (tests call `run` repeatedly in one process).
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global();
    tracing::info!("kernels: {}", ternfleet_kernels::isa_name());
    if let Some(note) = ternfleet_kernels::isa_note() {
        tracing::warn!("kernels: {note}");
    }
    Ok(())
}

pub(crate) fn progress_bar(template: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(template)
            .expect("static progress template is valid"),
    );
    bar
}

/// Runs one parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    let (service, id) = match &cli.command {
        Command::Node(a) => ("ternfleet-node", a.id.clone()),
        Command::Serve(a) => (
            "ternfleet-coordinator",
            a.id.clone().unwrap_or_else(|| "coordinator".into()),
        ),
        _ => ("ternfleet", String::new()),
    };
    crate::telemetry::configure(crate::telemetry::Options {
        format: cli.log_format,
        otlp_endpoint: cli.otlp_endpoint.clone(),
        service: service.into(),
        id,
    });
    let r = dispatch(cli.command);
    crate::telemetry::shutdown();
    r
}

fn dispatch(command: Command) -> Result<()> {
    match command {
        Command::Generate(a) => cmd_generate(a),
        Command::Tokenize(a) => cmd_tokenize(a),
        Command::Perplexity(a) => cmd_perplexity(a),
        Command::Routing(a) => cmd_routing(a),
        Command::FitPredictor(a) => cmd_fit_predictor(a),
        Command::Bench(a) => cmd_bench(a),
        Command::Info(a) => cmd_info(a),
        Command::Convert(a) => cmd_convert(a),
        Command::Compare(a) => cmd_compare(a),
        Command::Serve(a) => cmd_serve(*a),
        Command::Certs(a) => cmd_certs(a),
        Command::Cluster(a) => cmd_cluster(a),
        Command::Node(a) => cmd_node(a),
        Command::Ctl(a) => crate::ctl::run(a),
        Command::Probe(a) => cmd_probe(a),
        Command::OtlpSink(a) => crate::otlp_sink::run(&a.listen),
    }
}

/// `probe quic://HOST:PORT`: a node's state, asked with `Hello` over mutual TLS.
fn probe_node(a: &ProbeArgs, host: &str) -> Result<()> {
    use ternfleet_shared::wire::{Frame, NodeState};
    let (Some(certs), Some(id)) = (&a.certs, &a.id) else {
        bail!("probe {}: quic:// needs --certs DIR and --id ID", a.url);
    };
    let node = a.node.clone().unwrap_or_else(|| id.clone());
    let me = ternfleet_shared::mtls::Identity::load(certs, id)?;
    let timeout = std::time::Duration::from_secs(a.timeout.max(1));
    let addr = std::net::ToSocketAddrs::to_socket_addrs(host)
        .with_context(|| format!("{host}: not a HOST:PORT that resolves"))?
        .next()
        .with_context(|| format!("{host}: resolves to no address"))?;
    let hello = Frame::Hello { id: id.clone() }.encode()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = rt.block_on(async {
        let any: std::net::SocketAddr = if addr.is_ipv4() {
            "0.0.0.0:0".parse()?
        } else {
            "[::]:0".parse()?
        };
        let ep = ternfleet_shared::net::endpoint(any, None)?;
        let ask = async {
            let conn = ep
                .connect_with(me.client_config()?, addr, &node)?
                .await
                .with_context(|| format!("{}: handshake", a.url))?;
            let (mut send, mut recv) = conn.open_bi().await?;
            ternfleet_shared::net::write_frame(&mut send, &hello)
                .await
                .map_err(anyhow::Error::msg)?;
            let f = ternfleet_shared::net::read_frame(&mut recv)
                .await
                .map_err(|e| {
                    anyhow::anyhow!(
                        "{e}: the node closed the connection (a node outside a control plane \
                     answers only the coordinators' certificates: --id coordinator --node ID)"
                    )
                })?;
            conn.close(0u32.into(), b"probed");
            anyhow::Ok(f)
        };
        let r = tokio::time::timeout(timeout, ask).await;
        ep.close(0u32.into(), b"");
        r.map_err(|_| anyhow::anyhow!("{}: no answer within {timeout:?}", a.url))?
    })?;
    match answer {
        Frame::Status {
            state: NodeState::Ready,
            ..
        } => Ok(()),
        Frame::Status {
            state: NodeState::Loading { done, total },
            ..
        } => bail!(
            "{}: node {node} is loading ({:.0} % of {total} bytes)",
            a.url,
            done as f64 * 100.0 / total.max(1) as f64
        ),
        Frame::Status {
            state: NodeState::Unavailable(why),
            ..
        } => bail!("{}: node {node} is unavailable: {why}", a.url),
        Frame::Error { message, .. } => bail!("{}: {message}", a.url),
        f => bail!("{}: answered {f:?}", a.url),
    }
}

fn cmd_probe(a: ProbeArgs) -> Result<()> {
    use std::io::{Read, Write};
    if let Some(host) = a.url.strip_prefix("quic://") {
        return probe_node(&a, host.trim_end_matches('/'));
    }
    let rest = a
        .url
        .strip_prefix("http://")
        .with_context(|| format!("{}: only http:// URLs are probed", a.url))?;
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let timeout = std::time::Duration::from_secs(a.timeout.max(1));
    let addr = std::net::ToSocketAddrs::to_socket_addrs(host)
        .with_context(|| format!("{host}: not a HOST:PORT that resolves"))?
        .next()
        .with_context(|| format!("{host}: resolves to no address"))?;
    let mut conn = std::net::TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("{}: cannot connect", a.url))?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes())
        .with_context(|| format!("{}: sending the request", a.url))?;
    let mut answer = Vec::new();
    conn.take(64 * 1024)
        .read_to_end(&mut answer)
        .with_context(|| format!("{}: no answer within {timeout:?}", a.url))?;
    let text = String::from_utf8_lossy(&answer);
    let status = text.lines().next().unwrap_or_default().to_string();
    if status.split_whitespace().nth(1) == Some("200") {
        return Ok(());
    }
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).trim();
    bail!("{}: {status} {body}", a.url)
}

fn cmd_serve(a: ServeArgs) -> Result<()> {
    let cfg = a.config()?;
    init_runtime(cfg.threads)?;
    if !cfg.model.exists() {
        let hint = if cfg.model == std::path::Path::new(DEFAULT_MODEL) {
            " (run scripts/fetch-model.sh qwen to download the default model)"
        } else {
            ""
        };
        bail!("model {} not found{hint}", cfg.model.display());
    }
    crate::serve::serve(cfg)
}

fn cmd_certs(a: CertsArgs) -> Result<()> {
    use ternfleet_shared::mtls;
    match a.cmd {
        CertsCmd::Init { dir, issue, keep } => {
            let ca = dir.join("ca.pem");
            if keep && ca.exists() {
                println!("cluster CA: {} (kept)", ca.display());
            } else {
                let ca = mtls::init_ca(&dir)?;
                println!(
                    "cluster CA: {} (its key beside it, readable by you only)",
                    ca.display()
                );
            }
            for name in issue {
                let pem = dir.join(format!("{name}.pem"));
                if keep && pem.exists() {
                    println!("{name}: {} (kept)", pem.display());
                    continue;
                }
                let (pem, key) = mtls::issue(&dir, &name)?;
                println!("{name}: {} and {}", pem.display(), key.display());
            }
        }
        CertsCmd::Issue { dir, name } => {
            let (pem, key) = mtls::issue(&dir, &name)?;
            println!("{name}: {} and {}", pem.display(), key.display());
        }
    }
    Ok(())
}

fn cmd_cluster(a: ClusterArgs) -> Result<()> {
    let ClusterCmd::Plan {
        bundle,
        nodes,
        replicas,
        out,
    } = a.cmd;
    let man = ternfleet_shared::bundle::Manifest::read(&bundle)?;
    let mut list = Vec::new();
    for n in &nodes {
        let Some((id, addr)) = n.split_once('=') else {
            bail!("--node {n:?}: expected ID=HOST:PORT");
        };
        list.push((id.to_string(), addr.to_string()));
    }
    let mut file = ternfleet_shared::cluster::ClusterFile::plan(&man, &list, replicas)?;
    file.bundle = Some(ternfleet_shared::bundle::manifest_digest(&bundle)?);
    std::fs::write(&out, file.to_toml()).with_context(|| format!("writing {}", out.display()))?;
    let placement = file.placement(man.n_layer, man.moe.n_expert)?;
    let bytes = |i: usize| -> u64 {
        man.experts
            .iter()
            .filter(|e| placement.nodes[i].experts[e.layer].contains(&e.expert))
            .map(|e| e.part.bytes)
            .sum()
    };
    println!("{:<16} {:>8} {:>12}", "node", "experts", "MB");
    for (i, n) in placement.nodes.iter().enumerate() {
        let count: usize = n.experts.iter().map(|s| s.len()).sum();
        println!("{:<16} {:>8} {:>12.1}", n.id, count, bytes(i) as f64 / 1e6);
    }
    println!("wrote {} ({replicas} replica(s) per expert)", out.display());
    Ok(())
}

fn cmd_node(a: NodeArgs) -> Result<()> {
    init_runtime(a.threads)?;
    let man = ternfleet_shared::bundle::Manifest::read(&a.model)?;
    let arch = crate::model::config::Arch::from_name(&man.architecture)?;
    ternfleet_node::server::run(ternfleet_node::server::NodeOptions {
        bundle: a.model,
        id: a.id,
        certs: a.certs,
        cluster: a.cluster,
        listen: a.listen,
        ram_budget: a.ram_budget,
        io_threads: a.io_threads.clamp(1, 256),
        evict: a.evict,
        act: crate::model::weights::activation(arch),
        state_dir: a.state_dir.or_else(crate::seat::default_state_dir),
        control: (a.init_cluster || a.join.is_some()).then(|| {
            ternfleet_node::control::ControlOptions {
                init_cluster: a.init_cluster,
                join: a.join.clone(),
            }
        }),
        prune: a.prune,
        move_rate: a.move_rate,
        move_chunk: a
            .move_chunk
            .clamp(1, ternfleet_shared::wire::MAX_BLOB_CHUNK as u64) as u32,
        metrics: match a.metrics.as_deref() {
            None => ternfleet_node::server::MetricsAddr::Default,
            Some("off") => ternfleet_node::server::MetricsAddr::Off,
            Some(addr) => ternfleet_node::server::MetricsAddr::At(addr.to_string()),
        },
        listen_any: a.listen_any,
    })?;
    Ok(())
}

fn cmd_convert(a: ConvertArgs) -> Result<()> {
    init_runtime(a.threads)?;
    let opts = crate::convert::ConvertOptions {
        model: a.model.clone(),
        out: a.out.clone(),
        experts: a.experts,
        top_k: a.top_k,
        calib: a.calib.clone(),
        calib_tokens: a.calib_tokens,
        expert_type: crate::convert::ExpertType::parse(&a.expert_type)?,
        seed: a.seed,
        grouping: crate::convert::moefy::Grouping::parse(&a.grouping)?,
    };
    let bar =
        progress_bar("convert {msg:24} {bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}]");
    let t = std::time::Instant::now();
    let r = crate::convert::convert(&opts, &|stage, done, total| {
        bar.set_message(stage.to_string());
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let r = r?;
    let m = &r.manifest;
    let bytes: u64 = m.experts.iter().map(|e| e.part.bytes).sum();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "out": a.out, "architecture": m.architecture, "layers": m.n_layer,
                "moe": m.moe, "expert_bytes": bytes, "coordinator_bytes": m.coordinator.bytes,
                "written": r.written, "reused": r.reused, "notes": m.provenance.notes,
            })
        );
    } else {
        println!(
            "bundle {}: {} {} layers x {} experts (top-{} by default, {:?} gating), experts {:.1} MiB + coordinator {:.1} MiB; {} parts written, {} reused, {:.1}s",
            a.out.display(),
            m.architecture,
            m.n_layer,
            m.moe.n_expert,
            m.moe.n_expert_used,
            m.moe.gating,
            bytes as f64 / (1 << 20) as f64,
            m.coordinator.bytes as f64 / (1 << 20) as f64,
            r.written,
            r.reused,
            t.elapsed().as_secs_f64()
        );
        for n in &m.provenance.notes {
            println!("note: {n}");
        }
    }
    Ok(())
}

fn cmd_compare(a: CompareArgs) -> Result<()> {
    let (model, opts) = init(&a.model)?;
    let reference = Model::open(&a.reference)
        .with_context(|| format!("reference {}", a.reference.display()))?;
    // Two MoE models with the same experts are compared at the same top-k.
    let mut ref_opts = SeqOptions {
        top_experts: None,
        numerics: a.ref_numerics.unwrap_or(opts.numerics),
    };
    if let (Some(k), Some(m)) = (a.model.top_experts, &reference.cfg.moe) {
        if k <= m.n_expert {
            ref_opts.top_experts = Some(k);
        }
    }
    let t = &a.text;
    let text = t.read()?;
    let bar = progress_bar(
        "compare {msg:9} {bar:40} {pos}/{len} chunks [{elapsed_precise}<{eta_precise}]",
    );
    let r = crate::compare::compare(
        &model,
        &reference,
        opts,
        ref_opts,
        &text,
        t.ctx,
        t.batch,
        t.chunks,
        |what, done, total| {
            bar.set_message(what.to_string());
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    );
    bar.finish_and_clear();
    let r = r?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "perplexity {:.4} vs reference {:.4} ({:+.2} %); top-1 agreement {:.2} % over {} positions",
            r.ppl,
            r.ppl_ref,
            100.0 * (r.ppl / r.ppl_ref - 1.0),
            100.0 * r.top1_agreement,
            r.scored
        );
        if let Some(ra) = &r.routing_agreement {
            let v: Vec<String> = ra.iter().map(|x| format!("{:.1}", 100.0 * x)).collect();
            println!(
                "routing agreement per layer (% of tokens with the same expert set): {}",
                v.join(" ")
            );
        }
    }
    Ok(())
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let (model, opts) = init(&a.model)?;
    let params = SamplerParams {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        seed: a.seed,
        ..SamplerParams::default()
    };
    if let Some(file) = &a.prompts {
        return generate_many(&model, opts, params, file, &a);
    }
    let mut sampler = Sampler::new(params)?;
    let prompt = a.prompt.as_deref().unwrap_or_default();
    let prompt_tokens = model.tokenizer.encode(prompt, true, true);
    if prompt_tokens.is_empty() {
        bail!("the prompt tokenizes to no tokens");
    }
    let need = prompt_tokens
        .len()
        .checked_add(a.n.saturating_sub(1))
        .with_context(|| format!("-n {}: too many tokens", a.n))?;
    let n_ctx = a.ctx.unwrap_or(need.max(1));
    if need > n_ctx {
        bail!(
            "prompt ({} tokens) + {} new tokens exceed --ctx {n_ctx}",
            prompt_tokens.len(),
            a.n
        );
    }
    if n_ctx > model.cfg.n_ctx_train {
        tracing::warn!(
            "context {n_ctx} exceeds the model's training context {}",
            model.cfg.n_ctx_train
        );
    }
    check_kv_fits(&model, n_ctx, "--ctx")?;
    let mut cache = model.new_cache_with(n_ctx, opts);
    let req = GenerateRequest {
        prompt_tokens: prompt_tokens.clone(),
        max_tokens: a.n,
        batch: a.batch,
        stop_at_eog: !a.ignore_eos,
        digest: a.logits_digest,
    };
    let stdout = std::io::stdout();
    let mut pending: Vec<u8> = Vec::new();
    let json = a.json;
    let g = generate(&model, &mut cache, &mut sampler, &req, |tok| {
        if !json {
            // Print whole UTF-8 characters as soon as they are complete.
            pending.extend(model.tokenizer.token_to_piece(tok, false));
            let valid = match std::str::from_utf8(&pending) {
                Ok(_) => pending.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => pending.len(),
            };
            let mut out = stdout.lock();
            let _ = out.write_all(String::from_utf8_lossy(&pending[..valid]).as_bytes());
            let _ = out.flush();
            pending.drain(..valid);
        }
    })?;
    let text = model.tokenizer.decode(&g.tokens);
    if json {
        let mut obj =
            serde_json::json!({ "prompt_tokens": prompt_tokens, "tokens": g.tokens, "text": text });
        if let Some(d) = &g.logits_sha256 {
            obj["logits_sha256"] = d.clone().into();
        }
        println!("{obj}");
    } else {
        if !pending.is_empty() {
            print!("{}", String::from_utf8_lossy(&pending));
        }
        println!();
    }
    let n = g.tokens.len();
    tracing::info!(
        "prompt {} tokens in {:.3}s ({:.1} t/s), generated {n} tokens in {:.3}s ({:.1} t/s)",
        prompt_tokens.len(),
        g.prefill_s,
        prompt_tokens.len() as f64 / g.prefill_s.max(1e-9),
        g.decode_s,
        n as f64 / g.decode_s.max(1e-9)
    );
    Ok(())
}

/// One prompt per line of `text`: `\n` becomes a newline and `\\` a backslash; a
/// backslash before anything else stays as it is.
pub fn parse_prompt_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|line| {
            let mut out = String::with_capacity(line.len());
            let mut chars = line.chars();
            while let Some(c) = chars.next() {
                if c != '\\' {
                    out.push(c);
                    continue;
                }
                match chars.next() {
                    Some('n') => out.push('\n'),
                    Some('\\') => out.push('\\'),
                    Some(other) => {
                        out.push('\\');
                        out.push(other);
                    }
                    None => out.push('\\'),
                }
            }
            out
        })
        .collect()
}

/// `generate --prompts FILE`: every prompt through the batched engine.
fn generate_many(
    model: &Model,
    opts: SeqOptions,
    params: SamplerParams,
    file: &std::path::Path,
    a: &GenerateArgs,
) -> Result<()> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading prompts from {}", file.display()))?;
    let prompts = parse_prompt_lines(&text);
    if prompts.is_empty() {
        bail!("{}: no prompts (one per line)", file.display());
    }
    let mut toks = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let t = model.tokenizer.encode(p, true, true);
        if t.is_empty() {
            bail!(
                "{} line {}: the prompt tokenizes to no tokens",
                file.display(),
                i + 1
            );
        }
        toks.push(t);
    }
    if a.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    let eopts = crate::engine::EngineOptions {
        parallel: a.parallel,
        chunk: a.batch.max(1),
        max_tokens: a.n,
        stop_at_eog: !a.ignore_eos,
        numerics: opts.numerics,
        kv_budget: a.kv_budget,
        top_experts: opts.top_experts,
        sampling: params,
        keep_logits: a.logits_digest,
    };
    let (outs, stats) = crate::engine::run(model, &toks, &eopts)?;
    let mut stdout = std::io::stdout().lock();
    for (i, o) in outs.iter().enumerate() {
        let text = model.tokenizer.decode(&o.tokens);
        if a.json {
            let mut obj = serde_json::json!({ "index": i, "prompt_tokens": toks[i].len(), "tokens": o.tokens, "text": text });
            if a.logits_digest {
                obj["logits_sha256"] = crate::generate::logits_sha256(&o.logits).into();
            }
            writeln!(stdout, "{obj}")?;
        } else {
            writeln!(stdout, "[{i}] {}{text}", prompts[i])?;
        }
    }
    tracing::info!(
        "{} prompts, {} at a time: {} steps, {} prompt tokens ({} from shared prefixes), {} generated in {:.2}s ({:.1} t/s)",
        toks.len(),
        a.parallel,
        stats.steps,
        stats.prompt_tokens,
        stats.prefix_reused,
        stats.generated,
        stats.wall_s,
        stats.generated as f64 / stats.wall_s.max(1e-9)
    );
    Ok(())
}

/// Refuses a context whose KV cache would not fit in this machine's memory, naming the flag
/// (a huge `-n` or `--ctx` is an error, not an allocation failure).
fn check_kv_fits(model: &Model, positions: usize, flag: &str) -> Result<()> {
    let per = crate::kv_pool::KvPool::block_bytes(
        model.cfg.n_layer,
        model.cfg.k_dim(),
        model.cfg.v_dim(),
    ) / crate::kv_pool::BLOCK as u64;
    let need = (positions as u64).saturating_mul(per);
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kib| kib.saturating_mul(1024))
        .unwrap_or(u64::MAX);
    if need > total {
        bail!(
            "{flag}: {positions} positions need {:.1} GiB of KV cache ({per} bytes each), more than this machine's {:.1} GiB of memory",
            need as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        );
    }
    Ok(())
}

/// A size: plain bytes or a number with KiB/MiB/GiB/TiB (or KB/MB/GB/TB, also powers of two).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a size such as 512MiB, 8GiB or 1048576"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => {
            return Err(format!(
                "{s:?}: unknown unit {u:?} (use KiB, MiB, GiB or TiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?}: too large"))
}

fn cmd_tokenize(a: TokenizeArgs) -> Result<()> {
    let (model, _) = init(&a.model)?;
    let ids = model
        .tokenizer
        .encode(&a.prompt, !a.no_bos, !a.no_parse_special);
    if a.json {
        println!("{}", serde_json::json!({ "ids": ids }));
    } else {
        for id in ids {
            let piece = model.tokenizer.token_to_piece(id, true);
            println!("{id:>8} -> {:?}", String::from_utf8_lossy(&piece));
        }
    }
    Ok(())
}

fn cmd_perplexity(a: PerplexityArgs) -> Result<()> {
    let (model, opts) = init(&a.model)?;
    let t = &a.text;
    let text = t.read()?;
    let bar = progress_bar(
        "perplexity {bar:40} {pos}/{len} chunks, {msg} [{elapsed_precise}<{eta_precise}]",
    );
    let r = crate::perplexity::perplexity(
        &model,
        opts,
        &text,
        t.ctx,
        t.batch,
        t.chunks,
        |done, total, ppl| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(format!("ppl {ppl:.4}"));
        },
    );
    bar.finish_and_clear();
    let r = r?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "ppl": r.ppl, "chunks": r.chunks, "tokens": r.tokens, "ctx": t.ctx, "ppl_chunks": r.ppl_chunks })
        );
    } else {
        println!(
            "perplexity: {:.4} ({} chunks of {} tokens, {} tokens in the text)",
            r.ppl, r.chunks, t.ctx, r.tokens
        );
    }
    Ok(())
}

fn cmd_fit_predictor(a: FitPredictorArgs) -> Result<()> {
    if !(a.holdout > 0.0 && a.holdout < 0.5) {
        bail!("--holdout must be between 0 and 0.5, got {}", a.holdout);
    }
    let (model, opts) = init(&a.model)?;
    let text = std::fs::read_to_string(&a.calib)
        .with_context(|| format!("reading {}", a.calib.display()))?;
    let fo = crate::model::fit::FitOptions {
        tokens: a.tokens,
        lookahead: a.model.lookahead.max(crate::routing::MAX_LOOKAHEAD),
        ctx: a.ctx,
        holdout: a.holdout,
    };
    let out = a
        .output
        .clone()
        .unwrap_or_else(|| crate::model::predict::default_path(&a.model.model));
    let bar = progress_bar("fitting {bar:40} {pos}/{len} chunks [{elapsed_precise}<{eta_precise}]");
    let t = std::time::Instant::now();
    let r = crate::model::fit::fit(&model, opts, &text, &fo, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let (pred, report) = r?;
    pred.save(&out, report.train_tokens)?;
    tracing::info!(
        "fitted in {:.1}s, wrote {}",
        t.elapsed().as_secs_f64(),
        out.display()
    );
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{}: fitted on {} tokens, {} held out; recall of the top-{} on the held-out tokens by lookahead",
        out.display(),
        report.train_tokens,
        report.holdout_tokens,
        report.k
    );
    println!("  router predictor:  {}", fmt_recall(&report.router_recall));
    println!(
        "  learned predictor: {}",
        fmt_recall(&report.learned_recall)
    );
    println!(
        "  {} of {} layer pairs kept the router predictor (no ridge strength beat it)",
        report.pairs_router, report.pairs
    );
    Ok(())
}

/// Recall by lookahead: `1: 78.0 %, 2: 70.6 %, …`.
fn fmt_recall(v: &[Option<f64>]) -> String {
    v.iter()
        .enumerate()
        .map(|(j, v)| match v {
            Some(v) => format!("{}: {:.1} %", j + 1, 100.0 * v),
            None => format!("{}: n/a", j + 1),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn cmd_routing(a: RoutingArgs) -> Result<()> {
    let (model, opts) = init(&a.model)?;
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    if a.tokens == 0 {
        bail!("--tokens must be at least 1");
    }
    let bar = progress_bar("routing {bar:40} {pos}/{len} chunks [{elapsed_precise}<{eta_precise}]");
    let r = crate::routing::routing(&model, opts, &text, a.tokens, a.ctx, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let r = r?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "{} tokens, {} experts per layer, top-{}: distinct experts per layer min {} mean {:.1}; routing entropy mean {:.2} bits (max {:.2})",
        r.tokens, r.n_expert, r.k, r.distinct_min, r.distinct_mean, r.entropy_mean_bits, r.entropy_max_bits
    );
    for l in &r.layers {
        println!(
            "  layer {:>3}: {:>4} distinct, entropy {:.2} bits",
            l.layer, l.distinct, l.entropy_bits
        );
    }
    println!(
        "router predictor recall of the top-{} by lookahead {}",
        r.k,
        fmt_recall(&r.recall)
    );
    if let Some(l) = &r.recall_learned {
        println!(
            "learned predictor recall of the top-{} by lookahead {}",
            r.k,
            fmt_recall(l)
        );
    }
    for s in &r.store {
        println!(
            "store {:>3.0} % resident, {}, {}: hit rate {:.1} % (prefetches {}, used {}, wasted {})",
            100.0 * s.resident,
            s.evict,
            match s.hints {
                "none" => "without hints       ".to_string(),
                h => format!("{h} hints{}", " ".repeat(13usize.saturating_sub(h.len()))),
            },
            100.0 * s.hit_rate,
            s.prefetches,
            s.prefetch_used,
            s.prefetch_wasted
        );
    }
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let (model, opts) = init(&a.model)?;
    let positions = a
        .prompt
        .max(a.gen)
        .checked_add(1)
        .context("--prompt/--gen: too many tokens")?;
    let seqs = a.parallel.unwrap_or(1).max(1);
    check_kv_fits(
        &model,
        positions.saturating_mul(seqs),
        "--prompt/--gen/--parallel",
    )?;
    let mut r = crate::bench::bench(&model, opts, a.prompt, a.gen, a.batch, a.reps)?;
    r.store = model.experts.store_stats();
    if let Some(n) = a.parallel {
        if n == 0 {
            bail!("--parallel must be at least 1");
        }
        r.agg_tg_tps = Some(crate::bench::bench_parallel(
            &model,
            opts,
            n,
            a.prompt,
            a.gen,
            a.reps,
            a.micro_batches as usize,
        )?);
        r.parallel = Some(n);
    }
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "pp{}: {:.1} t/s   tg{}: {:.1} t/s   ({} threads, kernels {}, {} numerics, mean of {} runs)",
            a.prompt, r.pp_tps, a.gen, r.tg_tps, r.threads, r.kernels, r.numerics, r.reps
        );
        if r.reps > 1 {
            let runs: Vec<String> = [("pp", &r.pp_tps_runs), ("tg", &r.tg_tps_runs)]
                .into_iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(name, v)| {
                    let each: Vec<String> = v.iter().map(|x| format!("{x:.1}")).collect();
                    format!("{name} {}", each.join(" / "))
                })
                .collect();
            if !runs.is_empty() {
                println!("runs: {}", runs.join("   "));
            }
        }
        if let (Some(n), Some(agg)) = (r.parallel, r.agg_tg_tps) {
            println!("tg{} with {n} sequences: {agg:.1} t/s aggregate", a.gen);
        }
        if let Some(s) = &r.store {
            println!(
                "expert store: hit rate {:.1} % ({} hits, {} waits on prefetches, {} misses), prefetches {} ({} used, {} wasted), {:.2} GB read, mean read {:.2} ms",
                100.0 * s.hit_rate(),
                s.hits,
                s.waits,
                s.misses,
                s.prefetches,
                s.prefetch_used,
                s.prefetch_wasted,
                s.bytes_read as f64 / 1e9,
                s.read_ns as f64 / s.reads.max(1) as f64 / 1e6
            );
        }
    }
    Ok(())
}

fn cmd_info(a: InfoArgs) -> Result<()> {
    let (model, _) = init(&a.model)?;
    let cfg = &model.cfg;
    let file = model.file();
    let str_key = |k: &str| file.get_str(k).ok().flatten().map(str::to_string);
    // Weight types: tensors and bytes per type, largest first.
    let mut by_type = std::collections::BTreeMap::<&str, (usize, u64)>::new();
    let (mut params, mut bytes) = (0u64, 0u64);
    for t in file.tensors() {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.size;
        params += t.n_elements();
        bytes += t.size;
    }
    let mut types: Vec<_> = by_type.into_iter().collect();
    types.sort_by_key(|t| std::cmp::Reverse(t.1 .1));
    let n_swa = cfg.is_swa.iter().filter(|s| **s).count();
    let template = str_key("tokenizer.chat_template");
    // A bundle is a directory: the sizes of its top-level files (the tensor figures below count
    // its coordinator part only).
    let file_bytes = match std::fs::read_dir(&a.model.model) {
        Ok(dir) => dir
            .filter_map(|e| e.ok()?.metadata().ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .sum(),
        Err(_) => std::fs::metadata(&a.model.model).map_or(bytes, |m| m.len()),
    };
    let info = serde_json::json!({
        "model": a.model.model.display().to_string(),
        "name": str_key("general.name"),
        "arch": cfg.arch.name(),
        "params": params,
        "file_bytes": file_bytes,
        "layers": cfg.n_layer,
        "sliding_window": cfg.sliding_window,
        "sliding_window_layers": n_swa,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_head_kv": cfg.n_head_kv,
        "head_dim": [cfg.head_dim_k, cfg.head_dim_v],
        "n_ff": cfg.n_ff,
        "n_vocab": cfg.n_vocab,
        "tokenizer": str_key("tokenizer.ggml.model"),
        "n_ctx_train": cfg.n_ctx_train,
        "rope_base": cfg.rope_base,
        "rope_scale": cfg.rope_scale,
        "experts": cfg.moe.as_ref().map(|m| serde_json::json!({
            "count": m.n_expert,
            "used": m.n_expert_used,
            "n_ff": m.n_ff_exp,
            "shared_n_ff": m.n_ff_shexp,
        })),
        "chat_template": template.is_some(),
        "weights": types.iter().map(|(ty, (n, b))| serde_json::json!({
            "type": ty, "tensors": n, "bytes": b,
        })).collect::<Vec<_>>(),
        "kernels": ternfleet_kernels::isa_name(),
    });
    if a.json {
        println!("{info}");
        return Ok(());
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let name = str_key("general.name").unwrap_or_else(|| "(no general.name)".into());
    println!(
        "model       {} ({:.1} MiB)",
        a.model.model.display(),
        mib(file_bytes)
    );
    println!("name        {name}");
    println!(
        "arch        {}, {:.1} M parameters",
        cfg.arch.name(),
        params as f64 / 1e6
    );
    match cfg.sliding_window {
        Some(w) => println!(
            "layers      {} ({n_swa} with a {w}-token sliding window)",
            cfg.n_layer
        ),
        None => println!("layers      {}", cfg.n_layer),
    }
    println!(
        "width       embedding {}, FFN {}, heads {} (KV {}), head dim {}",
        cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim_k
    );
    println!(
        "vocabulary  {} ({})",
        cfg.n_vocab,
        str_key("tokenizer.ggml.model").unwrap_or_else(|| "unknown tokenizer".into())
    );
    println!(
        "context     {} tokens trained, RoPE base {}",
        cfg.n_ctx_train, cfg.rope_base
    );
    match &cfg.moe {
        Some(m) => println!(
            "experts     {} per layer, {} used per token, FFN {} each{}",
            m.n_expert,
            m.n_expert_used,
            m.n_ff_exp,
            m.n_ff_shexp
                .map_or(String::new(), |s| format!(", shared expert FFN {s}"))
        ),
        None => println!("experts     none (dense)"),
    }
    println!(
        "chat        {}",
        if template.is_some() {
            "template in the file (tokenizer.chat_template)"
        } else {
            "no template in the file (serve --chat-template NAME|FILE)"
        }
    );
    for (i, (ty, (n, b))) in types.iter().enumerate() {
        let head = if i == 0 { "weights" } else { "" };
        println!("{head:<11} {ty:<6} {n:>4} tensors {:>9.1} MiB", mib(*b));
    }
    println!("kernels     {}", ternfleet_kernels::isa_name());
    Ok(())
}
