//! Causal (optionally sliding-window) attention of a step's query rows, each sequence over its
//! own keys and values, read block by block from the [`KvPool`].
//!
//! Two algorithms, both rounding as one of llama.cpp's CPU flash-attention paths
//! (`ggml_compute_forward_flash_attn_ext_f16`, ggml-cpu/ops.cpp) with the f16 cache:
//! - **one query at a time** (llama.cpp below 64 queries in a batch): Q rounded to f16, K·Q by
//!   `ggml_vec_dot_f16`, online softmax in key order with an f16 V accumulator
//!   (`ggml_vec_scale_f16` / `ggml_vec_mad_f16`), divided by the sum at the end;
//! - **tiled** (llama.cpp from 64 queries, `ggml_compute_forward_flash_attn_ext_tiled`): Q in
//!   f32, keys in tiles of 64 from position 0 (one pool block per tile), scores as one FMA chain
//!   over the head dimension, the running max and sum updated once per tile (`softmax_exp`,
//!   summed in f64), P·V one FMA per key in order; divided by the sum last.
//!
//! Each row's result depends only on its position and its sequence's keys and values in
//! either algorithm; only the choice between them depends on the batch. Parity mode chooses as
//! llama.cpp does, per sequence, from how many queries that sequence brings; invariant mode
//! always tiles (a fixed KV split), so a row's bits never depend on what shares its step.

use half::f16;
use rayon::prelude::*;
use ternfleet_kernels::Numerics;

use crate::kv_pool::{KvPool, SeqId, BLOCK};
use crate::model::ModelConfig;

/// ggml's flash attention handles fewer than this many queries one at a time
/// (ggml-cpu/common.h `GGML_FA_TILE_Q`).
pub const FA_TILE_Q: usize = 64;
/// Keys per tile (ggml-cpu/common.h `GGML_FA_TILE_KV`): one pool block.
const W: usize = BLOCK;

/// One sequence's query rows in a step: rows `row0..row0 + n` of the step, positions
/// `p0..p0 + n` of `seq`.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    pub seq: SeqId,
    pub row0: usize,
    pub n: usize,
    pub p0: usize,
}

/// Attention of every segment's queries in layer `il`. `q` is `rows × q_dim` (RoPE applied,
/// scaled), `out` is `rows × n_head·head_dim_v`. The step's own keys and values must already
/// be in the pool.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    cfg: &ModelConfig,
    pool: &KvPool,
    il: usize,
    segs: &[Segment],
    q: &[f32],
    window: Option<usize>,
    numerics: Numerics,
    out: &mut [f32],
) {
    let one_at_a_time = |s: &Segment| numerics == Numerics::Parity && s.n < FA_TILE_Q;
    let (single, tiled): (Vec<Segment>, Vec<Segment>) = segs.iter().partition(|s| one_at_a_time(s));
    if !single.is_empty() {
        attend_single(cfg, pool, il, &single, q, window, out);
    }
    if !tiled.is_empty() {
        attend_tiled(cfg, pool, il, &tiled, q, window, out);
    }
}

/// The key (or value) row of position `j` of a sequence whose blocks are `blocks`, head `g`.
fn kv_row<'a>(
    data: impl Fn(u32) -> &'a [f16],
    blocks: &[u32],
    j: usize,
    dim: usize,
    g: usize,
    h: usize,
) -> &'a [f16] {
    let b = data(blocks[j / BLOCK]);
    let at = (j % BLOCK) * dim + g * h;
    &b[at..at + h]
}

