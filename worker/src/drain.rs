//! Requests in flight, and the graceful stop that waits for them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Notify};

/// A worker's requests in flight and its draining state, shared by its services. On shutdown
/// ([`Drain::drain`]) the worker refuses new work ([`Drain::enter`] fails), waits for what runs
/// to finish within a deadline, then ends its long-lived streams (KV events). Before that, it
/// may leave the cluster without stopping ([`Drain::leave`], Kubernetes' preStop hook): it
/// refuses new work and reports draining while what runs goes on.
#[derive(Debug)]
pub struct Drain {
    count: AtomicUsize,
    changed: Notify,
    draining: AtomicBool,
    left: watch::Sender<bool>,
    stop: watch::Sender<bool>,
}

impl Drain {
    /// Nothing in flight, taking work.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            count: AtomicUsize::new(0),
            changed: Notify::new(),
            draining: AtomicBool::new(false),
            left: watch::channel(false).0,
            stop: watch::channel(false).0,
        })
    }

    /// Counts one request until the returned guard drops; refused (the error says why, for an
    /// UNAVAILABLE answer) once the worker drains.
    pub fn enter(self: &Arc<Self>) -> Result<InFlight, &'static str> {
        if self.is_draining() {
            return Err("this worker is draining for shutdown");
        }
        self.count.fetch_add(1, Ordering::SeqCst);
        Ok(InFlight(self.clone()))
    }

    /// Requests counted now.
    pub fn in_flight(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Whether the worker has begun to stop.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Stops taking new work and wakes [`Drain::left`]; requests in flight go on, and nothing
    /// stops until [`Drain::drain`]. Returns how many are in flight.
    pub fn leave(&self) -> usize {
        self.draining.store(true, Ordering::SeqCst);
        self.left.send_replace(true);
        self.in_flight()
    }

    /// Resolves once [`Drain::leave`] (or [`Drain::drain`]) has been called.
    pub async fn left(&self) {
        let mut rx = self.left.subscribe();
        let _ = rx.wait_for(|l| *l).await;
    }

    /// Turns true when the drain is over: long-lived streams end then.
    pub fn stopped(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// Stops taking work, waits (up to `deadline`) for the requests in flight to finish, then
    /// flips [`Drain::stopped`]. Returns how many were still running at the deadline.
    pub async fn drain(&self, deadline: Duration) -> usize {
        self.draining.store(true, Ordering::SeqCst);
        self.left.send_replace(true);
        let idle = async {
            loop {
                let changed = self.changed.notified();
                if self.in_flight() == 0 {
                    return;
                }
                changed.await;
            }
        };
        let _ = tokio::time::timeout(deadline, idle).await;
        self.stop.send_replace(true);
        self.in_flight()
    }
}

/// One request counted in flight; dropping it ends the count.
#[derive(Debug)]
pub struct InFlight(Arc<Drain>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_drain_waits_for_requests_then_refuses_and_stops_streams() {
        let d = Drain::new();
        let a = d.enter().unwrap();
        let b = d.enter().unwrap();
        assert_eq!(d.in_flight(), 2);
        let mut stopped = d.stopped();
        let drain = tokio::spawn({
            let d = d.clone();
            async move { d.drain(Duration::from_secs(60)).await }
        });
        tokio::task::yield_now().await;
        assert!(d.is_draining());
        assert!(d.enter().is_err(), "no new work while draining");
        assert!(!*stopped.borrow());
        drop(a);
        tokio::task::yield_now().await;
        assert!(!drain.is_finished(), "one request still runs");
        drop(b);
        assert_eq!(drain.await.unwrap(), 0);
        stopped.changed().await.unwrap();
        assert!(*stopped.borrow());
    }

    #[tokio::test(start_paused = true)]
    async fn leaving_refuses_new_work_but_stops_nothing() {
        let d = Drain::new();
        let held = d.enter().unwrap();
        let left = tokio::spawn({
            let d = d.clone();
            async move { d.left().await }
        });
        tokio::task::yield_now().await;
        assert!(!left.is_finished());
        assert_eq!(d.leave(), 1);
        left.await.unwrap();
        assert!(d.is_draining());
        assert!(d.enter().is_err(), "no new work once left");
        assert_eq!(d.in_flight(), 1, "what runs goes on");
        assert!(!*d.stopped().borrow(), "nothing stops before the drain");
        drop(held);
        assert_eq!(d.drain(Duration::from_secs(60)).await, 0);
        assert!(*d.stopped().borrow());
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_ends_a_drain_that_requests_outlive() {
        let d = Drain::new();
        let _held = d.enter().unwrap();
        assert_eq!(d.drain(Duration::from_secs(3)).await, 1);
        assert!(*d.stopped().borrow());
    }
}
