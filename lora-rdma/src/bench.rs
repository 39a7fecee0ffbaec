//! The TCP landing-rate benchmark: an 84 MB adapter (rank 16 on every
//! linear projection of Llama-3.1-8B) landed from a loopback peer, against
//! two baselines timed in the same run, interleaved with the landings so
//! drift hits all alike:
//!
//! - a plain socket copy of the same number of bytes between the same two
//!   endpoints (a server thread of this process, as the peer is, writing
//!   one buffer with one `write_all`; this thread reading it with one
//!   `read_exact` into a buffer of its own): the line rate of loopback TCP
//!   on this host, which the landing's target is stated against;
//! - a memcpy of the same bytes.
//!
//! `cargo xtask bench` calls [`tcp_landing_rate`] and reports the numbers;
//! nothing here asserts on time.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::bf16;
use lora_audit::LoraOptions;
use lora_layout::{LoraModule, ModelConfig};
use safetensors::{Dtype, tensor::TensorView};

use crate::land::{HostLanding, LandError, Lander, LandingTuning};
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
    /// Median time of one plain socket copy of `bytes` over loopback
    /// between a server thread and this one ([`SocketCopy`]).
    pub socket_median: Duration,
    /// How the landings spent the host's cores (the host's default).
    pub tuning: LandingTuning,
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

    /// Plain socket copy rate at the median, in GB/s.
    pub fn socket_gbps(&self) -> f64 {
        gbps(self.bytes, self.socket_median)
    }

    /// The landing's rate as a share of the plain socket copy's (1.0: the
    /// landing moves bytes as fast as a bare socket does).
    pub fn share_of_socket(&self) -> f64 {
        self.socket_median.as_secs_f64() / self.land_median.as_secs_f64().max(1e-12)
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

/// The landing's baseline: a plain socket copy over loopback. A server
/// thread (the peer's arrangement: the peer serves each connection on a
/// thread of its own) answers every one-byte request with all of its
/// buffer in one `write_all`; [`SocketCopy::copy`] sends the request and
/// reads the answer with one `read_exact` into the caller's buffer. Both
/// ends keep the operating system's default socket settings, with
/// `TCP_NODELAY` as the transport sets it.
pub struct SocketCopy {
    stream: Option<TcpStream>,
    server: Option<JoinHandle<std::io::Result<()>>>,
}

impl SocketCopy {
    /// Start the server thread with `src` as the bytes it sends, and
    /// connect to it.
    pub fn start(src: Vec<u8>) -> std::io::Result<SocketCopy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let server = std::thread::Builder::new()
            .name("socket-copy".into())
            .spawn(move || -> std::io::Result<()> {
                let (mut stream, _) = listener.accept()?;
                stream.set_nodelay(true)?;
                let mut ask = [0u8; 1];
                // Until the client closes: one whole buffer per request.
                while stream.read(&mut ask)? == 1 {
                    stream.write_all(&src)?;
                }
                Ok(())
            })?;
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(SocketCopy {
            stream: Some(stream),
            server: Some(server),
        })
    }

    /// Ask for the server's buffer and read it into `dst`, which must be
    /// as long as it.
    pub fn copy(&mut self, dst: &mut [u8]) -> std::io::Result<()> {
        let stream = self
            .stream
            .as_mut()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotConnected, "the socket copy was closed"))?;
        stream.write_all(&[1])?;
        stream.read_exact(dst)
    }

    /// Close the connection and wait for the server thread; its error, if
    /// it failed.
    pub fn finish(mut self) -> std::io::Result<()> {
        self.close()
    }

    fn close(&mut self) -> std::io::Result<()> {
        drop(self.stream.take());
        match self.server.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(std::io::Error::other("the socket copy's server thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for SocketCopy {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

/// Land the synthetic 84 MB adapter (rank 16, every linear projection of
/// Llama-3.1-8B) `runs` times from a peer on loopback, after one untimed
/// landing that stages it; between landings, copy the same number of bytes
/// over a plain loopback socket ([`SocketCopy`]) and with a memcpy, `runs`
/// times each, after one untimed socket copy (which also touches the
/// destination both copies write).
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
    let src = bf16_bytes(&fill(first.bytes / 2, 7)).to_vec();
    let mut dst = vec![0u8; src.len()];
    let mut socket = SocketCopy::start(src.clone()).map_err(setup)?;
    socket.copy(&mut dst).map_err(setup)?;
    let mut land_times = Vec::with_capacity(runs);
    let mut socket_times = Vec::with_capacity(runs);
    let mut copy_times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        lander.land(&mut transport, "bench", &mut target)?;
        land_times.push(start.elapsed());
        let start = Instant::now();
        socket.copy(&mut dst).map_err(setup)?;
        std::hint::black_box(&mut dst);
        socket_times.push(start.elapsed());
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copy_times.push(start.elapsed());
    }
    socket.finish().map_err(setup)?;
    let entries = 2 * (first.dense.len() + first.experts.len());
    Ok(LandingBench {
        bytes: first.bytes,
        entries,
        runs,
        land_best: land_times.iter().min().copied().unwrap_or_default(),
        land_median: median(land_times),
        memcpy_median: median(copy_times),
        socket_median: median(socket_times),
        tuning: lander.tuning(),
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
        assert!(bench.socket_median > Duration::ZERO && bench.memcpy_median > Duration::ZERO);
    }

    #[test]
    fn the_socket_copy_moves_every_byte_each_time() {
        let src: Vec<u8> = (0..1_000_003u32).map(|i| (i % 253) as u8).collect();
        let mut copy = SocketCopy::start(src.clone()).unwrap();
        let mut dst = vec![0u8; src.len()];
        for _ in 0..3 {
            dst.fill(0);
            copy.copy(&mut dst).unwrap();
            assert_eq!(dst, src);
        }
        copy.finish().unwrap();
    }

    #[test]
    fn rates_and_share_come_from_the_medians() {
        let b = LandingBench {
            bytes: 4_000_000_000,
            entries: 2,
            runs: 1,
            land_median: Duration::from_secs(2),
            land_best: Duration::from_secs(2),
            memcpy_median: Duration::from_millis(250),
            socket_median: Duration::from_millis(1500),
            tuning: LandingTuning::for_cores(2),
        };
        assert_eq!(
            (b.land_gbps(), b.socket_gbps(), b.memcpy_gbps()),
            (2.0, 4.0 / 1.5, 16.0)
        );
        assert_eq!(b.share_of_socket(), 0.75);
    }
}
