//! Reasoning split out of the answer, for models that think in `<think>...</think>` before
//! they answer (Qwen3, DeepSeek-R1): what is inside the tags is the reasoning (chat's
//! `reasoning_content`, a Responses reasoning item, a Messages `thinking` block), what follows
//! is the answer (where tool calls are then looked for).
//!
//! The output opens the thought with `<think>` (Qwen3), or the prompt already did (a template
//! whose generation prompt ends with `<think>`: DeepSeek-R1's, Qwen3's thinking-only models):
//! then the output starts inside it. An output that does not open with `<think>` is all answer
//! (Qwen3 with `enable_thinking: false`, whose prompt holds an empty thought). A thought cut
//! short (by `max_tokens`) stays reasoning. Newlines next to the tags are the template's
//! layout, not text: dropped. Text is released as soon as it cannot be part of a tag.

use crate::dispatch::Dispatcher;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// Nothing released yet: the output may still open with `<think>`.
    Start,
    /// Inside the thought (`started`: reasoning text has been released).
    Thinking { started: bool },
    /// The answer (`started`: answer text has been released).
    Answer { started: bool },
}

/// Splits one output's text, as it streams, into reasoning and answer.
pub(super) struct ThinkSplitter {
    state: State,
    /// Text not released yet: a possible tag's start, or newlines that may precede one.
    held: String,
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl ThinkSplitter {
    /// A splitter for an output that starts inside the thought (`in_thought`: the prompt
    /// opened it) or may open one.
    pub(super) fn new(in_thought: bool) -> Self {
        Self {
            state: if in_thought {
                State::Thinking { started: false }
            } else {
                State::Start
            },
            held: String::new(),
        }
    }

    /// Whether the output is still inside its thought.
    pub(super) fn thinking(&self) -> bool {
        matches!(self.state, State::Thinking { .. })
    }

    /// Drops the newlines the held text starts with (the template's layout next to a tag);
    /// whether any text is left.
    fn past_newlines(&mut self) -> bool {
        let t = self.held.trim_start_matches('\n');
        self.held = t.to_string();
        !self.held.is_empty()
    }

    /// Takes the next piece of the output: the reasoning and the answer text it releases.
    pub(super) fn push(&mut self, piece: &str) -> (String, String) {
        self.held.push_str(piece);
        let (mut reasoning, mut answer) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking { started: false };
                    } else if OPEN.starts_with(t) {
                        return (reasoning, answer);
                    } else {
                        self.state = State::Answer { started: false };
                    }
                }
                State::Thinking { started } => {
                    if !started {
                        if !self.past_newlines() {
                            return (reasoning, answer);
                        }
                        self.state = State::Thinking { started: true };
                    }
                    if let Some(i) = self.held.find(CLOSE) {
                        reasoning.push_str(self.held[..i].trim_end_matches('\n'));
                        self.held = self.held[i + CLOSE.len()..].to_string();
                        self.state = State::Answer { started: false };
                        continue;
                    }
                    // Release all but a possible `</think>` start and the newlines before it.
                    let keep = partial_tag(&self.held, CLOSE);
                    let body = &self.held[..self.held.len() - keep];
                    let cut = body.trim_end_matches('\n').len();
                    reasoning.push_str(&self.held[..cut]);
                    self.held = self.held[cut..].to_string();
                    return (reasoning, answer);
                }
                State::Answer { started } => {
                    if !started {
                        if !self.past_newlines() {
                            return (reasoning, answer);
                        }
                        self.state = State::Answer { started: true };
                    }
                    answer.push_str(&self.held);
                    self.held.clear();
                    return (reasoning, answer);
                }
            }
        }
    }

    /// [`ThinkSplitter::push`], then (`last`: the output ends with this piece)
    /// [`ThinkSplitter::finish`]: what the piece releases.
    pub(super) fn feed(&mut self, piece: &str, last: bool) -> (String, String) {
        let (mut r, mut a) = self.push(piece);
        if last {
            let (r2, a2) = self.finish();
            r.push_str(&r2);
            a.push_str(&a2);
        }
        (r, a)
    }

    /// The output has ended: what is still held, released (an unfinished thought is
    /// reasoning; text that never opened one is answer).
    pub(super) fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start => (String::new(), held),
            State::Thinking { .. } => (held.trim_end_matches('\n').to_string(), String::new()),
            State::Answer { .. } => (String::new(), held),
        }
    }
}

/// A whole output split into its reasoning and its answer.
pub(super) fn split_reasoning(text: &str, in_thought: bool) -> (String, String) {
    ThinkSplitter::new(in_thought).feed(text, true)
}

/// Whether a prompt leaves the output inside a thought: the template's generation prompt
/// ended with `<think>` (and no `</think>` after it).
pub(super) fn starts_in_thought(d: &Dispatcher, prompt: &[u32]) -> bool {
    let tail = &prompt[prompt.len().saturating_sub(16)..];
    let text = d
        .model
        .text
        .tokenizer
        .decode(tail, false)
        .unwrap_or_default();
    text.trim_end().ends_with(OPEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `out` streamed in pieces of every size gives what it gives whole.
    fn streams_like_whole(out: &str, in_thought: bool) -> (String, String) {
        let whole = split_reasoning(out, in_thought);
        let chars: Vec<char> = out.chars().collect();
        for step in 1..=9 {
            let mut s = ThinkSplitter::new(in_thought);
            let (mut r, mut a) = (String::new(), String::new());
            for piece in chars.chunks(step) {
                let (pr, pa) = s.push(&piece.iter().collect::<String>());
                r.push_str(&pr);
                a.push_str(&pa);
            }
            let (pr, pa) = s.finish();
            r.push_str(&pr);
            a.push_str(&pa);
            assert_eq!((&r, &a), (&whole.0, &whole.1), "step {step} of {out:?}");
        }
        whole
    }

    fn pair(r: &str, a: &str) -> (String, String) {
        (r.to_string(), a.to_string())
    }

    #[test]
    fn thoughts_split_from_answers_streamed_or_whole() {
        // Qwen3: the output opens the thought.
        assert_eq!(
            streams_like_whole("<think>\nLet me see.\n2+2=4\n</think>\n\nIt is 4.", false),
            pair("Let me see.\n2+2=4", "It is 4.")
        );
        // DeepSeek-R1: the prompt opened it.
        assert_eq!(
            streams_like_whole("Hm, <b>bold</b>.\n</think>\n\nYes.", true),
            pair("Hm, <b>bold</b>.", "Yes.")
        );
        // Thinking off: no tags, all answer (a `<` that is not a tag included).
        assert_eq!(
            streams_like_whole("a < b, <thin> is not it", false),
            pair("", "a < b, <thin> is not it")
        );
        // Cut short inside the thought: all reasoning.
        assert_eq!(
            streams_like_whole("<think>\nstill going </thi", false),
            pair("still going </thi", "")
        );
        // An empty thought, and newlines inside the answer kept.
        assert_eq!(
            streams_like_whole("<think>\n\n</think>\n\nline 1\n\nline 2\n", false),
            pair("", "line 1\n\nline 2\n")
        );
        // Text before a late `<think>` is answer, and the tag stays in it.
        assert_eq!(
            streams_like_whole("Sure. <think>no</think>", false),
            pair("", "Sure. <think>no</think>")
        );
        // Multi-byte text next to a partial tag.
        assert_eq!(
            streams_like_whole("<think>né</think>é<", false),
            pair("né", "é<")
        );
        assert_eq!(streams_like_whole("", false), pair("", ""));
        assert_eq!(streams_like_whole("<thi", false), pair("", "<thi"));
    }
}
