//! Engine fixture access shared by the engine's integration tests: a
//! family's folder, its adapters and its request batch (fixtures made by
//! `fixtures/make_engine_fixtures.py`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use lora_engine::{AdapterDir, Engine, EngineError, Request, RequestOutput, parse_requests, rel_error};

/// The engine fixtures (`LORA_FIXTURES_DIR` when set: the GPU bundle
/// carries them elsewhere).
pub fn family_dir(family: &str) -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
        .join("engine")
        .join(family)
}

/// The family's adapters, by name.
pub fn adapters(family: &str) -> Vec<AdapterDir> {
    let dir = family_dir(family).join("adapters");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("adapters folder")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| AdapterDir {
            dir: dir.join(&name),
            name,
        })
        .collect()
}

/// The family's request batch.
pub fn requests(family: &str) -> Vec<Request> {
    let text = std::fs::read_to_string(family_dir(family).join("requests.json")).expect("requests.json");
    parse_requests(&text).expect("valid requests")
}

/// Serve `reqs` on one engine; every request's output.
pub fn serve(engine: Result<Engine, EngineError>, reqs: &[Request], what: &str) -> Vec<RequestOutput> {
    let mut engine = engine.unwrap_or_else(|e| panic!("{what}: {e}"));
    let ids: Vec<usize> = reqs.iter().map(|r| engine.submit(r.clone()).expect("submit")).collect();
    engine.run().unwrap_or_else(|e| panic!("{what}: {e}"));
    ids.iter()
        .map(|&i| engine.output(i).expect("finished").clone())
        .collect()
}

/// A rank's output of a sharded run against the one-rank run's `want`:
/// the same greedy tokens, prompt and step logits within `tol`, and equal
/// to rank 0's output `rank0` (every rank ends with the whole logits).
pub fn check_rank_output(what: &str, got: &RequestOutput, want: &RequestOutput, rank0: &RequestOutput, tol: f64) {
    assert_eq!(got.tokens, want.tokens, "{what}: greedy tokens");
    let prompt = rel_error(&got.logits_prompt, &want.logits_prompt);
    let step = rel_error(&got.logits_step, &want.logits_step);
    assert!(prompt < tol && step < tol, "{what}: rel err {prompt:.2e} / {step:.2e}");
    assert_eq!(got, rank0, "{what}: ranks agree");
}
