//! Text ⇄ token ids: HF `tokenizers` loaded from `tokenizer.json`, or built from GGUF metadata, and
//! incremental detokenization for streaming.
//!
//! For GGUF we assemble the equivalent `tokenizer.json` in memory (byte-level BPE, the vocabulary and
//! merges from `tokenizer.ggml.*`, special tokens as added tokens) and hand it to `tokenizers`, so
//! both sources run the same, well-tested code. The pre-tokenizer is chosen by `tokenizer.ggml.pre`
//! as llama.cpp does: `smollm` splits every digit on its own before the GPT-2 regex.

use serde_json::{json, Value};

use crate::gguf::GgufFile;
use crate::ModelError;

/// Llama 3's pre-tokenizer regex (`tokenizer.ggml.pre = llama-bpe`).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF `tokenizer.ggml.token_type` values.
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

/// A model's tokenizer: text to token ids and back, with the model's BOS/EOS conventions.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The beginning-of-sequence token's id, if the model has one.
    pub bos_token_id: Option<u32>,
    /// Token ids that end generation (EOS, and end-of-turn tokens the model declares).
    pub eos_token_ids: Vec<u32>,
    /// Whether [`Tokenizer::encode`] with `add_special` prepends BOS.
    pub add_bos: bool,
    /// The BOS token's text (what chat templates see as `bos_token`).
    pub bos_token: Option<String>,
    /// The EOS token's text (what chat templates see as `eos_token`).
    pub eos_token: Option<String>,
    /// Cached: `tokenizers` computes the size with added tokens by building the whole vocabulary
    /// map (milliseconds for 49k tokens), and every decode checks ids against it.
    vocab_size: usize,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab_size())
            .field("bos", &self.bos_token_id)
            .field("eos", &self.eos_token_ids)
            .finish()
    }
}

fn tk_err(e: tokenizers::Error) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Wraps a `tokenizers` tokenizer; `bos`/`eos` name tokens by their text.
    pub fn from_hf(
        inner: tokenizers::Tokenizer,
        bos: Option<String>,
        eos: Option<String>,
        extra_eos_ids: &[u32],
        add_bos: bool,
    ) -> Self {
        let bos_token_id = bos.as_deref().and_then(|t| inner.token_to_id(t));
        let mut eos_token_ids: Vec<u32> = eos
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .into_iter()
            .collect();
        for &e in extra_eos_ids {
            if !eos_token_ids.contains(&e) {
                eos_token_ids.push(e);
            }
        }
        Self {
            vocab_size: inner.get_vocab_size(true),
            inner,
            bos_token_id,
            eos_token_ids,
            add_bos,
            bos_token: bos,
            eos_token: eos,
        }
    }

    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let s = |k: &str| g.get(k).and_then(|v| v.as_str());
        let model = s("tokenizer.ggml.model")
            .ok_or_else(|| ModelError::Tokenizer("GGUF has no tokenizer.ggml.model".into()))?;
        if model != "gpt2" {
            return Err(ModelError::Unsupported(format!(
                "GGUF tokenizer model {model:?}; byte-level BPE (gpt2) is supported, or pass an HF directory with tokenizer.json"
            )));
        }
        let tokens = g
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .ok_or_else(|| ModelError::Tokenizer("GGUF has no tokenizer.ggml.tokens".into()))?;
        let merges = g
            .get("tokenizer.ggml.merges")
            .and_then(|v| v.as_array())
            .ok_or_else(|| ModelError::Tokenizer("GGUF has no tokenizer.ggml.merges".into()))?;
        let types = g
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array());
        let mut vocab = serde_json::Map::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            let t = t
                .as_str()
                .ok_or_else(|| ModelError::Tokenizer(format!("token {i} is not a string")))?;
            vocab.insert(t.to_string(), json!(i));
            let ty = types
                .and_then(|a| a.get(i))
                .and_then(|v| v.as_u64())
                .unwrap_or(1);
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                added.push(json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": ty == TOKEN_TYPE_CONTROL}));
            }
        }
        let merges: Vec<Value> = merges
            .iter()
            .filter_map(|m| m.as_str())
            .map(|m| json!(m))
            .collect();
        let pre = s("tokenizer.ggml.pre").unwrap_or("default");
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let pre_tokenizer = match pre {
            "default" | "gpt2" | "gpt-2" => byte_level(true),
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            "llama-bpe" | "llama3" | "llama-v3" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": false},
                byte_level(false)]}),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "GGUF pre-tokenizer {other:?} (supported: default/gpt2, smollm, llama-bpe); pass an HF directory with tokenizer.json instead"
                )))
            }
        };
        let spec = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added, "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges}
        });
        let inner: tokenizers::Tokenizer = serde_json::from_value(spec)
            .map_err(|e| ModelError::Tokenizer(format!("building from GGUF: {e}")))?;
        let id = |k: &str| g.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        let bos_token_id = id("tokenizer.ggml.bos_token_id");
        let mut eos_token_ids: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        if let Some(eot) = id("tokenizer.ggml.eot_token_id") {
            if !eos_token_ids.contains(&eot) {
                eos_token_ids.push(eot);
            }
        }
        let name = |i: Option<u32>| i.and_then(|i| inner.id_to_token(i));
        Ok(Self {
            bos_token: name(bos_token_id),
            eos_token: name(eos_token_ids.first().copied()),
            add_bos: g
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            bos_token_id,
            eos_token_ids,
            vocab_size: inner.get_vocab_size(true),
            inner,
        })
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Encodes text. Special tokens written in the text (`<|im_start|>`) become their ids; BOS is
    /// prepended when the model asks for it and `add_special` is set.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self.inner.encode_fast(text, false).map_err(tk_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special && self.add_bos {
            if let Some(b) = self.bos_token_id {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text. Ids outside the vocabulary are an error, not a panic.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, ModelError> {
        let vocab = self.vocab_size() as u32;
        if let Some(bad) = ids.iter().find(|&&i| i >= vocab) {
            return Err(ModelError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        self.inner.decode(ids, skip_special).map_err(tk_err)
    }

    /// Where `other` maps text to ids differently: the first id whose entry differs, or the
    /// sizes when they differ (None: the same vocabulary, as a draft model must have).
    pub fn vocabulary_difference(&self, other: &Tokenizer) -> Option<String> {
        let (a, b) = (self.vocab_size(), other.vocab_size());
        if a != b {
            return Some(format!("{a} token ids against {b}"));
        }
        (0..a as u32).find_map(|id| {
            let (x, y) = (self.id_to_token(id), other.id_to_token(id));
            (x != y).then(|| format!("id {id} is {x:?} against {y:?}"))
        })
    }

    /// The vocabulary entry of one id (its raw token text, not decoded), if the id exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry, if there is one with exactly this text.
    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.inner.token_to_id(t)
    }

    /// Every id's bytes as the model writes them (what a grammar engine matches text against):
    /// byte-level BPE entries mapped back from GPT-2's printable characters, SentencePiece
    /// entries with `▁` as a space and `<0xNN>` as that byte, added tokens as their text. Special
    /// tokens (BOS, EOS, template markers) are marked, not spelled: they write no text.
    pub fn vocab_bytes(&self) -> Result<Vec<VocabEntry>, ModelError> {
        let kind = self
            .inner
            .get_decoder()
            .and_then(decoder_kind)
            .ok_or_else(|| {
                ModelError::Unsupported(
                    "a tokenizer whose decoder is neither byte-level nor byte-fallback".into(),
                )
            })?;
        let added = self.inner.get_added_tokens_decoder();
        let to_byte = byte_level_chars();
        (0..self.vocab_size as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return Ok(VocabEntry {
                        bytes: t.content.as_bytes().to_vec(),
                        special: t.special,
                    });
                }
                let Some(name) = self.inner.id_to_token(id) else {
                    // A hole in the vocabulary: nothing can produce it, so it writes nothing.
                    return Ok(VocabEntry {
                        bytes: Vec::new(),
                        special: true,
                    });
                };
                let bytes = match kind {
                    DecoderKind::ByteLevel => name
                        .chars()
                        .map(|c| to_byte.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        .ok_or_else(|| {
                            ModelError::Tokenizer(format!(
                                "token {id} ({name:?}) is not a byte-level BPE entry"
                            ))
                        })?,
                    DecoderKind::ByteFallback => match byte_fallback(&name) {
                        Some(b) => vec![b],
                        None => name.replace('\u{2581}', " ").into_bytes(),
                    },
                };
                Ok(VocabEntry {
                    bytes,
                    special: false,
                })
            })
            .collect()
    }

    /// Whether `id` ends generation (one of [`Tokenizer::eos_token_ids`]).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }
}

