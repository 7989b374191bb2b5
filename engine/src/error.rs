//! [`EngineError`]: why the engine refused or failed a request, or could not start, and whose
//! fault that is. The lowest module of the crate: every other one may use it.

use tandem_types::{ErrorKind, SamplingError};

/// Why the engine refused or failed a request, or could not start. [`EngineError::kind`] says
/// whose fault it is; the workers map that kind, not the text, to a gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The sampling parameters are invalid.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The request has no prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The output to resume from already reaches `max_tokens`.
    #[error("{resume} output tokens to resume from leave nothing to generate under max_tokens {max_tokens}")]
    NothingToResume {
        /// Output tokens given to resume from.
        resume: usize,
        /// The request's output limit in tokens.
        max_tokens: u32,
    },
    /// Prompt and output do not fit the model's context.
    #[error("prompt and output need {tokens} tokens but the model's context is {max}")]
    ContextOverflow {
        /// Tokens the request needs.
        tokens: usize,
        /// The model's context in tokens.
        max: usize,
    },
    /// A token id is not in the model's vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken {
        /// The offending token id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The request alone needs more KV blocks than the whole pool has.
    #[error("request needs {need} KV blocks but the pool has only {total}: raise --kv-cache-mb or shorten the request")]
    TooLargeForCache {
        /// Blocks the prompt and `max_tokens` of output need.
        need: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A prefill-mode or remote-prefill request this engine cannot take as asked (a skip that is
    /// not a whole number of blocks, output to resume): its sender's mistake.
    #[error("{0}")]
    BadPlan(String),
    /// The request's parallel samples (`n`) are out of range or cannot be combined with the
    /// rest of it.
    #[error("n: {0}")]
    Samples(String),
    /// What this engine was built for cannot serve the request (KV transfer with a device
    /// cache): the operator's to change.
    #[error("{0}")]
    Unsupported(String),
    /// The engine's configuration makes no engine.
    #[error("configuration: {0}")]
    Config(String),
    /// A remote-prefill join named a request (by id) that is not waiting for remote KV.
    #[error("request {0} is not waiting for remote KV")]
    NotParked(u64),
    /// The engine's loop is gone, so nothing more can be submitted or answered.
    #[error("the engine has stopped")]
    Stopped,
    /// The worker is draining for shutdown and handed the request over: its K/V stays there
    /// for the worker that takes it next to pull ([`crate::Engine::hand_off`]).
    #[error(
        "this worker is draining: the request moves to another worker, its KV pulled from here"
    )]
    HandedOff,
    /// The request's grammar cannot be compiled (the text names the problem), or this model's
    /// tokenizer cannot serve grammars.
    #[error("grammar: {0}")]
    Grammar(#[from] tandem_grammar::GrammarError),
    /// A step failed, failing every request in it (each gets this copy of the step's error).
    #[error("the engine step failed: {0}")]
    Step(String),
    /// The model's weights cannot be assembled as given.
    #[error("model: {0}")]
    Model(String),
    /// A CPU kernel or weight conversion failed (a shape mismatch, a tensor it cannot read).
    #[error(transparent)]
    Kernel(#[from] tandem_kernels::KernelError),
    /// The model's files or tensors could not be read.
    #[error(transparent)]
    Files(#[from] tandem_model::ModelError),
    /// A CUDA call failed.
    #[error(transparent)]
    Cuda(#[from] tandem_kernels::cuda::CudaError),
    /// A copy between a device's KV pool and host staging memory failed (the text says why).
    #[error("device KV copy: {0}")]
    Device(String),
    /// A collective between the ranks of a tensor-parallel group failed (a rank stuck or gone,
    /// buffers that do not agree).
    #[error("tensor-parallel collective: {0}")]
    Collective(#[from] tandem_collective::CollectiveError),
    /// The engine could not be built (the model, the device); the text says why.
    #[error("{0}")]
    Startup(String),
    /// A broken invariant inside the engine: a bug.
    #[error("internal: {0}")]
    Internal(String),
    /// The engine's thread panicked (a bug; the text is the panic's message): every request it
    /// held failed with this, and it takes no more. Its worker stops so that it is restarted.
    #[error("the engine failed and stopped: {0}")]
    Failed(String),
}

impl EngineError {
    /// Whose fault this is: the request's ([`ErrorKind::InvalidRequest`], [`ErrorKind::TooLarge`])
    /// or the server's.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Sampling(_)
            | Self::EmptyPrompt
            | Self::NothingToResume { .. }
            | Self::BadToken { .. }
            | Self::Samples(_)
            | Self::BadPlan(_) => ErrorKind::InvalidRequest,
            Self::ContextOverflow { .. } | Self::TooLargeForCache { .. } => ErrorKind::TooLarge,
            Self::Unsupported(_) => ErrorKind::Unsupported,
            Self::Grammar(tandem_grammar::GrammarError::Tokenizer(_)) => ErrorKind::Unsupported,
            Self::Grammar(tandem_grammar::GrammarError::Busy(_)) => ErrorKind::Busy,
            Self::Grammar(tandem_grammar::GrammarError::Internal(_)) => ErrorKind::Internal,
            Self::Grammar(_) => ErrorKind::InvalidRequest,
            Self::Stopped | Self::HandedOff => ErrorKind::Unavailable,
            Self::Config(_)
            | Self::NotParked(_)
            | Self::Step(_)
            | Self::Model(_)
            | Self::Kernel(_)
            | Self::Files(_)
            | Self::Cuda(_)
            | Self::Device(_)
            | Self::Collective(_)
            | Self::Startup(_)
            | Self::Internal(_)
            | Self::Failed(_) => ErrorKind::Internal,
        }
    }
}
