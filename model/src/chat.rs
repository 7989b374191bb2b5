//! Chat templates: the model's Jinja template rendered with minijinja the way HF transformers
//! renders it (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`, Python string methods,
//! loop controls), so a template written for HF produces the same prompt here.

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// One chat message. `content` is text; richer content parts are flattened by the caller.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks: `system`, `user`, `assistant`, `tool`, or whatever roles the template knows.
    pub role: String,
    /// What they say.
    pub content: String,
    /// An assistant's tool calls as HF templates expect them: `{"type": "function", "id",
    /// "function": {"name", "arguments"}}` with the arguments an object, not a JSON string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The speaker's name (OpenAI's `name`), for templates that write it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An earlier assistant turn's reasoning, for templates that write it (or drop it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    takes_tools: bool,
    tool_calls: ToolCallStyle,
    thinks: bool,
}

/// How a model family writes its tool calls in its output, which its chat template shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ToolCallStyle {
    /// `<tool_call>{"name", "arguments"}</tool_call>` blocks among the text (Hermes; Qwen's, and
    /// what a template without tools is told to write).
    #[default]
    Hermes,
    /// `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` to the end (Mistral's).
    Mistral,
    /// The whole output one or more JSON objects `{"name", "parameters"}` (separated by `;`),
    /// after an optional `<|python_tag|>` (Llama 3.1's JSON tool calling).
    Llama3Json,
}

impl ToolCallStyle {
    /// The style a chat template's source shows: Mistral's `[TOOL_CALLS]`, Llama 3.1's
    /// `<|python_tag|>` or `ipython` role, else Hermes.
    pub fn of_template(source: &str) -> Self {
        if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<|python_tag|>") || source.contains("ipython") {
            Self::Llama3Json
        } else {
            Self::Hermes
        }
    }
}

impl std::str::FromStr for ToolCallStyle {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "hermes" => Ok(Self::Hermes),
            "mistral" => Ok(Self::Mistral),
            "llama3_json" => Ok(Self::Llama3Json),
            o => Err(format!(
                "unknown tool-call parser {o:?} (hermes, mistral, llama3_json)"
            )),
        }
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

