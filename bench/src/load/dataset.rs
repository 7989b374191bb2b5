//! What is sent: synthetic prompts of given length distributions, shared prefixes, multi-turn
//! conversations, ShareGPT files, timestamped traces (Mooncake's JSONL), and the two sides of
//! speculative decoding: edits (a text or a piece of code to give back changed, so the answer
//! repeats its prompt) and free-form stories (nothing to repeat). Every dataset is deterministic
//! in its seed: session `i` is the same on every run, every agent and every target. Requests ask
//! the server to go on past the end of sequence, so that each does the same work everywhere,
//! except an edit's: its answer ends where the model ends it.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tandem_model::Tokenizer;

/// A length distribution, in tokens: `N`, `A-B` (uniform, inclusive) or `normal:MEAN:STD`
/// (rounded, at least 1).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum LenDist {
    /// Always this many.
    Fixed(usize),
    /// Uniform over `lo..=hi`.
    Uniform(usize, usize),
    /// Normal, rounded and kept at 1 or more.
    Normal(f64, f64),
}

impl LenDist {
    /// One draw.
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        match *self {
            Self::Fixed(n) => n,
            Self::Uniform(lo, hi) => rng.gen_range(lo..=hi),
            Self::Normal(mean, std) => {
                let z: f64 = rand_distr::Distribution::sample(&rand_distr::StandardNormal, rng);
                (mean + std * z).round().max(1.0) as usize
            }
        }
    }
}

impl FromStr for LenDist {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?}: a length is N, A-B or normal:MEAN:STD");
        if let Some(rest) = s.strip_prefix("normal:") {
            let (m, d) = rest.split_once(':').ok_or_else(bad)?;
            let (m, d): (f64, f64) = (m.parse().map_err(|_| bad())?, d.parse().map_err(|_| bad())?);
            if m < 1.0 || d < 0.0 || !m.is_finite() || !d.is_finite() {
                return Err(bad());
            }
            return Ok(Self::Normal(m, d));
        }
        if let Some((a, b)) = s.split_once('-') {
            let (a, b): (usize, usize) =
                (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
            if a == 0 || b < a {
                return Err(bad());
            }
            return Ok(Self::Uniform(a, b));
        }
        match s.parse() {
            Ok(n) if n > 0 => Ok(Self::Fixed(n)),
            _ => Err(bad()),
        }
    }
}

/// A chat message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Its text.
    pub content: String,
}

/// A request's prompt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Prompt {
    /// Token ids, to `/v1/completions`.
    Tokens(Vec<u32>),
    /// Text, to `/v1/completions`.
    Text(String),
    /// A turn's new messages, to `/v1/chat/completions` after the conversation so far.
    Chat(Vec<Message>),
}

/// One request of a session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// What it sends.
    pub prompt: Prompt,
    /// Output tokens asked for: all of them where `ignore_eos`, at most that many otherwise.
    pub max_tokens: usize,
    /// Whether the server is asked to go on past the model's end of sequence, so that every
    /// request does the same work on every server (every dataset but `edit`, whose answer is a
    /// text given back, which ends where the model ends it, as a user's would).
    #[serde(default = "eos_ignored")]
    pub ignore_eos: bool,
    /// One of a mixed workload's long requests.
    #[serde(default)]
    pub long: bool,
}

/// A turn's `ignore_eos` where a saved one has none (from before the field).
fn eos_ignored() -> bool {
    true
}

/// A unit of work: one request, or a conversation whose turns go one after another, each
/// resending the history (earlier turns and the server's answers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Session {
    /// The turns, in order.
    pub turns: Vec<Turn>,
}

