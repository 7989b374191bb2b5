//! Tool calling: OpenAI's `tools` and `tool_choice` on the way in, the model's calls parsed into
//! `tool_calls` on the way out.
//!
//! The model writes a call as Hermes-style models (Qwen 2.5 and 3, Hermes, many fine-tunes) do:
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A chat template that renders a
//! `tools` list itself gets the tools as HF passes them; for one that does not, the tools are
//! described in the system message in that same format, an assistant's earlier calls are written
//! back as those blocks and tool results as `<tool_response>` turns. `tool_choice: "required"` or
//! a named function is enforced by the grammar engine: the output is one call (or several, with
//! `parallel_tool_calls: true`) whose arguments validate against the function's schema.

use serde_json::{json, Value};
use tandem_model::{ChatMessage, ToolCallStyle};
use tandem_types::Grammar;

use crate::error::ApiError;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// What a request lets the model call.
pub(super) struct Tools {
    defs: Vec<ToolDef>,
    choice: ToolChoice,
    parallel: bool,
}

struct ToolDef {
    name: String,
    parameters: Value,
    /// The request's entry, `{"type": "function", "function": {...}}`, as templates take it.
    entry: Value,
}

#[derive(Clone, PartialEq, Eq, Debug)]
enum ToolChoice {
    Auto,
    Required,
    Named(String),
}

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::invalid(message, param)
}

