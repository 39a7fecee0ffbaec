//! `cargo xtask gpu-bundle` and `cargo xtask gpu-test`.
//!
//! The GPU host has no Rust toolchain, so the bundle carries everything it
//! runs: every workspace crate's test executables and the `xtask` binary
//! (for `bench`), built here in release mode without debug info, stripped
//! and packed into `payload.tar.gz`, plus `fixtures/`, `xtask/bench/*.py` and
//! a `run.sh` that unpacks and runs them with
//! `LORA_REQUIRE_GPU=1` (GPU tests fail instead of skipping) and prints a
//! summary last. A crate whose tests do not build is reported and left out,
//! so one crate in progress does not block the others' GPU tests.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util;

/// Where the bundle goes, relative to the workspace root (git-ignored).
const BUNDLE_DIR: &str = ".gpu-bundle";
/// Test executables left out of the bundle: they spawn workspace binaries
/// (`lora-audit`, `lora-peer`) by the path cargo compiled into them, which
/// does not exist on the GPU host, and they touch no GPU (CI runs them).
const HOST_ONLY_TESTS: [&str; 5] = [
    "lora_audit_cli-bounds",
    "lora_audit_cli-fixtures",
    "lora_audit_cli-mutants",
    "lora_rdma-faults",
    "lora_rdma-peer_process",
];

/// What may travel to the GPU machine.
const SIZE_LIMIT: u64 = 64 * 1024 * 1024;

/// The bundle folder: `.gpu-bundle/`, or `LORA_GPU_BUNDLE_DIR` (relative to the
/// workspace root) so that two people sharing a checkout can each carry their own.
fn bundle_dir(root: &Path) -> PathBuf {
    root.join(std::env::var("LORA_GPU_BUNDLE_DIR").unwrap_or_else(|_| BUNDLE_DIR.to_string()))
}

/// Build the GPU test and bench binaries and gather them into `.gpu-bundle/`.
pub fn bundle(_args: &[String]) -> Result<(), String> {
    let root = util::workspace_root();
    let dir = bundle_dir(&root);
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
    }
    for sub in ["tests", "bin", "bench"] {
        fs::create_dir_all(dir.join(sub)).map_err(|e| format!("cannot create {sub}: {e}"))?;
    }

    let mut skipped = Vec::new();
    let mut copied = 0usize;
    for member in workspace_members(&root)? {
        match test_executables(&root, &member) {
            Ok(exes) => {
                for (name, path) in exes {
                    let bundled = format!("{}-{name}", member.replace('-', "_"));
                    if HOST_ONLY_TESTS.contains(&bundled.as_str()) {
                        continue;
                    }
                    let dest = dir.join("tests").join(bundled);
                    fs::copy(&path, &dest).map_err(|e| format!("cannot copy {}: {e}", path.display()))?;
                    copied += 1;
                }
            }
            Err(e) => {
                eprintln!("gpu-bundle: leaving out {member}: its tests do not build ({e})");
                skipped.push(member);
            }
        }
    }
    let xtask = build_xtask(&root)?;
    fs::copy(&xtask, dir.join("bin/xtask")).map_err(|e| format!("cannot copy xtask: {e}"))?;

    let bench_src = root.join("xtask/bench");
    if bench_src.is_dir() {
        for entry in fs::read_dir(&bench_src).map_err(|e| e.to_string())? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.extension().is_some_and(|x| x == "py") {
                let name = path.file_name().ok_or("bench script without a name")?;
                fs::copy(&path, dir.join("bench").join(name)).map_err(|e| e.to_string())?;
            }
        }
    }
    let fixtures = root.join("fixtures");
    if fixtures.is_dir() {
        copy_tree(&fixtures, &dir.join("fixtures"))?;
    }
    pack_binaries(&dir)?;
    let run_sh = dir.join("run.sh");
    fs::write(&run_sh, RUN_SH).map_err(|e| format!("cannot write run.sh: {e}"))?;
    set_executable(&run_sh)?;

    let size = tree_size(&dir)?;
    eprintln!(
        "gpu-bundle: {copied} test executables, xtask, {} in {} ({:.1} MiB){}",
        if fixtures.is_dir() { "fixtures" } else { "no fixtures" },
        dir.display(),
        size as f64 / (1024.0 * 1024.0),
        if skipped.is_empty() {
            String::new()
        } else {
            format!("; left out: {}", skipped.join(", "))
        }
    );
    if size > SIZE_LIMIT {
        return Err(format!(
            "bundle is {size} bytes, over the {SIZE_LIMIT}-byte limit of the GPU machine"
        ));
    }
    Ok(())
}

