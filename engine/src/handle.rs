//! The engine on its own thread, driven over channels.
//!
//! [`EngineHandle::spawn`] builds the engine on a dedicated OS thread (the engine is
//! single-threaded and not `Send`: its block manager uses `Rc`) and runs the step loop there. The
//! handle is `Send + Sync` and cheap to share: `submit` validates on the caller's thread and
//! returns a [`RequestStream`] of events, `cancel` and `stats` never block on the loop. Streams
//! are tokio channels, so async code awaits them without blocking a worker thread, and sync code
//! uses [`RequestStream::blocking_next`]. Dropping a stream before its request finished cancels the
//! request: a client that goes away frees its KV blocks within a step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc as tmpsc;
use tokio::sync::{oneshot, watch};

use tandem_model::BlockHash;

use crate::block_manager::KvEvent;
use crate::engine::{
    Engine, EngineStats, Event, Finished, KvChunk, Limits, Request, RequestId, Reservation,
    TokenEvent,
};
use crate::error::EngineError;
use crate::kv_cache::KvPoolWriter;
use crate::sampler::Sampled;
use tandem_grammar::GrammarCompiler;

/// What a request's stream carries.
#[derive(Debug)]
pub enum StreamEvent {
    /// Prompt blocks of a prefill-mode request, before its token.
    Kv(KvChunk),
    /// A generated token.
    Token(TokenEvent),
    /// The last event of a request that ran (or was cancelled).
    Finished(Finished),
    /// The last event of a request the engine could not serve, and why.
    Failed(EngineError),
}

enum Command {
    Submit {
        id: RequestId,
        /// Boxed: a request's sampling (and grammar) is most of a command's size.
        request: Box<Request>,
        mode: Mode,
        events: tmpsc::UnboundedSender<StreamEvent>,
    },
    JoinRemote(RequestId, Sampled, usize),
    PrefillLocally(RequestId),
    Cancel(RequestId),
    StopSamples(RequestId, Vec<u32>),
    SubscribeKv(tmpsc::UnboundedSender<KvUpdate>),
    /// A block came back from the disk tier (the loop may be waiting for a command).
    Wake,
    /// Hand every request over (a drain): they end with [`EngineError::HandedOff`]; the reply
    /// says how many.
    HandOff(oneshot::Sender<usize>),
    Shutdown,
}

/// What a KV-event subscriber receives: one snapshot first, then every change in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvUpdate {
    /// The cached block hashes now; `next_seq` is the sequence number of the first event after it.
    Snapshot {
        /// Sequence number of the first [`KvEvent`] that follows.
        next_seq: u64,
        /// Every block hash cached now, sorted.
        hashes: Vec<BlockHash>,
        /// Every block hash in the engine's disk tier now, sorted (none without one).
        disk_hashes: Vec<BlockHash>,
    },
    /// Changes since the previous update, in sequence order.
    Events(Vec<KvEvent>),
}

/// How a submitted request gets its prompt's KV.
enum Mode {
    /// Prefilled here, then decoded.
    Local,
    /// Prefill mode: KV chunks out from `skip_tokens` on, the first token, done.
    Prefill { skip_tokens: usize },
    /// KV comes from a prefill worker: reserve blocks and answer with them (`None`: no room now).
    Remote(oneshot::Sender<Option<Reservation>>),
}

struct Shared {
    stats: Mutex<EngineStats>,
    next_id: AtomicU64,
    /// The panic that ended the loop, once one has.
    failure: watch::Sender<Option<String>>,
}

