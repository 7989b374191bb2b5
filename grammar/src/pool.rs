//! Where grammars compile: a few threads of the process's own, each with a stack far larger than
//! the depth [`limits`](crate::limits) lets through needs, behind a bounded queue. A compile
//! never runs on the thread that asked for it (an async worker's or an engine's), a panic in one
//! is that request's error, and a caller waits at most [`COMPILE_BUDGET`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::GrammarError;

/// Each compile thread's stack: reserved address space, touched only as deep as a compile goes.
/// A chain at [`MAX_GRAMMAR_DEPTH`](crate::MAX_GRAMMAR_DEPTH) uses a few megabytes.
pub const COMPILE_STACK_BYTES: usize = 256 << 20;

/// Compiles waiting for a thread beyond which a new one is refused as busy.
pub const COMPILE_QUEUE: usize = 64;

/// How long a caller waits for its compile. The grammar engine's own fuel limits end a compile
/// long before; this bounds the wait behind others in the queue.
pub const COMPILE_BUDGET: Duration = Duration::from_secs(30);

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    queue: SyncSender<Job>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let (queue, jobs) = mpsc::sync_channel::<Job>(COMPILE_QUEUE);
        let jobs = Arc::new(Mutex::new(jobs));
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .clamp(1, 4);
        for i in 0..threads {
            let jobs: Arc<Mutex<Receiver<Job>>> = jobs.clone();
            std::thread::Builder::new()
                .name(format!("grammar-{i}"))
                .stack_size(COMPILE_STACK_BYTES)
                .spawn(move || loop {
                    let job = match jobs.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .expect("spawning a grammar compile thread");
        }
        Pool { queue }
    })
}

/// Runs `work` on a compile thread and waits for its answer: a panic becomes
/// [`GrammarError::Internal`], a full queue or a compile past [`COMPILE_BUDGET`]
/// [`GrammarError::Busy`].
pub(crate) fn run<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, GrammarError> + Send + 'static,
) -> Result<T, GrammarError> {
    let (tx, rx) = mpsc::sync_channel(1);
    let job: Job = Box::new(move || {
        let out = catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|p| {
            let what = tandem_types::panic_message(p.as_ref());
            Err(GrammarError::Internal(format!(
                "the grammar compiler failed: {what}"
            )))
        });
        // The caller may have stopped waiting.
        let _ = tx.send(out);
    });
    match pool().queue.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Err(GrammarError::Busy(format!(
                "{COMPILE_QUEUE} grammars are already waiting to compile"
            )))
        }
        Err(TrySendError::Disconnected(_)) => {
            return Err(GrammarError::Internal(
                "the grammar compile threads are gone".into(),
            ))
        }
    }
    match rx.recv_timeout(COMPILE_BUDGET) {
        Ok(out) => out,
        Err(RecvTimeoutError::Timeout) => Err(GrammarError::Busy(format!(
            "the grammar did not compile within {COMPILE_BUDGET:?}"
        ))),
        Err(RecvTimeoutError::Disconnected) => Err(GrammarError::Internal(
            "the grammar compile thread stopped".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_the_callers_error_and_the_pool_goes_on() {
        let e = run::<()>(|| panic!("boom")).unwrap_err();
        assert!(
            matches!(&e, GrammarError::Internal(m) if m.contains("boom")),
            "{e:?}"
        );
        assert_eq!(run(|| Ok(7)).unwrap(), 7);
    }

    #[test]
    fn work_runs_on_a_deep_stack() {
        // 64 MiB of stack in one frame chain: far past a default thread's 2 MiB (or 8).
        fn deep(n: usize) -> usize {
            let pad = std::hint::black_box([n as u8; 4096]);
            if n == 0 {
                0
            } else {
                deep(n - 1) + pad[n % 4096] as usize % 2 // n's parity
            }
        }
        let got = run(|| Ok(deep(16_000))).unwrap();
        assert_eq!(got, 8_000);
    }
}
