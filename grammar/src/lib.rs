//! Structured outputs: a request's [`Grammar`] compiled, for one tokenizer, into a [`Constraint`]
//! that says at each step which tokens keep the output inside the grammar's language.
//!
//! The grammar engine is llguidance (JSON Schema, regular expressions and Lark grammars over a
//! token trie): [`Grammars`] holds its compiler for one model's vocabulary, built once per
//! process; [`Grammars::compile`] makes one request's [`Constraint`]. The router compiles a
//! request's grammar to refuse a bad one with a 400 before it is routed; each worker compiles it
//! again for its own sampler, and a worker that takes over a stream (a remote prefill's first
//! token, a migrated request's output) brings the constraint to where the tokens left it by
//! feeding it those tokens.

use std::sync::{Arc, OnceLock};

mod finite;
mod limits;
mod pool;

pub use limits::{MAX_GRAMMAR_BYTES, MAX_GRAMMAR_DEPTH};
pub use pool::{COMPILE_BUDGET, COMPILE_QUEUE, COMPILE_STACK_BYTES};

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use tandem_model::Tokenizer;
pub use tandem_types::Grammar;

/// Why a grammar cannot constrain a request, or a constraint cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The grammar is not one the engine can compile (the message names the construct).
    #[error("{0}")]
    Invalid(String),
    /// The vocabulary cannot be read as bytes (a tokenizer this engine does not know).
    #[error("structured outputs are not available for this tokenizer: {0}")]
    Tokenizer(String),
    /// A token the grammar does not allow was fed to it (a bug upstream, or a peer's).
    #[error("the output left the grammar: {0}")]
    Rejected(String),
    /// The grammar cannot go on from where the output stands (the engine hit one of its limits,
    /// or nothing the vocabulary has continues it).
    #[error("the output's grammar cannot go on: {0}")]
    Stuck(String),
    /// Too many grammars are compiling: the same request may compile in a moment.
    #[error("the grammar compiler is busy: {0}")]
    Busy(String),
    /// The compiler itself failed (it panicked): not the grammar's fault as far as is known.
    #[error("{0}")]
    Internal(String),
}

/// The grammar engine's message without the marker it leaves where, with verbose errors, the
/// parser's state would be.
fn terse(e: impl std::fmt::Display) -> String {
    let m = e.to_string();
    m.trim_end()
        .trim_end_matches("<non-verbose/>")
        .trim_end()
        .to_string()
}

/// JSON output as models learned it from Python's `json.dumps` (`", "` and `": "`, no free
/// whitespace): a small model given free whitespace can spend its whole budget on newlines.
/// A schema that carries its own `x-guidance` options keeps them.
fn json_options() -> Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// The compiler for one model's vocabulary: build it once (it indexes every token's bytes),
/// share it, and [`compile`](Self::compile) each request's grammar with it.
/// Cheap to clone: the clones share one index.
#[derive(Clone)]
pub struct Grammars(Arc<Index>);

struct Index {
    factory: ParserFactory,
    /// Ids that end generation: allowed together wherever the grammar allows its end.
    eos: Vec<u32>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("eos", &self.0.eos)
            .finish()
    }
}

/// The tokenizer as the grammar engine sees it: a trie of every id's bytes, and the model's
/// own tokenizer for text the grammar forces.
struct TokenizerView {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for TokenizerView {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            // The trie's greedy split stands in for a piece the tokenizer refuses.
            self.tokenizer.encode(text, false).unwrap_or_default()
        })
    }
}

