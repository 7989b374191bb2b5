//! The disk tier: KV blocks kept in files on a local (or shared) directory, keyed by their
//! chained prefix hash, so that a prefix evicted from a worker's RAM pool, or computed before a
//! restart, is read back instead of computed again.
//!
//! A block is one file, `<dir>/<fingerprint>/<hh>/<hash>.kvb` (`hh` the hash's top byte: no
//! directory holds more than a few thousand files): a 48-byte header, then the payload.
//!
//! | bytes  | field                                                            |
//! |--------|------------------------------------------------------------------|
//! | 0..8   | magic `TNDMKVB1`                                                 |
//! | 8..16  | fingerprint: what the payloads are (model, cache layout, dtype, head split) |
//! | 16..24 | the block's chained hash                                         |
//! | 24..32 | payload length                                                   |
//! | 32..40 | xxh3-64 of the payload, checked on every read                    |
//! | 40..48 | xxh3-64 of bytes 0..40                                           |
//!
//! The fingerprint is also the directory: workers of different models (or cache layouts) share
//! a volume without reading each other's blocks, and each bounds only its own bytes.
//!
//! Writes happen on a writer thread: [`DiskTier::put`] queues a payload and returns (a spill
//! past [`DiskTierConfig::max_pending_bytes`] is dropped and counted, never waited for). A file
//! is written under a temporary name and renamed into place, so a reader sees a whole file or
//! none; a crash can still leave a torn one (a rename that reached the disk before the data),
//! which the length check at startup or the checksum on read refuses. Reads happen on a reader
//! thread ([`DiskTier::load`]), their results sent to the caller's channel; [`DiskTier::contains`]
//! is an index lookup. No I/O ever runs under the index's lock, so a slow disk delays what it
//! delays, never the caller.
//!
//! On open, the index is rebuilt from the directory: every file whose header checks and whose
//! length matches is kept, in the order of its modification time (a read touches it: the order
//! survives restarts), then the oldest are removed until the tier fits its capacity. Plain
//! buffered reads and writes: a block is hundreds of KiB, read whole, and the page cache keeps
//! recently written blocks hot for the reads that follow.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"TNDMKVB1";
const HEADER: usize = 48;

/// Where and how big a disk tier is.
#[derive(Clone, Debug)]
pub struct DiskTierConfig {
    /// The directory (created if missing); the tier's files go in a subdirectory named by the
    /// fingerprint.
    pub dir: PathBuf,
    /// Most bytes of block files kept (headers included); the least recently used go first.
    pub capacity_bytes: u64,
    /// What the payloads are: a digest of everything that makes two workers' blocks of one hash
    /// interchangeable (the model, the cache's layout and element type, the head split).
    pub fingerprint: u64,
    /// Most payload bytes queued for the writer; a block offered past it is dropped.
    pub max_pending_bytes: u64,
    /// For a directory other processes write too (a volume shared by a group of workers): how
    /// often to look for the blocks they wrote (files are read whole when used, and one that
    /// another process removed is a miss then). `None`: only this process writes here.
    pub rescan: Option<Duration>,
}

impl DiskTierConfig {
    /// A tier of `capacity_bytes` in `dir` for payloads of `fingerprint`, with a write queue of
    /// 256 MiB.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64, fingerprint: u64) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes,
            fingerprint,
            max_pending_bytes: 256 << 20,
            rescan: None,
        }
    }
}

/// Why a block could not be read from the tier.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DiskError {
    /// The tier does not hold the block (never written, evicted, or removed as corrupt).
    #[error("block {0:016x} is not on disk")]
    Missing(u64),
    /// The block's file failed a check (header, length or checksum); it was removed.
    #[error("block {hash:016x} on disk is corrupt ({why}); removed")]
    Corrupt {
        /// The block.
        hash: u64,
        /// Which check failed.
        why: String,
    },
    /// The file could not be read.
    #[error("block {hash:016x}: {why}")]
    Io {
        /// The block.
        hash: u64,
        /// The error.
        why: String,
    },
}

/// A block read back: its hash and its payload, or why not.
pub type Loaded = (u64, Result<Vec<u8>, DiskError>);

