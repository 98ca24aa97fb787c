//! The KV pool: every sequence's keys and values, in fixed-size blocks preallocated up to a
//! memory budget, with a block table per sequence, prefix sharing and transactional steps.
//!
//! Why blocks (vLLM's PagedAttention) rather than a slot of `n_ctx` positions per sequence:
//! a server does not know how long each sequence will grow, and slots reserve the worst case;
//! blocks are taken as a sequence grows and returned when it ends, so the budget holds as many
//! sequences as their actual lengths allow, and a block of a shared prompt prefix can belong to
//! several sequences at once. A block holds [`BLOCK`] = 64 positions, the key tile of
//! llama.cpp's tiled flash attention (`GGML_FA_TILE_KV`), so attention reads a block as one
//! tile, straight from the pool.
//!
//! Layout: per layer one array of keys and one of values, `n_blocks × BLOCK × dim` f16 (the
//! cache type llama.cpp uses by default); a position's row is contiguous, as attention's
//! one-query path reads it.
//!
//! Transactions: a step first [`KvPool::begin`]s (takes the blocks its rows need), writes its
//! rows' keys and values at positions past each sequence's committed length, and then either
//! [`KvPool::commit`]s (the lengths grow) or [`KvPool::rollback`]s (the new blocks go back,
//! lengths stay). Positions past the committed length are never read by a later step, and only
//! full blocks are ever shared, so a failed step leaves every sequence exactly as it was and a
//! retry writes the same bits into the same places.
//!
//! Prefix sharing: each full block of a sequence is registered under a hash of every token up
//! to its end (a chain: parent key + its own 64 tokens, compared in full on a hit). A new
//! sequence's prompt takes the longest run of registered blocks that match it, reference-
//! counted. Blocks whose last owner ended stay registered and are reused by later prompts
//! until the pool needs their memory (the least recently freed go first). Sharing reproduces
//! the same bits only when a row's keys do not depend on how the prompt was chunked — the
//! batch-invariant numerics; in parity mode the engine does not share.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use half::f16;

/// Positions per block.
pub const BLOCK: usize = 64;

/// Blocks a pool may hold (2^24 blocks = 2^30 positions; the bookkeeping stays small).
pub const MAX_BLOCKS: usize = 1 << 24;

/// A sequence's handle in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Errors of the pool.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("KV pool full: {need} more blocks of {BLOCK} positions needed, {free} free of {total} (raise --kv-budget or run fewer sequences)")]
    Full {
        need: usize,
        free: usize,
        total: usize,
    },
    #[error("sequence {seq}: context full: {used} positions + {adding} new > its limit {limit} (raise --ctx)")]
    Context {
        seq: u64,
        used: usize,
        adding: usize,
        limit: usize,
    },
    #[error("sequence {0} is not in the KV pool")]
    NoSeq(u64),
    #[error("sequence {seq} appears twice in one step")]
    Twice { seq: u64 },
    #[error("KV budget of {budget} bytes: {block_bytes} bytes per block of {BLOCK} positions, and a pool holds 1 to {MAX_BLOCKS} blocks")]
    Budget { budget: u64, block_bytes: u64 },
}

/// Where a block came from when registered for prefix sharing.
#[derive(Clone, Debug, PartialEq, Eq)]
struct BlockKey {
    /// Hash of everything up to and including this block.
    hash: u64,
    parent: u64,
    tokens: Vec<u32>,
}

#[derive(Clone, Debug, Default)]
struct Seq {
    blocks: Vec<u32>,
    /// Committed positions.
    len: usize,
    /// Committed tokens (the prefix keys of its blocks are computed from them).
    tokens: Vec<u32>,
    limit: usize,
    /// Hash of the chain up to the end of the last registered full block.
    chain: u64,
    /// Full blocks already registered (or found registered).
    registered: usize,
}

