//! The hostile-input harness of issue 42, process side: a few hundred
//! mutants of the bundled llama fixtures (see `mutants/generator.rs`), each
//! through `lora-audit check` and, where the fixture has probe inputs,
//! `lora-audit probe`, each process under a deadline. Asserted: an exit
//! status of 0, 1 or 2 (never a signal: no abort, no panic), no "panicked"
//! anywhere, every refusal a `REJECT[code] subject: reason` line, every
//! error a message, no hang past the deadline, what each mutant may do
//! ([`Expect`]), and that `check` and `probe` agree on the verdict.
//!
//! The disk-swap side (a CPU pool left bit for bit on a failed swap) is
//! `lora-pool/tests/mutants.rs`, over the same mutants.

#![allow(clippy::unwrap_used)]

#[path = "mutants/generator.rs"]
mod generator;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use generator::{Expect, Mutant, Scratch, fixture_dir, fixtures_root, model_config_path};

/// Longest any one process may run.
const DEADLINE: Duration = Duration::from_secs(20);

/// A finished (or killed) process.
struct Run {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
    timed_out: bool,
}

/// `lora-audit <args>`, its output into files of `dir` (no pipe to fill),
/// polled until [`DEADLINE`], then killed.
fn run_bounded(args: &[&std::ffi::OsStr], dir: &Path, tag: &str) -> Run {
    let (out_path, err_path) = (dir.join(format!("{tag}.stdout")), dir.join(format!("{tag}.stderr")));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lora-audit"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap());
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("LORA_") {
            cmd.env_remove(key);
        }
    }
    let started = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            timed_out = true;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let elapsed = started.elapsed();
    use std::os::unix::process::ExitStatusExt;
    Run {
        code: status.code(),
        signal: status.signal(),
        stdout: String::from_utf8_lossy(&std::fs::read(&out_path).unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&std::fs::read(&err_path).unwrap()).into_owned(),
        elapsed,
        timed_out,
    }
}

/// What every run must be, whatever its input: an answer in time, with an
/// exit status of 0, 1 or 2, and a message for every refusal and error.
fn well_behaved(what: &str, run: &Run) -> Result<i32, String> {
    let show = || {
        format!(
            "{what}\n--- stdout\n{}\n--- stderr\n{}",
            tail(&run.stdout),
            tail(&run.stderr)
        )
    };
    if run.timed_out {
        return Err(format!("hung past {DEADLINE:?}: {}", show()));
    }
    if let Some(sig) = run.signal {
        return Err(format!("killed by signal {sig} (abort or crash): {}", show()));
    }
    if run.stdout.contains("panicked") || run.stderr.contains("panicked") {
        return Err(format!("panicked: {}", show()));
    }
    let code = match run.code {
        Some(c @ 0..=2) => c,
        other => return Err(format!("exit status {other:?}, not 0, 1 or 2: {}", show())),
    };
    match code {
        0 => {
            if !run.stdout.contains(": SERVABLE") && !run.stdout.starts_with("wrote ") {
                return Err(format!("exit 0 without a verdict: {}", show()));
            }
        }
        1 => {
            let rejects: Vec<&str> = run
                .stdout
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with("REJECT["))
                .collect();
            if rejects.is_empty() || !run.stdout.contains("REFUSED") {
                return Err(format!("exit 1 without a REJECT line: {}", show()));
            }
            for line in rejects {
                // `REJECT[code] subject: reason`. The subject is what the
                // file names (a tensor or a field), so it is empty where a
                // mutant gave a tensor an empty name; code and reason never are.
                let well_formed = line.split_once("] ").and_then(|(code, rest)| {
                    let (_subject, reason) = rest.split_once(": ")?;
                    Some(code.len() > "REJECT[".len() && !reason.trim().is_empty())
                });
                if well_formed != Some(true) {
                    return Err(format!("a refusal without a code or a reason: {line:?}: {}", show()));
                }
            }
        }
        _ => {
            let message = run.stderr.trim();
            let body = message.strip_prefix("lora-audit:").unwrap_or(message).trim();
            if body.is_empty() {
                return Err(format!("exit 2 without a message: {}", show()));
            }
        }
    }
    Ok(code)
}

fn tail(s: &str) -> &str {
    let cut = s.len().saturating_sub(2000);
    let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
    &s[cut..]
}

/// The outcome of one mutant's runs.
struct Outcome {
    check: i32,
    probe: Option<i32>,
    slowest: Duration,
}

