//! Speculative decoding's proposers: cheap guesses at a decoding sequence's next tokens, which
//! the engine verifies in one packed step (see the engine's `speculate` module for the
//! verification and the policy that sizes it).
//!
//! Every proposer here is deterministic: a proposal is a point mass, so the standard
//! rejection rule (accept a proposed token `d` with probability `min(1, p(d) / q(d))`, else draw
//! from the residual `max(0, p - q)` normalised) is "accept `d` with probability `p(d)`, else
//! draw from `p` without `d`". The engine applies it by drawing each position's token from the
//! target's distribution `p` with the sequence's own sampler and stopping at the first draw that
//! differs from the proposal: the same law, and the same random stream as without speculation,
//! so a seeded request gives the tokens it gives without speculation, whatever was proposed.
//!
//! - [`NgramProposer`]: prompt lookup (as vLLM's `ngram`): the longest n-gram that ends the
//!   sequence and occurs earlier in it, and the tokens that followed it there.
//! - [`SuffixProposer`]: suffix decoding: the request's own prompt and output as above, plus a
//!   worker-wide [`SuffixIndex`] of recent outputs (agentic and code-editing traffic repeats
//!   itself across requests), whichever matches the longer context.
//!
//! The two that run a model, a self-draft ([`SpecMethod::SelfDraft`]) and a draft model
//! ([`SpecMethod::Draft`]), propose the greedy tokens of that model: a point mass too. The
//! engine runs them (its `speculate` and `draft` modules).

use std::collections::{HashMap, VecDeque};

/// Most tokens one sequence may have proposed in one step.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Which proposer a worker speculates with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup over the request's own tokens ([`NgramProposer`]).
    Ngram,
    /// The request's tokens and a worker-wide index of recent outputs ([`SuffixProposer`]).
    Suffix,
    /// A self-draft: the target's own first `n` layers with its final norm and head (an early
    /// exit, LayerSkip-style), proposing greedily. It shares the target's KV cache: those
    /// layers' K/V for a token are the bits the whole model writes, so drafting needs no pool
    /// of its own and nothing is computed for the prompt beyond the target's prefill.
    SelfDraft(usize),
    /// A draft model: a smaller model with the target's tokenizer (a GGUF file or an HF
    /// directory), run on the same worker over a paged KV pool of its own, proposing greedily.
    /// Its K/V for a sequence's tokens is computed on the worker that decodes it (after a
    /// remote prefill or a migration too), as the sequence first drafts.
    Draft(std::path::PathBuf),
}

impl std::str::FromStr for SpecMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ngram" => Ok(Self::Ngram),
            "suffix" => Ok(Self::Suffix),
            o if o.starts_with("draft:") => match &o["draft:".len()..] {
                "" => Err(format!(
                    "--speculative {o}: draft:PATH names the draft model's GGUF file or HF directory"
                )),
                path => Ok(Self::Draft(path.into())),
            },
            o => match o.strip_prefix("self:").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(Self::SelfDraft(n)),
                Some(_) => Err(format!(
                    "--speculative {o}: self:N drafts with the target's first N layers, N at least 1"
                )),
                None => Err(format!(
                    "unknown proposer {o:?} (ngram|suffix|self:N|draft:PATH)"
                )),
            },
        }
    }
}

impl std::fmt::Display for SpecMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ngram => f.write_str("ngram"),
            Self::Suffix => f.write_str("suffix"),
            Self::SelfDraft(n) => write!(f, "self:{n}"),
            Self::Draft(path) => write!(f, "draft:{}", path.display()),
        }
    }
}

/// How an engine speculates.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// The proposer.
    pub method: SpecMethod,
    /// Most tokens proposed per sequence and step (1 to [`MAX_SPECULATIVE_TOKENS`]).
    pub tokens: usize,
    /// Sizes each step's proposals by what they are expected to gain against what the step's
    /// measured cost says they take (acceptance per sequence, the step's rows): speculation
    /// backs off where it would not pay, down to plain decoding. Off: every proposal is
    /// verified whole.
    pub adaptive: bool,
}

impl SpecConfig {
    /// `tokens` proposed by `method`, adaptive.
    pub fn new(method: SpecMethod, tokens: usize) -> Self {
        Self {
            method,
            tokens,
            adaptive: true,
        }
    }

