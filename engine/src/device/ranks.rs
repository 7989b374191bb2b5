//! A tensor-parallel group's rank threads, driven in lockstep by the engine's one scheduler:
//! every step (and every block copy) goes to all ranks, which run it at once, exchanging through
//! their group's collectives, and rank 0's result comes back. What a rank holds and how it
//! exchanges is its [`RankWork`]: the CPU's ranks ([`super::tp_cpu`]) and the GPUs'
//! ([`super::tp_cuda`]) share this logic, so the CPU's tests exercise the GPUs' too.
//!
//! A step that fails on any rank fails as a whole. The ranks are then idle, so the group is
//! rebuilt before the next step: a poisoned group (a rank that timed out, or gave up) does not
//! outlive the step it failed. A rank that panics fails its step like an error and lives on.
//!
//! A group's setup can wait for every rank without a bound of its own (NCCL's does), so a rank
//! that cannot join would leave its peers waiting for it for good. The group stops waiting as
//! soon as a rank says it could not join: the join fails with that rank's reason, and the ranks
//! still in the setup take no job, and fail every step at once saying so, until they come out of
//! it.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use tandem_collective::CollectiveError;
use tandem_types::BlockId;

use crate::error::EngineError;
use crate::forward::SeqBatch;

/// What a rank gives back for a step: logits (rank 0's are the step's; other ranks may give
/// none), or each logit row's pick where the device picks (greedy decoding on a GPU).
pub(crate) enum StepOut {
    /// f32 logits, rows of the whole vocabulary.
    Logits(Vec<f32>),
    /// Each logit row's argmax and its log-probability.
    Picks(Vec<(u32, f32)>),
}

