//! Prefetch: the engine names the adapters its queue will need, and a
//! worker thread of the pool audits, prepares and packs each into the host
//! tier ([`crate::host_tier`]), so its later promotion is one copy.
//!
//! The worker never touches the device's stream or the pool's slots, and
//! holds the tier's lock only to insert, so it never blocks a step. Each
//! request ends in one [`PrefetchEvent`], taken once by
//! [`LoraPool::prefetch_events`](crate::LoraPool::prefetch_events): a
//! refused adapter is reported there, with the audit's reasons, exactly
//! once per request.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use half::bf16;
use lora_audit::{
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, AuditError, HostOverlay, LoraOptions, Refusal, UnparsedSafetensors, audit_header,
    prepare_adapter,
};
use lora_kernels::Device;
use lora_layout::{ModelConfig, PairLayout, SlotLayout};

use crate::dora::DoraMagnitudes;
use crate::error::PoolError;
use crate::host_tier::{FileStamp, HostImage, HostTier};
use crate::image::{ImageError, PackPlan, dense_sources, file_sources};
use crate::pool::{dense_only, pack_experts, served_tensor};

/// How one prefetch request ended.
#[derive(Debug)]
pub struct PrefetchEvent {
    /// The adapter's name, as the request gave it.
    pub name: String,
    /// Its image's bytes in the host tier, or why it is not there (a
    /// refusal, an unreadable file, no host memory, no room in the tier).
    pub outcome: Result<usize, PoolError>,
}

/// One request: an adapter's name and directory.
struct Job {
    name: String,
    dir: PathBuf,
}

/// What the worker needs to build images: everything but the device's
/// stream.
struct Packer {
    device: Device,
    cfg: ModelConfig,
    opts: LoraOptions,
    layout: SlotLayout,
    tier: Arc<Mutex<HostTier>>,
}

/// The events the worker left, and how many requests have none yet.
#[derive(Default)]
struct Outbox {
    events: Mutex<(Vec<PrefetchEvent>, usize)>,
    done: Condvar,
    /// Set when the pool drops: the requests still queued are skipped.
    closing: AtomicBool,
}

/// The pool's prefetch worker and the events it left.
pub(crate) struct Prefetcher {
    jobs: Option<Sender<Job>>,
    outbox: Arc<Outbox>,
    worker: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Start the worker (thread `lora-prefetch`) over `tier`.
    pub(crate) fn start(
        device: &Device,
        cfg: &ModelConfig,
        opts: &LoraOptions,
        layout: &SlotLayout,
        tier: Arc<Mutex<HostTier>>,
    ) -> Result<Prefetcher, PoolError> {
        let (jobs, queue) = mpsc::channel();
        let outbox = Arc::new(Outbox::default());
        let packer = Packer {
            device: device.clone(),
            cfg: cfg.clone(),
            opts: opts.clone(),
            layout: layout.clone(),
            tier,
        };
        let sink = Arc::clone(&outbox);
        let worker = std::thread::Builder::new()
            .name("lora-prefetch".to_string())
            .spawn(move || packer.run(&queue, &sink))
            .map_err(|e| PoolError::StagingThreads {
                threads: 1,
                message: e.to_string(),
            })?;
        Ok(Prefetcher {
            jobs: Some(jobs),
            outbox,
            worker: Some(worker),
        })
    }

    /// Queue `name` from `dir`; returns at once.
    pub(crate) fn request(&self, name: &str, dir: &Path) -> Result<(), PoolError> {
        let job = Job {
            name: name.to_string(),
            dir: dir.to_path_buf(),
        };
        let Some(jobs) = &self.jobs else {
            return Err(PoolError::PrefetchStopped);
        };
        self.outbox.lock().1 += 1;
        if jobs.send(job).is_err() {
            self.outbox.lock().1 -= 1;
            return Err(PoolError::PrefetchStopped);
        }
        Ok(())
    }

    /// The events since the last call, oldest first.
    pub(crate) fn take_events(&self) -> Vec<PrefetchEvent> {
        std::mem::take(&mut self.outbox.lock().0)
    }