    /// Refuses a count of proposed tokens outside 1 to [`MAX_SPECULATIVE_TOKENS`].
    pub fn check(&self) -> Result<(), String> {
        if self.tokens == 0 || self.tokens > MAX_SPECULATIVE_TOKENS {
            return Err(format!(
                "--num-speculative-tokens {} must be 1 to {MAX_SPECULATIVE_TOKENS}",
                self.tokens
            ));
        }
        Ok(())
    }

    /// The proposer this configuration names, where it proposes from tokens alone (a
    /// self-draft or a draft model runs a model: the engine drafts with it).
    pub fn proposer(&self) -> Option<Box<dyn Proposer>> {
        match self.method {
            SpecMethod::Ngram => Some(Box::new(NgramProposer::default())),
            SpecMethod::Suffix => Some(Box::new(SuffixProposer::default())),
            SpecMethod::SelfDraft(_) | SpecMethod::Draft(_) => None,
        }
    }
}

/// Guesses the tokens that follow a sequence.
pub trait Proposer: Send {
    /// The proposer's name, for logs and metrics.
    fn name(&self) -> &'static str;

    /// Appends to `out` up to `k` tokens likely to follow `tokens` (the sequence's prompt and
    /// output so far); nothing when it has no guess.
    fn propose(&self, tokens: &[u32], k: usize, out: &mut Vec<u32>);

    /// A sequence left the engine holding `tokens`, the first `prompt_len` of them its prompt
    /// (a proposer that learns from traffic keeps what it needs).
    fn learn(&mut self, tokens: &[u32], prompt_len: usize) {
        let _ = (tokens, prompt_len);
    }
}

/// The longest run of at most `max_n` tokens that ends `tokens` and also occurs earlier in
/// it, at least `min_n` long: `(its length, where the tokens after its most recent earlier
/// occurrence start)`. One backward scan: at each earlier position the match is extended
/// backwards while it holds, and a match of `max_n` ends the scan.
pub fn longest_match(tokens: &[u32], min_n: usize, max_n: usize) -> Option<(usize, usize)> {
    let len = tokens.len();
    if len < 2 || max_n == 0 {
        return None;
    }
    let last = tokens[len - 1];
    let mut best: Option<(usize, usize)> = None;
    for end in (0..len - 1).rev() {
        if tokens[end] != last {
            continue;
        }
        let mut n = 1;
        while n < max_n && n <= end && tokens[end - n] == tokens[len - 1 - n] {
            n += 1;
        }
        if n >= min_n && best.is_none_or(|(b, _)| n > b) {
            best = Some((n, end + 1));
            if n == max_n {
                break;
            }
        }
    }
    best
}

/// Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest
/// n-gram (`min_n` to `max_n` tokens) that ends the sequence.
#[derive(Clone, Copy, Debug)]
pub struct NgramProposer {
    /// Shortest n-gram matched.
    pub min_n: usize,
    /// Longest n-gram matched.
    pub max_n: usize,
}

impl Default for NgramProposer {
    fn default() -> Self {
        Self { min_n: 2, max_n: 8 }
    }
}

impl Proposer for NgramProposer {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn propose(&self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        if let Some((_, at)) = longest_match(tokens, self.min_n, self.max_n) {
            out.extend(&tokens[at..tokens.len().min(at + k)]);
        }
    }
}

/// A worker-wide index of recent outputs: for every context of 1 to `depth` tokens that
/// occurred in them, how often each token followed it (what a suffix tree of depth `depth`
/// over the outputs counts at its nodes, kept in a map from the context's hash). Bounded: it
/// holds the most recent outputs up to `capacity` tokens, and an output that leaves takes its
/// counts with it.
pub struct SuffixIndex {
    depth: usize,
    capacity: usize,
    held: usize,
    outputs: VecDeque<Vec<u32>>,
    next: HashMap<u64, Vec<(u32, u32)>>,
}

