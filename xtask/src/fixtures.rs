//! `cargo xtask fixtures`: regenerate `fixtures/` with real PEFT.
//!
//! Runs `fixtures/make_fixtures.py` twice: with `$LORA_FIXTURE_PYTHON`
//! (default `python3`; needs torch, transformers 5.x, peft, safetensors) for
//! most fixtures, and with `$LORA_FIXTURE_PYTHON4` (transformers 4.x) for the
//! per-expert MoE fixtures (`*_v4`). Each run writes only its own
//! generation's fixtures. Extra arguments pass through to the script
//! (`--only <model>/<adapter>`, `--list`). Without arguments it then runs
//! `fixtures/make_engine_fixtures.py` with `$LORA_FIXTURE_PYTHON`: the
//! reference engine's mixed batches and PEFT's answers (`fixtures/engine/`).

use std::process::Command;

use crate::util;

/// The Python packages the generator imports.
const PACKAGES: [&str; 4] = ["torch", "transformers", "peft", "safetensors"];

/// Regenerate the fixtures.
pub fn run(args: &[String]) -> Result<(), String> {
    let script = util::workspace_root().join("fixtures").join("make_fixtures.py");
    let python5 = std::env::var("LORA_FIXTURE_PYTHON").unwrap_or_else(|_| "python3".to_string());
    check_python("LORA_FIXTURE_PYTHON", &python5, 5)?;
    util::run(Command::new(&python5).arg(&script).args(args))?;
    if args.is_empty() {
        let engine = util::workspace_root().join("fixtures").join("make_engine_fixtures.py");
        util::run(Command::new(&python5).arg(&engine))?;
    } else {
        eprintln!("xtask fixtures: arguments given, so fixtures/engine/ was not regenerated");
    }
    match std::env::var("LORA_FIXTURE_PYTHON4") {
        Ok(python4) if !python4.is_empty() => {
            check_python("LORA_FIXTURE_PYTHON4", &python4, 4)?;
            util::run(Command::new(&python4).arg(&script).args(args))
        }
        _ => {
            eprintln!(
                "xtask fixtures: LORA_FIXTURE_PYTHON4 is not set, so the transformers 4.x fixtures \
                 (fixtures/*_v4) were not regenerated; point it at a Python with transformers 4.x and peft"
            );
            Ok(())
        }
    }
}

/// Check that `python` runs and has every package, with transformers of
/// major version `major`; the error says exactly what is missing.
fn check_python(variable: &str, python: &str, major: u32) -> Result<(), String> {
    let probe = format!(
        "import importlib.util\n\
         missing = [m for m in {PACKAGES:?} if importlib.util.find_spec(m) is None]\n\
         print('missing=' + ' '.join(missing))\n\
         if 'transformers' not in missing:\n    \
             import transformers; print('transformers=' + transformers.__version__)\n"
    );
    let out = Command::new(python)
        .args(["-c", &probe])
        .output()
        .map_err(|e| format!("{variable}={python}: cannot start it: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{variable}={python}: the package check failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    let missing = field("missing");
    if !missing.is_empty() {
        return Err(format!(
            "{variable}={python} lacks the Python package(s) {missing}; install {} (transformers {major}.x)",
            PACKAGES.join(", ")
        ));
    }
    let version = field("transformers");
    let found_major = version.split('.').next().and_then(|m| m.parse::<u32>().ok());
    if found_major != Some(major) {
        return Err(format!(
            "{variable}={python} has transformers {version}; these fixtures need transformers {major}.x"
        ));
    }
    Ok(())
}
