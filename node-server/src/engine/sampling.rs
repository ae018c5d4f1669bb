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
        self.sample_owned(logits.to_vec())
    }

    /// [`Sampler::sample_full`] on logits the caller gives up (adjusted in place: a step's
    /// 155k-value row is not copied again).
    pub fn sample_owned(&mut self, mut adjusted: Vec<f32>) -> Sampled {
        let p = &self.params;
        // A NaN counts as -inf, written only where there is one: the check alone vectorises
        // (rewriting a decode step's 154,880 logits took ~60 us of the host's time a token).
        if adjusted.iter().fold(false, |any, v| any | v.is_nan()) {
            for v in adjusted.iter_mut() {
                if v.is_nan() {
                    *v = f32::NEG_INFINITY;
                }
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

    /// Greedy, or a draw from the tokens kept by top-k, min-p and top-p, walked in order of
    /// probability (ties by index). Only the part of that order a draw reaches is sorted.
    fn choose(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return ops::argmax(logits) as u32;
        }
        let mut probs: Vec<f32> = logits.iter().map(|l| l / p.temperature).collect();
        ops::softmax(&mut probs);
        if probs.iter().any(|v| !v.is_finite()) {
            return ops::argmax(logits) as u32;
        }
        let mut order = Ranked::new(&probs, p.top_k);
        let max_p = order.get(0).map_or(0.0, |i| probs[i]);
        let cut = p.min_p * max_p;
        // The kept tokens are the first `kept` of the order: stop below the min-p cut (never
        // at the first) or once their mass reaches top-p.
        let (mut kept, mut mass, mut stopped) = (0usize, 0.0f32, false);
        while let Some(t) = order.head(kept) {
            if kept > 0 && probs[t] < cut {
                stopped = true;
                break;
            }
            kept += 1;
            mass += probs[t];
            if mass >= p.top_p {
                stopped = true;
                break;
            }
        }
        if !stopped {
            if kept > 0 && mass >= 0.5 {
                // Every tail value is below half an ulp of `mass`: adding one changes nothing,
                // so the walk keeps each down to the cut and never reaches top-p.
                kept += order.tail_at_least(&probs, cut);
            } else {
                while let Some(t) = order.get(kept) {
                    if kept > 0 && probs[t] < cut {
                        break;
                    }
                    kept += 1;
                    mass += probs[t];
                    if mass >= p.top_p {
                        break;
                    }
                }
            }
        }
        if !(mass > 0.0 && mass.is_finite()) {
            return ops::argmax(logits) as u32;
        }
        let mut r = self.rng.random_range(0.0..mass);
        for i in 0..kept {
            let t = order.get(i).expect("a kept token has a rank");
            r -= probs[t];
            if r <= 0.0 {
                return t as u32;
            }
        }
        order.get(kept - 1).expect("at least one token") as u32
    }
}

/// `draw` of each job, the jobs in parallel when there are several (the engine's sequences
/// of one step: each draw reads and partly sorts a whole vocabulary, ~2-3 ms at 155k
/// tokens, and depends only on its own sampler, so the tokens are those drawn in turn).
pub fn draw_each<T: Send, R: Send>(jobs: Vec<T>, draw: impl Fn(T) -> R + Sync + Send) -> Vec<R> {
    use rayon::prelude::*;
    if jobs.len() < 2 {
        return jobs.into_iter().map(draw).collect();
    }
    jobs.into_par_iter().map(draw).collect()
}

/// Probabilities below this are the tail of a [`Ranked`] order: half an ulp of any mass in
/// [0.5, 1), so a tail value never changes such a sum.
const TAIL: f32 = 1.0 / 33_554_432.0;

/// Token indices in order of probability (descending, ties by index): the head (every
/// probability of at least [`TAIL`], or the top k) sorted at once, the tail only when a walk
/// reaches it (a draw lands there with the tail's tiny share of the mass).
struct Ranked {
    head: Vec<usize>,
    /// [`ops::rank_key`]s of the tail, sorted on first use.
    tail: Vec<u64>,
    tail_sorted: bool,
}

impl Ranked {
    fn new(probs: &[f32], top_k: usize) -> Ranked {
        if top_k > 0 {
            return Ranked {
                head: ops::top_k(probs, top_k),
                tail: Vec::new(),
                tail_sorted: true,
            };
        }
        let (mut head, tail): (Vec<u64>, Vec<u64>) = probs
            .iter()
            .enumerate()
            .map(|(i, &v)| ops::rank_key(v, i))
            .partition(|&k| probs[ops::key_index(k)] >= TAIL);
        ops::sort_rank_keys(&mut head);
        Ranked {
            head: head.into_iter().map(ops::key_index).collect(),
            tail,
            tail_sorted: false,
        }
    }

    /// Rank `i` if it is in the head.
    fn head(&self, i: usize) -> Option<usize> {
        self.head.get(i).copied()
    }

    /// Rank `i`.
    fn get(&mut self, i: usize) -> Option<usize> {
        if i < self.head.len() {
            return Some(self.head[i]);
        }
        if !self.tail_sorted {
            ops::sort_rank_keys(&mut self.tail);
            self.tail_sorted = true;
        }
        self.tail
            .get(i - self.head.len())
            .map(|&k| ops::key_index(k))
    }

    /// Tail tokens whose probability is at least `cut` (they lead the sorted tail).
    fn tail_at_least(&self, probs: &[f32], cut: f32) -> usize {
        self.tail
            .iter()
            .filter(|&&k| probs[ops::key_index(k)] >= cut)
            .count()
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

    /// The draw as it was written first: every token sorted by probability (ties by index),
    /// the kept prefix, one uniform draw over its mass. `Sampler::choose` must pick the same
    /// token from the same generator state.
    fn reference_choose(p: &SamplingParams, rng: &mut ChaCha8Rng, logits: &[f32]) -> u32 {
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
        let mut r = rng.random_range(0.0..mass);
        for &i in &kept {
            r -= probs[i];
            if r <= 0.0 {
                return i as u32;
            }
        }
        *kept.last().expect("at least one token") as u32
    }

    /// The head and the lazily sorted tail read as one order: the full sort's.
    #[test]
    fn ranked_order_is_the_full_sort() {
        let mut probs: Vec<f32> = (0..2000)
            .map(|i| ((i * 37 % 101) as f32 - 100.0).exp())
            .collect();
        probs[5] = 0.0;
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|v| *v /= sum);
        let mut full: Vec<usize> = (0..probs.len()).collect();
        full.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let mut ranked = Ranked::new(&probs, 0);
        assert!(!ranked.head.is_empty() && !ranked.tail.is_empty());
        let got: Vec<usize> = (0..probs.len()).map(|i| ranked.get(i).unwrap()).collect();
        assert_eq!(got, full);
        assert_eq!(ranked.get(probs.len()), None);
        assert_eq!(Ranked::new(&probs, 3).head, full[..3]);
    }

    /// Same tokens as the full sort over peaked, flat and tied logits (vocabularies with a
    /// long tail below 2^-25 and without), every truncation, many seeds.
    #[test]
    fn draws_match_the_full_sort() {
        let mut g = ChaCha8Rng::seed_from_u64(11);
        for case in 0..120 {
            let vocab = [7usize, 300, 5000, 40_000][case % 4];
            let spread = [0.5f32, 4.0, 12.0, 40.0][(case / 4) % 4];
            let logits: Vec<f32> = (0..vocab)
                .map(|i| match case % 3 {
                    0 => g.random_range(-spread..spread),
                    1 => (g.random_range(0..6) as f32) * spread / 6.0,
                    _ => spread * (1.0 - (i as f32 / vocab as f32)).powi(8),
                })
                .collect();
            let params = SamplingParams {
                temperature: [1.0, 0.7, 1.5][case % 3],
                top_p: [1.0, 0.9, 0.5, 0.999][(case / 3) % 4],
                top_k: [0, 0, 40, vocab + 1][(case / 7) % 4],
                min_p: [0.0, 0.0, 0.05][(case / 5) % 3],
                seed: case as u64,
                ..Default::default()
            };
            let mut sampler = Sampler::with_params(params.clone());
            let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
            for draw in 0..30 {
                let want = reference_choose(&params, &mut rng, &logits);
                assert_eq!(sampler.choose(&logits), want, "case {case} draw {draw}");
            }
        }
    }

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