impl Grammars {
    /// The compiler for `tokenizer`'s vocabulary, padded to `vocab_size` ids (the model's logit
    /// rows may be longer than the tokenizer's vocabulary; the extra ids are never allowed).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self, GrammarError> {
        let entries = tokenizer
            .vocab_bytes()
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        if entries.len() > vocab_size {
            return Err(GrammarError::Tokenizer(format!(
                "the tokenizer has {} ids, more than the model's {vocab_size} logits",
                entries.len()
            )));
        }
        let special = |name: &[u8]| {
            let mut b = Vec::with_capacity(name.len() + 1);
            b.push(TokTrie::SPECIAL_TOKEN_MARKER);
            b.extend_from_slice(name);
            b
        };
        let mut words: Vec<Vec<u8>> = entries
            .into_iter()
            .map(|e| {
                if e.special {
                    special(&e.bytes)
                } else {
                    e.bytes
                }
            })
            .collect();
        while words.len() < vocab_size {
            words.push(special(format!("<[{}]>", words.len()).as_bytes()));
        }
        let eos = tokenizer.eos_token_ids.clone();
        let first_eos = *eos.first().ok_or_else(|| {
            GrammarError::Tokenizer("the model declares no end-of-sequence token".into())
        })?;
        let mut info = TokRxInfo::new(vocab_size as u32, first_eos);
        info.tok_bos = tokenizer.bos_token_id;
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(&eos);
        }
        let env: TokEnv = Arc::new(TokenizerView {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let caps = InferenceCapabilities {
            ff_tokens: false,
            conditional_ff_tokens: false,
            backtrack: false,
            fork: false,
        };
        let mut factory = ParserFactory::new(&env, caps, &SlicedBiasComputer::general_slices())
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        // An error names what failed, not the parser's whole state and grammar (which go back
        // to the client, and can be as long as the grammar it sent).
        factory.limits_mut().verbose_errors = false;
        Ok(Self(Arc::new(Index { factory, eos })))
    }

    /// One request's constraint, at the start of its output. The grammar's size and depth are
    /// checked first ([`MAX_GRAMMAR_BYTES`], [`MAX_GRAMMAR_DEPTH`]); it then compiles on one of
    /// the process's compile threads (deep stacks, a bounded queue, [`COMPILE_BUDGET`]), never
    /// on the caller's.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, GrammarError> {
        let top = Self::top_level(grammar)?;
        let json = matches!(grammar, Grammar::JsonSchema(_) | Grammar::JsonObject);
        let index = self.0.clone();
        pool::run(move || {
            let parser = index
                .factory
                .create_parser(top)
                .map_err(|e| GrammarError::Invalid(terse(e)))?;
            let mut matcher = Matcher::new(Ok(parser));
            if let Some(e) = matcher.get_error() {
                return Err(GrammarError::Invalid(terse(e)));
            }
            // What may come first: a grammar nothing can start, or a schema whose only text
            // is the empty one (no JSON value is: its references never bottom out), would
            // end the output at once with nothing in it.
            let first = matcher.compute_mask_or_eos().map_err(|e| {
                GrammarError::Invalid(format!("the grammar cannot start: {}", terse(e)))
            })?;
            let only_end = first.num_set() == 1 && first.is_allowed(index.eos[0]);
            if first.is_zero() || (json && only_end) {
                return Err(GrammarError::Invalid(
                    "the grammar has no text a model could write (is every branch of its \
                     recursion required?)"
                        .into(),
                ));
            }
            Ok(Constraint {
                matcher: Box::new(matcher),
                eos: index.eos.clone(),
                step_budget: STEP_BUDGET,
            })
        })
    }

    /// The grammar in the engine's terms, once its size and depth are within the limits.
    fn top_level(grammar: &Grammar) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match grammar {
            Grammar::JsonSchema(text) => {
                limits::check_size("JSON schema", text.len())?;
                let mut schema: Value = serde_json::from_str(text).map_err(|e| {
                    GrammarError::Invalid(format!("the JSON schema is not JSON: {e}"))
                })?;
                limits::check_schema(&schema)?;
                if finite::has_finite_instance(&schema) == Some(false) {
                    return Err(GrammarError::Invalid(
                        "the JSON schema allows no text a model could write: every instance must \
                         hold another instance (a `$ref` cycle through required properties or \
                         non-empty arrays), so none is finite"
                            .into(),
                    ));
                }
                match &mut schema {
                    Value::Object(o) => {
                        o.entry("x-guidance").or_insert_with(json_options);
                    }
                    Value::Bool(_) => {}
                    _ => {
                        return Err(GrammarError::Invalid(
                            "a JSON schema is an object (or true/false)".into(),
                        ))
                    }
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({
                "type": "object",
                "x-guidance": json_options(),
            })),
            Grammar::Regex(rx) => {
                limits::check_size("regular expression", rx.len())?;
                TopLevelGrammar::from_regex(rx)
            }
            Grammar::Choice(options) => {
                if options.is_empty() {
                    return Err(GrammarError::Invalid("the choice list is empty".into()));
                }
                limits::check_size("choice list", options.iter().map(|o| o.len() + 4).sum())?;
                // Lark's string literals are JSON strings.
                let alternatives: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).expect("a string serializes"))
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Grammar::Lark(text) => {
                limits::check_size("Lark grammar", text.len())?;
                limits::check_lark(text)?;
                TopLevelGrammar::from_lark(text.clone())
            }
        })
    }
}

/// [`Grammars`] for one model, built on first use: a process that never sees a grammar never
/// pays for indexing the vocabulary (a few hundred milliseconds for 49k ids). Share it.
pub struct GrammarCompiler {
    tokenizer: Tokenizer,
    vocab_size: usize,
    built: OnceLock<Result<Grammars, String>>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .field("built", &self.built.get().is_some())
            .finish()
    }
}

impl GrammarCompiler {
    /// A compiler for `tokenizer`'s vocabulary over `vocab_size` logits (see [`Grammars::new`]).
    pub fn new(tokenizer: Tokenizer, vocab_size: usize) -> Self {
        Self {
            tokenizer,
            vocab_size,
            built: OnceLock::new(),
        }
    }

    /// Builds the vocabulary's index now rather than on the first grammar.
    pub fn grammars(&self) -> Result<&Grammars, GrammarError> {
        self.built
            .get_or_init(|| {
                Grammars::new(&self.tokenizer, self.vocab_size).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| GrammarError::Tokenizer(e.clone()))
    }

    /// One request's constraint, at the start of its output.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, GrammarError> {
        self.grammars()?.compile(grammar)
    }
}

