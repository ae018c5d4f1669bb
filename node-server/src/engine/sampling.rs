//! Token sampling: greedy at temperature 0, else temperature + top-p from a seeded RNG.

use crate::backend::cpu::ops;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(temperature: f32, top_p: f32, seed: u64) -> Sampler {
        Sampler {
            temperature,
            top_p,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature <= 0.0 {
            return ops::argmax(logits) as u32;
        }
        let mut probs: Vec<f32> = logits.iter().map(|l| l / self.temperature).collect();
        ops::softmax(&mut probs);
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let mut kept = Vec::new();
        let mut mass = 0.0;
        for i in order {
            kept.push(i);
            mass += probs[i];
            if mass >= self.top_p {
                break;
            }
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
}
