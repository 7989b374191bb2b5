//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, seeded
//! sampling, and log-probabilities.
//!
//! Order (as vLLM/HF): repetition penalty (prompt and output tokens), presence/frequency penalties
//! (output tokens), then greedy argmax when temperature is 0, else temperature, top-k, top-p,
//! min-p and a draw from a per-request ChaCha8 stream, so the same seed gives the same tokens.
//! Log-probabilities are of the model's raw distribution (log-softmax of unmodified logits).
//!
//! Before all of that, `logit_bias` is added, and a request with a grammar (structured outputs)
//! masks every token its grammar does not allow next: the mask is the last word, so a bias or
//! a penalty can reorder the allowed tokens but never bring back a masked one.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use tandem_kernels::ops;

use tandem_grammar::Constraint;
use tandem_types::ValidSampling;

/// A sampled token with its log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sampled {
    /// The chosen token id.
    pub token: u32,
    /// Its log-probability under the model's raw distribution (before penalties and temperature).
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Per-sequence sampling state.
pub struct Sampler {
    params: ValidSampling,
    rng: ChaCha8Rng,
    /// Output token counts, for presence/frequency penalties.
    counts: HashMap<u32, u32>,
    /// Prompt and output tokens seen, for the repetition penalty.
    seen: std::collections::HashSet<u32>,
    /// The request's grammar, where the output stands in it.
    constraint: Option<Constraint>,
    /// Why the grammar could not go on, once it could not: the sequence ends with this error.
    grammar_failure: Option<String>,
}

