//! Shared by the peer integration tests: fixtures, the `lora-peer` process,
//! the disk-side reference images and pool snapshots.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lora_audit::{LoraOptions, prepare_adapter};
use lora_layout::{ExpertLayout, LoraModule, ModelConfig, SlotLayout};
use lora_pool::image::{SlotImage, dense_sources, expert_sources};
use lora_pool::{AdapterSlot, AdapterSource, BatchCapacity, LoraPool};
use lora_rdma::land::HostLanding;

/// `fixtures/` at the workspace root.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// The base model config of fixture model `model`.
pub fn model_config(model: &str) -> ModelConfig {
    ModelConfig::from_file(&fixtures().join(model).join("config.json")).unwrap()
}

/// A `lora-peer serve` child process, killed when dropped.
pub struct PeerProcess {
    child: Child,
    /// Where it listens.
    pub addr: String,
    stdout: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl PeerProcess {
    /// Serve `adapters` of fixture model `model` (validated against the
    /// config of `config_model`) with `extra` arguments.
    pub fn spawn_with_config(config_model: &str, model: &str, adapters: &[&str], extra: &[&str]) -> PeerProcess {
        let dirs: Vec<PathBuf> = adapters.iter().map(|a| fixtures().join(model).join(a)).collect();
        let mut child = Command::new(env!("CARGO_BIN_EXE_lora-peer"))
            .arg("serve")
            .arg("--model")
            .arg(fixtures().join(config_model).join("config.json"))
            .arg("--adapters")
            .args(&dirs)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn lora-peer");
        let (tx, stdout) = channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let err = child.stderr.take().unwrap();
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut text = String::new();
            let mut err = err;
            let _ = err.read_to_string(&mut text);
            sink.lock().unwrap().push_str(&text);
        });
        let mut peer = PeerProcess {
            child,
            addr: String::new(),
            stdout,
            stderr,
        };
        let line = peer.wait_line("listening on ", Duration::from_secs(60));
        peer.addr = line["listening on ".len()..].trim().to_string();
        peer
    }

    /// Serve `adapters` of fixture model `model`.
    pub fn spawn(model: &str, adapters: &[&str], extra: &[&str]) -> PeerProcess {
        PeerProcess::spawn_with_config(model, model, adapters, extra)
    }

    /// The next stdout line starting with `prefix`.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    std::thread::sleep(Duration::from_millis(100));
                    panic!(
                        "lora-peer never printed `{prefix}`; stderr:\n{}",
                        self.stderr.lock().unwrap()
                    );
                }
            }
        }
    }

    /// SIGKILL the peer and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The disk path: `prepare_adapter` then `SlotImage::pack`, dense and
/// expert images.
pub fn packed_from_disk(model: &str, adapter: &str, opts: &LoraOptions) -> (SlotImage, SlotImage) {
    let cfg = model_config(model);
    let p = prepare_adapter(&fixtures().join(model).join(adapter), &cfg, opts).unwrap();
    let dense = dense_sources(&p);
    let experts = expert_sources(&p);
    let layout = SlotLayout::new(&cfg, opts.max_rank).unwrap();
    let expert_layout = ExpertLayout::new(&cfg, opts.expert_rank, p.experts.iter().map(|e| (e.layer, e.site))).unwrap();
    (
        SlotImage::pack(&layout, &dense).unwrap(),
        SlotImage::pack(&expert_layout, &experts).unwrap(),
    )
}

/// A CPU pool loading fixture adapters of `model` from disk: `(name,
/// adapter directory)` into slots 0, 1, ...
pub fn disk_pool(model: &str, adapters: &[(&str, &str)], opts: LoraOptions) -> LoraPool {
    let dirs: Vec<PathBuf> = adapters.iter().map(|(_, a)| fixtures().join(model).join(a)).collect();
    let sources: Vec<AdapterSource<'_>> = adapters
        .iter()
        .zip(&dirs)
        .map(|((name, _), dir)| AdapterSource { name, dir })
        .collect();
    let device = lora_kernels::Device::cpu();
    LoraPool::load(&device, model_config(model), opts, BatchCapacity::default(), &sources).unwrap()
}

/// Whether a landing target holds nothing: no pairs, every byte zero.
pub fn assert_fresh(target: &HostLanding) {
    assert!(target.dense().pairs().is_empty(), "dense pairs declared");
    assert!(target.experts().pairs().is_empty(), "expert pairs declared");
    assert!(target.dense().as_bytes().iter().all(|&b| b == 0), "dense bytes written");
    assert!(
        target.experts().as_bytes().iter().all(|&b| b == 0),
        "expert bytes written"
    );
}

/// Everything a publish may change: every slot's bytes, every table entry,
/// the slot registry.
#[derive(Debug, PartialEq)]
pub struct Snapshot {
    pub bytes: Vec<Vec<half::bf16>>,
    pub entries: Vec<lora_kernels::PairEntry>,
    pub slots: Vec<AdapterSlot>,
}

pub fn snapshot(pool: &LoraPool) -> Snapshot {
    assert_eq!(pool.slot_ids().count(), pool.slots().len());
    let cfg = pool.config();
    let mut entries = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        for module in LoraModule::ALL {
            for slot in pool.slot_ids() {
                if let Some(e) = pool.entry(layer, module, slot) {
                    entries.push(e);
                }
            }
        }
    }
    Snapshot {
        bytes: pool.slot_ids().map(|s| pool.slot_contents(s).unwrap()).collect(),
        entries,
        slots: pool.slots().to_vec(),
    }
}
