//! Where the Responses API keeps what `store: true` asks it to keep: each response as last
//! answered, with the conversation it was given, so that `GET /v1/responses/{id}` finds it and
//! a request with `previous_response_id` sends only its new input (the router puts the
//! conversation back together, and the rendered prompt's prefix is the one the worker's
//! prefix cache already holds).
//!
//! Backends: `memory` (this router's own: a cache bounded in bytes, least recently used evicted
//! first, each entry expiring its TTL after it was written) and, with the `etcd` feature,
//! `etcd://HOST:PORT[,...]` (shared by every router of a cluster: one key per response under
//! `/tandem/<cluster>/responses/`, each on a lease of the TTL, so that a follow-up reaching
//! another router replica finds its conversation).
//!
//! Background responses run on the router that took them; [`Running`] holds their cancel
//! switches.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ApiError;

/// One stored response.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(crate) struct StoredResponse {
    /// The response object as last answered (its status, output and usage).
    pub(crate) response: Value,
    /// The conversation the response was given, without its instructions: the items of the
    /// responses before it (their inputs and outputs) and its own input, each with an id.
    pub(crate) input: Vec<Value>,
}

impl StoredResponse {
    /// Bytes it takes, as the memory backend weighs it.
    fn weight(&self) -> u32 {
        let n = serde_json::to_vec(self).map_or(0, |v| v.len());
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The status of the response (`completed`, `in_progress`, ...).
    pub(crate) fn status(&self) -> &str {
        self.response["status"].as_str().unwrap_or("")
    }
}

/// Where stored responses live (`--responses-store`).
#[derive(Clone, Debug, PartialEq)]
pub enum StoreSpec {
    /// This router's memory.
    Memory,
    /// etcd at these endpoints, shared by the cluster's routers.
    Etcd(Vec<String>),
}

impl std::str::FromStr for StoreSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "memory" {
            return Ok(Self::Memory);
        }
        match s.parse::<tandem_discovery::DiscoverySpec>() {
            Ok(tandem_discovery::DiscoverySpec::Etcd { endpoints }) => Ok(Self::Etcd(endpoints)),
            _ => Err(format!(
                "{s:?}: the responses store is `memory` or `etcd://HOST:PORT[,HOST:PORT...]`"
            )),
        }
    }
}

/// The store's settings.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Which backend.
    pub spec: StoreSpec,
    /// Memory backend: most bytes of stored responses kept.
    pub max_bytes: u64,
    /// How long a stored response is kept after it was last written.
    pub ttl: Duration,
    /// The cluster's name (etcd keys live under `/tandem/<cluster>/responses/`).
    pub cluster: String,
    /// etcd: how long a call may take.
    pub timeout: Duration,
}

/// The stored responses.
pub(crate) enum ResponseStore {
    Memory(moka::sync::Cache<String, Arc<StoredResponse>>),
    #[cfg(feature = "etcd")]
    Etcd(Box<tandem_discovery::KvStore>),
}

impl ResponseStore {
    /// The store `cfg` asks for; etcd is reached once here (an error naming it when it does not
    /// answer in time).
    pub(crate) async fn open(cfg: &StoreConfig) -> Result<Self, String> {
        match &cfg.spec {
            StoreSpec::Memory => Ok(Self::memory(cfg.max_bytes, cfg.ttl)),
            #[cfg(feature = "etcd")]
            StoreSpec::Etcd(endpoints) => {
                let prefix = format!("/tandem/{}/responses/", cfg.cluster);
                tandem_discovery::KvStore::connect(endpoints.clone(), prefix, cfg.ttl, cfg.timeout)
                    .await
                    .map(|kv| Self::Etcd(Box::new(kv)))
                    .map_err(|e| format!("--responses-store: {e}"))
            }
            #[cfg(not(feature = "etcd"))]
            StoreSpec::Etcd(_) => Err("--responses-store etcd://...: this tandem was built without etcd support; build it with `cargo build --release --features etcd`".into()),
        }
    }

    /// A memory store of at most `max_bytes`, entries living `ttl` after their last write.
    pub(crate) fn memory(max_bytes: u64, ttl: Duration) -> Self {
        Self::Memory(
            moka::sync::Cache::builder()
                .max_capacity(max_bytes)
                .weigher(|_: &String, v: &Arc<StoredResponse>| v.weight())
                .time_to_live(ttl)
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .build(),
        )
    }

    /// Keeps `r` under `id`, replacing what was there.
    pub(crate) async fn put(&self, id: &str, r: StoredResponse) -> Result<(), ApiError> {
        match self {
            Self::Memory(c) => {
                c.insert(id.to_string(), Arc::new(r));
                Ok(())
            }
            #[cfg(feature = "etcd")]
            Self::Etcd(kv) => {
                let bytes = serde_json::to_vec(&r).map_err(|e| {
                    ApiError::Internal(format!("a response did not serialize: {e}"))
                })?;
                kv.put(id, bytes).await.map_err(store_error)
            }
        }
    }