/// One request's grammar state: which tokens may come next ([`allowed`](Self::allowed)), and
/// the tokens that came ([`consume`](Self::consume)).
#[derive(Clone)]
pub struct Constraint {
    /// Boxed: a parser's state is large, and requests carrying one move through channels.
    matcher: Box<Matcher>,
    eos: Vec<u32>,
    /// The most one call may take ([`STEP_BUDGET`] unless set).
    step_budget: std::time::Duration,
}

/// The most one token's grammar work may take: a mask ([`Constraint::allowed`]), or the advance
/// past a token ([`Constraint::consume`]). The parser bounds the items it creates a step, but
/// not the work of a grammar whose parses multiply with the text (`e: e e | "a"` spent 28 ms a
/// token after 240 bytes and 1.7 s after 960 on a Zen 3 core, and it runs on the engine's
/// thread, holding up every request in the batch): the first step over the budget ends its
/// request with the grammar's error. A JSON schema's step takes microseconds to a few
/// milliseconds, so this is far from any grammar a client means.
pub const STEP_BUDGET: std::time::Duration = std::time::Duration::from_secs(1);

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.matcher.is_stopped())
            .finish()
    }
}

/// The tokens a [`Constraint`] allows next: one bit per vocabulary id.
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Whether `token` may come next.
    pub fn allows(&self, token: u32) -> bool {
        self.0.is_allowed(token)
    }

    /// How many ids may come next.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }

    /// Sets every disallowed id's logit to minus infinity (`logits` is one vocabulary row).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (chunk, &bits) in logits.chunks_mut(32).zip(words) {
            if bits == u32::MAX {
                continue;
            }
            for (j, v) in chunk.iter_mut().enumerate() {
                if bits & (1 << j) == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        // Ids past the mask's words (none when the mask covers the row) are not allowed.
        for v in logits.iter_mut().skip(words.len() * 32) {
            *v = f32::NEG_INFINITY;
        }
    }
}

impl Constraint {
    /// The tokens that may come next. Where the grammar may end, every end-of-sequence id is
    /// allowed; once it must end, only those are. A grammar that cannot go on (the engine hit
    /// one of its limits, or the grammar has no way to continue) is an error: the request
    /// must end with it, never go on unconstrained.
    pub fn allowed(&mut self) -> Result<TokenMask, GrammarError> {
        let start = std::time::Instant::now();
        let mask = self.matcher.compute_mask_or_eos();
        self.within_budget(start, "mask")?;
        let mut mask = mask.map_err(|e| GrammarError::Stuck(terse(e)))?;
        if self.eos.iter().any(|&e| mask.is_allowed(e)) {
            for &e in &self.eos {
                mask.allow_token(e);
            }
        } else if mask.is_zero() {
            return Err(GrammarError::Stuck(
                "no token can continue the output".into(),
            ));
        }
        Ok(TokenMask(mask))
    }

    /// Advances past `token`, which came next in the output. An end-of-sequence id ends the
    /// grammar.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        // Whichever end the model wrote, the grammar engine knows its own.
        let token = if self.eos.contains(&token) {
            self.eos[0]
        } else {
            token
        };
        let start = std::time::Instant::now();
        let r = self.matcher.consume_token(token);
        self.within_budget(start, "advance")?;
        r.map_err(|e| GrammarError::Rejected(terse(e)))
    }

    /// How many of `tokens` the grammar allows one after another from where it stands, without
    /// moving it: speculative decoding's proposals, cut where the output would leave the
    /// grammar (an end-of-sequence id counts as the grammar's own end). 0 where the grammar
    /// cannot tell.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        let mapped: Vec<u32> = tokens
            .iter()
            .map(|t| match self.eos.contains(t) {
                true => self.eos[0],
                false => *t,
            })
            .collect();
        self.matcher.validate_tokens(&mapped).unwrap_or(0)
    }

    /// With another budget than [`STEP_BUDGET`] for each mask and advance.
    pub fn with_step_budget(mut self, budget: std::time::Duration) -> Self {
        self.step_budget = budget;
        self
    }

    /// An error if the call that began at `start` took longer than the step budget.
    fn within_budget(&self, start: std::time::Instant, what: &str) -> Result<(), GrammarError> {
        let took = start.elapsed();
        if took <= self.step_budget {
            return Ok(());
        }
        Err(GrammarError::Stuck(format!(
            "the grammar is too ambiguous to follow: one token's {what} took {} ms, over the {} ms a step may take",
            took.as_millis(),
            self.step_budget.as_millis()
        )))
    }

    /// An independent copy at the same point of the grammar (its own parser and lexer state):
    /// for a parallel sample that goes on from here on its own thread.
    pub fn fork(&self) -> Constraint {
        Constraint {
            matcher: Box::new(self.matcher.deep_clone()),
            eos: self.eos.clone(),
            step_budget: self.step_budget,
        }
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
