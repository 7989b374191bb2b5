//! Every file of `fuzz/corpus/<target>/` through its coverage-guided fuzz target's body
//! (`fuzz/src/lib.rs`), in process, as libFuzzer runs it: the seeds, and each input a fuzzing run
//! found to crash, saved there as a regression (`scripts/fuzz` says how). It also keeps the
//! targets compiling with the crates they call.

use crate::common;

#[path = "../../fuzz/src/lib.rs"]
mod targets;

#[test]
fn every_corpus_file_passes_its_fuzz_target() {
    for &(name, run) in targets::TARGETS {
        let dir = common::repo_root().join("fuzz/corpus").join(name);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(files.len() >= 2, "{name}: {files:?}");
        for f in files {
            let data = std::fs::read(&f).unwrap();
            if std::panic::catch_unwind(|| run(&data)).is_err() {
                panic!("{}: the {name} target fails on it", f.display());
            }
        }
    }
}
