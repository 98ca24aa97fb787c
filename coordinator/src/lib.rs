//! ternfleet coordinator: the dense model, its KV cache, sampling and the `ternfleet` CLI.
//!
//! Principal types and who drives them:
//! - [`model::Model`] — a loaded GGUF model: config, [`tokenizer::Tokenizer`], dense weights and
//!   an [`ternfleet_node::expert::ExpertBackend`] running every layer's FFN. `forward` runs a
//!   batch of tokens of one sequence against a [`kv_cache::KvCache`].
//! - [`generate::generate`], [`perplexity::perplexity`], [`bench::bench`] — the workloads the
//!   CLI subcommands ([`cli`]) call.
//! - [`sampler::Sampler`] — greedy / temperature / top-k / top-p / min-p / repetition penalty.
pub mod bench;
pub mod cli;
pub mod compare;
pub mod convert;
pub mod generate;
pub mod kv_cache;
pub mod model;
pub mod ops;
pub mod perplexity;
pub mod sampler;
pub mod tokenizer;
