//! `cargo xtask`: the workspace's tasks.
//!
//! - `ci`: what CI runs (format check, the test suite, the demo).
//! - `demo`: the whole pipeline on the bundled fixtures.
//! - `fixtures`: regenerate `fixtures/` with real PEFT (needs Python with
//!   `torch`, `transformers`, `peft`).
//! - `gpu-bundle` / `gpu-test`: build the GPU test and bench binaries and
//!   gather them into `.gpu-bundle/`; run them where cargo and a GPU meet.
//! - `bench`: kernel, swap and peer-landing benchmarks.
//! - `probe`: an adapter's deltas computed through the serving path.
//! - `serve`: a request file served by the reference engine (`lora-engine`).
//!
//! xtask sits above every library crate; it may depend on all of them.

use std::process::ExitCode;

mod bench;
mod bench_io;
mod demo;
mod engine;
mod fixtures;
mod gpu;
mod probe;
mod serve;
mod util;

/// `cargo xtask cuda-sources DIR`: write every kernel family's translation
/// unit (what NVRTC compiles) into DIR, to compare the machine code of two
/// builds offline.
fn cuda_sources(args: &[String]) -> Result<(), String> {
    let [dir] = args else {
        return Err("usage: cargo xtask cuda-sources DIR".into());
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))?;
    for (file, source) in lora_kernels::kernel_sources() {
        let path = std::path::Path::new(dir).join(file);
        std::fs::write(&path, source).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (task, rest) = match args.split_first() {
        Some((t, r)) => (t.as_str(), r),
        None => ("", &[][..]),
    };
    let result = match task {
        "ci" => ci(),
        "demo" => demo::run(rest),
        "fixtures" => fixtures::run(rest),
        "gpu-bundle" => gpu::bundle(rest),
        "gpu-test" => gpu::gpu_test(rest),
        "bench" => bench::run(rest),
        "cuda-sources" => cuda_sources(rest),
        "probe" => {
            return match probe::run(rest) {
                Ok(()) => ExitCode::SUCCESS,
                Err(probe::ProbeFailure::Refused(table)) => {
                    print!("{table}");
                    ExitCode::from(1)
                }
                Err(probe::ProbeFailure::Usage(e)) => {
                    eprintln!("xtask probe: {e}");
                    ExitCode::from(2)
                }
            };
        }
        "serve" => {
            return match engine::run(rest) {
                Ok(()) => ExitCode::SUCCESS,
                Err(engine::ServeFailure::Refused(e)) => {
                    eprintln!("xtask serve: {e}");
                    ExitCode::from(1)
                }
                Err(engine::ServeFailure::Input(e)) => {
                    eprintln!("xtask serve: {e}");
                    ExitCode::from(2)
                }
            };
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <ci|demo|probe|serve|fixtures|gpu-bundle|gpu-test|bench|cuda-sources> [args]"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {task}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What CI runs: the format check, every test (nextest when installed), the
/// doc tests, and the demo.
fn ci() -> Result<(), String> {
    use std::process::Command;
    if util::succeeds(Command::new("cargo").args(["fmt", "--version"])) {
        util::run(Command::new("cargo").args(["fmt", "--all", "--", "--check"]))?;
    } else {
        eprintln!("rustfmt is not installed: skipping the format check");
    }
    if util::succeeds(Command::new("cargo").args(["nextest", "--version"])) {
        util::run(Command::new("cargo").args(["nextest", "run", "--workspace", "--no-fail-fast"]))?;
    } else {
        eprintln!("cargo-nextest is not installed: running cargo test");
        util::run(Command::new("cargo").args(["test", "--workspace", "--no-fail-fast", "--lib", "--bins", "--tests"]))?;
    }
    util::run(Command::new("cargo").args(["test", "--workspace", "--doc"]))?;
    // The RDMA READ transport builds against the system's libibverbs
    // headers (`.ci/run` installs them); its unit tests need no device.
    if util::succeeds(Command::new("pkg-config").args(["--exists", "libibverbs"])) {
        util::run(Command::new("cargo").args(["clippy", "-p", "lora-rdma", "--all-targets", "--features", "ibverbs"]))?;
        util::run(Command::new("cargo").args(["test", "-p", "lora-rdma", "--features", "ibverbs", "--lib"]))?;
    } else {
        eprintln!("libibverbs headers are not installed: the `ibverbs` feature of lora-rdma is not built");
    }
    demo::run(&[])
}
