//! What a worker says about itself, where it says it, and what a router accepts.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// The two worker roles of a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs continuous batching and streams tokens (`tandem.v1.Decode`).
    Decode,
    /// Computes prompts' KV blocks and sends them to decode workers (`tandem.v1.Prefill`).
    Prefill,
}

impl Role {
    /// Both roles, decode first.
    pub const ALL: [Role; 2] = [Role::Decode, Role::Prefill];

    /// The role's name in keys, logs and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Role::Decode => "decode",
            Role::Prefill => "prefill",
        }
    }

    fn from_name(s: &str) -> Option<Self> {
        Role::ALL.into_iter().find(|r| r.name() == s)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A worker's card: what the router needs to reach it and to decide whether it may use it.
/// Stored as JSON under the worker's key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerCard {
    /// Decode or prefill.
    pub role: Role,
    /// Unique in the cluster; the last part of the key.
    pub worker_id: String,
    /// `host:port` the router reaches the worker's gRPC services at.
    pub grpc_addr: String,
    /// `host:port` prefill workers push KV blocks to (decode workers that take remote prefills).
    #[serde(default)]
    pub kv_addr: Option<String>,
    /// The served model's name.
    pub model: String,
    /// Tokens per KV block; every worker of a cluster must agree.
    pub block_size: u32,
    /// The KV cache's element type, as `--kv-dtype` names it.
    pub kv_dtype: String,
    /// Tensor-parallel ranks behind this worker.
    pub tp: u32,
    /// The Tandem version the worker runs.
    pub version: String,
}

/// Why a card or key is not valid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CardError {
    /// A cluster name or worker id that is empty or holds a `/` (it is one level of the key).
    #[error("{what} {value:?} must be non-empty and hold no '/'")]
    BadName {
        /// Which name ("cluster", "worker id").
        what: &'static str,
        /// The name given.
        value: String,
    },
    /// The stored value is not a card.
    #[error("not a worker card: {0}")]
    Json(String),
    /// The card's role or id disagrees with the key it is stored under.
    #[error("card says {card_role}/{card_id} but is stored under {key}")]
    KeyMismatch {
        /// The key.
        key: String,
        /// The card's role.
        card_role: Role,
        /// The card's worker id.
        card_id: String,
    },
    /// The card names no address to reach the worker at.
    #[error("card has no gRPC address")]
    NoAddress,
}

impl WorkerCard {
    /// The card as stored (JSON).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a card serializes")
    }

    /// Reads a card stored under `key`, checking it against the key's role and id.
    pub fn parse(cluster: &ClusterPath, key: &str, value: &[u8]) -> Result<Self, CardError> {
        let card: WorkerCard =
            serde_json::from_slice(value).map_err(|e| CardError::Json(e.to_string()))?;
        match cluster.parse_key(key) {
            Some((role, id)) if role == card.role && id == card.worker_id => {}
            _ => {
                return Err(CardError::KeyMismatch {
                    key: key.to_string(),
                    card_role: card.role,
                    card_id: card.worker_id,
                })
            }
        }
        if card.grpc_addr.is_empty() {
            return Err(CardError::NoAddress);
        }
        Ok(card)
    }
}

fn check_name(what: &'static str, value: &str) -> Result<(), CardError> {
    if value.is_empty() || value.contains('/') {
        return Err(CardError::BadName {
            what,
            value: value.to_string(),
        });
    }
    Ok(())
}

/// One cluster's place in etcd: every key of it starts with `/tandem/<cluster>/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterPath {
    prefix: String,
}

impl ClusterPath {
    /// The path of the cluster named `cluster`.
    pub fn new(cluster: &str) -> Result<Self, CardError> {
        check_name("cluster", cluster)?;
        Ok(Self {
            prefix: format!("/tandem/{cluster}/"),
        })
    }

    /// The prefix every key of the cluster starts with (what the router lists and watches).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key a worker's card lives under.
    pub fn key(&self, role: Role, worker_id: &str) -> Result<String, CardError> {
        check_name("worker id", worker_id)?;
        Ok(format!("{}{}/{worker_id}", self.prefix, role.name()))
    }

    /// The role and worker id a key names, or `None` for a key that is not a worker's.
    pub fn parse_key<'k>(&self, key: &'k str) -> Option<(Role, &'k str)> {
        let rest = key.strip_prefix(&self.prefix)?;
        let (role, id) = rest.split_once('/')?;
        let role = Role::from_name(role)?;
        (!id.is_empty() && !id.contains('/')).then_some((role, id))
    }
}

