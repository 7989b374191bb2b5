//! The LoRA adapters a worker serves, by name: read from PEFT directories at start (`--lora
//! NAME=PATH`) and at run time (`LoadLora`), at most `--max-loras` of them in memory at once.
//!
//! An adapter is an `Arc`: a request holds its adapter for its whole life, so unloading (or
//! dropping one from memory to make room) never pulls weights from under a running request; the
//! memory goes when the last request holding them finishes. When more adapters are served than
//! may be resident, the least recently used of those no request holds leaves memory and is read
//! again from its path when next asked for (its content hash checked: files changed on disk are
//! refused, not served under the old name).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tandem_model::{LoraAdapter, ModelConfig};
use tandem_proto::worker as pb;
use tonic::Status;

/// Why an adapter could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// No adapter of that name is served here.
    #[error("LoRA adapter {0:?} is not loaded on this worker")]
    NotFound(String),
    /// The adapter's files are missing, malformed or do not fit the base model.
    #[error("{0}")]
    Invalid(String),
    /// The name is served with other weights.
    #[error(
        "LoRA adapter {name:?} is already loaded from {path} with other weights: unload it first"
    )]
    Exists {
        /// The name.
        name: String,
        /// Where the weights it has were read from.
        path: String,
    },
    /// The request names other weights than those served under the name.
    #[error(
        "LoRA adapter {name:?} here has content hash {have:016x}, the request's is {want:016x}"
    )]
    Mismatch {
        /// The name.
        name: String,
        /// The served weights' hash.
        have: u64,
        /// The request's.
        want: u64,
    },
    /// Every resident adapter is held by a running request: none can make room.
    #[error("all {0} resident LoRA adapters are in use (--max-loras): retry")]
    Full(usize),
}

impl From<LoraError> for Status {
    fn from(e: LoraError) -> Self {
        let m = e.to_string();
        match e {
            LoraError::NotFound(_) => Status::not_found(m),
            LoraError::Invalid(_) => Status::invalid_argument(m),
            LoraError::Exists { .. } => Status::already_exists(m),
            LoraError::Mismatch { .. } => Status::failed_precondition(m),
            LoraError::Full(_) => Status::resource_exhausted(m),
        }
    }
}

/// One served adapter.
struct Entry {
    path: PathBuf,
    hash: u64,
    rank: usize,
    bytes: usize,
    base_model: String,
    /// Its weights, while resident.
    weights: Option<Arc<LoraAdapter>>,
    /// When it was last asked for (a counter).
    used: u64,
    /// Requests that asked for it.
    requests: u64,
}

impl Entry {
    fn in_use(&self) -> usize {
        self.weights
            .as_ref()
            .map_or(0, |w| Arc::strong_count(w).saturating_sub(1))
    }
}

/// A worker's adapters. Shared by its roles' services.
pub struct Loras {
    base: ModelConfig,
    max_rank: usize,
    max_resident: usize,
    inner: Mutex<(BTreeMap<String, Entry>, u64)>,
}

