//! Ranks that are threads of one process, exchanging through one shared allocation.
//!
//! Each rank owns two slots (double buffering) of `capacity` values, each with a ready stamp and
//! a length. A collective is a round: every rank writes its contribution (perhaps empty) into its
//! slot of the round's parity, stamps it with the round's number (release), waits until every
//! rank's stamp shows the round (acquire), and reads what it needs. A rank starts round `s` only
//! after every rank stamped round `s - 1`, which each did only after reading round `s - 2`: so
//! the slot of parity `s % 2` is free again, and no other synchronisation is needed. Longer
//! buffers go in rounds of `capacity` values.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Collective, CollectiveError};

/// Messages from one rank to another, in order, and the signal that one arrived.
type Mailbox = (Mutex<VecDeque<Vec<f32>>>, Condvar);

struct Shared {
    size: usize,
    capacity: usize,
    watchdog: Duration,
    /// `size × 2` slots of `capacity` values: slot `(rank, parity)` at `(rank · 2 + parity) · capacity`.
    data: Box<[UnsafeCell<f32>]>,
    /// The round each slot was last written for.
    stamps: Box<[AtomicU64]>,
    /// The values each slot holds.
    lens: Box<[AtomicUsize]>,
    poisoned: AtomicBool,
    why: Mutex<String>,
    /// Point-to-point messages, `from · size + to`.
    mail: Box<[Mailbox]>,
    /// Ranks asleep waiting for a round (after spinning a while), and where they sleep: a
    /// rank that stamps a slot rings the bell when any sleep. With more ranks than cores, a
    /// spinning waiter would take the core a late rank needs to arrive.
    sleepers: AtomicUsize,
    gate: Mutex<()>,
    bell: Condvar,
}

// SAFETY: a slot's values are written only by its rank, before it release-stores the slot's
// stamp, and read by the others only after they acquire-load that stamp; the writer does not
// write the slot again until every rank has finished reading it (see the module's comment).
unsafe impl Sync for Shared {}

impl Shared {
    fn slot(&self, rank: usize, parity: usize) -> usize {
        rank * 2 + parity
    }

    /// The values of slot `i`.
    ///
    /// # Safety
    /// The slot's stamp must have been acquire-loaded at the current round by the caller, or
    /// the caller must be its writer.
    unsafe fn values(&self, i: usize, len: usize) -> &[f32] {
        assert!(
            len <= self.capacity,
            "{len} values of a {}-value slot",
            self.capacity
        );
        // SAFETY: in bounds (`len <= capacity`, slot `i` of the allocation), the pointer taken
        // from the whole allocation, and the slot is not written concurrently (the caller's
        // contract).
        unsafe { std::slice::from_raw_parts(self.slot_ptr(i), len) }
    }

    /// The first value of slot `i`, as a pointer into the whole allocation.
    fn slot_ptr(&self, i: usize) -> *mut f32 {
        assert!(i < self.size * 2, "slot {i} of {}", self.size * 2);
        // SAFETY: slot `i` starts inside the allocation (checked above).
        UnsafeCell::raw_get(unsafe { self.data.as_ptr().add(i * self.capacity) })
    }

    fn poison(&self, why: String) {
        let mut w = self.why.lock().unwrap_or_else(|e| e.into_inner());
        if !self.poisoned.swap(true, Ordering::AcqRel) {
            *w = why;
        }
        drop(w);
        let _g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        self.bell.notify_all();
    }

    fn check(&self) -> Result<(), CollectiveError> {
        if self.poisoned.load(Ordering::Acquire) {
            let why = self.why.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Err(CollectiveError::Poisoned(why));
        }
        Ok(())
    }
}

/// Values from which an all-reduce splits the sums among the ranks (two rounds, each rank
/// summing its share) instead of every rank summing all of them (one round).
const SPLIT_SUM: usize = 16 << 10;

/// How long a waiting rank yields its core before it sleeps until the round is complete.
const YIELDING: Duration = Duration::from_millis(2);

/// Makes the ranks of a thread group.
pub struct ThreadGroup;