fn attend_single(
    cfg: &ModelConfig,
    pool: &KvPool,
    il: usize,
    segs: &[Segment],
    q: &[f32],
    window: Option<usize>,
    out: &mut [f32],
) {
    let (hk, hv) = (cfg.head_dim_k, cfg.head_dim_v);
    let (k_dim, v_dim) = pool.dims();
    let group = cfg.n_head / cfg.n_head_kv;
    let width = cfg.n_head * hv;
    // (segment, row within it, head) for every query head of every row.
    let tasks: Vec<(usize, usize, usize)> = segs
        .iter()
        .enumerate()
        .flat_map(|(si, s)| (0..s.n).flat_map(move |t| (0..cfg.n_head).map(move |h| (si, t, h))))
        .collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(si, t, head)| {
            let s = &segs[si];
            let blocks = pool
                .blocks(s.seq)
                .expect("a step's sequences are in the pool");
            let g = head / group;
            let pos = s.p0 + t;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let row = s.row0 + t;
            let qrow = &q[row * cfg.q_dim() + head * hk..row * cfg.q_dim() + (head + 1) * hk];
            let q16: Vec<f16> = qrow.iter().map(|&v| f16::from_f32(v)).collect();
            let mut acc = vec![f16::ZERO; hv];
            let (mut sum, mut max) = (0f32, f32::NEG_INFINITY);
            for j in lo..=pos {
                let key = kv_row(|b| pool.key_block(il, b), blocks, j, k_dim, g, hk);
                let s = ternfleet_kernels::dot_f16(key, &q16) * cfg.kq_scale;
                let (mut ms, mut vs) = (1f32, 1f32);
                if s > max {
                    let old = max;
                    max = s;
                    ms = (old - max).exp();
                    ternfleet_kernels::scale_f16(&mut acc, ms);
                } else {
                    vs = (s - max).exp();
                }
                let value = kv_row(|b| pool.value_block(il, b), blocks, j, v_dim, g, hv);
                ternfleet_kernels::mad_f16(&mut acc, value, vs);
                // `S = S*ms + vs`, contracted to one FMA by the C compiler (-ffp-contract=fast).
                sum = sum.mul_add(ms, vs);
            }
            let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
            acc.iter().map(|a| a.to_f32() * inv).collect()
        })
        .collect();
    for (&(si, t, head), r) in tasks.iter().zip(&results) {
        let row = segs[si].row0 + t;
        out[row * width + head * hv..row * width + (head + 1) * hv].copy_from_slice(r);
    }
}

/// Queries per tiled task (at most): with the query heads of one KV head they share each
/// tile's conversion from the f16 pool.
const QUERIES_PER_TASK: usize = 16;
/// Rows per kernel call: the kernels share each K and V tile load among them (every row keeps
/// its own max, sum and FMA chains).
const R: usize = 4;