/// Counters of a tier since it was opened, and what it holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DiskTierStats {
    /// Blocks held now.
    pub blocks: u64,
    /// Bytes of their files now.
    pub bytes: u64,
    /// The capacity in bytes.
    pub capacity_bytes: u64,
    /// Blocks found on disk when the tier opened (after removing torn files).
    pub recovered: u64,
    /// Files refused when the tier opened (bad header or length), and removed.
    pub torn: u64,
    /// Blocks written.
    pub writes: u64,
    /// Payload bytes written.
    pub write_bytes: u64,
    /// Seconds spent writing files.
    pub write_seconds: f64,
    /// Blocks offered while the write queue was full, and dropped.
    pub write_dropped: u64,
    /// Writes that failed (the disk full, the directory gone); the block is not kept.
    pub write_errors: u64,
    /// Blocks read back whole.
    pub reads: u64,
    /// Payload bytes read back.
    pub read_bytes: u64,
    /// Seconds spent reading files (checksums included).
    pub read_seconds: f64,
    /// Reads of blocks the tier did not hold.
    pub read_misses: u64,
    /// Reads refused by a check (header, length, checksum); the file was removed.
    pub checksum_failures: u64,
    /// Blocks removed to stay within the capacity.
    pub evictions: u64,
}

#[derive(Default)]
struct Counters {
    writes: AtomicU64,
    write_bytes: AtomicU64,
    write_nanos: AtomicU64,
    write_dropped: AtomicU64,
    write_errors: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    read_nanos: AtomicU64,
    read_misses: AtomicU64,
    checksum_failures: AtomicU64,
    evictions: AtomicU64,
}

/// What the tier holds: each block's file size and its place in the LRU order.
#[derive(Default)]
struct Index {
    entries: HashMap<u64, (u64, u64)>,
    /// Tick → hash, oldest first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    bytes: u64,
    /// Blocks queued for the writer, their payloads kept here until written: a block spilled a
    /// moment ago is read back from memory (not offered again meanwhile, either).
    queued: HashMap<u64, Arc<Vec<u8>>>,
    pending_bytes: u64,
    /// Blocks that came (`true`) or went (`false`) since the last [`DiskTier::take_changes`].
    changes: Vec<(u64, bool)>,
}

impl Index {
    fn touch(&mut self, hash: u64) {
        if let Some((_, t)) = self.entries.get_mut(&hash) {
            self.lru.remove(t);
            self.tick += 1;
            *t = self.tick;
            self.lru.insert(self.tick, hash);
        }
    }

    fn insert(&mut self, hash: u64, len: u64) {
        self.changes.push((hash, true));
        self.tick += 1;
        if let Some((old, t)) = self.entries.insert(hash, (len, self.tick)) {
            self.lru.remove(&t);
            self.bytes -= old;
        }
        self.lru.insert(self.tick, hash);
        self.bytes += len;
    }

    fn remove(&mut self, hash: u64) -> bool {
        match self.entries.remove(&hash) {
            Some((len, t)) => {
                self.lru.remove(&t);
                self.bytes -= len;
                self.changes.push((hash, false));
                true
            }
            None => false,
        }
    }

    /// The least recently used blocks to remove so that `bytes` fits `capacity`.
    fn over(&mut self, capacity: u64) -> Vec<u64> {
        let mut out = Vec::new();
        while self.bytes > capacity {
            let Some((_, hash)) = self.lru.pop_first() else {
                break;
            };
            let (len, _) = self.entries.remove(&hash).expect("indexed");
            self.bytes -= len;
            self.changes.push((hash, false));
            out.push(hash);
        }
        out
    }
}

struct Shared {
    root: PathBuf,
    fingerprint: u64,
    capacity: u64,
    max_pending: u64,
    index: Mutex<Index>,
    counters: Counters,
    recovered: u64,
    torn: u64,
    /// A stuck disk (tests): file reads and writes wait while it is set.
    stuck: std::sync::atomic::AtomicBool,
    /// Set when the tier closes (the rescan thread stops).
    closing: std::sync::atomic::AtomicBool,
    /// Called after the tier's contents change (its owner reports what it holds).
    notify: Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
    /// Names this process's temporary files apart from other writers' of a shared directory.
    nonce: u64,
}

