//! The host-tier section of `cargo xtask bench` (`--sections tier`): an
//! adapter prefetched into the pool's host tier, promoted into a slot by
//! one copy, against a pinned host-to-device copy of the same bytes in the
//! same run. Target: within 1.1x.

use std::time::Instant;

use lora_kernels::Device;
use lora_layout::ModelConfig;
use lora_pool::{BatchCapacity, LoraOptions, LoraPool, SlotId, SwapRoute};
use lora_rdma::bench::LLAMA_8B;

use crate::bench_io::{IoRow, copy_baseline, quantiles};

/// A promotion's target: at most this many times the pinned copy.
const PROMOTION_TARGET: f64 = 1.1;

/// Promote a synthetic rank-16 all-linear Llama-3.1-8B adapter (about 84
/// MB BF16) from the host tier into a slot, `reps` times, interleaved with
/// a pinned host-to-device copy of the slot's bytes.
pub fn promotion(device: &Device, reps: usize) -> Result<IoRow, String> {
    let err = |e: lora_pool::PoolError| e.to_string();
    let cfg = ModelConfig::from_hf_config(LLAMA_8B).map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("lora-tier-bench-{}", std::process::id()));
    lora_rdma::bench::write_adapter(&dir, &cfg, 16).map_err(|e| e.to_string())?;
    let slot_bytes = lora_layout::SlotLayout::new(&cfg, 16)
        .map_err(|e| e.to_string())?
        .slot_bytes();
    let opts = LoraOptions {
        max_loras: 2,
        max_rank: 16,
        rotatable: true,
        host_tier_bytes: 2 * slot_bytes,
        ..LoraOptions::default()
    };
    let capacity = BatchCapacity {
        max_rows: 64,
        max_segments: 4,
    };
    let mut pool = LoraPool::new(device, cfg, opts, capacity).map_err(err)?;
    let t = Instant::now();
    pool.prefetch("bench", &dir).map_err(err)?;
    pool.wait_for_prefetch();
    let prefetch_us = t.elapsed().as_secs_f64() * 1e6;
    for event in pool.prefetch_events() {
        event.outcome.map_err(|e| format!("prefetch of {}: {e}", event.name))?;
    }
    let slot_elems = slot_bytes / 2;
    let (pinned, mut dst) = copy_baseline(device, slot_elems)?;
    let sync = |d: &Device| d.synchronize().map_err(|e| e.to_string());
    let promote = |pool: &mut LoraPool| -> Result<f64, String> {
        let report = pool.swap_from_disk(SlotId::new(0), "bench", &dir).map_err(err)?;
        if report.route != SwapRoute::HostTier {
            return Err(format!(
                "the promotion took the {:?} route, not the host tier",
                report.route
            ));
        }
        Ok(report.publish_us)
    };
    // Warm both paths once, then interleave them so drift hits both alike.
    dst.upload_pinned(0, &pinned).map_err(|e| e.to_string())?;
    promote(&mut pool)?;
    sync(device)?;
    let (mut copy_us, mut promote_us, mut publish_us) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        dst.upload_pinned(0, &pinned).map_err(|e| e.to_string())?;
        sync(device)?;
        copy_us.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        publish_us.push(promote(&mut pool)?);
        sync(device)?;
        promote_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (copy, _) = quantiles(copy_us);
    let (median_us, spread) = quantiles(promote_us);
    let (publish, _) = quantiles(publish_us);
    Ok(IoRow {
        name: format!("promotion from the host tier, {:.1} MB", slot_bytes as f64 / 1e6),
        bytes: slot_bytes,
        median_us,
        spread: format!(
            "{spread}; publish {publish:.0} us on the host; the prefetch (audit, prepare, pack into pinned \
             memory, on the pool's worker) {prefetch_us:.0} us"
        ),
        baseline: "pinned host-to-device copy".into(),
        baseline_us: copy,
        target_ratio: Some(PROMOTION_TARGET),
    })
}
