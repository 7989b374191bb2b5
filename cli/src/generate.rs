//! `tandem generate`: offline generation through the engine.
//!
//! With `--jsonl`, every stdin line is a request (`{"prompt": ...}`, `{"prompt_ids": [...]}` or
//! `{"messages": [...]}`), all lines are served as one continuous batch, and one JSON line per input
//! comes out in input order. A line that cannot be served gets `{"error": ...}` in its place and
//! the command exits non-zero after writing every line. Without `--jsonl` it streams one prompt's
//! text for a person.

use std::io::{BufRead, Read, Write};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;
use serde_json::json;
use tandem_engine::{Request, SamplingError, SamplingParams, ValidSampling};
use tandem_model::{ChatMessage, IncrementalDecoder, LoadedModel};

use crate::EngineArgs;

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Most tokens to generate per request.
    #[arg(long, env = "TANDEM_MAX_TOKENS", default_value_t = 128)]
    max_tokens: u32,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Seed for sampling; the same seed gives the same tokens.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating after EOS (EOS is not banned, only not a stop).
    #[arg(long)]
    ignore_eos: bool,
    /// Read JSON lines on stdin and write one JSON line per input.
    #[arg(long)]
    jsonl: bool,
    /// The prompt (text mode); read from stdin when absent.
    #[arg(long)]
    prompt: Option<String>,
    /// Wrap --prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    messages: Option<Vec<ChatMessage>>,
}

impl GenerateArgs {
    /// The flags' sampling, checked (the same check as every API's).
    fn params(&self) -> Result<ValidSampling, SamplingError> {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            max_tokens: self.max_tokens,
            ignore_eos: self.ignore_eos,
            ..Default::default()
        }
        .validate()
    }
}

fn chat_prompt(m: &LoadedModel, messages: &[ChatMessage]) -> Result<Vec<u32>> {
    let t = m
        .chat_template
        .as_ref()
        .context("this model has no chat template: send \"prompt\" instead of \"messages\"")?;
    let text = t.render(messages, true)?;
    Ok(m.tokenizer.encode(&text, false)?)
}

fn parse_line(m: &LoadedModel, line: &str) -> Result<Vec<u32>> {
    let input: Input = serde_json::from_str(line)
        .context("not a JSON object with \"prompt\", \"prompt_ids\" or \"messages\"")?;
    match (input.prompt, input.prompt_ids, input.messages) {
        (Some(p), None, None) => Ok(m.tokenizer.encode(&p, true)?),
        (None, Some(ids), None) => Ok(ids),
        (None, None, Some(msgs)) => chat_prompt(m, &msgs),
        _ => bail!("give exactly one of \"prompt\", \"prompt_ids\" or \"messages\""),
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let params = a.params()?;
    let (mut engine, model) = a.engine.build()?;
    if !a.jsonl {
        return run_text(&a, &mut engine, &model);
    }
    let stdin = std::io::stdin();
    let mut slots: Vec<Result<usize, String>> = Vec::new();
    let mut requests = Vec::new();
    for (n, line) in stdin.lock().lines().enumerate() {
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        let req = parse_line(&model, &line).map(|prompt| Request::new(prompt, params.clone()));
        match req.and_then(|r| engine.validate(&r).map(|_| r).map_err(Into::into)) {
            Ok(r) => {
                slots.push(Ok(requests.len()));
                requests.push(r);
            }
            Err(e) => slots.push(Err(format!("line {}: {e:#}", n + 1))),
        }
    }
    let outputs = engine.generate(requests, |_| {}, |_| {})?;
    let mut out = std::io::stdout().lock();
    let mut failed = 0;
    for s in slots {
        let v = match s {
            Ok(i) => {
                let o = &outputs[i];
                json!({
                    "prompt_ids": o.prompt_ids,
                    "output_ids": o.output_ids,
                    "text": model.tokenizer.decode(&o.output_ids, false)?,
                    "finish_reason": o.finish_reason,
                })
            }
            Err(e) => {
                failed += 1;
                json!({ "error": e })
            }
        };
        writeln!(out, "{v}")?;
    }
    out.flush()?;
    if failed > 0 {
        bail!("{failed} input line(s) could not be served (see their \"error\")");
    }
    Ok(())
}

fn run_text(
    a: &GenerateArgs,
    engine: &mut tandem_engine::Engine,
    model: &LoadedModel,
) -> Result<()> {
    let text = match &a.prompt {
        Some(p) => p.clone(),
        None => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            s
        }
    };
    let prompt = if a.chat {
        chat_prompt(
            model,
            &[ChatMessage {
                role: "user".into(),
                content: text,
                ..Default::default()
            }],
        )?
    } else {
        model.tokenizer.encode(&text, true)?
    };
    let mut dec = IncrementalDecoder::new(true);
    let mut out = std::io::stdout().lock();
    let mut err = None;
    let res = engine.generate(
        vec![Request::new(prompt, a.params()?)],
        |ev| {
            if err.is_some() {
                return;
            }
            match dec.push(&model.tokenizer, ev.sampled.token) {
                Ok(piece) => {
                    let _ = out.write_all(piece.as_bytes());
                    let _ = out.flush();
                }
                Err(e) => err = Some(e),
            }
        },
        |_| {},
    )?;
    if let Some(e) = err {
        return Err(e.into());
    }
    write!(out, "{}", dec.finish(&model.tokenizer)?)?;
    writeln!(out)?;
    eprintln!(
        "[{} tokens, finish: {:?}]",
        res[0].output_ids.len(),
        res[0].finish_reason
    );
    Ok(())
}
