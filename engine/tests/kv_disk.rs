//! The disk tier under the prefix cache: blocks the pool evicts are written to disk and read back
//! for a later request with the same prefix, with the bits recompute gives (tokens and
//! log-probabilities compared with `to_bits()`); a damaged file is refused, counted and computed
//! instead; the tier survives a restart; it keeps to its capacity; and a stuck disk holds up
//! neither the steps nor the requests behind the one waiting for it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tandem_engine::{
    CpuModel, Engine, EngineConfig, Finished, KvDiskConfig, KvEventKind, Request, WeightFormat,
};
use tandem_model::hash::block_hashes;
use tandem_types::SamplingParams;

const BS: usize = 16;

fn model() -> CpuModel {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/families/llama3/model.gguf");
    let m = tandem_model::load(&p).unwrap();
    CpuModel::new(&m, WeightFormat::Native).unwrap()
}

/// An engine of `blocks` blocks over a tier of `capacity` bytes in `dir`.
fn engine(dir: &Path, blocks: usize, capacity: u64) -> Engine {
    let mut disk = KvDiskConfig::new(dir, capacity, "tiny llama3");
    // Long enough never to run out in a test, however slow the machine.
    disk.max_wait = Duration::from_secs(3600);
    let cfg = EngineConfig {
        block_size: BS,
        num_blocks: Some(blocks),
        kv_disk: Some(disk),
        ..EngineConfig::default()
    };
    Engine::new(model(), cfg, vec![]).unwrap()
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|t| (t * 7 + seed * 31 + t * t) % 200 + 5)
        .collect()
}

/// A greedy request and a seeded one at temperature 0.9 after `p`, 12 tokens each.
fn requests(p: &[u32]) -> Vec<Request> {
    let sampled = SamplingParams {
        temperature: 0.9,
        seed: Some(11),
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    };
    vec![
        Request::greedy(p.to_vec(), 12).unwrap(),
        Request::new(p.to_vec(), sampled.validate().unwrap()),
    ]
}

fn run(e: &mut Engine, r: Vec<Request>) -> Vec<Finished> {
    e.generate(r, |_| {}, |_| {}).unwrap()
}

/// What the outputs are, bit for bit.
fn bits(out: &[Finished]) -> Vec<(Vec<u32>, Vec<u32>)> {
    out.iter()
        .map(|f| {
            (
                f.output_ids.clone(),
                f.logprobs.iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect()
}

/// Runs other prompts through `e` until none of `p`'s blocks is left in its pool, and waits for
/// the writes.
fn push_out(e: &mut Engine) {
    for seed in 1..4 {
        run(
            e,
            vec![Request::greedy(prompt(100 + seed, 120), 4).unwrap()],
        );
    }
    e.disk_tier().unwrap().flush();
}

/// [`push_out`], and checks that `p`'s full prompt blocks are on disk.
fn evict(e: &mut Engine, p: &[u32]) {
    push_out(e);
    let hashes = block_hashes(p, BS);
    // The pool holds 10 blocks; three 124-token requests since leave nothing of `p`.
    assert!(e.stats().disk.spilled >= hashes.len() as u64);
    for h in &hashes[..(p.len() - 1) / BS] {
        assert!(e.disk_tier().unwrap().contains(h.0), "block on disk");
    }
}

#[test]
fn a_prefix_evicted_from_ram_comes_back_from_disk_with_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path(), 10, 64 << 20);
    let p = prompt(0, 81);
    let want = run(&mut e, requests(&p));
    assert_eq!(want[0].output_ids.len(), 12);
    evict(&mut e, &p);
    let got = run(&mut e, requests(&p));
    assert_eq!(bits(&got), bits(&want));
    // The five full blocks of the prompt came from disk (once: the second request found them
    // in the pool).
    let s = e.stats();
    assert_eq!(s.disk.promoted, 5, "{s:?}");
    assert_eq!(got[0].cached_prompt_tokens, 80);
    assert_eq!(s.disk.load_failures, 0);
    assert_eq!(s.blocks_used, 0);
    let tier = s.disk_tier.unwrap();
    assert_eq!(tier.reads, 5);
    assert!(tier.write_bytes > 0 && tier.read_bytes > 0);
}

#[test]
fn a_damaged_block_is_refused_counted_and_computed() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path(), 10, 64 << 20);
    let p = prompt(1, 81);
    let want = run(&mut e, requests(&p));
    evict(&mut e, &p);
    // Block 2's file loses a bit: blocks 0 and 1 come back, 2 is computed and so is everything
    // after it (its successors are read back, but admission stops at the first block missing).
    let h2 = block_hashes(&p, BS)[2];
    let path = e.disk_tier().unwrap().path_of(h2.0);
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    let got = run(&mut e, requests(&p));
    assert_eq!(bits(&got), bits(&want));
    // The router heard of the blocks written, and of the refused one going.
    let (mut on_disk, mut gone) = (Vec::new(), Vec::new());
    for ev in e.drain_kv_events() {
        match ev.kind {
            KvEventKind::DiskStored { hashes } => on_disk.extend(hashes),
            KvEventKind::DiskRemoved { hashes } => gone.extend(hashes),
            _ => {}
        }
    }
    assert!(block_hashes(&p, BS)[..5]
        .iter()
        .all(|h| on_disk.contains(h)));
    assert_eq!(gone, [h2]);
    assert!(!e.disk_hashes().contains(&h2));
    let s = e.stats();
    assert_eq!(s.disk_tier.unwrap().checksum_failures, 1);
    assert_eq!(s.disk.load_failures, 1);
    assert_eq!(got[0].cached_prompt_tokens, 2 * BS);
    assert!(!path.exists() || !e.disk_tier().unwrap().contains(h2.0));
}

