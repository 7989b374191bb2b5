//! Whose fault a failure is, and so what its caller may do about it.

/// The kind of a failure, as every edge maps it: the worker API to a gRPC code (tandem-proto), the
/// router to an HTTP status and an OpenAI error type. A fault of the server is never reported as
/// the client's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or asks for something out of range: the client's to fix
    /// (HTTP 400, `INVALID_ARGUMENT`).
    InvalidRequest,
    /// The request is well formed but larger than this deployment can ever serve (its context,
    /// its KV pool): the client's to shorten (HTTP 400, `OUT_OF_RANGE`).
    TooLarge,
    /// The server is full now; the same request may succeed later or elsewhere (HTTP 503 with
    /// `Retry-After`, `RESOURCE_EXHAUSTED`).
    Busy,
    /// The server is stopping or stopped (HTTP 503, `UNAVAILABLE`): retry on another.
    Unavailable,
    /// The deployment is configured in a way that cannot serve this request (HTTP 500,
    /// `FAILED_PRECONDITION`): the operator's to fix.
    Unsupported,
    /// A fault inside the server (HTTP 500, `INTERNAL`).
    Internal,
}

impl ErrorKind {
    /// Whether the client caused it (and retrying the same request cannot help).
    pub fn is_client_fault(self) -> bool {
        matches!(self, Self::InvalidRequest | Self::TooLarge)
    }
}