/// Which dataset, and its parameters.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum DatasetSpec {
    /// Random token ids of the given lengths; with `long_every` k > 0 every k-th request is a
    /// long prompt with a short answer (long prefills arriving while the others decode).
    Random {
        /// Prompt tokens.
        input: LenDist,
        /// Output tokens.
        output: LenDist,
        /// Every k-th request is long (0: none).
        long_every: usize,
        /// A long request's prompt tokens.
        long_input: usize,
        /// A long request's output tokens.
        long_output: usize,
    },
    /// `prefixes` system prompts of `prefix_len` tokens, each followed by one of `questions`
    /// questions of `question_len` tokens (the prefix-cache and KV-aware routing case).
    SharedPrefix {
        /// Distinct shared prefixes.
        prefixes: usize,
        /// Questions per prefix.
        questions: usize,
        /// Tokens of a prefix.
        prefix_len: usize,
        /// Tokens of a question.
        question_len: LenDist,
        /// Output tokens.
        output: LenDist,
    },
    /// Conversations of `turns` turns, each a new user message of `input` tokens' worth of
    /// text after the history (the decode-side prefix reuse case).
    MultiTurn {
        /// Turns per conversation.
        turns: usize,
        /// Tokens of each new user message.
        input: LenDist,
        /// Output tokens of each answer.
        output: LenDist,
    },
    /// The first exchange of each conversation of a ShareGPT JSON file: its human turn as the
    /// prompt, its answer's length (in the model's tokens) as the output length.
    ShareGpt(PathBuf),
    /// A Mooncake-style JSONL trace: `timestamp` (ms), `input_length`, `output_length`,
    /// `hash_ids` (512-token blocks: equal ids are equal tokens, so shared prefixes recur).
    Trace(PathBuf),
    /// Edits: a chat asking for a piece of code (with identifiers that recur through it) with
    /// one identifier renamed, or a paragraph with its misspellings fixed, given back whole; the
    /// answer is asked for as many tokens as the text has (and a tenth more). The workload
    /// speculative decoding is for.
    Edit,
    /// Free-form stories: a chat asking for a story on a drawn subject, `output` tokens long.
    /// Nothing in the prompt to repeat.
    Story {
        /// Output tokens.
        output: LenDist,
    },
}

/// Identifiers the edit dataset's code draws from.
const IDENTS: [&str; 24] = [
    "total", "count", "values", "result", "index", "items", "buffer", "offset", "limit", "window",
    "score", "weights", "records", "cursor", "matrix", "prefix", "suffix", "tokens", "queue",
    "stack", "width", "height", "scale", "delta",
];

/// Words the edit dataset's prose and the stories' subjects draw from.
const NOUNS: [&str; 24] = [
    "lighthouse",
    "river",
    "garden",
    "engine",
    "market",
    "bridge",
    "winter",
    "library",
    "harbor",
    "mountain",
    "village",
    "signal",
    "orchard",
    "station",
    "forest",
    "island",
    "workshop",
    "tower",
    "desert",
    "canal",
    "meadow",
    "factory",
    "castle",
    "valley",
];

/// The edit dataset's code: two functions over the same names, each name used several times.
fn edit_code(rng: &mut impl Rng) -> (String, String) {
    use rand::seq::SliceRandom;
    let mut names: Vec<&str> = IDENTS.to_vec();
    names.shuffle(rng);
    let [f, g, a, b, t, i, s, v, new] = [
        names[0], names[1], names[2], names[3], names[4], names[5], names[6], names[7], names[8],
    ];
    let code = format!(
        "def make_{f}({a}, {b}):\n    {t} = []\n    for {i} in range({a}):\n        if {i} % {b} == 0:\n            {t}.append({i} * {b})\n        else:\n            {t}.append({i} + {b})\n    return {t}\n\n\ndef sum_{g}({t}, {b}):\n    {s} = 0\n    for {v} in {t}:\n        if {v} > {b}:\n            {s} = {s} + {v}\n    return {s}\n\n\ndef report_{f}({a}, {b}):\n    {t} = make_{f}({a}, {b})\n    {s} = sum_{g}({t}, {b})\n    print(\"{t}:\", {t})\n    print(\"{s}:\", {s})\n    return {s}\n"
    );
    let ask = format!(
        "Rename the variable `{t}` to `{new}` everywhere in this Python code. Answer with the whole code and nothing else.\n\n```python\n{code}```"
    );
    (ask, code)
}

