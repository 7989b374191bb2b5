//! The line each `tandem` process prints on its standard output once its ports are open, and
//! the one parser of it: what `tandem up` reads to know a child is serving and where, and what
//! the tests read of the processes they start.
//!
//! | role | line |
//! | --- | --- |
//! | decode worker | `tandem decode: listening on ADDR kv ADDR` (`kv none` without a KV port) |
//! | prefill worker | `tandem prefill: listening on ADDR` |
//! | router | `tandem router: http ADDR grpc ADDR` |
//! | `tandem up` (the whole cluster) | `tandem up: ready http ADDR grpc ADDR` |
//!
//! ```
//! use tandem_discovery::Ready;
//! let r = Ready::Decode { grpc: "127.0.0.1:9000".into(), kv: Some("127.0.0.1:9001".into()) };
//! let line = r.to_string();
//! assert_eq!(line, "tandem decode: listening on 127.0.0.1:9000 kv 127.0.0.1:9001");
//! assert_eq!(Ready::parse(&line), Some(r));
//! ```

use std::fmt;

/// A process's ready line, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ready {
    /// A decode worker: its gRPC address, and its KV receiver's (None without one).
    Decode {
        /// The gRPC address.
        grpc: String,
        /// The KV receiver's address.
        kv: Option<String>,
    },
    /// A prefill worker: its gRPC address.
    Prefill {
        /// The gRPC address.
        grpc: String,
    },
    /// A router: its HTTP and gRPC addresses.
    Router {
        /// The OpenAI-compatible HTTP address.
        http: String,
        /// The public gRPC address.
        grpc: String,
    },
    /// `tandem up`: the cluster's router, every child ready.
    Up {
        /// The OpenAI-compatible HTTP address.
        http: String,
        /// The public gRPC address.
        grpc: String,
    },
}

impl Ready {
    /// How a decode worker's line starts.
    pub const DECODE: &'static str = "tandem decode: listening on";
    /// How a prefill worker's line starts.
    pub const PREFILL: &'static str = "tandem prefill: listening on";
    /// How a router's line starts.
    pub const ROUTER: &'static str = "tandem router:";
    /// How `tandem up`'s line starts.
    pub const UP: &'static str = "tandem up: ready";

    /// The line's start for a role (`decode`, `prefill` or `router`).
    pub fn marker(role: &str) -> Option<&'static str> {
        match role {
            "decode" => Some(Self::DECODE),
            "prefill" => Some(Self::PREFILL),
            "router" => Some(Self::ROUTER),
            "up" => Some(Self::UP),
            _ => None,
        }
    }

    /// A ready line (surrounding whitespace ignored); None for any other line.
    pub fn parse(line: &str) -> Option<Ready> {
        let line = line.trim();
        let words = |rest: &str| {
            rest.split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        if let Some(rest) = line.strip_prefix(Self::DECODE) {
            return match words(rest).as_slice() {
                [grpc, kv, addr] if kv == "kv" => Some(Ready::Decode {
                    grpc: grpc.clone(),
                    kv: (addr != "none").then(|| addr.clone()),
                }),
                _ => None,
            };
        }
        if let Some(rest) = line.strip_prefix(Self::PREFILL) {
            return match words(rest).as_slice() {
                [grpc] => Some(Ready::Prefill { grpc: grpc.clone() }),
                _ => None,
            };
        }
        let front = |rest: &str| match words(rest).as_slice() {
            [h, http, g, grpc] if h == "http" && g == "grpc" => Some((http.clone(), grpc.clone())),
            _ => None,
        };
        if let Some(rest) = line.strip_prefix(Self::ROUTER) {
            return front(rest).map(|(http, grpc)| Ready::Router { http, grpc });
        }
        if let Some(rest) = line.strip_prefix(Self::UP) {
            return front(rest).map(|(http, grpc)| Ready::Up { http, grpc });
        }
        None
    }

    /// The gRPC address the line gives.
    pub fn grpc(&self) -> &str {
        match self {
            Ready::Decode { grpc, .. }
            | Ready::Prefill { grpc }
            | Ready::Router { grpc, .. }
            | Ready::Up { grpc, .. } => grpc,
        }
    }
}

impl fmt::Display for Ready {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ready::Decode { grpc, kv } => {
                let kv = kv.as_deref().unwrap_or("none");
                write!(f, "{} {grpc} kv {kv}", Self::DECODE)
            }
            Ready::Prefill { grpc } => write!(f, "{} {grpc}", Self::PREFILL),
            Ready::Router { http, grpc } => write!(f, "{} http {http} grpc {grpc}", Self::ROUTER),
            Ready::Up { http, grpc } => write!(f, "{} http {http} grpc {grpc}", Self::UP),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_round_trips_and_nothing_else_parses() {
        let all = [
            Ready::Decode {
                grpc: "127.0.0.1:1".into(),
                kv: None,
            },
            Ready::Decode {
                grpc: "[::1]:2".into(),
                kv: Some("10.0.0.1:3".into()),
            },
            Ready::Prefill {
                grpc: "127.0.0.1:4".into(),
            },
            Ready::Router {
                http: "0.0.0.0:8000".into(),
                grpc: "0.0.0.0:50051".into(),
            },
            Ready::Up {
                http: "127.0.0.1:8000".into(),
                grpc: "127.0.0.1:50051".into(),
            },
        ];
        for r in &all {
            let line = r.to_string();
            assert_eq!(
                Ready::parse(&format!("  {line}\n")).as_ref(),
                Some(r),
                "{line}"
            );
        }
        assert_eq!(
            all[0].to_string(),
            "tandem decode: listening on 127.0.0.1:1 kv none"
        );
        assert_eq!(all[3].grpc(), "0.0.0.0:50051");
        for other in [
            "",
            "tandem decode: listening on 127.0.0.1:1",
            "tandem decode: listening on a kv b extra",
            "tandem prefill: listening on",
            "tandem router: http a",
            "tandem router: grpc a http b",
            "tandem up: ready",
            "tandem up: stopping",
            "bench agent listening on 127.0.0.1:5",
        ] {
            assert_eq!(Ready::parse(other), None, "{other:?}");
        }
        assert_eq!(Ready::marker("prefill"), Some(Ready::PREFILL));
        assert_eq!(Ready::marker("agent"), None);
    }
}
