//! `cargo xtask`: the workspace's tasks.
//!
//! - `ci`: what CI runs (format check, the test suite, the Python
//!   package's tests, the demo).
//! - `py-test`: the `lora-audit` Python wheel built and tested.
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
mod py;
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

/// Every task: its name, its arguments and what it does (`--help`).
const TASKS: &[(&str, &str, &str)] = &[
    (
        "ci",
        "",
        "what CI runs: the format check, every test, the doc tests, the demo",
    ),
    (
        "demo",
        demo::ARGS,
        "mixed batches served end to end on the bundled fixtures, checked against PEFT",
    ),
    (
        "probe",
        "<adapter_dir> --model <config.json> --probes <in.safetensors> [--base <tables.safetensors>] \
         --out <out.safetensors> [--device cpu|cuda] [--max-rank N] [--expert-rank N] [--allow-partial] [--experts] [--embedding-lora] \
         [--lm-head-lora] [--tp-rank R --tp-world W] [--ep-rank R --ep-world W] [--json]",
        "an adapter's deltas through the serving path (exit 1: refused, 2: bad usage or input)",
    ),
    (
        "serve",
        engine::ARGS,
        "a request file served by the reference engine (exit 1: a refused adapter, 2: unreadable input)",
    ),
    (
        "fixtures",
        "",
        "regenerate fixtures/ with real PEFT (needs Python with torch, transformers, peft)",
    ),
    (
        "gpu-bundle",
        "",
        "build the GPU test and bench binaries into .gpu-bundle/ (run there: .gpu-bundle/run.sh test|bench|all)",
    ),
    (
        "gpu-test",
        "[test|bench|all]",
        "gpu-bundle, then run it here (where cargo and a GPU meet)",
    ),
    (
        "bench",
        "[--out PATH] [--torch-script PATH] [--reps N] [--sections a,b] [--sweep] [--variant SUBSTRING] \
         [--without-default] [--quick] [--only SUBSTRING]",
        "kernel, decode-step, swap and peer-landing benchmarks (sections: kernels, step, swap, landing)",
    ),
    (
        "plot",
        "REPORT.json [DIR]",
        "redraw a saved bench report's SVG plots (bench writes them beside its JSON)",
    ),
    (
        "py-test",
        "",
        "build the lora-audit Python wheel (maturin) and run its pytest suite in a fresh virtual environment",
    ),
    (
        "cuda-sources",
        "DIR",
        "write every kernel family's translation unit into DIR",
    ),
];

/// `cargo xtask --help`, or one task's usage.
fn help(task: Option<&str>) -> String {
    match task.and_then(|t| TASKS.iter().find(|(name, ..)| *name == t)) {
        Some((name, args, what)) => format!("usage: cargo xtask {name} {args}\n\n{what}\n"),
        None => {
            let mut out =
                String::from("usage: cargo xtask <task> [args]   (cargo xtask <task> --help: its usage)\n\ntasks:\n");
            for (name, _, what) in TASKS {
                out.push_str(&format!("  {name:<13} {what}\n"));
            }
            out
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (task, rest) = match args.split_first() {
        Some((t, r)) => (t.as_str(), r),
        None => ("", &[][..]),
    };
    if matches!(task, "--help" | "-h" | "help") {
        print!("{}", help(rest.first().map(String::as_str)));
        return ExitCode::SUCCESS;
    }
    if rest.iter().any(|a| a == "--help" || a == "-h") && TASKS.iter().any(|(name, ..)| *name == task) {
        print!("{}", help(Some(task)));
        return ExitCode::SUCCESS;
    }
    let result = match task {
        "ci" => ci(),
        "demo" => demo::run(rest),
        "py-test" => py::run(rest),
        "plot" => bench::plot::run(rest),
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
            eprint!("{}", help(None));
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
/// doc tests, clippy and the rendered docs (warnings are errors), the Python
/// package's tests, and the demo.
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
    // Lints and rendered docs, always (the `ibverbs` feature's lints below
    // only where its headers are).
    util::run(Command::new("cargo").args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    util::run(
        Command::new("cargo")
            .args(["doc", "--workspace", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    // The RDMA READ transport builds against the system's libibverbs
    // headers (`.ci/run` installs them); its unit tests need no device.
    if util::succeeds(Command::new("pkg-config").args(["--exists", "libibverbs"])) {
        util::run(Command::new("cargo").args(["clippy", "-p", "lora-rdma", "--all-targets", "--features", "ibverbs"]))?;
        util::run(Command::new("cargo").args(["test", "-p", "lora-rdma", "--features", "ibverbs", "--lib"]))?;
    } else {
        eprintln!("libibverbs headers are not installed: the `ibverbs` feature of lora-rdma is not built");
    }
    py::run(&[])?;
    demo::run(&[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_lists_every_task_and_each_task_has_its_usage() {
        let all = help(None);
        for (name, args, _) in TASKS {
            assert!(all.contains(&format!("  {name} ")), "{name} missing from:\n{all}");
            let one = help(Some(name));
            assert!(one.starts_with(&format!("usage: cargo xtask {name} {args}")), "{one}");
        }
        // An unknown task gets the list.
        assert_eq!(help(Some("nope")), all);
    }
}
