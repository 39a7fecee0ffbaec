//! Engine fixture access shared by the engine's integration tests: a
//! family's folder, its adapters and its request batch (fixtures made by
//! `fixtures/make_engine_fixtures.py`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use lora_engine::{AdapterDir, Request, parse_requests};

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
