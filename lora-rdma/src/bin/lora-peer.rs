//! `lora-peer`: a weight peer that audits adapters, stages them on demand
//! for an engine's geometry and serves them over the peer protocol.
//!
//! ```text
//! lora-peer serve --model config.json --adapters dir/a dir/b --listen 127.0.0.1:7700
//! ```
//!
//! It binds loopback unless `--listen` names another address. Adapters the
//! audit refuses are reported and not served; a served adapter whose files
//! change is audited again before it is staged. Connection limits, the
//! per-request deadlines and the staging cache's memory budget are options
//! (`--help`). On startup it prints one
//! `listening on ADDR` line on stdout (tests read the port from it).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lora_layout::ModelConfig;
use lora_rdma::peer::{Peer, PeerFault, PeerOptions, PeerStore, StoreOptions};

#[derive(Parser)]
#[command(name = "lora-peer", about = "Serve peer-staged LoRA adapters to inference engines.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Audit the adapters and serve them.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// The base model's Hugging Face `config.json`.
    #[arg(long)]
    model: PathBuf,
    /// Adapter directories (`adapter_config.json` + `adapter_model.safetensors`);
    /// each is served under its directory name.
    #[arg(long, num_args = 1.., required = true)]
    adapters: Vec<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: String,
    /// Skip targets the engine cannot apply instead of refusing the adapter.
    #[arg(long)]
    allow_partial: bool,
    /// Refuse adapters with routed-expert or router deltas.
    #[arg(long)]
    no_experts: bool,
    /// Connections served at once (past it, the longest-idle one is closed
    /// for a new one, or the new one is refused busy).
    #[arg(long, default_value_t = 32)]
    max_connections: usize,
    /// Connections served at once from one client address.
    #[arg(long, default_value_t = 16)]
    max_per_client: usize,
    /// Seconds an idle connection is kept.
    #[arg(long, default_value_t = 300)]
    idle_timeout: u64,
    /// Seconds any single read or write may wait, and a whole request may
    /// take to arrive.
    #[arg(long, default_value_t = 30)]
    io_timeout: u64,
    /// The slowest a client may take a reply, in MiB/s (a reply of N bytes
    /// has 2 x io-timeout + N / rate).
    #[arg(long, default_value_t = 16)]
    min_rate_mib: u64,
    /// Stagings kept in memory at once.
    #[arg(long, default_value_t = 16)]
    max_staged: usize,
    /// Largest single staging, in MiB.
    #[arg(long, default_value_t = 8192)]
    max_stage_mib: usize,
    /// Memory budget of all stagings kept, in MiB (least recently used
    /// stagings no landing pins are dropped past it).
    #[arg(long, default_value_t = 16384)]
    cache_mib: usize,
    /// Serve RDMA READ from this device (needs the `ibverbs` feature).
    #[arg(long)]
    rdma_device: Option<String>,
    /// The RDMA device's port.
    #[arg(long, default_value_t = 1)]
    rdma_port: u8,
    /// The GID index on that port (RoCE).
    #[arg(long, default_value_t = 0)]
    rdma_gid_index: u8,
    /// Test only: `corrupt-byte` (flip a staged byte after checksumming) or
    /// `stall-after=N` (hang after N data bytes on a connection).
    #[arg(long, hide = true)]
    test_fault: Vec<String>,
}

fn adapter_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let cfg = ModelConfig::from_file(&args.model).map_err(|e| e.to_string())?;
    let mut store_options = StoreOptions {
        allow_partial: args.allow_partial,
        experts: !args.no_experts,
        max_staged: args.max_staged,
        max_stage_bytes: args.max_stage_mib.saturating_mul(1 << 20),
        max_cache_bytes: args.cache_mib.saturating_mul(1 << 20),
        corrupt_staged_byte: false,
    };
    let mut fault = None;
    for f in &args.test_fault {
        match f.split_once('=') {
            None if f == "corrupt-byte" => store_options.corrupt_staged_byte = true,
            Some(("stall-after", n)) => {
                let n = n
                    .parse()
                    .map_err(|_| format!("--test-fault {f}: expected a byte count"))?;
                fault = Some(PeerFault::StallAfterBytes(n));
            }
            _ => return Err(format!("unknown --test-fault {f}")),
        }
    }
    let mut store = PeerStore::new(cfg, store_options);
    if let Some(device) = &args.rdma_device {
        store = with_rdma(store, device, args.rdma_port, args.rdma_gid_index)?;
    }
    for dir in &args.adapters {
        let name = adapter_name(dir);
        match store.add_adapter(&name, dir) {
            Ok(()) => eprintln!("lora-peer: serving `{name}` from {}", dir.display()),
            Err(refused) => eprintln!("lora-peer: NOT serving `{name}`: {}", refused.reason),
        }
    }
    let options = PeerOptions {
        max_connections: args.max_connections,
        max_per_client: args.max_per_client,
        idle_timeout: Duration::from_secs(args.idle_timeout),
        io_timeout: Duration::from_secs(args.io_timeout),
        min_rate: args.min_rate_mib.saturating_mul(1 << 20),
        fault,
    };
    let peer =
        Peer::bind(store, args.listen.as_str(), options).map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let addr = peer.local_addr().map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on {addr}")
        .and_then(|_| out.flush())
        .map_err(|e| e.to_string())?;
    drop(out);
    peer.serve().map_err(|e| e.to_string())
}

#[cfg(feature = "ibverbs")]
fn with_rdma(store: PeerStore, device: &str, port: u8, gid_index: u8) -> Result<PeerStore, String> {
    let device = lora_rdma::verbs::PeerDevice::open_port(device, port, gid_index).map_err(|e| e.to_string())?;
    Ok(store.with_rdma(device))
}

#[cfg(not(feature = "ibverbs"))]
fn with_rdma(_store: PeerStore, _device: &str, _port: u8, _gid_index: u8) -> Result<PeerStore, String> {
    Err("--rdma-device needs lora-peer built with the `ibverbs` feature".into())
}

fn main() -> ExitCode {
    let Cli { command } = Cli::parse();
    let result = match command {
        Command::Serve(args) => serve(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lora-peer: {e}");
            ExitCode::FAILURE
        }
    }
}
