//! The worker-list file of `--discovery file:PATH`: the decode and prefill workers' addresses as
//! JSON (`{"decode": ["host:port", ...], "prefill": [...]}`), which the router reads again
//! whenever it changes. `tandem up --autoscale` keeps one as it starts and drains workers; any
//! other supervisor can do the same. Written whole and renamed into place ([`WorkerList::write`]),
//! so a reader never sees half a file.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The workers a list file names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerList {
    /// Decode workers, `host:port` (their gRPC address).
    #[serde(default)]
    pub decode: Vec<String>,
    /// Prefill workers, `host:port`.
    #[serde(default)]
    pub prefill: Vec<String>,
}

impl WorkerList {
    /// Parses a list file's text; refuses an address that is not `host:port`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let list: Self = serde_json::from_str(text).map_err(|e| e.to_string())?;
        for a in list.decode.iter().chain(&list.prefill) {
            let ok = a
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
            if !ok {
                return Err(format!("{a:?} is not host:port"));
            }
        }
        Ok(list)
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes the list to `path` atomically: to a file beside it, then renamed over it.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let name = path
            .file_name()
            .ok_or_else(|| std::io::Error::other(format!("{}: not a file", path.display())))?;
        let mut tmp = path.to_path_buf();
        tmp.set_file_name(format!(".{}.new", name.to_string_lossy()));
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text + "\n")?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_round_trips_and_bad_addresses_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("workers.json");
        let list = WorkerList {
            decode: vec!["127.0.0.1:5000".into(), "w-1:5001".into()],
            prefill: vec![],
        };
        list.write(&path).unwrap();
        assert_eq!(WorkerList::read(&path).unwrap(), list);
        assert_eq!(
            WorkerList::parse(r#"{"decode": ["a:1"]}"#).unwrap().prefill,
            Vec::<String>::new()
        );
        for (bad, says) in [
            (r#"{"decode": ["nowhere"]}"#, "nowhere"),
            (r#"{"decode": [":80"]}"#, ":80"),
            (r#"{"decode": ["a:0"]}"#, "a:0"),
            (r#"{"decode": ["a:1"], "extra": 1}"#, "extra"),
            ("{", "EOF"),
        ] {
            let e = WorkerList::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = WorkerList::read(&dir.path().join("none.json")).unwrap_err();
        assert!(e.contains("none.json"), "{e}");
    }
}