/// `check` (and `probe` where the fixture has probe inputs) of the adapter
/// in `dir` against `model`.
fn check_and_probe(fixture: &str, dir: &Path, model: &Path, what: &str) -> Result<Outcome, String> {
    let common: Vec<&std::ffi::OsStr> = vec![
        dir.as_os_str(),
        "--model".as_ref(),
        model.as_os_str(),
        "--max-rank".as_ref(),
        "16".as_ref(),
        "--experts".as_ref(),
        "--embedding-lora".as_ref(),
    ];
    let mut args: Vec<&std::ffi::OsStr> = vec!["check".as_ref()];
    args.extend(&common);
    let check = run_bounded(&args, dir, "check");
    let check_code = well_behaved(&format!("check {what}"), &check)?;
    let mut slowest = check.elapsed;
    let oracle = fixture_dir(fixture).join("oracle.safetensors");
    let probe = if oracle.exists() {
        let out = dir.join("probe_out.safetensors");
        let tables = fixtures_root().join(generator::MODEL).join("tables.safetensors");
        let mut args: Vec<&std::ffi::OsStr> = vec!["probe".as_ref()];
        args.extend(&common);
        args.extend([
            "--probes".as_ref(),
            oracle.as_os_str(),
            "--base".as_ref(),
            tables.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ]);
        let run = run_bounded(&args, dir, "probe");
        let code = well_behaved(&format!("probe {what}"), &run)?;
        slowest = slowest.max(run.elapsed);
        if code == 0 {
            // A probe that answers writes a readable file.
            let written = lora_audit::LoadedSafetensors::open(&out)
                .map_err(|e| format!("probe {what}: exit 0 but its output is unreadable: {e}"))?;
            if written.infos().map_err(|e| e.to_string())?.is_empty() {
                return Err(format!("probe {what}: exit 0 but no answers written"));
            }
        }
        // The pure host path and the audit agree on the verdict.
        let agree = !matches!((check_code, code), (0, 1) | (1 | 2, 0));
        if !agree {
            return Err(format!(
                "check exits {check_code} but probe exits {code}: {what}\n--- check\n{}\n--- probe\n{}{}",
                tail(&check.stdout),
                tail(&run.stdout),
                tail(&run.stderr)
            ));
        }
        Some(code)
    } else {
        None
    };
    Ok(Outcome {
        check: check_code,
        probe,
        slowest,
    })
}

/// Whether `code` (of a mutant of a fixture whose own code is `baseline`)
/// is what the mutant may do.
fn expected(expect: Expect, code: i32, baseline: i32) -> bool {
    match expect {
        Expect::Any => true,
        Expect::Same => code == baseline,
        Expect::NotServable => code != 0,
        Expect::Unreadable => code == 2,
    }
}

#[test]
fn every_mutant_is_answered_with_an_exit_code_and_a_message() {
    let started = Instant::now();
    let seed = generator::seed();
    let mutants = generator::mutants(seed);
    assert!(mutants.len() >= 300, "only {} mutants", mutants.len());
    let scratch = Scratch::new("audit");
    let model = model_config_path();

    // The unmutated fixtures first: their codes are what `Same` means.
    let mut baseline = std::collections::BTreeMap::new();
    for fixture in generator::FIXTURES {
        let dir = scratch.join(format!("clean-{fixture}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(fixture_dir(fixture).join(f), dir.join(f)).unwrap();
        }
        let outcome = check_and_probe(fixture, &dir, &model, fixture).unwrap();
        baseline.insert(*fixture, outcome.check);
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert_eq!(baseline["dora"], 1);
    assert_eq!(baseline["demo_r4_plain"], 0);

    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let tally = Mutex::new((
        std::collections::BTreeMap::<(i32, Option<i32>), usize>::new(),
        Duration::ZERO,
    ));
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    let verbose = std::env::var_os("MUTANTS_VERBOSE").is_some();
    let work = |m: &Mutant| -> Result<Outcome, String> {
        let dir: PathBuf = scratch.join(format!("m{}", m.id));
        let adapter = dir.join("adapter");
        m.write_adapter(&adapter);
        let model_path = match &m.model {
            Some(text) => {
                let p = dir.join("config.json");
                std::fs::write(&p, text).unwrap();
                p
            }
            None => model.clone(),
        };
        let outcome = check_and_probe(m.fixture, &adapter, &model_path, &m.label());
        let _ = std::fs::remove_dir_all(&dir);
        let outcome = outcome?;
        let base = baseline[m.fixture];
        if !expected(m.expect, outcome.check, base) {
            return Err(format!(
                "{}: check exits {} but the mutant is {:?} (the fixture exits {base})",
                m.label(),
                outcome.check,
                m.expect
            ));
        }
        if let Some(p) = outcome.probe
            && m.model.is_none()
            && !expected(m.expect, p, base)
        {
            return Err(format!(
                "{}: probe exits {p} but the mutant is {:?} (the fixture exits {base})",
                m.label(),
                m.expect
            ));
        }
        Ok(outcome)
    };
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(m) = mutants.get(i) else { break };
                    match work(m) {
                        Ok(o) => {
                            if verbose {
                                eprintln!("{}: check {} probe {:?}", m.label(), o.check, o.probe);
                            }
                            let mut t = tally.lock().unwrap();
                            *t.0.entry((o.check, o.probe)).or_default() += 1;
                            t.1 = t.1.max(o.slowest);
                        }
                        Err(e) => failures.lock().unwrap().push(e),
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    let (tally, slowest) = tally.into_inner().unwrap();
    eprintln!(
        "{} mutants (seed {seed}) in {:.1?} on {workers} workers, slowest process {slowest:.1?}; \
         (check, probe) exit codes: {tally:?}",
        mutants.len(),
        started.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} of {} mutants misbehaved (MUTANTS_SEED={seed}):\n{}",
        failures.len(),
        mutants.len(),
        failures.join("\n\n")
    );
}