impl Tools {
    /// The request's tools, or none when it has none or says `tool_choice: "none"`. Refuses a
    /// tool that is not a named function, a choice that names no given tool, and a choice without
    /// tools.
    pub(super) fn parse(
        tools: Option<&[Value]>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => return Ok(None),
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(bad(
                        format!("tool_choice {other:?} is not none, auto, required or a function"),
                        "tool_choice",
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        bad(
                            "tool_choice names a function as {\"type\": \"function\", \"function\": {\"name\": ...}}",
                            "tool_choice",
                        )
                    })?;
                ToolChoice::Named(name.to_string())
            }
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::Auto => Ok(None),
                _ => Err(bad("tool_choice needs tools to choose from", "tool_choice")),
            };
        }
        let mut defs = Vec::with_capacity(tools.len());
        for t in tools {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("each tool is {\"type\": \"function\", ...}", "tools"));
            }
            let f = t
                .get("function")
                .ok_or_else(|| bad("a tool needs its \"function\"", "tools"))?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            let valid = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !valid {
                return Err(bad(
                    format!("tool name {name:?} must be 1 to 64 of a-z, A-Z, 0-9, _ and -"),
                    "tools",
                ));
            }
            if defs.iter().any(|d: &ToolDef| d.name == name) {
                return Err(bad(format!("two tools are named {name:?}"), "tools"));
            }
            let parameters = f
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            if !parameters.is_object() {
                return Err(bad(
                    format!("tool {name:?}: parameters must be a JSON Schema object"),
                    "tools",
                ));
            }
            defs.push(ToolDef {
                name: name.to_string(),
                parameters,
                entry: t.clone(),
            });
        }
        if let ToolChoice::Named(n) = &choice {
            if !defs.iter().any(|d| &d.name == n) {
                return Err(bad(
                    format!("tool_choice names {n:?}, which is not among the tools"),
                    "tool_choice",
                ));
            }
        }
        Ok(Some(Self {
            defs,
            choice,
            parallel: parallel.unwrap_or(false),
        }))
    }

    /// The tools as the chat template takes them.
    pub(super) fn entries(&self) -> Vec<Value> {
        self.defs.iter().map(|d| d.entry.clone()).collect()
    }

    /// For `required` or a named function: the grammar that makes the output calls (one, or one
    /// or more with `parallel_tool_calls`) whose arguments validate against their schemas.
    pub(super) fn grammar(&self) -> Option<Grammar> {
        let allowed: Vec<&ToolDef> = match &self.choice {
            ToolChoice::Auto => return None,
            ToolChoice::Required => self.defs.iter().collect(),
            ToolChoice::Named(n) => self.defs.iter().filter(|d| &d.name == n).collect(),
        };
        let calls: Vec<Value> = allowed
            .iter()
            .map(|d| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": d.name}, "arguments": d.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = json!({
            "anyOf": calls,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        let more = if self.parallel {
            " (\"\\n\" call)*"
        } else {
            ""
        };
        Some(Grammar::Lark(format!(
            "start: call{more}\ncall: {open} %json {schema} {close}",
            open = serde_json::to_string(&format!("{OPEN}\n")).expect("a string"),
            close = serde_json::to_string(&format!("\n{CLOSE}")).expect("a string"),
        )))
    }

    /// The tools described for a model whose template does not render them: a system message
    /// in the format the parser reads back.
    pub(super) fn describe(&self) -> String {
        let mut s = String::from(
            "You may call functions to help with the user's request. The functions are listed \
             in <tools></tools> as JSON signatures.\n<tools>\n",
        );
        for d in &self.defs {
            s.push_str(&d.entry.get("function").unwrap_or(&d.entry).to_string());
            s.push('\n');
        }
        s.push_str(
            "</tools>\nTo call a function, write a JSON object with its name and arguments \
             inside <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \
             \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }
}

/// An assistant message's `tool_calls` from the API (arguments as a JSON string) in the shape
/// HF templates render (arguments as an object).
pub(super) fn calls_for_template(calls: &[Value]) -> Result<Vec<Value>, ApiError> {
    calls
        .iter()
        .map(|c| {
            let f = c
                .get("function")
                .ok_or_else(|| bad("a tool call needs its \"function\"", "messages"))?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or("");
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => {
                    serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                }
                Some(v) => v.clone(),
                None => json!({}),
            };
            Ok(json!({
                "id": c.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }))
        })
        .collect()
}

/// The conversation for a template that does not render tools: the tools described in the
/// system message (when the request has any), earlier calls written out as `<tool_call>`
/// blocks, tool results as user turns in `<tool_response>`.
pub(super) fn without_tool_support(
    mut messages: Vec<ChatMessage>,
    tools: Option<&Tools>,
) -> Vec<ChatMessage> {
    if let Some(t) = tools {
        let described = t.describe();
        match messages.first_mut() {
            Some(m) if m.role == "system" || m.role == "developer" => {
                m.content = format!("{}\n\n{described}", m.content);
            }
            _ => messages.insert(
                0,
                ChatMessage {
                    role: "system".into(),
                    content: described,
                    ..Default::default()
                },
            ),
        }
    }
    messages
        .into_iter()
        .map(|mut m| {
            if let Some(calls) = m.tool_calls.take() {
                for c in calls {
                    let f = &c["function"];
                    let call = json!({"name": f["name"], "arguments": f["arguments"]});
                    if !m.content.is_empty() {
                        m.content.push('\n');
                    }
                    m.content.push_str(&format!("{OPEN}\n{call}\n{CLOSE}"));
                }
            }
            if m.role == "tool" {
                m.role = "user".into();
                m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
                m.tool_call_id = None;
            }
            m
        })
        .collect()
}

/// One call the model made.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct ToolCall {
    pub(super) id: String,
    pub(super) name: String,
    /// The arguments as a JSON string (OpenAI's shape).
    pub(super) arguments: String,
}

impl ToolCall {
    /// The call in a message's `tool_calls`, or in a streamed delta (with `index`).
    pub(super) fn json(&self, index: Option<usize>) -> Value {
        let mut v = json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        });
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

/// Mistral's mark before its list of calls.
const MISTRAL: &str = "[TOOL_CALLS]";
/// Llama 3.1's mark before a call (gone from the text where special tokens are skipped).
const PYTHON_TAG: &str = "<|python_tag|>";

