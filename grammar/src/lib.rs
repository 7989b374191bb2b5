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
pub struct Grammars {
    factory: ParserFactory,
    /// Ids that end generation: allowed together wherever the grammar allows its end.
    eos: Vec<u32>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("eos", &self.eos).finish()
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
        Ok(Self { factory, eos })
    }

    /// One request's constraint, at the start of its output.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, GrammarError> {
        let top = match grammar {
            Grammar::JsonSchema(text) => {
                let mut schema: Value = serde_json::from_str(text).map_err(|e| {
                    GrammarError::Invalid(format!("the JSON schema is not JSON: {e}"))
                })?;
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
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Choice(options) => {
                if options.is_empty() {
                    return Err(GrammarError::Invalid("the choice list is empty".into()));
                }
                // Lark's string literals are JSON strings.
                let alternatives: Vec<String> = options
                    .iter()
                    .map(|o| serde_json::to_string(o).expect("a string serializes"))
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Constraint {
            matcher: Box::new(matcher),
            eos: self.eos.clone(),
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
}

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
    /// allowed; once it must end, only those are. A constraint in error allows only the end,
    /// so the request stops rather than leaving its grammar.
    pub fn allowed(&mut self) -> TokenMask {
        let mut mask = match self.matcher.compute_mask_or_eos() {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "grammar failed: ending the output");
                let mut m = SimpleVob::alloc(self.vocab_size());
                m.allow_token(self.eos[0]);
                m
            }
        };
        if self.eos.iter().any(|&e| mask.is_allowed(e)) {
            for &e in &self.eos {
                mask.allow_token(e);
            }
        }
        TokenMask(mask)
    }

    /// Advances past `token`, which came next in the output. An end-of-sequence id ends the
    /// grammar.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.eos.contains(&token) {
            // Whichever end the model wrote, the grammar engine knows its own.
            return self
                .matcher
                .consume_token(self.eos[0])
                .map_err(|e| GrammarError::Rejected(e.to_string()));
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Rejected(e.to_string()))
    }

    /// An independent copy at the same point of the grammar (its own parser and lexer state):
    /// for a parallel sample that goes on from here on its own thread.
    pub fn fork(&self) -> Constraint {
        Constraint {
            matcher: Box::new(self.matcher.deep_clone()),
            eos: self.eos.clone(),
        }
    }

    /// Whether the grammar is complete and allows nothing more.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn vocab_size(&self) -> usize {
        self.matcher
            .tok_env()
            .map(|e| e.tok_trie().vocab_size())
            .unwrap_or(self.eos[0] as usize + 1)
    }
}