/// One rank's share of a group: its part of the model and of the KV pool, run on its thread.
pub(crate) trait RankWork: Send + 'static {
    /// The rank's handle on its group's collectives, made on the rank's thread (an NCCL
    /// communicator stays on the thread that made it).
    type Comm;
    /// What a new group hands each rank to make its handle from.
    type Join: Send + 'static;

    /// This rank's place in its group.
    fn rank(&self) -> usize;
    /// Joins a (new) group: collective where the group's setup is (NCCL's), so every rank
    /// is asked at once.
    fn join(&mut self, join: Self::Join) -> Result<Self::Comm, EngineError>;
    /// One packed step of `seqs` in lockstep with the group's other ranks: logits, or picks
    /// where `picks` asks for them.
    fn step(
        &mut self,
        seqs: &[SeqBatch<'_>],
        picks: bool,
        comm: &mut Self::Comm,
    ) -> Result<StepOut, EngineError>;
    /// Copies blocks within this rank's part of the pool (copy-on-write).
    fn copy(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError>;
    /// Gives the group up after this rank failed, so that its peers do not wait for it.
    fn abort(comm: &mut Self::Comm, why: String);
    /// Whether the group has been given up (tests).
    #[cfg(test)]
    fn poisoned(comm: &Self::Comm) -> bool;
}

/// One step's sequences, owned, so every rank thread reads the same copy.
pub(crate) struct OwnedBatch {
    seqs: Vec<(Vec<u32>, usize, Vec<u32>, usize)>,
}

impl OwnedBatch {
    pub(crate) fn new(seqs: &[SeqBatch<'_>]) -> Self {
        Self {
            seqs: seqs
                .iter()
                .map(|s| {
                    let (t, b) = (s.tokens.to_vec(), s.block_table.to_vec());
                    (t, s.cached, b, s.logits)
                })
                .collect(),
        }
    }

    fn batches(&self) -> Vec<SeqBatch<'_>> {
        self.seqs
            .iter()
            .map(|(tokens, cached, table, want)| SeqBatch {
                tokens,
                cached: *cached,
                block_table: table,
                logits: *want,
                lora: None,
            })
            .collect()
    }
}

enum Job<J> {
    Step {
        batch: Arc<OwnedBatch>,
        picks: bool,
    },
    Copy(Arc<Vec<(BlockId, BlockId)>>),
    /// Joins a new group (at the start, and after a failed step).
    Join(J),
    /// Leaves the group just joined, which another rank could not join, so that the next step
    /// fails at once rather than at a collective that rank never comes to.
    Leave(String),
    /// Test hook: the rank takes no job until its group has been given up, as a stuck rank.
    #[cfg(test)]
    StallUntilPoisoned,
    /// Test hook: the rank's next step panics.
    #[cfg(test)]
    PanicNext,
}

/// A rank thread as the group sees it.
struct Rank<J> {
    jobs: mpsc::Sender<Job<J>>,
    done: mpsc::Receiver<Result<StepOut, EngineError>>,
    thread: Option<JoinHandle<()>>,
    /// Left in a group's setup that another rank could not join: its answer to that join is
    /// still to come, and it takes no job before; the refusal, which it leaves that group for
    /// if it did join.
    owes: Option<String>,
}

/// Makes a new group: what each rank, in order, joins it with.
pub(crate) type Regroup<J> = Box<dyn FnMut() -> Result<Vec<J>, EngineError> + Send>;

/// The rank threads of one group.
pub(crate) struct RankGroup<W: RankWork> {
    ranks: Vec<Rank<W::Join>>,
    regroup: Regroup<W::Join>,
}

impl<W: RankWork> RankGroup<W> {
    /// A thread for each of `works` (rank 0 first), joined into a group `regroup` makes; a
    /// rank that cannot join fails the start with its reason.
    pub(crate) fn start(works: Vec<W>, regroup: Regroup<W::Join>) -> Result<Self, EngineError> {
        let mut ranks = Vec::with_capacity(works.len());
        for (i, w) in works.into_iter().enumerate() {
            if w.rank() != i {
                return Err(EngineError::Internal(format!(
                    "rank {} started as rank {i} of its group",
                    w.rank()
                )));
            }
            ranks.push(Rank::start(w)?);
        }
        let mut g = Self { ranks, regroup };
        g.join_all()?;
        Ok(g)
    }

    /// Ranks in the group.
    pub(crate) fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Every rank joins a new group; the first rank's failure to, if any.
    fn join_all(&mut self) -> Result<(), EngineError> {
        // No new group while ranks are still in an old one's setup (making one is not free:
        // an NCCL id opens a socket for ranks that would never come).
        if let Some(i) = self.stuck() {
            return Err(still_in_setup(i));
        }
        let joins = (self.regroup)()?;
        if joins.len() != self.ranks.len() {
            return Err(EngineError::Internal(format!(
                "a new group of {} for {} ranks",
                joins.len(),
                self.ranks.len()
            )));
        }
        self.send_all(joins.into_iter().map(Job::Join).collect())
            .map(|_| ())
    }

    /// Runs a step on every rank: rank 0's result.
    pub(crate) fn step(
        &mut self,
        seqs: &[SeqBatch<'_>],
        picks: bool,
    ) -> Result<StepOut, EngineError> {
        let batch = Arc::new(OwnedBatch::new(seqs));
        let jobs = (0..self.ranks.len())
            .map(|_| Job::Step {
                batch: batch.clone(),
                picks,
            })
            .collect();
        self.all(jobs)
    }

    /// A step's logits (rank 0's).
    pub(crate) fn logits(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        match self.step(seqs, false)? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Picks(_) => Err(EngineError::Internal(
                "rank 0 picked tokens when logits were asked for".into(),
            )),
        }
    }

    /// A step's picks, each logit row's argmax (rank 0's, picked on its device).
    pub(crate) fn picks(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<(u32, f32)>, EngineError> {
        match self.step(seqs, true)? {
            StepOut::Picks(p) => Ok(p),
            // No row wanted logits.
            StepOut::Logits(l) if l.is_empty() => Ok(Vec::new()),
            StepOut::Logits(_) => Err(EngineError::Internal(
                "rank 0 gave logits when picks were asked for".into(),
            )),
        }
    }

    /// Copies blocks on every rank.
    pub(crate) fn copy(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        if pairs.is_empty() {
            return Ok(());
        }
        let pairs = Arc::new(pairs.to_vec());
        let jobs = (0..self.ranks.len())
            .map(|_| Job::Copy(pairs.clone()))
            .collect();
        self.all(jobs).map(|_| ())
    }

    /// The first rank still in the setup of a group another rank could not join; each rank
    /// that has since come out of it is taken back: its late answer read, and, where it did
    /// join, the group left again (see [`Self::leave`]).
    fn stuck(&mut self) -> Option<usize> {
        let mut first = None;
        for (i, r) in self.ranks.iter_mut().enumerate() {
            let Some(why) = r.owes.clone() else {
                continue;
            };
            match r.done.try_recv() {
                Err(mpsc::TryRecvError::Empty) => {
                    first.get_or_insert(i);
                }
                Ok(Ok(_)) => {
                    r.owes = None;
                    r.leave(why);
                }
                Ok(Err(e)) => {
                    tracing::warn!(rank = i, error = %e, "a tensor-parallel rank came out of a group's setup");
                    r.owes = None;
                }
                // A thread that has ended: its next job says so.
                Err(mpsc::TryRecvError::Disconnected) => r.owes = None,
            }
        }
        first
    }

    /// Sends each rank its job and waits for every answer: rank 0's result, or the first
    /// real error. Every rank that took its job is waited for, even when another could not
    /// take its own: none may still be running when this returns. Except in a join: there a
    /// rank that could not join ends the wait, and the ranks still in the group's setup are
    /// left there, owing their answers (see [`Self::stuck`]).
    fn send_all(&mut self, jobs: Vec<Job<W::Join>>) -> Result<StepOut, EngineError> {
        if let Some(i) = self.stuck() {
            return Err(still_in_setup(i));
        }
        let joining = matches!(jobs.first(), Some(Job::Join(_)));
        let gone = |i| EngineError::Step(format!("tensor-parallel rank {i} has stopped"));
        let mut answers: Vec<Option<Result<StepOut, EngineError>>> = self
            .ranks
            .iter()
            .zip(jobs)
            .enumerate()
            .map(|(i, (r, job))| r.jobs.send(job).is_err().then(|| Err(gone(i))))
            .collect();
        if !joining {
            for (i, r) in self.ranks.iter().enumerate() {
                if answers[i].is_none() {
                    answers[i] = Some(r.done.recv().unwrap_or_else(|_| Err(gone(i))));
                }
            }
        } else {
            // Polled, so that the first rank that could not join ends the wait.
            while answers.iter().any(Option::is_none)
                && !answers.iter().any(|a| matches!(a, Some(Err(_))))
            {
                for (i, r) in self.ranks.iter().enumerate() {
                    if answers[i].is_none() {
                        let wait = std::time::Duration::from_millis(1);
                        match r.done.recv_timeout(wait) {
                            Ok(a) => answers[i] = Some(a),
                            Err(mpsc::RecvTimeoutError::Timeout) => {}
                            Err(mpsc::RecvTimeoutError::Disconnected) => {
                                answers[i] = Some(Err(gone(i)))
                            }
                        }
                    }
                }
            }
            // The refusal (it names its rank: "rank N could not join its group"), the reason
            // the others have no group.
            let why = answers.iter().find_map(|a| match a {
                Some(Err(EngineError::Step(s) | EngineError::Startup(s))) => Some(s.clone()),
                Some(Err(e)) => Some(e.to_string()),
                _ => None,
            });
            if let Some(why) = why {
                let left: Vec<usize> = (0..answers.len())
                    .filter(|&i| answers[i].is_none())
                    .collect();
                if !left.is_empty() {
                    tracing::error!(
                        ranks = ?left,
                        "tensor-parallel ranks left in the setup of a group another rank could not join"
                    );
                }
                for (i, r) in self.ranks.iter_mut().enumerate() {
                    match answers[i] {
                        None => r.owes = Some(why.clone()),
                        Some(Ok(_)) => r.leave(why.clone()),
                        Some(Err(_)) => {}
                    }
                }
            }
        }
        // The answers that came (a rank left in a setup gave none).
        let mut results: Vec<Result<StepOut, EngineError>> =
            answers.into_iter().flatten().collect();
        if results.iter().all(|r| r.is_ok()) {
            return results.swap_remove(0);
        }
        // A peer's poisoning is a consequence, not a cause; so is a peer's timeout where a rank
        // failed by itself (it gave up without coming to the collective its peers waited in).
        let poisoned =
            |e: &EngineError| matches!(e, EngineError::Collective(CollectiveError::Poisoned(_)));
        let timeout =
            |e: &EngineError| matches!(e, EngineError::Collective(CollectiveError::Timeout { .. }));
        let is = |r: &Result<StepOut, EngineError>, f: &dyn Fn(&EngineError) -> bool| {
            r.as_ref().is_err_and(f)
        };
        let at = results
            .iter()
            .position(|r| is(r, &|e| !poisoned(e) && !timeout(e)))
            .or_else(|| results.iter().position(|r| is(r, &timeout)))
            .or_else(|| results.iter().position(Result::is_err));
        Err(match at.map(|i| results.swap_remove(i)) {
            // A step's or a join's own error as it is; anything else fails the step.
            Some(Err(e @ (EngineError::Step(_) | EngineError::Startup(_)))) => e,
            Some(Err(e)) => EngineError::Step(e.to_string()),
            _ => EngineError::Internal("a failed step with no error".into()),
        })
    }

    /// [`Self::send_all`], then, after a failure, a new group (whose own failure leaves the
    /// ranks without one: the next step fails saying why, and tries again).
    fn all(&mut self, jobs: Vec<Job<W::Join>>) -> Result<StepOut, EngineError> {
        let out = self.send_all(jobs);
        if out.is_err() {
            if let Err(e) = self.join_all() {
                tracing::error!(error = %e, "rebuilding a tensor-parallel group after a failed step");
            }
        }
        out
    }

    /// Test hook: every rank joins the group of `joins` instead of the group's own next.
    #[cfg(test)]
    pub(crate) fn join_with(&mut self, joins: Vec<W::Join>) -> Result<(), EngineError> {
        self.send_all(joins.into_iter().map(Job::Join).collect())
            .map(|_| ())
    }

    /// Test hook: rank `rank` takes no job until its group is given up.
    #[cfg(test)]
    pub(crate) fn stall(&self, rank: usize) {
        self.ranks[rank]
            .jobs
            .send(Job::StallUntilPoisoned)
            .expect("a live rank");
    }

    /// Test hook: rank `rank`'s next step panics.
    #[cfg(test)]
    pub(crate) fn panic_next(&self, rank: usize) {
        self.ranks[rank]
            .jobs
            .send(Job::PanicNext)
            .expect("a live rank");
    }
}

impl<J: Send + 'static> Rank<J> {
    /// Leaves the group this rank has just joined, which another rank could not (`why`): a
    /// group missing a rank would fail only at its first collective, a watchdog later.
    fn leave(&self, why: String) {
        if self.jobs.send(Job::Leave(why)).is_ok() {
            let _ = self.done.recv();
        }
    }

    fn start<W: RankWork<Join = J>>(mut work: W) -> Result<Self, EngineError> {
        let rank = work.rank();
        let (jobs, inbox) = mpsc::channel::<Job<J>>();
        let (reply, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("tp-rank-{rank}"))
            .spawn(move || {
                // The rank's group, or why it has none.
                let mut comm: Result<W::Comm, String> = Err("it has not joined one".into());
                #[cfg(test)]
                let mut panic_next = false;
                while let Ok(job) = inbox.recv() {
                    let out = match job {
                        Job::Step { batch, picks } => {
                            let seqs = batch.batches();
                            #[cfg(test)]
                            let panics = std::mem::take(&mut panic_next);
                            match &mut comm {
                                Err(why) => Err(EngineError::Step(format!(
                                    "tensor-parallel rank {rank} has no group: {why}"
                                ))),
                                Ok(c) => {
                                    let run = || {
                                        #[cfg(test)]
                                        assert!(!panics, "a test asked for it");
                                        work.step(&seqs, picks, c)
                                    };
                                    let r = caught(rank, run);
                                    if let Err(e) = &r {
                                        // The others must not wait for this rank's next
                                        // collective.
                                        W::abort(c, format!("rank {rank} failed: {e}"));
                                    }
                                    r
                                }
                            }
                        }
                        Job::Copy(pairs) => {
                            caught(rank, || work.copy(&pairs)).map(|()| StepOut::Logits(Vec::new()))
                        }
                        Job::Leave(why) => {
                            leave_group::<W>(rank, &mut comm, why, true);
                            Ok(StepOut::Logits(Vec::new()))
                        }
                        Job::Join(j) => {
                            // The old group goes first (a failure to leave is logged, and the
                            // join goes ahead, for a group's setup waits for every rank).
                            let why = "it is joining a new one".to_string();
                            leave_group::<W>(rank, &mut comm, why, false);
                            let joined = caught(rank, || work.join(j));
                            let out = match &joined {
                                Ok(_) => Ok(StepOut::Logits(Vec::new())),
                                Err(e) => Err(EngineError::Startup(format!(
                                    "tensor-parallel rank {rank} could not join its group: {e}"
                                ))),
                            };
                            comm = joined.map_err(|e| e.to_string());
                            out
                        }
                        #[cfg(test)]
                        Job::StallUntilPoisoned => {
                            while !comm.as_ref().is_ok_and(|c| W::poisoned(c)) {
                                std::thread::sleep(std::time::Duration::from_millis(1));
                            }
                            continue;
                        }
                        #[cfg(test)]
                        Job::PanicNext => {
                            panic_next = true;
                            continue;
                        }
                    };
                    if reply.send(out).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| EngineError::Startup(format!("starting rank {rank}'s thread: {e}")))?;
        Ok(Self {
            jobs,
            done,
            thread: Some(thread),
            owes: None,
        })
    }
}

/// Why a group takes no job: rank `i` is still in a setup another rank could not join.
fn still_in_setup(i: usize) -> EngineError {
    EngineError::Step(format!(
        "tensor-parallel rank {i} is still in the setup of a group that another rank could not \
         join"
    ))
}

/// Leaves a rank's group (given up first where `abort`), which it then has not for `why`.
/// Dropping an NCCL communicator aborts it, which may panic in its bindings: that is logged.
fn leave_group<W: RankWork>(
    rank: usize,
    comm: &mut Result<W::Comm, String>,
    why: String,
    abort: bool,
) {
    let old = std::mem::replace(comm, Err(why.clone()));
    if let Err(e) = caught(rank, || {
        if let (Ok(mut c), true) = (old, abort) {
            W::abort(&mut c, why);
        }
        Ok(())
    }) {
        tracing::error!(error = %e, rank, "leaving a tensor-parallel group");
    }
}

/// `f`'s result, a panic in it an error naming the rank.
fn caught<T>(rank: usize, f: impl FnOnce() -> Result<T, EngineError>) -> Result<T, EngineError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = tandem_types::panic_message(p.as_ref());
        Err(EngineError::Internal(format!(
            "rank {rank} panicked: {what}"
        )))
    })
}

