//! The TCP landing-rate benchmark: an 84 MB adapter (rank 16 on every
//! linear projection of Llama-3.1-8B) landed from a loopback peer, against
//! a plain memcpy of the same bytes in the same run. `cargo xtask bench`
//! calls [`tcp_landing_rate`] and reports the numbers; nothing here asserts
//! on time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use half::bf16;
use lora_audit::LoraOptions;
use lora_layout::{LoraModule, ModelConfig};
use safetensors::{Dtype, tensor::TensorView};

use crate::land::{HostLanding, LandError, Lander};
use crate::peer::{Peer, PeerOptions, PeerStore, StoreOptions};
use crate::stage::bf16_bytes;
use crate::tcp::{TcpOptions, TcpTransport};

/// The model geometry of the benchmarks: Llama-3.1-8B's `config.json`.
pub const LLAMA_8B: &str = include_str!("../../lora-layout/testdata/llama-3.1-8b.json");
/// Rank of the benchmark adapter (and the pool's `max_rank`).
const RANK: usize = 16;
/// The projections an `all-linear` Llama adapter adapts.
pub const MODULES: [LoraModule; 7] = [
    LoraModule::QProj,
    LoraModule::KProj,
    LoraModule::VProj,
    LoraModule::OProj,
    LoraModule::GateProj,
    LoraModule::UpProj,
    LoraModule::DownProj,
];

/// What one benchmark run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct LandingBench {
    /// Bytes landed per landing (what travels: A true-rank rows, padded B).
    pub bytes: usize,
    /// Manifest entries per landing.
    pub entries: usize,
    /// Timed landings.
    pub runs: usize,
    /// Median wall time of one whole landing: manifest, engine audit,
    /// reads, checksum verification.
    pub land_median: Duration,
    /// Fastest landing.
    pub land_best: Duration,
    /// Median time of one memcpy of `bytes`.
    pub memcpy_median: Duration,
}

impl LandingBench {
    /// Landing rate at the median, in GB/s (10^9 bytes).
    pub fn land_gbps(&self) -> f64 {
        gbps(self.bytes, self.land_median)
    }

    /// Memcpy rate at the median, in GB/s.
    pub fn memcpy_gbps(&self) -> f64 {
        gbps(self.bytes, self.memcpy_median)
    }
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Writing the synthetic adapter or binding the peer failed.
    #[error("benchmark setup: {0}")]
    Setup(String),
    /// A landing failed.
    #[error(transparent)]
    Land(#[from] LandError),
}

fn setup(e: impl std::fmt::Display) -> BenchError {
    BenchError::Setup(e.to_string())
}

/// A deterministic, non-zero BF16 fill (xorshift), small values like a
/// trained adapter's.
fn fill(n: usize, seed: u64) -> Vec<bf16> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02)
        })
        .collect()
}

/// Write a synthetic rank-`rank` adapter of every linear projection of
/// `cfg` (PEFT layout and key names) into `dir`.
pub fn write_adapter(dir: &Path, cfg: &ModelConfig, rank: usize) -> Result<(), BenchError> {
    std::fs::create_dir_all(dir).map_err(setup)?;
    let targets: Vec<&str> = MODULES.iter().map(|m| m.short_name()).collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
        "bias": "none",
    });
    std::fs::write(dir.join(lora_audit::ADAPTER_CONFIG), config.to_string()).map_err(setup)?;
    let mut tensors: Vec<(String, Vec<usize>, Vec<bf16>)> = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        for (m, module) in MODULES.iter().enumerate() {
            let (out, inp) = module.dims(cfg);
            let path = format!("base_model.model.model.layers.{layer}.{}", module.path(cfg.family));
            let seed = (layer * MODULES.len() + m) as u64;
            tensors.push((
                format!("{path}.lora_A.weight"),
                vec![rank, inp],
                fill(rank * inp, 2 * seed + 1),
            ));
            tensors.push((
                format!("{path}.lora_B.weight"),
                vec![out, rank],
                fill(out * rank, 2 * seed + 2),
            ));
        }
    }
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::BF16, shape.clone(), bf16_bytes(data)).map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(setup)?;
    safetensors::serialize_to_file(views, None, &dir.join(lora_audit::ADAPTER_WEIGHTS)).map_err(setup)
}

/// Removes the benchmark's adapter directory however the run ends.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

/// Land the synthetic 84 MB adapter (rank 16, every linear projection of
/// Llama-3.1-8B) `runs` times from a peer on loopback, after one untimed
/// landing that stages it, and memcpy the same number of bytes `runs` times.
pub fn tcp_landing_rate(runs: usize) -> Result<LandingBench, BenchError> {
    let cfg = ModelConfig::from_hf_config(LLAMA_8B).map_err(setup)?;
    landing_rate(&cfg, RANK, runs)
}

/// [`tcp_landing_rate`] for any dense model geometry `cfg` (Llama module
/// names) and rank; the pool's `max_rank` is `rank`.
pub fn landing_rate(cfg: &ModelConfig, rank: usize, runs: usize) -> Result<LandingBench, BenchError> {
    let runs = runs.max(1);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = TempDir(std::env::temp_dir().join(format!("lora-rdma-bench-{}-{nanos}", std::process::id())));
    write_adapter(&dir.0, cfg, rank)?;
    let mut store = PeerStore::new(cfg.clone(), StoreOptions::default());
    store.add_adapter("bench", &dir.0).map_err(|r| setup(r.reason))?;
    let peer = Peer::bind(store, "127.0.0.1:0", PeerOptions::default()).map_err(setup)?;
    let handle = peer.spawn().map_err(setup)?;
    let opts = LoraOptions {
        max_rank: rank,
        ..LoraOptions::default()
    };
    let lander = Lander::new(cfg.clone(), opts)?;
    let mut transport = TcpTransport::connect(&handle.addr().to_string(), TcpOptions::default())
        .map_err(|e| BenchError::Land(e.into()))?;
    let mut target = HostLanding::new(lander.layout());
    let first = lander.land(&mut transport, "bench", &mut target)?;
    let mut land_times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        lander.land(&mut transport, "bench", &mut target)?;
        land_times.push(start.elapsed());
    }
    let src = fill(first.bytes / 2, 7);
    let mut dst = vec![bf16::ZERO; src.len()];
    let mut copy_times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copy_times.push(start.elapsed());
    }
    let entries = 2 * (first.dense.len() + first.experts.len());
    Ok(LandingBench {
        bytes: first.bytes,
        entries,
        runs,
        land_best: land_times.iter().min().copied().unwrap_or_default(),
        land_median: median(land_times),
        memcpy_median: median(copy_times),
    })
}

#[cfg(test)]
mod tests {
    use lora_layout::{PairLayout, SlotLayout};

    use super::*;

    /// The benchmark's bookkeeping on a small model; says nothing about time.
    #[test]
    fn the_benchmark_lands_every_linear_projection() {
        let cfg = crate::test_support::config("llama");
        let bench = landing_rate(&cfg, 4, 2).unwrap();
        let layout = SlotLayout::new(&cfg, 4).unwrap();
        let places: Vec<_> = (0..layout.len()).filter_map(|i| layout.place(i)).collect();
        assert_eq!(bench.entries, 2 * places.len());
        // A travels as its rank rows, B padded to max_rank (= the rank here).
        let bytes: usize = places.iter().map(|p| 2 * 4 * (p.in_dim + p.out_dim)).sum();
        assert_eq!(bench.bytes, bytes);
        assert_eq!(bench.runs, 2);
        assert!(bench.land_best <= bench.land_median);
    }
}
