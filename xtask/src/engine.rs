//! `cargo xtask serve`: a request file served by the reference engine.
//!
//! ```text
//! cargo xtask serve --model DIR --adapter NAME=DIR [--adapter ...] --requests FILE.json
//!     --out OUT.safetensors [--device cpu|cuda] [--max-loras N] [--max-rank N]
//!     [--experts] [--expert-rank N]
//! ```
//! `OUT.safetensors` holds, for request `i`: `logits_prompt::i` F32
//! `[prompt_len, vocab]`, `tokens::i` I64 `[K]`, `logits_step::i` F32
//! `[K, vocab]`. Exit 0: served; 1: an adapter is refused (named, with the
//! audit's reasons) or serving failed; 2: unreadable or invalid input
//! (model, adapters, requests, options such as an absurd `--max-loras`).

use std::path::PathBuf;

use lora_audit::{DEFAULT_EXPERT_RANK, DEFAULT_MAX_LORAS, DEFAULT_MAX_RANK, LoraOptions};
use lora_engine::{AdapterDir, Engine, EngineError, EngineOptions, RequestOutput, parse_requests, write_answers};
use lora_kernels::Device;

/// Why `serve` failed, by exit status.
#[derive(Debug)]
pub enum ServeFailure {
    /// Exit 1: a refused adapter, or a failure while serving.
    Refused(String),
    /// Exit 2: unreadable or invalid input, or bad usage.
    Input(String),
}

struct Args {
    model: PathBuf,
    adapters: Vec<AdapterDir>,
    requests: PathBuf,
    out: PathBuf,
    device: Option<String>,
    lora: LoraOptions,
}

/// The task's arguments (its usage line, `cargo xtask serve --help`).
pub(crate) const ARGS: &str = "--model DIR --adapter NAME=DIR [--adapter ...] --requests FILE.json \
     --out OUT.safetensors [--device cpu|cuda] [--max-loras N] [--max-rank N] [--experts] [--expert-rank N] [--embedding-lora] [--lm-head-lora]";

fn parse(args: &[String]) -> Result<Args, String> {
    let (mut model, mut requests, mut out, mut device) = (None, None, None, None);
    let mut adapters = Vec::new();
    let mut lora = LoraOptions {
        max_loras: DEFAULT_MAX_LORAS,
        max_rank: DEFAULT_MAX_RANK,
        expert_rank: DEFAULT_EXPERT_RANK,
        ..LoraOptions::default()
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{a} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|e| format!("{a} {v}: {e}"));
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(value()?)),
            "--requests" => requests = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--device" => device = Some(value()?),
            "--adapter" => {
                let v = value()?;
                let (name, dir) = v
                    .split_once('=')
                    .filter(|(n, d)| !n.is_empty() && !d.is_empty())
                    .ok_or(format!("--adapter {v}: expected NAME=DIR"))?;
                adapters.push(AdapterDir {
                    name: name.to_string(),
                    dir: PathBuf::from(dir),
                });
            }
            "--max-loras" => lora.max_loras = number(value()?)?,
            "--max-rank" => lora.max_rank = number(value()?)?,
            "--expert-rank" => lora.expert_rank = number(value()?)?,
            "--experts" => lora.experts = true,
            "--embedding-lora" => lora.embedding_lora = true,
            "--lm-head-lora" => lora.lm_head_lora = true,
            other => return Err(format!("unexpected argument {other}\nusage: cargo xtask serve {ARGS}")),
        }
    }
    let need = |v: Option<PathBuf>, what: &str| v.ok_or(format!("missing {what}\nusage: cargo xtask serve {ARGS}"));
    if lora.max_loras == 0 {
        return Err("--max-loras must be at least 1".into());
    }
    Ok(Args {
        model: need(model, "--model")?,
        requests: need(requests, "--requests")?,
        out: need(out, "--out")?,
        adapters,
        device,
        lora,
    })
}

fn device(choice: Option<&str>) -> Result<Device, String> {
    match choice {
        None | Some("cpu") => Ok(Device::cpu()),
        Some("cuda") => Device::cuda(0).map_err(|e| format!("--device cuda: {e}")),
        Some(other) => Err(format!("--device {other}: expected cpu or cuda")),
    }
}

/// Loading: a refused adapter is exit 1; anything else about the model,
/// the adapters or the options (unreadable, malformed, too large) exit 2.
fn load_failure(e: EngineError) -> ServeFailure {
    match e {
        EngineError::AdapterRefused { .. } => ServeFailure::Refused(e.to_string()),
        other => ServeFailure::Input(other.to_string()),
    }
}

/// Run `serve`.
pub fn run(args: &[String]) -> Result<(), ServeFailure> {
    let args = parse(args).map_err(ServeFailure::Input)?;
    let device = device(args.device.as_deref()).map_err(ServeFailure::Input)?;
    let text = read_capped(&args.requests).map_err(ServeFailure::Input)?;
    let requests =
        parse_requests(&text).map_err(|e| ServeFailure::Input(format!("{}: {e}", args.requests.display())))?;
    let mut engine = Engine::load(
        &args.model,
        &args.adapters,
        &device,
        args.lora,
        EngineOptions::default(),
    )
    .map_err(load_failure)?;
    let vocab = engine.model().config().vocab;
    let total: usize = requests
        .iter()
        .map(|r| (r.prompt.len() + r.max_new_tokens).saturating_mul(vocab))
        .fold(0usize, usize::saturating_add);
    if total > MAX_OUTPUT_FLOATS {
        return Err(ServeFailure::Input(format!(
            "{}: the outputs would hold {total} logits, over the limit of {MAX_OUTPUT_FLOATS}",
            args.requests.display()
        )));
    }
    for r in &requests {
        engine
            .submit(r.clone())
            .map_err(|e| ServeFailure::Input(e.to_string()))?;
    }
    engine.run().map_err(|e| ServeFailure::Refused(e.to_string()))?;
    let outputs: Vec<&RequestOutput> = (0..requests.len())
        .map(|i| {
            engine
                .output(i)
                .ok_or(ServeFailure::Refused(format!("request {i} did not finish")))
        })
        .collect::<Result<_, _>>()?;
    write_answers(&args.out, &outputs, vocab).map_err(|e| ServeFailure::Input(e.to_string()))?;
    println!(
        "served {} requests in {} steps ({} adapters, {} slots) -> {}",
        requests.len(),
        engine.steps(),
        args.adapters.len(),
        engine.pool().options().max_loras,
        args.out.display()
    );
    Ok(())
}

/// Most logits written in one run: 2^30 (4 GiB of F32).
const MAX_OUTPUT_FLOATS: usize = 1 << 30;

fn read_capped(path: &std::path::Path) -> Result<String, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len > lora_engine::MAX_REQUESTS_BYTES as u64 {
        return Err(format!(
            "{}: {len} bytes, over the limit of {}",
            path.display(),
            lora_engine::MAX_REQUESTS_BYTES
        ));
    }
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}
