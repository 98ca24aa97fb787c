//! Every option of `ternfleet serve`: a TOML file (`--config`, unknown keys refused) whose
//! values the command line overrides. `deploy/serve.toml` is the commented template; a test
//! checks that it parses and equals the defaults.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use ternfleet_kernels::Numerics;

use super::chat::{ChatTemplate, BUILTIN};
use super::openai::Limits;
use crate::cli::{parse_size, DEFAULT_MODEL};
use crate::model::Model;

/// The server's configuration.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Model: a GGUF file or a bundle directory.
    pub model: PathBuf,
    /// Name the API reports for the model (default: the file name).
    pub model_name: Option<String>,
    /// This process's id in the cluster.
    pub id: String,
    /// HTTP API address.
    pub http: String,
    /// gRPC API address; empty = no gRPC.
    pub grpc: String,
    /// Allow binding a non-loopback address without TLS.
    pub listen_any: bool,
    /// PEM certificate chain for HTTPS and gRPC over TLS (with `tls_key`).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Compute threads (default: all cores).
    pub threads: Option<usize>,
    /// `invariant` (a request's tokens do not depend on what shares its steps) or `parity`.
    pub numerics: String,
    /// MoE models: experts per token.
    pub top_experts: Option<usize>,
    /// MoE models: RAM for routed experts (`8GiB`, bytes); the rest is read from disk by the
    /// expert store. Empty = every expert memory-mapped.
    pub ram_budget: String,
    /// With `ram_budget`: `none`, `router` or `learned` hints to the expert store.
    pub prefetch: String,
    /// With `prefetch`: layers ahead hinted.
    pub lookahead: usize,
    /// With `prefetch = "learned"`: the predictor file (default: beside the model).
    pub predictor: Option<PathBuf>,
    /// With `ram_budget`: threads reading experts.
    pub io_threads: usize,
    /// With `ram_budget`: `lfu` or `lru`.
    pub evict: String,
    /// Bundles: run the routed experts on the nodes of this cluster file.
    pub cluster: Option<PathBuf>,
    /// With `cluster`: the cluster CA and this process's certificate (`ternfleet certs`).
    pub certs: Option<PathBuf>,
    /// With `cluster` or `join`: milliseconds a node call may take before a replica is tried
    /// (plus 0.5 ms per route).
    pub step_deadline_ms: u64,
    /// Bundles: take a seat in the control plane through the member at this QUIC
    /// `host:port` and route with its committed placement (instead of `cluster`).
    pub join: Option<String>,
    /// With `join`: the QUIC address the control plane reaches this coordinator at (port 0:
    /// any; give a routable address when the nodes are on other machines).
    pub listen: String,
    /// With `join`: the address the members reach this coordinator at (empty = the bound
    /// address).
    pub advertise: String,
    /// With `join`: the admin gRPC API's address (mutual TLS, the `operator` certificate;
    /// `ternfleet ctl --addr`); empty = none.
    pub admin: String,
    /// With `join`: where the Raft store lives (`STATE_DIR/ID/raft.redb`; default
    /// `$XDG_STATE_HOME/ternfleet` or `~/.local/state/ternfleet`).
    pub state_dir: Option<PathBuf>,
    /// Requests generating at once.
    pub parallel: usize,
    /// Requests waiting beyond those; more get 429 at once.
    pub max_queue: usize,
    /// Positions per request (prompt + generated); 0 = the model's training context.
    pub ctx: usize,
    /// KV pool size (`2GiB`, bytes); empty = enough for `parallel` requests of `ctx`.
    pub kv_budget: String,
    /// Prompt tokens per request per step.
    pub chunk: usize,
    /// Rows per step.
    pub step_tokens: usize,
    /// Largest request body (`1MiB`, bytes).
    pub max_body: String,
    /// Prompt tokens per request; 0 = `ctx - 1`.
    pub max_prompt_tokens: usize,
    pub max_stop: usize,
    pub max_stop_len: usize,
    pub max_logprobs: usize,
    pub max_messages: usize,
    /// `max_tokens` of a request that gives none (default: up to the context).
    pub default_max_tokens: Option<usize>,
    /// A request's deadline, seconds.
    pub timeout_s: f64,
    /// How long running requests may finish after SIGTERM, seconds.
    pub grace_s: f64,
    /// `chatml`, `gemma`, `llama3` or a Jinja file; empty = the model's own (chatml if none).
    pub chat_template: String,
    /// Bearer API keys; empty = no auth.
    pub api_keys: Vec<String>,
    /// A file with one API key per line (added to `api_keys`).
    pub api_key_file: Option<PathBuf>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            model: PathBuf::from(DEFAULT_MODEL),
            model_name: None,
            id: "coordinator".into(),
            http: "127.0.0.1:8080".into(),
            grpc: "127.0.0.1:50051".into(),
            listen_any: false,
            tls_cert: None,
            tls_key: None,
            threads: None,
            numerics: "invariant".into(),
            top_experts: None,
            ram_budget: String::new(),
            prefetch: "none".into(),
            lookahead: crate::model::predict::LOOKAHEAD,
            predictor: None,
            io_threads: 4,
            evict: "lfu".into(),
            cluster: None,
            certs: None,
            step_deadline_ms: 750,
            join: None,
            listen: "127.0.0.1:0".into(),
            advertise: String::new(),
            admin: "127.0.0.1:50052".into(),
            state_dir: None,
            parallel: 16,
            max_queue: 64,
            ctx: 4096,
            kv_budget: String::new(),
            chunk: 256,
            step_tokens: 512,
            max_body: "1MiB".into(),
            max_prompt_tokens: 0,
            max_stop: 4,
            max_stop_len: 256,
            max_logprobs: 20,
            max_messages: 1024,
            default_max_tokens: None,
            timeout_s: 600.0,
            grace_s: 30.0,
            chat_template: String::new(),
            api_keys: Vec::new(),
            api_key_file: None,
        }
    }
}