impl ThreadGroup {
    /// `size` ranks, each to be moved to its own thread. `capacity` values go in one round;
    /// a collective waits at most `watchdog` for its peers.
    pub fn ranks(size: usize, capacity: usize, watchdog: Duration) -> Vec<ThreadRank> {
        assert!(size > 0 && capacity > 0, "a group of ranks with room");
        let shared = Arc::new(Shared {
            size,
            capacity,
            watchdog,
            data: (0..size * 2 * capacity)
                .map(|_| UnsafeCell::new(0.0))
                .collect(),
            stamps: (0..size * 2).map(|_| AtomicU64::new(0)).collect(),
            lens: (0..size * 2).map(|_| AtomicUsize::new(0)).collect(),
            poisoned: AtomicBool::new(false),
            why: Mutex::new(String::new()),
            mail: (0..size * size)
                .map(|_| (Mutex::new(VecDeque::new()), Condvar::new()))
                .collect(),
            sleepers: AtomicUsize::new(0),
            gate: Mutex::new(()),
            bell: Condvar::new(),
        });
        (0..size)
            .map(|rank| ThreadRank {
                rank,
                round: 0,
                shared: shared.clone(),
                stats: Arc::default(),
            })
            .collect()
    }
}

/// One rank of a [`ThreadGroup`].
pub struct ThreadRank {
    rank: usize,
    round: u64,
    shared: Arc<Shared>,
    stats: Arc<RankStats>,
}

/// What one rank's collectives have cost so far, readable from any thread.
#[derive(Debug, Default)]
pub struct RankStats {
    calls: AtomicU64,
    values: AtomicU64,
    nanos: AtomicU64,
}

impl RankStats {
    /// Collectives called.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Values this rank contributed.
    pub fn values(&self) -> u64 {
        self.values.load(Ordering::Relaxed)
    }

    /// Time spent inside collectives: waiting for peers, and the copies and sums.
    pub fn time(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }

    fn add(&self, values: usize, since: Instant) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.values.fetch_add(values as u64, Ordering::Relaxed);
        let ns = since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.nanos.fetch_add(ns, Ordering::Relaxed);
    }
}

impl ThreadRank {
    /// This rank's running costs (shared: the handle stays valid when the rank moves).
    pub fn stats(&self) -> Arc<RankStats> {
        self.stats.clone()
    }

    /// This rank counting its costs into `stats` (a rank of an earlier group's, so a rebuilt
    /// group's counts go on from where the old one's stopped).
    pub fn counting_into(mut self, stats: Arc<RankStats>) -> Self {
        self.stats = stats;
        self
    }

    /// Whether the group has been given up (a rank timed out, or aborted).
    pub fn poisoned(&self) -> bool {
        self.shared.poisoned.load(Ordering::Acquire)
    }

    /// Gives the group up from this rank (it failed outside a collective, and will not come
    /// to the next one): every rank's current and later collectives fail at once with `why`
    /// instead of waiting for the watchdog.
    pub fn abort(&self, why: String) {
        self.shared.poison(why);
    }