/// A running engine. Dropping the handle stops the loop (after the current step) and joins it.
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    limits: Limits,
    kv_writers: Vec<(std::ops::Range<u32>, KvPoolWriter)>,
    kv_devices: Vec<crate::DevicePool>,
    grammars: Option<Arc<GrammarCompiler>>,
    expert_load: Option<Arc<crate::forward::ExpertLoad>>,
    thread: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Builds the engine with `build` on a new thread and starts its loop there.
    pub fn spawn(
        build: impl FnOnce() -> Result<Engine, EngineError> + Send + 'static,
    ) -> Result<Self, EngineError> {
        let (commands, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats::default()),
            next_id: AtomicU64::new(1),
            failure: watch::Sender::new(None),
        });
        let loop_shared = shared.clone();
        let waker = std::sync::Mutex::new(commands.clone());
        let thread = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || {
                let mut engine = match build() {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                engine.set_disk_wake(Arc::new(move || {
                    // A block read back, or the tier's contents changed (events to publish).
                    let _ = waker
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .send(Command::Wake);
                }));
                *loop_shared.stats() = engine.stats();
                let _ = ready_tx.send(Ok((
                    engine.limits(),
                    engine
                        .kv_pools()
                        .iter()
                        .map(|r| (r.heads.clone(), r.pool.writer()))
                        .collect::<Vec<_>>(),
                    engine.backend().device_pools(),
                    engine.grammars().cloned(),
                    engine.expert_load(),
                )));
                run_loop(engine, rx, &loop_shared);
            })
            .map_err(|e| EngineError::Internal(format!("cannot start the engine thread: {e}")))?;
        let (limits, kv_writers, kv_devices, grammars, expert_load) = ready_rx
            .recv()
            .map_err(|_| EngineError::Internal("engine thread died while starting".into()))??;
        Ok(Self {
            commands,
            shared,
            limits,
            kv_writers,
            kv_devices,
            grammars,
            expert_load,
            thread: Some(thread),
        })
    }

    /// A mixture of experts' rows per expert so far, in expert order (None for a dense model):
    /// read from the counters the steps add to, without waiting for the engine's thread.
    pub fn expert_load(&self) -> Option<Vec<u64>> {
        self.expert_load.as_ref().map(|l| l.snapshot())
    }

    /// What requests are checked against; [`Self::submit`] checks them on the caller's thread.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The request with its grammar compiled, checked against the limits: on the caller's
    /// thread, so neither a refusal nor a compile holds up the engine's steps.
    fn checked(&self, mut request: Request) -> Result<Request, EngineError> {
        request.compile(self.grammars.as_deref())?;
        self.limits.validate(&request)?;
        Ok(request)
    }

    /// Writers of blocks into the engine's KV pools from other threads (transfers into reserved
    /// blocks; see [`Self::reserve_remote`]): one per tensor-parallel rank with the KV heads
    /// its pool holds, in rank order (one of every head without tensor parallelism); none when
    /// the cache is on a GPU.
    pub fn kv_writers(&self) -> Vec<(std::ops::Range<u32>, KvPoolWriter)> {
        self.kv_writers.clone()
    }

    /// Every rank's device KV pool with its KV heads, in rank order, for transfers into them
    /// through staging (see [`crate::DeviceSink`]), when the cache is on devices rather than
    /// in host pools (empty otherwise).
    pub fn kv_devices(&self) -> Vec<crate::DevicePool> {
        self.kv_devices.clone()
    }

    /// The request with its grammar compiled on tokio's blocking pool, for async callers to
    /// call before [`Self::submit`] (whose own compile then has nothing left to do): a large
    /// schema takes milliseconds (one of 500 properties 21 ms on a Zen 4 core), the
    /// vocabulary's index on first use a few hundred, which a thread serving streams must not
    /// spend. A request without a grammar comes straight back.
    pub async fn compile(&self, mut request: Request) -> Result<Request, EngineError> {
        if request.params.grammar.is_none() || request.constraint.is_some() {
            return Ok(request);
        }
        let grammars = self.grammars.clone();
        tokio::task::spawn_blocking(move || {
            request.compile(grammars.as_deref())?;
            Ok(request)
        })
        .await
        .map_err(|e| EngineError::Internal(format!("compiling the request's grammar: {e}")))?
    }

    /// Queues a request; invalid ones are refused here, before they reach the loop.
    pub fn submit(&self, request: Request) -> Result<RequestStream, EngineError> {
        let request = self.checked(request)?;
        self.send_submit(request, Mode::Local)
    }

    /// Queues a request in prefill mode: its stream carries [`StreamEvent::Kv`] chunks of the
    /// prompt's blocks from `skip_tokens` on as they are computed, then the first token.
    pub fn submit_prefill(
        &self,
        request: Request,
        skip_tokens: usize,
    ) -> Result<RequestStream, EngineError> {
        let request = self.checked(request)?;
        self.send_submit(request, Mode::Prefill { skip_tokens })
    }

    /// The decode side of a remote prefill: reserves blocks for the prompt (reusing the prefix
    /// cache) and parks the request. `Ok(None)`: no room now (submit it locally instead). Then
    /// [`Self::join_remote`] once the blocks hold the prompt's KV, or [`Self::prefill_locally`].
    /// Dropping the stream cancels it and frees the blocks: revoke any transfer into them first.
    pub async fn reserve_remote(
        &self,
        request: Request,
    ) -> Result<Option<(RequestStream, Reservation)>, EngineError> {
        let request = self.checked(request)?;
        let (tx, rx) = oneshot::channel();
        let mut stream = self.send_submit(request, Mode::Remote(tx))?;
        match rx.await {
            Ok(Some(r)) => Ok(Some((stream, r))),
            Ok(None) => {
                stream.done = true;
                Ok(None)
            }
            Err(_) => match stream.next().await {
                Some(StreamEvent::Failed(e)) => Err(e),
                _ => Err(EngineError::Stopped),
            },
        }
    }

    /// The reserved blocks hold the prompt's KV and `first` is the prefill worker's token: the
    /// request joins the running batch (its stream goes on from that token). `source_cached`:
    /// the leading tokens the prefill side found rather than computed ([`Engine::join_remote`]).
    pub fn join_remote(&self, stream: &RequestStream, first: Sampled, source_cached: usize) {
        let _ = self
            .commands
            .send(Command::JoinRemote(stream.id, first, source_cached));
    }

    /// The transfer failed: prefill the reserved request here instead.
    pub fn prefill_locally(&self, stream: &RequestStream) {
        let _ = self.commands.send(Command::PrefillLocally(stream.id));
    }

    fn send_submit(&self, request: Request, mode: Mode) -> Result<RequestStream, EngineError> {
        if self.failure().is_some() {
            return Err(EngineError::Stopped);
        }
        let id = RequestId(self.shared.next_id.fetch_add(1, Ordering::Relaxed));
        let unfinished = request.samples.count;
        let (tx, rx) = tmpsc::unbounded_channel();
        self.commands
            .send(Command::Submit {
                id,
                request: Box::new(request),
                mode,
                events: tx,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(RequestStream {
            id,
            rx,
            commands: self.commands.clone(),
            unfinished,
            done: false,
        })
    }

    /// Cancels a request (no-op if it already finished); its stream ends with a `Cancelled`
    /// finish within a step.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.commands.send(Command::Cancel(id));
    }

    /// Finishes some of a request's parallel samples (`Stop`, no-op for those already finished)
    /// while the others go on: each one's stream gets its finish within a step and its blocks
    /// are freed. For a stop the engine cannot see, such as a stop string found in the text.
    pub fn stop_samples(&self, id: RequestId, indices: &[u32]) {
        if !indices.is_empty() {
            let _ = self
                .commands
                .send(Command::StopSamples(id, indices.to_vec()));
        }
    }

    /// Hands every request over for a drain ([`Engine::hand_off`]): each stream ends with
    /// [`EngineError::HandedOff`] and the K/V its sequence computed stays in this engine for the
    /// worker that resumes it to pull. Returns how many requests were handed over (0 when the
    /// engine has stopped).
    pub async fn hand_off(&self) -> usize {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::HandOff(tx)).is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }

    /// The engine's state after its latest step.
    pub fn stats(&self) -> EngineStats {
        *self.shared.stats()
    }

    /// Why the engine stopped, if its thread panicked (the panic's message): it then failed
    /// every request it held with [`EngineError::Failed`] and takes no more.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.borrow().clone()
    }

    /// Resolves, with the panic's message, once the engine's thread has panicked (never, while
    /// it runs): a worker stops then, so that its supervisor starts a new one.
    pub async fn failed(&self) -> String {
        let mut rx = self.shared.failure.subscribe();
        let why = rx
            .wait_for(Option::is_some)
            .await
            .map(|why| why.clone().unwrap_or_default());
        match why {
            Ok(why) => why,
            // The sender lives in `shared`, which this handle holds: never.
            Err(_) => std::future::pending().await,
        }
    }

    /// Subscribes to the prefix cache's changes: a [`KvUpdate::Snapshot`] first, then
    /// [`KvUpdate::Events`] with consecutive sequence numbers. Dropping the receiver unsubscribes.
    pub fn subscribe_kv(&self) -> Result<tmpsc::UnboundedReceiver<KvUpdate>, EngineError> {
        let (tx, rx) = tmpsc::unbounded_channel();
        self.commands
            .send(Command::SubscribeKv(tx))
            .map_err(|_| EngineError::Stopped)?;
        Ok(rx)
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The events of one request, in order, ending with `Finished` (one per sample: with parallel
/// samples, each sample's events are in order and the samples' interleave) or `Failed`.
pub struct RequestStream {
    id: RequestId,
    rx: tmpsc::UnboundedReceiver<StreamEvent>,
    commands: mpsc::Sender<Command>,
    /// Samples that have not finished yet (the stream ends after the last one's `Finished`).
    unfinished: u32,
    done: bool,
}

impl RequestStream {
    /// The id the engine gave this request (what [`EngineHandle::cancel`] takes).
    pub fn id(&self) -> RequestId {
        self.id
    }

    fn seen(&mut self, e: Option<StreamEvent>) -> Option<StreamEvent> {
        match e {
            None | Some(StreamEvent::Failed(_)) => self.done = true,
            Some(StreamEvent::Finished(_)) => {
                self.unfinished = self.unfinished.saturating_sub(1);
                self.done = self.unfinished == 0;
            }
            _ => {}
        }
        e
    }

    /// Whether the last event has been taken (with parallel samples: every sample's finish).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The next event; `None` after the last.
    pub async fn next(&mut self) -> Option<StreamEvent> {
        let e = self.rx.recv().await;
        self.seen(e)
    }

    /// The next event if one is ready now, without waiting.
    pub fn try_next(&mut self) -> Option<StreamEvent> {
        let e = self.rx.try_recv().ok();
        if e.is_some() {
            self.seen(e)
        } else {
            None
        }
    }

    /// The next event, blocking the calling thread (not for async code).
    pub fn blocking_next(&mut self) -> Option<StreamEvent> {
        let e = self.rx.blocking_recv();
        self.seen(e)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

/// Sends the block manager's new events to every KV subscriber (dropping those that left). Runs
/// after every step and before a new subscriber's snapshot, so the snapshot's `next_seq` is
/// exactly the first event the new subscriber has not seen.
fn publish_kv(engine: &Engine, subscribers: &mut Vec<tmpsc::UnboundedSender<KvUpdate>>) {
    let events = engine.drain_kv_events();
    if events.is_empty() {
        return;
    }
    subscribers.retain(|s| s.send(KvUpdate::Events(events.clone())).is_ok());
}

/// Sends events to their requests' streams; a request whose stream is gone is cancelled.
fn deliver(engine: &mut Engine, sinks: &mut HashMap<RequestId, Sink>, events: Vec<Event>) {
    for ev in events {
        let (id, finish, ev) = match ev {
            Event::Kv(c) => (c.request, false, StreamEvent::Kv(c)),
            Event::Token(t) => (t.request, false, StreamEvent::Token(t)),
            Event::Finished(f) => (f.request, true, StreamEvent::Finished(f)),
        };
        let (gone, last) = match sinks.get_mut(&id) {
            Some(s) => {
                if finish {
                    s.unfinished = s.unfinished.saturating_sub(1);
                }
                (s.events.send(ev).is_err(), s.unfinished == 0)
            }
            None => (false, false),
        };
        if last {
            sinks.remove(&id);
        } else if gone {
            // Nobody is listening any more: stop spending compute on it.
            sinks.remove(&id);
            engine.cancel(id);
        }
    }
}

/// Where a request's events go, and how many of its samples have yet to finish.
struct Sink {
    events: tmpsc::UnboundedSender<StreamEvent>,
    unfinished: u32,
}

fn run_loop(mut engine: Engine, rx: mpsc::Receiver<Command>, shared: &Shared) {
    let mut sinks: HashMap<RequestId, Sink> = HashMap::new();
    let mut kv_subscribers: Vec<tmpsc::UnboundedSender<KvUpdate>> = Vec::new();
    loop {
        // A panic (a bug) leaves the engine's state unknown: its blocks, its running sequences.
        // Nothing of it is trusted after one; every request it held gets the panic as its error
        // (a stream that only ended would read as a worker gone, and the router would resume it
        // elsewhere: a request that makes engines panic would take them all down, one by one).
        let turn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            turn(&mut engine, &rx, &mut sinks, &mut kv_subscribers, shared)
        }));
        match turn {
            Ok(true) => {}
            Ok(false) => return,
            Err(panic) => {
                let why = tandem_types::panic_message(panic.as_ref());
                tracing::error!(
                    why,
                    "the engine thread panicked: failing its requests and stopping"
                );
                shared.failure.send_replace(Some(why.clone()));
                let failed = || StreamEvent::Failed(EngineError::Failed(why.clone()));
                for (_, sink) in sinks.drain() {
                    let _ = sink.events.send(failed());
                }
                // Requests already queued: submissions from now on are refused at the handle.
                for c in rx.try_iter() {
                    if let Command::Submit { events, .. } = c {
                        let _ = events.send(failed());
                    }
                }
                return;
            }
        }
    }
}

/// One turn of the loop: the commands waiting (blocking for one when there is no work), then
/// a step. False when the loop should end (shutdown, or every handle gone).
fn turn(
    engine: &mut Engine,
    rx: &mpsc::Receiver<Command>,
    sinks: &mut HashMap<RequestId, Sink>,
    kv_subscribers: &mut Vec<tmpsc::UnboundedSender<KvUpdate>>,
    shared: &Shared,
) -> bool {
    let mut commands = Vec::new();
    if !engine.has_work() {
        match rx.recv() {
            Ok(c) => commands.push(c),
            Err(_) => return false,
        }
    } else if let Some(until) = engine.waits_on_disk_only() {
        // Only reads from the disk tier are outstanding: each one wakes the loop, and the
        // oldest request stops waiting at `until`.
        match rx.recv_timeout(until.saturating_duration_since(std::time::Instant::now())) {
            Ok(c) => commands.push(c),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return false,
        }
    }
    commands.extend(rx.try_iter());
    for c in commands {
        match c {
            Command::Submit {
                id,
                request,
                mode,
                events,
            } => {
                let request = *request;
                let unfinished = request.samples.count;
                let added = match mode {
                    Mode::Local => engine.add(id, request),
                    Mode::Prefill { skip_tokens } => engine.add_prefill(id, request, skip_tokens),
                    Mode::Remote(reply) => match engine.reserve_remote(id, request) {
                        Ok(Some(r)) => {
                            if reply.send(Some(r)).is_err() {
                                engine.cancel(id);
                            }
                            Ok(())
                        }
                        Ok(None) => {
                            let _ = reply.send(None);
                            continue;
                        }
                        Err(e) => Err(e),
                    },
                };
                match added {
                    Ok(()) => {
                        sinks.insert(id, Sink { events, unfinished });
                    }
                    Err(e) => {
                        let _ = events.send(StreamEvent::Failed(e));
                    }
                }
            }
            Command::JoinRemote(id, first, held) => match engine.join_remote(id, first, held) {
                Ok(events) => deliver(engine, sinks, events),
                Err(e) => tracing::debug!(error = %e, "join of a request no longer parked"),
            },
            Command::PrefillLocally(id) => {
                engine.prefill_locally(id);
            }
            Command::Cancel(id) => engine.cancel(id),
            Command::StopSamples(id, indices) => engine.stop_samples(id, &indices),
            Command::SubscribeKv(tx) => {
                publish_kv(engine, kv_subscribers);
                let (last_seq, hashes) = engine.block_manager().snapshot();
                let next_seq = last_seq + 1;
                let disk_hashes = engine.disk_hashes();
                let snapshot = KvUpdate::Snapshot {
                    next_seq,
                    hashes,
                    disk_hashes,
                };
                if tx.send(snapshot).is_ok() {
                    kv_subscribers.push(tx);
                }
            }
            Command::Wake => {}
            Command::HandOff(reply) => {
                let ids = engine.hand_off();
                for id in &ids {
                    if let Some(s) = sinks.remove(id) {
                        let _ = s.events.send(StreamEvent::Failed(EngineError::HandedOff));
                    }
                }
                // What was parked shows in the stats by the time the caller hears back.
                *shared.stats() = engine.stats();
                let _ = reply.send(ids.len());
            }
            Command::Shutdown => return false,
        }
    }
    match engine.step() {
        Ok((events, _)) => deliver(engine, sinks, events),
        Err(e) => {
            tracing::error!(error = %e, "engine step failed; failing its requests");
            for id in engine.abort_all() {
                if let Some(s) = sinks.remove(&id) {
                    let failed = EngineError::Step(e.to_string());
                    let _ = s.events.send(StreamEvent::Failed(failed));
                }
            }
        }
    }
    publish_kv(engine, kv_subscribers);
    *shared.stats() = engine.stats();
    true
}

impl Shared {
    /// The stats, whoever held the lock last (it guards a plain copy, whole at every moment).
    fn stats(&self) -> std::sync::MutexGuard<'_, EngineStats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::tiny_model;
    use crate::engine::tests::config;
    use crate::engine::tests::req;
    use crate::engine::FinishReason;

    fn spawn() -> EngineHandle {
        EngineHandle::spawn(|| Engine::new(tiny_model(3), config(), vec![])).unwrap()
    }

    /// Steps the test lets through: the engine thread waits in each forward for a permit, so
    /// what a request has done when the test acts on it does not depend on the machine's speed.
    #[derive(Clone, Default)]
    struct Gate(Arc<(Mutex<Option<u32>>, std::sync::Condvar)>);

    impl Gate {
        /// Lets every step through (the start).
        fn open(&self) {
            *self.0 .0.lock().unwrap() = None;
            self.0 .1.notify_all();
        }

        /// Lets `n` more steps through, then holds the next.
        fn grant(&self, n: u32) {
            let mut g = self.0 .0.lock().unwrap();
            *g = Some(g.unwrap_or(0) + n);
            self.0 .1.notify_all();
        }

        fn pass(&self) {
            let mut g = self.0 .0.lock().unwrap();
            loop {
                match *g {
                    None => return,
                    Some(n) if n > 0 => {
                        *g = Some(n - 1);
                        return;
                    }
                    Some(_) => g = self.0 .1.wait(g).unwrap(),
                }
            }
        }
    }

    /// The CPU backend behind a [`Gate`].
    struct Gated {
        inner: crate::device::cpu::CpuBackend,
        gate: Gate,
    }

    impl crate::backend::Backend for Gated {
        fn config(&self) -> &tandem_model::ModelConfig {
            self.inner.config()
        }
        fn forward(
            &mut self,
            seqs: &[crate::forward::SeqBatch<'_>],
        ) -> Result<Vec<f32>, EngineError> {
            self.gate.pass();
            self.inner.forward(seqs)
        }
        fn num_blocks(&self) -> usize {
            self.inner.num_blocks()
        }
        fn copy_blocks(
            &mut self,
            pairs: &[(tandem_types::BlockId, tandem_types::BlockId)],
        ) -> Result<(), EngineError> {
            self.inner.copy_blocks(pairs)
        }
        fn weight_bytes(&self) -> usize {
            self.inner.weight_bytes()
        }
        fn kv_bytes_per_token(&self) -> f64 {
            self.inner.kv_bytes_per_token()
        }
        fn kv_dtype_name(&self) -> &'static str {
            self.inner.kv_dtype_name()
        }
        fn device(&self) -> String {
            self.inner.device()
        }
    }

    #[tokio::test]
    async fn async_streams_match_the_sync_engine_and_cancel_frees_blocks() {
        let gate = Gate::default();
        let h = {
            let gate = gate.clone();
            EngineHandle::spawn(move || {
                let inner = crate::device::cpu::CpuBackend::new(tiny_model(3), &config().pool())?;
                Engine::with_backend(Box::new(Gated { inner, gate }), config(), vec![])
            })
            .unwrap()
        };
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|i| (0..(5 + 7 * i)).map(|t| (t * 3 + i) % 97).collect())
            .collect();
        let mut streams: Vec<RequestStream> = prompts
            .iter()
            .map(|p| h.submit(req(p.clone(), 12)).unwrap())
            .collect();
        let mut got = Vec::new();
        for s in &mut streams {
            let mut toks = Vec::new();
            loop {
                match s.next().await.expect("stream ends with Finished") {
                    StreamEvent::Token(t) => toks.push(t.sampled.token),
                    StreamEvent::Finished(f) => {
                        assert_eq!(f.output_ids, toks);
                        assert_eq!(f.finish_reason, FinishReason::Length);
                        break;
                    }
                    other => panic!("{other:?}"),
                }
            }
            got.push(toks);
        }
        let mut e = Engine::new(tiny_model(3), config(), vec![]).unwrap();
        let want: Vec<Vec<u32>> = e
            .generate(
                prompts.iter().map(|p| req(p.clone(), 12)).collect(),
                |_| {},
                |_| {},
            )
            .unwrap()
            .into_iter()
            .map(|f| f.output_ids)
            .collect();
        assert_eq!(got, want);
        // Cancel a long one mid-stream: its prompt's step and one decode step run, then the
        // engine waits in the third. The cancel is read before that step (if the engine had
        // not reached it yet) or right after it, so the request ends with 2 or 3 tokens.
        gate.grant(2);
        let mut long = h.submit(req(vec![1, 2, 3], 200)).unwrap();
        assert!(matches!(long.next().await, Some(StreamEvent::Token(_))));
        assert!(matches!(long.next().await, Some(StreamEvent::Token(_))));
        h.cancel(long.id());
        gate.open();
        let mut tokens = 2;
        let mut last = None;
        while let Some(ev) = long.next().await {
            if matches!(ev, StreamEvent::Token(_)) {
                tokens += 1;
            }
            last = Some(ev);
        }
        match last {
            Some(StreamEvent::Finished(f)) => {
                assert_eq!(f.finish_reason, FinishReason::Cancelled);
                assert!((2..=3).contains(&tokens), "{tokens} tokens");
                assert_eq!(f.output_ids.len(), tokens);
            }
            other => panic!("{other:?}"),
        }
        // Stats are published right after the step that finished it; the engine has nothing
        // left to run, so the wait is for one loop turn of an idle thread.
        for _ in 0..2000 {
            if h.stats().blocks_used == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let st = h.stats();
        assert_eq!(
            (st.running, st.waiting, st.blocks_used),
            (0, 0, 0),
            "{st:?}"
        );
        assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total);
    }

    #[tokio::test]
    async fn a_prefill_handle_feeds_a_decode_handle() {
        let prefill = spawn();
        let decode = spawn();
        let prompt: Vec<u32> = (0..70).map(|t| (t * 3 + 1) % 97).collect();
        drain_async(&mut decode.submit(req(prompt.clone(), 9)).unwrap()).await;
        // A different prompt sharing nothing with the decode cache but the first block.
        let mut prompt2 = prompt.clone();
        prompt2[20] = 96;
        let want2 = {
            let h = spawn();
            drain_async(&mut h.submit(req(prompt2.clone(), 9)).unwrap()).await
        };
        let (mut stream, r) = decode
            .reserve_remote(req(prompt2.clone(), 9))
            .await
            .unwrap()
            .expect("room");
        assert_eq!(
            r.cached_tokens, 16,
            "the first block is cached on the decode side"
        );
        assert_eq!(r.blocks.len(), 4, "tokens 16..70");
        let mut p = prefill
            .submit_prefill(req(prompt2.clone(), 9), r.cached_tokens)
            .unwrap();
        let w = decode.kv_writers().remove(0).1;
        let mut first = None;
        let mut filled = 0;
        while let Some(ev) = p.next().await {
            match ev {
                StreamEvent::Kv(c) => {
                    for j in 0..c.blocks {
                        for layer in 0..c.layers() {
                            let b = r.blocks[c.first + j].index();
                            let frame = c.pieces[0].frame(layer, j);
                            // SAFETY: reserved and parked: the decode engine leaves it alone.
                            unsafe { w.write(layer, b, frame).unwrap() };
                        }
                    }
                    filled += c.blocks;
                }
                StreamEvent::Token(t) => first = Some(t.sampled),
                StreamEvent::Finished(_) => {}
                StreamEvent::Failed(e) => panic!("{e}"),
            }
        }
        assert_eq!(filled, r.blocks.len());
        decode.join_remote(&stream, first.expect("first token"), 0);
        assert_eq!(drain_async(&mut stream).await, want2);
        // No room: a reservation larger than the pool is refused at validation.
        assert!(decode.reserve_remote(req(vec![1; 5000], 1)).await.is_err());
    }

    async fn drain_async(s: &mut RequestStream) -> Vec<u32> {
        let mut toks = Vec::new();
        while let Some(ev) = s.next().await {
            match ev {
                StreamEvent::Token(t) => toks.push(t.sampled.token),
                StreamEvent::Failed(e) => panic!("{e}"),
                _ => {}
            }
        }
        toks
    }

    fn drain(s: &mut RequestStream) -> Vec<u32> {
        let mut toks = Vec::new();
        while let Some(ev) = s.blocking_next() {
            if let StreamEvent::Token(t) = ev {
                toks.push(t.sampled.token);
            }
        }
        toks
    }

    #[test]
    fn kv_subscribers_get_a_snapshot_then_gapless_events() {
        let h = spawn();
        let a: Vec<u32> = (0..40).map(|t| (t * 7 + 1) % 97).collect();
        drain(&mut h.submit(req(a.clone(), 2)).unwrap());
        let mut sub = h.subscribe_kv().unwrap();
        let (next_seq, hashes) = match sub.blocking_recv() {
            Some(KvUpdate::Snapshot {
                next_seq, hashes, ..
            }) => (next_seq, hashes),
            other => panic!("{other:?}"),
        };
        // 40 prompt + 2 output tokens: the first two 16-token blocks are full and cached.
        let want = tandem_model::block_hashes(&a, 16);
        assert_eq!(want.len(), 2);
        for w in &want {
            assert!(hashes.contains(w), "{hashes:?} lacks {w:?}");
        }
        let b: Vec<u32> = (0..20).map(|t| (t * 5 + 3) % 97).collect();
        drain(&mut h.submit(req(b.clone(), 1)).unwrap());
        let mut seq = next_seq;
        let mut stored = Vec::new();
        while stored.is_empty() {
            match sub.blocking_recv() {
                Some(KvUpdate::Events(evs)) => {
                    for e in evs {
                        assert_eq!(e.seq, seq, "sequence numbers have no gaps");
                        seq += 1;
                        if let crate::KvEventKind::Stored { hashes, .. } = e.kind {
                            stored.extend(hashes);
                        }
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(stored, tandem_model::block_hashes(&b, 16));
    }

    #[tokio::test]
    async fn compile_gives_the_request_its_constraint_and_refuses_a_bad_grammar() {
        let text = tandem_model::load_text(&tandem_model::default_model_path()).unwrap();
        let grammars = Arc::new(GrammarCompiler::new(text.tokenizer, text.config.vocab_size));
        let h = EngineHandle::spawn(move || {
            Ok(Engine::new(tiny_model(3), config(), vec![])?.with_grammars(grammars))
        })
        .unwrap();
        let with = |g: Option<tandem_grammar::Grammar>| {
            let r = req(vec![1, 2], 4);
            let mut p = (*r.params).clone();
            p.grammar = g;
            Request {
                params: p.validate().unwrap(),
                ..r
            }
        };
        let plain = h.compile(with(None)).await.unwrap();
        assert!(plain.constraint.is_none());
        let choice = tandem_grammar::Grammar::Choice(vec!["yes".into(), "no".into()]);
        let compiled = h.compile(with(Some(choice))).await.unwrap();
        assert!(compiled.constraint.is_some());
        let bad = tandem_grammar::Grammar::Regex("(unclosed".into());
        assert!(matches!(
            h.compile(with(Some(bad))).await,
            Err(EngineError::Grammar(tandem_grammar::GrammarError::Invalid(
                _
            )))
        ));
    }

    #[tokio::test]
    async fn a_grammar_that_cannot_go_on_ends_its_request_with_the_error() {
        // Twenty right-recursive rules over `a`: the parser passes its limit of 2,000 items in
        // a row within fifty tokens. The sampler used to drop such a grammar and go on
        // unconstrained; the request must end with the error instead.
        let text = tandem_model::load_text(&tandem_model::default_model_path()).unwrap();
        let a = text.tokenizer.encode("a", false).unwrap()[0];
        let eos = text.tokenizer.eos_token_ids.clone();
        let grammars = Arc::new(GrammarCompiler::new(text.tokenizer, text.config.vocab_size));
        let h = EngineHandle::spawn(move || {
            Ok(Engine::new(tiny_model(3), config(), vec![])?.with_grammars(grammars))
        })
        .unwrap();
        let lark = include_str!("../../grammar/tests/data/items_bomb.lark");
        let r = req(vec![1, 2, 3], 200);
        let mut p = (*r.params).clone();
        p.grammar = Some(tandem_grammar::Grammar::Lark(lark.into()));
        // The grammar may end after any `a`: keep the model from ending it there.
        p.logit_bias = eos.iter().map(|&e| (e, -100.0)).collect();
        let r = Request {
            params: p.validate().unwrap(),
            ..r
        };
        let mut s = h.submit(h.compile(r).await.unwrap()).unwrap();
        let mut tokens = Vec::new();
        let finished = loop {
            match s.next().await {
                Some(StreamEvent::Token(t)) => tokens.push(t),
                Some(StreamEvent::Finished(f)) => break f,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(finished.finish_reason, FinishReason::Error);
        let e = finished.error.as_deref().unwrap();
        assert!(e.contains("max is 2000"), "{e}");
        // Every token but the last (drawn as it failed, never shown) is the grammar's; the
        // last token event carries the finish.
        let (last, kept) = tokens.split_last().unwrap();
        assert!((10..200).contains(&kept.len()), "{}", kept.len());
        assert!(kept
            .iter()
            .all(|t| t.sampled.token == a && t.finish.is_none()));
        assert_eq!(last.finish, Some(FinishReason::Error));
        assert!(s.next().await.is_none());
        for _ in 0..2000 {
            if h.stats().blocks_used == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(h.stats().blocks_used, 0);
    }

    #[test]
    fn bad_requests_are_refused_at_submit_and_dropped_streams_cancel() {
        let h = spawn();
        assert!(matches!(
            h.submit(req(vec![500], 4)),
            Err(EngineError::BadToken { id: 500, .. })
        ));
        assert!(h.submit(req(vec![], 4)).is_err());
        let s = h.submit(req(vec![1, 2, 3], 100_000)).unwrap();
        drop(s);
        let mut t = h.submit(req(vec![4, 5], 3)).unwrap();
        let mut n = 0;
        while let Some(ev) = t.blocking_next() {
            if let StreamEvent::Token(_) = ev {
                n += 1;
            }
        }
        assert_eq!(n, 3);
        for _ in 0..2000 {
            let st = h.stats();
            if st.running == 0 && st.waiting == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let st = h.stats();
        assert_eq!(
            (st.running, st.waiting, st.blocks_used),
            (0, 0, 0),
            "{st:?}"
        );
    }

    #[tokio::test]
    async fn a_panic_on_the_engine_thread_fails_every_request_and_says_why() {
        // Two requests; the fourth step panics (as a bug would).
        let h = EngineHandle::spawn(|| {
            let cfg = crate::EngineConfig {
                panic_at_step: Some(4),
                ..config()
            };
            Engine::new(tiny_model(3), cfg, vec![])
        })
        .unwrap();
        assert_eq!(h.failure(), None);
        let mut a = h.submit(req(vec![1, 2, 3], 50)).unwrap();
        let mut b = h.submit(req(vec![4, 5], 50)).unwrap();
        // `a` is in every step; `b` from the first step after its submission reached the loop,
        // which on a loaded machine can be after the third (the engine thread steps `a` on
        // meanwhile): then `b` fails waiting, with no token.
        for (s, made) in [(&mut a, 3..=3), (&mut b, 0..=3)] {
            let mut tokens = 0;
            let why = loop {
                match s.next().await {
                    Some(StreamEvent::Token(_)) => tokens += 1,
                    Some(StreamEvent::Failed(EngineError::Failed(why))) => break why,
                    other => panic!("{other:?}"),
                }
            };
            assert!(why.contains("engine step 4"), "{why}");
            // Steps 1 to 3 made its tokens; it never finished.
            assert!(made.contains(&tokens), "{tokens}");
            assert!(s.is_done());
            assert!(s.next().await.is_none());
        }
        let why = tokio::time::timeout(std::time::Duration::from_secs(60), h.failed())
            .await
            .expect("the failure is announced");
        assert!(why.contains("engine step 4"), "{why}");
        assert_eq!(h.failure().as_deref(), Some(why.as_str()));
        // Nothing more is taken; the handle still answers (and drops without hanging).
        assert!(matches!(
            h.submit(req(vec![1], 5)),
            Err(EngineError::Stopped)
        ));
        assert_eq!(h.stats().steps, 3);
    }
}
