//! The model graph: embeddings, attention over the KV pool, norms, routers and the LM head.
//! The FFN of every layer runs through an [`ExpertBackend`], so the same graph serves dense
//! models (one expert, weight 1), routed experts in process and, later, on remote nodes.
//!
//! [`Model::step`] runs one engine step: rows from many sequences (prefill chunks and decode
//! tokens mixed), every weight read once for all rows, attention per sequence over its own
//! blocks, logits for the rows that ask. A step is a transaction on the [`KvPool`]: if any
//! layer fails (an expert backend error, a timeout) no sequence's cache changes.

pub mod config;
pub mod fit;
pub mod moe;
pub mod predict;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use std::time::{Duration, Instant};

use ternfleet_kernels::{Activations, Numerics};
use ternfleet_node::expert::{dump, LocalExperts};
use ternfleet_shared::bundle::BundleError;
use ternfleet_shared::compute::Linear;
use ternfleet_shared::expert::{ExpertBackend, ExpertBatch, Route};
use ternfleet_shared::gguf::GgufFile;

use crate::attention::{attend, Segment};
use crate::kv_cache::{KvCache, SeqOptions};
use crate::kv_pool::{KvError, KvPool, SeqId};
use crate::ops;
use crate::tokenizer::Tokenizer;
pub use config::{Arch, ModelConfig, ModelError, MoeConfig};
use weights::DenseWeights;

/// Errors of a forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {id} at batch position {pos} is outside the vocabulary (n_vocab {n_vocab})")]
    BadToken { id: u32, pos: usize, n_vocab: usize },
    #[error("empty batch")]
    Empty,
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Expert(#[from] ternfleet_shared::expert::ExpertError),
    #[error(transparent)]
    Compute(#[from] ternfleet_shared::compute::ComputeError),
    #[error("layer {layer}: the expert backend returned {got} floats for {routes} routes of width {n_embd}")]
    ExpertOutput {
        layer: usize,
        got: usize,
        routes: usize,
        n_embd: usize,
    },
    #[error(transparent)]
    Kernel(#[from] ternfleet_kernels::KernelError),
}

/// Sees inside a forward pass (see [`Model::forward_observed`]). Both methods default to
/// doing nothing. `Send`: the pass runs on a compute-pool thread.
pub trait Observer: Send {
    /// The residual stream entering layer `layer`'s FFN block (before its norm):
    /// `n_tokens × n_embd`.
    fn ffn_residual(&mut self, _layer: usize, _x: &[f32]) {}
    /// The normalised FFN input of layer `layer`: `n_tokens × n_embd`.
    fn ffn_input(&mut self, _layer: usize, _x: &[f32]) {}
    /// The routes of an MoE layer (per token, best first; a shared expert last) and the
    /// router's scores (`n_tokens × n_expert`).
    fn routes(&mut self, _layer: usize, _routes: &[Route], _scores: &[f32]) {}
    /// Whether it looks at nothing (a step may then be split into micro-batches, whose
    /// layers would reach an observer as separate row ranges). Observed or not, a step
    /// computes the same bits (the last layer's FFN runs on the rows that want logits either
    /// way; an observer is shown every row's input and routing there).
    fn is_noop(&self) -> bool {
        false
    }
}

/// An [`Observer`] that looks at nothing.
pub struct NoObserver;
impl Observer for NoObserver {
    fn is_noop(&self) -> bool {
        true
    }
}

/// One micro-batch's expert call of one layer, in flight.
struct Flight {
    layer: usize,
    routes: Vec<Route>,
    /// The lane rows of the routes' tokens when the call carried only some rows (the last
    /// layer's, pruned to the rows that want logits); `None`: token `t` is lane row `t`.
    rows: Option<Vec<usize>>,
    call: Box<dyn ternfleet_shared::expert::InFlight>,
    sent: Instant,
}

/// Which positions of a batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token (generation, prefill benchmarks).
    Last,
    /// Tokens `from..` of the batch (perplexity).
    From(usize),
    /// None (a prefill chunk that is not the prompt's last).
    None,
}

impl Logits {
    /// The first row of `n` that wants logits (`n` when none does).
    fn first(self, n: usize) -> usize {
        match self {
            Logits::Last => n - 1,
            Logits::From(f) => f.min(n - 1),
            Logits::None => n,
        }
    }
}

/// One sequence's rows in a step: `tokens` at its next positions.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    /// Which of these rows return logits.
    pub logits: Logits,
    /// MoE models: experts each of its tokens uses (`None`: the model's own).
    pub top_experts: Option<usize>,
}

/// How a step computes.
#[derive(Clone, Copy, Debug)]
pub struct StepOptions {
    pub numerics: Numerics,
    /// How long one layer's expert call may take.
    pub expert_deadline: Duration,
    /// At most this many micro-batches per step (1 or 2): with 2, a step of several
    /// sequences whose experts run elsewhere (a cluster) is split in two, and one half's
    /// attention runs while the other half's experts are away. Only with invariant numerics
    /// (where it changes no bit); otherwise, or with one sequence, the step is one batch.
    pub micro_batches: usize,
}

