//! tandem-types: the words every Tandem crate shares.
//!
//! Owns: what one request asks of the sampler and when it stops ([`SamplingParams`] as given,
//! [`ValidSampling`] once checked, [`SamplingError`] naming the one field that is wrong, and the
//! [`limits`] those checks use) whose fault a failure is ([`ErrorKind`]) and what names a KV block ([`BlockId`]), so that every edge
//! (HTTP, the public gRPC API, the worker API) maps a failure the same way.
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
