//! A token program that forces the shape of an output: fixed token runs, a choice among
//! alternatives (tool names), and free runs that end at a given token. It is how
//! `tool_choice` required / named yields a well-formed GLM tool call from any model: the
//! sampler only ever sees the tokens the program allows.
//!
//! This is not a general grammar engine (JSON schema output needs one, e.g. llguidance);
//! argument values are free text, which the tool-call parser keeps as strings unless they
//! are JSON.

/// One step of a program.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    /// Exactly these tokens.
    Fixed(Vec<u32>),
    /// One alternative, chosen by sampling among the alternatives' next tokens; each
    /// alternative carries the parts that follow when it is chosen.
    OneOf(Vec<(Vec<u32>, Vec<Part>)>),
    /// At least one sampled token, none of `banned`, until `end` is sampled; after `max`
    /// tokens `end` is forced.
    Free {
        end: u32,
        banned: Vec<u32>,
        max: usize,
    },
}

/// What the next token may be.
#[derive(Clone, Debug, PartialEq)]
pub enum Allowed {
    Only(Vec<u32>),
    AllBut(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct Program {
    parts: std::collections::VecDeque<Part>,
    /// Tokens taken inside the current part.
    taken: Vec<u32>,
}

impl Program {
    pub fn new(parts: Vec<Part>) -> Program {
        Program {
            parts: parts.into(),
            taken: Vec::new(),
        }
    }

    /// True once every part is complete (the sequence should end).
    pub fn done(&self) -> bool {
        self.parts.is_empty()
    }

    /// The tokens allowed next; `None` when the program is done.
    pub fn allowed(&self) -> Option<Allowed> {
        let n = self.taken.len();
        Some(match self.parts.front()? {
            Part::Fixed(tokens) => Allowed::Only(vec![tokens[n]]),
            Part::OneOf(alts) => {
                let mut next: Vec<u32> = alts
                    .iter()
                    .filter(|(a, _)| a.len() > n && a[..n] == self.taken[..])
                    .map(|(a, _)| a[n])
                    .collect();
                next.sort_unstable();
                next.dedup();
                Allowed::Only(next)
            }
            Part::Free { end, banned, max } => {
                if n >= *max {
                    Allowed::Only(vec![*end])
                } else if n == 0 {
                    let mut b = banned.clone();
                    b.push(*end);
                    Allowed::AllBut(b)
                } else {
                    Allowed::AllBut(banned.clone())
                }
            }
        })
    }

    /// Records the sampled token (one the program allowed).
    pub fn advance(&mut self, token: u32) {
        self.taken.push(token);
        let n = self.taken.len();
        let complete = match self.parts.front() {
            None => return,
            Some(Part::Fixed(tokens)) => n >= tokens.len(),
            Some(Part::Free { end, .. }) => token == *end,
            Some(Part::OneOf(alts)) => {
                let exact = alts.iter().position(|(a, _)| a[..] == self.taken[..]);
                let longer = alts
                    .iter()
                    .any(|(a, _)| a.len() > n && a[..n] == self.taken[..]);
                match exact {
                    Some(i) if !longer => {
                        let then = alts[i].1.clone();
                        self.parts.pop_front();
                        for p in then.into_iter().rev() {
                            self.parts.push_front(p);
                        }
                        self.taken.clear();
                        self.skip_empty();
                        return;
                    }
                    _ => false,
                }
            }
        };
        if complete {
            self.parts.pop_front();
            self.taken.clear();
            self.skip_empty();
        }
    }

    fn skip_empty(&mut self) {
        while matches!(self.parts.front(), Some(Part::Fixed(t)) if t.is_empty()) {
            self.parts.pop_front();
        }
    }

    /// Sets every logit the program does not allow to -inf.
    pub fn mask(&self, logits: &mut [f32]) {
        match self.allowed() {
            None => {}
            Some(Allowed::Only(ok)) => {
                let keep: Vec<(u32, f32)> = ok
                    .iter()
                    .filter_map(|&t| logits.get(t as usize).map(|&v| (t, v)))
                    .collect();
                logits.fill(f32::NEG_INFINITY);
                for (t, v) in keep {
                    // A forced token keeps a finite logit even if the model gave it -inf.
                    logits[t as usize] = if v.is_finite() { v } else { 0.0 };
                }
            }
            Some(Allowed::AllBut(banned)) => {
                for t in banned {
                    if let Some(v) = logits.get_mut(t as usize) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the program, taking the smallest allowed token (or `free` in free runs).
    fn run(mut p: Program, free: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut free = free.iter();
        while let Some(a) = p.allowed() {
            let t = match a {
                Allowed::Only(ok) => ok[0],
                Allowed::AllBut(banned) => {
                    let t = *free.next().unwrap();
                    assert!(!banned.contains(&t) || t == 99, "{t} banned");
                    t
                }
            };
            out.push(t);
            p.advance(t);
        }
        out
    }

    #[test]
    fn fixed_choice_and_free_parts() {
        let p = Program::new(vec![
            Part::Fixed(vec![1, 2]),
            Part::OneOf(vec![
                (vec![10, 11], vec![Part::Fixed(vec![20])]),
                (vec![12], vec![Part::Fixed(vec![21])]),
            ]),
            Part::Free {
                end: 99,
                banned: vec![5],
                max: 3,
            },
            Part::Fixed(vec![7]),
        ]);
        // Free run: 40, 41 then the end token.
        assert_eq!(
            run(p.clone(), &[40, 41, 99]),
            [1, 2, 10, 11, 20, 40, 41, 99, 7]
        );
        // The free run is cut at max tokens by forcing the end.
        assert_eq!(run(p, &[40, 41, 42]), [1, 2, 10, 11, 20, 40, 41, 42, 99, 7]);
    }

    #[test]
    fn mask_forbids_and_forces() {
        let mut p = Program::new(vec![
            Part::Free {
                end: 3,
                banned: vec![0],
                max: 4,
            },
            Part::Fixed(vec![1]),
        ]);
        let mut l = vec![5.0, 1.0, 2.0, 9.0];
        p.mask(&mut l);
        // First free token: neither banned nor the end (no empty values).
        assert_eq!(l, [f32::NEG_INFINITY, 1.0, 2.0, f32::NEG_INFINITY]);
        p.advance(2);
        p.advance(3);
        let mut l = vec![5.0, f32::NEG_INFINITY, 2.0, 9.0];
        p.mask(&mut l);
        assert_eq!(
            l,
            [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, f32::NEG_INFINITY]
        );
        p.advance(1);
        assert!(p.done() && p.allowed().is_none());
    }
}
