//! Token sampling: greedy, or a chain of repetition penalty → top-k → top-p → min-p →
//! temperature → seeded draw (the order llama.cpp's common sampler uses).

/// Sampling parameters, validated by [`SamplerParams::validate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub repeat_last_n: usize,
    /// Subtracted once from every token seen in the window (OpenAI's presence penalty); 0
    /// disables.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the window (OpenAI's frequency penalty); 0 disables.
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

/// A sampling parameter out of range.
#[derive(Debug, thiserror::Error)]
#[error("sampling parameter {name} = {value} is invalid: {rule}")]
pub struct ParamError {
    pub name: &'static str,
    pub value: String,
    pub rule: &'static str,
}

impl SamplerParams {
    /// Rejects NaN, infinities and out-of-range values.
    pub fn validate(&self) -> Result<(), ParamError> {
        let bad = |name, value: f32, rule| {
            Err(ParamError {
                name,
                value: value.to_string(),
                rule,
            })
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", self.temperature, "must be finite and >= 0");
        }
        if !self.top_p.is_finite() || !(0.0..=1.0).contains(&self.top_p) || self.top_p == 0.0 {
            return bad("top_p", self.top_p, "must be in (0, 1]");
        }
        if !self.min_p.is_finite() || !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "must be in [0, 1]");
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return bad(
                "repeat_penalty",
                self.repeat_penalty,
                "must be finite and > 0",
            );
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return bad(name, v, "must be finite");
            }
        }
        Ok(())
    }
}

/// splitmix64: a small, well-mixed, seedable generator (reproducible across platforms).
/// Also seeds MoEfication's clustering.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Stateful sampler (holds the RNG).
pub struct Sampler {
    p: SamplerParams,
    rng: Rng,
}

/// Index of the largest logit; the first one on ties (llama.cpp's greedy sampler).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler with validated parameters.
    pub fn new(p: SamplerParams) -> Result<Sampler, ParamError> {
        p.validate()?;
        let rng = Rng(p.seed);
        Ok(Sampler { p, rng })
    }

    /// Picks the next token from `logits` given the tokens so far (`history`).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.p;
        let mut logits = std::borrow::Cow::Borrowed(logits);
        if p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            // llama.cpp's penalties sampler: per distinct token of the window, the repetition
            // penalty, then `count * frequency + presence`.
            let l = logits.to_mut();
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
            for &t in &history[start..] {
                *counts.entry(t).or_default() += 1;
            }
            for (&t, &c) in &counts {
                let Some(v) = l.get_mut(t as usize) else {
                    continue;
                };
                if *v <= 0.0 {
                    *v *= p.repeat_penalty;
                } else {
                    *v /= p.repeat_penalty;
                }
                *v -= c as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
        if p.temperature == 0.0 {
            return argmax(&logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k.max(1));
        }
        let softmax = |c: &[(u32, f32)]| -> Vec<f64> {
            let max = c[0].1 as f64;
            let e: Vec<f64> = c.iter().map(|x| (x.1 as f64 - max).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|v| v / s).collect()
        };
        if p.top_p < 1.0 {
            let probs = softmax(&cand);
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let max = cand[0].1;
            let thresh = max + (p.min_p).ln();
            let keep = cand.iter().take_while(|c| c.1 >= thresh).count().max(1);
            cand.truncate(keep);
        }
        for c in cand.iter_mut() {
            c.1 /= p.temperature;
        }
        let probs = softmax(&cand);
        let r = self.rng.next_f64();
        let mut acc = 0.0;
        for (c, pr) in cand.iter().zip(&probs) {
            acc += pr;
            if r < acc {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplerParams {
            temperature: 0.0,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.sample(&[0.0, 1.0, 5.0], &[]), 2);
    }

    #[test]
    fn same_seed_same_draws_and_top_k_one_is_greedy() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplerParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..20).map(|_| s.sample(&logits, &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..20).map(|_| s.sample(&logits, &[])).collect()
        };
        assert_eq!(a, b);
        let mut s = Sampler::new(SamplerParams { top_k: 1, ..p }).unwrap();
        assert_eq!(s.sample(&logits, &[]), argmax(&logits));
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(SamplerParams {
            temperature: 0.0,
            repeat_penalty: 2.0,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.sample(&[3.0, 2.0], &[0]), 1);
    }

    #[test]
    fn frequency_and_presence_penalties_subtract_per_count() {
        let mut s = Sampler::new(SamplerParams {
            temperature: 0.0,
            frequency_penalty: 1.0,
            presence_penalty: 0.5,
            ..Default::default()
        })
        .unwrap();
        // Token 0 seen twice: 3.0 - 2*1.0 - 0.5 = 0.5 < 1.0 (token 1, seen once: 1.0 - 1.5).
        assert_eq!(s.sample(&[3.0, 1.0, 0.9], &[0, 0, 1]), 2);
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        for p in [
            SamplerParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplerParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplerParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplerParams {
                repeat_penalty: f32::INFINITY,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(p).is_err());
        }
    }
}
