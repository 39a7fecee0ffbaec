//! `cargo xtask py-test`: build the `lora-audit` Python package (PyO3,
//! maturin, an abi3 wheel) and run its pytest suite against the wheel
//! installed in a fresh virtual environment, beside the `lora-audit`
//! command whose answers it must give.

use std::path::Path;
use std::process::Command;

use crate::util;

/// Where the virtual environment, the wheel and the extension's build go.
const WORK_DIR: &str = "target/py";

/// The Python interpreter: `LORA_PYTHON`, else `python3`.
fn python() -> String {
    std::env::var("LORA_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

pub fn run(_args: &[String]) -> Result<(), String> {
    let root = util::workspace_root();
    let work = root.join(WORK_DIR);
    let venv = work.join("venv");
    let wheels = work.join("wheels");
    for dir in [&venv, &wheels] {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
        }
    }
    util::run(Command::new(python()).args(["-m", "venv"]).arg(&venv))?;
    let bin = |name: &str| venv.join("bin").join(name);
    util::run(
        Command::new(bin("python"))
            .args(["-m", "pip", "install", "-q", "maturin>=1.5,<2", "pytest"])
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    )?;
    let package = root.join("lora-audit-py");
    util::run(
        Command::new("cargo")
            .current_dir(&package)
            .args(["fmt", "--", "--check"]),
    )?;
    util::run(
        Command::new(bin("maturin"))
            .current_dir(&package)
            .args(["build", "--release", "--locked", "-o"])
            .arg(&wheels)
            .env("CARGO_TARGET_DIR", work.join("build")),
    )?;
    let wheel = only_wheel(&wheels)?;
    util::run(
        Command::new(bin("python"))
            .args(["-m", "pip", "install", "-q"])
            .arg(&wheel),
    )?;
    // The command the package must agree with.
    util::run(
        Command::new("cargo")
            .current_dir(&root)
            .args(["build", "-p", "lora-audit-cli"]),
    )?;
    util::run(
        Command::new(bin("python"))
            .args(["-m", "pytest", "-q"])
            .arg(package.join("tests"))
            // Import the installed wheel, never the source tree.
            .current_dir(&work)
            .env("LORA_AUDIT_BIN", root.join("target/debug/lora-audit")),
    )
}

fn only_wheel(dir: &Path) -> Result<std::path::PathBuf, String> {
    let wheels: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        other => Err(format!(
            "expected one wheel in {}, found {}",
            dir.display(),
            other.len()
        )),
    }
}