    /// One round: writes `mine`, waits for every rank, then `read(parity, len)` with the
    /// common length of the round's contributions from the ranks in `same_len` (their lengths
    /// must agree).
    fn exchange<R>(
        &mut self,
        op: &'static str,
        mine: &[f32],
        same_len: &[usize],
        read: impl FnOnce(&Shared, usize, usize) -> R,
    ) -> Result<R, CollectiveError> {
        let sh = &*self.shared;
        sh.check()?;
        assert!(
            mine.len() <= sh.capacity,
            "{} values for a {}-value slot",
            mine.len(),
            sh.capacity
        );
        self.round += 1;
        let round = self.round;
        let parity = (round % 2) as usize;
        let me = sh.slot(self.rank, parity);
        // SAFETY: this rank is the slot's only writer, and no rank reads it until the stamp
        // below (see `Shared`); `mine` fits in the slot.
        unsafe {
            std::ptr::copy_nonoverlapping(mine.as_ptr(), sh.slot_ptr(me), mine.len());
        }
        sh.lens[me].store(mine.len(), Ordering::Relaxed);
        sh.stamps[me].store(round, Ordering::Release);
        // Paired with the fence in `wait_all`: either a sleeper sees this stamp when it checks
        // under the gate, or this load sees the sleeper and rings.
        std::sync::atomic::fence(Ordering::SeqCst);
        if sh.sleepers.load(Ordering::Relaxed) > 0 {
            let _g = sh.gate.lock().unwrap_or_else(|e| e.into_inner());
            sh.bell.notify_all();
        }
        self.wait_all(op, round, parity)?;
        let mut len = None;
        for &r in same_len {
            let l = sh.lens[sh.slot(r, parity)].load(Ordering::Relaxed);
            if len.is_some_and(|n| n != l) {
                let why = format!(
                    "{op}: ranks gave different lengths ({} and {l})",
                    len.unwrap_or(0)
                );
                sh.poison(why.clone());
                return Err(CollectiveError::Shape(why));
            }
            len = Some(l);
        }
        Ok(read(sh, parity, len.unwrap_or(0)))
    }

