//! The I/O sections of `cargo xtask bench`: a disk swap into a pool slot
//! against a pinned host-to-device copy of the same bytes, and the peer
//! landing over TCP loopback against a plain socket copy of the same bytes
//! between the same two endpoints, each pair measured in the same run.

use std::time::Instant;

use half::bf16;
use lora_kernels::Device;
use lora_layout::ModelConfig;
use lora_pool::{BatchCapacity, LoraOptions, LoraPool, SlotId, StagingTuning};
use lora_rdma::bench::LLAMA_8B;
use rayon::prelude::*;

/// One measured operation beside its baseline.
#[derive(Debug, Clone)]
pub struct IoRow {
    /// What was measured.
    pub name: String,
    /// Bytes moved.
    pub bytes: usize,
    /// Median, microseconds.
    pub median_us: f64,
    /// The spread of the runs, in words (`p10 … p90 …`, or the best run).
    pub spread: String,
    /// The baseline's name.
    pub baseline: String,
    /// The baseline's median, microseconds.
    pub baseline_us: f64,
    /// The target ratio to the baseline (time / baseline), if any.
    pub target_ratio: Option<f64>,
}

/// Median and a `p10 … p90 …` spread of `us`.
pub(crate) fn quantiles(mut us: Vec<f64>) -> (f64, String) {
    us.sort_by(f64::total_cmp);
    let at = |q: f64| {
        us.get(((us.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    (at(0.5), format!("p10 {:.0} us, p90 {:.0} us", at(0.1), at(0.9)))
}

/// Swap a synthetic rank-16 all-linear Llama-3.1-8B adapter (about 84 MB
/// BF16) from a file in the page cache into a slot, `reps` times, against a
/// pinned host-to-device copy of the slot's bytes. Target: within 1.5x.
/// With `sweep`, the swap is also timed at other staging chunk sizes.
pub fn swap(device: &Device, reps: usize, sweep: bool) -> Result<IoRow, String> {
    let cfg = ModelConfig::from_hf_config(LLAMA_8B).map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("lora-swap-bench-{}", std::process::id()));
    lora_rdma::bench::write_adapter(&dir, &cfg, 16).map_err(|e| e.to_string())?;
    // Bring the file into the page cache.
    let file = dir.join(lora_audit::ADAPTER_WEIGHTS);
    std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    let opts = LoraOptions {
        max_loras: 2,
        max_rank: 16,
        rotatable: true,
        ..LoraOptions::default()
    };
    let capacity = BatchCapacity {
        max_rows: 64,
        max_segments: 4,
    };
    let mut pool = LoraPool::new(device, cfg, opts, capacity).map_err(|e| e.to_string())?;
    let slot_elems = pool.layout().slot_bytes() / 2;
    let bytes = pool.layout().slot_bytes();

    let (pinned, mut dst) = copy_baseline(device, slot_elems)?;
    let sync = |d: &Device| d.synchronize().map_err(|e| e.to_string());
    let mut copy_us = Vec::with_capacity(reps);
    let mut swap_us = Vec::with_capacity(reps);
    let (mut stage_us, mut publish_us) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    let mut audit_us = Vec::with_capacity(reps);
    let mut route = String::new();
    // Warm both paths once, then interleave them so drift hits both alike.
    dst.upload_pinned(0, &pinned).map_err(|e| e.to_string())?;
    pool.swap_from_disk(SlotId::new(0), "bench", &dir)
        .map_err(|e| e.to_string())?;
    sync(device)?;
    for _ in 0..reps {
        let t = Instant::now();
        dst.upload_pinned(0, &pinned).map_err(|e| e.to_string())?;
        sync(device)?;
        copy_us.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let report = pool
            .swap_from_disk(SlotId::new(0), "bench", &dir)
            .map_err(|e| e.to_string())?;
        sync(device)?;
        swap_us.push(t.elapsed().as_secs_f64() * 1e6);
        stage_us.push(report.stage_us);
        publish_us.push(report.publish_us);
        audit_us.push(report.audit_us);
        route = format!("{:?}", report.route);
    }
    let chunks = pool.staging_chunks();
    let mut swept = String::new();
    if sweep {
        for (mib, read_threads, device_repack, streaming_stores) in [
            (4usize, 16usize, false, false),
            (4, 16, true, false),
            (4, 16, true, true),
            (4, 14, true, true),
            (4, 12, true, true),
            (8, 16, true, true),
            (2, 16, true, true),
        ] {
            let tuning = StagingTuning {
                chunk_bytes: mib << 20,
                device_repack,
                read_threads,
                streaming_stores,
            };
            pool.tune_staging(tuning).map_err(|e| e.to_string())?;
            let (mut us, mut stage) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
            for _ in 0..reps {
                let t = Instant::now();
                let report = pool
                    .swap_from_disk(SlotId::new(0), "bench", &dir)
                    .map_err(|e| e.to_string())?;
                sync(device)?;
                us.push(t.elapsed().as_secs_f64() * 1e6);
                stage.push(report.stage_us);
            }
            let route = match (device_repack, streaming_stores) {
                (false, _) => "host pack",
                (true, false) => "repack",
                (true, true) => "repack, streaming stores",
            };
            swept += &format!(
                "; {route} {mib} MiB, {read_threads} readers: {:.0} us (stage {:.0})",
                quantiles(us).0,
                quantiles(stage).0
            );
        }
        pool.tune_staging(StagingTuning::default()).map_err(|e| e.to_string())?;
    }
    let parts = swap_parts(&pool, &dir, reps)?;
    let (raw_read, read_and_copy) = read_beside_copy(device, &dir, &pinned, &mut dst, reps)?;
    let _ = std::fs::remove_dir_all(&dir);
    let (copy, _) = quantiles(copy_us);
    let (median_us, spread) = quantiles(swap_us);
    let (stage, _) = quantiles(stage_us);
    let (publish, _) = quantiles(publish_us);
    let (audit, _) = quantiles(audit_us);
    Ok(IoRow {
        name: format!("disk swap into a slot, {:.1} MB", bytes as f64 / 1e6),
        bytes,
        median_us,
        spread: format!(
            "{spread}; route {route}; stage {stage:.0} us (audit {audit:.0} us), {chunks} chunks, \
             publish {publish:.0} us; alone: {parts}; the data section read alone {raw_read:.0} us, \
             read while the pinned copy runs: both done in {read_and_copy:.0} us{swept}"
        ),
        baseline: "pinned host-to-device copy".into(),
        baseline_us: copy,
        target_ratio: Some(1.5),
    })
}

/// The baseline copy's buffers: `elems` BF16 values in pinned host memory
/// (a pattern, so no page is left untouched) and a device buffer of the same
/// size to copy them into.
pub(crate) fn copy_baseline(
    device: &Device,
    elems: usize,
) -> Result<(lora_kernels::PinnedHostBuffer<bf16>, lora_kernels::DeviceBuffer<bf16>), String> {
    let mut pinned = device.alloc_pinned::<bf16>(elems).map_err(|e| e.to_string())?;
    pinned
        .as_mut_slice()
        .map_err(|e| e.to_string())?
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = bf16::from_f32((i % 251) as f32));
    let dst = device.alloc_zeros::<bf16>(elems).map_err(|e| e.to_string())?;
    Ok((pinned, dst))
}

/// The landing's target: at least this share of the plain socket copy's
/// rate.
const LANDING_SHARE_TARGET: f64 = 0.7;

/// The peer landing rate of the same 84 MB adapter over TCP loopback
/// against a plain socket copy of the same bytes between the same two
/// endpoints (a server thread of this process, as the peer is, and this
/// thread; the line rate), with a memcpy of the same bytes beside them, all
/// interleaved in one run. Target: the landing at 70 % of the socket copy's
/// rate or better (time within 1 / 0.7 of it).
pub fn peer_landing(reps: usize) -> Result<IoRow, String> {
    let b = lora_rdma::bench::tcp_landing_rate(reps).map_err(|e| e.to_string())?;
    Ok(IoRow {
        name: format!("peer landing over TCP loopback, {:.1} MB", b.bytes as f64 / 1e6),
        bytes: b.bytes,
        median_us: b.land_median.as_secs_f64() * 1e6,
        spread: format!(
            "best {:.0} us of {}; landing {:.2} GB/s, plain socket copy {:.2} GB/s: {:.0} % of its rate \
             (target >= {:.0} %); memcpy {:.0} us ({:.1} GB/s); pages populated ahead: {}, parts checked as \
             they land: {}",
            b.land_best.as_secs_f64() * 1e6,
            b.runs,
            b.land_gbps(),
            b.socket_gbps(),
            100.0 * b.share_of_socket(),
            100.0 * LANDING_SHARE_TARGET,
            b.memcpy_median.as_secs_f64() * 1e6,
            b.memcpy_gbps(),
            b.tuning.populate_ahead,
            b.tuning.check_as_landed,
        ),
        baseline: "plain socket copy, same bytes".into(),
        baseline_us: b.socket_median.as_secs_f64() * 1e6,
        target_ratio: Some(1.0 / LANDING_SHARE_TARGET),
    })
}

/// Where a swap's host time goes: the audit (config, the weights' header,
/// placement), and the pack of every pair read from the file straight into
/// host memory, each timed alone. Medians, in words.
fn swap_parts(pool: &LoraPool, dir: &std::path::Path, reps: usize) -> Result<String, String> {
    use lora_audit::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, SafetensorsFile, audit_header};
    use lora_layout::PairLayout;
    use lora_pool::image::{PackPlan, file_sources};
    let s = |e: &dyn std::fmt::Display| e.to_string();
    let layout = pool.layout();
    let mut dst = vec![bf16::ZERO; layout.slot_bytes() / 2];
    let (mut audit_us, mut pack_us) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        let text = std::fs::read_to_string(dir.join(ADAPTER_CONFIG)).map_err(|e| s(&e))?;
        let file = SafetensorsFile::open(&dir.join(ADAPTER_WEIGHTS)).map_err(|e| s(&e))?;
        let report = audit_header("bench", &text, file.infos(), pool.config(), pool.options()).map_err(|e| s(&e))?;
        audit_us.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let sources = file_sources(&report, &file).map_err(|e| s(&e))?;
        let plan = PackPlan::new(layout, &sources).map_err(|e| s(&e))?;
        plan.fill(layout, 0..PairLayout::len(layout), &mut dst)
            .map_err(|e| s(&e))?;
        pack_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (audit, _) = quantiles(audit_us);
    let (pack, _) = quantiles(pack_us);
    Ok(format!(
        "audit {audit:.0} us, read + pack {pack:.0} us on {} threads",
        rayon_threads()
    ))
}

/// The two streams a disk swap cannot avoid, timed alone and together: the
/// adapter file's data section read from the page cache (every core, the
/// swap's 128 KiB pieces) and the pinned host-to-device copy of the slot.
/// Together they share the host's memory bandwidth; the time until both are
/// done is what any swap from the page cache must at least take on this
/// host. Medians, µs: (read alone, read and copy together).
fn read_beside_copy(
    device: &Device,
    dir: &std::path::Path,
    pinned: &lora_kernels::PinnedHostBuffer<bf16>,
    dst: &mut lora_kernels::DeviceBuffer<bf16>,
    reps: usize,
) -> Result<(f64, f64), String> {
    let s = |e: &dyn std::fmt::Display| e.to_string();
    let file = lora_audit::UnparsedSafetensors::open(&dir.join(lora_audit::ADAPTER_WEIGHTS)).map_err(|e| s(&e))?;
    let mut raw = vec![0u8; file.data_len() as usize];
    let piece = 128 << 10;
    let read = |raw: &mut Vec<u8>| {
        raw.par_chunks_mut(piece)
            .enumerate()
            .try_for_each(|(i, p)| file.read_data_at(p, (i * piece) as u64))
            .map_err(|e| s(&e))
    };
    let (mut alone, mut together) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        read(&mut raw)?;
        alone.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        dst.upload_pinned(0, pinned).map_err(|e| s(&e))?;
        read(&mut raw)?;
        device.synchronize().map_err(|e| s(&e))?;
        together.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok((quantiles(alone).0, quantiles(together).0))
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