/// What a step took from the pool, to keep or give back.
#[derive(Debug)]
#[must_use = "a step's blocks must be committed or rolled back"]
pub struct StepTx {
    /// (sequence, rows added, blocks it held before the step).
    rows: Vec<(SeqId, usize, usize)>,
}

/// Statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KvStats {
    pub blocks_total: usize,
    pub blocks_used: usize,
    /// Free blocks still holding a registered prefix.
    pub blocks_cached: usize,
    pub sequences: usize,
    /// Prompt positions taken from shared blocks instead of computed.
    pub prefix_hit_positions: u64,
}

/// The pool.
pub struct KvPool {
    k_dim: usize,
    v_dim: usize,
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    refs: Vec<u32>,
    /// Free blocks, the next to take first; registered ones go to the back when freed.
    free: VecDeque<u32>,
    key: Vec<Option<BlockKey>>,
    by_hash: HashMap<u64, u32>,
    seqs: HashMap<SeqId, Seq>,
    next_id: u64,
    sharing: bool,
    prefix_hits: u64,
}

fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    // SipHash with fixed keys: the same prefix gives the same key in every run.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl KvPool {
    /// Bytes of one block across all layers.
    pub fn block_bytes(n_layer: usize, k_dim: usize, v_dim: usize) -> u64 {
        (n_layer * BLOCK * (k_dim + v_dim) * 2) as u64
    }

    /// A pool of as many blocks as `budget` bytes hold. Memory is allocated as blocks are
    /// first taken (free blocks are handed out lowest first), so a generous budget costs
    /// nothing until sequences grow into it. `sharing` turns prefix sharing on.
    pub fn new(
        n_layer: usize,
        k_dim: usize,
        v_dim: usize,
        budget: u64,
        sharing: bool,
    ) -> Result<KvPool, KvError> {
        let block_bytes = Self::block_bytes(n_layer, k_dim, v_dim).max(1);
        let n_blocks = usize::try_from(budget / block_bytes).unwrap_or(usize::MAX);
        if n_blocks == 0 || n_blocks > MAX_BLOCKS {
            return Err(KvError::Budget {
                budget,
                block_bytes,
            });
        }
        Ok(KvPool {
            k_dim,
            v_dim,
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
            refs: vec![0; n_blocks],
            free: (0..n_blocks as u32).collect(),
            key: vec![None; n_blocks],
            by_hash: HashMap::new(),
            seqs: HashMap::new(),
            next_id: 0,
            sharing,
            prefix_hits: 0,
        })
    }

    /// A pool for `positions` positions of one sequence (CLI tools), at most [`MAX_BLOCKS`]
    /// blocks (a sequence that outgrows it gets [`KvError::Full`]).
    pub fn for_positions(n_layer: usize, k_dim: usize, v_dim: usize, positions: usize) -> KvPool {
        let blocks = positions.div_ceil(BLOCK).clamp(1, MAX_BLOCKS) as u64;
        let block_bytes = Self::block_bytes(n_layer, k_dim, v_dim).max(1);
        Self::new(n_layer, k_dim, v_dim, blocks * block_bytes, false)
            .expect("1..=MAX_BLOCKS whole blocks are a valid budget")
    }

    /// Row widths.
    pub fn dims(&self) -> (usize, usize) {
        (self.k_dim, self.v_dim)
    }

    /// Whether prefix sharing is on.
    pub fn sharing(&self) -> bool {
        self.sharing
    }

    /// A new empty sequence that may grow to `limit` positions.
    pub fn add_sequence(&mut self, limit: usize) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(
            id,
            Seq {
                limit,
                ..Seq::default()
            },
        );
        id
    }

    fn seq(&self, id: SeqId) -> Result<&Seq, KvError> {
        self.seqs.get(&id).ok_or(KvError::NoSeq(id.0))
    }

    /// Committed positions of `id`.
    pub fn len(&self, id: SeqId) -> Result<usize, KvError> {
        Ok(self.seq(id)?.len)
    }

    /// The committed tokens of `id`.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32], KvError> {
        Ok(&self.seq(id)?.tokens)
    }

    /// The blocks of `id`, in position order.
    pub fn blocks(&self, id: SeqId) -> Result<&[u32], KvError> {
        Ok(&self.seq(id)?.blocks)
    }

    /// Keys of `layer` in block `b`: `BLOCK × k_dim`.
    pub fn key_block(&self, layer: usize, b: u32) -> &[f16] {
        let n = BLOCK * self.k_dim;
        &self.k[layer][b as usize * n..(b as usize + 1) * n]
    }
    /// Values of `layer` in block `b`: `BLOCK × v_dim`.
    pub fn value_block(&self, layer: usize, b: u32) -> &[f16] {
        let n = BLOCK * self.v_dim;
        &self.v[layer][b as usize * n..(b as usize + 1) * n]
    }

    /// Statistics.
    pub fn stats(&self) -> KvStats {
        let cached = self
            .free
            .iter()
            .filter(|&&b| self.key[b as usize].is_some())
            .count();
        KvStats {
            blocks_total: self.refs.len(),
            blocks_used: self.refs.len() - self.free.len(),
            blocks_cached: cached,
            sequences: self.seqs.len(),
            prefix_hit_positions: self.prefix_hits,
        }
    }

    fn take_block(&mut self) -> Option<u32> {
        let b = self.free.pop_front()?;
        let (kn, vn) = (
            (b as usize + 1) * BLOCK * self.k_dim,
            (b as usize + 1) * BLOCK * self.v_dim,
        );
        for (k, v) in self.k.iter_mut().zip(self.v.iter_mut()) {
            if k.len() < kn {
                k.resize(kn, f16::ZERO);
                v.resize(vn, f16::ZERO);
            }
        }
        if let Some(k) = self.key[b as usize].take() {
            self.by_hash.remove(&k.hash);
        }
        self.refs[b as usize] = 1;
        Some(b)
    }

    fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "releasing a free block");
        *r -= 1;
        if *r == 0 {
            if self.key[b as usize].is_some() {
                self.free.push_back(b);
            } else {
                self.free.push_front(b);
            }
        }
    }

    /// Ends `id`: its blocks go back (registered ones stay findable until reused).
    pub fn remove(&mut self, id: SeqId) -> Result<(), KvError> {
        let s = self.seqs.remove(&id).ok_or(KvError::NoSeq(id.0))?;
        for b in s.blocks {
            self.release(b);
        }
        Ok(())
    }

    /// Attaches the registered blocks that hold a prefix of `prompt` to the empty sequence
    /// `id`; returns how many positions it now holds (a multiple of [`BLOCK`], always less
    /// than `prompt.len()`, so the last prompt token is computed and yields logits).
    pub fn reuse_prefix(&mut self, id: SeqId, prompt: &[u32]) -> Result<usize, KvError> {
        let s = self.seq(id)?;
        if !self.sharing || s.len != 0 || !s.blocks.is_empty() {
            return Ok(0);
        }
        let max_blocks = prompt.len().saturating_sub(1) / BLOCK;
        let mut parent = 0u64;
        let mut found = Vec::new();
        for chunk in prompt.chunks_exact(BLOCK).take(max_blocks) {
            let h = chain_hash(parent, chunk);
            let Some(&b) = self.by_hash.get(&h) else {
                break;
            };
            match &self.key[b as usize] {
                Some(k) if k.parent == parent && k.tokens == chunk => {}
                _ => break,
            }
            found.push(b);
            parent = h;
        }
        for &b in &found {
            if self.refs[b as usize] == 0 {
                self.free.retain(|&f| f != b);
            }
            self.refs[b as usize] += 1;
        }
        let n = found.len() * BLOCK;
        self.prefix_hits += n as u64;
        let s = self.seqs.get_mut(&id).ok_or(KvError::NoSeq(id.0))?;
        s.registered = found.len();
        s.blocks = found;
        s.len = n;
        s.tokens = prompt[..n].to_vec();
        s.chain = parent;
        Ok(n)
    }

    /// Takes the blocks that `rows` (sequence, new positions) need. On error nothing changed.
    pub fn begin(&mut self, rows: &[(SeqId, usize)]) -> Result<StepTx, KvError> {
        let mut need = 0;
        let mut seen = std::collections::HashSet::new();
        for &(id, n) in rows {
            if !seen.insert(id) {
                return Err(KvError::Twice { seq: id.0 });
            }
            let s = self.seq(id)?;
            if s.len + n > s.limit {
                return Err(KvError::Context {
                    seq: id.0,
                    used: s.len,
                    adding: n,
                    limit: s.limit,
                });
            }
            need += (s.len + n).div_ceil(BLOCK).saturating_sub(s.blocks.len());
        }
        if need > self.free.len() {
            return Err(KvError::Full {
                need,
                free: self.free.len(),
                total: self.refs.len(),
            });
        }
        let mut tx = StepTx {
            rows: Vec::with_capacity(rows.len()),
        };
        for &(id, n) in rows {
            let s = &self.seqs[&id];
            let (had, want) = (s.blocks.len(), (s.len + n).div_ceil(BLOCK));
            let mut new = Vec::with_capacity(want.saturating_sub(had));
            for _ in had..want {
                new.push(self.take_block().expect("counted free blocks above"));
            }
            self.seqs
                .get_mut(&id)
                .expect("checked above")
                .blocks
                .extend(new);
            tx.rows.push((id, n, had));
        }
        Ok(tx)
    }

    /// Writes the key and value rows of position `pos` of `id` in `layer` (a position the
    /// current step added).
    pub fn write(&mut self, layer: usize, id: SeqId, pos: usize, k: &[f32], v: &[f32]) {
        let b = self.seqs[&id].blocks[pos / BLOCK] as usize;
        let row = b * BLOCK + pos % BLOCK;
        debug_assert!(
            self.refs[b] == 1 && self.key[b].is_none(),
            "writing into a shared or registered block"
        );
        let kd = &mut self.k[layer][row * self.k_dim..(row + 1) * self.k_dim];
        kd.iter_mut()
            .zip(k)
            .for_each(|(d, &x)| *d = f16::from_f32(x));
        let vd = &mut self.v[layer][row * self.v_dim..(row + 1) * self.v_dim];
        vd.iter_mut()
            .zip(v)
            .for_each(|(d, &x)| *d = f16::from_f32(x));
    }

    /// Makes the step's rows part of their sequences (`tokens[i]` are the tokens of
    /// `tx`'s i-th sequence) and registers blocks that became full.
    pub fn commit(&mut self, tx: StepTx, tokens: &[&[u32]]) {
        for (&(id, n, _), toks) in tx.rows.iter().zip(tokens) {
            let sharing = self.sharing;
            let s = self.seqs.get_mut(&id).expect("a step's sequences live");
            s.len += n;
            s.tokens.extend_from_slice(&toks[..n]);
            if !sharing {
                continue;
            }
            let full = s.len / BLOCK;
            let mut to_register = Vec::new();
            while s.registered < full {
                let i = s.registered;
                let chunk = &s.tokens[i * BLOCK..(i + 1) * BLOCK];
                let h = chain_hash(s.chain, chunk);
                to_register.push((s.blocks[i], s.chain, h, chunk.to_vec()));
                s.chain = h;
                s.registered += 1;
            }
            for (b, parent, hash, tokens) in to_register {
                if self.by_hash.contains_key(&hash) || self.key[b as usize].is_some() {
                    continue;
                }
                self.by_hash.insert(hash, b);
                self.key[b as usize] = Some(BlockKey {
                    hash,
                    parent,
                    tokens,
                });
            }
        }
    }

    /// Undoes [`KvPool::begin`]: the blocks it took go back; lengths never moved.
    pub fn rollback(&mut self, tx: StepTx) {
        for (id, _, had) in tx.rows {
            let Some(s) = self.seqs.get_mut(&id) else {
                continue;
            };
            let taken: Vec<u32> = s.blocks.drain(had..).collect();
            for b in taken.into_iter().rev() {
                self.release(b);
            }
        }
    }

    /// Keeps the first `len` positions of `id` (no-op when it holds fewer). A shared block
    /// that would be written again is copied first; a registered one is unregistered.
    pub fn truncate(&mut self, id: SeqId, len: usize) -> Result<(), KvError> {
        let s = self.seq(id)?;
        if len >= s.len {
            return Ok(());
        }
        let keep = len.div_ceil(BLOCK);
        let dropped: Vec<u32> = s.blocks[keep..].to_vec();
        let partial = (!len.is_multiple_of(BLOCK)).then(|| s.blocks[keep - 1]);
        for b in dropped {
            self.release(b);
        }
        let s = self.seqs.get_mut(&id).expect("checked above");
        s.blocks.truncate(keep);
        s.len = len;
        s.tokens.truncate(len);
        s.registered = s.registered.min(len / BLOCK);
        s.chain = 0;
        for chunk in s.tokens.chunks_exact(BLOCK).take(s.registered) {
            s.chain = chain_hash(s.chain, chunk);
        }
        if let Some(b) = partial {
            let bi = b as usize;
            if self.refs[bi] > 1 {
                let fresh = self.take_block().ok_or(KvError::Full {
                    need: 1,
                    free: 0,
                    total: self.refs.len(),
                })?;
                for layer in 0..self.k.len() {
                    let (kn, vn) = (BLOCK * self.k_dim, BLOCK * self.v_dim);
                    self.k[layer].copy_within(bi * kn..(bi + 1) * kn, fresh as usize * kn);
                    self.v[layer].copy_within(bi * vn..(bi + 1) * vn, fresh as usize * vn);
                }
                self.release(b);
                *self
                    .seqs
                    .get_mut(&id)
                    .expect("checked above")
                    .blocks
                    .last_mut()
                    .expect("keep >= 1 when len % BLOCK != 0") = fresh;
            } else if let Some(k) = self.key[bi].take() {
                self.by_hash.remove(&k.hash);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(blocks: usize, sharing: bool) -> KvPool {
        KvPool::new(
            2,
            4,
            4,
            blocks as u64 * KvPool::block_bytes(2, 4, 4),
            sharing,
        )
        .unwrap()
    }

    fn step(p: &mut KvPool, id: SeqId, toks: &[u32]) -> Result<(), KvError> {
        let p0 = p.len(id)?;
        let tx = p.begin(&[(id, toks.len())])?;
        for (i, &t) in toks.iter().enumerate() {
            for l in 0..2 {
                p.write(l, id, p0 + i, &[t as f32; 4], &[-(t as f32); 4]);
            }
        }
        p.commit(tx, &[toks]);
        Ok(())
    }

    #[test]
    fn rollback_leaves_lengths_and_free_blocks_as_they_were() {
        let mut p = pool(4, false);
        let a = p.add_sequence(1000);
        step(&mut p, a, &[1; 70]).unwrap();
        let before = (p.stats(), p.len(a).unwrap(), p.blocks(a).unwrap().to_vec());
        // 70 + 100 positions: three blocks, one more than a held.
        let tx = p.begin(&[(a, 100)]).unwrap();
        assert_eq!(p.stats().blocks_used, 3);
        p.rollback(tx);
        assert_eq!(
            (p.stats(), p.len(a).unwrap(), p.blocks(a).unwrap().to_vec()),
            before
        );
    }

    #[test]
    fn full_pool_and_context_limit_are_errors_that_change_nothing() {
        let mut p = pool(2, false);
        let a = p.add_sequence(100);
        let b = p.add_sequence(1000);
        step(&mut p, b, &[1; 64]).unwrap();
        assert_eq!(
            p.begin(&[(a, 10), (b, 65)]).unwrap_err(),
            // a: 1 block for 10 positions; b: 64 + 65 positions need 2 more than its 1.
            KvError::Full {
                need: 3,
                free: 1,
                total: 2
            }
        );
        assert!(matches!(
            p.begin(&[(a, 101)]).unwrap_err(),
            KvError::Context { limit: 100, .. }
        ));
        assert!(matches!(
            p.begin(&[(a, 1), (a, 1)]).unwrap_err(),
            KvError::Twice { .. }
        ));
        assert_eq!(p.stats().blocks_used, 1);
        assert_eq!(p.len(a).unwrap(), 0);
    }

    #[test]
    fn a_shared_prefix_is_found_refcounted_and_survives_its_first_owner() {
        let mut p = pool(8, true);
        let prompt: Vec<u32> = (0..200).collect();
        let a = p.add_sequence(1000);
        assert_eq!(p.reuse_prefix(a, &prompt).unwrap(), 0);
        step(&mut p, a, &prompt).unwrap();
        let b = p.add_sequence(1000);
        // 200 tokens: blocks 0..3 full, at most (200-1)/64 = 3 reused.
        assert_eq!(p.reuse_prefix(b, &prompt).unwrap(), 192);
        assert_eq!(p.blocks(b).unwrap(), &p.blocks(a).unwrap()[..3]);
        p.remove(a).unwrap();
        // b still holds its three, a's fourth (partial) is free again.
        assert_eq!(p.stats().blocks_used, 3);
        p.remove(b).unwrap();
        assert_eq!(p.stats().blocks_cached, 3);
        // A later prompt with the same first 128 tokens and a different third block.
        let mut other = prompt.clone();
        other[150] = 9999;
        let c = p.add_sequence(1000);
        assert_eq!(p.reuse_prefix(c, &other).unwrap(), 128);
        // Block contents are the first owner's writes.
        assert_eq!(p.key_block(1, p.blocks(c).unwrap()[1])[0].to_f32(), 64.0);
        assert_eq!(p.stats().prefix_hit_positions, 192 + 128);
    }

    #[test]
    fn parity_pools_never_share() {
        let mut p = pool(8, false);
        let prompt: Vec<u32> = (0..200).collect();
        let a = p.add_sequence(1000);
        step(&mut p, a, &prompt).unwrap();
        let b = p.add_sequence(1000);
        assert_eq!(p.reuse_prefix(b, &prompt).unwrap(), 0);
    }

    #[test]
    fn truncate_into_a_shared_block_copies_it_first() {
        let mut p = pool(8, true);
        let prompt: Vec<u32> = (0..130).collect();
        let a = p.add_sequence(1000);
        step(&mut p, a, &prompt).unwrap();
        let b = p.add_sequence(1000);
        assert_eq!(p.reuse_prefix(b, &prompt).unwrap(), 128);
        let shared = p.blocks(b).unwrap()[1];
        p.truncate(b, 100).unwrap();
        let own = p.blocks(b).unwrap()[1];
        assert_ne!(own, shared);
        assert_eq!(
            p.key_block(0, own)[..4 * 36],
            p.key_block(0, shared)[..4 * 36]
        );
        // b now writes position 100 into its copy; a's block keeps its value.
        step(&mut p, b, &[7]).unwrap();
        assert_eq!(p.key_block(0, shared)[36 * 4].to_f32(), 100.0);
        assert_eq!(p.key_block(0, own)[36 * 4].to_f32(), 7.0);
        assert_eq!(p.tokens(b).unwrap().len(), 101);
    }

    #[test]
    fn a_budget_below_one_block_is_refused() {
        assert!(matches!(
            KvPool::new(2, 4, 4, 100, false),
            Err(KvError::Budget { .. })
        ));
    }
}