    fn wait_all(&self, op: &'static str, round: u64, parity: usize) -> Result<(), CollectiveError> {
        let sh = &*self.shared;
        let start = Instant::now();
        let mut spins = 0u32;
        for r in 0..sh.size {
            let stamp = &sh.stamps[sh.slot(r, parity)];
            while stamp.load(Ordering::Acquire) < round {
                // Poll, handing the core now and then to whoever is runnable (with more ranks
                // than cores, the late rank); after a while, sleep until a rank stamps (or a
                // while passes, to look at the watchdog).
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(64) {
                    continue;
                }
                if start.elapsed() < YIELDING {
                    std::thread::yield_now();
                    continue;
                }
                sh.sleepers.fetch_add(1, Ordering::Relaxed);
                std::sync::atomic::fence(Ordering::SeqCst);
                {
                    let g = sh.gate.lock().unwrap_or_else(|e| e.into_inner());
                    if stamp.load(Ordering::Acquire) < round && !sh.poisoned.load(Ordering::Acquire)
                    {
                        let nap = Duration::from_millis(20);
                        let _ = sh
                            .bell
                            .wait_timeout(g, nap)
                            .unwrap_or_else(|e| e.into_inner());
                    }
                }
                sh.sleepers.fetch_sub(1, Ordering::Relaxed);
                {
                    sh.check()?;
                    let waited = start.elapsed();
                    if waited > sh.watchdog {
                        let missing: Vec<usize> = (0..sh.size)
                            .filter(|&q| {
                                sh.stamps[sh.slot(q, parity)].load(Ordering::Acquire) < round
                            })
                            .collect();
                        let e = CollectiveError::Timeout {
                            op,
                            rank: self.rank,
                            missing,
                            waited,
                        };
                        sh.poison(e.to_string());
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    fn all_ranks(&self) -> Vec<usize> {
        (0..self.shared.size).collect()
    }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let since = Instant::now();
        let all = self.all_ranks();
        let cap = self.shared.capacity;
        let (me, size) = (self.rank, self.shared.size);
        for chunk in buf.chunks_mut(cap) {
            let n = chunk.len();
            // Each element is summed over the ranks in rank order, whoever sums it: every rank
            // ends with bit-identical values, those of a serial sum in that order.
            let sum_of = |sh: &Shared, parity: usize, range: std::ops::Range<usize>| {
                // SAFETY: every stamp was acquired at this round by `exchange`.
                let slot = |r| unsafe { &sh.values(sh.slot(r, parity), n)[range.clone()] };
                let mut acc = slot(0).to_vec();
                for r in 1..sh.size {
                    for (a, b) in acc.iter_mut().zip(slot(r)) {
                        *a += b;
                    }
                }
                acc
            };
            if n < SPLIT_SUM || size == 1 {
                let sum = self.exchange("all_reduce", chunk, &all, |sh, parity, _| {
                    sum_of(sh, parity, 0..n)
                })?;
                chunk.copy_from_slice(&sum);
                continue;
            }
            // A long buffer: each rank sums its share of the elements (reading the slots of
            // this round, which no rank writes again before every rank has stamped the next),
            // then the shares are gathered through the other parity's slots.
            let share = |r: usize| r * n / size..(r + 1) * n / size;
            let mine = self.exchange("all_reduce", chunk, &all, |sh, parity, _| {
                sum_of(sh, parity, share(me))
            })?;
            self.exchange("all_reduce", &mine, &[], |sh, parity, _| {
                for r in 0..size {
                    let part = share(r);
                    // SAFETY: every stamp was acquired at this round by `exchange`.
                    let x = unsafe { sh.values(sh.slot(r, parity), part.len()) };
                    chunk[part].copy_from_slice(x);
                }
            })?;
        }
        if buf.is_empty() {
            self.exchange("all_reduce", &[], &all, |_, _, _| ())?;
        }
        self.stats.add(buf.len(), since);
        Ok(())
    }

    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        let since = Instant::now();
        let size = self.shared.size;
        let n = mine.len();
        if out.len() != size * n {
            return Err(CollectiveError::Shape(format!(
                "all_gather: {size} ranks × {n} values into {}",
                out.len()
            )));
        }
        let all = self.all_ranks();
        let cap = self.shared.capacity;
        let mut at = 0;
        loop {
            let len = cap.min(n - at);
            self.exchange("all_gather", &mine[at..at + len], &all, |sh, parity, _| {
                for r in 0..sh.size {
                    // SAFETY: every stamp was acquired at this round by `exchange`.
                    let x = unsafe { sh.values(sh.slot(r, parity), len) };
                    out[r * n + at..r * n + at + len].copy_from_slice(x);
                }
            })?;
            at += len;
            if at >= n {
                self.stats.add(n, since);
                return Ok(());
            }
        }
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        crate::check_root(root, self.shared.size)?;
        let cap = self.shared.capacity;
        let me = self.rank;
        let mut at = 0;
        loop {
            let len = cap.min(buf.len() - at);
            let mine: &[f32] = if me == root { &buf[at..at + len] } else { &[] };
            let got = self.exchange("broadcast", mine, &[root], |sh, parity, n| {
                // SAFETY: the root's stamp was acquired at this round by `exchange`.
                unsafe { sh.values(sh.slot(root, parity), n) }.to_vec()
            })?;
            if got.len() != len {
                let why = format!(
                    "broadcast: rank {root} sent {} values, rank {me} expects {len}",
                    got.len()
                );
                self.shared.poison(why.clone());
                return Err(CollectiveError::Shape(why));
            }
            buf[at..at + len].copy_from_slice(&got);
            at += len;
            if at >= buf.len() {
                return Ok(());
            }
        }
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.exchange("barrier", &[], &[], |_, _, _| ())
    }

    fn all_to_all(&mut self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let since = Instant::now();
        let (size, me, cap) = (self.shared.size, self.rank, self.shared.capacity);
        crate::check_sends(send, size)?;
        let all = self.all_ranks();
        // A first round of every rank's lengths (as bits: exact), so that each knows where its
        // part of every other's stream lies and how many rounds the longest stream takes.
        let mine: Vec<f32> = send
            .iter()
            .map(|v| f32::from_bits(v.len() as u32))
            .collect();
        let lens: Vec<Vec<usize>> = self.exchange("all_to_all", &mine, &all, |sh, parity, n| {
            (0..sh.size)
                .map(|r| {
                    // SAFETY: every stamp was acquired at this round by `exchange`.
                    let v = unsafe { sh.values(sh.slot(r, parity), n) };
                    v.iter().map(|x| x.to_bits() as usize).collect()
                })
                .collect()
        })?;
        let totals: Vec<usize> = lens.iter().map(|l| l.iter().sum()).collect();
        // Rank i's values for this rank: `[from, to)` of its stream.
        let part: Vec<(usize, usize)> = lens
            .iter()
            .map(|l| {
                let from = l[..me].iter().sum::<usize>();
                (from, from + l[me])
            })
            .collect();
        let stream = send.concat();
        let rounds = totals.iter().map(|t| t.div_ceil(cap)).max().unwrap_or(0);
        let mut out: Vec<Vec<f32>> = part
            .iter()
            .map(|(a, b)| Vec::with_capacity(b - a))
            .collect();
        for k in 0..rounds {
            let piece = &stream[(k * cap).min(stream.len())..((k + 1) * cap).min(stream.len())];
            self.exchange("all_to_all", piece, &[], |sh, parity, _| {
                for (i, o) in out.iter_mut().enumerate() {
                    let (lo, hi) = (k * cap, ((k + 1) * cap).min(totals[i]));
                    let (a, b) = (lo.max(part[i].0), hi.min(part[i].1));
                    if a >= b {
                        continue;
                    }
                    // SAFETY: every stamp was acquired at this round by `exchange`; rank i
                    // wrote `hi - lo` values this round.
                    let v = unsafe { sh.values(sh.slot(i, parity), hi - lo) };
                    o.extend_from_slice(&v[a - lo..b - lo]);
                }
            })?;
        }
        self.stats.add(stream.len(), since);
        Ok(out)
    }

    fn send(&mut self, to: usize, buf: &[f32]) -> Result<(), CollectiveError> {
        let sh = &*self.shared;
        sh.check()?;
        crate::check_peer(true, self.rank, to, sh.size)?;
        let (queue, ready) = &sh.mail[self.rank * sh.size + to];
        queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(buf.to_vec());
        ready.notify_all();
        Ok(())
    }

    fn recv(&mut self, from: usize, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let sh = &*self.shared;
        sh.check()?;
        crate::check_peer(false, self.rank, from, sh.size)?;
        let (queue, ready) = &sh.mail[from * sh.size + self.rank];
        let start = Instant::now();
        let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(msg) = q.pop_front() {
                if msg.len() != buf.len() {
                    return Err(CollectiveError::Shape(format!(
                        "recv: rank {from} sent {} values, rank {} expects {}",
                        msg.len(),
                        self.rank,
                        buf.len()
                    )));
                }
                buf.copy_from_slice(&msg);
                return Ok(());
            }
            let waited = start.elapsed();
            if waited > sh.watchdog {
                let e = CollectiveError::Timeout {
                    op: "recv",
                    rank: self.rank,
                    missing: vec![from],
                    waited,
                };
                sh.poison(e.to_string());
                return Err(e);
            }
            let left = sh.watchdog - waited;
            q = ready
                .wait_timeout(q, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
            drop(q);
            sh.check()?;
            q = queue.lock().unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SingleRank;
    use proptest::prelude::*;

    /// Runs `f` on every rank, each on its own thread; results in rank order.
    fn on_ranks<T: Send + 'static>(
        ranks: Vec<ThreadRank>,
        f: impl Fn(&mut ThreadRank) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut r| {
                let f = f.clone();
                std::thread::spawn(move || f(&mut r))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Rank `r`'s values for call `c`: distinct, with fractions that make order matter.
    fn data(r: usize, c: usize, n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u64 + 1)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .wrapping_add(seed ^ ((r * 31 + c) as u64) << 17);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 10f32.powi((r % 4) as i32 - 2)
            })
            .collect()
    }

    const WATCHDOG: Duration = Duration::from_secs(60);

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        /// Several all-reduces in a row (so both buffers are reused), of lengths that span
        /// several rounds: every rank holds the serial sum in rank order, to the bit.
        #[test]
        fn all_reduce_equals_the_serial_sum_on_every_rank(
            size in 1usize..6,
            n in 0usize..2500,
            capacity in prop::sample::select(vec![1usize, 7, 256, 4096]),
            seed in any::<u64>(),
        ) {
            let calls = 3;
            let got = on_ranks(ThreadGroup::ranks(size, capacity, WATCHDOG), move |r| {
                (0..calls)
                    .map(|c| {
                        let mut buf = data(r.rank(), c, n, seed);
                        r.all_reduce_sum(&mut buf).unwrap();
                        buf
                    })
                    .collect::<Vec<_>>()
            });
            for c in 0..calls {
                let mut want = data(0, c, n, seed);
                for r in 1..size {
                    for (a, b) in want.iter_mut().zip(data(r, c, n, seed)) {
                        *a += b;
                    }
                }
                for (rank, g) in got.iter().enumerate() {
                    let same = g[c].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    prop_assert!(same, "rank {} call {}", rank, c);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]
        /// Long buffers, whose sums the ranks split among them, between short ones summed
        /// whole (so the two kinds of rounds interleave on both parities): the serial sum in
        /// rank order on every rank, to the bit.
        #[test]
        fn split_all_reduces_equal_the_serial_sum_on_every_rank(
            size in 1usize..6,
            long in prop::sample::select(vec![SPLIT_SUM, SPLIT_SUM + 7, 3 * SPLIT_SUM + 5]),
            capacity in prop::sample::select(vec![SPLIT_SUM, 1 << 20]),
            seed in any::<u64>(),
        ) {
            let lens = [long, 100, long, long, SPLIT_SUM - 1];
            let got = on_ranks(ThreadGroup::ranks(size, capacity, WATCHDOG), move |r| {
                lens.iter()
                    .enumerate()
                    .map(|(c, &n)| {
                        let mut buf = data(r.rank(), c, n, seed);
                        r.all_reduce_sum(&mut buf).unwrap();
                        buf
                    })
                    .collect::<Vec<_>>()
            });
            for (c, &n) in lens.iter().enumerate() {
                let mut want = data(0, c, n, seed);
                for r in 1..size {
                    for (a, b) in want.iter_mut().zip(data(r, c, n, seed)) {
                        *a += b;
                    }
                }
                for (rank, g) in got.iter().enumerate() {
                    let same = g[c].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    prop_assert!(same, "rank {} call {} of {} values", rank, c, n);
                }
            }
        }
    }

    #[test]
    fn gather_and_broadcast_move_each_ranks_values() {
        let n = 10;
        let got = on_ranks(ThreadGroup::ranks(3, 4, WATCHDOG), move |r| {
            let mine = data(r.rank(), 0, n, 1);
            let mut all = vec![0f32; 3 * n];
            r.all_gather(&mine, &mut all).unwrap();
            let mut b = if r.rank() == 2 {
                data(2, 1, n, 1)
            } else {
                vec![0.0; n]
            };
            r.broadcast(&mut b, 2).unwrap();
            r.barrier().unwrap();
            (all, b)
        });
        let want: Vec<f32> = (0..3).flat_map(|r| data(r, 0, n, 1)).collect();
        for (all, b) in got {
            assert_eq!(all, want);
            assert_eq!(b, data(2, 1, n, 1));
        }
    }

    #[test]
    fn send_and_recv_pair_up_in_order() {
        let got = on_ranks(ThreadGroup::ranks(2, 8, WATCHDOG), |r| {
            if r.rank() == 0 {
                r.send(1, &[1.0, 2.0]).unwrap();
                r.send(1, &[3.0, 4.0]).unwrap();
                vec![]
            } else {
                let (mut a, mut b) = ([0f32; 2], [0f32; 2]);
                r.recv(0, &mut a).unwrap();
                r.recv(0, &mut b).unwrap();
                vec![a, b]
            }
        });
        assert_eq!(got[1], vec![[1.0, 2.0], [3.0, 4.0]]);
    }

    /// Every rank gets exactly what each sent it, in rank order: empty sends, sends longer than
    /// a slot (several rounds), and a rank's own part, over a few exchanges in a row.
    #[test]
    fn all_to_all_delivers_each_ranks_parts() {
        // What rank `from` sends rank `to` at exchange `x`: a length from 0 to 40 (a slot holds
        // 16), values naming all three.
        let part = |x: usize, from: usize, to: usize| -> Vec<f32> {
            let n = (x * 7 + from * 13 + to * 5) % 41;
            (0..n)
                .map(|i| (x * 10000 + from * 1000 + to * 100 + i) as f32)
                .collect()
        };
        for size in [1, 2, 3, 4] {
            let got = on_ranks(ThreadGroup::ranks(size, 16, WATCHDOG), move |r| {
                (0..3)
                    .map(|x| {
                        let send: Vec<Vec<f32>> =
                            (0..r.size()).map(|to| part(x, r.rank(), to)).collect();
                        r.all_to_all(&send).unwrap()
                    })
                    .collect::<Vec<_>>()
            });
            for (me, rounds) in got.iter().enumerate() {
                for (x, recv) in rounds.iter().enumerate() {
                    let want: Vec<Vec<f32>> = (0..size).map(|from| part(x, from, me)).collect();
                    assert_eq!(recv, &want, "size {size}, rank {me}, exchange {x}");
                }
            }
        }
        let mut one = SingleRank;
        assert_eq!(one.all_to_all(&[vec![1.0]]).unwrap(), vec![vec![1.0]]);
        assert!(one.all_to_all(&[vec![], vec![]]).is_err());
    }

    /// Rank 2 never comes: the others fail with the watchdog's error naming it, and the group
    /// refuses every later collective.
    #[test]
    fn a_rank_that_never_arrives_trips_the_watchdog() {
        let mut ranks = ThreadGroup::ranks(3, 16, Duration::from_millis(200));
        let absent = ranks.pop().unwrap();
        let got = on_ranks(ranks, |r| {
            let mut buf = vec![1.0; 5];
            let first = r.all_reduce_sum(&mut buf);
            let after = r.barrier();
            (first, after)
        });
        for (rank, (first, after)) in got.into_iter().enumerate() {
            match first {
                Err(CollectiveError::Timeout { missing, op, .. }) => {
                    assert_eq!(op, "all_reduce");
                    assert!(missing.contains(&2), "rank {rank}: {missing:?}");
                    assert!(!missing.contains(&rank));
                }
                // The other rank may see the group poisoned by the first one to time out.
                Err(CollectiveError::Poisoned(why)) => {
                    assert!(why.contains("did not arrive"), "{why}")
                }
                other => panic!("rank {rank}: {other:?}"),
            }
            assert!(
                matches!(after, Err(CollectiveError::Poisoned(_))),
                "{after:?}"
            );
        }
        drop(absent);
        // recv waits for its sender under the same watchdog.
        let got = on_ranks(ThreadGroup::ranks(2, 4, Duration::from_millis(100)), |r| {
            if r.rank() == 1 {
                r.recv(0, &mut [0f32; 3]).err()
            } else {
                None
            }
        });
        assert!(
            matches!(&got[1], Some(CollectiveError::Timeout { missing, .. }) if missing == &vec![0]),
            "{got:?}"
        );
    }

    #[test]
    fn mismatched_lengths_are_errors_not_garbage() {
        let got = on_ranks(ThreadGroup::ranks(2, 16, WATCHDOG), |r| {
            let mut buf = vec![1.0; 3 + r.rank()];
            r.all_reduce_sum(&mut buf)
        });
        // The rank that sees the mismatch says so; the other either sees it too or finds the
        // group poisoned with that reason, whichever comes first on its thread.
        for g in &got {
            assert!(
                matches!(g, Err(CollectiveError::Shape(m) | CollectiveError::Poisoned(m))
                    if m.contains("different lengths")),
                "{g:?}"
            );
        }
        assert!(
            got.iter()
                .any(|g| matches!(g, Err(CollectiveError::Shape(_)))),
            "{got:?}"
        );
        let mut one = crate::SingleRank;
        let mut buf = [2.0f32, 3.0];
        one.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, [2.0, 3.0]);
        let mut out = [0f32; 2];
        one.all_gather(&buf, &mut out).unwrap();
        assert_eq!(out, buf);
        assert!(one.broadcast(&mut buf, 1).is_err());
    }
}
