//! The key/value cache of one sequence: per layer, f16 keys and values by position (llama.cpp's
//! default cache type is f16, and we store the same rounding).

use half::f16;

/// Errors of the cache.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error(
        "context full: {used} positions used + {adding} new > capacity {capacity} (raise --ctx)"
    )]
    Full {
        used: usize,
        adding: usize,
        capacity: usize,
    },
}

/// Keys and values of one sequence. Memory grows with use, up to `capacity` positions.
pub struct KvCache {
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    k_dim: usize,
    v_dim: usize,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// A cache for `n_layer` layers of `k_dim`/`v_dim` wide rows, up to `capacity` positions.
    pub fn new(n_layer: usize, k_dim: usize, v_dim: usize, capacity: usize) -> KvCache {
        KvCache {
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
            k_dim,
            v_dim,
            len: 0,
            capacity,
        }
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Maximum positions.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forgets every position (memory is kept for reuse).
    pub fn clear(&mut self) {
        self.len = 0;
        for l in self.k.iter_mut().chain(self.v.iter_mut()) {
            l.clear();
        }
    }

    /// Checks that `n` more positions fit.
    pub fn reserve(&self, n: usize) -> Result<(), KvError> {
        if self.len + n > self.capacity {
            return Err(KvError::Full {
                used: self.len,
                adding: n,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Appends `n` rows of keys and values for `layer` at positions `len..len+n`. Call for every
    /// layer, then [`KvCache::commit`].
    pub fn push(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        self.k[layer].extend(k.iter().map(|&x| f16::from_f32(x)));
        self.v[layer].extend(v.iter().map(|&x| f16::from_f32(x)));
    }

    /// Marks `n` appended positions as filled.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
        debug_assert!(self.k.iter().all(|l| l.len() == self.len * self.k_dim));
    }

    /// Keys of `layer` at every position pushed so far (`positions × k_dim`).
    pub fn keys(&self, layer: usize) -> &[f16] {
        &self.k[layer]
    }
    /// Values of `layer` (`positions × v_dim`).
    pub fn values(&self, layer: usize) -> &[f16] {
        &self.v[layer]
    }
    /// Row widths.
    pub fn dims(&self) -> (usize, usize) {
        (self.k_dim, self.v_dim)
    }
}
