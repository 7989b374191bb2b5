//! etcd discovery: the workers' cards under `/tandem/<cluster>/`, listed then watched
//! (tandem-discovery's `follow`), each checked against what the router serves before its address
//! reaches a pool. A card that fails the check is logged once with its reason and counted.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tandem_discovery::{follow, Cards, ClusterPath, DiscoveryError, Refusal, Role};
use tokio::sync::watch;

use super::{publish, Published};
use crate::workers::{PoolShared, WorkerAddr};

/// Workers found through their cards in etcd.
pub struct EtcdDiscovery;

impl EtcdDiscovery {
    /// Lists `cluster` in etcd at `endpoints` and follows it. Fails, naming the endpoints, when
    /// etcd does not answer the first list within `timeout`.
    pub async fn start(
        endpoints: Vec<String>,
        cluster: ClusterPath,
        timeout: Duration,
        shared: PoolShared,
    ) -> Result<Published, DiscoveryError> {
        let metrics = shared.metrics.clone();
        let mut cards = follow(
            endpoints,
            cluster,
            timeout,
            Arc::new(move |key, why| {
                tracing::warn!(%key, %why, "skipping a malformed worker card");
                metrics.malformed_card();
            }),
        )
        .await?;
        let (lists, decode, prefill) = Published::empty();
        let mut split = Split {
            shared,
            refused: HashMap::new(),
            decode,
            prefill,
        };
        split.apply(&cards.borrow_and_update());
        let task = tokio::spawn(async move {
            while cards.changed().await.is_ok() {
                let view = cards.borrow_and_update().clone();
                split.apply(&view);
            }
        });
        Ok(lists.kept_by(task))
    }
}

/// Turns the cards into the two address lists.
struct Split {
    shared: PoolShared,
    /// Cards refused, by key, so each refusal is logged and counted once.
    refused: HashMap<String, Refusal>,
    decode: watch::Sender<Vec<WorkerAddr>>,
    prefill: watch::Sender<Vec<WorkerAddr>>,
}

impl Split {
    fn apply(&mut self, cards: &Cards) {
        self.refused.retain(|k, _| cards.contains_key(k));
        let (mut decode, mut prefill) = (Vec::new(), Vec::new());
        for (key, card) in cards {
            match self.shared.expect.check(&card.model, card.block_size) {
                Ok(()) => {
                    self.refused.remove(key);
                    let list = match card.role {
                        Role::Decode => &mut decode,
                        Role::Prefill => &mut prefill,
                    };
                    list.push(WorkerAddr::from(card.grpc_addr.as_str()));
                }
                Err(refusal) => {
                    if self.refused.get(key) != Some(&refusal) {
                        tracing::warn!(%key, worker = %card.grpc_addr, reason = %refusal, "worker refused: not routing to it");
                        self.shared
                            .metrics
                            .worker_refused(card.role, refusal.label());
                        self.refused.insert(key.clone(), refusal);
                    }
                }
            }
        }
        publish(&self.decode, decode);
        publish(&self.prefill, prefill);
    }
}