fn attend_tiled(
    cfg: &ModelConfig,
    pool: &KvPool,
    il: usize,
    segs: &[Segment],
    q: &[f32],
    window: Option<usize>,
    out: &mut [f32],
) {
    let (hk, hv) = (cfg.head_dim_k, cfg.head_dim_v);
    let (k_dim, v_dim) = pool.dims();
    let group = cfg.n_head / cfg.n_head_kv;
    let width = cfg.n_head * hv;
    // (segment, KV head, first row, rows); rows are (query, head of the group), query-major:
    // row r is query r / group with head g·group + r % group. Each row's arithmetic is its own
    // (the kernels only share loads among rows), so any split gives the same bits: chunks of
    // QUERIES_PER_TASK queries, smaller when that leaves threads idle (a decode step of one
    // sequence with one KV head would otherwise run on one thread).
    let total_rows: usize = segs.iter().map(|s| s.n * group).sum::<usize>() * cfg.n_head_kv;
    let threads = rayon::current_num_threads().max(1);
    let chunk = (QUERIES_PER_TASK * group)
        .min(total_rows.div_ceil(threads))
        .max(1);
    let mut tasks = Vec::new();
    for (si, s) in segs.iter().enumerate() {
        for g in 0..cfg.n_head_kv {
            let rows = s.n * group;
            for r0 in (0..rows).step_by(chunk) {
                tasks.push((si, g, r0, (rows - r0).min(chunk)));
            }
        }
    }
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(si, g, row0, nr)| {
            let s = &segs[si];
            let blocks = pool
                .blocks(s.seq)
                .expect("a step's sequences are in the pool");
            let pos = |r: usize| s.p0 + (row0 + r) / group;
            let lo = |r: usize| window.map_or(0, |w| (pos(r) + 1).saturating_sub(w));
            let mut qb = Vec::with_capacity(nr * hk);
            for r in row0..row0 + nr {
                let (row, head) = (s.row0 + r / group, g * group + r % group);
                qb.extend_from_slice(
                    &q[row * cfg.q_dim() + head * hk..row * cfg.q_dim() + (head + 1) * hk],
                );
            }
            let hi = pos(nr - 1);
            let mut vkq = vec![0f32; nr * hv];
            let mut sum = vec![0f32; nr];
            let mut max = vec![f32::NEG_INFINITY; nr];
            let mut kq = vec![0f32; R * W];
            let mut kt = vec![0f32; hk * W];
            let mut vt = vec![0f32; W * hv];
            for (tile, &block) in blocks.iter().enumerate().take(hi / W + 1).skip(lo(0) / W) {
                let k0 = tile * W;
                let kb = pool.key_block(il, block);
                let vb = pool.value_block(il, block);
                // The tile's keys widened and transposed (hk rows of W keys) and its values
                // widened, up to the last position any row sees (the pool holds stale data
                // past it). Keys past it keep whatever finite values an earlier tile left:
                // every row masks those scores to -inf. Values past it are zero, so their
                // zero weights add nothing.
                let valid = (hi + 1 - k0).min(W);
                ternfleet_kernels::widen_transpose_f16(&kb[g * hk..], k_dim, valid, hk, &mut kt, W);
                for c in 0..valid {
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(
                        &vb[c * v_dim + g * hv..c * v_dim + (g + 1) * hv],
                        &mut vt[c * hv..(c + 1) * hv],
                    );
                }
                vt[valid * hv..].fill(0.0);
                for r0 in (0..nr).step_by(R) {
                    let rows = (nr - r0).min(R);
                    let kq = &mut kq[..rows * W];
                    ternfleet_kernels::fa_scores(&qb[r0 * hk..(r0 + rows) * hk], &kt, W, kq);
                    for i in 0..rows {
                        let r = r0 + i;
                        let row = &mut kq[i * W..(i + 1) * W];
                        for (j, s) in row.iter_mut().enumerate() {
                            *s = if k0 + j < lo(r) || k0 + j > pos(r) {
                                f32::NEG_INFINITY
                            } else {
                                *s * cfg.kq_scale
                            };
                        }
                        let tile_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        if tile_max == f32::NEG_INFINITY {
                            // No key of this tile is visible to the row: it adds nothing.
                            row.fill(0.0);
                            continue;
                        }
                        let new_max = max[r].max(tile_max);
                        if new_max > max[r] {
                            let ms = (max[r] - new_max).exp();
                            vkq[r * hv..(r + 1) * hv].iter_mut().for_each(|v| *v *= ms);
                            sum[r] *= ms;
                        }
                        max[r] = new_max;
                        sum[r] =
                            (sum[r] as f64 + ternfleet_kernels::softmax_exp(row, new_max)) as f32;
                    }
                    ternfleet_kernels::fa_pv(&mut vkq[r0 * hv..(r0 + rows) * hv], kq, &vt, hv);
                }
            }
            for r in 0..nr {
                let inv = if sum[r] == 0.0 { 0.0 } else { 1.0 / sum[r] };
                vkq[r * hv..(r + 1) * hv].iter_mut().for_each(|v| *v *= inv);
            }
            vkq
        })
        .collect();
    for (&(si, g, row0, _), res) in tasks.iter().zip(&results) {
        let s = &segs[si];
        for (r, rowv) in res.chunks_exact(hv).enumerate() {
            let (t, head) = ((row0 + r) / group, g * group + (row0 + r) % group);
            let row = s.row0 + t;
            out[row * width + head * hv..row * width + (head + 1) * hv].copy_from_slice(rowv);
        }
    }
}