#[test]
fn the_tier_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompt(2, 81);
    let want = {
        let mut e = engine(dir.path(), 10, 64 << 20);
        let want = run(&mut e, requests(&p));
        evict(&mut e, &p);
        want
    };
    let mut e = engine(dir.path(), 10, 64 << 20);
    let s = e.stats().disk_tier.unwrap();
    assert!(s.recovered >= 5 && s.torn == 0, "{s:?}");
    let got = run(&mut e, requests(&p));
    assert_eq!(bits(&got), bits(&want));
    assert_eq!(got[0].cached_prompt_tokens, 80);
    assert_eq!(e.stats().disk.promoted, 5);
}

#[test]
fn a_full_tier_drops_its_oldest_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path(), 10, 1 << 20);
    let block = {
        let p = prompt(3, 81);
        run(&mut e, requests(&p));
        evict(&mut e, &p);
        let s = e.stats().disk_tier.unwrap();
        s.bytes / s.blocks
    };
    // A tier of three blocks' files.
    let dir2 = tempfile::tempdir().unwrap();
    let mut e = engine(dir2.path(), 10, 3 * block);
    run(&mut e, requests(&prompt(4, 81)));
    push_out(&mut e);
    let s = e.stats().disk_tier.unwrap();
    assert!(s.writes > 3, "{s:?}");
    assert_eq!((s.blocks, s.bytes), (3, 3 * block), "{s:?}");
    assert_eq!(s.evictions, s.writes - 3, "{s:?}");
}

#[test]
fn a_stuck_disk_holds_up_neither_the_steps_nor_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(dir.path(), 10, 64 << 20);
    let p = prompt(5, 81);
    let want = run(&mut e, requests(&p));
    evict(&mut e, &p);
    e.disk_tier().unwrap().set_stuck(true);
    let [a, b] = <[Request; 2]>::try_from(requests(&p)).ok().unwrap();
    e.add(tandem_engine::RequestId(1), a).unwrap();
    e.add(
        tandem_engine::RequestId(2),
        Request::greedy(prompt(9, 40), 6).unwrap(),
    )
    .unwrap();
    // The request behind the one waiting for the disk runs to its end, step by step, while
    // the disk answers nothing (and the blocks its steps evict queue for writing).
    let mut done = Vec::new();
    for _ in 0..200 {
        let (events, _) = e.step().unwrap();
        done.extend(events.into_iter().filter_map(|ev| match ev {
            tandem_engine::Event::Finished(f) => Some(f),
            _ => None,
        }));
        if !done.is_empty() {
            break;
        }
    }
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].request.0, 2);
    assert_eq!(done[0].output_ids.len(), 6);
    assert_eq!(e.stats().loading, 1, "the first still waits for its blocks");
    e.disk_tier().unwrap().set_stuck(false);
    e.add(tandem_engine::RequestId(3), b).unwrap();
    while e.has_work() {
        let (events, _) = e.step().unwrap();
        done.extend(events.into_iter().filter_map(|ev| match ev {
            tandem_engine::Event::Finished(f) => Some(f),
            _ => None,
        }));
    }
    let by_id = |id: u64| done.iter().find(|f| f.request.0 == id).expect("finished");
    let got = [by_id(1).clone(), by_id(3).clone()];
    assert_eq!(bits(&got), bits(&want));
    assert_eq!(got[0].cached_prompt_tokens, 80);
}