    /// Wait until every request queued so far has its event (tests and
    /// benches; an engine polls [`Prefetcher::take_events`] instead).
    pub(crate) fn wait_idle(&self) {
        let mut state = self.outbox.lock();
        while state.1 > 0 {
            state = self.outbox.done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Outbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<PrefetchEvent>, usize)> {
        // A poisoned lock only means the worker panicked mid-push; the
        // events already there are whole.
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Prefetcher {
    /// Close the queue and wait for the worker to finish the request in
    /// hand; the ones still queued are dropped unserved.
    fn drop(&mut self) {
        self.outbox.closing.store(true, Ordering::Relaxed);
        drop(self.jobs.take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

impl Packer {
    fn run(self, queue: &Receiver<Job>, outbox: &Outbox) {
        for job in queue {
            if outbox.closing.load(Ordering::Relaxed) {
                break;
            }
            let outcome = self.serve(&job.name, &job.dir);
            let mut state = outbox.lock();
            state.0.push(PrefetchEvent {
                name: job.name,
                outcome,
            });
            state.1 = state.1.saturating_sub(1);
            outbox.done.notify_all();
        }
    }

    /// Put `name`'s image in the tier (unless a current one is there).
    fn serve(&self, name: &str, dir: &Path) -> Result<usize, PoolError> {
        {
            let mut tier = self.tier.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(image) = tier.get(name).filter(|i| i.is_current(dir)) {
                return Ok(image.bytes());
            }
        }
        let image = self.image(name, dir)?;
        let bytes = image.bytes();
        self.tier
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name, image)
            .map_err(PoolError::HostTier)?;
        Ok(bytes)
    }

    /// Audit, prepare and pack the adapter in `dir` on this thread.
    fn image(&self, name: &str, dir: &Path) -> Result<HostImage, PoolError> {
        let audit_err = |source: AuditError| PoolError::Audit {
            adapter: name.to_string(),
            source: Box::new(source),
        };
        let image_err = |source| PoolError::Image {
            adapter: name.to_string(),
            source,
        };
        // Stamped before the read: a file changed meanwhile makes the image
        // stale, never a mix taken for current.
        let stamp = FileStamp::of(dir).map_err(|e| {
            audit_err(AuditError::Io {
                path: dir.display().to_string(),
                source: e,
            })
        })?;
        // A tensor-parallel rank reads only its shard's bytes of a
        // dense-only adapter, as the disk swap's host pack does.
        if self.layout.placement().tp_world() > 1
            && let Some(image) = self.rank_image(name, dir, &stamp)?
        {
            return Ok(image);
        }
        let adapter = prepare_adapter(dir, &self.cfg, &self.opts).map_err(audit_err)?;
        if !adapter.experts.is_empty() && (!self.opts.experts || self.cfg.moe.is_none()) {
            return Err(PoolError::NoExpertPool(name.to_string()));
        }
        let experts = pack_experts(&self.cfg, self.opts.expert_rank, name, &adapter)?.map(Arc::new);
        let sources = dense_sources(&adapter);
        let plan = PackPlan::new(&self.layout, &sources).map_err(image_err)?;
        let mut dense = self.device.alloc_pinned::<bf16>(self.layout.slot_bytes() / 2)?;
        plan.fill(&self.layout, 0..self.layout.len(), dense.as_mut_slice()?)
            .map_err(image_err)?;
        Ok(HostImage {
            dir: dir.to_path_buf(),
            stamp,
            dense,
            dense_pairs: plan.metas().to_vec(),
            group_expert_deltas: experts.is_some() || adapter.report.group_expert_pairs > 0,
            experts,
            has_overlay: !adapter.overlay.is_empty(),
            // A DoRA adapter's rescale needs the base weights, which only
            // the pool's promotion reads: the tier keeps the magnitudes.
            dora: DoraMagnitudes::of_prepared(&adapter),
            overlay: adapter.overlay,
        })
    }
}

impl Packer {
    /// The image of a dense-only adapter in `dir` from the rank's bytes of
    /// its file only: the header audited, each pair's shard read with
    /// positioned reads into its place (`PackPlan` over the file), a
    /// non-finite value among them refused naming the tensor. `None` for
    /// any other adapter (experts, overlays, no safetensors file, a
    /// refusal): the prepared route answers it.
    fn rank_image(&self, name: &str, dir: &Path, stamp: &FileStamp) -> Result<Option<HostImage>, PoolError> {
        let audit_err = |source: AuditError| PoolError::Audit {
            adapter: name.to_string(),
            source: Box::new(source),
        };
        let weights = dir.join(ADAPTER_WEIGHTS);
        if !weights.is_file() {
            return Ok(None);
        }
        let config_path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            audit_err(AuditError::Io {
                path: config_path.display().to_string(),
                source: e,
            })
        })?;
        let file = UnparsedSafetensors::open(&weights)
            .and_then(|u| u.parse())
            .map_err(audit_err)?;
        let mut report =
            audit_header(&dir.display().to_string(), &text, file.infos(), &self.cfg, &self.opts).map_err(audit_err)?;
        if !dense_only(&report) {
            return Ok(None);
        }
        let sources = file_sources(&report, &file).map_err(audit_err)?;
        let plan = PackPlan::new(&self.layout, &sources).map_err(|source| PoolError::Image {
            adapter: name.to_string(),
            source,
        })?;
        let mut dense = self.device.alloc_pinned::<bf16>(self.layout.slot_bytes() / 2)?;
        match plan.fill(&self.layout, 0..self.layout.len(), dense.as_mut_slice()?) {
            Ok(()) => {}
            Err(ImageError::NonFinite {
                key,
                part,
                index,
                value,
            }) => {
                report.refuse(Refusal::non_finite(served_tensor(&report, key, part), index, value));
                return Err(audit_err(AuditError::Refused(Box::new(report))));
            }
            Err(source) => {
                return Err(PoolError::Image {
                    adapter: name.to_string(),
                    source,
                });
            }
        }
        Ok(Some(HostImage {
            dir: dir.to_path_buf(),
            stamp: stamp.clone(),
            dense,
            dense_pairs: plan.metas().to_vec(),
            experts: None,
            group_expert_deltas: report.group_expert_pairs > 0,
            has_overlay: false,
            overlay: HostOverlay::none(self.cfg.hidden_size),
            dora: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_dropped_worker_skips_the_requests_still_queued() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
        let cfg = ModelConfig::from_file(&fixtures.join("config.json")).unwrap();
        let opts = LoraOptions::default();
        let layout = SlotLayout::new(&cfg, opts.max_rank).unwrap();
        let tier = Arc::new(Mutex::new(HostTier::new(usize::MAX)));
        let prefetcher = Prefetcher::start(&Device::cpu(), &cfg, &opts, &layout, Arc::clone(&tier)).unwrap();
        let adapter = fixtures.join("demo_r4_plain");
        for i in 0..200 {
            prefetcher.request(&format!("p{i}"), &adapter).unwrap();
        }
        drop(prefetcher);
        let served = tier.lock().unwrap().view().names.len();
        assert!(served < 200, "the drop waited for all {served} requests");
    }
}