/// The edit dataset's prose: sentences about drawn places, every fifth word of a few of them
/// misspelt (two letters swapped).
fn edit_prose(rng: &mut impl Rng) -> (String, String) {
    const SHAPES: [&str; 6] = [
        "The old {} stood at the edge of the {}, and every morning the people of the {} walked past it.",
        "Nobody in the {} remembered who had built the {}, but everyone agreed that the {} was older.",
        "In the evening the light from the {} fell across the {} and reached as far as the {}.",
        "When the storm came, the {} was closed, the {} was flooded and the {} went dark for a week.",
        "Children from the {} liked to play near the {} until the keeper of the {} sent them home.",
        "Every spring a fair was held between the {} and the {}, and traders came from the {}.",
    ];
    let mut text = Vec::new();
    for _ in 0..8 {
        let shape = SHAPES[rng.gen_range(0..SHAPES.len())];
        let mut sentence = String::new();
        for (k, part) in shape.split("{}").enumerate() {
            if k > 0 {
                sentence.push_str(NOUNS[rng.gen_range(0..NOUNS.len())]);
            }
            sentence.push_str(part);
        }
        text.push(sentence);
    }
    let clean = text.join(" ");
    let typo = |w: &str, rng: &mut dyn rand::RngCore| -> String {
        let c: Vec<char> = w.chars().collect();
        if c.len() < 5 || !c.iter().all(|c| c.is_ascii_alphabetic()) {
            return w.to_string();
        }
        let j = 1 + (rng.next_u32() as usize) % (c.len() - 3);
        let mut c = c;
        c.swap(j, j + 1);
        c.into_iter().collect()
    };
    let words: Vec<String> = clean
        .split(' ')
        .enumerate()
        .map(|(k, w)| {
            if k % 5 == 3 {
                typo(w, rng)
            } else {
                w.to_string()
            }
        })
        .collect();
    let ask = format!(
        "Fix the spelling mistakes in this text. Answer with the whole corrected text and nothing else.\n\n{}",
        words.join(" ")
    );
    (ask, clean)
}

/// Tokens of one trace block.
pub const TRACE_BLOCK: usize = 512;

/// One trace line.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// A dataset ready to give sessions. It travels to load agents whole (files already read), all
/// but the tokenizer, which each agent brings.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Dataset {
    spec: DatasetSpec,
    seed: u64,
    vocab: u32,
    /// ShareGPT: (prompt text, output tokens).
    exchanges: Vec<(String, usize)>,
    /// Trace lines, in time order.
    trace: Vec<TraceLine>,
    /// Multi-turn: text of random tokens needs the model's tokenizer.
    #[serde(skip)]
    tokenizer: Option<Tokenizer>,
    /// Whether it was read with a tokenizer (its text then needs one to be the same).
    tokenized: bool,
}

/// What can go wrong reading a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The file could not be read.
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    /// The file's content is not the format.
    #[error("{0}: {1}")]
    Format(PathBuf, String),
}

fn read(path: &Path) -> Result<String, DatasetError> {
    std::fs::read_to_string(path).map_err(|e| DatasetError::Io(path.into(), e))
}

impl Dataset {
    /// Reads the dataset's file, if it has one. `vocab` bounds random token ids (they start at
    /// 100, past the special tokens); `tokenizer` measures ShareGPT answers and writes the text
    /// of multi-turn messages (without it, a word list stands in and lengths are estimates).
    pub fn new(
        spec: DatasetSpec,
        seed: u64,
        vocab: u32,
        tokenizer: Option<Tokenizer>,
    ) -> Result<Self, DatasetError> {
        let mut d = Self {
            spec: spec.clone(),
            seed,
            vocab: vocab.max(101),
            exchanges: Vec::new(),
            trace: Vec::new(),
            tokenized: tokenizer.is_some(),
            tokenizer,
        };
        match &spec {
            DatasetSpec::ShareGpt(path) => d.exchanges = d.read_sharegpt(path)?,
            DatasetSpec::Trace(path) => d.trace = read_trace(path)?,
            _ => {}
        }
        Ok(d)
    }

