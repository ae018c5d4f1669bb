//! Token sampling: penalties (presence, frequency, repetition), then greedy at temperature 0,
//! else temperature, top-k, top-p and min-p, drawn from a seeded RNG so the same seed gives
//! the same tokens. Log-probabilities are those of the penalised logits before temperature.

use crate::backend::cpu::ops;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// Every per-request sampling knob (OpenAI's names and ranges; `top_k` 0 and `min_p` 0 are off).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub seed: u64,
    /// Return the chosen token's log-probability and this many alternatives (`Some(0)`:
    /// the chosen one only).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            logprobs: None,
        }
    }
}

/// One sampled token and, when asked, its log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// How often each token was generated so far (presence and frequency penalties).
    counts: HashMap<u32, u32>,
    /// Prompt and generated tokens (repetition penalty).
    seen: std::collections::HashSet<u32>,
}

impl Sampler {
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Sampler {
        Sampler::with_params(SamplingParams {
            temperature,
            top_p,
            seed,
            ..SamplingParams::default()
        })
    }

    pub fn with_params(params: SamplingParams) -> Sampler {
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
            counts: HashMap::new(),
            seen: Default::default(),
        }
    }

    /// Marks prompt tokens for the repetition penalty.
    pub fn observe_prompt(&mut self, tokens: &[u32]) {
        self.seen.extend(tokens.iter().copied());
    }

    /// Samples a token and records it as generated.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_full(logits).token
    }

    pub fn sample_full(&mut self, logits: &[f32]) -> Sampled {
        let p = &self.params;
        let mut adjusted = logits.to_vec();
        for v in adjusted.iter_mut() {
            if v.is_nan() {
                *v = f32::NEG_INFINITY;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(v) = adjusted.get_mut(t as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(v) = adjusted.get_mut(t as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        let want = p.logprobs;
        let token = self.choose(&adjusted);
        let (logprob, top) = match want {
            None => (None, Vec::new()),
            Some(k) => {
                let lp = log_softmax(&adjusted);
                let top = ops::top_k(&lp, k.min(lp.len()))
                    .into_iter()
                    .map(|i| (i as u32, lp[i]))
                    .collect();
                (Some(lp[token as usize]), top)
            }
        };
        *self.counts.entry(token).or_insert(0) += 1;
        self.seen.insert(token);
        Sampled {
            token,
            logprob,
            top,
        }
    }

    fn choose(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return ops::argmax(logits) as u32;
        }
        let mut probs: Vec<f32> = logits.iter().map(|l| l / p.temperature).collect();
        ops::softmax(&mut probs);
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let max_p = order.first().map_or(0.0, |&i| probs[i]);
        let mut kept = Vec::new();
        let mut mass = 0.0;
        for i in order {
            if !kept.is_empty() && probs[i] < p.min_p * max_p {
                break;
            }
            kept.push(i);
            mass += probs[i];
            if mass >= p.top_p {
                break;
            }
        }
        if !(mass > 0.0 && mass.is_finite()) {
            return ops::argmax(logits) as u32;
        }
        let mut r = self.rng.random_range(0.0..mass);
        for &i in &kept {
            r -= probs[i];
            if r <= 0.0 {
                return i as u32;
            }
        }
        *kept.last().expect("at least one token") as u32
    }
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return vec![-(x.len() as f32).ln(); x.len()];
    }
    let sum: f32 = x.iter().map(|v| (v - max).exp()).sum();
    let lse = max + sum.ln();
    x.iter().map(|v| v - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_at_zero_temperature_and_seeded_otherwise() {
        let logits = [0.1, 2.0, 0.5, 1.9];
        assert_eq!(Sampler::new(0.0, 1.0, 1).sample(&logits), 1);
        let (mut a, mut b) = (Sampler::new(1.0, 0.9, 3), Sampler::new(1.0, 0.9, 3));
        let xs: Vec<u32> = (0..50).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..50).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
        // top_p 0.9 keeps tokens 1, 3 and 2 only; token 0 never appears.
        assert!(!xs.contains(&0));
        assert!(xs.contains(&1) && xs.contains(&3));
    }

    fn draws(params: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::with_params(params);
        (0..n).map(|_| s.sample(logits)).collect()
    }

    #[test]
    fn top_k_and_min_p_cut_the_tail() {
        let logits = [0.1, 2.0, 0.5, 1.9];
        let xs = draws(
            SamplingParams {
                top_k: 2,
                seed: 7,
                ..Default::default()
            },
            &logits,
            200,
        );
        assert!(xs.iter().all(|&t| t == 1 || t == 3), "{xs:?}");
        assert!(xs.contains(&1) && xs.contains(&3));
        // p(2)/p(1) = e^-1.5 ~ 0.22: min_p 0.5 drops tokens 2 and 0.
        let ys = draws(
            SamplingParams {
                min_p: 0.5,
                seed: 7,
                ..Default::default()
            },
            &logits,
            200,
        );
        assert!(ys.iter().all(|&t| t == 1 || t == 3), "{ys:?}");
    }

    #[test]
    fn penalties_move_greedy_away_from_repeats() {
        let logits = [0.0, 2.0, 1.9, 0.0];
        // Greedy repeats token 1 without penalties.
        let plain = draws(
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            &logits,
            3,
        );
        assert_eq!(plain, [1, 1, 1]);
        let presence = draws(
            SamplingParams {
                temperature: 0.0,
                presence_penalty: 0.5,
                ..Default::default()
            },
            &logits,
            3,
        );
        assert_eq!(presence, [1, 2, 1]);
        let mut rep = Sampler::with_params(SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..Default::default()
        });
        rep.observe_prompt(&[1]);
        assert_eq!(rep.sample(&logits), 2);
    }

    #[test]
    fn logprobs_are_normalised_and_ranked() {
        let mut s = Sampler::with_params(SamplingParams {
            temperature: 0.0,
            logprobs: Some(2),
            ..Default::default()
        });
        let out = s.sample_full(&[0.0, 1.0, 3.0, f32::NAN]);
        assert_eq!(out.token, 2);
        let lp = out.logprob.unwrap();
        assert_eq!(out.top.len(), 2);
        assert_eq!(out.top[0], (2, lp));
        assert_eq!(out.top[1].0, 1);
        let total: f32 = [0.0f32, 1.0, 3.0]
            .iter()
            .map(|v| (v - 3.0 - (1.0 + (-2.0f32).exp() + (-3.0f32).exp()).ln()).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert!((lp - (-(1.0 + (-2.0f32).exp() + (-3.0f32).exp()).ln())).abs() < 1e-5);
    }
}