thread_local! {
    /// A vocabulary's room for the exponentials of a log-sum-exp, kept by each thread that
    /// samples (a fresh one per token would be a fresh allocation to fault in).
    static EXPS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Sampler {
    /// A sampler for one sequence, seeded from `params.seed` (or at random); `prompt` feeds the
    /// repetition penalty; `constraint` is the request's compiled grammar, if it has one.
    pub fn new(params: ValidSampling, prompt: &[u32], constraint: Option<Constraint>) -> Self {
        Self::for_sample(params, prompt, constraint, 0)
    }

    /// The sampler of sample `index` of a request with parallel samples: it draws from stream
    /// `index` of the seed's generator, so samples of one seeded request differ from each other
    /// and sample 0 draws what [`Sampler::new`] would.
    pub fn for_sample(
        params: ValidSampling,
        prompt: &[u32],
        constraint: Option<Constraint>,
        index: u32,
    ) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(u64::from(index));
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            Default::default()
        };
        Self {
            rng,
            counts: HashMap::new(),
            seen,
            params,
            constraint,
            grammar_failure: None,
        }
    }

    /// Whether the request's grammar is complete and allows nothing more (false without one).
    pub fn grammar_finished(&self) -> bool {
        self.constraint
            .as_ref()
            .is_some_and(Constraint::is_finished)
    }

    /// Why the request's grammar could not go on, once it could not: the sequence must end
    /// with this error (its output would leave the grammar).
    pub fn grammar_failure(&self) -> Option<&str> {
        self.grammar_failure.as_deref()
    }

    fn fail(&mut self, e: tandem_grammar::GrammarError) {
        tracing::warn!(error = %e, "the grammar cannot go on: ending the request");
        self.grammar_failure.get_or_insert_with(|| e.to_string());
    }

    /// Advances the grammar past `token`. A token it refuses is a failure, not a reason to
    /// drop it: the sequence ends with the error.
    fn advance(&mut self, token: u32) {
        if self.grammar_failure.is_some() {
            return;
        }
        if let Some(c) = &mut self.constraint {
            if let Err(e) = c.consume(token) {
                self.fail(e);
            }
        }
    }

    /// How many of `tokens` the request's grammar allows one after another from where the
    /// output stands (all of them without a grammar; none once it failed): a proposal is cut
    /// there before it is verified.
    pub fn grammar_prefix(&mut self, tokens: &[u32]) -> usize {
        if self.grammar_failure.is_some() {
            return 0;
        }
        match &mut self.constraint {
            Some(c) => c.valid_prefix(tokens),
            None => tokens.len(),
        }
    }

    /// The sampling parameters it applies.
    pub fn params(&self) -> &ValidSampling {
        &self.params
    }

    /// Picks the next token from `logits` (one vocabulary row) and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let p = &self.params;
        // The log-probabilities are of the raw logits: `logit - lse`, which is the bits
        // `log_softmax` gives; the whole vector only when top log-probabilities are asked for.
        let lse = EXPS.with(|e| {
            let mut e = e.borrow_mut();
            e.resize(logits.len(), 0.0);
            ops::log_sum_exp(logits, &mut e)
        });
        let penalized =
            p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let raw = logits;
        let mut failed = None;
        let mut l: Vec<f32>;
        let logits = if penalized || !p.logit_bias.is_empty() || self.constraint.is_some() {
            l = logits.to_vec();
            for &(t, b) in &p.logit_bias {
                if let Some(v) = l.get_mut(t as usize) {
                    *v += b;
                }
            }
            if p.repetition_penalty != 1.0 {
                for &t in &self.seen {
                    let v = &mut l[t as usize];
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
            if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
                for (&t, &n) in &self.counts {
                    l[t as usize] -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
            if self.grammar_failure.is_none() {
                if let Some(c) = &mut self.constraint {
                    // A grammar that cannot go on fails the sequence; the token drawn here is
                    // never shown.
                    match c.allowed() {
                        Ok(mask) => mask.apply(&mut l),
                        Err(e) => failed = Some(e),
                    }
                }
            }
            &l[..]
        } else {
            logits
        };
        let (greedy, n_top, rep) = (p.is_greedy(), p.top_logprobs as usize, p.repetition_penalty);
        if let Some(e) = failed {
            self.fail(e);
        }
        let token = if greedy {
            ops::argmax(logits) as u32
        } else {
            self.draw(logits)
        };
        let top = if n_top > 0 {
            let lp: Vec<f32> = raw.iter().map(|&v| v - lse).collect();
            top_n(&lp, n_top)
        } else {
            Vec::new()
        };
        if rep != 1.0 {
            self.seen.insert(token);
        }
        *self.counts.entry(token).or_insert(0) += 1;
        self.advance(token);
        Sampled {
            token,
            logprob: raw[token as usize] - lse,
            top,
        }
    }

    /// Whether this sampler's choice is the plain argmax of the raw logits with only the chosen
    /// token's log-probability reported: a device can then pick it ([`Self::accept`]) without
    /// sending the logits back.
    pub fn argmax_only(&self) -> bool {
        let p = &self.params;
        p.is_greedy()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.top_logprobs == 0
            && p.logit_bias.is_empty()
            && self.constraint.is_none()
    }

    /// The token a device picked for an [`Self::argmax_only`] sampler, with its log-probability:
    /// recorded as [`Self::sample`] would have recorded it.
    pub fn accept(&mut self, token: u32, logprob: f32) -> Sampled {
        debug_assert!(self.argmax_only(), "accept is for argmax-only samplers");
        self.record(token);
        Sampled {
            token,
            logprob,
            top: Vec::new(),
        }
    }

    /// Records a token sampled elsewhere (a prefill worker's first token) as if this sampler had
    /// drawn it: penalties count it, and a seeded stream moves past the draw it took there, so
    /// the tokens after it are the ones a single worker would have produced.
    pub fn record(&mut self, token: u32) {
        if !self.params.is_greedy() {
            let _ = self.rng.gen::<f32>();
        }
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        *self.counts.entry(token).or_insert(0) += 1;
        self.advance(token);
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        // Candidates sorted by logit, descending; top-k trims the list before the softmax.
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = if p.top_k > 0 {
            (p.top_k as usize).min(idx.len())
        } else {
            idx.len()
        };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        // Masked tokens (a grammar's, a bias of -inf) are no candidates, not even the last
        // resort of the draw below.
        let possible = idx.partition_point(|&i| logits[i as usize] > f32::NEG_INFINITY);
        idx.truncate(possible.max(1));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) * inv_t).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        // top-p: keep the smallest prefix whose mass reaches top_p (always at least one token).
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        // min-p: drop tokens less likely than min_p × the most likely one.
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
        }
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.gen::<f32>() * total;
        for i in 0..keep {
            r -= probs[i];
            if r <= 0.0 {
                return idx[i];
            }
        }
        idx[keep - 1]
    }
}

