//! `lora-audit`: check a PEFT adapter against a base model, or probe its
//! deltas as they will be served. The command line over the `lora-audit`
//! library (which never depends on an argument parser). With `--tp-rank R
//! --tp-world W` (or `LORA_TP_RANK` / `LORA_TP_WORLD`) the report sizes the
//! rank's slot and `probe` writes the rank's part of each dense delta
//! (`lora_audit::probe_adapter_at`); with `--ep-rank R --ep-world W` (or
//! `LORA_EP_RANK` / `LORA_EP_WORLD`) the report places the rank's experts
//! and the router, and expert probes of other ranks' experts are zeros.
//!
//! Exit status: 0 servable (probe written), 1 refused, 2 bad usage or
//! unreadable input (with `--json`, also `{"error": …, "exit": 2}` on
//! stdout). Every error names the file or directory it is about.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use lora_audit::{AuditArgs, AuditError, AuditReport, LoraOptions, audit_adapter, prepare_adapter, probe_files_at};
use lora_layout::ModelConfig;
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "lora-audit",
    version,
    about = "Audit PEFT LoRA adapters for multi-LoRA serving",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The exit codes, in every `--help`.
const EXIT_CODES: &str = "Exit status: 0 servable (probe written), 1 refused (the report says why, \
with a stable REJECT[...] code per tensor or field), 2 bad usage or unreadable input (with --json, \
also a JSON object {\"error\": ..., \"exit\": 2} on stdout).

Example: lora-audit check out/my-adapter --model base/config.json --max-rank 16 --json";

#[derive(Subcommand)]
enum Command {
    /// Place every tensor of an adapter or refuse it with reasons.
    #[command(after_help = EXIT_CODES)]
    Check {
        #[command(flatten)]
        common: Common,
    },
    /// Compute the served deltas for probe inputs (pure host path).
    #[command(after_help = EXIT_CODES)]
    Probe {
        #[command(flatten)]
        common: Common,
        /// Probe inputs: `probe_in::<weight>` and `rows_idx::<table>` tensors (and, for DoRA
        /// pairs, `base_weight::<weight>` / `base_bias::<weight>`).
        #[arg(long)]
        probes: PathBuf,
        /// Base token tables (`…embed_tokens.weight`, `lm_head.weight`), for `rows_idx::` probes.
        #[arg(long)]
        base: Option<PathBuf>,
        /// Where to write `probe_out::` / `rows_merged::` tensors.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Args)]
struct Common {
    /// The adapter directory (adapter_config.json + adapter_model.safetensors).
    adapter_dir: PathBuf,
    /// The base model's config.json.
    #[arg(long)]
    model: PathBuf,
    /// Rank the dense pool pads to (default: LORA_MAX_RANK, else 16).
    #[arg(long)]
    max_rank: Option<usize>,
    /// Rank the expert pool pads to (default: LORA_EXPERT_RANK, else 16).
    #[arg(long)]
    expert_rank: Option<usize>,
    /// Skip targets the engine cannot apply (each skip is listed).
    #[arg(long)]
    allow_partial: bool,
    /// Serve routed-expert and router deltas.
    #[arg(long)]
    experts: bool,
    /// Serve DoRA adapters (a pool built with LORA_DORA=1; probes of DoRA
    /// pairs need `base_weight::<weight>` in the probe file).
    #[arg(long)]
    dora: bool,
    /// Tensor-parallel rank (default: LORA_TP_RANK, else 0): the slot, and
    /// each probe's output, are the rank's part.
    #[arg(long)]
    tp_rank: Option<usize>,
    /// Tensor-parallel world size (default: LORA_TP_WORLD, else 1).
    #[arg(long)]
    tp_world: Option<usize>,
    /// The fully-sharded option (or LORA_FULLY_SHARDED=1): a
    /// column-parallel pair's A is cut by rank rows too (the slot shrinks;
    /// each probe's output is still the rank's part).
    #[arg(long)]
    fully_sharded: bool,
    /// Expert-parallel rank (default: LORA_EP_RANK, else 0): the expert
    /// slot holds the rank's block of experts; probes of other experts
    /// answer zeros.
    #[arg(long)]
    ep_rank: Option<usize>,
    /// Expert-parallel world size (default: LORA_EP_WORLD, else 1).
    #[arg(long)]
    ep_world: Option<usize>,
    /// Give slots a place for a LoRA on the input embedding.
    #[arg(long)]
    embedding_lora: bool,
    /// Give slots a place for a LoRA on the output head.
    #[arg(long)]
    lm_head_lora: bool,
    /// Cut the embedding and head pairs by the vocabulary, as the base
    /// model's vocab-parallel embedding and lm_head are (default:
    /// LORA_VOCAB_PARALLEL): the slot holds the rank's vocabulary block and
    /// an lm_head probe answers the rank's logit columns.
    #[arg(long)]
    vocab_parallel: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

impl Common {
    fn options(&self) -> Result<LoraOptions, String> {
        let args = AuditArgs {
            max_rank: self.max_rank,
            expert_rank: self.expert_rank,
            allow_partial: self.allow_partial,
            experts: self.experts,
            dora: self.dora,
            tp_rank: self.tp_rank,
            tp_world: self.tp_world,
            ep_rank: self.ep_rank,
            ep_world: self.ep_world,
            fully_sharded: self.fully_sharded,
            embedding_lora: self.embedding_lora,
            lm_head_lora: self.lm_head_lora,
            vocab_parallel: self.vocab_parallel,
        };
        LoraOptions::from_env()
            .and_then(|o| o.with_args(args))
            .map_err(|e| e.to_string())
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = match &cli.command {
        Command::Check { common } | Command::Probe { common, .. } => common.json,
    };
    match run(cli) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("lora-audit: {message}");
            if json {
                println!("{:#}", json!({ "error": message, "exit": 2 }));
            }
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, String> {
    match cli.command {
        Command::Check { common } => {
            let opts = common.options()?;
            let cfg = ModelConfig::from_file(&common.model).map_err(|e| e.to_string())?;
            let report = audit_adapter(&common.adapter_dir, &cfg, &opts).map_err(|e| e.to_string())?;
            if common.json {
                println!("{:#}", report.to_json(&cfg));
            } else {
                print!("{}", report.to_text(&cfg));
            }
            Ok(verdict(&report))
        }
        Command::Probe {
            common,
            probes,
            base,
            out,
        } => {
            let opts = common.options()?;
            let cfg = ModelConfig::from_file(&common.model).map_err(|e| e.to_string())?;
            let adapter = match prepare_adapter(&common.adapter_dir, &cfg, &opts) {
                Ok(a) => a,
                Err(AuditError::Refused(report)) => {
                    if common.json {
                        println!("{:#}", report.to_json(&cfg));
                    } else {
                        print!("{}", report.to_text(&cfg));
                    }
                    return Ok(ExitCode::from(1));
                }
                Err(e) => return Err(e.to_string()),
            };
            let outputs = probe_files_at(&adapter, &cfg, &probes, base.as_deref(), &out, opts.placement)
                .map_err(|e| e.to_string())?;
            if common.json {
                let summary = json!({
                    "out": out.display().to_string(),
                    "written": outputs.tensors.keys().collect::<Vec<_>>(),
                    "unserved": outputs.unserved,
                });
                println!("{summary:#}");
            } else {
                println!("wrote {} tensors to {}", outputs.tensors.len(), display(&out));
                for w in &outputs.unserved {
                    println!("  not served (no delta written): {w}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn display(p: &Path) -> String {
    p.display().to_string()
}

fn verdict(report: &AuditReport) -> ExitCode {
    if report.is_servable() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