impl<W: RankWork> Drop for RankGroup<W> {
    fn drop(&mut self) {
        self.stuck();
        for r in &mut self.ranks {
            // Closing the channel ends the rank's loop.
            let (closed, _) = mpsc::channel();
            drop(std::mem::replace(&mut r.jobs, closed));
            // A rank still in a group's setup may never come out of it: it is left to end by
            // itself (its loop ends once it does), not waited for.
            if let Some(t) = r.thread.take().filter(|_| r.owes.is_none()) {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A rank of a fake group: its step answers its rank's number, fails on token 999, and
    /// it joins a group as the group's join says.
    struct Fake {
        rank: usize,
    }

    /// How a fake rank's join goes.
    enum FakeJoin {
        Ok,
        /// Joins after a pause (its answer likely comes after a peer's refusal).
        SlowOk(std::time::Duration),
        Refuse(String),
        /// Waits, as a collective setup does for a peer, until the sender is dropped; then
        /// refuses.
        Hang(mpsc::Receiver<()>),
    }

    impl RankWork for Fake {
        type Comm = ();
        type Join = FakeJoin;

        fn rank(&self) -> usize {
            self.rank
        }

        fn join(&mut self, join: Self::Join) -> Result<(), EngineError> {
            match join {
                FakeJoin::Ok => Ok(()),
                FakeJoin::SlowOk(pause) => {
                    std::thread::sleep(pause);
                    Ok(())
                }
                FakeJoin::Refuse(why) => Err(EngineError::Device(why)),
                FakeJoin::Hang(until) => {
                    let _ = until.recv();
                    Err(EngineError::Device("the setup was given up".into()))
                }
            }
        }

        fn step(
            &mut self,
            seqs: &[SeqBatch<'_>],
            _picks: bool,
            _comm: &mut (),
        ) -> Result<StepOut, EngineError> {
            match seqs[0].tokens[0] {
                999 => Err(EngineError::Step(format!("rank {} refused 999", self.rank))),
                _ => Ok(StepOut::Logits(vec![self.rank as f32; 2])),
            }
        }

        fn copy(&mut self, _pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
            Ok(())
        }

        fn abort(_comm: &mut (), _why: String) {}

        fn poisoned(_comm: &()) -> bool {
            false
        }
    }

    fn step(g: &mut RankGroup<Fake>, token: u32) -> Result<Vec<f32>, String> {
        let (tokens, table) = ([token], [0u32]);
        let seq = [SeqBatch {
            tokens: &tokens,
            cached: 0,
            block_table: &table,
            logits: 1,
            lora: None,
        }];
        match g.step(&seq, false).map_err(|e| e.to_string())? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Picks(_) => Err("picks".into()),
        }
    }

    /// [`step`], again after a pause while a rank is still coming out of a group's setup.
    fn past_setup(g: &mut RankGroup<Fake>, token: u32) -> Result<Vec<f32>, String> {
        loop {
            match step(g, token) {
                Err(e) if e.contains("is still in the setup") => {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                r => return r,
            }
        }
    }

    /// A rank that cannot join fails the start naming itself and the reason; a group that
    /// cannot be rebuilt after a failed step leaves the ranks without one, so that the next
    /// step fails saying why, and is tried again after it.
    #[test]
    fn a_group_that_cannot_be_made_fails_its_steps_with_the_reason_until_it_can() {
        let works = || (0..3).map(|rank| Fake { rank }).collect::<Vec<_>>();
        let refuse = |r: usize| -> Regroup<FakeJoin> {
            Box::new(move || {
                Ok((0..3)
                    .map(|i| match i == r {
                        true => FakeJoin::Refuse("no such device".into()),
                        false => FakeJoin::Ok,
                    })
                    .collect())
            })
        };
        let e = RankGroup::start(works(), refuse(1))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("tensor-parallel rank 1 could not join its group: ")
                && e.contains("no such device"),
            "{e}"
        );
        let broken = Arc::new(AtomicBool::new(false));
        let b = broken.clone();
        let mut g = RankGroup::start(
            works(),
            Box::new(move || {
                let broken = b.load(Ordering::SeqCst);
                Ok((0..3)
                    .map(|i| match (broken, i) {
                        (true, 2) => FakeJoin::Refuse("the fabric is down".into()),
                        // Rank 0 joins late: it leaves the group all the same once it has.
                        (true, 0) => FakeJoin::SlowOk(std::time::Duration::from_millis(20)),
                        _ => FakeJoin::Ok,
                    })
                    .collect())
            }),
        )
        .unwrap();
        assert_eq!(g.size(), 3);
        // Rank 0's answer is the step's.
        assert_eq!(step(&mut g, 5).unwrap(), vec![0.0; 2]);
        // Every rank refuses; the step's error is the first rank's.
        broken.store(true, Ordering::SeqCst);
        assert_eq!(
            step(&mut g, 999).unwrap_err(),
            "the engine step failed: rank 0 refused 999"
        );
        // Ranks 0 and 1 joined the rebuilt group but left it again, for rank 2 could not: the
        // step fails at once on rank 0, saying why. (A rank whose join answer came after rank
        // 2's refusal is still being taken back at first: a pause, and again.)
        let e = past_setup(&mut g, 5).unwrap_err();
        assert!(
            e.contains(
                "tensor-parallel rank 0 has no group: tensor-parallel rank 2 could not join its \
                 group: "
            ) && e.contains("the fabric is down"),
            "{e}"
        );
        broken.store(false, Ordering::SeqCst);
        // The failed step rebuilt the group again (rank 0 late again); the next, once rank 0
        // is out, rebuilds it whole.
        let e = past_setup(&mut g, 5).unwrap_err();
        assert!(e.contains("rank 0 has no group"), "{e}");
        assert_eq!(step(&mut g, 5).unwrap(), vec![0.0; 2]);
        g.copy(&[(BlockId(1), BlockId(2))]).unwrap();
    }

    /// Ranks left waiting in a group's setup for a peer that could not join (NCCL's setup
    /// waits for every rank): the start fails at once with the peer's reason rather than
    /// waiting for them, and dropping the group does not wait either. In a running group, a
    /// rebuild that leaves ranks in the setup fails each later step at once, saying so, until
    /// they come out of it; then the group is rebuilt and steps again.
    #[test]
    fn ranks_left_in_a_setup_that_a_peer_refused_hold_nothing_up() {
        let works = || (0..3).map(|rank| Fake { rank }).collect::<Vec<_>>();
        // The plan for the next joins: rank 1 refuses, the others hang until released.
        let hang = Arc::new(std::sync::Mutex::new(Vec::<mpsc::Sender<()>>::new()));
        let failing = Arc::new(AtomicBool::new(true));
        let regroup = |hang: Arc<std::sync::Mutex<Vec<mpsc::Sender<()>>>>,
                       failing: Arc<AtomicBool>|
         -> Regroup<FakeJoin> {
            Box::new(move || {
                Ok((0..3)
                    .map(|i| match (failing.load(Ordering::SeqCst), i) {
                        (false, _) => FakeJoin::Ok,
                        (true, 1) => FakeJoin::Refuse("out of device memory".into()),
                        (true, _) => {
                            let (tx, rx) = mpsc::channel();
                            hang.lock().unwrap().push(tx);
                            FakeJoin::Hang(rx)
                        }
                    })
                    .collect())
            })
        };
        let e = RankGroup::start(works(), regroup(hang.clone(), failing.clone()))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("tensor-parallel rank 1 could not join its group: ")
                && e.contains("out of device memory"),
            "{e}"
        );
        // Ranks 0 and 2 still wait in that setup (the failed start's group was dropped without
        // waiting for them); released, their threads end.
        assert_eq!(hang.lock().unwrap().len(), 2);
        hang.lock().unwrap().clear();

        failing.store(false, Ordering::SeqCst);
        let mut g = RankGroup::start(works(), regroup(hang.clone(), failing.clone())).unwrap();
        assert_eq!(step(&mut g, 5).unwrap(), vec![0.0; 2]);
        // A failed step's rebuild is refused by rank 1 and leaves 0 and 2 in its setup.
        failing.store(true, Ordering::SeqCst);
        assert_eq!(
            step(&mut g, 999).unwrap_err(),
            "the engine step failed: rank 0 refused 999"
        );
        assert_eq!(hang.lock().unwrap().len(), 2);
        for _ in 0..3 {
            let e = step(&mut g, 5).unwrap_err();
            assert!(
                e.contains("tensor-parallel rank 0 is still in the setup of a group"),
                "{e}"
            );
        }
        // No new group was made meanwhile (its setup would have waited too).
        assert_eq!(hang.lock().unwrap().len(), 2);
        // Out of the setup (refused), the ranks answer the old join, are taken back, have no
        // group for one more step (which rebuilds it) and then step again.
        failing.store(false, Ordering::SeqCst);
        hang.lock().unwrap().clear();
        // (Each try while they are still coming out fails at once: a pause, and again.)
        let got = loop {
            match step(&mut g, 5) {
                Ok(l) => break l,
                Err(e) if e.contains("is still in the setup") => {
                    std::thread::sleep(std::time::Duration::from_millis(1))
                }
                Err(e) => assert!(e.contains("has no group"), "{e}"),
            }
        };
        assert_eq!(got, vec![0.0; 2]);
        g.copy(&[(BlockId(1), BlockId(2))]).unwrap();
    }
}
