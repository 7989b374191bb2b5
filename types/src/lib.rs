//! tandem-types: the words every Tandem crate shares.
//!
//! Owns: what one request asks of the sampler and when it stops ([`SamplingParams`] as given,
//! [`ValidSampling`] once checked, [`SamplingError`] naming the one field that is wrong, and the
//! [`limits`] those checks use) whose fault a failure is ([`ErrorKind`]) and what names a KV block ([`BlockId`]), so that every edge
//! (HTTP, the public gRPC API, the worker API) maps a failure the same way; and the one scheduling
//! figure the router plans by as the engine keeps it ([`MIN_ITL_PREFILL_CHUNK`]).
//!
//! A request is checked once where it enters: the router builds a [`ValidSampling`] from the
//! OpenAI or gRPC body, a worker builds one from the worker API's message (a trust boundary of its
//! own), and the engine takes only a [`ValidSampling`], so no layer below the edge checks again
//! and no two layers can disagree on a limit.
//!
//! Does not own: wire formats (tandem-proto maps these types to and from its messages) or the
//! checks that need a model or an engine (vocabulary, context, KV pool: the engine's `Limits`).

#![deny(missing_docs)]

mod error;
mod ids;
mod sampling;

pub use error::{panic_message, ErrorKind};
pub use ids::BlockId;
pub use sampling::{limits, Grammar, SamplingError, SamplingParams, ValidSampling};

/// Prompt tokens an engine step with decoding sequences always takes under an ITL target,
/// whatever the target leaves: the prompts' pace when the decodes alone fill the target, so a
/// prompt's first token stays bounded (a 200-token prompt in at most 13 such steps). A prompt of
/// fewer uncached tokens is computed in the decode worker's next step whatever it runs, so the
/// router never sends one to a prefill worker on the ITL target's account: the move would only
/// add a round trip and a KV transfer to its first token.
pub const MIN_ITL_PREFILL_CHUNK: usize = 16;
