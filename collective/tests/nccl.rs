//! The NCCL ranks under the same checks as the CPU thread ranks: every collective of every rank
//! equals its serial definition. A group of one rank runs on any machine with a GPU and NCCL; a
//! group of every GPU runs where there are several. Without NCCL or a GPU each test says so on
//! stderr and returns; TANDEM_REQUIRE_GPU=1 (scripts/gpu-check) turns that into a failure.

use std::time::Duration;

use tandem_collective::nccl::{self, NcclId, NcclRank};
use tandem_collective::Collective;

/// GPUs here when there are at least `need`; None (said on stderr) when NCCL or a GPU is
/// missing and not required, or when there are fewer than `need` (a machine with one card
/// cannot hold a group of two: said, never a failure).
fn gpus(test: &str, need: usize) -> Option<usize> {
    let required = std::env::var_os("TANDEM_REQUIRE_GPU").is_some();
    let why = if !nccl::available() {
        "no CUDA driver or no libnccl on the library path"
    } else {
        match cudarc::driver::result::init()
            .and_then(|_| cudarc::driver::CudaContext::device_count())
        {
            Ok(n) if n as usize >= need => return Some(n as usize),
            Ok(n) if n > 0 => {
                eprintln!(
                    "{test}: {n} GPU here, the test needs {need} (a machine with several cards)"
                );
                return None;
            }
            _ => "no CUDA device",
        }
    };
    assert!(!required, "{test}: TANDEM_REQUIRE_GPU is set but {why}");
    eprintln!("{test}: {why}; the NCCL ranks are compile-checked only here");
    None
}

/// Runs `f` on ranks 0..n, one thread each on GPU `rank`, in one NCCL group; results in rank
/// order.
fn on_ranks<T: Send + 'static>(
    n: usize,
    watchdog: Duration,
    f: impl Fn(&mut NcclRank) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    // The setup's times go to stderr (gpu-check keeps them): a slow NCCL start shows where.
    let t = std::time::Instant::now();
    let id = NcclId::new().unwrap();
    eprintln!("NCCL id made in {:.1?}", t.elapsed());
    // Across processes the id travels as bytes: these ranks take it the same way.
    let bytes = id.to_bytes();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || {
                let id = NcclId::from_bytes(&bytes);
                let t = std::time::Instant::now();
                let mut r = NcclRank::new(rank, rank, n, id, watchdog).unwrap();
                eprintln!("NCCL rank {rank} of {n} joined in {:.1?}", t.elapsed());
                let t = std::time::Instant::now();
                let out = f(&mut r);
                eprintln!(
                    "NCCL rank {rank} of {n} ran its calls in {:.1?}",
                    t.elapsed()
                );
                out
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn data(rank: usize, call: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 31 + rank * 7 + call * 13) % 97) as f32 / 8.0 - 6.0)
        .collect()
}

fn collectives_equal_their_definitions(ranks: usize) {
    let lens = [0usize, 1, 1000, 1 << 18];
    let got = on_ranks(ranks, Duration::from_secs(120), move |r| {
        let me = r.rank();
        let mut out = Vec::new();
        for (c, &n) in lens.iter().enumerate() {
            let mut buf = data(me, c, n);
            r.all_reduce_sum(&mut buf).unwrap();
            let mut all = vec![0f32; r.size() * n];
            r.all_gather(&data(me, c, n), &mut all).unwrap();
            let mut b = data(me, c + 100, n);
            r.broadcast(&mut b, r.size() - 1).unwrap();
            r.barrier().unwrap();
            out.push((buf, all, b));
        }
        out
    });
    for (c, &n) in lens.iter().enumerate() {
        let sum: Vec<f32> = (0..n)
            .map(|i| (0..ranks).map(|r| data(r, c, n)[i]).sum())
            .collect();
        let gathered: Vec<f32> = (0..ranks).flat_map(|r| data(r, c, n)).collect();
        let root = data(ranks - 1, c + 100, n);
        for (rank, calls) in got.iter().enumerate() {
            let (s, g, b) = &calls[c];
            // Values that are multiples of 1/8 below 100 in magnitude: every order of
            // summation is exact, so the sums must be equal, not close.
            assert_eq!(s, &sum, "all-reduce of {n} on rank {rank}");
            assert_eq!(g, &gathered, "all-gather of {n} on rank {rank}");
            assert_eq!(b, &root, "broadcast of {n} on rank {rank}");
        }
    }
}

#[test]
fn a_single_rank_group_runs_every_collective() {
    if gpus("a_single_rank_group_runs_every_collective", 1).is_none() {
        return;
    }
    collectives_equal_their_definitions(1);
}

#[test]
fn a_group_of_every_gpu_runs_every_collective() {
    let Some(n) = gpus("a_group_of_every_gpu_runs_every_collective", 2) else {
        return;
    };
    collectives_equal_their_definitions(n);
}

/// A group whose second rank never joins its collective: the first fails at its watchdog with
/// the timeout, and is poisoned. Needs two GPUs.
#[test]
fn a_rank_that_never_comes_trips_the_watchdog() {
    if gpus("a_rank_that_never_comes_trips_the_watchdog", 2).is_none() {
        return;
    }
    let got = on_ranks(2, Duration::from_millis(500), |r| {
        if r.rank() == 1 {
            // Joins the group, then skips the collective.
            std::thread::sleep(Duration::from_secs(2));
            return Ok(());
        }
        let mut buf = vec![1f32; 16];
        let e = r.all_reduce_sum(&mut buf).map_err(|e| e.to_string());
        let again = r.barrier().map_err(|e| e.to_string());
        e.and(again)
    });
    let e = got[0].clone().unwrap_err();
    assert!(e.contains("did not arrive"), "{e}");
}
