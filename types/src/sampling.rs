//! One request's sampling and stopping: as given ([`SamplingParams`]) and once checked
//! ([`ValidSampling`]).
//!
//! The limits follow what OpenAI and vLLM clients expect. Where the two differ, the field that
//! OpenAI defines takes OpenAI's range (temperature in [0, 2], penalties in [-2, 2], at most 20
//! alternatives), and a field that only vLLM defines takes vLLM's (repetition_penalty: any
//! positive number; top_k: 0 or -1 for off at the API).

use std::ops::Deref;

use serde::{Deserialize, Serialize};

/// The ranges a request is checked against, defined once for every layer.
pub mod limits {
    /// Largest temperature (OpenAI's range is [0, 2]).
    pub const MAX_TEMPERATURE: f32 = 2.0;
    /// Presence and frequency penalties lie in [-`PENALTY`, `PENALTY`] (OpenAI's).
    pub const PENALTY: f32 = 2.0;
    /// Largest number of alternatives reported per token (OpenAI's `top_logprobs` limit).
    pub const MAX_TOP_LOGPROBS: u32 = 20;
    /// A logit bias lies in [-`LOGIT_BIAS`, `LOGIT_BIAS`] (OpenAI's range).
    pub const LOGIT_BIAS: f32 = 100.0;
    /// Most tokens one request may bias.
    pub const MAX_LOGIT_BIAS_TOKENS: usize = 1024;
}

/// What the output must match (structured outputs): the grammar engine turns it into a token
/// mask at each step, so every sampled token keeps the text inside the language.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Grammar {
    /// JSON that validates against this JSON Schema (its text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text that matches this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text in the language of this Lark grammar (llguidance's dialect, which takes `%json`
    /// and regular expressions inside rules).
    Lark(String),
}

/// How to pick tokens and when to stop, as a caller gives them: any values. Defaults: greedy,
/// 16 tokens, stop at EOS. [`SamplingParams::validate`] turns it into a [`ValidSampling`], the
/// only form the engine takes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 means no top-k filter.
    pub top_k: u32,
    /// Nucleus mass kept, in (0, 1].
    pub top_p: f32,
    /// Tokens less likely than this fraction of the most likely one are dropped.
    pub min_p: f32,
    /// HF-style multiplicative penalty on prompt and output tokens (1 is off).
    pub repetition_penalty: f32,
    /// OpenAI-style additive penalty on tokens already generated.
    pub presence_penalty: f32,
    /// OpenAI-style penalty per occurrence of a generated token.
    pub frequency_penalty: f32,
    /// Seed of the request's own random stream (none: drawn from the system).
    pub seed: Option<u64>,
    /// Number of most likely alternatives to report with each token (0: just the token's own).
    pub top_logprobs: u32,
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Tokens that end generation (as EOS does).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating after EOS (EOS may still be produced; it is not banned).
    pub ignore_eos: bool,
    /// Added to these tokens' logits before anything else (OpenAI's `logit_bias`): `(token,
    /// bias)`, -100 bans a token and 100 all but forces it.
    pub logit_bias: Vec<(u32, f32)>,
    /// The output must match this (structured outputs); none: free text.
    pub grammar: Option<Grammar>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            top_logprobs: 0,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logit_bias: Vec::new(),
            grammar: None,
        }
    }
}

/// The one field a request got wrong, with the value it sent.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// Not a number in [0, [`limits::MAX_TEMPERATURE`]].
    #[error("temperature must be in [0, {max}], got {0}", max = limits::MAX_TEMPERATURE)]
    Temperature(f32),
    /// Not in (0, 1].
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    /// Below -1 (the API's "off").
    #[error("top_k must be -1 (off), 0 (off) or positive, got {0}")]
    TopK(i64),
    /// Not in [0, 1].
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    /// Not a positive number.
    #[error("repetition_penalty must be a number above 0, got {0}")]
    RepetitionPenalty(f32),
    /// Not in [-[`limits::PENALTY`], [`limits::PENALTY`]].
    #[error("presence_penalty must be in [-{p}, {p}], got {0}", p = limits::PENALTY)]
    PresencePenalty(f32),
    /// Not in [-[`limits::PENALTY`], [`limits::PENALTY`]].
    #[error("frequency_penalty must be in [-{p}, {p}], got {0}", p = limits::PENALTY)]
    FrequencyPenalty(f32),
    /// Above [`limits::MAX_TOP_LOGPROBS`].
    #[error("top_logprobs must be at most {max}, got {0}", max = limits::MAX_TOP_LOGPROBS)]
    TopLogprobs(u32),
    /// Zero: nothing to generate.
    #[error("max_tokens must be at least 1")]
    MaxTokens,
    /// A bias outside [-[`limits::LOGIT_BIAS`], [`limits::LOGIT_BIAS`]].
    #[error("logit_bias values must be in [-{b}, {b}], got {0}", b = limits::LOGIT_BIAS)]
    LogitBias(f32),
    /// More than [`limits::MAX_LOGIT_BIAS_TOKENS`] tokens biased.
    #[error("logit_bias may name at most {max} tokens, got {0}", max = limits::MAX_LOGIT_BIAS_TOKENS)]
    LogitBiasTokens(usize),
}

