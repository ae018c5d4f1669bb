//! A model run the tier tests compare bit for bit: the logits of every prompt position, then
//! of `steps` cached greedy decode steps.

use glmflash_node::model::Model;
use glmflash_node::model::Step;

pub fn prompt_then_greedy(model: &Model, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let mut out = model
        .forward(
            &mut [Step {
                tokens: prompt,
                cache: &mut cache,
                all_logits: true,
            }],
            None,
        )
        .unwrap();
    for _ in 0..steps {
        let last = out.last().unwrap();
        let next =
            glmflash_node::backend::cpu::ops::argmax(&last[last.len() - model.cfg.vocab_size..])
                as u32;
        out.extend(
            model
                .forward(
                    &mut [Step {
                        tokens: &[next],
                        cache: &mut cache,
                        all_logits: false,
                    }],
                    None,
                )
                .unwrap(),
        );
    }
    out
}
