//! The fuzz targets' CI smoke: every checked-in corpus file of every target
//! (`fuzz/corpus/<target>/`), seeds and regressions alike, through the same check libFuzzer runs
//! (`pillar_fuzz_oracles`), without libFuzzer. The rewriter's differential part against h2
//! needs the `h2` feature, on in the fuzz targets only (see Cargo.toml).

use std::path::Path;

#[test]
fn every_corpus_file_of_every_target_passes_its_check() {
    let corpora = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    for (target, check) in pillar_fuzz_oracles::TARGETS {
        let dir = corpora.join(target);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "target {target} has no corpus");
        for file in files {
            let data = std::fs::read(&file).expect("a corpus file");
            // A failing file names itself: the panic message alone does not.
            let run = std::panic::catch_unwind(|| check(&data));
            assert!(run.is_ok(), "{target}: {} fails its check", file.display());
        }
    }
}

#[test]
fn every_target_has_a_fuzz_target_file() {
    let targets = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz_targets");
    for (target, _) in pillar_fuzz_oracles::TARGETS {
        assert!(targets.join(format!("{target}.rs")).is_file(), "{target}");
    }
}