fn raise_exception(msg: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> Result<Value, JinjaError> {
    // Templates use this for "today's date" in system prompts; days since the epoch in UTC suffice.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86400) as i64);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let out = fmt
        .replace("%Y", &format!("{y:04}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3]);
    Ok(Value::from(out))
}

/// Gregorian date from days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719468;
    let era = z.div_euclid(146097);
    let doe = z.rem_euclid(146097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + if m <= 2 { 1 } else { 0 }, m, d)
}

impl ChatTemplate {
    /// Compiles a Jinja template; `bos_token`/`eos_token` are the texts the template sees under
    /// those names (empty when None).
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(format!("chat template does not compile: {e}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or("").into(),
            eos_token: eos_token.unwrap_or("").into(),
            takes_tools: source.contains("tools"),
            thinks: source.contains("<think>"),
            tool_calls: ToolCallStyle::of_template(source),
        })
    }

    /// How the model writes tool calls, as its template shows.
    pub fn tool_call_style(&self) -> ToolCallStyle {
        self.tool_calls
    }

    /// Whether the template renders a `tools` list itself (HF's convention for tool calling);
    /// for one that does not, the caller describes the tools in the conversation.
    pub fn takes_tools(&self) -> bool {
        self.takes_tools
    }

    /// Whether the model thinks before it answers, in `<think>...</think>` (its template writes
    /// the tags: Qwen3's, DeepSeek-R1's).
    pub fn thinks(&self) -> bool {
        self.thinks
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the assistant's
    /// answer begins.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ModelError> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// [`ChatTemplate::render`] with the tools the model may call, passed to the template as
    /// `tools` (OpenAI's `{"type": "function", "function": {...}}` entries, as HF passes them).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, ModelError> {
        self.render_with(
            messages,
            add_generation_prompt,
            tools,
            &serde_json::Map::new(),
        )
    }

    /// [`ChatTemplate::render_with_tools`] with more variables for the template (vLLM's
    /// `chat_template_kwargs`: `enable_thinking` for Qwen3's, say). The messages, tools,
    /// `add_generation_prompt` and the special tokens are the caller's; a variable of the same
    /// name in `kwargs` does not replace them.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[serde_json::Value]>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ModelError> {
        if messages.is_empty() {
            return Err(ModelError::Template("messages must not be empty".into()));
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            ..Value::from_serialize(kwargs)
        })
        .map_err(|e| {
            let detail = e
                .detail()
                .map(str::to_string)
                .unwrap_or_else(|| e.to_string());
            ModelError::Template(format!("chat template error: {detail}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: &[(&str, &str)]) -> Vec<ChatMessage> {
        v.iter()
            .map(|(r, c)| ChatMessage {
                role: r.to_string(),
                content: c.to_string(),
                ..Default::default()
            })
            .collect()
    }

    /// A template shows its family's tool-call style: Mistral's mark, Llama 3.1's python tag
    /// or ipython role, else Hermes; the flag's names parse, others are refused naming them.
    #[test]
    fn templates_show_their_tool_call_style() {
        for (source, style) in [
            (
                "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
                ToolCallStyle::Mistral,
            ),
            ("{{ '<|python_tag|>' }}", ToolCallStyle::Llama3Json),
            (
                "{% if message.role == 'ipython' %}x{% endif %}",
                ToolCallStyle::Llama3Json,
            ),
            (
                "{% for t in tools %}<tool_call>{% endfor %}",
                ToolCallStyle::Hermes,
            ),
        ] {
            let t = ChatTemplate::new(source, None, None).unwrap();
            assert_eq!(t.tool_call_style(), style, "{source}");
        }
        assert_eq!("llama3_json".parse(), Ok(ToolCallStyle::Llama3Json));
        assert_eq!("mistral".parse(), Ok(ToolCallStyle::Mistral));
        let e = "pythonic".parse::<ToolCallStyle>().unwrap_err();
        assert!(e.contains("\"pythonic\""), "{e}");
    }

    /// A Qwen3-style template that thinks: ChatML, an earlier answer's thinking dropped, and
    /// `enable_thinking: false` writing an empty thought into the prompt.
    pub(crate) const THINKING: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}";

    /// Variables beyond the conversation reach the template (vLLM's `chat_template_kwargs`):
    /// Qwen3's `enable_thinking`; they do not replace the messages. A template with
    /// `<think>` thinks.
    #[test]
    fn template_kwargs_reach_the_template_and_thinking_shows() {
        let t = ChatTemplate::new(THINKING, None, None).unwrap();
        assert!(t.thinks());
        assert!(!ChatTemplate::new("{{ messages }}", None, None)
            .unwrap()
            .thinks());
        let m = vec![
            ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            },
            ChatMessage {
                role: "assistant".into(),
                content: "<think>\nhm\n</think>\n\nhello".into(),
                ..Default::default()
            },
            ChatMessage {
                role: "user".into(),
                content: "again".into(),
                ..Default::default()
            },
        ];
        let on = t.render(&m, true).unwrap();
        assert_eq!(
            on,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        );
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), serde_json::json!(false));
        kw.insert("messages".into(), serde_json::json!([]));
        let off = t.render_with(&m, true, None, &kw).unwrap();
        assert_eq!(off, format!("{on}<think>\n\n</think>\n\n"));
        kw.insert("enable_thinking".into(), serde_json::json!(true));
        assert_eq!(t.render_with(&m, true, None, &kw).unwrap(), on);
    }

    #[test]
    fn hf_features() {
        let src = r#"{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
{% if loop.index0 > 2 %}{% break %}{% endif %}{% if m.role == 'skip' %}{% continue %}{% endif %}
[{{ m.role | upper }}]{{ m.content.strip() }}|{{ m | tojson }}
{% endfor %}{% if add_generation_prompt %}<gen>{% endif %}"#;
        let t = ChatTemplate::new(src, Some("<s>"), Some("</s>")).unwrap();
        let out = t
            .render(
                &msgs(&[
                    ("user", "  hi "),
                    ("skip", "x"),
                    ("assistant", "yo"),
                    ("user", "late"),
                ]),
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<s>[USER]hi|{\"role\":\"user\",\"content\":\"  hi \"}\n[ASSISTANT]yo|{\"role\":\"assistant\",\"content\":\"yo\"}\n<gen>"
        );
        let err = t.render(&msgs(&[("tool", "x")]), false).unwrap_err();
        assert!(err.to_string().contains("no tools"), "{err}");
        assert!(t.render(&[], true).is_err());
    }

    #[test]
    fn bad_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_778), (2026, 11, 21));
    }
}