    /// The response stored under `id`, if any.
    pub(crate) async fn get(&self, id: &str) -> Result<Option<Arc<StoredResponse>>, ApiError> {
        match self {
            Self::Memory(c) => Ok(c.get(id)),
            #[cfg(feature = "etcd")]
            Self::Etcd(kv) => match kv.get(id).await.map_err(store_error)? {
                None => Ok(None),
                Some(bytes) => serde_json::from_slice(&bytes)
                    .map(|r| Some(Arc::new(r)))
                    .map_err(|e| {
                        ApiError::Internal(format!("stored response {id} does not parse: {e}"))
                    }),
            },
        }
    }

    /// Forgets `id`; whether it was there.
    pub(crate) async fn delete(&self, id: &str) -> Result<bool, ApiError> {
        match self {
            Self::Memory(c) => Ok(c.remove(id).is_some()),
            #[cfg(feature = "etcd")]
            Self::Etcd(kv) => kv.delete(id).await.map_err(store_error),
        }
    }
}

#[cfg(feature = "etcd")]
fn store_error(e: tandem_discovery::DiscoveryError) -> ApiError {
    ApiError::Busy(format!("the responses store did not answer: {e}"))
}

/// The background responses running on this router: their cancel switches and tasks.
#[derive(Default)]
pub(crate) struct Running {
    tasks: Mutex<HashMap<String, RunningTask>>,
}

/// A background response's switch (sending stops it) and its task (which stores the response
/// as it ended before it returns).
pub(crate) struct RunningTask {
    pub(crate) cancel: tokio::sync::oneshot::Sender<()>,
    pub(crate) task: tokio::task::JoinHandle<()>,
}

impl Running {
    pub(crate) fn insert(&self, id: String, t: RunningTask) {
        self.tasks.lock().expect("running map").insert(id, t);
    }

    /// Takes `id`'s task out (to cancel it, or because it finished).
    pub(crate) fn take(&self, id: &str) -> Option<RunningTask> {
        self.tasks.lock().expect("running map").remove(id)
    }

    /// Stops `id` where it runs here, once its task has stored how it ended.
    pub(crate) async fn stop(&self, id: &str) {
        if let Some(t) = self.take(id) {
            let _ = t.cancel.send(());
            let _ = t.task.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> StoredResponse {
        StoredResponse {
            response: json!({"id": "r", "status": "completed", "output": [{"text": text}]}),
            input: vec![json!({"type": "message", "role": "user", "content": text})],
        }
    }

    #[tokio::test]
    async fn the_memory_store_keeps_gets_and_deletes() {
        let s = ResponseStore::memory(1 << 20, Duration::from_secs(60));
        assert_eq!(s.get("a").await.unwrap(), None);
        s.put("a", stored("one")).await.unwrap();
        assert_eq!(*s.get("a").await.unwrap().unwrap(), stored("one"));
        s.put("a", stored("two")).await.unwrap();
        assert_eq!(
            s.get("a").await.unwrap().unwrap().response["output"][0]["text"],
            "two"
        );
        assert!(s.delete("a").await.unwrap());
        assert!(!s.delete("a").await.unwrap());
        assert_eq!(s.get("a").await.unwrap(), None);
    }

    /// Over its byte bound, the store evicts the least recently used response first.
    #[tokio::test]
    async fn the_memory_store_evicts_the_least_recently_used_over_its_bound() {
        let one = stored(&"x".repeat(1000));
        let w = u64::from(one.weight());
        let s = ResponseStore::memory(3 * w + w / 2, Duration::from_secs(60));
        let ResponseStore::Memory(cache) = &s else {
            unreachable!()
        };
        for id in ["a", "b", "c"] {
            s.put(id, one.clone()).await.unwrap();
            cache.run_pending_tasks();
        }
        // "a" read: "b" is now the least recently used.
        assert!(s.get("a").await.unwrap().is_some());
        s.put("d", one.clone()).await.unwrap();
        cache.run_pending_tasks();
        assert!(s.get("b").await.unwrap().is_none(), "b evicted");
        for id in ["a", "c", "d"] {
            assert!(s.get(id).await.unwrap().is_some(), "{id} kept");
        }
    }

    /// An entry past its TTL is gone (the TTL here is short; the test waits past it, so it
    /// holds whatever the machine's speed).
    #[tokio::test]
    async fn a_stored_response_expires_after_its_ttl() {
        let s = ResponseStore::memory(1 << 20, Duration::from_millis(50));
        s.put("a", stored("one")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(s.get("a").await.unwrap(), None);
    }

    #[test]
    fn store_specs_parse() {
        assert_eq!("memory".parse::<StoreSpec>().unwrap(), StoreSpec::Memory);
        assert_eq!(
            "etcd://a:2379,b:2379".parse::<StoreSpec>().unwrap(),
            StoreSpec::Etcd(vec!["http://a:2379".into(), "http://b:2379".into()])
        );
        assert!("redis://x".parse::<StoreSpec>().is_err());
        assert!("etcd://".parse::<StoreSpec>().is_err());
    }
}