impl std::fmt::Debug for Loras {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loras")
            .field("served", &self.lock().0.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Loras {
    /// None served yet, for a `base` model: ranks up to `max_rank`, `max_resident` in memory.
    pub fn new(base: ModelConfig, max_rank: usize, max_resident: usize) -> Self {
        Self {
            base,
            max_rank,
            max_resident: max_resident.max(1),
            inner: Mutex::new((BTreeMap::new(), 0)),
        }
    }

    /// None served, and none may be (a worker whose device runs the base model only).
    pub fn none(base: ModelConfig) -> Self {
        Self::new(base, 0, 1)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (BTreeMap<String, Entry>, u64)> {
        // Every operation leaves the map consistent: a panic elsewhere cannot half-change it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self, name: &str, path: &Path) -> Result<LoraAdapter, LoraError> {
        if self.max_rank == 0 {
            return Err(LoraError::Invalid(
                "this worker serves no LoRA adapters (its device runs the base model only)".into(),
            ));
        }
        tandem_model::load_lora(name, path, &self.base, self.max_rank)
            .map_err(|e| LoraError::Invalid(e.to_string()))
    }

    /// Makes room for one more resident adapter: drops the least recently used resident one
    /// that no request holds, if `max_resident` are in memory.
    fn make_room(&self, map: &mut BTreeMap<String, Entry>) -> Result<(), LoraError> {
        let resident = map.values().filter(|e| e.weights.is_some()).count();
        if resident < self.max_resident {
            return Ok(());
        }
        let victim = map
            .values_mut()
            .filter(|e| e.weights.is_some() && e.in_use() == 0)
            .min_by_key(|e| e.used)
            .ok_or(LoraError::Full(self.max_resident))?;
        victim.weights = None;
        Ok(())
    }

    /// Reads the adapter at `path` and serves it as `name` (blocking: it reads the files).
    /// The same files under the same name again are no error; another adapter's name is.
    pub fn load(&self, name: &str, path: &Path) -> Result<pb::LoraInfo, LoraError> {
        if name.is_empty() || name.len() > 256 || name.chars().any(char::is_whitespace) {
            return Err(LoraError::Invalid(format!(
                "LoRA adapter name {name:?}: 1 to 256 characters, no spaces"
            )));
        }
        let a = self.read(name, path)?;
        let mut g = self.lock();
        let (map, tick) = &mut *g;
        let resident = match map.get(name) {
            Some(e) if e.hash != a.content_hash => {
                return Err(LoraError::Exists {
                    name: name.into(),
                    path: e.path.display().to_string(),
                })
            }
            Some(e) => e.weights.is_some(),
            None => false,
        };
        // Served but dropped from memory, or new: it needs a resident slot.
        if !resident {
            self.make_room(map)?;
        }
        *tick += 1;
        let e = map.entry(name.to_string()).or_insert(Entry {
            path: path.to_path_buf(),
            hash: a.content_hash,
            rank: a.rank,
            bytes: a.bytes(),
            base_model: a.base_model.clone().unwrap_or_default(),
            weights: None,
            used: 0,
            requests: 0,
        });
        e.used = *tick;
        if e.weights.is_none() {
            e.weights = Some(Arc::new(a));
        }
        Ok(info(name, e))
    }

    /// Stops serving `name`; requests holding it finish with it.
    pub fn unload(&self, name: &str) -> Result<(), LoraError> {
        match self.lock().0.remove(name) {
            Some(_) => Ok(()),
            None => Err(LoraError::NotFound(name.into())),
        }
    }

    /// The adapter served as `name`, its content hash checked against `want` (0: any); read
    /// again from its path if it left memory (blocking then).
    pub fn get(&self, name: &str, want: u64) -> Result<Arc<LoraAdapter>, LoraError> {
        let path = {
            let mut g = self.lock();
            let (map, tick) = &mut *g;
            *tick += 1;
            let now = *tick;
            let e = map
                .get_mut(name)
                .ok_or_else(|| LoraError::NotFound(name.into()))?;
            if want != 0 && want != e.hash {
                return Err(LoraError::Mismatch {
                    name: name.into(),
                    have: e.hash,
                    want,
                });
            }
            e.used = now;
            e.requests += 1;
            if let Some(w) = &e.weights {
                return Ok(w.clone());
            }
            e.path.clone()
        };
        let a = Arc::new(self.read(name, &path)?);
        let mut g = self.lock();
        let (map, _) = &mut *g;
        let have = map.get(name).map(|e| (e.hash, e.weights.clone()));
        match have {
            None => Err(LoraError::NotFound(name.into())),
            Some((hash, _)) if hash != a.content_hash => Err(LoraError::Invalid(format!(
                "LoRA adapter {name:?}: its files at {} changed since it was loaded",
                path.display()
            ))),
            // Another caller read it meanwhile.
            Some((_, Some(w))) => Ok(w),
            Some((_, None)) => {
                self.make_room(map)?;
                let e = map.get_mut(name).expect("checked above");
                e.weights = Some(a.clone());
                Ok(a)
            }
        }
    }

    /// The adapter a request names, if it names one ([`Self::get`]), read from its files off
    /// the async threads when it is not resident.
    pub async fn resolve(
        self: &Arc<Self>,
        l: Option<&pb::LoraRef>,
    ) -> Result<Option<Arc<LoraAdapter>>, Status> {
        let Some(l) = l else { return Ok(None) };
        let loras = self.clone();
        let (name, hash) = (l.name.clone(), l.content_hash);
        tokio::task::spawn_blocking(move || loras.get(&name, hash))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map(Some)
            .map_err(Status::from)
    }

    /// Every adapter served, by name.
    pub fn list(&self) -> Vec<pb::LoraInfo> {
        self.lock().0.iter().map(|(n, e)| info(n, e)).collect()
    }

    /// Writes the adapters' metrics: how many are served and resident, and per adapter the
    /// requests that asked for it and those running with it now.
    pub fn encode(
        &self,
        enc: &mut prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use crate::metrics::{counter, gauge};
        let list = self.list();
        let resident = list.iter().filter(|i| i.resident).count() as i64;
        gauge(
            enc,
            "tandem_lora_adapters",
            "LoRA adapters this worker serves (served), and of those the ones in memory (resident)",
            &[
                (&[("state", "served")], list.len() as i64),
                (&[("state", "resident")], resident),
            ],
        )?;
        let labels: Vec<[(&str, &str); 1]> = list
            .iter()
            .map(|i| [("lora_adapter", i.name.as_str())])
            .collect();
        let requests: Vec<(&[(&str, &str)], u64)> = labels
            .iter()
            .zip(&list)
            .map(|(l, i)| (&l[..], i.requests))
            .collect();
        counter(
            enc,
            "tandem_lora_requests",
            "Requests that asked for each LoRA adapter here since it was loaded",
            &requests,
        )?;
        let running: Vec<(&[(&str, &str)], i64)> = labels
            .iter()
            .zip(&list)
            .map(|(l, i)| (&l[..], i64::from(i.in_use)))
            .collect();
        gauge(
            enc,
            "tandem_lora_running_requests",
            "Requests holding each LoRA adapter now (running or queued here)",
            &running,
        )
    }

    /// Adapters served.
    pub fn len(&self) -> usize {
        self.lock().0.len()
    }

    /// Whether none is served.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn info(name: &str, e: &Entry) -> pb::LoraInfo {
    pb::LoraInfo {
        name: name.to_string(),
        path: e.path.display().to_string(),
        content_hash: e.hash,
        rank: e.rank as u32,
        bytes: e.bytes as u64,
        resident: e.weights.is_some(),
        in_use: e.in_use() as u32,
        base_model: e.base_model.clone(),
        requests: e.requests,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_model::LoraTarget;

    fn base() -> ModelConfig {
        ModelConfig::from_hf_json(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#,
        )
        .unwrap()
    }

    fn write(dir: &Path, seed: u64) {
        tandem_model::write_random_lora(dir, &base(), 4, 8.0, &[LoraTarget::Q], seed).unwrap();
    }

    #[test]
    fn adapters_load_unload_and_leave_memory_least_recently_used_first() {
        let t = tempfile::tempdir().unwrap();
        for (i, n) in ["a", "b", "c"].iter().enumerate() {
            write(&t.path().join(n), i as u64);
        }
        let l = Loras::new(base(), 8, 2);
        let ia = l.load("a", &t.path().join("a")).unwrap();
        assert!(ia.resident && ia.rank == 4 && ia.bytes > 0);
        // The same files again: no error; other files under the name: refused.
        l.load("a", &t.path().join("a")).unwrap();
        assert!(matches!(
            l.load("a", &t.path().join("b")),
            Err(LoraError::Exists { .. })
        ));
        l.load("b", &t.path().join("b")).unwrap();
        let held = l.get("a", ia.content_hash).unwrap();
        // A third with two resident: b (unheld, older use than a) leaves memory.
        l.load("c", &t.path().join("c")).unwrap();
        let res: Vec<(String, bool, u32)> = l
            .list()
            .into_iter()
            .map(|i| (i.name, i.resident, i.in_use))
            .collect();
        assert_eq!(
            res,
            vec![
                ("a".into(), true, 1),
                ("b".into(), false, 0),
                ("c".into(), true, 0)
            ]
        );
        // Loading b again while it is out of memory takes a slot like any other: c leaves.
        l.load("b", &t.path().join("b")).unwrap();
        let resident: Vec<bool> = l.list().iter().map(|i| i.resident).collect();
        assert_eq!(resident, vec![true, true, false]);
        // b is read back on demand (c, unheld, makes room); a wrong hash is refused.
        let b = l.get("b", 0).unwrap();
        assert!(matches!(
            l.get("b", b.content_hash ^ 1),
            Err(LoraError::Mismatch { .. })
        ));
        // All resident adapters held: nothing can make room for c.
        assert!(matches!(l.get("c", 0), Err(LoraError::Full(2))));
        drop(b);
        assert!(l.get("c", 0).is_ok());
        // Unloading one in use: it is no longer served, and the holder keeps its weights.
        l.unload("a").unwrap();
        assert!(matches!(l.get("a", 0), Err(LoraError::NotFound(_))));
        assert!(held.pair(0, LoraTarget::Q).is_some());
        assert!(matches!(l.unload("a"), Err(LoraError::NotFound(_))));
        // A bad adapter is refused and nothing is kept.
        assert!(matches!(
            l.load("bad", &t.path().join("missing")),
            Err(LoraError::Invalid(_))
        ));
        assert!(matches!(
            l.load("has space", &t.path().join("a")),
            Err(LoraError::Invalid(_))
        ));
        assert_eq!(l.len(), 2);
    }
}