impl SamplingError {
    /// The field's name in the OpenAI API (an error body's `param`).
    pub fn field(&self) -> &'static str {
        match self {
            Self::Temperature(_) => "temperature",
            Self::TopP(_) => "top_p",
            Self::TopK(_) => "top_k",
            Self::MinP(_) => "min_p",
            Self::RepetitionPenalty(_) => "repetition_penalty",
            Self::PresencePenalty(_) => "presence_penalty",
            Self::FrequencyPenalty(_) => "frequency_penalty",
            Self::TopLogprobs(_) => "top_logprobs",
            Self::MaxTokens => "max_tokens",
            Self::LogitBias(_) | Self::LogitBiasTokens(_) => "logit_bias",
        }
    }
}

impl SamplingParams {
    /// The API's `top_k` (vLLM's: -1 and 0 are off) as the sampler's (0 is off).
    pub fn api_top_k(top_k: i64) -> Result<u32, SamplingError> {
        if top_k < -1 {
            return Err(SamplingError::TopK(top_k));
        }
        Ok(top_k.clamp(0, u32::MAX as i64) as u32)
    }

    /// Checks every field, in declaration order; the first bad one is the error.
    pub fn check(&self) -> Result<(), SamplingError> {
        use SamplingError as E;
        let t = self.temperature;
        if !(t.is_finite() && (0.0..=limits::MAX_TEMPERATURE).contains(&t)) {
            return Err(E::Temperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(E::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(E::MinP(self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(E::RepetitionPenalty(r));
        }
        let penalty = -limits::PENALTY..=limits::PENALTY;
        if !penalty.contains(&self.presence_penalty) {
            return Err(E::PresencePenalty(self.presence_penalty));
        }
        if !penalty.contains(&self.frequency_penalty) {
            return Err(E::FrequencyPenalty(self.frequency_penalty));
        }
        if self.top_logprobs > limits::MAX_TOP_LOGPROBS {
            return Err(E::TopLogprobs(self.top_logprobs));
        }
        if self.max_tokens == 0 {
            return Err(E::MaxTokens);
        }
        if self.logit_bias.len() > limits::MAX_LOGIT_BIAS_TOKENS {
            return Err(E::LogitBiasTokens(self.logit_bias.len()));
        }
        let bias = -limits::LOGIT_BIAS..=limits::LOGIT_BIAS;
        if let Some(&(_, b)) = self.logit_bias.iter().find(|(_, b)| !bias.contains(b)) {
            return Err(E::LogitBias(b));
        }
        Ok(())
    }

    /// The checked form, or the first field that is out of range.
    pub fn validate(self) -> Result<ValidSampling, SamplingError> {
        self.check()?;
        Ok(ValidSampling(self))
    }
}

/// Sampling and stopping that passed [`SamplingParams::validate`]: every value in range. It
/// reads as a [`SamplingParams`] (through `Deref`) and cannot be changed into an invalid one.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct ValidSampling(SamplingParams);

impl ValidSampling {
    /// The same request stopping after `max_tokens` (at least 1).
    pub fn with_max_tokens(mut self, max_tokens: std::num::NonZeroU32) -> Self {
        self.0.max_tokens = max_tokens.get();
        self
    }

    /// The values, to change and check again.
    pub fn into_params(self) -> SamplingParams {
        self.0
    }

    /// Greedy: [`SamplingParams::default`] with `max_tokens`, stopping at EOS.
    pub fn greedy(max_tokens: std::num::NonZeroU32) -> Self {
        Self::default().with_max_tokens(max_tokens)
    }

    /// Whether every token is the most likely one (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.0.temperature == 0.0 || self.0.top_k == 1
    }
}

impl Default for ValidSampling {
    /// [`SamplingParams::default`], which is valid.
    fn default() -> Self {
        Self(SamplingParams::default())
    }
}

impl Deref for ValidSampling {
    type Target = SamplingParams;

    fn deref(&self) -> &SamplingParams {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut SamplingParams)) -> Result<ValidSampling, SamplingError> {
        let mut p = SamplingParams::default();
        f(&mut p);
        p.validate()
    }

    #[test]
    fn the_default_is_valid_and_greedy() {
        let v = SamplingParams::default().validate().unwrap();
        assert!(v.is_greedy());
        assert_eq!(v, ValidSampling::default());
        assert_eq!(v.max_tokens, 16);
    }

    #[test]
    fn each_bad_field_is_named_with_its_value() {
        type Edit = Box<dyn FnOnce(&mut SamplingParams)>;
        let cases: Vec<(SamplingError, Edit)> = vec![
            (
                SamplingError::Temperature(-1.0),
                Box::new(|p| p.temperature = -1.0),
            ),
            (
                SamplingError::Temperature(2.5),
                Box::new(|p| p.temperature = 2.5),
            ),
            (SamplingError::TopP(0.0), Box::new(|p| p.top_p = 0.0)),
            (SamplingError::TopP(1.5), Box::new(|p| p.top_p = 1.5)),
            (SamplingError::MinP(-0.1), Box::new(|p| p.min_p = -0.1)),
            (
                SamplingError::RepetitionPenalty(0.0),
                Box::new(|p| p.repetition_penalty = 0.0),
            ),
            (
                SamplingError::PresencePenalty(2.5),
                Box::new(|p| p.presence_penalty = 2.5),
            ),
            (
                SamplingError::FrequencyPenalty(-3.0),
                Box::new(|p| p.frequency_penalty = -3.0),
            ),
            (
                SamplingError::TopLogprobs(21),
                Box::new(|p| p.top_logprobs = 21),
            ),
            (SamplingError::MaxTokens, Box::new(|p| p.max_tokens = 0)),
            (
                SamplingError::LogitBias(-101.0),
                Box::new(|p| p.logit_bias = vec![(5, 1.0), (7, -101.0)]),
            ),
            (
                SamplingError::LogitBiasTokens(1025),
                Box::new(|p| p.logit_bias = (0..1025).map(|t| (t, 1.0)).collect()),
            ),
        ];
        for (want, f) in cases {
            let got = with(f).unwrap_err();
            assert_eq!(got, want);
            assert!(
                got.to_string().starts_with(got.field()),
                "{got} names {}",
                got.field()
            );
        }
    }

    #[test]
    fn nan_and_infinity_are_refused_everywhere() {
        for v in [f32::NAN, f32::INFINITY] {
            assert!(with(|p| p.temperature = v).is_err());
            assert!(with(|p| p.top_p = v).is_err());
            assert!(with(|p| p.min_p = v).is_err());
            assert!(with(|p| p.repetition_penalty = v).is_err());
            assert!(with(|p| p.presence_penalty = v).is_err());
            assert!(with(|p| p.frequency_penalty = v).is_err());
            assert!(with(|p| p.logit_bias = vec![(1, v)]).is_err());
        }
    }

    #[test]
    fn the_edges_of_each_range_are_accepted() {
        assert!(with(|p| p.temperature = limits::MAX_TEMPERATURE).is_ok());
        assert!(with(|p| p.top_p = 1.0).is_ok());
        assert!(with(|p| p.min_p = 1.0).is_ok());
        assert!(with(|p| p.repetition_penalty = 5.0).is_ok());
        assert!(with(|p| p.presence_penalty = -limits::PENALTY).is_ok());
        assert!(with(|p| p.top_logprobs = limits::MAX_TOP_LOGPROBS).is_ok());
    }

    #[test]
    fn api_top_k_maps_off_values_and_refuses_the_rest() {
        assert_eq!(SamplingParams::api_top_k(-1), Ok(0));
        assert_eq!(SamplingParams::api_top_k(0), Ok(0));
        assert_eq!(SamplingParams::api_top_k(40), Ok(40));
        assert_eq!(SamplingParams::api_top_k(i64::MAX), Ok(u32::MAX));
        assert_eq!(SamplingParams::api_top_k(-2), Err(SamplingError::TopK(-2)));
    }

    #[test]
    fn a_valid_request_stays_valid_when_its_length_changes() {
        let v = with(|p| p.temperature = 0.7).unwrap();
        let one = v.with_max_tokens(std::num::NonZeroU32::MIN);
        assert_eq!(one.max_tokens, 1);
        assert_eq!(one.temperature, 0.7);
        assert!(one.into_params().check().is_ok());
    }
}
