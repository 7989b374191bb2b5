//! The `--discovery` choice.

use std::str::FromStr;

/// How a cluster's members find each other (`--discovery`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoverySpec {
    /// The addresses given on the command line (`--decode-workers`, `--prefill-workers`).
    Static,
    /// Workers register in etcd and the router watches it: `etcd://HOST:PORT[,HOST:PORT...]`.
    Etcd {
        /// The etcd endpoints, as `http://host:port`.
        endpoints: Vec<String>,
    },
    /// The router re-resolves the names given in `--decode-workers` and `--prefill-workers`
    /// (a headless Service's `name:port`) through DNS: one worker per address.
    K8s,
    /// The router reads the workers from a JSON file (`file:PATH`, a
    /// [`WorkerList`](crate::WorkerList)) and reads it again whenever it changes.
    File {
        /// The list file.
        path: std::path::PathBuf,
    },
}

/// A `--discovery` value that is none of the three.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("--discovery {0:?}: expected static, k8s, file:PATH or etcd://HOST:PORT[,HOST:PORT...]")]
pub struct SpecError(pub String);

impl FromStr for DiscoverySpec {
    type Err = SpecError;

    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s {
            "static" => return Ok(Self::Static),
            "k8s" | "kubernetes" => return Ok(Self::K8s),
            _ => {}
        }
        if let Some(path) = s.strip_prefix("file:") {
            if path.is_empty() {
                return Err(SpecError(s.into()));
            }
            return Ok(Self::File { path: path.into() });
        }
        let rest = s
            .strip_prefix("etcd://")
            .ok_or_else(|| SpecError(s.into()))?;
        let endpoints: Vec<String> = rest
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| format!("http://{e}"))
            .collect();
        let valid = |e: &String| {
            let hp = e.trim_start_matches("http://");
            hp.rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
        };
        if endpoints.is_empty() || !endpoints.iter().all(valid) {
            return Err(SpecError(s.into()));
        }
        Ok(Self::Etcd { endpoints })
    }
}

impl std::fmt::Display for DiscoverySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Static => f.write_str("static"),
            Self::K8s => f.write_str("k8s"),
            Self::File { path } => write!(f, "file:{}", path.display()),
            Self::Etcd { endpoints } => {
                let hosts: Vec<&str> = endpoints
                    .iter()
                    .map(|e| e.trim_start_matches("http://"))
                    .collect();
                write!(f, "etcd://{}", hosts.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms_and_names_bad_ones() {
        assert_eq!("static".parse(), Ok(DiscoverySpec::Static));
        assert_eq!("k8s".parse(), Ok(DiscoverySpec::K8s));
        let e: DiscoverySpec = "etcd://127.0.0.1:2379,etcd-1:2379".parse().unwrap();
        assert_eq!(
            e,
            DiscoverySpec::Etcd {
                endpoints: vec!["http://127.0.0.1:2379".into(), "http://etcd-1:2379".into()]
            }
        );
        assert_eq!(e.to_string(), "etcd://127.0.0.1:2379,etcd-1:2379");
        let f: DiscoverySpec = "file:/run/tandem/workers.json".parse().unwrap();
        assert_eq!(
            f,
            DiscoverySpec::File {
                path: "/run/tandem/workers.json".into()
            }
        );
        assert_eq!(f.to_string(), "file:/run/tandem/workers.json");
        for bad in [
            "etcd://",
            "etcd://host",
            "etcd://:2379",
            "consul://x:1",
            "",
            "file:",
        ] {
            let err = bad.parse::<DiscoverySpec>().unwrap_err();
            assert!(err.to_string().contains("expected static, k8s"), "{bad}");
        }
    }
}