impl Default for StepOptions {
    fn default() -> Self {
        StepOptions {
            numerics: Numerics::Parity,
            expert_deadline: Duration::from_secs(60),
            micro_batches: 2,
        }
    }
}

/// A loaded model: configuration, tokenizer, dense weights and the FFN backend.
pub struct Model {
    pub cfg: ModelConfig,
    pub tokenizer: Tokenizer,
    pub weights: DenseWeights,
    pub experts: Box<dyn ExpertBackend>,
    /// How many layers ahead the shadow predictor hints the expert backend (when it wants
    /// hints); 0 (the default): no hints.
    pub lookahead: usize,
    /// The learned shadow predictor ([`predict::LearnedPredictor`]), used for the hints where
    /// it has a map; `None`: the router predictor.
    pub learned: Option<Arc<predict::LearnedPredictor>>,
    /// Rows routed to each routed expert so far, `[layer][expert]` (the console's heatmap).
    pub routed: std::sync::Mutex<Vec<Vec<u64>>>,
    file: Arc<GgufFile>,
}

/// Where a bundle's routed experts run when they are not in this process: the nodes of a
/// placement, reached through a transport (QUIC, or an in-memory one in tests).
#[derive(Clone)]
pub struct ClusterSpec {
    pub placement: ternfleet_shared::cluster::Placement,
    pub transport: Arc<dyn ternfleet_shared::net::Transport>,
    /// This coordinator's id (the nodes check it against its certificate).
    pub me: String,
    pub opts: crate::remote::RemoteOptions,
    /// Newer placements from the control plane (`serve --join`); `None`: the placement is
    /// static (`--cluster FILE`).
    pub follow: Option<crate::remote::PlacementFeed>,
    /// Where the backend counts the rows routed to each expert.
    pub routed: crate::remote::RoutingCounts,
}

impl std::fmt::Debug for ClusterSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSpec")
            .field("nodes", &self.placement.nodes.len())
            .field("me", &self.me)
            .field("opts", &self.opts)
            .finish()
    }
}

/// How [`Model::open_with`] holds the weights.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Bundles: run the routed experts on these nodes instead of in this process.
    pub cluster: Option<ClusterSpec>,
    /// Keep at most this many bytes of routed experts in RAM (MoE GGUF files): the rest is
    /// read from disk on demand or ahead of time on the shadow predictor's hints
    /// (`ternfleet_node::store`). `None`: every expert memory-mapped.
    pub ram_budget: Option<u64>,
    /// Threads reading experts from disk (default 4).
    pub io_threads: Option<usize>,
    /// Which resident expert the store drops first.
    pub evict: ternfleet_node::store::Evict,
}

/// Opening a model: a GGUF error, or a model/tokenizer error.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {err}")]
    Gguf {
        path: String,
        err: ternfleet_shared::gguf::GgufError,
    },
    #[error("{path}: {err}")]
    Model { path: String, err: ModelError },
    #[error("{path}: tokenizer: {err}")]
    Tokenizer {
        path: String,
        err: crate::tokenizer::TokenizerError,
    },
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Shard(ternfleet_node::shard::ShardError),
    #[error(transparent)]
    Store(#[from] ternfleet_node::store::StoreError),
    #[error("{path}: --ram-budget needs a mixture-of-experts model ({why})")]
    NoStore { path: String, why: &'static str },
    #[error(
        "{path}: --cluster needs a bundle directory (make one: ternfleet convert -m {path} -o DIR)"
    )]
    ClusterNeedsBundle { path: String },
    #[error("{path}: --cluster and --ram-budget: the nodes hold the experts (give --ram-budget to `ternfleet node`)")]
    ClusterAndStore { path: String },
    #[error("cluster: {0}")]
    Cluster(String),
    #[error("cluster: {0}")]
    Remote(#[from] ternfleet_shared::expert::ExpertError),
}

pub use ternfleet_node::shard::{BLOB_EXPERT_KEY, BLOB_LAYER_KEY};

impl From<ternfleet_node::shard::ShardError> for LoadError {
    /// Bundle and GGUF errors keep their own variants (callers match on them).
    fn from(e: ternfleet_node::shard::ShardError) -> Self {
        use ternfleet_node::shard::ShardError;
        match e {
            ShardError::Bundle(b) => LoadError::Bundle(b),
            ShardError::Gguf { path, err } => LoadError::Gguf {
                path: path.display().to_string(),
                err,
            },
            other => LoadError::Shard(other),
        }
    }
}

impl Model {
    /// Opens a GGUF model file, or a bundle directory (see [`Model::open_bundle`]), and binds
    /// its weights (memory-mapped, nothing copied but norms and routers).
    pub fn open(path: &Path) -> Result<Model, LoadError> {
        Model::open_with(path, &OpenOptions::default())
    }