    fn read_sharegpt(&self, path: &Path) -> Result<Vec<(String, usize)>, DatasetError> {
        let fmt = |m: String| DatasetError::Format(path.into(), m);
        let v: Value =
            serde_json::from_str(&read(path)?).map_err(|e| fmt(format!("not JSON: {e}")))?;
        let entries = v
            .as_array()
            .ok_or_else(|| fmt("a ShareGPT file is a JSON array of conversations".into()))?;
        let mut out = Vec::new();
        for e in entries {
            let turns = e
                .get("conversations")
                .or_else(|| e.get("conversation"))
                .and_then(Value::as_array);
            let Some(turns) = turns else { continue };
            let text = |t: &Value| {
                t.get("value")
                    .or_else(|| t.get("content"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
            };
            let role = |t: &Value| {
                t.get("from")
                    .or_else(|| t.get("role"))
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            let Some(i) = turns
                .iter()
                .position(|t| matches!(role(t).as_str(), "human" | "user"))
            else {
                continue;
            };
            let (Some(q), Some(a)) = (text(&turns[i]), turns.get(i + 1).and_then(text)) else {
                continue;
            };
            let answer = self.count_tokens(&a);
            // As the peers' tools do: skip exchanges too short to time.
            if self.count_tokens(&q) < 4 || answer < 4 {
                continue;
            }
            out.push((q, answer));
        }
        if out.is_empty() {
            return Err(fmt("no conversation with a human turn and an answer".into()));
        }
        Ok(out)
    }

    fn count_tokens(&self, text: &str) -> usize {
        match &self.tokenizer {
            Some(t) => t.encode(text, false).map(|v| v.len()).unwrap_or(0),
            None => text.len().div_ceil(4),
        }
    }

    /// The seed it is drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Gives a dataset that came over the wire the receiver's tokenizer. A dataset whose text
    /// was made with a tokenizer refuses to go on without one (its prompts would differ).
    pub fn with_tokenizer(mut self, tokenizer: Option<Tokenizer>) -> Result<Self, String> {
        // (An edit's answer length is its text counted in the model's tokens.)
        let writes_text = matches!(self.spec, DatasetSpec::MultiTurn { .. } | DatasetSpec::Edit);
        if writes_text && self.tokenized && tokenizer.is_none() {
            return Err(
                "this dataset writes its text with the model's tokenizer: start the agent with --model"
                    .into(),
            );
        }
        self.tokenizer = tokenizer;
        Ok(self)
    }

    /// The same dataset drawn from another seed (its files are not read again).
    pub fn with_seed(&self, seed: u64) -> Self {
        Self {
            seed,
            ..self.clone()
        }
    }

    /// Sessions this dataset holds (`None`: as many as asked for).
    pub fn len(&self) -> Option<usize> {
        match &self.spec {
            DatasetSpec::Trace(_) => Some(self.trace.len()),
            _ => None,
        }
    }

    /// Whether a file-backed dataset is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }

    /// A trace's arrival offsets (from its first line), scaled by `1/speedup`.
    pub fn trace_times(&self, speedup: f64) -> Option<Vec<Duration>> {
        let first = self.trace.first()?.timestamp;
        Some(
            self.trace
                .iter()
                .map(|l| Duration::from_secs_f64((l.timestamp - first) / 1e3 / speedup))
                .collect(),
        )
    }

    fn rng(&self, stream: u64, i: u64) -> ChaCha8Rng {
        let mut r = ChaCha8Rng::seed_from_u64(self.seed ^ stream.rotate_left(32));
        r.set_stream(i);
        r
    }

    fn tokens(&self, rng: &mut impl Rng, n: usize) -> Vec<u32> {
        (0..n).map(|_| rng.gen_range(100..self.vocab)).collect()
    }

    fn text(&self, rng: &mut impl Rng, n: usize) -> String {
        match &self.tokenizer {
            Some(t) => {
                let ids = self.tokens(rng, n);
                t.decode(&ids, true).unwrap_or_default()
            }
            None => {
                const WORDS: [&str; 16] = [
                    "river", "stone", "light", "number", "garden", "signal", "paper", "orbit",
                    "metal", "window", "cloud", "engine", "story", "market", "bridge", "winter",
                ];
                (0..n)
                    .map(|_| WORDS[rng.gen_range(0..WORDS.len())])
                    .collect::<Vec<_>>()
                    .join(" ")
            }
        }
    }

    /// Session `i` (a file-backed dataset wraps around).
    pub fn session(&self, i: usize) -> Session {
        let mut rng = self.rng(1, i as u64);
        let one = |prompt, max_tokens| Session {
            turns: vec![Turn {
                prompt,
                max_tokens,
                ignore_eos: true,
                long: false,
            }],
        };
        match &self.spec {
            DatasetSpec::Random {
                input,
                output,
                long_every,
                long_input,
                long_output,
            } => {
                if *long_every > 0 && i % long_every == long_every - 1 {
                    let prompt = Prompt::Tokens(self.tokens(&mut rng, *long_input));
                    return Session {
                        turns: vec![Turn {
                            prompt,
                            max_tokens: *long_output,
                            ignore_eos: true,
                            long: true,
                        }],
                    };
                }
                let n = input.sample(&mut rng);
                let m = output.sample(&mut rng);
                one(Prompt::Tokens(self.tokens(&mut rng, n)), m)
            }
            DatasetSpec::SharedPrefix {
                prefixes,
                questions,
                prefix_len,
                question_len,
                output,
            } => {
                let (p, q) = ((*prefixes).max(1), (*questions).max(1));
                // Questions go round the prefixes in a shuffled order, the same every run.
                let k = i % (p * q);
                let mut order: Vec<usize> = (0..p * q).collect();
                let mut shuffle = self.rng(2, (i / (p * q)) as u64);
                use rand::seq::SliceRandom;
                order.shuffle(&mut shuffle);
                let pick = order[k];
                let mut prompt = self.tokens(&mut self.rng(3, (pick % p) as u64), *prefix_len);
                let n = question_len.sample(&mut rng);
                prompt.extend(self.tokens(&mut rng, n));
                one(Prompt::Tokens(prompt), output.sample(&mut rng))
            }
            DatasetSpec::MultiTurn {
                turns,
                input,
                output,
            } => Session {
                turns: (0..(*turns).max(1))
                    .map(|_| {
                        let n = input.sample(&mut rng);
                        let content = self.text(&mut rng, n);
                        Turn {
                            prompt: Prompt::Chat(vec![Message {
                                role: "user".into(),
                                content,
                            }]),
                            max_tokens: output.sample(&mut rng),
                            ignore_eos: true,
                            long: false,
                        }
                    })
                    .collect(),
            },
            DatasetSpec::ShareGpt(_) => {
                let (q, a) = &self.exchanges[i % self.exchanges.len()];
                one(
                    Prompt::Chat(vec![Message {
                        role: "user".into(),
                        content: q.clone(),
                    }]),
                    *a,
                )
            }
            DatasetSpec::Edit => {
                let (ask, answer) = match rng.gen_bool(0.5) {
                    true => edit_code(&mut rng),
                    false => edit_prose(&mut rng),
                };
                // Room for the answer and a tenth more; the answer ends where the model ends
                // it: past its end of sequence a model writes what no user receives, text that
                // repeats little (on the default model a quarter of the tokens of a run that
                // ignored it).
                let tokens = self.count_tokens(&answer);
                let mut session = one(
                    Prompt::Chat(vec![Message {
                        role: "user".into(),
                        content: ask,
                    }]),
                    tokens + tokens / 10,
                );
                session.turns[0].ignore_eos = false;
                session
            }
            DatasetSpec::Story { output } => {
                const KINDS: [&str; 6] = [
                    "a long story",
                    "a fairy tale",
                    "an adventure story",
                    "a mystery story",
                    "a story for children",
                    "a sad story",
                ];
                let kind = KINDS[rng.gen_range(0..KINDS.len())];
                let (a, b) = (
                    NOUNS[rng.gen_range(0..NOUNS.len())],
                    NOUNS[rng.gen_range(0..NOUNS.len())],
                );
                let content = format!("Write {kind} about a {a} and a {b}.");
                one(
                    Prompt::Chat(vec![Message {
                        role: "user".into(),
                        content,
                    }]),
                    output.sample(&mut rng),
                )
            }
            DatasetSpec::Trace(_) => {
                let line = &self.trace[i % self.trace.len()];
                let mut prompt = Vec::with_capacity(line.input_length);
                for &h in &line.hash_ids {
                    if prompt.len() >= line.input_length {
                        break;
                    }
                    let block = self.tokens(&mut self.rng(4, h), TRACE_BLOCK);
                    prompt.extend(block);
                }
                prompt.truncate(line.input_length);
                let rest = line.input_length - prompt.len();
                prompt.extend(self.tokens(&mut rng, rest));
                one(Prompt::Tokens(prompt), line.output_length.max(1))
            }
        }
    }
}

fn read_trace(path: &Path) -> Result<Vec<TraceLine>, DatasetError> {
    let mut out = Vec::new();
    for (n, line) in read(path)?.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: TraceLine = serde_json::from_str(line)
            .map_err(|e| DatasetError::Format(path.into(), format!("line {}: {e}", n + 1)))?;
        out.push(l);
    }
    if out.is_empty() {
        return Err(DatasetError::Format(path.into(), "no lines".into()));
    }
    out.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(s: &Session) -> &[u32] {
        match &s.turns[0].prompt {
            Prompt::Tokens(t) => t,
            p => panic!("{p:?}"),
        }
    }

    fn chat(s: &Session) -> &str {
        match &s.turns[0].prompt {
            Prompt::Chat(m) => &m[0].content,
            p => panic!("{p:?}"),
        }
    }

    /// Edits hold the text they ask back (code whose renamed name recurs, or a paragraph with
    /// some words misspelt) and ask for as many tokens as it has and a tenth; stories ask for
    /// the drawn length and hold nothing to repeat. Both are the same for the same seed.
    #[test]
    fn edits_hold_what_they_ask_back_and_stories_do_not() {
        let edits = Dataset::new(DatasetSpec::Edit, 3, 1000, None).unwrap();
        assert_eq!(edits.session(5), edits.with_seed(3).session(5));
        let (mut code, mut prose) = (0, 0);
        for i in 0..40 {
            let s = edits.session(i);
            let ask = chat(&s);
            if let Some((_, rest)) = ask.split_once("```python\n") {
                code += 1;
                let body = rest.strip_suffix("```").unwrap();
                let old = ask.split('`').nth(1).unwrap();
                assert!(body.matches(old).count() >= 8, "{ask}");
                let tokens = body.len().div_ceil(4);
                assert_eq!(s.turns[0].max_tokens, tokens + tokens / 10);
                assert!(!s.turns[0].ignore_eos);
            } else {
                prose += 1;
                let text = ask.split_once("\n\n").unwrap().1;
                assert!(text.split(' ').count() > 100, "{text}");
                assert!(s.turns[0].max_tokens > text.len() / 5);
                assert!(!s.turns[0].ignore_eos);
            }
        }
        assert!(code > 10 && prose > 10, "{code} code, {prose} prose");
        let stories = Dataset::new(
            DatasetSpec::Story {
                output: LenDist::Fixed(96),
            },
            3,
            1000,
            None,
        )
        .unwrap();
        for i in 0..10 {
            let s = stories.session(i);
            assert!(chat(&s).starts_with("Write ") && chat(&s).len() < 80);
            assert_eq!(s.turns[0].max_tokens, 96);
            assert!(s.turns[0].ignore_eos);
        }
    }

    #[test]
    fn lengths_parse_and_draw_in_range() {
        assert_eq!("200".parse(), Ok(LenDist::Fixed(200)));
        assert_eq!("10-20".parse(), Ok(LenDist::Uniform(10, 20)));
        assert_eq!("normal:100:5".parse(), Ok(LenDist::Normal(100.0, 5.0)));
        for bad in ["0", "20-10", "x", "normal:1", "normal:-3:1"] {
            assert!(bad.parse::<LenDist>().is_err(), "{bad}");
        }
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let d = LenDist::Uniform(10, 20);
        let xs: Vec<usize> = (0..1000).map(|_| d.sample(&mut rng)).collect();
        assert!(xs.iter().all(|&x| (10..=20).contains(&x)));
        assert!(xs.contains(&10) && xs.contains(&20));
    }

    #[test]
    fn random_sessions_are_deterministic_and_sized() {
        let spec = DatasetSpec::Random {
            input: LenDist::Uniform(5, 9),
            output: LenDist::Fixed(7),
            long_every: 0,
            long_input: 0,
            long_output: 0,
        };
        let a = Dataset::new(spec.clone(), 1, 1000, None).unwrap();
        let b = Dataset::new(spec.clone(), 1, 1000, None).unwrap();
        let c = Dataset::new(spec, 2, 1000, None).unwrap();
        assert_eq!(a.session(3), b.session(3));
        assert_ne!(a.session(3), c.session(3));
        assert_ne!(a.session(3), a.session(4));
        for i in 0..50 {
            let s = a.session(i);
            assert!((5..=9).contains(&tokens(&s).len()));
            assert!(tokens(&s).iter().all(|&t| (100..1000).contains(&t)));
            assert_eq!(s.turns[0].max_tokens, 7);
        }
        let mixed = DatasetSpec::Random {
            input: LenDist::Fixed(5),
            output: LenDist::Fixed(7),
            long_every: 3,
            long_input: 50,
            long_output: 2,
        };
        let d = Dataset::new(mixed, 1, 1000, None).unwrap();
        let longs: Vec<bool> = (0..6).map(|i| d.session(i).turns[0].long).collect();
        assert_eq!(longs, [false, false, true, false, false, true]);
        assert_eq!(tokens(&d.session(2)).len(), 50);
        assert_eq!(d.session(2).turns[0].max_tokens, 2);
    }

    #[test]
    fn shared_prefix_sessions_share_exactly_their_prefixes() {
        let spec = DatasetSpec::SharedPrefix {
            prefixes: 3,
            questions: 4,
            prefix_len: 32,
            question_len: LenDist::Fixed(8),
            output: LenDist::Fixed(4),
        };
        let d = Dataset::new(spec, 0, 5000, None).unwrap();
        let prefixes: Vec<Vec<u32>> = (0..12)
            .map(|i| tokens(&d.session(i))[..32].to_vec())
            .collect();
        let mut distinct = prefixes.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 3, "three system prompts");
        for p in &distinct {
            assert_eq!(
                prefixes.iter().filter(|q| q == &p).count(),
                4,
                "four questions each"
            );
        }
        assert_eq!(tokens(&d.session(0)).len(), 40);
    }

    #[test]
    fn datasets_travel_whole_and_text_needs_the_same_tokenizer() {
        let spec = DatasetSpec::MultiTurn {
            turns: 2,
            input: LenDist::Fixed(3),
            output: LenDist::Fixed(4),
        };
        let d = Dataset::new(spec, 7, 5000, None).unwrap();
        let wire = serde_json::to_string(&d).unwrap();
        let back: Dataset = serde_json::from_str(&wire).unwrap();
        let back = back.with_tokenizer(None).unwrap();
        assert_eq!(back.session(3), d.session(3));
        assert_eq!(back.with_seed(9).seed(), 9);
        // Made with a tokenizer, it refuses to run without one.
        let mut tokenized: Dataset = serde_json::from_str(&wire).unwrap();
        tokenized.tokenized = true;
        let e = tokenized.with_tokenizer(None).unwrap_err();
        assert!(e.contains("--model"), "{e}");
    }

    #[test]
    fn multi_turn_sessions_have_their_turns() {
        let spec = DatasetSpec::MultiTurn {
            turns: 3,
            input: LenDist::Fixed(5),
            output: LenDist::Fixed(6),
        };
        let s = Dataset::new(spec, 0, 5000, None).unwrap().session(0);
        assert_eq!(s.turns.len(), 3);
        for t in &s.turns {
            let Prompt::Chat(m) = &t.prompt else { panic!() };
            assert_eq!(m[0].role, "user");
            assert_eq!(m[0].content.split(' ').count(), 5);
            assert_eq!(t.max_tokens, 6);
        }
    }

    #[test]
    fn sharegpt_files_give_first_exchanges() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("sg.json");
        std::fs::write(
            &f,
            r#"[{"id":"a","conversations":[{"from":"human","value":"tell me about the sea and its tides"},{"from":"gpt","value":"the sea rises and falls twice a day because of the moon"}]},
               {"id":"b","conversations":[{"from":"gpt","value":"only an answer"}]},
               {"id":"c","conversations":[{"from":"human","value":"hi"},{"from":"gpt","value":"hello"}]}]"#,
        )
        .unwrap();
        let d = Dataset::new(DatasetSpec::ShareGpt(f.clone()), 0, 1000, None).unwrap();
        let s = d.session(5);
        let Prompt::Chat(m) = &s.turns[0].prompt else {
            panic!()
        };
        assert_eq!(m[0].content, "tell me about the sea and its tides");
        // Without a tokenizer: a quarter of the characters.
        assert_eq!(s.turns[0].max_tokens, 55usize.div_ceil(4));
        std::fs::write(&f, "{}").unwrap();
        let e = Dataset::new(DatasetSpec::ShareGpt(f), 0, 1000, None).unwrap_err();
        assert!(e.to_string().contains("JSON array"), "{e}");
    }

    #[test]
    fn traces_give_times_and_shared_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("t.jsonl");
        std::fs::write(
            &f,
            "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 1500, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [1, 3]}\n",
        )
        .unwrap();
        let d = Dataset::new(DatasetSpec::Trace(f.clone()), 0, 5000, None).unwrap();
        assert_eq!(d.len(), Some(2));
        assert_eq!(
            d.trace_times(1.0).unwrap(),
            vec![Duration::ZERO, Duration::from_millis(500)]
        );
        assert_eq!(d.trace_times(2.0).unwrap()[1], Duration::from_millis(250));
        let (a, b) = (d.session(0), d.session(1));
        assert_eq!(tokens(&a).len(), 600);
        assert_eq!(tokens(&b).len(), 700);
        assert_eq!(tokens(&a)[..512], tokens(&b)[..512], "block 1 is shared");
        assert_ne!(tokens(&a)[512..600], tokens(&b)[512..600]);
        assert_eq!(b.turns[0].max_tokens, 3);
        std::fs::write(&f, "{\"timestamp\": 1}\n").unwrap();
        let e = Dataset::new(DatasetSpec::Trace(f), 0, 5000, None).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
    }
}