/// Why a router refuses a worker it found.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The worker serves another model.
    #[error("serves model {got:?}, this router serves {want:?}")]
    Model {
        /// The worker's model.
        got: String,
        /// The router's.
        want: String,
    },
    /// The worker's KV blocks hold another number of tokens than the cluster's.
    #[error("block size {got}, the cluster's is {want}")]
    BlockSize {
        /// The worker's block size.
        got: u32,
        /// The cluster's.
        want: u32,
    },
}

impl Refusal {
    /// The reason as a metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::Model { .. } => "model",
            Refusal::BlockSize { .. } => "block_size",
        }
    }
}

/// What a router requires of every worker before it routes to it.
#[derive(Debug, Default)]
pub struct Expect {
    models: Vec<String>,
    block_size: OnceLock<u32>,
}

impl Expect {
    /// Workers must serve one of `models` (none: any model), with `block_size` tokens per block
    /// (`None`: the block size of the first worker accepted, which every later one must share).
    pub fn new(models: Vec<String>, block_size: Option<u32>) -> Self {
        let lock = OnceLock::new();
        if let Some(bs) = block_size {
            let _ = lock.set(bs);
        }
        Self {
            models,
            block_size: lock,
        }
    }

    /// Accepts or refuses a worker that serves `model` with `block_size`.
    pub fn check(&self, model: &str, block_size: u32) -> Result<(), Refusal> {
        if !self.models.is_empty() && !self.models.iter().any(|m| m == model) {
            return Err(Refusal::Model {
                got: model.to_string(),
                want: self.models[0].clone(),
            });
        }
        let want = *self.block_size.get_or_init(|| block_size);
        if want != block_size {
            return Err(Refusal::BlockSize {
                got: block_size,
                want,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card() -> WorkerCard {
        WorkerCard {
            role: Role::Decode,
            worker_id: "d0".into(),
            grpc_addr: "10.0.0.1:50100".into(),
            kv_addr: Some("10.0.0.1:50300".into()),
            model: "m".into(),
            block_size: 16,
            kv_dtype: "f32".into(),
            tp: 1,
            version: "0.1.0".into(),
        }
    }

    #[test]
    fn keys_round_trip_and_refuse_bad_names() {
        let c = ClusterPath::new("c1").unwrap();
        assert_eq!(c.prefix(), "/tandem/c1/");
        let k = c.key(Role::Prefill, "p-3").unwrap();
        assert_eq!(k, "/tandem/c1/prefill/p-3");
        assert_eq!(c.parse_key(&k), Some((Role::Prefill, "p-3")));
        assert_eq!(c.parse_key("/tandem/c1/router/x"), None);
        assert_eq!(c.parse_key("/tandem/c2/decode/x"), None);
        assert_eq!(c.parse_key("/tandem/c1/decode/a/b"), None);
        assert_eq!(c.parse_key("/tandem/c1/decode/"), None);
        assert!(matches!(
            ClusterPath::new("a/b"),
            Err(CardError::BadName {
                what: "cluster",
                ..
            })
        ));
        assert!(c.key(Role::Decode, "").is_err());
    }

    #[test]
    fn cards_parse_and_are_checked_against_their_key() {
        let c = ClusterPath::new("c1").unwrap();
        let k = c.key(Role::Decode, "d0").unwrap();
        let json = card().to_json();
        assert_eq!(WorkerCard::parse(&c, &k, json.as_bytes()).unwrap(), card());
        let other = c.key(Role::Decode, "d1").unwrap();
        assert!(matches!(
            WorkerCard::parse(&c, &other, json.as_bytes()),
            Err(CardError::KeyMismatch { .. })
        ));
        assert!(matches!(
            WorkerCard::parse(&c, &k, b"{not json"),
            Err(CardError::Json(_))
        ));
        let mut no_addr = card();
        no_addr.grpc_addr.clear();
        assert_eq!(
            WorkerCard::parse(&c, &k, no_addr.to_json().as_bytes()),
            Err(CardError::NoAddress)
        );
    }

    #[test]
    fn expect_pins_the_first_block_size_and_checks_the_model() {
        let e = Expect::new(vec!["m".into(), "alias".into()], None);
        assert_eq!(e.check("alias", 32), Ok(()));
        assert_eq!(
            e.check("m", 16),
            Err(Refusal::BlockSize { got: 16, want: 32 })
        );
        assert_eq!(e.check("other", 32).unwrap_err().label(), "model");
        let fixed = Expect::new(Vec::new(), Some(16));
        assert_eq!(fixed.check("anything", 16), Ok(()));
        assert_eq!(
            fixed.check("anything", 8).unwrap_err().label(),
            "block_size"
        );
    }
}
