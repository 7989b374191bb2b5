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

/// The text of a caught panic's payload: what `panic!` formatted (a `&str` or a `String`), or
/// `"a panic"` for any other payload. One place for every `catch_unwind` that reports a panic as
/// a request's error.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

impl ErrorKind {
    /// Whether the client caused it (and retrying the same request cannot help).
    pub fn is_client_fault(self) -> bool {
        matches!(self, Self::InvalidRequest | Self::TooLarge)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_s_text_is_its_message() {
        let caught = |f: fn()| std::panic::catch_unwind(f).unwrap_err();
        assert_eq!(panic_message(caught(|| panic!("plain")).as_ref()), "plain");
        assert_eq!(
            panic_message(caught(|| panic!("formatted {}", 7)).as_ref()),
            "formatted 7"
        );
        assert_eq!(
            panic_message(caught(|| std::panic::panic_any(42u8)).as_ref()),
            "a panic"
        );
    }
}
