//! One sequence with a KV pool of its own: what the single-sequence tools (generate,
//! perplexity, bench, compare, calibration) run on. The engine itself runs many sequences on a
//! shared [`KvPool`] through `Model::step`.

use ternfleet_kernels::Numerics;

use crate::kv_pool::{KvError, KvPool, SeqId};
use crate::model::ModelConfig;

/// Per-sequence options of a request (not model state: two requests may differ).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqOptions {
    /// MoE models: experts per token (`None`: the model's own).
    pub top_experts: Option<usize>,
    /// Float order of its steps.
    pub numerics: Numerics,
}

/// A single sequence and its options.
pub struct KvCache {
    pool: KvPool,
    seq: SeqId,
    capacity: usize,
    pub opts: SeqOptions,
}

impl KvCache {
    /// A cache for `capacity` positions of `cfg`'s model (memory taken as positions fill).
    pub fn new(cfg: &ModelConfig, capacity: usize, opts: SeqOptions) -> KvCache {
        let mut pool = KvPool::for_positions(cfg.n_layer, cfg.k_dim(), cfg.v_dim(), capacity);
        let seq = pool.add_sequence(capacity);
        KvCache {
            pool,
            seq,
            capacity,
            opts,
        }
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.pool.len(self.seq).unwrap_or(0)
    }
    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Maximum positions.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forgets every position (memory is kept for reuse).
    pub fn clear(&mut self) {
        // The sequence is ours, so removing it cannot fail.
        let _ = self.pool.remove(self.seq);
        self.seq = self.pool.add_sequence(self.capacity);
    }
    /// Checks that `n` more positions fit.
    pub fn reserve(&self, n: usize) -> Result<(), KvError> {
        let used = self.len();
        if used + n > self.capacity {
            return Err(KvError::Context {
                seq: self.seq.0,
                used,
                adding: n,
                limit: self.capacity,
            });
        }
        Ok(())
    }

    pub(crate) fn seq(&self) -> SeqId {
        self.seq
    }
    pub(crate) fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }
}
