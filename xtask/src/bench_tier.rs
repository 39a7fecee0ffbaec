//! The host-tier section of `cargo xtask bench` (`--sections tier`): an
//! adapter prefetched into the pool's host tier, promoted into a slot by
//! one copy, against a pinned host-to-device copy of the same bytes in the
//! same run. Target: within 1.1x.

use std::time::Instant;

use lora_kernels::Device;
use lora_layout::ModelConfig;
use lora_pool::{BatchCapacity, LandedImages, LoraOptions, LoraPool, SlotId, SwapRoute};
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

/// The decode step's target during a concurrent promotion: at most this
/// many times its time without one.
const BESIDE_TARGET: f64 = 1.1;
/// Rows of the decode step timed beside the promotion (the `step` section's
/// middle case).
const BESIDE_ROWS: usize = 16;
/// Step graphs replayed back to back per measurement (a step of this shape
/// takes about as long as the promotion: the first one overlaps it).
const BESIDE_STEPS: usize = 4;

/// Decode steps beside a promotion: the whole-step LoRA graph of the
/// Llama-3.1-8B geometry (16 rows of slot 0's random rank-16 adapter, the
/// `step` section's applies) replayed [`BESIDE_STEPS`] times back to back,
/// an event between each, alone and while the 84 MB adapter of the `tier`
/// section lands from the host tier into slot 1 on the copy lane
/// (`begin_swap`, the replays, `finish_swap` once `swap_landed`),
/// interleaved `reps` times. Ours: the first step after `begin_swap` (the
/// promotion lands under it); baseline: the first step of the runs without
/// one. The later steps, the promotion's own time (begin until landed, host
/// clock) and a pinned copy of its bytes are reported beside. Target:
/// within 1.1x.
pub fn promotion_beside_decode(device: &Device, reps: usize) -> Result<IoRow, String> {
    use super::step::{Banks, RANK, adapter_image, apply_step, decode_options, kernel_err, site_buffers};
    use lora_kernels::testing::Rng;
    use lora_pool::StepRow;
    let err = |e: lora_pool::PoolError| e.to_string();
    let kerr = |e: lora_kernels::KernelError| e.to_string();
    let cfg = ModelConfig::from_hf_config(LLAMA_8B).map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("lora-beside-bench-{}", std::process::id()));
    lora_rdma::bench::write_adapter(&dir, &cfg, RANK).map_err(|e| e.to_string())?;
    let slot_bytes = lora_layout::SlotLayout::new(&cfg, RANK)
        .map_err(|e| e.to_string())?
        .slot_bytes();
    let opts = LoraOptions {
        max_loras: 2,
        max_rank: RANK,
        rotatable: true,
        host_tier_bytes: 2 * slot_bytes,
        ..LoraOptions::default()
    };
    let capacity = BatchCapacity {
        max_rows: BESIDE_ROWS,
        max_segments: 1,
    };
    let mut pool = LoraPool::new(device, cfg.clone(), opts, capacity).map_err(err)?;
    let mut rng = Rng::new(0x5eed_0045);
    let banks = Banks::new(&cfg, &mut rng);
    let image = adapter_image(pool.layout(), &cfg, &banks, &mut rng)?;
    pool.publish_landed(SlotId::new(0), "decode", LandedImages::new(image, None))
        .map_err(err)?;
    pool.prefetch("promoted", &dir).map_err(err)?;
    pool.wait_for_prefetch();
    for event in pool.prefetch_events() {
        event.outcome.map_err(|e| format!("prefetch of {}: {e}", event.name))?;
    }
    let lease = pool.acquire("decode").map_err(err)?;
    let rows = vec![StepRow::Adapter(&lease); BESIDE_ROWS];
    let step = pool.decode_step(&rows, BESIDE_ROWS).map_err(err)?;
    let mut bufs = site_buffers(device, &cfg, BESIDE_ROWS, &mut rng).map_err(kerr)?;
    let layers = cfg.num_hidden_layers;
    let graph = {
        let (pool, step, bufs) = (&pool, &step, &mut bufs);
        device
            .capture_graph(|| {
                apply_step(pool, step, BESIDE_ROWS, layers, bufs, decode_options(true)).map_err(kernel_err)
            })
            .map_err(kerr)?
    };
    // `BESIDE_STEPS` replays back to back, an event between each: µs per step.
    let steps = |graph: &lora_kernels::DeviceGraph| -> Result<Vec<lora_kernels::DeviceEvent>, String> {
        let mut events = vec![device.record_event().map_err(kerr)?];
        for _ in 0..BESIDE_STEPS {
            graph.replay().map_err(kerr)?;
            events.push(device.record_event().map_err(kerr)?);
        }
        Ok(events)
    };
    let per_step = |events: &[lora_kernels::DeviceEvent]| -> Result<Vec<f64>, String> {
        events
            .windows(2)
            .map(|w| Ok(f64::from(w[0].elapsed_ms(&w[1]).map_err(kerr)?) * 1e3))
            .collect()
    };
    let (pinned, mut dst) = copy_baseline(device, slot_bytes / 2)?;
    let sync = |d: &Device| d.synchronize().map_err(|e| e.to_string());
    let (mut alone_us, mut beside_us, mut landed_us, mut copy_us) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Warm every path once, then interleave.
    graph.replay().map_err(kerr)?;
    for round in 0..=reps {
        sync(device)?;
        let t = Instant::now();
        dst.upload_pinned(0, &pinned).map_err(kerr)?;
        sync(device)?;
        let copy = t.elapsed().as_secs_f64() * 1e6;
        let alone = steps(&graph)?;
        sync(device)?;
        // Slot 1 is emptied after each round, so every round promotes the
        // same tier image into it.
        let t = Instant::now();
        let route = pool.begin_swap(SlotId::new(1), "promoted", &dir).map_err(err)?;
        if route != SwapRoute::HostTier {
            return Err(format!("the promotion took the {route:?} route, not the host tier"));
        }
        let beside = steps(&graph)?;
        while pool.swap_landed().map_err(err)? == Some(false) {
            std::hint::spin_loop();
        }
        let landed = t.elapsed().as_secs_f64() * 1e6;
        pool.finish_swap().map_err(err)?;
        sync(device)?;
        device.check_faults().map_err(kerr)?;
        pool.evict(SlotId::new(1)).map_err(err)?;
        if round > 0 {
            copy_us.push(copy);
            alone_us.push(per_step(&alone)?);
            beside_us.push(per_step(&beside)?);
            landed_us.push(landed);
        }
    }
    drop((step, lease));
    let _ = std::fs::remove_dir_all(&dir);
    // Step k of every run, alone and beside the promotion.
    let nth = |runs: &[Vec<f64>], k: usize| quantiles(runs.iter().filter_map(|r| r.get(k).copied()).collect());
    let (alone, _) = nth(&alone_us, 0);
    let (median_us, spread) = nth(&beside_us, 0);
    let later: Vec<String> = (1..BESIDE_STEPS)
        .map(|k| format!("{:.0} / {:.0}", nth(&beside_us, k).0, nth(&alone_us, k).0))
        .collect();
    let (landed, landed_spread) = quantiles(landed_us);
    let (copy, _) = quantiles(copy_us);
    Ok(IoRow {
        name: format!("decode step ({BESIDE_ROWS} rows, whole-step graph) beside a host-tier promotion"),
        bytes: slot_bytes,
        median_us,
        spread: format!(
            "{spread}; the first step after begin_swap, which the promotion lands under: begin to landed \
             {landed:.0} us ({landed_spread}), a pinned copy of its {:.1} MB alone {copy:.0} us; the next steps, \
             beside / alone: {}",
            slot_bytes as f64 / 1e6,
            later.join(", ")
        ),
        baseline: "the same steps without a promotion".into(),
        baseline_us: alone,
        target_ratio: Some(BESIDE_TARGET),
    })
}