    /// [`Model::open`] with options (an expert store within a RAM budget).
    pub fn open_with(path: &Path, opts: &OpenOptions) -> Result<Model, LoadError> {
        let p = path.display().to_string();
        if opts.cluster.is_some() && opts.ram_budget.is_some() {
            return Err(LoadError::ClusterAndStore { path: p });
        }
        if path.is_dir() {
            let store = opts
                .ram_budget
                .map(|b| (b, opts.io_threads.unwrap_or(4), opts.evict));
            return Model::open_bundle_with(path, store, opts.cluster.as_ref());
        }
        if opts.cluster.is_some() {
            return Err(LoadError::ClusterNeedsBundle { path: p });
        }
        let file = Arc::new(GgufFile::open(path).map_err(|err| LoadError::Gguf {
            path: p.clone(),
            err,
        })?);
        let store = opts
            .ram_budget
            .map(|budget| (path, budget, opts.io_threads.unwrap_or(4), opts.evict));
        Self::from_file_with(file, store).map_err(|e| match e {
            LoadError::Model { err, .. } => LoadError::Model {
                path: p.clone(),
                err,
            },
            LoadError::Tokenizer { err, .. } => LoadError::Tokenizer {
                path: p.clone(),
                err,
            },
            other => other,
        })
    }

    /// Binds an already opened file.
    pub fn from_file(file: Arc<GgufFile>) -> Result<Model, LoadError> {
        Self::from_file_with(file, None)
    }

