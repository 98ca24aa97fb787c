//! The f32 element-wise operations of the dense graph, written to round the way ggml's CPU
//! backend does (ggml-cpu/ops.cpp), because greedy parity with llama.cpp depends on it.

use crate::model::config::RopeType;

/// RMS-normalises `x` in place and multiplies by `w` (ggml `rms_norm` then `mul`): the sum of
/// squares is accumulated in f64 (`ggml_float`), the scale computed in f32.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, w) in x.iter_mut().zip(w) {
        *v = (*v * scale) * w;
    }
}

/// Applies [`rms_norm`] to each `w.len()`-wide row of `x`.
pub fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        rms_norm(row, w, eps);
    }
}

/// Adds `b` to every `b.len()`-wide row of `x`.
pub fn add_bias_rows(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
    }
}

/// cos/sin of each rotated pair at position `pos`, computed like ggml's `ggml_rope_cache_init`
/// (theta multiplied up iteratively by `base^(-2/n_rot)`, starting from the position).
pub fn rope_cache(pos: usize, n_rot: usize, base: f32, freq_scale: f32, out: &mut Vec<(f32, f32)>) {
    out.clear();
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    let mut theta = pos as f32;
    for _ in 0..n_rot / 2 {
        let t = freq_scale * theta;
        out.push((t.cos(), t.sin()));
        theta *= theta_scale;
    }
}

/// Rotates one head `x` (width >= 2 * cache.len()) in place, rounding like ggml's
/// `rotate_pairs` as GCC compiles it (`-ffp-contract=fast` fuses `x0*cos - x1*sin` into
/// `fma(x0, cos, -(x1*sin))` and `x0*sin + x1*cos` into `fma(x0, sin, x1*cos)`).
pub fn rope_apply(x: &mut [f32], cache: &[(f32, f32)], ty: RopeType) {
    let half = cache.len();
    match ty {
        RopeType::Norm => {
            for (i, &(c, s)) in cache.iter().enumerate() {
                let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = x0.mul_add(c, -(x1 * s));
                x[2 * i + 1] = x0.mul_add(s, x1 * c);
            }
        }
        RopeType::Neox => {
            for (i, &(c, s)) in cache.iter().enumerate() {
                let (x0, x1) = (x[i], x[i + half]);
                x[i] = x0.mul_add(c, -(x1 * s));
                x[i + half] = x0.mul_add(s, x1 * c);
            }
        }
    }
}

/// ln softmax(logits)[tok], in f64 like llama-perplexity's `log_softmax`.
pub fn log_softmax_at(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    (logits[tok] - max) as f64 - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let mut x = vec![1.0f32, -2.0, 3.0, 4.0];
        rms_norm(&mut x, &[1.0; 4], 0.0);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
        let ratio = x[3] / x[0];
        assert!((ratio - 4.0).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_by_position_times_frequency() {
        let mut c = Vec::new();
        rope_cache(3, 4, 100.0, 1.0, &mut c);
        // pair 0: theta = 3; pair 1: theta = 3 * 100^(-1/2) = 0.3
        assert!((c[0].0 - 3f32.cos()).abs() < 1e-6);
        assert!((c[1].1 - 0.3f32.sin()).abs() < 1e-6);
        let mut x = [1.0f32, 0.0, 0.0, 0.0];
        rope_apply(&mut x, &c, RopeType::Neox);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[2] - 3f32.sin()).abs() < 1e-6);
        let mut y = [1.0f32, 0.0, 0.0, 0.0];
        rope_apply(&mut y, &c, RopeType::Norm);
        assert!((y[1] - 3f32.sin()).abs() < 1e-6);
        // Rotation keeps the norm.
        let n: f32 = x.iter().map(|v| v * v).sum();
        assert!((n - 1.0).abs() < 1e-6);
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let l = [0.5f32, 2.0, -1.0];
        let p: f64 = (0..3).map(|i| log_softmax_at(&l, i).exp()).sum();
        assert!((p - 1.0).abs() < 1e-12);
    }
}
