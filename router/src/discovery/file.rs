//! File discovery: the workers a [`WorkerList`] file names, read again every refresh interval
//! when its text changed. A file that is gone or does not parse keeps the last lists (a
//! supervisor rewriting it must not empty the pools), with the error logged once until it
//! changes; at start it must be readable.

use std::path::PathBuf;
use std::time::Duration;

use tandem_discovery::WorkerList;

use super::{publish, Published};
use crate::workers::WorkerAddr;

/// A router's view of a worker-list file.
pub struct FileDiscovery;

fn addrs(v: &[String]) -> Vec<WorkerAddr> {
    v.iter().map(|a| WorkerAddr::from(a.as_str())).collect()
}

impl FileDiscovery {
    /// Reads `path` (an error if it cannot be read or parsed), publishes its lists and
    /// follows the file every `refresh`.
    pub fn start(path: PathBuf, refresh: Duration) -> Result<Published, String> {
        let first = std::fs::read_to_string(&path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let list = WorkerList::parse(&first).map_err(|e| format!("{}: {e}", path.display()))?;
        let (lists, decode_tx, prefill_tx) = Published::empty();
        publish(&decode_tx, addrs(&list.decode));
        publish(&prefill_tx, addrs(&list.prefill));
        let task = tokio::spawn(async move {
            let mut seen = first;
            let mut failing: Option<String> = None;
            let mut tick = tokio::time::interval(refresh);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let text = match tokio::fs::read_to_string(&path).await {
                    Ok(t) if t == seen => continue,
                    Ok(t) => Ok(t),
                    Err(e) => Err(format!("reading {}: {e}", path.display())),
                };
                let list = text.as_deref().map_err(Clone::clone).and_then(|t| {
                    WorkerList::parse(t).map_err(|e| format!("{}: {e}", path.display()))
                });
                match list {
                    Ok(list) => {
                        publish(&decode_tx, addrs(&list.decode));
                        publish(&prefill_tx, addrs(&list.prefill));
                        failing = None;
                    }
                    Err(e) if failing.as_ref() != Some(&e) => {
                        tracing::error!("worker list: {e}; keeping the last lists");
                        failing = Some(e);
                    }
                    Err(_) => {}
                }
                // A file read (good or bad) is not read again until it changes.
                if let Ok(t) = text {
                    seen = t;
                }
            }
        });
        Ok(lists.kept_by(task))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::Discovery;

    fn names(rx: &tokio::sync::watch::Receiver<Vec<WorkerAddr>>) -> Vec<String> {
        rx.borrow().iter().map(|a| a.as_str().to_string()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn follows_the_file_and_keeps_the_last_lists_while_it_is_broken() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("workers.json");
        assert!(
            FileDiscovery::start(path.clone(), Duration::from_millis(100))
                .err()
                .unwrap()
                .contains("workers.json")
        );
        let write = |decode: &[&str], prefill: &[&str]| {
            WorkerList {
                decode: decode.iter().map(|s| s.to_string()).collect(),
                prefill: prefill.iter().map(|s| s.to_string()).collect(),
            }
            .write(&path)
            .unwrap()
        };
        write(&["127.0.0.1:2", "127.0.0.1:1"], &[]);
        let found = FileDiscovery::start(path.clone(), Duration::from_millis(100)).unwrap();
        let (mut d, mut p) = (found.decode_workers(), found.prefill_workers());
        assert_eq!(names(&d), ["127.0.0.1:1", "127.0.0.1:2"]);
        assert!(names(&p).is_empty());
        d.borrow_and_update();
        p.borrow_and_update();

        // A worker joins each pool.
        write(
            &["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
            &["127.0.0.1:9"],
        );
        d.changed().await.unwrap();
        assert_eq!(names(&d), ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
        p.changed().await.unwrap();
        assert_eq!(names(&p), ["127.0.0.1:9"]);

        // A broken file and a missing one keep the lists.
        std::fs::write(&path, "{\"decode\": [").unwrap();
        tokio::time::sleep(Duration::from_millis(350)).await;
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(!d.has_changed().unwrap());
        assert_eq!(names(&d).len(), 3);

        // Back, with one decode worker drained away.
        write(&["127.0.0.1:3", "127.0.0.1:1"], &["127.0.0.1:9"]);
        d.changed().await.unwrap();
        assert_eq!(names(&d), ["127.0.0.1:1", "127.0.0.1:3"]);
        assert_eq!(names(&p), ["127.0.0.1:9"]);
    }
}