/// Build the bundle and run it here (cargo and a GPU on one machine).
pub fn gpu_test(args: &[String]) -> Result<(), String> {
    bundle(args)?;
    let root = util::workspace_root();
    let mode = args.first().map_or("test", String::as_str);
    util::run(Command::new("bash").arg(bundle_dir(&root).join("run.sh")).arg(mode))
}

/// Release builds for the bundle: no debug info, so binaries stay small.
fn release_cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root)
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo");
    cmd
}

fn workspace_members(root: &Path) -> Result<Vec<String>, String> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("cargo metadata output: {e}"))?;
    let packages = meta["packages"].as_array().ok_or("cargo metadata: no packages")?;
    Ok(packages
        .iter()
        .filter_map(|p| p["name"].as_str().map(String::from))
        .collect())
}

/// `(target name, path)` of every test executable of `member`.
fn test_executables(root: &Path, member: &str) -> Result<Vec<(String, PathBuf)>, String> {
    let out = release_cargo(root)
        .args(["test", "--release", "--no-run", "--message-format=json", "-p", member])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo test: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // With JSON output the compiler's errors travel inside the messages.
        for msg in stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        {
            if msg["reason"] == "compiler-message" && msg["message"]["level"] == "error" {
                eprint!("{}", msg["message"]["rendered"].as_str().unwrap_or_default());
            }
        }
        return Err(format!("cargo test --no-run -p {member} failed"));
    }
    let mut exes = Vec::new();
    for line in stdout.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        if msg["package_id"]
            .as_str()
            .is_some_and(|id| !package_matches(id, member))
        {
            continue;
        }
        if let (Some(exe), Some(name)) = (msg["executable"].as_str(), msg["target"]["name"].as_str()) {
            exes.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    Ok(exes)
}

/// Whether a cargo package id (`path+file:///…/lora-kernels#0.1.0` or the
/// older `name version (source)`) names `member`.
fn package_matches(id: &str, member: &str) -> bool {
    id.starts_with(&format!("{member} ")) || id.contains(&format!("/{member}#")) || id.contains(&format!("#{member}@"))
}