impl ServeConfig {
    /// Reads a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<ServeConfig> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("{}", path.display()))
    }

    /// Checks values that have no type to say so.
    pub fn validate(&self) -> Result<()> {
        if self.parallel == 0 {
            bail!("parallel must be at least 1");
        }
        if self.chunk == 0 || self.step_tokens == 0 {
            bail!("chunk and step_tokens must be at least 1");
        }
        if self.step_tokens < self.parallel {
            bail!(
                "step_tokens ({}) must be at least parallel ({}): every running request decodes one row per step",
                self.step_tokens,
                self.parallel
            );
        }
        for (name, v) in [("timeout_s", self.timeout_s), ("grace_s", self.grace_s)] {
            if !v.is_finite() || v <= 0.0 || v > 1e7 {
                bail!("{name} = {v}: expected a positive number of seconds");
            }
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            bail!("--tls-cert and --tls-key go together: give both or neither");
        }
        if self.join.is_some() && self.cluster.is_some() {
            bail!("--join and --cluster exclude each other: the placement comes either from the control plane or from a static file");
        }
        if self.join.is_some() && self.certs.is_none() {
            bail!("--join needs --certs DIR (the cluster CA and this coordinator's certificate: ternfleet certs)");
        }
        self.numerics()?;
        self.grpc_addr()?;
        self.max_body_bytes()?;
        self.ram_budget_bytes()?;
        self.evict()?;
        crate::cli::check_prefetch(&self.prefetch, self.lookahead)?;
        if !(1..=256).contains(&self.io_threads) {
            bail!("io_threads must be 1 to 256, got {}", self.io_threads);
        }
        if !self.kv_budget.is_empty() {
            parse_size(&self.kv_budget).map_err(|e| anyhow::anyhow!("kv_budget: {e}"))?;
        }
        Ok(())
    }

    /// The gRPC address, if gRPC is on; non-loopback only with `listen_any`.
    pub fn grpc_addr(&self) -> Result<Option<std::net::SocketAddr>> {
        if self.grpc.is_empty() {
            return Ok(None);
        }
        let a: std::net::SocketAddr = self
            .grpc
            .parse()
            .with_context(|| format!("--grpc {:?}: expected HOST:PORT", self.grpc))?;
        self.check_exposure("--grpc", a)?;
        Ok(Some(a))
    }

    /// Whether the APIs use TLS.
    pub fn tls(&self) -> bool {
        self.tls_cert.is_some()
    }

    /// A non-loopback address needs TLS or `listen_any`.
    pub fn check_exposure(&self, flag: &str, a: std::net::SocketAddr) -> Result<()> {
        if !a.ip().is_loopback() && !self.listen_any && !self.tls() {
            bail!("{flag} {a}: binding a non-loopback address serves the API to the network without TLS; give --tls-cert/--tls-key, or pass --listen-any to do it anyway");
        }
        Ok(())
    }

    /// `ram_budget` in bytes (`None`: every expert mapped).
    pub fn ram_budget_bytes(&self) -> Result<Option<u64>> {
        if self.ram_budget.is_empty() {
            return Ok(None);
        }
        parse_size(&self.ram_budget)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("ram_budget: {e}"))
    }

    pub fn evict(&self) -> Result<ternfleet_node::store::Evict> {
        self.evict
            .parse()
            .map_err(|e: String| anyhow::anyhow!("evict: {e}"))
    }

    pub fn numerics(&self) -> Result<Numerics> {
        self.numerics
            .parse()
            .map_err(|e: String| anyhow::anyhow!("numerics: {e}"))
    }

    pub fn max_body_bytes(&self) -> Result<usize> {
        let b = parse_size(&self.max_body).map_err(|e| anyhow::anyhow!("max_body: {e}"))?;
        usize::try_from(b).context("max_body is too large")
    }

    /// The API's name for the model.
    pub fn model_name(&self) -> String {
        self.model_name.clone().unwrap_or_else(|| {
            self.model
                .file_name()
                .map_or("model".into(), |n| n.to_string_lossy().into_owned())
        })
    }

    /// The configured keys plus those of `api_key_file`.
    pub fn api_keys(&self) -> Result<Vec<String>> {
        let mut keys = self.api_keys.clone();
        if let Some(f) = &self.api_key_file {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("reading the API key file {}", f.display()))?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from),
            );
        }
        if keys.iter().any(|k| k.len() < 8) {
            bail!("API keys must be at least 8 characters");
        }
        Ok(keys)
    }

    /// Positions per request for `model`.
    pub fn ctx_for(&self, model: &Model) -> usize {
        if self.ctx == 0 {
            model.cfg.n_ctx_train
        } else {
            self.ctx
        }
    }

    /// The request limits (before the model is known, `ctx` as configured).
    pub fn limits(&self) -> Limits {
        let ctx = if self.ctx == 0 { 4096 } else { self.ctx };
        Limits {
            ctx,
            max_prompt_tokens: if self.max_prompt_tokens == 0 {
                ctx.saturating_sub(1).max(1)
            } else {
                self.max_prompt_tokens
            },
            max_stop: self.max_stop,
            max_stop_len: self.max_stop_len,
            max_logprobs: self.max_logprobs,
            max_messages: self.max_messages,
        }
    }

    /// KV pool bytes: as configured, or room for `parallel` requests of `ctx` positions.
    pub fn kv_budget_for(&self, model: &Model, ctx: usize) -> Result<u64> {
        if !self.kv_budget.is_empty() {
            return parse_size(&self.kv_budget).map_err(|e| anyhow::anyhow!("kv_budget: {e}"));
        }
        let per_block = crate::kv_pool::KvPool::block_bytes(
            model.cfg.n_layer,
            model.cfg.k_dim(),
            model.cfg.v_dim(),
        );
        // Exactly what the scheduler reserves for `parallel` requests of `ctx` positions.
        let blocks = super::scheduler::blocks_for(ctx) * self.parallel;
        Ok(per_block * blocks as u64)
    }

    /// The chat template: the configured one, else the model's own, else chatml.
    pub fn chat_template(&self, model: &Model) -> Result<ChatTemplate> {
        let tok = &model.tokenizer;
        let text = |id: Option<u32>| {
            id.and_then(|i| tok.token_text(i))
                .unwrap_or_default()
                .to_string()
        };
        let (bos, eos) = (text(tok.bos()), text(tok.eos()));
        let name = self.chat_template.as_str();
        if !name.is_empty() {
            if let Some(t) = ChatTemplate::builtin(name, &bos, &eos) {
                return Ok(t?);
            }
            let path = std::path::Path::new(name);
            if !path.exists() {
                let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
                bail!(
                    "--chat-template {name}: neither a built-in template ({}) nor a file",
                    names.join(", ")
                );
            }
            let src = std::fs::read_to_string(path)
                .with_context(|| format!("reading the chat template {}", path.display()))?;
            return Ok(ChatTemplate::new(name, &src, &bos, &eos)?);
        }
        match model.file().get_str("tokenizer.chat_template") {
            Ok(Some(src)) => Ok(ChatTemplate::new("gguf", src, &bos, &eos)?),
            _ => {
                tracing::warn!(
                    "the model has no chat template: /v1/chat/completions uses chatml (set --chat-template)"
                );
                ChatTemplate::builtin("chatml", &bos, &eos)
                    .expect("chatml is built in")
                    .map_err(Into::into)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_in_deploy_parses_and_equals_the_defaults() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/serve.toml");
        let c = ServeConfig::from_file(std::path::Path::new(path)).unwrap();
        assert_eq!(c, ServeConfig::default());
        c.validate().unwrap();
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_the_field_named() {
        let e = toml::from_str::<ServeConfig>("paralel = 4")
            .unwrap_err()
            .to_string();
        assert!(e.contains("paralel"), "{e}");
        let c: ServeConfig = toml::from_str("numerics = \"fast\"").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("numerics"));
        let c: ServeConfig = toml::from_str("parallel = 32\nstep_tokens = 16").unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("step_tokens"));
    }
}