enum ReadJob {
    Load {
        hashes: Vec<u64>,
        reply: mpsc::Sender<Loaded>,
        wake: Option<Arc<dyn Fn() + Send + Sync>>,
    },
}

/// A worker's disk tier. Dropping it finishes the queued writes and stops its threads.
pub struct DiskTier {
    shared: Arc<Shared>,
    writes: Option<mpsc::Sender<(u64, Arc<Vec<u8>>)>>,
    reads: Option<mpsc::Sender<ReadJob>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("root", &self.shared.root)
            .field("capacity", &self.shared.capacity)
            .finish()
    }
}

impl DiskTier {
    /// Opens (or creates) the tier: rebuilds its index from the files there, removing torn
    /// ones and the oldest past the capacity, and starts its writer and reader threads.
    pub fn open(config: DiskTierConfig) -> std::io::Result<Self> {
        let root = config.dir.join(format!("{:016x}", config.fingerprint));
        fs::create_dir_all(root.join("tmp"))?;
        // Temporary files are writes a crash cut short (an hour old: a shared directory's other
        // writers are not cut short).
        for e in fs::read_dir(root.join("tmp"))?.flatten() {
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age > Duration::from_secs(3600));
            if old {
                let _ = fs::remove_file(e.path());
            }
        }
        let (found, torn) = scan(&root, config.fingerprint, |_| false)?;
        let mut index = Index::default();
        for &(_, hash, len) in &found {
            index.insert(hash, len);
        }
        index.changes.clear();
        let recovered = found.len() as u64;
        let shared = Arc::new(Shared {
            root,
            fingerprint: config.fingerprint,
            capacity: config.capacity_bytes,
            max_pending: config.max_pending_bytes,
            index: Mutex::new(index),
            counters: Counters::default(),
            recovered,
            torn,
            stuck: Default::default(),
            closing: Default::default(),
            notify: Mutex::new(None),
            nonce: rand::random(),
        });
        shared.evict_over();
        let (wtx, wrx) = mpsc::channel::<(u64, Arc<Vec<u8>>)>();
        let (rtx, rrx) = mpsc::channel::<ReadJob>();
        let w = shared.clone();
        let r = shared.clone();
        let threads = vec![
            std::thread::Builder::new()
                .name("kv-disk-write".into())
                .spawn(move || {
                    for (hash, payload) in wrx {
                        w.write(hash, &payload);
                    }
                })?,
            std::thread::Builder::new()
                .name("kv-disk-read".into())
                .spawn(move || {
                    for job in rrx {
                        let ReadJob::Load {
                            hashes,
                            reply,
                            wake,
                        } = job;
                        for hash in hashes {
                            if reply.send((hash, r.read(hash))).is_err() {
                                break;
                            }
                            if let Some(wake) = &wake {
                                wake();
                            }
                        }
                    }
                })?,
        ];
        let mut tier = Self {
            shared,
            writes: Some(wtx),
            reads: Some(rtx),
            threads,
        };
        if let Some(every) = config.rescan {
            let s = tier.shared.clone();
            tier.threads.push(
                std::thread::Builder::new()
                    .name("kv-disk-scan".into())
                    .spawn(move || s.rescan_every(every))?,
            );
        }
        Ok(tier)
    }

    /// Whether the tier holds `hash`: written whole, or queued for writing (a read takes it
    /// from the queue then).
    pub fn contains(&self, hash: u64) -> bool {
        let ix = self.shared.lock();
        ix.entries.contains_key(&hash) || ix.queued.contains_key(&hash)
    }

    /// Every block held now (what a snapshot of the tier reports).
    pub fn hashes(&self) -> Vec<u64> {
        self.shared.lock().entries.keys().copied().collect()
    }

    /// The blocks that came (`true`: written, or found written by another process) or went
    /// (`false`: evicted, refused, gone) since the last call, in order. What the tier held when
    /// it opened is not a change: [`Self::hashes`] says it.
    pub fn take_changes(&self) -> Vec<(u64, bool)> {
        std::mem::take(&mut self.shared.lock().changes)
    }

    /// Calls `notify` (from the tier's threads) after each change of its contents.
    pub fn set_notify(&self, notify: Arc<dyn Fn() + Send + Sync>) {
        *self.shared.notify.lock().unwrap_or_else(|p| p.into_inner()) = Some(notify);
    }

    /// Whether `hash` is held or queued: a spill of it would be redundant.
    pub fn has_or_queued(&self, hash: u64) -> bool {
        self.contains(hash)
    }

    /// Queues a block for writing; false (counted) when it was dropped because the queue is full,
    /// or when the tier holds or queues it already.
    pub fn put(&self, hash: u64, payload: Vec<u8>) -> bool {
        let len = payload.len() as u64;
        {
            let ix = self.shared.lock();
            if ix.entries.contains_key(&hash) || ix.queued.contains_key(&hash) {
                return false;
            }
            if ix.pending_bytes + len > self.shared.max_pending {
                drop(ix);
                self.shared
                    .counters
                    .write_dropped
                    .fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
        let payload = Arc::new(payload);
        {
            let mut ix = self.shared.lock();
            ix.queued.insert(hash, payload.clone());
            ix.pending_bytes += len;
        }
        let sent = self
            .writes
            .as_ref()
            .is_some_and(|w| w.send((hash, payload)).is_ok());
        if !sent {
            let mut ix = self.shared.lock();
            ix.queued.remove(&hash);
            ix.pending_bytes -= len;
        }
        sent
    }

    /// Reads `hashes` back on the reader thread, in order, each result sent to `reply` as it is
    /// read (then `wake` called, if given: the receiver's owner may be waiting on something
    /// else).
    pub fn load(
        &self,
        hashes: Vec<u64>,
        reply: mpsc::Sender<Loaded>,
        wake: Option<Arc<dyn Fn() + Send + Sync>>,
    ) {
        if let Some(r) = &self.reads {
            let _ = r.send(ReadJob::Load {
                hashes,
                reply,
                wake,
            });
        }
    }

    /// Reads one block here, on the caller's thread (checked as every read is).
    pub fn read(&self, hash: u64) -> Result<Vec<u8>, DiskError> {
        self.shared.read(hash)
    }

    /// Waits until every block queued so far is written (or dropped for an error).
    pub fn flush(&self) {
        loop {
            if self.shared.lock().queued.is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The tier's counters and contents now.
    pub fn stats(&self) -> DiskTierStats {
        let s = &self.shared;
        let c = &s.counters;
        let ix = s.lock();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DiskTierStats {
            blocks: ix.entries.len() as u64,
            bytes: ix.bytes,
            capacity_bytes: s.capacity,
            recovered: s.recovered,
            torn: s.torn,
            writes: get(&c.writes),
            write_bytes: get(&c.write_bytes),
            write_seconds: get(&c.write_nanos) as f64 * 1e-9,
            write_dropped: get(&c.write_dropped),
            write_errors: get(&c.write_errors),
            reads: get(&c.reads),
            read_bytes: get(&c.read_bytes),
            read_seconds: get(&c.read_nanos) as f64 * 1e-9,
            read_misses: get(&c.read_misses),
            checksum_failures: get(&c.checksum_failures),
            evictions: get(&c.evictions),
        }
    }

    /// Makes the disk stuck, or not: while it is, every file read and write waits (tests of a
    /// disk slower than anything, without timing anything).
    #[cfg(feature = "fault-injection")]
    pub fn set_stuck(&self, stuck: bool) {
        self.shared.stuck.store(stuck, Ordering::SeqCst);
    }

    /// Where a block's file is (for tests that damage one).
    pub fn path_of(&self, hash: u64) -> PathBuf {
        self.shared.path(hash)
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // Closing the queues ends the threads once they have done what was queued.
        self.shared.closing.store(true, Ordering::SeqCst);
        self.writes.take();
        self.reads.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.root
            .join(format!("{:02x}", hash >> 56))
            .join(format!("{hash:016x}.kvb"))
    }

    fn wait_unstuck(&self) {
        while self.stuck.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Adds the blocks other writers of the directory stored, every `every`, until the tier
    /// closes.
    fn rescan_every(&self, every: Duration) {
        let mut since = Instant::now();
        while !self.closing.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50).min(every));
            if since.elapsed() < every {
                continue;
            }
            since = Instant::now();
            let known = |h: u64| self.lock().entries.contains_key(&h);
            match scan(&self.root, self.fingerprint, known) {
                Ok((found, _)) if !found.is_empty() => {
                    let mut ix = self.lock();
                    for (_, hash, len) in found {
                        if !ix.entries.contains_key(&hash) {
                            ix.insert(hash, len);
                        }
                    }
                    drop(ix);
                    self.evict_over();
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "rescanning the KV disk tier"),
            }
        }
    }

    fn notify(&self) {
        let n = self
            .notify
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(n) = n {
            n();
        }
    }

    /// Removes the least recently used blocks past the capacity, then tells the owner what
    /// changed (a write or a scan calls it after adding blocks).
    fn evict_over(&self) {
        let gone = self.over(&mut self.lock());
        self.remove_files(gone);
    }

    /// Takes the least recently used blocks past the capacity out of the index, counted as
    /// evicted under the same lock (the stats never see a block gone but not counted); their
    /// files are removed after, by [`Self::remove_files`].
    fn over(&self, ix: &mut Index) -> Vec<u64> {
        let gone = ix.over(self.capacity);
        self.counters
            .evictions
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        gone
    }

    /// Removes evicted blocks' files, then tells the owner what changed.
    fn remove_files(&self, gone: Vec<u64>) {
        for hash in gone {
            let _ = fs::remove_file(self.path(hash));
        }
        self.notify();
    }

    /// The writer thread's work for one block.
    fn write(&self, hash: u64, payload: &[u8]) {
        self.wait_unstuck();
        let t = Instant::now();
        let len = (HEADER + payload.len()) as u64;
        let result = if len > self.capacity {
            Err(std::io::Error::other("the block is larger than the tier"))
        } else {
            self.write_file(hash, payload)
        };
        // The block leaves the queue, is indexed, counted and what it pushes past the
        // capacity evicted under one lock: `flush` returns once the queue is empty, and the
        // stats it is followed by then hold the write whole.
        let mut ix = self.lock();
        ix.queued.remove(&hash);
        ix.pending_bytes -= payload.len() as u64;
        let c = &self.counters;
        match result {
            Ok(()) => {
                ix.insert(hash, len);
                c.writes.fetch_add(1, Ordering::Relaxed);
                c.write_bytes
                    .fetch_add(payload.len() as u64, Ordering::Relaxed);
                c.write_nanos
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let gone = self.over(&mut ix);
                drop(ix);
                self.remove_files(gone);
            }
            Err(e) => {
                c.write_errors.fetch_add(1, Ordering::Relaxed);
                drop(ix);
                tracing::warn!(hash = format!("{hash:016x}"), error = %e, "a KV block was not written to disk");
            }
        }
    }

    fn write_file(&self, hash: u64, payload: &[u8]) -> std::io::Result<()> {
        let path = self.path(hash);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let tmp = self.root.join("tmp").join(format!(
            "{hash:016x}.{:016x}.{}",
            self.nonce,
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let header = header(self.fingerprint, hash, payload);
        let written = (|| {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&header)?;
            f.write_all(payload)?;
            fs::rename(&tmp, &path)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }

    /// One block's payload, checked; a block that fails a check is removed.
    fn read(&self, hash: u64) -> Result<Vec<u8>, DiskError> {
        let t = Instant::now();
        let queued = {
            let ix = self.lock();
            if !ix.entries.contains_key(&hash) && !ix.queued.contains_key(&hash) {
                drop(ix);
                self.counters.read_misses.fetch_add(1, Ordering::Relaxed);
                return Err(DiskError::Missing(hash));
            }
            ix.queued.get(&hash).cloned()
        };
        if let Some(payload) = queued {
            // Spilled a moment ago and not written yet: the payload is still in memory.
            self.count_read(payload.len(), t);
            return Ok(payload.as_ref().clone());
        }
        self.wait_unstuck();
        let path = self.path(hash);
        let mut bytes = Vec::new();
        let read = fs::File::open(&path).and_then(|mut f| f.read_to_end(&mut bytes));
        if let Err(e) = read {
            // Gone underneath the index (a shared directory's other writer evicted it).
            self.lock().remove(hash);
            self.notify();
            self.counters.read_misses.fetch_add(1, Ordering::Relaxed);
            return Err(match e.kind() {
                std::io::ErrorKind::NotFound => DiskError::Missing(hash),
                _ => DiskError::Io {
                    hash,
                    why: e.to_string(),
                },
            });
        }
        if let Err(why) = check_bytes(&bytes, self.fingerprint, hash, true) {
            tracing::warn!(path = %path.display(), why, "a corrupt KV block file: removed");
            self.lock().remove(hash);
            let _ = fs::remove_file(&path);
            self.notify();
            self.counters
                .checksum_failures
                .fetch_add(1, Ordering::Relaxed);
            return Err(DiskError::Corrupt { hash, why });
        }
        self.lock().touch(hash);
        // The modification time is the LRU order a restart rebuilds.
        if let Ok(f) = fs::File::options().append(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        bytes.drain(..HEADER);
        self.count_read(bytes.len(), t);
        Ok(bytes)
    }

    /// Counts a block of `len` payload bytes read back, begun at `t`.
    fn count_read(&self, len: usize, t: Instant) {
        let c = &self.counters;
        c.reads.fetch_add(1, Ordering::Relaxed);
        c.read_bytes.fetch_add(len as u64, Ordering::Relaxed);
        c.read_nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

fn header(fingerprint: u64, hash: u64, payload: &[u8]) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..8].copy_from_slice(MAGIC);
    h[8..16].copy_from_slice(&fingerprint.to_le_bytes());
    h[16..24].copy_from_slice(&hash.to_le_bytes());
    h[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[32..40].copy_from_slice(&xxh3_64(payload).to_le_bytes());
    let check = xxh3_64(&h[..40]);
    h[40..48].copy_from_slice(&check.to_le_bytes());
    h
}

/// Checks a file's header, and its payload's checksum when `payload` (the whole file in
/// `bytes`, or only its header when not).
fn check_bytes(bytes: &[u8], fingerprint: u64, hash: u64, payload: bool) -> Result<u64, String> {
    if bytes.len() < HEADER {
        return Err(format!("{} bytes, shorter than a header", bytes.len()));
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    if &bytes[..8] != MAGIC {
        return Err("not a block file".into());
    }
    if xxh3_64(&bytes[..40]) != word(40) {
        return Err("header checksum".into());
    }
    if word(8) != fingerprint || word(16) != hash {
        return Err("another block's header".into());
    }
    let len = word(24);
    if payload {
        if bytes.len() as u64 != HEADER as u64 + len {
            return Err(format!("{} payload bytes of {len}", bytes.len() - HEADER));
        }
        if xxh3_64(&bytes[HEADER..]) != word(32) {
            return Err("payload checksum".into());
        }
    }
    Ok(len)
}

/// A block file found by a scan: its modification time, hash and size.
type Found = (SystemTime, u64, u64);

/// The block files under `root` whose hashes `skip` does not name, each checked
/// ([`check_file`]), oldest first; and how many were torn (removed).
fn scan(
    root: &Path,
    fingerprint: u64,
    skip: impl Fn(u64) -> bool,
) -> std::io::Result<(Vec<Found>, u64)> {
    let mut found = Vec::new();
    let mut torn = 0;
    for sub in fs::read_dir(root)?.flatten() {
        let name = sub.file_name();
        if name.len() != 2 || !sub.path().is_dir() {
            continue;
        }
        for e in fs::read_dir(sub.path())?.flatten() {
            let path = e.path();
            let Some(hash) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".kvb"))
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            else {
                continue;
            };
            if skip(hash) {
                continue;
            }
            match check_file(&path, fingerprint, hash) {
                Ok((len, modified)) => found.push((modified, hash, len)),
                Err(why) => {
                    tracing::warn!(path = %path.display(), why, "a torn KV block file: removed");
                    let _ = fs::remove_file(&path);
                    torn += 1;
                }
            }
        }
    }
    found.sort();
    Ok((found, torn))
}

/// A file found when the tier opens: its header checked and its length matched (the payload is
/// checked when read). Its size and modification time.
fn check_file(path: &Path, fingerprint: u64, hash: u64) -> Result<(u64, SystemTime), String> {
    let mut f = fs::File::open(path).map_err(|e| e.to_string())?;
    let meta = f.metadata().map_err(|e| e.to_string())?;
    let mut head = [0u8; HEADER];
    f.read_exact(&mut head)
        .map_err(|_| format!("{} bytes, shorter than a header", meta.len()))?;
    let len = check_bytes(&head, fingerprint, hash, false)?;
    if meta.len() != HEADER as u64 + len {
        return Err(format!(
            "{} payload bytes of {len}",
            meta.len().saturating_sub(HEADER as u64)
        ));
    }
    let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
    Ok((meta.len(), modified))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
    }

    fn tier(dir: &Path, capacity: u64) -> DiskTier {
        DiskTier::open(DiskTierConfig::new(dir, capacity, 0xfeed)).unwrap()
    }

    #[test]
    fn a_block_comes_back_as_written_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let t = tier(dir.path(), 1 << 20);
        assert!(t.put(7, block(7, 1000)));
        assert!(!t.put(7, block(7, 1000)), "offered twice");
        t.flush();
        assert!(t.contains(7));
        assert_eq!(t.read(7).unwrap(), block(7, 1000));
        assert_eq!(t.read(8), Err(DiskError::Missing(8)));
        let s = t.stats();
        assert_eq!((s.blocks, s.writes, s.reads, s.read_misses), (1, 1, 1, 1));
        assert_eq!(s.bytes, (HEADER + 1000) as u64);
        drop(t);
        let t = tier(dir.path(), 1 << 20);
        assert_eq!(t.stats().recovered, 1);
        assert_eq!(t.read(7).unwrap(), block(7, 1000));
        // Another fingerprint sees nothing of it.
        let other = DiskTier::open(DiskTierConfig::new(dir.path(), 1 << 20, 0xbeef)).unwrap();
        assert!(!other.contains(7));
    }

    #[test]
    fn the_tier_reports_what_came_and_went() {
        let dir = tempfile::tempdir().unwrap();
        let file = (HEADER + 100) as u64;
        let t = tier(dir.path(), 2 * file);
        let told = Arc::new(AtomicU64::new(0));
        let n = told.clone();
        t.set_notify(Arc::new(move || {
            n.fetch_add(1, Ordering::Relaxed);
        }));
        for h in [1u64, 2, 3] {
            t.put(h, block(h, 100));
            t.flush();
        }
        // 3 pushed 1 out; then 2 is damaged and refused on read.
        let p = t.path_of(2);
        fs::write(&p, b"garbage").unwrap();
        assert!(t.read(2).is_err());
        assert_eq!(
            t.take_changes(),
            [(1, true), (2, true), (3, true), (1, false), (2, false)]
        );
        assert!(t.take_changes().is_empty());
        assert!(told.load(Ordering::Relaxed) >= 4);
        let mut held = t.hashes();
        held.sort();
        assert_eq!(held, [3]);
        // Reopened: what it holds is its contents, not a change.
        drop(t);
        let t = tier(dir.path(), 2 * file);
        assert_eq!(t.hashes(), [3]);
        assert!(t.take_changes().is_empty());
    }

    #[test]
    fn a_damaged_file_is_refused_counted_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let t = tier(dir.path(), 1 << 20);
        for h in [1u64, 2, 3] {
            t.put(h, block(h, 500));
        }
        t.flush();
        // A flipped payload byte: found by the checksum on read.
        let p = t.path_of(1);
        let mut bytes = fs::read(&p).unwrap();
        bytes[HEADER + 100] ^= 1;
        fs::write(&p, bytes).unwrap();
        assert!(matches!(t.read(1), Err(DiskError::Corrupt { hash: 1, .. })));
        assert!(!t.contains(1) && !p.exists());
        assert_eq!(t.stats().checksum_failures, 1);
        // A torn file (cut short) and a foreign one: refused when the tier opens.
        let p2 = t.path_of(2);
        let bytes = fs::read(&p2).unwrap();
        fs::write(&p2, &bytes[..bytes.len() - 10]).unwrap();
        let p3 = t.path_of(3);
        fs::write(&p3, b"not a block").unwrap();
        drop(t);
        let t = tier(dir.path(), 1 << 20);
        let s = t.stats();
        assert_eq!((s.recovered, s.torn, s.blocks), (0, 2, 0));
        assert!(!p2.exists() && !p3.exists());
    }

    #[test]
    fn the_tier_keeps_to_its_capacity_dropping_the_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        let file = (HEADER + 1000) as u64;
        let t = tier(dir.path(), 3 * file);
        for h in [1u64, 2, 3] {
            t.put(h, block(h, 1000));
            t.flush();
        }
        // Reading 1 makes 2 the oldest.
        t.read(1).unwrap();
        t.put(4, block(4, 1000));
        t.flush();
        let held: Vec<bool> = (1..=4).map(|h| t.contains(h)).collect();
        assert_eq!(held, [true, false, true, true]);
        assert!(!t.path_of(2).exists());
        let s = t.stats();
        assert_eq!((s.evictions, s.bytes), (1, 3 * file));
        // The order survives a restart (modification times), and a smaller capacity evicts the
        // oldest on open.
        drop(t);
        let t = tier(dir.path(), 2 * file);
        let held: Vec<bool> = (1..=4).map(|h| t.contains(h)).collect();
        assert_eq!(held.iter().filter(|&&h| h).count(), 2);
        assert!(t.contains(4), "the newest stays");
    }

    #[test]
    fn a_full_queue_drops_spills_instead_of_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = DiskTierConfig::new(dir.path(), 1 << 20, 1);
        c.max_pending_bytes = 2500;
        let t = DiskTier::open(c).unwrap();
        // Nothing is written while the disk is stuck: two blocks fit the queue, the others are
        // dropped, and none of the calls waits for the disk.
        t.set_stuck(true);
        let offered: Vec<bool> = (0..4).map(|h| t.put(h, block(h, 1000))).collect();
        assert_eq!(offered, [true, true, false, false]);
        assert_eq!(t.stats().write_dropped, 2);
        // A queued block is held: read back from memory while the disk is stuck.
        assert!(t.contains(0) && !t.contains(2));
        assert_eq!(t.read(1).unwrap(), block(1, 1000));
        assert!(t.hashes().is_empty(), "nothing written yet");
        t.set_stuck(false);
        t.flush();
        assert!(t.contains(0) && t.contains(1) && !t.contains(2));
    }

    #[test]
    fn tiers_sharing_a_directory_find_each_others_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let shared = |d: &Path| {
            let mut c = DiskTierConfig::new(d, 1 << 20, 3);
            c.rescan = Some(Duration::from_millis(1));
            DiskTier::open(c).unwrap()
        };
        let (a, b) = (shared(dir.path()), shared(dir.path()));
        a.put(21, block(21, 700));
        a.flush();
        // The other tier's next scan indexes it (bounded only against a scan that never runs).
        let end = Instant::now() + Duration::from_secs(300);
        while !b.contains(21) {
            assert!(Instant::now() < end, "never found");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(b.read(21).unwrap(), block(21, 700));
        // Removed by the one that wrote it: the other's read is a miss, and its index forgets.
        fs::remove_file(a.path_of(21)).unwrap();
        assert_eq!(b.read(21), Err(DiskError::Missing(21)));
        assert!(!b.contains(21));
    }

    #[test]
    fn loads_arrive_on_the_callers_channel_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let t = tier(dir.path(), 1 << 20);
        for h in [5u64, 6] {
            t.put(h, block(h, 300));
        }
        t.flush();
        let (tx, rx) = mpsc::channel();
        let woken = Arc::new(AtomicU64::new(0));
        let w = woken.clone();
        t.load(
            vec![5, 9, 6],
            tx,
            Some(Arc::new(move || {
                w.fetch_add(1, Ordering::Relaxed);
            })),
        );
        let got: Vec<Loaded> = rx.iter().take(3).collect();
        assert_eq!(got[0], (5, Ok(block(5, 300))));
        assert_eq!(got[1], (9, Err(DiskError::Missing(9))));
        assert_eq!(got[2], (6, Ok(block(6, 300))));
        drop(t);
        assert_eq!(woken.load(Ordering::Relaxed), 3);
    }
}