fn build_xtask(root: &Path) -> Result<PathBuf, String> {
    let out = release_cargo(root)
        .args(["build", "--release", "-p", "xtask", "--message-format=json"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo build: {e}"))?;
    if !out.status.success() {
        return Err("cargo build -p xtask failed".into());
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "xtask")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| "cargo build -p xtask produced no executable".into())
}

/// Strip the executables (when `strip` is installed) and pack `tests/` and
/// `bin/` into `payload.tar.gz`: test executables compress about 3x, which
/// keeps the bundle under the size limit; `run.sh` unpacks it first.
fn pack_binaries(dir: &Path) -> Result<(), String> {
    let strip = Command::new("strip")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    for sub in ["tests", "bin"] {
        for entry in fs::read_dir(dir.join(sub)).map_err(|e| e.to_string())? {
            let path = entry.map_err(|e| e.to_string())?.path();
            if strip {
                util::run(Command::new("strip").arg("--strip-all").arg(&path))?;
            }
        }
    }
    util::run(
        Command::new("tar")
            .current_dir(dir)
            .args(["-czf", "payload.tar.gz", "tests", "bin"]),
    )?;
    for sub in ["tests", "bin"] {
        fs::remove_dir_all(dir.join(sub)).map_err(|e| format!("cannot remove {sub}: {e}"))?;
    }
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> Result<(), String> {
    fs::create_dir_all(to).map_err(|e| format!("cannot create {}: {e}", to.display()))?;
    for entry in fs::read_dir(from).map_err(|e| format!("cannot read {}: {e}", from.display()))? {
        let entry = entry.map_err(|e| e.to_string())?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if src.is_dir() {
            copy_tree(&src, &dst)?;
        } else {
            fs::copy(&src, &dst).map_err(|e| format!("cannot copy {}: {e}", src.display()))?;
        }
    }
    Ok(())
}

fn tree_size(dir: &Path) -> Result<u64, String> {
    let mut total = 0;
    for entry in fs::read_dir(dir).map_err(|e| e.to_string())? {
        let entry = entry.map_err(|e| e.to_string())?;
        let meta = entry.metadata().map_err(|e| e.to_string())?;
        total += if meta.is_dir() {
            tree_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

fn set_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let mut perm = fs::metadata(path).map_err(|e| e.to_string())?.permissions();
    perm.set_mode(0o755);
    fs::set_permissions(path, perm).map_err(|e| e.to_string())
}

/// The bundle's runner. Logs go to `$OUT` (the GPU tool's return folder) or
/// `./out`: one test log, the bench log and JSON, so few files travel back.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs the GPU bundle built by `cargo xtask gpu-bundle`.
# usage: run.sh [test|bench|all] [extra args for `xtask bench`]
# LORA_TESTS (space-separated globs, e.g. 'lora_kernels-* lora_pool-*') picks test executables; all by default.
# Each test binary and the bench run under `timeout` (LORA_TEST_TIMEOUT,
# LORA_BENCH_TIMEOUT seconds, default 300), so a hung kernel costs one entry.
set -u -o pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-test}"
shift || true
out="${OUT:-$here/out}"
mkdir -p "$out"
# GPU tests fail rather than skip, unless the caller says otherwise (a CPU-only check of the bundle).
export LORA_REQUIRE_GPU="${LORA_REQUIRE_GPU:-1}"
export LORA_FIXTURES_DIR="$here/fixtures"
export LORA_XTASK_BIN="$here/bin/xtask"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
if [ -f "$here/payload.tar.gz" ] && [ ! -d "$here/tests" ]; then
  tar -xzf "$here/payload.tar.gz" -C "$here" || { echo "cannot unpack payload.tar.gz"; exit 2; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"

pass=0
fail=0
failed=""
summary=""
if [ "$mode" = test ] || [ "$mode" = all ]; then
  log="$out/tests.log"
  : >"$log"
  # The patterns are globbed against tests/ only, never the current folder.
  set -f
  patterns="${LORA_TESTS:-*}"
  picked=""
  for g in $patterns; do
    set +f
    picked="$picked $(ls -d "$here"/tests/$g 2>/dev/null)"
    set -f
  done
  set +f
  for t in $picked; do
    name="$(basename "$t")"
    echo "=== $name" >>"$log"
    start=$(date +%s)
    # GPU tests are #[ignore]d (visibly skipped where no GPU is); here they
    # run. The RDMA loopback test stays ignored: it needs an RDMA device.
    include="--include-ignored"
    [ "$name" = lora_rdma-verbs_loopback ] && include=""
    if (cd "$here" && timeout "${LORA_TEST_TIMEOUT:-300}" "$t" $include 2>&1) >>"$log"; then
      pass=$((pass + 1))
    else
      fail=$((fail + 1))
      failed="$failed $name"
    fi
    line="$(grep -E '^test result:' "$log" | tail -n 1)"
    summary="$summary
$name ($(( $(date +%s) - start ))s): $line"
  done
  grep -E '^(test .* FAILED|skipping |---- |thread .* panicked)' "$log" | head -n 60
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  if timeout "${LORA_BENCH_TIMEOUT:-300}" "$here/bin/xtask" bench --out "$out/bench.json" --torch-script "$here/bench/torch_lora_baseline.py" "$@" 2>&1 | tee "$out/bench.log"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    failed="$failed bench"
  fi
fi
echo "$summary"
[ -n "$failed" ] && echo "failed:$failed"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
"#;
