//! ternfleet coordinator: the model graph, the KV pool, sampling, the batched engine and the
//! `ternfleet` CLI.
//!
//! Principal types and who drives them:
//! - [`model::Model`] — a loaded GGUF model or bundle: config, [`tokenizer::Tokenizer`], dense
//!   weights and a `ternfleet_shared::expert::ExpertBackend` running every layer's FFN.
//!   [`model::Model::step`] runs one step over rows of many sequences against a
//!   [`kv_pool::KvPool`]; `forward` is the one-sequence form over a [`kv_cache::KvCache`].
//! - [`kv_pool::KvPool`] — every sequence's keys and values in fixed blocks: budget, prefix
//!   sharing, transactional steps.
//! - [`engine::Engine`] — continuous batching of many prompts through `step` (the CLI's
//!   `generate --prompts --parallel`, `bench --parallel`).
//! - [`generate::generate`], [`perplexity::perplexity`], [`bench::bench`] — the workloads the
//!   CLI subcommands ([`cli`]) call.
//! - [`serve`] — `ternfleet serve`: the scheduler, the compute thread driving `step`, and the
//!   OpenAI-compatible HTTP API.
//! - [`remote::RemoteExperts`] — the expert backend of a cluster: each layer's routes sent to
//!   the nodes of a placement (one call per node), failover to replicas.
//! - [`admin`] — the admin gRPC API of a seated coordinator (mutual TLS), what `ternfleet
//!   ctl` talks to.
//! - [`seat::Seat`] — `serve --join`: the coordinator as a Raft learner of the control plane,
//!   routing with the newest committed placement.
//! - [`sampler::Sampler`] — greedy / temperature / top-k / top-p / min-p / repetition penalty.
pub mod admin;
pub mod attention;
pub mod bench;
pub mod cli;
pub mod compare;
pub mod convert;
pub mod ctl;
pub mod engine;
pub mod generate;
pub mod kv_cache;
pub mod kv_pool;
pub mod model;
pub mod ops;
pub mod otlp_sink;
pub mod perplexity;
pub mod remote;
pub mod routing;
pub mod sampler;
pub mod seat;
pub mod serve;
pub mod telemetry;
pub mod tokenizer;