/// Splits a model's output into text and tool calls as it streams, in the model's style
/// ([`ToolCallStyle`]). Hermes: text is released as soon as it cannot be the start of a
/// `<tool_call>`, a call once its block closes. Mistral: text until `[TOOL_CALLS]`, then the
/// list of calls, parsed at the end. Llama 3.1 JSON: an output that starts as a JSON object
/// (or with `<|python_tag|>`) is held and parsed at the end, any other is text. What does not
/// parse as calls (not JSON, no name) is released as text: nothing the model wrote is lost.
pub(super) struct CallParser {
    /// Text not yet released: a possible start of a block, or an open block.
    held: String,
    calls: usize,
    id_base: String,
    style: ToolCallStyle,
    /// Mistral and Llama: the rest of the output is calls, held to its end.
    capturing: bool,
    /// Llama: the output was found to be text.
    text_only: bool,
}

impl CallParser {
    /// A parser for one choice of a model that writes calls in `style`; call ids are
    /// `call_<request>_<n>`.
    pub(super) fn new(request_id: &str, choice: usize, style: ToolCallStyle) -> Self {
        Self {
            held: String::new(),
            calls: 0,
            id_base: format!("call_{}_{choice}", request_id.replace(['-', '.'], "")),
            style,
            capturing: false,
            text_only: false,
        }
    }

    /// The longest tail of what is held that could still become `mark`: kept back.
    fn hold_back(&mut self, mark: &str) -> String {
        let keep = (1..mark.len())
            .rev()
            .find(|&k| {
                self.held.len() >= k
                    && self.held.is_char_boundary(self.held.len() - k)
                    && mark.starts_with(&self.held[self.held.len() - k..])
            })
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        self.held.drain(..cut).collect()
    }

    /// [`CallParser::push`] for the styles whose calls run to the end of the output.
    fn push_trailing(&mut self) -> String {
        if self.capturing {
            return String::new();
        }
        match self.style {
            ToolCallStyle::Mistral => match self.held.find(MISTRAL) {
                Some(at) => {
                    let text = self.held[..at].trim_end().to_string();
                    self.held.drain(..at + MISTRAL.len());
                    self.capturing = true;
                    text
                }
                None => self.hold_back(MISTRAL),
            },
            _ if self.text_only => std::mem::take(&mut self.held),
            _ => {
                let start = self.held.trim_start();
                if start.is_empty() || PYTHON_TAG.starts_with(start) {
                    String::new()
                } else if start.starts_with('{') || start.starts_with(PYTHON_TAG) {
                    self.capturing = true;
                    String::new()
                } else {
                    self.text_only = true;
                    std::mem::take(&mut self.held)
                }
            }
        }
    }

    /// The calls a Mistral list or Llama JSON objects hold; None where any does not parse.
    fn trailing_calls(&mut self, body: &str) -> Option<Vec<ToolCall>> {
        let mut values = Vec::new();
        let mut rest = body.trim_start().trim_start_matches(PYTHON_TAG);
        loop {
            rest = rest.trim_start().trim_start_matches(';').trim_start();
            if rest.is_empty() {
                break;
            }
            let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
            let v = it.next()?.ok()?;
            rest = &rest[it.byte_offset()..];
            match v {
                Value::Array(a) => values.extend(a),
                v => values.push(v),
            }
        }
        let first = self.calls;
        let calls: Option<Vec<ToolCall>> =
            values.iter().map(|v| self.call(&v.to_string())).collect();
        if calls.is_none() {
            self.calls = first;
        }
        calls.filter(|c| !c.is_empty())
    }

    /// Calls made so far.
    pub(super) fn calls(&self) -> usize {
        self.calls
    }