/// The hash of a context grown backwards by one token.
fn extend_hash(h: u64, token: u32) -> u64 {
    // splitmix64 of the running hash and the token: contexts that differ anywhere differ here
    // (a collision only costs a rejected proposal).
    let mut z = h ^ (u64::from(token) + 0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hash every context starts from.
const CONTEXT_ROOT: u64 = 0x2545_f491_4f6c_dd1d;

impl SuffixIndex {
    /// An index of contexts up to `depth` tokens over outputs of up to `capacity` tokens.
    pub fn new(depth: usize, capacity: usize) -> Self {
        Self {
            depth: depth.max(1),
            capacity,
            held: 0,
            outputs: VecDeque::new(),
            next: HashMap::new(),
        }
    }

    /// Tokens of output it holds.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Counts every (context, next token) pair of `seq` up or down by one.
    fn count(&mut self, seq: &[u32], up: bool) {
        for i in 1..seq.len() {
            let mut h = CONTEXT_ROOT;
            for m in 1..=self.depth.min(i) {
                h = extend_hash(h, seq[i - m]);
                let entry = self.next.entry(h).or_default();
                match entry.iter_mut().find(|(t, _)| *t == seq[i]) {
                    Some((_, n)) if up => *n += 1,
                    Some((_, n)) => *n -= 1,
                    None if up => entry.push((seq[i], 1)),
                    None => {}
                }
                if !up {
                    entry.retain(|&(_, n)| n > 0);
                    if entry.is_empty() {
                        self.next.remove(&h);
                    }
                }
            }
        }
    }

    /// Adds an output (with the prompt tokens that lead into it as context), dropping the
    /// oldest outputs beyond the capacity.
    pub fn insert(&mut self, seq: Vec<u32>) {
        if seq.len() < 2 || seq.len() > self.capacity {
            return;
        }
        self.count(&seq, true);
        self.held += seq.len();
        self.outputs.push_back(seq);
        while self.held > self.capacity {
            let old = self.outputs.pop_front().expect("held counts the outputs");
            self.held -= old.len();
            self.count(&old, false);
        }
    }

    /// The longest context (at least `min_n` tokens) ending `tokens` that the index has seen,
    /// its length and the tokens that followed it, most often first.
    fn lookup(&self, tokens: &[u32], min_n: usize) -> Option<(usize, &[(u32, u32)])> {
        let mut h = CONTEXT_ROOT;
        let mut best = None;
        for m in 1..=self.depth.min(tokens.len()) {
            h = extend_hash(h, tokens[tokens.len() - m]);
            match self.next.get(&h) {
                Some(next) if m >= min_n => best = Some((m, next.as_slice())),
                Some(_) => {}
                None => break,
            }
        }
        best
    }

    /// Follows the most frequent continuation from the end of `tokens`, token by token, while
    /// the path's estimated probability (the product of each step's share of its context's
    /// counts) stays at least `min_prob`: up to `k` tokens into `out`. Returns the context
    /// length the first token was found under (0: none).
    pub fn propose(
        &self,
        tokens: &[u32],
        k: usize,
        min_n: usize,
        min_prob: f64,
        out: &mut Vec<u32>,
    ) -> usize {
        let mut path: Vec<u32> = tokens[tokens.len().saturating_sub(self.depth)..].to_vec();
        let mut prob = 1.0;
        let mut first = 0;
        for _ in 0..k {
            let Some((m, next)) = self.lookup(&path, min_n) else {
                break;
            };
            let total: u32 = next.iter().map(|&(_, n)| n).sum();
            let &(t, n) = next
                .iter()
                .max_by_key(|&&(t, n)| (n, std::cmp::Reverse(t)))
                .expect("a context in the index has a continuation");
            prob *= f64::from(n) / f64::from(total);
            if prob < min_prob {
                break;
            }
            if first == 0 {
                first = m;
            }
            out.push(t);
            path.push(t);
        }
        first
    }
}

/// Suffix decoding: the request's own prompt and output (the longest earlier match, as prompt
/// lookup) and the worker-wide [`SuffixIndex`] of recent outputs; the one whose context matches
/// longer proposes.
pub struct SuffixProposer {
    /// The outputs of the sequences that left this engine.
    pub index: SuffixIndex,
    /// Shortest context matched.
    pub min_n: usize,
    /// Longest context matched (and the index's depth).
    pub max_n: usize,
    /// Lowest estimated probability of a proposed path from the index.
    pub min_prob: f64,
    /// Prompt tokens before an output that go into the index with it (its leading context).
    pub lead_in: usize,
}

impl Default for SuffixProposer {
    fn default() -> Self {
        let max_n = 8;
        Self {
            index: SuffixIndex::new(max_n, 1 << 18),
            min_n: 2,
            max_n,
            min_prob: 0.1,
            lead_in: max_n,
        }
    }
}

impl Proposer for SuffixProposer {
    fn name(&self) -> &'static str {
        "suffix"
    }

    fn propose(&self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        let local = longest_match(tokens, self.min_n, self.max_n);
        let start = out.len();
        let global = self
            .index
            .propose(tokens, k, self.min_n, self.min_prob, out);
        if let Some((n, at)) = local {
            if n >= global {
                out.truncate(start);
                out.extend(&tokens[at..tokens.len().min(at + k)]);
            }
        }
    }

    fn learn(&mut self, tokens: &[u32], prompt_len: usize) {
        if tokens.len() > prompt_len {
            let from = prompt_len.saturating_sub(self.lead_in);
            self.index.insert(tokens[from..].to_vec());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_most_recent_match_is_found() {
        // "5 6 7" ends the sequence; it occurred at 1..4 (followed by 8) and "6 7" at 6..8
        // (followed by 9): the longer match wins.
        let t = [4, 5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7];
        assert_eq!(longest_match(&t, 2, 8), Some((3, 4)));
        // Capped at 2: the most recent "6 7".
        assert_eq!(longest_match(&t, 2, 2), Some((2, 8)));
        assert_eq!(longest_match(&[1, 2, 3], 1, 4), None);
        assert_eq!(longest_match(&[3, 1, 3], 1, 4), Some((1, 1)));
        assert_eq!(longest_match(&[3, 1, 3], 2, 4), None);
        // The occurrence may overlap the end: "1 1 1" proposes 1s.
        let mut out = Vec::new();
        NgramProposer::default().propose(&[2, 1, 1, 1], 4, &mut out);
        assert_eq!(out, [1]);
        out.clear();
        NgramProposer::default().propose(&t, 3, &mut out);
        assert_eq!(out, [8, 1, 6]);
    }

    #[test]
    fn the_suffix_index_proposes_what_followed_and_forgets_the_oldest() {
        let mut ix = SuffixIndex::new(4, 12);
        ix.insert(vec![1, 2, 3, 4, 5, 6]);
        let mut out = Vec::new();
        assert_eq!(ix.propose(&[9, 9, 2, 3], 3, 2, 0.1, &mut out), 2);
        assert_eq!(out, [4, 5, 6]);
        // A second output where "2 3" goes on otherwise: the more frequent continuation wins,
        // and the path's probability counts the split.
        ix.insert(vec![7, 2, 3, 8]);
        ix.insert(vec![6, 2, 3, 8]);
        assert_eq!(ix.held(), 8, "the first output left at 14 tokens");
        out.clear();
        ix.propose(&[0, 2, 3], 2, 2, 0.1, &mut out);
        assert_eq!(out, [8]);
        // What left took its counts with it: nothing follows "4 5" any more.
        out.clear();
        assert_eq!(ix.propose(&[4, 5], 2, 2, 0.0, &mut out), 0);
        assert!(out.is_empty());
        // Every count of the first output is gone: the map holds only the two left.
        let mut fresh = SuffixIndex::new(4, 12);
        fresh.insert(vec![7, 2, 3, 8]);
        fresh.insert(vec![6, 2, 3, 8]);
        assert_eq!(ix.next.len(), fresh.next.len());
    }

    #[test]
    fn the_suffix_proposer_prefers_the_longer_context() {
        let mut p = SuffixProposer::default();
        p.learn(&[1, 2, 3, 4, 5, 6, 7, 8], 0);
        let mut out = Vec::new();
        // Only the index knows "3 4 5".
        p.propose(&[9, 3, 4, 5], 2, &mut out);
        assert_eq!(out, [6, 7]);
        // The request's own "4 5" (then 10) is shorter than the index's "3 4 5".
        out.clear();
        p.propose(&[4, 5, 10, 3, 4, 5], 2, &mut out);
        assert_eq!(out, [6, 7]);
        // Its own "2 4 5" is longer than the index's "4 5".
        out.clear();
        p.propose(&[2, 4, 5, 11, 2, 4, 5], 2, &mut out);
        assert_eq!(out, [11, 2]);
        assert_eq!(
            "draft:/m/small.gguf".parse::<SpecMethod>(),
            Ok(SpecMethod::Draft("/m/small.gguf".into()))
        );
        assert_eq!(
            SpecMethod::Draft("/m/small.gguf".into()).to_string(),
            "draft:/m/small.gguf"
        );
        assert_eq!("suffix".parse::<SpecMethod>(), Ok(SpecMethod::Suffix));
        assert_eq!(
            "self:12".parse::<SpecMethod>(),
            Ok(SpecMethod::SelfDraft(12))
        );
        assert_eq!(SpecMethod::SelfDraft(12).to_string(), "self:12");
        for bad in ["self:0", "self:", "self:x", "eagle", "draft:"] {
            assert!(bad.parse::<SpecMethod>().is_err(), "{bad}");
        }
    }
}