/// One vocabulary entry as [`Tokenizer::vocab_bytes`] gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabEntry {
    /// The bytes it writes (a special token's: its name).
    pub bytes: Vec<u8>,
    /// A control token (BOS, EOS, a template marker) rather than text.
    pub special: bool,
}

#[derive(Clone, Copy)]
enum DecoderKind {
    ByteLevel,
    ByteFallback,
}

fn decoder_kind(d: &tokenizers::DecoderWrapper) -> Option<DecoderKind> {
    use tokenizers::DecoderWrapper as D;
    match d {
        D::ByteLevel(_) => Some(DecoderKind::ByteLevel),
        D::ByteFallback(_) => Some(DecoderKind::ByteFallback),
        D::Sequence(s) => s.get_decoders().iter().find_map(decoder_kind),
        _ => None,
    }
}

/// GPT-2's byte-level alphabet read backwards: the printable Latin-1 bytes stand for
/// themselves, the other 68 bytes for the characters from U+0100 on, in byte order.
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                next += 1;
                (char::from_u32(next - 1).expect("below U+0200"), b)
            }
        })
        .collect()
}

/// `<0xNN>`, SentencePiece's spelling of a raw byte.
fn byte_fallback(name: &str) -> Option<u8> {
    let hex = name.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// Turns a growing list of token ids into text pieces without ever cutting a UTF-8 character.
///
/// Decodes a short window of recent tokens twice (with and without the newest) and emits the
/// difference once it no longer ends in a replacement character: byte-level BPE can split one
/// character across tokens, and a word-initial space depends on the previous token.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl IncrementalDecoder {
    /// A decoder for a new stream; `skip_special` leaves special tokens out of the text.
    pub fn new(skip_special: bool) -> Self {
        Self {
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            skip_special,
        }
    }

    /// Adds one token; returns the new text it completes, possibly empty.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, ModelError> {
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let piece = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back at the end of the stream (an incomplete character decodes lossily).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, ModelError> {
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or("").to_string())
    }
}