    /// Takes a piece of output; returns the text and the calls it completes.
    pub(super) fn push(&mut self, piece: &str) -> (String, Vec<ToolCall>) {
        self.held.push_str(piece);
        if self.style != ToolCallStyle::Hermes {
            return (self.push_trailing(), Vec::new());
        }
        let mut text = String::new();
        let mut calls = Vec::new();
        loop {
            match self.held.find(OPEN) {
                Some(start) => {
                    text.push_str(&self.held[..start]);
                    let body_at = start + OPEN.len();
                    let Some(end) = self.held[body_at..].find(CLOSE) else {
                        self.held.drain(..start);
                        break;
                    };
                    let body = self.held[body_at..body_at + end].to_string();
                    let whole = self.held[start..body_at + end + CLOSE.len()].to_string();
                    self.held.drain(..body_at + end + CLOSE.len());
                    match self.call(&body) {
                        Some(c) => {
                            // The whitespace that separates blocks is not text.
                            let kept = text.trim_end().len();
                            text.truncate(kept);
                            calls.push(c);
                        }
                        None => text.push_str(&whole),
                    }
                }
                None => {
                    // Keep back the longest tail that could still become "<tool_call>".
                    text.push_str(&self.hold_back(OPEN));
                    break;
                }
            }
        }
        if self.calls > 0 && calls.is_empty() && text.trim().is_empty() {
            text.clear();
        }
        (text, calls)
    }

    /// The end of the output: the calls a Mistral list or Llama JSON held to the end makes;
    /// whatever else is held (an unclosed block, what did not parse) is text.
    pub(super) fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        if !self.capturing {
            return (held, Vec::new());
        }
        self.capturing = false;
        match self.trailing_calls(&held) {
            Some(calls) => (String::new(), calls),
            None if self.style == ToolCallStyle::Mistral => {
                (format!("{MISTRAL}{held}"), Vec::new())
            }
            None => (held, Vec::new()),
        }
    }

    fn call(&mut self, body: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            Some(Value::String(s)) => s.clone(),
            Some(a) => a.to_string(),
            None => "{}".into(),
        };
        let id = format!("{}_{}", self.id_base, self.calls);
        self.calls += 1;
        Some(ToolCall {
            id,
            name,
            arguments,
        })
    }
}

