//! Tenants: which tenant an API key belongs to and what that tenant may use, read from
//! `--tenants FILE` (JSON or YAML) and read again when the file changes.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Tenants whose name labels the per-tenant metrics, in the file's order; the rest share the
/// label `other`, so a file of thousands of tenants cannot blow up the series a scrape holds.
pub const MAX_LABELLED: usize = 64;

/// The label of the tenants past [`MAX_LABELLED`].
pub const OTHER_LABEL: &str = "other";

/// One tenant as the file gives it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// The tenant's name: its metrics label and trace attribute (1 to 64 of `A-Z a-z 0-9 _ . -`).
    pub name: String,
    /// The API keys that are this tenant's (sent as `Authorization: Bearer KEY`).
    pub keys: Vec<String>,
    /// Its priority band: a higher band's requests are dispatched first, and the engines admit
    /// them first and preempt them last (default 0; negative is lower).
    #[serde(default)]
    pub priority: i32,
    /// Its share within its band when the band's tenants all wait (default 1): tokens served
    /// count against it divided by this.
    #[serde(default = "one")]
    pub weight: f64,
    /// Most requests a minute (a bucket of this many, refilled evenly).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Most tokens (prompt and output) a minute, a bucket likewise.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Most of its requests at the workers at once; more wait in the router's queue.
    #[serde(default)]
    pub max_concurrent: Option<u32>,
    /// Longest one of its requests waits in the router's queue before it is refused (503);
    /// default: the router's `--max-queue-wait-ms`.
    #[serde(default)]
    pub max_queue_wait_ms: Option<u64>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    tenants: Vec<TenantSpec>,
}

/// A tenants file, checked: every key maps to one tenant.
#[derive(Debug)]
pub struct TenantTable {
    /// The tenants in the file's order.
    pub tenants: Vec<TenantSpec>,
    /// Each key's SHA-256 digest, to the index of its tenant.
    by_key: HashMap<[u8; 32], usize>,
}

impl TenantTable {
    /// Reads a tenants file's text: JSON when `json` (or when it starts with `{`), else YAML.
    pub fn parse(text: &str, json: bool) -> Result<Self, String> {
        let file: TenantsFile = if json || text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| e.to_string())?
        } else {
            serde_saphyr::from_str(text).map_err(|e| e.to_string())?
        };
        Self::new(file.tenants)
    }

    /// The table of `tenants`, or what is wrong with them.
    pub fn new(tenants: Vec<TenantSpec>) -> Result<Self, String> {
        if tenants.is_empty() {
            return Err("no tenants: every request would be refused".into());
        }
        let mut names = HashSet::new();
        let mut by_key = HashMap::new();
        for (i, t) in tenants.iter().enumerate() {
            let ok_name = !t.name.is_empty()
                && t.name.len() <= 64
                && t.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
            if !ok_name {
                return Err(format!(
                    "tenant {:?}: a name is 1 to 64 of A-Z a-z 0-9 _ . -",
                    t.name
                ));
            }
            if t.name == OTHER_LABEL {
                return Err(format!(
                    "tenant {OTHER_LABEL:?}: that name labels the tenants past the first {MAX_LABELLED}"
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(format!("tenant {:?} appears twice", t.name));
            }
            if t.keys.is_empty() {
                return Err(format!("tenant {:?} has no keys", t.name));
            }
            for k in &t.keys {
                if k.is_empty() || k.chars().any(char::is_whitespace) {
                    return Err(format!(
                        "tenant {:?}: a key is empty or has whitespace in it",
                        t.name
                    ));
                }
                let digest: [u8; 32] = Sha256::digest(k.as_bytes()).into();
                if let Some(j) = by_key.insert(digest, i) {
                    return Err(format!(
                        "a key of tenant {:?} is also tenant {:?}'s",
                        t.name, tenants[j].name
                    ));
                }
            }
            if !(t.weight.is_finite() && t.weight > 0.0) {
                return Err(format!("tenant {:?}: weight must be above 0", t.name));
            }
            let zero = [
                ("requests_per_minute", t.requests_per_minute.map(u64::from)),
                ("tokens_per_minute", t.tokens_per_minute),
                ("max_concurrent", t.max_concurrent.map(u64::from)),
                ("max_queue_wait_ms", t.max_queue_wait_ms),
            ]
            .into_iter()
            .find(|(_, v)| *v == Some(0));
            if let Some((field, _)) = zero {
                return Err(format!(
                    "tenant {:?}: {field} must be at least 1 (leave it out for no limit)",
                    t.name
                ));
            }
        }
        Ok(Self { tenants, by_key })
    }

    /// The tenant whose key `token` is.
    pub fn lookup(&self, token: &str) -> Option<&TenantSpec> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_key.get(&digest).map(|&i| &self.tenants[i])
    }

    /// The metrics label of the tenant at `index` in the file.
    pub fn label(index: usize, name: &str) -> String {
        if index < MAX_LABELLED {
            name.to_string()
        } else {
            OTHER_LABEL.to_string()
        }
    }
}

/// The tenants file as last read well: a file that stops parsing leaves the tenants as they
/// were (and says why in the log and in `tandem_router_tenants_reloads_total{outcome="error"}`).
pub struct Tenants {
    path: PathBuf,
    table: RwLock<(Arc<TenantTable>, [u8; 32])>,
}