/// The `n` largest entries as (index, value), largest first.
fn top_n(lp: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let n = n.min(idx.len());
    idx.select_nth_unstable_by(n - 1, |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]));
    idx.truncate(n);
    idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    idx.into_iter().map(|i| (i, lp[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_plain_argmax_samplers_can_be_picked_on_a_device() {
        let greedy = SamplingParams::default();
        let with = |f: &dyn Fn(&mut SamplingParams)| {
            let mut p = greedy.clone();
            f(&mut p);
            sampler(p, &[1, 2]).argmax_only()
        };
        assert!(with(&|_| {}));
        assert!(with(&|p| {
            p.temperature = 0.8;
            p.top_k = 1
        }));
        assert!(!with(&|p| p.temperature = 0.8));
        assert!(!with(&|p| p.top_logprobs = 1));
        assert!(!with(&|p| p.repetition_penalty = 1.1));
        assert!(!with(&|p| p.presence_penalty = 0.5));
        assert!(!with(&|p| p.frequency_penalty = 0.5));
        // An accepted pick counts like a sampled one (for penalties of later tokens).
        let mut s = sampler(greedy, &[]);
        let got = s.accept(4, -0.25);
        assert_eq!((got.token, got.logprob, got.top.len()), (4, -0.25, 0));
        assert_eq!(s.counts.get(&4), Some(&1));
    }

    use super::*;
    use tandem_types::SamplingParams;

    fn sampler(p: SamplingParams, prompt: &[u32]) -> Sampler {
        Sampler::new(p.validate().unwrap(), prompt, None)
    }

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.5, -1.0, 0.0, 2.9]
    }

    #[test]
    fn greedy_and_logprobs() {
        let mut s = sampler(
            SamplingParams {
                top_logprobs: 2,
                ..Default::default()
            },
            &[],
        );
        let out = s.sample(&logits());
        assert_eq!(out.token, 1);
        let mut lp = vec![0f32; 6];
        ops::log_softmax(&logits(), &mut lp);
        assert_eq!(out.logprob, lp[1]);
        assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 5]);
        assert_eq!(out.top[1].1, lp[5]);
    }

    #[test]
    fn logprobs_are_log_softmax_bits_with_or_without_top() {
        // A vocabulary-sized row, so the vector max and exponentials run whole registers and a tail.
        let row: Vec<f32> = (0..49_155)
            .map(|i| ((i * 7919 % 10_007) as f32 / 997.0).sin() * 12.0)
            .collect();
        let mut lp = vec![0f32; row.len()];
        ops::log_softmax(&row, &mut lp);
        for top in [0, 3] {
            let params = SamplingParams {
                top_logprobs: top,
                ..Default::default()
            };
            let out = sampler(params, &[]).sample(&row);
            assert_eq!(out.token as usize, ops::argmax(&row));
            assert_eq!(out.logprob, lp[out.token as usize], "top {top}");
            assert_eq!(out.top.len(), top as usize);
            for &(t, v) in &out.top {
                assert_eq!(v, lp[t as usize]);
            }
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let p = SamplingParams {
            temperature: 1.5,
            seed: Some(42),
            ..Default::default()
        };
        let run = |p: &SamplingParams| {
            let mut s = sampler(p.clone(), &[]);
            (0..50)
                .map(|_| s.sample(&logits()).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(&p), run(&p));
        assert_ne!(
            run(&p),
            run(&SamplingParams {
                seed: Some(43),
                ..p.clone()
            })
        );
        // High temperature visits more than one token.
        let toks = run(&p);
        assert!(toks.iter().any(|&t| t != toks[0]));
    }

    #[test]
    fn filters_restrict_the_support() {
        let draw = |p: SamplingParams| {
            let mut s = sampler(p, &[]);
            (0..200)
                .map(|_| s.sample(&logits()).token)
                .collect::<std::collections::BTreeSet<_>>()
        };
        let base = SamplingParams {
            temperature: 1.0,
            seed: Some(1),
            ..Default::default()
        };
        assert_eq!(
            draw(SamplingParams {
                top_k: 2,
                ..base.clone()
            }),
            [1, 5].into()
        );
        // top-p 0.5: token 1 (p≈0.37) and 5 (p≈0.34) are needed to reach 0.5.
        assert_eq!(
            draw(SamplingParams {
                top_p: 0.5,
                ..base.clone()
            }),
            [1, 5].into()
        );
        // min-p 0.7: tokens within 70% of the best: 1 and 5 (e^-0.1≈0.90), not 2 (e^-0.5≈0.61).
        assert_eq!(
            draw(SamplingParams {
                min_p: 0.7,
                ..base.clone()
            }),
            [1, 5].into()
        );
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        // Repetition penalty on a prompt token that is the argmax.
        let mut s = sampler(
            SamplingParams {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            &[1],
        );
        assert_eq!(s.sample(&logits()).token, 5);
        // Frequency penalty: after emitting 1 once, 1 is penalized by 0.5 → 2.5 < 2.9.
        let mut s = sampler(
            SamplingParams {
                frequency_penalty: 0.5,
                ..Default::default()
            },
            &[],
        );
        assert_eq!(s.sample(&logits()).token, 1);
        assert_eq!(s.sample(&logits()).token, 5);
        let mut s = sampler(
            SamplingParams {
                presence_penalty: 1.0,
                ..Default::default()
            },
            &[],
        );
        assert_eq!(s.sample(&logits()).token, 1);
        assert_eq!(s.sample(&logits()).token, 5);
    }
}