/// A whole output in `style` split into its text (none when only whitespace is left) and its
/// calls.
pub(super) fn split_calls(
    request_id: &str,
    text: &str,
    style: ToolCallStyle,
) -> (Option<String>, Vec<ToolCall>) {
    let mut p = CallParser::new(request_id, 0, style);
    let (mut out, mut calls) = p.push(text);
    let (rest, more) = p.finish();
    out.push_str(&rest);
    calls.extend(more);
    let content = (!out.trim().is_empty()).then(|| out.trim().to_string());
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `out` streamed in pieces of every size in `steps` gives what it gives whole.
    fn streams_like_whole(out: &str, style: ToolCallStyle) -> (Option<String>, Vec<ToolCall>) {
        let whole = split_calls("r-1", out, style);
        for step in [1, 2, 3, 7] {
            let mut p = CallParser::new("r-1", 0, style);
            let (mut text, mut got) = (String::new(), Vec::new());
            let chars: Vec<char> = out.chars().collect();
            for piece in chars.chunks(step) {
                let (t, c) = p.push(&piece.iter().collect::<String>());
                text.push_str(&t);
                got.extend(c);
            }
            let (t, c) = p.finish();
            text.push_str(&t);
            got.extend(c);
            let text = (!text.trim().is_empty()).then(|| text.trim().to_string());
            assert_eq!((text, got), whole, "{style:?} step {step}");
        }
        whole
    }

    /// The two calls every style's test output makes.
    fn two_calls(calls: &[ToolCall]) {
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].arguments).unwrap(),
            json!({"city": "Paris"})
        );
        assert_eq!(
            (calls[1].name.as_str(), calls[1].arguments.as_str()),
            ("time", "{}")
        );
        assert_ne!(calls[0].id, calls[1].id);
    }

    #[test]
    fn calls_are_parsed_out_of_text_in_any_split() {
        let out = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = streams_like_whole(out, ToolCallStyle::Hermes);
        assert_eq!(content.as_deref(), Some("Let me check."));
        two_calls(&calls);
    }

    /// Mistral's `[TOOL_CALLS]` list and Llama 3.1's JSON objects (with or without the
    /// python tag, `;` between them) are calls, streamed or whole; text before Mistral's mark
    /// is text; what does not parse, or is not at the start of a Llama output, stays text.
    #[test]
    fn each_family_s_calls_are_parsed_in_any_split() {
        let mistral = "Checking. [TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"time\", \"arguments\": {}}]";
        let (content, calls) = streams_like_whole(mistral, ToolCallStyle::Mistral);
        assert_eq!(content.as_deref(), Some("Checking."));
        two_calls(&calls);
        for llama in [
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"time\", \"parameters\": {}}",
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\n{\"name\": \"time\", \"parameters\": {}}",
        ] {
            let (content, calls) = streams_like_whole(llama, ToolCallStyle::Llama3Json);
            assert_eq!(content, None, "{llama}");
            two_calls(&calls);
        }
        for (style, text) in [
            (ToolCallStyle::Mistral, "[TOOL_CALLS] not json"),
            (ToolCallStyle::Mistral, "plain answer [TOOL"),
            (ToolCallStyle::Llama3Json, "{\"not\": \"a call\"}"),
            (ToolCallStyle::Llama3Json, "The answer is {\"name\": \"x\"}"),
            (ToolCallStyle::Llama3Json, "  "),
        ] {
            let (content, calls) = streams_like_whole(text, style);
            assert!(calls.is_empty(), "{style:?} {text}");
            assert_eq!(
                content.as_deref(),
                Some(text.trim()).filter(|t| !t.is_empty())
            );
        }
    }

    #[test]
    fn text_that_is_not_a_call_is_kept() {
        let hermes = ToolCallStyle::Hermes;
        let (content, calls) = split_calls(
            "r",
            "a < b and <tool_call>not json</tool_call> <tool",
            hermes,
        );
        assert!(calls.is_empty());
        assert_eq!(
            content.as_deref(),
            Some("a < b and <tool_call>not json</tool_call> <tool")
        );
        let (content, calls) = split_calls("r", "plain answer", hermes);
        assert_eq!((content.as_deref(), calls.len()), (Some("plain answer"), 0));
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}])
    }

    #[test]
    fn choices_are_checked_and_required_ones_get_a_grammar() {
        let t = weather();
        let tools = t.as_array().unwrap();
        assert!(Tools::parse(Some(tools), Some(&json!("none")), None)
            .unwrap()
            .is_none());
        let auto = Tools::parse(Some(tools), None, None).unwrap().unwrap();
        assert!(auto.grammar().is_none());
        assert!(auto.describe().contains("get_weather"));
        let req = Tools::parse(Some(tools), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        let Some(Grammar::Lark(g)) = req.grammar() else {
            panic!("a Lark grammar")
        };
        assert!(g.contains("%json") && g.contains("get_weather") && !g.contains(")*"));
        let named = json!({"type": "function", "function": {"name": "nope"}});
        assert!(Tools::parse(Some(tools), Some(&named), None).is_err());
        assert!(Tools::parse(None, Some(&json!("required")), None).is_err());
        assert!(Tools::parse(Some(tools), Some(&json!("sometimes")), None).is_err());
        let unnamed = [json!({"type": "function", "function": {"name": "a b"}})];
        assert!(Tools::parse(Some(&unnamed), None, None).is_err());
    }

    #[test]
    fn a_template_without_tools_reads_them_in_the_conversation() {
        let t = weather();
        let tools = Tools::parse(Some(t.as_array().unwrap()), None, None)
            .unwrap()
            .unwrap();
        let calls = calls_for_template(&[json!({"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}})])
        .unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Oslo"}));
        let msgs = vec![
            ChatMessage {
                role: "user".into(),
                content: "weather?".into(),
                ..Default::default()
            },
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(calls),
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "sunny".into(),
                tool_call_id: Some("c1".into()),
                ..Default::default()
            },
        ];
        let out = without_tool_support(msgs, Some(&tools));
        assert_eq!(out[0].role, "system");
        assert!(out[0].content.contains("<tools>"));
        assert!(out[2].content.starts_with("<tool_call>") && out[2].content.contains("Oslo"));
        assert_eq!(out[3].role, "user");
        assert_eq!(out[3].content, "<tool_response>\nsunny\n</tool_response>");
    }
}