impl Tenants {
    /// Reads `path`; an error names the file and what is wrong with it.
    pub fn load(path: &Path) -> Result<Self, String> {
        let (table, digest) = read(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            table: RwLock::new((Arc::new(table), digest)),
        })
    }

    /// The tenants now.
    pub fn table(&self) -> Arc<TenantTable> {
        self.table
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// Reads the file again: the new table when its bytes changed and it parses, `None` when
    /// they did not change, the error when it does not parse (the old table stays).
    pub fn reload(&self) -> Result<Option<Arc<TenantTable>>, String> {
        let bytes = std::fs::read(&self.path)
            .map_err(|e| format!("cannot read tenants file {}: {e}", self.path.display()))?;
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        if self.table.read().unwrap_or_else(|e| e.into_inner()).1 == digest {
            return Ok(None);
        }
        let (table, digest) = parse(&self.path, &bytes)?;
        let table = Arc::new(table);
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = (table.clone(), digest);
        Ok(Some(table))
    }
}

fn read(path: &Path) -> Result<(TenantTable, [u8; 32]), String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read tenants file {}: {e}", path.display()))?;
    parse(path, &bytes)
}

fn parse(path: &Path, bytes: &[u8]) -> Result<(TenantTable, [u8; 32]), String> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| format!("tenants file {} is not UTF-8 text", path.display()))?;
    let json = path.extension().is_some_and(|e| e == "json");
    let table = TenantTable::parse(text, json)
        .map_err(|e| format!("tenants file {}: {e}", path.display()))?;
    Ok((table, Sha256::digest(bytes).into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "
tenants:
  - name: a
    keys: [ka1, ka2]
    priority: 1
    requests_per_minute: 60
    tokens_per_minute: 20000
    max_concurrent: 8
  - name: b
    keys: [kb]
";

    #[test]
    fn yaml_and_json_give_the_same_tenants_and_keys_find_theirs() {
        let y = TenantTable::parse(YAML, false).unwrap();
        let j = TenantTable::parse(
            r#"{"tenants": [{"name": "a", "keys": ["ka1", "ka2"], "priority": 1,
                "requests_per_minute": 60, "tokens_per_minute": 20000, "max_concurrent": 8},
               {"name": "b", "keys": ["kb"]}]}"#,
            false,
        )
        .unwrap();
        assert_eq!(y.tenants, j.tenants);
        let a = &y.tenants[0];
        assert_eq!(
            (a.priority, a.requests_per_minute, a.tokens_per_minute),
            (1, Some(60), Some(20000))
        );
        assert_eq!((a.max_concurrent, a.weight), (Some(8), 1.0));
        assert_eq!(y.tenants[1].priority, 0);
        assert_eq!(y.lookup("ka2").unwrap().name, "a");
        assert_eq!(y.lookup("kb").unwrap().name, "b");
        assert!(y.lookup("kc").is_none());
        assert!(y.lookup("ka").is_none());
    }

    #[test]
    fn a_file_that_cannot_work_is_refused_with_the_reason() {
        let cases = [
            ("tenants: []", "no tenants"),
            (
                "tenants: [{name: a, keys: [k]}, {name: a, keys: [j]}]",
                "appears twice",
            ),
            (
                "tenants: [{name: a, keys: [k]}, {name: b, keys: [k]}]",
                "also tenant \"a\"'s",
            ),
            ("tenants: [{name: a, keys: []}]", "no keys"),
            ("tenants: [{name: 'a b', keys: [k]}]", "a name is"),
            ("tenants: [{name: other, keys: [k]}]", "labels the tenants"),
            ("tenants: [{name: a, keys: ['k k']}]", "whitespace"),
            (
                "tenants: [{name: a, keys: [k], requests_per_minute: 0}]",
                "requests_per_minute must be at least 1",
            ),
            ("tenants: [{name: a, keys: [k], weight: 0}]", "weight"),
            ("tenants: [{name: a, keys: [k], quota: 3}]", "quota"),
            (
                "tenants: [{name: a, keys: [k], priority: high}]",
                "priority",
            ),
        ];
        for (text, want) in cases {
            let e = TenantTable::parse(text, false).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn a_reload_takes_a_changed_file_and_keeps_the_old_tenants_over_a_broken_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.yaml");
        std::fs::write(&path, YAML).unwrap();
        let t = Tenants::load(&path).unwrap();
        assert!(t.reload().unwrap().is_none(), "unchanged");
        std::fs::write(&path, YAML.replace("60", "120")).unwrap();
        let new = t.reload().unwrap().expect("changed");
        assert_eq!(new.tenants[0].requests_per_minute, Some(120));
        std::fs::write(&path, "tenants: [{name: a}]").unwrap();
        let e = t.reload().unwrap_err();
        assert!(e.contains("tenants.yaml") && e.contains("keys"), "{e}");
        assert_eq!(t.table().tenants[0].requests_per_minute, Some(120));
        assert!(Tenants::load(&dir.path().join("none.yaml"))
            .err()
            .unwrap()
            .contains("cannot read"));
    }
}