    /// Binds an already opened file; `store`: (its path, RAM budget, I/O threads) to serve
    /// the routed experts from an expert store.
    fn from_file_with(
        file: Arc<GgufFile>,
        store: Option<(&Path, u64, usize, ternfleet_node::store::Evict)>,
    ) -> Result<Model, LoadError> {
        let wrap = |err| LoadError::Model {
            path: String::new(),
            err,
        };
        let cfg = ModelConfig::from_gguf(&file).map_err(wrap)?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|err| LoadError::Tokenizer {
            path: String::new(),
            err,
        })?;
        let (weights, ffns) = weights::load(&file, &cfg, true).map_err(wrap)?;
        let experts: Box<dyn ExpertBackend> = match store {
            None => Box::new(LocalExperts::new(ffns)),
            Some((path, ..)) if cfg.moe.is_none() => {
                return Err(LoadError::NoStore {
                    path: path.display().to_string(),
                    why: "this model has no routed experts",
                })
            }
            Some((_, budget, io, evict)) => {
                let n_routed = cfg.moe.as_ref().map_or(0, |m| m.n_expert);
                Box::new(ternfleet_node::store::StoreExperts::new(
                    ffns, n_routed, budget, evict, io,
                )?)
            }
        };
        Ok(Model {
            cfg,
            tokenizer,
            weights,
            experts,
            lookahead: 0,
            learned: None,
            routed: Default::default(),
            file,
        })
    }

    /// Opens a bundle written by `ternfleet convert`: checks the manifest, the size and
    /// SHA-256 of every part and that each part is the one the manifest describes, then binds
    /// the coordinator part and every expert blob (all held by this process's backend).
    pub fn open_bundle(dir: &Path) -> Result<Model, LoadError> {
        Model::open_bundle_with(dir, None, None)
    }

    /// [`Model::open_bundle`]; `store`: (RAM budget, I/O threads) to serve the expert blobs
    /// from an expert store.
    fn open_bundle_with(
        dir: &Path,
        store: Option<(u64, usize, ternfleet_node::store::Evict)>,
        cluster: Option<&ClusterSpec>,
    ) -> Result<Model, LoadError> {
        use ternfleet_shared::bundle::{Gating, Manifest};
        let man = Manifest::read(dir)?;
        let cpath = Manifest::verify_part(dir, &man.coordinator)?;
        let cp = cpath.display().to_string();
        let mismatch = |path: &Path, msg: String| {
            LoadError::Bundle(BundleError::Mismatch {
                path: path.to_owned(),
                msg,
            })
        };
        let file = Arc::new(GgufFile::open(&cpath).map_err(|err| LoadError::Gguf {
            path: cp.clone(),
            err,
        })?);
        let wrap = |err| LoadError::Model {
            path: cp.clone(),
            err,
        };
        let mut cfg = ModelConfig::from_gguf(&file).map_err(wrap)?;
        if cfg.arch.name() != man.architecture || cfg.n_layer != man.n_layer {
            return Err(mismatch(
                &cpath,
                format!(
                    "architecture {} with {} layers, the manifest says {} with {}",
                    cfg.arch.name(),
                    cfg.n_layer,
                    man.architecture,
                    man.n_layer
                ),
            ));
        }
        let mi = &man.moe;
        let moe = MoeConfig {
            n_expert: mi.n_expert,
            n_expert_used: mi.n_expert_used,
            n_ff_exp: mi.n_ff_exp,
            gating: mi.gating,
            n_ff_shexp: mi.n_ff_shexp,
        };
        if let Some(own) = &cfg.moe {
            if own.n_expert != moe.n_expert
                || own.n_ff_exp != moe.n_ff_exp
                || own.n_ff_shexp != moe.n_ff_shexp
            {
                return Err(mismatch(
                    &cpath,
                    format!("its experts are {own:?}, the manifest says {moe:?}"),
                ));
            }
        }
        cfg.moe = Some(moe);
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|err| LoadError::Tokenizer {
            path: cp.clone(),
            err,
        })?;
        let (weights, shared) = weights::load(&file, &cfg, false).map_err(wrap)?;
        let shape = ternfleet_node::shard::ExpertShape {
            n_embd: cfg.n_embd,
            n_ff: mi.n_ff_exp,
            act: weights::activation(cfg.arch),
            routed: mi.gating != Gating::TopKUnit,
        };
        if let Some(c) = cluster {
            let digest = ternfleet_shared::bundle::manifest_digest(dir)?;
            let experts = Self::remote_experts(&man, &digest, shared, c)?;
            return Ok(Model {
                cfg,
                tokenizer,
                weights,
                experts: Box::new(experts),
                lookahead: 0,
                learned: None,
                routed: Default::default(),
                file,
            });
        }
        // Single-node mode holds every expert; a node opens only its shard the same way.
        let blobs = ternfleet_node::shard::open_experts(dir, &man, shape, |_, _| true)
            .map_err(LoadError::from)?
            .into_iter()
            .map(|(_, _, w)| w);
        let mut blobs = blobs;
        let ffns = shared
            .into_iter()
            .map(|sh| {
                let mut layer: Vec<_> = blobs.by_ref().take(mi.n_expert).collect();
                layer.extend(sh);
                layer
            })
            .collect();
        Ok(Model {
            cfg,
            tokenizer,
            weights,
            experts: match store {
                None => Box::new(LocalExperts::new(ffns)),
                Some((budget, io, evict)) => Box::new(ternfleet_node::store::StoreExperts::new(
                    ffns,
                    mi.n_expert,
                    budget,
                    evict,
                    io,
                )?),
            },
            lookahead: 0,
            learned: None,
            routed: Default::default(),
            file,
        })
    }

    /// The remote backend of a bundle: routed experts on the placement's nodes, shared
    /// experts here; each layer's input type from the manifest's tensor types (the same rule
    /// as `LocalExperts::input_type`).
    fn remote_experts(
        man: &ternfleet_shared::bundle::Manifest,
        digest: &str,
        shared: Vec<Vec<ternfleet_node::expert::FfnWeights>>,
        c: &ClusterSpec,
    ) -> Result<crate::remote::RemoteExperts, LoadError> {
        let n_expert = man.moe.n_expert;
        if c.placement.n_layer() != man.n_layer {
            return Err(LoadError::Cluster(format!(
                "the placement has {} layers, the bundle {}",
                c.placement.n_layer(),
                man.n_layer
            )));
        }
        let mut dots: Vec<Vec<Option<ternfleet_kernels::GgmlType>>> = vec![Vec::new(); man.n_layer];
        for e in &man.experts {
            for t in &e.tensors {
                if t.name == weights::BLOB_TENSORS[0] || t.name == weights::BLOB_TENSORS[1] {
                    let ty = ternfleet_kernels::GgmlType::ALL
                        .iter()
                        .copied()
                        .find(|g| g.name() == t.ty);
                    if let Some(l) = dots.get_mut(e.layer) {
                        l.push(ty.and_then(ternfleet_kernels::vec_dot_type));
                    }
                }
            }
        }
        for (l, sh) in shared.iter().enumerate() {
            for w in sh {
                for m in [&w.gate, &w.up] {
                    dots[l].push(ternfleet_kernels::vec_dot_type(m.ty()));
                }
            }
        }
        let input_types = dots
            .iter()
            .map(|d| match d.first() {
                Some(Some(t)) if d.iter().all(|x| x == &Some(*t)) => *t,
                _ => ternfleet_kernels::GgmlType::F32,
            })
            .collect();
        Ok(crate::remote::RemoteExperts::connect(
            c,
            digest,
            n_expert,
            shared,
            input_types,
        )?)
    }

    /// The mapped file.
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// A single-sequence cache for `n_ctx` positions (CLI tools, tests): parity numerics, the
    /// model's own expert count.
    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        KvCache::new(&self.cfg, n_ctx, SeqOptions::default())
    }

    /// [`Model::new_cache`] with a request's options.
    pub fn new_cache_with(&self, n_ctx: usize, opts: SeqOptions) -> KvCache {
        KvCache::new(&self.cfg, n_ctx, opts)
    }

    /// A KV pool of `budget` bytes for this model (prefix sharing in invariant mode only).
    pub fn new_pool(&self, budget: u64, numerics: Numerics) -> Result<KvPool, KvError> {
        KvPool::new(
            self.cfg.n_layer,
            self.cfg.k_dim(),
            self.cfg.v_dim(),
            budget,
            numerics == Numerics::Invariant,
        )
    }

    /// Runs `tokens` at the next positions of `cache` and returns logits (`rows × n_vocab`) for
    /// the positions `want` selects.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward_observed(cache, tokens, want, &mut NoObserver)
    }

    /// [`Model::forward`], showing `obs` each layer's FFN input and routing decisions
    /// (MoEfication calibration, routing statistics).
    pub fn forward_observed(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        want: Logits,
        obs: &mut dyn Observer,
    ) -> Result<Vec<f32>, ForwardError> {
        let input = SeqInput {
            seq: cache.seq(),
            tokens,
            logits: want,
            top_experts: cache.opts.top_experts,
        };
        let opts = StepOptions {
            numerics: cache.opts.numerics,
            ..StepOptions::default()
        };
        let mut out = self.step(cache.pool_mut(), &[input], &opts, obs)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One engine step over `inputs` (distinct sequences): returns, per input, the logits of
    /// the rows its [`Logits`] selects (`rows × n_vocab`). All or nothing: on error no
    /// sequence's cache has changed, and running the same step again gives the same bits.
    pub fn step(
        &self,
        pool: &mut KvPool,
        inputs: &[SeqInput<'_>],
        opts: &StepOptions,
        obs: &mut dyn Observer,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        let cfg = &self.cfg;
        if inputs.is_empty() || inputs.iter().any(|i| i.tokens.is_empty()) {
            return Err(ForwardError::Empty);
        }
        let mut row = 0;
        for inp in inputs {
            for (i, &t) in inp.tokens.iter().enumerate() {
                if t as usize >= cfg.n_vocab {
                    return Err(ForwardError::BadToken {
                        id: t,
                        pos: i,
                        n_vocab: cfg.n_vocab,
                    });
                }
            }
        }
        let mut segs = Vec::with_capacity(inputs.len());
        for inp in inputs {
            segs.push(Segment {
                seq: inp.seq,
                row0: row,
                n: inp.tokens.len(),
                p0: pool.len(inp.seq)?,
            });
            row += inp.tokens.len();
        }
        let adds: Vec<(SeqId, usize)> = inputs.iter().map(|i| (i.seq, i.tokens.len())).collect();
        let tx = pool.begin(&adds)?;
        // The whole pass on one pool thread: its parallel loops then hand work to the other
        // workers directly instead of waking the pool and sleeping once per loop.
        // The caller's trace span (the server's step) goes along: the layer spans are its
        // children.
        let span = tracing::Span::current();
        let x = ternfleet_shared::compute::on_pool(|| {
            span.in_scope(|| self.layers(pool, inputs, &segs, opts, obs))
        });
        match x {
            Ok(x) => {
                let toks: Vec<&[u32]> = inputs.iter().map(|i| i.tokens).collect();
                pool.commit(tx, &toks);
                ternfleet_shared::compute::on_pool(|| self.head(&x, inputs, &segs, opts.numerics))
            }
            Err(e) => {
                pool.rollback(tx);
                Err(e)
            }
        }
    }

    /// Embeddings and every layer for the step's rows (keys and values written to the pool);
    /// returns the residual stream, `rows × n_embd`.
    fn layers(
        &self,
        pool: &mut KvPool,
        inputs: &[SeqInput<'_>],
        segs: &[Segment],
        opts: &StepOptions,
        obs: &mut dyn Observer,
    ) -> Result<Vec<f32>, ForwardError> {
        let cfg = &self.cfg;
        let numerics = opts.numerics;
        let n: usize = segs.iter().map(|s| s.n).sum();
        let d = cfg.n_embd;
        let w = &self.weights;
        // Per row: its position, and its sequence's expert count.
        let mut positions = Vec::with_capacity(n);
        let mut ks = Vec::with_capacity(n);
        // Per row: whether it returns logits. llama.cpp keeps only those rows for the last
        // layer's FFN (`inp_out_ids`), so its matmuls (and router) there see just them, which
        // in parity numerics decides their float order; so do we. An observer still sees
        // every row's FFN input and routing there.
        let mut wants = vec![false; n];
        for (s, inp) in segs.iter().zip(inputs) {
            wants[s.row0 + inp.logits.first(s.n)..s.row0 + s.n].fill(true);
        }
        let last = w.layers.len().saturating_sub(1);
        for (s, inp) in segs.iter().zip(inputs) {
            positions.extend(s.p0..s.p0 + s.n);
            let k = inp
                .top_experts
                .or(cfg.moe.as_ref().map(|m| m.n_expert_used))
                .unwrap_or(1);
            ks.extend(std::iter::repeat_n(k, s.n));
        }

        // Embeddings (ggml get_rows + scale).
        let mut x = vec![0f32; n * d];
        for (&t, row) in inputs
            .iter()
            .flat_map(|i| i.tokens)
            .zip(x.chunks_exact_mut(d))
        {
            w.token_embd.dequantize_row(t as usize, row)?;
            if cfg.embd_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= cfg.embd_scale);
            }
        }

        let mut act = Activations::new();
        let mut h = vec![0f32; n * d];
        let mut q = vec![0f32; n * cfg.q_dim()];
        let mut k = vec![0f32; n * cfg.k_dim()];
        let mut v = vec![0f32; n * cfg.v_dim()];
        let mut attn = vec![0f32; n * cfg.n_head * cfg.head_dim_v];
        let mut o = vec![0f32; n * d];
        // cos/sin per row for the (at most two) RoPE settings, computed once per step
        // instead of once per layer: the global and the sliding-window layers' bases.
        let rope_tables = |base: f32, scale: f32| -> Vec<Vec<(f32, f32)>> {
            positions
                .iter()
                .map(|&p| {
                    let mut c = Vec::with_capacity(cfg.n_rot / 2);
                    ops::rope_cache(p, cfg.n_rot, base, scale, &mut c);
                    c
                })
                .collect()
        };
        let rope_global = rope_tables(cfg.rope_base, cfg.rope_scale);
        let rope_swa = if cfg.is_swa.iter().any(|&s| s) {
            rope_tables(cfg.rope_base_swa, 1.0)
        } else {
            Vec::new()
        };
        let mut expert_in = Activations::new();
        // Micro-batches ("lanes"): whole sequences, contiguous rows. With two, one lane's
        // attention runs while the other's experts are away (software pipeline below).
        let lanes = self.lanes(segs, opts, obs);
        // Per lane, its layer's expert call in flight: (layer, routes, call, sent).
        let mut flights: Vec<Option<Flight>> = lanes.iter().map(|_| None).collect();
        // Per lane, its rows (lane-relative) that want logits: the last layer's FFN runs on
        // those alone.
        let lane_wants: Vec<Vec<usize>> = lanes
            .iter()
            .map(|&(r0, r1)| (0..r1 - r0).filter(|&t| wants[r0 + t]).collect())
            .collect();

        dump("embd", &x, d);
        // Step `il` runs every lane's attention block of layer `il`; before a lane's, the
        // lane's FFN of layer `il - 1` is collected. With one lane this is the plain order
        // (attention, experts, attention, ...); with two, lane B's attention of layer `il`
        // overlaps lane A's experts of layer `il` and lane A's attention of `il + 1`
        // overlaps lane B's experts. Every row's arithmetic is the same either way (lanes
        // are only used with invariant numerics), so the output bits are too.
        for il in 0..=w.layers.len() {
            // A trace span per layer (disabled, and free, unless traces are exported): the
            // experts collected for layer `il - 1` and layer `il`'s attention and calls.
            let _layer = tracing::debug_span!("layer", layer = il).entered();
            for ((&(r0, r1), flight), wanted) in
                lanes.iter().zip(flights.iter_mut()).zip(&lane_wants)
            {
                let nl = r1 - r0;
                if let Some(f) = flight.take() {
                    // The FFN block of layer `il - 1` for this lane: its experts' results,
                    // summed per token in route order (llama.cpp adds a token's experts
                    // slot by slot in router order, shared expert last; float addition is
                    // not associative), whatever backend or node computed them.
                    let lw = &w.layers[f.layer];
                    let ys = f.call.wait(f.sent + opts.expert_deadline)?;
                    if ys.len() != f.routes.len() * d {
                        return Err(ForwardError::ExpertOutput {
                            layer: f.layer,
                            got: ys.len(),
                            routes: f.routes.len(),
                            n_embd: d,
                        });
                    }
                    let o = &mut o[r0 * d..r1 * d];
                    o.iter_mut().for_each(|v| *v = 0.0);
                    for (r, y) in f.routes.iter().zip(ys.chunks_exact(d)) {
                        let t = r.token as usize;
                        let t = f.rows.as_ref().map_or(t, |rows| rows[t]);
                        let dst = &mut o[t * d..(t + 1) * d];
                        if r.weight == 1.0 {
                            dst.iter_mut().zip(y).for_each(|(o, v)| *o += v);
                        } else {
                            // `ggml_mul` then `ggml_add`: two roundings, no FMA.
                            dst.iter_mut().zip(y).for_each(|(o, v)| *o += r.weight * v);
                        }
                    }
                    if let Some(pn) = &lw.post_ffn_norm {
                        ops::rms_norm_rows(o, pn, cfg.rms_eps);
                    }
                    let x = &mut x[r0 * d..r1 * d];
                    x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
                    dump(&format!("l_out-{}", f.layer), x, d);
                }
                let Some(lw) = w.layers.get(il) else {
                    continue;
                };
                // This lane's rows of every buffer, and its segments rebased to them.
                let lsegs: Vec<Segment> = segs
                    .iter()
                    .filter(|s| s.row0 >= r0 && s.row0 < r1)
                    .map(|s| Segment {
                        row0: s.row0 - r0,
                        ..*s
                    })
                    .collect();
                let x = &mut x[r0 * d..r1 * d];
                let h = &mut h[r0 * d..r1 * d];
                let q = &mut q[r0 * cfg.q_dim()..r1 * cfg.q_dim()];
                let k = &mut k[r0 * cfg.k_dim()..r1 * cfg.k_dim()];
                let v = &mut v[r0 * cfg.v_dim()..r1 * cfg.v_dim()];
                let attn_dim = cfg.n_head * cfg.head_dim_v;
                let attn = &mut attn[r0 * attn_dim..r1 * attn_dim];
                let o = &mut o[r0 * d..r1 * d];

                // Attention block.
                h.copy_from_slice(x);
                ops::rms_norm_rows(h, &lw.attn_norm, cfg.rms_eps);
                dump(&format!("attn_norm-{il}"), h, d);
                linear(&mut act, &lw.wq, h, nl, lw.bq.as_deref(), q, numerics)?;
                linear(&mut act, &lw.wk, h, nl, lw.bk.as_deref(), k, numerics)?;
                linear(&mut act, &lw.wv, h, nl, lw.bv.as_deref(), v, numerics)?;
                dump(&format!("Qcur-{il}"), q, cfg.q_dim());
                dump(&format!("Kcur-{il}"), k, cfg.k_dim());
                dump(&format!("Vcur-{il}"), v, cfg.v_dim());
                if let Some(qn) = &lw.q_norm {
                    ops::rms_norm_rows(q, qn, cfg.rms_eps);
                }
                if let Some(kn) = &lw.k_norm {
                    ops::rms_norm_rows(k, kn, cfg.rms_eps);
                }
                dump(&format!("Kcur_normed-{il}"), k, cfg.k_dim());
                let rope = if cfg.is_swa[il] {
                    &rope_swa[r0..r1]
                } else {
                    &rope_global[r0..r1]
                };
                for (t, rope) in rope.iter().enumerate() {
                    for head in
                        q[t * cfg.q_dim()..(t + 1) * cfg.q_dim()].chunks_exact_mut(cfg.head_dim_k)
                    {
                        ops::rope_apply(head, rope, cfg.rope_type);
                    }
                    for head in
                        k[t * cfg.k_dim()..(t + 1) * cfg.k_dim()].chunks_exact_mut(cfg.head_dim_k)
                    {
                        ops::rope_apply(head, rope, cfg.rope_type);
                    }
                }
                if cfg.q_scale != 1.0 {
                    q.iter_mut().for_each(|v| *v *= cfg.q_scale);
                }
                dump(&format!("Qrope-{il}"), q, cfg.head_dim_k);
                dump(&format!("Krope-{il}"), k, cfg.k_dim());
                for s in &lsegs {
                    for t in 0..s.n {
                        let r = s.row0 + t;
                        pool.write(
                            il,
                            s.seq,
                            s.p0 + t,
                            &k[r * cfg.k_dim()..(r + 1) * cfg.k_dim()],
                            &v[r * cfg.v_dim()..(r + 1) * cfg.v_dim()],
                        );
                    }
                }
                let window = if cfg.is_swa[il] {
                    cfg.sliding_window
                } else {
                    None
                };
                attend(cfg, pool, il, &lsegs, q, window, numerics, attn);
                dump(&format!("kqv_out-{il}"), attn, attn_dim);
                linear(&mut act, &lw.wo, attn, nl, lw.bo.as_deref(), o, numerics)?;
                dump(&format!("attn_out-{il}"), o, d);
                if let Some(pn) = &lw.post_attn_norm {
                    ops::rms_norm_rows(o, pn, cfg.rms_eps);
                }
                x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
                dump(&format!("ffn_inp-{il}"), x, d);

                // FFN block, through the expert backend: sent now, collected at the next
                // step of the pipeline.
                obs.ffn_residual(il, x);
                h.copy_from_slice(x);
                ops::rms_norm_rows(h, &lw.ffn_norm, cfg.rms_eps);
                dump(&format!("ffn_norm-{il}"), h, d);
                obs.ffn_input(il, h);
                // The last layer: only the rows that want logits (see `wants`).
                let keep: Option<Vec<usize>> =
                    (il == last && wanted.len() < nl).then(|| wanted.clone());
                if let (Some(_), Some(r), Some(m), false) =
                    (&keep, &lw.router, &cfg.moe, obs.is_noop())
                {
                    // The observer's routing of every row (the FFN routes the kept rows
                    // below, on those rows alone).
                    let (routed, scores) = r.route_rows(m, h, nl, &ks[r0..r1], numerics);
                    obs.routes(il, &routed, &scores);
                }
                let kept;
                let (fh, fnl, lks): (&[f32], usize, &[usize]) = match &keep {
                    Some(rows) if rows.is_empty() => continue,
                    Some(rows) => {
                        let kk: Vec<usize> = rows.iter().map(|&t| ks[r0 + t]).collect();
                        kept = (gather_rows(h, rows, d), kk);
                        (&kept.0, rows.len(), &kept.1)
                    }
                    None => (h, nl, &ks[r0..r1]),
                };
                let routes = match (&lw.router, &cfg.moe) {
                    (Some(r), Some(m)) => {
                        let (routed, scores) = r.route_rows(m, fh, fnl, lks, numerics);
                        if keep.is_none() {
                            obs.routes(il, &routed, &scores);
                        }
                        routed
                    }
                    _ => (0..fnl as u32)
                        .map(|t| Route {
                            token: t,
                            expert: 0,
                            weight: 1.0,
                        })
                        .collect(),
                };
                // Shadow predictor: later layers' routers on this state hint the expert
                // store, so their experts are read while this layer computes. Never changes
                // the output.
                if self.lookahead > 0 && self.experts.wants_hints() {
                    if let (Some(m), Some(p)) = (&cfg.moe, predict::RouterPredictor::new(cfg, w)) {
                        // The most experts any row of this step uses (per-request
                        // --top-experts).
                        let kmax = lks.iter().copied().max().unwrap_or(m.n_expert_used);
                        // The last layer routes only the rows that want logits: predict
                        // its experts from those.
                        let targets = il + 1..(il + 1 + self.lookahead).min(cfg.n_layer);
                        let xw = (targets.contains(&last) && wanted.len() < nl)
                            .then(|| gather_rows(x, wanted, d));
                        for target in targets {
                            let (xs, ns) = match &xw {
                                Some(_) if target == last && wanted.is_empty() => continue,
                                Some(xw) if target == last => (&xw[..], wanted.len()),
                                _ => (&x[..], nl),
                            };
                            let mut set = match &self.learned {
                                Some(lp) if lp.has(il, target) => {
                                    lp.predict(xs, ns, il, target, kmax)
                                }
                                _ => p.predict(xs, ns, target, kmax),
                            };
                            set.sort_unstable();
                            set.dedup();
                            self.experts.prefetch(target, &set);
                        }
                    }
                }
                // The rows cross the backend quantized to what the layer's experts read.
                let in_ty = self.experts.input_type(il)?;
                ternfleet_shared::compute::quantize_as(&mut expert_in, in_ty, fh, fnl, d)?;
                let batch = ExpertBatch {
                    layer: il,
                    input: &expert_in,
                    routes: &routes,
                    numerics,
                };
                let n_routed = cfg.moe.as_ref().map_or(0, |m| m.n_expert);
                if let (true, Ok(mut r)) = (n_routed > 0, self.routed.lock()) {
                    if r.len() <= il {
                        r.resize(il + 1, Vec::new());
                    }
                    let row = &mut r[il];
                    if row.len() < n_routed {
                        row.resize(n_routed, 0);
                    }
                    for rt in routes.iter().filter(|rt| (rt.expert as usize) < n_routed) {
                        row[rt.expert as usize] += 1;
                    }
                }
                let sent = Instant::now();
                let call = self.experts.submit(&batch)?;
                *flight = Some(Flight {
                    layer: il,
                    routes,
                    rows: keep,
                    call,
                    sent,
                });
            }
        }
        Ok(x)
    }

    /// The step's micro-batches as row ranges (whole segments each; see
    /// [`StepOptions::micro_batches`]).
    fn lanes(
        &self,
        segs: &[Segment],
        opts: &StepOptions,
        obs: &dyn Observer,
    ) -> Vec<(usize, usize)> {
        let n: usize = segs.iter().map(|s| s.n).sum();
        let split = opts.micro_batches >= 2
            && opts.numerics == Numerics::Invariant
            && segs.len() >= 2
            && self.experts.overlaps()
            && obs.is_noop();
        if !split {
            return vec![(0, n)];
        }
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::info!(
                "micro-batches: steps of several sequences run as 2, one's attention while the other's experts are on the nodes"
            )
        });
        // The first lane takes whole segments up to about half the rows.
        let mut cut = segs[0].row0 + segs[0].n;
        for s in &segs[1..segs.len() - 1] {
            if 2 * cut >= n {
                break;
            }
            cut = s.row0 + s.n;
        }
        vec![(0, cut), (cut, n)]
    }

    /// Final norm and LM head for the rows that want logits, split per input.
    fn head(
        &self,
        x: &[f32],
        inputs: &[SeqInput<'_>],
        segs: &[Segment],
        numerics: Numerics,
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        let (cfg, d) = (&self.cfg, self.cfg.n_embd);
        let mut wanted = Vec::new();
        for (inp, s) in inputs.iter().zip(segs) {
            wanted.extend(s.row0 + inp.logits.first(s.n)..s.row0 + s.n);
        }
        let mut out: Vec<Vec<f32>> = inputs.iter().map(|_| Vec::new()).collect();
        if wanted.is_empty() {
            return Ok(out);
        }
        let m = wanted.len();
        let mut xo = Vec::with_capacity(m * d);
        for &r in &wanted {
            xo.extend_from_slice(&x[r * d..(r + 1) * d]);
        }
        ops::rms_norm_rows(&mut xo, &self.weights.output_norm, cfg.rms_eps);
        let mut logits = vec![0f32; m * cfg.n_vocab];
        let mut act = Activations::new();
        linear(
            &mut act,
            &self.weights.output,
            &xo,
            m,
            None,
            &mut logits,
            numerics,
        )?;
        dump("result_norm", &xo, d);
        dump("result_output", &logits, cfg.n_vocab);
        if let Some(cap) = cfg.final_logit_softcap {
            logits.iter_mut().for_each(|l| *l = (*l / cap).tanh() * cap);
        }
        let mut at = 0;
        for ((inp, s), o) in inputs.iter().zip(segs).zip(out.iter_mut()) {
            let k = s.n - inp.logits.first(s.n);
            o.extend_from_slice(&logits[at * cfg.n_vocab..(at + k) * cfg.n_vocab]);
            at += k;
        }
        Ok(out)
    }
}

/// Rows `rows` of the row-major `x` (`d` values a row), in that order.
fn gather_rows(x: &[f32], rows: &[usize], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * d);
    for &t in rows {
        out.extend_from_slice(&x[t * d..(t + 1) * d]);
    }
    out
}

/// `out = W x (+ b)` for `n` rows of `x`, quantizing `x` for W's kernel.
fn linear(
    act: &mut Activations,
    w: &Linear,
    x: &[f32],
    n: usize,
    b: Option<&[f32]>,
    out: &mut [f32],
    numerics: Numerics,
) -> Result<(), ForwardError> {
    ternfleet_shared::compute::quantize_par(act, w.ty(), x, n, w.cols())?;
    w.forward(act, out, numerics)?;
    if let Some(b) = b {
        ops::add_bias_rows(out, b);
    }
    Ok(())
}
