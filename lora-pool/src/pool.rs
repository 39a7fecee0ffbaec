//! [`LoraPool`]: `max_loras` equal slots padded to `max_rank` in one device
//! allocation whose address never changes, per-(layer, module) PairEntry
//! tables the kernels read, an optional expert/router pool, and the
//! two-phase load and swap that keep every failure away from live slots.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use half::bf16;
use lora_audit::{
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, AuditError, AuditReport, HostOverlay, LoraOptions, PreparedAdapter,
    UnparsedSafetensors, audit_adapter, audit_header, prepare_adapter,
};
use lora_kernels::{
    Device, DeviceBuffer, LoraTarget, LoraWorkspace, OutputElem, PairEntry, RepackRegion, Rows, RowsMut, Segments,
    WorkspaceSpec, bgmv, one_adapter, repack, sgmv,
};
use lora_layout::{
    ExpertLayout, LoraModule, ModelConfig, MoeAdapterState, PairKey, SlotLayout, build_seq_slot_host,
    select_victim_slot,
};

use crate::companion::{NoCompanion, SlotCompanion};
use crate::error::PoolError;
use crate::expert::ExpertPool;
use crate::image::{PackPlan, PairMeta, SlotImage, dense_sources, expert_sources, file_sources};
use crate::lease::{SlotLease, SlotUse};
use crate::registry::{AdapterSlot, SlotRegistry};
use crate::staging::{Staging, StagingTuning};

/// The largest batch the pool's routing buffers and scratch serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchCapacity {
    /// Most rows (tokens) in one apply call.
    pub max_rows: usize,
    /// Most segments (sequences) in one prefill call.
    pub max_segments: usize,
}

impl Default for BatchCapacity {
    fn default() -> BatchCapacity {
        BatchCapacity {
            max_rows: 8192,
            max_segments: 256,
        }
    }
}

/// An adapter to load: its name in the pool and its PEFT directory.
#[derive(Debug, Clone, Copy)]
pub struct AdapterSource<'a> {
    /// The name requests use.
    pub name: &'a str,
    /// The directory holding `adapter_config.json` and the weights.
    pub dir: &'a Path,
}

/// What a load or swap did.
#[derive(Debug, Clone, PartialEq)]
pub struct SwapReport {
    /// The slot written.
    pub slot: usize,
    /// The adapter now in it.
    pub name: String,
    /// Its new generation.
    pub generation: u64,
    /// Its identity hash (changes with every write into the slot).
    pub adapter_id: u64,
    /// Dense pairs written.
    pub dense_pairs: usize,
    /// Expert and router pairs written.
    pub expert_pairs: usize,
    /// Host time of the stage phase (audit, read, pack, copies issued),
    /// microseconds; 0 for a publish of landed images.
    pub stage_us: f64,
    /// The part of `stage_us` spent opening the weights' header and
    /// auditing it (disk swaps only; 0 otherwise). On the device-repack
    /// route the audit runs beside the file's copy.
    pub audit_us: f64,
    /// How the dense pairs reached the slot.
    pub route: SwapRoute,
    /// Host time of the publish phase (slot copy, tables, bookkeeping),
    /// microseconds. Device copies may still be running when it returns.
    pub publish_us: f64,
}

/// How a load or swap brought an adapter's dense pairs into its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapRoute {
    /// The file's data section copied to the device as it is while the
    /// header was audited, then placed by one device repack.
    DeviceRepack,
    /// Each tensor read from the file into its padded place in pinned
    /// chunks on the host, then copied.
    HostPack,
    /// Prepared in full on the host first (expert pairs, token overlays, or
    /// a caller's prepared adapter), then packed.
    Prepared,
    /// Images landed from a peer.
    Landed,
}

/// One module of an apply call and where its outputs start in y.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModuleTarget {
    /// The module.
    pub module: LoraModule,
    /// First column of y it writes.
    pub y_col_offset: usize,
}

/// An adapter staged off to the side: everything a publish writes, checked.
struct Staged<S> {
    name: String,
    route: SwapRoute,
    dense: DenseSource,
    dense_pairs: Vec<PairMeta>,
    experts: Option<(ExpertLayout, SlotImage)>,
    companion: Option<S>,
    has_overlay: bool,
}

/// Where a staged adapter's dense slot image is.
enum DenseSource {
    /// Packed and uploaded into the pool's device staging slot.
    Staging,
    /// A file's data section copied as it is into the device staging slot
    /// (its first `bytes` bytes), placed by `regions` (offsets within a slot).
    Raw { regions: Vec<RepackRegion>, bytes: usize },
    /// A landed image.
    Image(SlotImage),
}

/// The slot pool.
pub struct LoraPool<C: SlotCompanion = NoCompanion> {
    device: Device,
    cfg: ModelConfig,
    opts: LoraOptions,
    layout: SlotLayout,
    weights: DeviceBuffer<bf16>,
    table: DeviceBuffer<PairEntry>,
    host_table: Vec<PairEntry>,
    experts: Option<ExpertPool>,
    registry: SlotRegistry,
    uses: Arc<SlotUse>,
    companion: C,
    capacity: BatchCapacity,
    seq_slot: DeviceBuffer<i32>,
    decode_rows: usize,
    cu_seqlens: DeviceBuffer<i32>,
    seg_slot: DeviceBuffer<i32>,
    segments: usize,
    prefill_rows: usize,
    workspace: LoraWorkspace,
    staging: Staging,
}

fn audit_err(adapter: &str) -> impl FnOnce(lora_audit::AuditError) -> PoolError + '_ {
    move |e| PoolError::Audit {
        adapter: adapter.to_string(),
        source: Box::new(e),
    }
}

fn image_err(adapter: &str) -> impl Fn(crate::image::ImageError) -> PoolError + Copy + Sync + '_ {
    move |e| PoolError::Image {
        adapter: adapter.to_string(),
        source: e,
    }
}

fn mul(a: usize, b: usize, what: &'static str) -> Result<usize, PoolError> {
    a.checked_mul(b)
        .ok_or(PoolError::Layout(lora_layout::LayoutError::Overflow { what }))
}

impl LoraPool<NoCompanion> {
    /// An empty pool (every slot a placeholder) for `cfg` on `device`.
    pub fn new(
        device: &Device,
        cfg: ModelConfig,
        opts: LoraOptions,
        capacity: BatchCapacity,
    ) -> Result<LoraPool<NoCompanion>, PoolError> {
        LoraPool::with_companion(device, cfg, opts, capacity, NoCompanion, 0)
    }

    /// Startup load: audit each adapter, size the expert pool from them
    /// (unless `opts.expert_slot_bytes` fixes it), check the memory the pool
    /// needs against the device's free memory, pack adapter `k` into slot
    /// `k`, and build the tables. Slots past the adapters stay empty.
    pub fn load(
        device: &Device,
        cfg: ModelConfig,
        opts: LoraOptions,
        capacity: BatchCapacity,
        adapters: &[AdapterSource<'_>],
    ) -> Result<LoraPool<NoCompanion>, PoolError> {
        LoraPool::load_with_companion(device, cfg, opts, capacity, adapters, NoCompanion)
    }
}

impl<C: SlotCompanion> LoraPool<C> {
    /// [`LoraPool::new`] with a slot companion (e.g. token overlays) and an
    /// expert slot size in bytes (used when the model is MoE, experts are
    /// enabled, and `opts.expert_slot_bytes` is unset).
    pub fn with_companion(
        device: &Device,
        cfg: ModelConfig,
        opts: LoraOptions,
        capacity: BatchCapacity,
        companion: C,
        expert_slot_bytes: usize,
    ) -> Result<LoraPool<C>, PoolError> {
        if opts.max_loras == 0 {
            return Err(PoolError::TooManyAdapters {
                adapters: 0,
                max_loras: 0,
            });
        }
        let layout = SlotLayout::new(&cfg, opts.max_rank)?;
        let slot_elems = layout.slot_bytes() / 2;
        let pool_elems = mul(slot_elems, opts.max_loras, "pool")?;
        let table_len = mul(
            mul(cfg.num_hidden_layers, LoraModule::ALL.len(), "tables")?,
            opts.max_loras,
            "tables",
        )?;
        let expert_bytes = opts.expert_slot_bytes.unwrap_or(expert_slot_bytes);
        let serve_experts = opts.experts && cfg.moe.is_some();
        let ws_spec = WorkspaceSpec {
            max_rows: capacity.max_rows,
            max_rank: opts.max_rank,
            max_segments: capacity.max_segments,
            max_targets: lora_kernels::MAX_TARGETS,
        };
        let needed = [
            mul(pool_elems, 2, "pool")?,
            // The device staging slot.
            layout.slot_bytes(),
            mul(table_len, std::mem::size_of::<PairEntry>(), "tables")?,
            if serve_experts {
                mul(expert_bytes.div_ceil(16) * 16, opts.max_loras, "expert pool")?
                    .saturating_add(ExpertPool::table_len(&cfg, opts.max_loras)? * std::mem::size_of::<PairEntry>())
            } else {
                0
            },
            (2 * capacity.max_rows + 2 * capacity.max_segments + 1) * 4,
            // Workspace: targets x k-splits x rows x padded rank, f32.
            lora_kernels::MAX_TARGETS * 4 * capacity.max_rows * opts.max_rank.div_ceil(16) * 16 * 4,
        ]
        .iter()
        .try_fold(0usize, |acc, b| acc.checked_add(*b))
        .ok_or(PoolError::Layout(lora_layout::LayoutError::Overflow {
            what: "pool bytes",
        }))?;
        let (free, _) = device.memory_info()?;
        if needed > free {
            return Err(PoolError::OutOfMemory { needed, free });
        }
        let experts = if serve_experts {
            Some(ExpertPool::new(
                device,
                &cfg,
                opts.max_loras,
                opts.expert_rank,
                expert_bytes,
            )?)
        } else {
            None
        };
        Ok(LoraPool {
            device: device.clone(),
            registry: SlotRegistry::new(opts.max_loras, opts.pinned),
            uses: SlotUse::new(opts.max_loras),
            weights: device.alloc_zeros(pool_elems)?,
            table: device.alloc_zeros(table_len)?,
            host_table: vec![PairEntry::default(); table_len],
            experts,
            companion,
            capacity,
            seq_slot: device.upload(&vec![-1i32; capacity.max_rows.max(1)])?,
            decode_rows: 0,
            cu_seqlens: device.alloc_zeros(capacity.max_segments + 1)?,
            seg_slot: device.alloc_zeros(capacity.max_segments.max(1))?,
            segments: 0,
            prefill_rows: 0,
            workspace: LoraWorkspace::new(device, ws_spec)?,
            staging: Staging::new(device, &layout, StagingTuning::default())?,
            layout,
            cfg,
            opts,
        })
    }

    /// [`LoraPool::load`] with a slot companion.
    pub fn load_with_companion(
        device: &Device,
        cfg: ModelConfig,
        opts: LoraOptions,
        capacity: BatchCapacity,
        adapters: &[AdapterSource<'_>],
        companion: C,
    ) -> Result<LoraPool<C>, PoolError> {
        if adapters.len() > opts.max_loras {
            return Err(PoolError::TooManyAdapters {
                adapters: adapters.len(),
                max_loras: opts.max_loras,
            });
        }
        check_unique_names(adapters)?;
        // The audit alone sizes the expert pool; the tensors are read once,
        // when each adapter is staged.
        let expert_bytes = adapters
            .iter()
            .map(|a| {
                let report = audit_adapter(a.dir, &cfg, &opts).map_err(audit_err(a.name))?;
                Ok(if report.is_servable() { report.expert_bytes } else { 0 })
            })
            .collect::<Result<Vec<usize>, PoolError>>()?
            .into_iter()
            .max()
            .unwrap_or(0);
        let mut pool = LoraPool::with_companion(device, cfg, opts, capacity, companion, expert_bytes)?;
        for (slot, src) in adapters.iter().enumerate() {
            let (staged, _) = pool.stage_from_dir(src.name, src.dir)?;
            pool.publish(slot, staged)?;
        }
        Ok(pool)
    }

    /// The device the pool lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The model geometry.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The options the pool was built with.
    pub fn options(&self) -> &LoraOptions {
        &self.opts
    }

    /// The slot layout (the one walk).
    pub fn layout(&self) -> &SlotLayout {
        &self.layout
    }

    /// The slots and their adapters.
    pub fn slots(&self) -> &[AdapterSlot] {
        self.registry.slots()
    }

    /// The slot holding `name`.
    pub fn slot_of(&self, name: &str) -> Option<usize> {
        self.registry.slot_of(name)
    }

    /// The expert/router pool, when the pool serves experts.
    pub fn experts(&self) -> Option<&ExpertPool> {
        self.experts.as_ref()
    }

    /// The slot companion.
    pub fn companion(&self) -> &C {
        &self.companion
    }

    /// The slot companion, mutably (its own apply calls may need it).
    pub fn companion_mut(&mut self) -> &mut C {
        &mut self.companion
    }

    /// The device address of the slot pool (never changes).
    pub fn pool_addr(&self) -> u64 {
        self.weights.device_addr()
    }

    /// The PairEntry table buffer (never moves).
    pub fn table(&self) -> &DeviceBuffer<PairEntry> {
        &self.table
    }

    /// First entry of (layer, module)'s `[max_loras]` table.
    pub fn table_offset(&self, layer: usize, module: LoraModule) -> Option<usize> {
        self.layout.entry(layer, module)?;
        Some((layer * LoraModule::ALL.len() + module.index()) * self.opts.max_loras)
    }

    /// The table entry of (layer, module) in `slot`, as last published.
    pub fn entry(&self, layer: usize, module: LoraModule, slot: usize) -> Option<PairEntry> {
        if slot >= self.opts.max_loras {
            return None;
        }
        self.host_table.get(self.table_offset(layer, module)? + slot).copied()
    }

    /// The bytes of slot `slot`, read back from the device.
    pub fn slot_contents(&self, slot: usize) -> Result<Vec<bf16>, PoolError> {
        self.check_slot(slot)?;
        let elems = self.layout.slot_bytes() / 2;
        Ok(self.weights.download_range(slot * elems, elems)?)
    }

    /// The per-row slot buffer of the current decode batch (`i32`, `-1` =
    /// no delta); its address never changes.
    pub fn seq_slot(&self) -> &DeviceBuffer<i32> {
        &self.seq_slot
    }

    /// Rows of the current decode batch.
    pub fn decode_rows(&self) -> usize {
        self.decode_rows
    }

    /// The MoE state of the adapter in `slot`, for
    /// `lora_layout::resolve_moe_lora_route`.
    pub fn moe_state(&self, slot: usize) -> Option<MoeAdapterState> {
        let s = self.registry.get(slot).filter(|s| s.is_filled())?;
        Some(MoeAdapterState {
            has_expert_deltas: s.has_expert_deltas(),
            expert_slot: (s.has_expert_deltas() && self.experts.is_some()).then_some(slot),
        })
    }

    /// Take a lease on the slot holding `name`: the slot is not overwritten
    /// while the lease lives.
    pub fn acquire(&self, name: &str) -> Result<SlotLease, PoolError> {
        let slot = self
            .registry
            .slot_of(name)
            .ok_or_else(|| PoolError::NotResident(name.to_string()))?;
        let id = self.registry.get(slot).map_or(0, AdapterSlot::adapter_id);
        Ok(SlotLease::take(&self.uses, slot, id))
    }

    /// Live leases on `slot`.
    pub fn ref_count(&self, slot: usize) -> u32 {
        self.uses.ref_count(slot)
    }

    fn check_slot(&self, slot: usize) -> Result<(), PoolError> {
        if slot >= self.opts.max_loras {
            return Err(PoolError::NoSuchSlot {
                slot,
                max_loras: self.opts.max_loras,
            });
        }
        Ok(())
    }

    fn check_idle(&self, slot: usize) -> Result<(), PoolError> {
        self.check_slot(slot)?;
        match self.uses.ref_count(slot) {
            0 => Ok(()),
            leases => Err(PoolError::SlotInUse { slot, leases }),
        }
    }

    /// Disk swap: audit and convert the adapter in `dir`, stage it, then
    /// write it into `slot` (zeroing the rank padding), refresh the slot's
    /// table entries, and bump its generation. Any failure — unreadable
    /// files, a refused adapter, a rank over `max_rank`, no memory, a slot in
    /// use — leaves every slot serving what it served, bit for bit.
    pub fn swap_from_disk(&mut self, slot: usize, name: &str, dir: &Path) -> Result<SwapReport, PoolError> {
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_idle(slot)?;
        self.check_name_free(name, Some(slot))?;
        let started = std::time::Instant::now();
        let (staged, audit_us) = self.stage_from_dir(name, dir)?;
        let stage_us = started.elapsed().as_secs_f64() * 1e6;
        let mut report = self.publish(slot, staged)?;
        report.stage_us = stage_us;
        report.audit_us = audit_us;
        Ok(report)
    }

    /// Tune the swap path for the host at hand: the host side is cut into
    /// pinned chunks, each copied to the device as soon as it is filled
    /// (smaller chunks start the copies sooner, each copy then carries more
    /// fixed cost), and a dense adapter whose data section fits the device
    /// staging slot may go there as it is and be placed by a device repack.
    /// What ends up in a slot is the same on every setting.
    pub fn tune_staging(&mut self, tuning: StagingTuning) -> Result<(), PoolError> {
        self.device.synchronize()?;
        self.staging.retune(&self.device, &self.layout, tuning)
    }

    /// Number of pinned staging chunks the swap path uses.
    pub fn staging_chunks(&self) -> usize {
        self.staging.chunk_count()
    }

    /// [`LoraPool::swap_from_disk`] for an adapter already prepared.
    pub fn swap_prepared(
        &mut self,
        slot: usize,
        name: &str,
        adapter: &PreparedAdapter,
    ) -> Result<SwapReport, PoolError> {
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_idle(slot)?;
        self.check_name_free(name, Some(slot))?;
        let staged = self.stage(name, adapter)?;
        self.publish(slot, staged)
    }

    /// Make `name` resident and lease it: its slot if it is already there,
    /// else a victim among the promotion slots `[pinned, max_loras)` (the
    /// first empty one, else the least recently used idle one), loaded from
    /// `dir`. `PoolFull` when every candidate is in use.
    pub fn promote(&mut self, name: &str, dir: &Path) -> Result<SlotLease, PoolError> {
        if self.registry.slot_of(name).is_some() {
            return self.acquire(name);
        }
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        let victim = self.pick_victim(name)?;
        self.swap_from_disk(victim, name, dir)?;
        self.acquire(name)
    }

    /// The promotion victim for `name`, by `select_victim_slot`.
    pub fn pick_victim(&self, name: &str) -> Result<usize, PoolError> {
        let views = self.registry.cache_slot_views(&self.uses);
        select_victim_slot(&views).map_err(|source| PoolError::PoolFull {
            adapter: name.to_string(),
            source,
        })
    }

    /// Empty `slot`: zero its bytes and tables and bump its generation.
    pub fn evict(&mut self, slot: usize) -> Result<(), PoolError> {
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_idle(slot)?;
        let elems = self.layout.slot_bytes() / 2;
        self.weights.zero_range(slot * elems, elems)?;
        self.clear_table_entries(slot);
        self.table.write(0, &self.host_table)?;
        if let Some(experts) = &mut self.experts {
            experts.clear(slot)?;
        }
        self.companion.clear(slot)?;
        self.registry.clear(slot);
        Ok(())
    }

    /// Publish images landed from a peer into `slot`: `dense` over the slot
    /// layout, `experts` over its expert layout. The caller checked every
    /// landed byte; nothing is read from a peer here.
    pub fn publish_landed(
        &mut self,
        slot: usize,
        name: &str,
        dense: SlotImage,
        experts: Option<(ExpertLayout, SlotImage)>,
    ) -> Result<SwapReport, PoolError> {
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_idle(slot)?;
        self.check_name_free(name, Some(slot))?;
        if name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        if dense.as_elems().len() != self.layout.slot_bytes() / 2 {
            return Err(image_err(name)(crate::image::ImageError::Destination {
                got: dense.as_elems().len(),
                expected: self.layout.slot_bytes() / 2,
            }));
        }
        if let Some((layout, _)) = &experts {
            let pool = self
                .experts
                .as_ref()
                .ok_or_else(|| PoolError::NoExpertPool(name.to_string()))?;
            pool.check_fits(name, layout)?;
        }
        let staged = Staged {
            name: name.to_string(),
            route: SwapRoute::Landed,
            dense_pairs: dense.pairs().to_vec(),
            dense: DenseSource::Image(dense),
            experts,
            companion: None,
            has_overlay: false,
        };
        self.publish(slot, staged)
    }

    fn check_name_free(&self, name: &str, slot: Option<usize>) -> Result<(), PoolError> {
        if name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        match self.registry.slot_of(name) {
            Some(s) if Some(s) != slot => Err(PoolError::DuplicateName(name.to_string())),
            _ => Ok(()),
        }
    }

    /// Phase one from an adapter directory; also returns the audit's host
    /// time, µs. An adapter of dense pairs only goes straight from its file:
    /// when its data section fits the device staging slot, the section is
    /// copied there as it is while another thread parses and audits the
    /// header, and publish places every tensor with one device repack;
    /// otherwise each tensor is read into its padded place in the pinned
    /// chunks. One with expert pairs or token overlays goes through
    /// `prepare_adapter`, which splits fused experts and compiles overlays.
    fn stage_from_dir(&mut self, name: &str, dir: &Path) -> Result<(Staged<C::Staged>, f64), PoolError> {
        if name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        let started = std::time::Instant::now();
        let since = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e6;
        let weights = dir.join(ADAPTER_WEIGHTS);
        if !weights.is_file() {
            // A pickle, or no weights: the full audit's verdict.
            let report = audit_adapter(dir, &self.cfg, &self.opts).map_err(audit_err(name))?;
            let audit_us = since(started);
            return Ok((self.stage_prepared(name, dir, report)?, audit_us));
        }
        let unparsed = UnparsedSafetensors::open(&weights).map_err(audit_err(name))?;
        let config_path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&config_path).map_err(|e| {
            audit_err(name)(AuditError::Io {
                path: config_path.display().to_string(),
                source: e,
            })
        })?;
        let raw_len = usize::try_from(unparsed.data_len()).unwrap_or(usize::MAX);
        let raw = self.staging.takes_raw(raw_len);
        let shown = dir.display().to_string();
        let (cfg, opts) = (&self.cfg, &self.opts);
        let audit = || {
            let file = unparsed.parse()?;
            let report = audit_header(&shown, &text, file.infos(), cfg, opts)?;
            Ok::<_, AuditError>((file, report, since(started)))
        };
        let (audited, read) = if raw {
            let stop = AtomicBool::new(false);
            std::thread::scope(|scope| {
                let auditor = scope.spawn(|| {
                    let audited = audit();
                    if !matches!(&audited, Ok((_, report, _)) if dense_only(report)) {
                        stop.store(true, Ordering::Relaxed);
                    }
                    audited
                });
                let read = self.staging.read_raw(&unparsed, raw_len, &stop, name);
                match auditor.join() {
                    Ok(audited) => (audited, read),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            })
        } else {
            (audit(), Ok(()))
        };
        let (file, report, audit_us) = audited.map_err(audit_err(name))?;
        if !dense_only(&report) {
            return Ok((self.stage_prepared(name, dir, report)?, audit_us));
        }
        read?;
        let sources = file_sources(&report.placed, &file).map_err(audit_err(name))?;
        let plan = PackPlan::new(&self.layout, &sources).map_err(image_err(name))?;
        let companion = self.companion.stage(name, &HostOverlay::none(self.cfg.hidden_size))?;
        let regions = if raw {
            plan.repack_regions(&self.layout, &file)
        } else {
            None
        };
        let (dense, route) = match regions {
            Some(regions) => (
                DenseSource::Raw {
                    regions,
                    bytes: raw_len,
                },
                SwapRoute::DeviceRepack,
            ),
            None => {
                self.staging.pack_and_upload(&self.layout, &plan, image_err(name))?;
                (DenseSource::Staging, SwapRoute::HostPack)
            }
        };
        let staged = Staged {
            name: name.to_string(),
            route,
            dense,
            dense_pairs: plan.metas().to_vec(),
            experts: None,
            companion: Some(companion),
            has_overlay: false,
        };
        Ok((staged, audit_us))
    }

    /// An audited adapter that is not dense-only: refused, or prepared in
    /// full (experts split, overlays compiled) and staged.
    fn stage_prepared(&mut self, name: &str, dir: &Path, report: AuditReport) -> Result<Staged<C::Staged>, PoolError> {
        if !report.is_servable() {
            return Err(audit_err(name)(AuditError::Refused(Box::new(report))));
        }
        let prepared = prepare_adapter(dir, &self.cfg, &self.opts).map_err(audit_err(name))?;
        self.stage(name, &prepared)
    }

    /// Phase one: check and build everything off to the side. Writes only
    /// the staging buffer and the companion's staged state.
    fn stage(&mut self, name: &str, adapter: &PreparedAdapter) -> Result<Staged<C::Staged>, PoolError> {
        if name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        let experts = if adapter.experts.is_empty() {
            None
        } else {
            let pool = self
                .experts
                .as_ref()
                .ok_or_else(|| PoolError::NoExpertPool(name.to_string()))?;
            let sites = adapter.experts.iter().map(|p| (p.layer, p.site));
            let layout = ExpertLayout::new(&self.cfg, self.opts.expert_rank, sites)?;
            pool.check_fits(name, &layout)?;
            let sources = expert_sources(adapter);
            let image = SlotImage::pack(&layout, &sources).map_err(image_err(name))?;
            Some((layout, image))
        };
        let sources = dense_sources(adapter);
        let plan = PackPlan::new(&self.layout, &sources).map_err(image_err(name))?;
        let companion = self.companion.stage(name, &adapter.overlay)?;
        self.staging.pack_and_upload(&self.layout, &plan, image_err(name))?;
        let dense_pairs = plan.metas().to_vec();
        Ok(Staged {
            name: name.to_string(),
            route: SwapRoute::Prepared,
            dense: DenseSource::Staging,
            dense_pairs,
            experts,
            companion: Some(companion),
            has_overlay: !adapter.overlay.is_empty(),
        })
    }

    /// Phase two: write the staged adapter into `slot` and make it live.
    /// Only device failures can stop it now.
    fn publish(&mut self, slot: usize, mut staged: Staged<C::Staged>) -> Result<SwapReport, PoolError> {
        let started = std::time::Instant::now();
        self.check_idle(slot)?;
        let elems = self.layout.slot_bytes() / 2;
        let base = slot * elems;
        match &mut staged.dense {
            DenseSource::Staging => self.weights.copy_from(base, &self.staging.device, 0, elems)?,
            DenseSource::Raw { regions, bytes } => {
                // The plan places regions in a slot of its own; this slot starts at `base`.
                for r in regions.iter_mut() {
                    r.dst_elem += base as u64;
                }
                repack(
                    &self.device,
                    &self.staging.device,
                    *bytes,
                    regions,
                    &mut self.staging.regions,
                    &mut self.weights,
                )?;
            }
            DenseSource::Image(image) => self.weights.write(base, image.as_elems())?,
        }
        self.clear_table_entries(slot);
        let base_addr = self.weights.addr_at(base)?;
        for meta in &staged.dense_pairs {
            let PairKey::Dense { layer, module } = meta.key else {
                continue;
            };
            let (Some(place), Some(offset)) = (self.layout.entry(layer, module), self.table_offset(layer, module))
            else {
                continue;
            };
            self.host_table[offset + slot] = PairEntry {
                a: base_addr + place.a_offset as u64,
                b: base_addr + place.b_offset as u64,
                scale: meta.scale,
                rank: meta.rank as u32,
            };
        }
        self.table.write(0, &self.host_table)?;
        let mut expert_pairs = Vec::new();
        if let Some(pool) = &mut self.experts {
            match &staged.experts {
                Some((layout, image)) => {
                    pool.publish(slot, layout, image.as_elems(), image.pairs())?;
                    expert_pairs = image.pairs().to_vec();
                }
                None => pool.clear(slot)?,
            }
        }
        match staged.companion {
            Some(c) => self.companion.commit(slot, c)?,
            None => self.companion.clear(slot)?,
        }
        let next = AdapterSlot {
            name: staged.name.clone(),
            generation: 0,
            pairs: staged.dense_pairs.clone(),
            expert_pairs,
            has_overlay: staged.has_overlay,
        };
        let generation = self.registry.publish(slot, next).unwrap_or(0);
        self.uses.touch(slot);
        let s = &self.registry.slots()[slot];
        Ok(SwapReport {
            slot,
            name: staged.name,
            generation,
            adapter_id: s.adapter_id(),
            dense_pairs: s.pairs.len(),
            expert_pairs: s.expert_pairs.len(),
            stage_us: 0.0,
            audit_us: 0.0,
            route: staged.route,
            publish_us: started.elapsed().as_secs_f64() * 1e6,
        })
    }

    fn clear_table_entries(&mut self, slot: usize) {
        let n = self.opts.max_loras;
        for i in (slot..self.host_table.len()).step_by(n) {
            self.host_table[i] = PairEntry::default();
        }
    }

    /// Set the rows of the next decode batch: one slot per row, `-1` for a
    /// row served by the base model; rows past `slots.len()` up to
    /// `padded_rows` are padding (`-1`). Every named slot must hold an
    /// adapter: a request never runs without its adapter silently.
    pub fn set_decode_rows(&mut self, slots: &[i32], padded_rows: usize) -> Result<(), PoolError> {
        if padded_rows > self.capacity.max_rows || slots.len() > padded_rows {
            return Err(PoolError::BatchTooLarge {
                what: "decode rows",
                got: padded_rows.max(slots.len()),
                capacity: self.capacity.max_rows,
            });
        }
        for (row, &slot) in slots.iter().enumerate() {
            self.check_row_slot(row, slot)?;
        }
        let rows = build_seq_slot_host(slots, padded_rows, -1);
        self.seq_slot.write(0, &rows)?;
        self.decode_rows = padded_rows;
        Ok(())
    }

    fn check_row_slot(&self, row: usize, slot: i32) -> Result<(), PoolError> {
        if slot < -1 {
            return Err(PoolError::Batch(format!(
                "row {row}: slot {slot} (use -1 for the base model)"
            )));
        }
        if slot >= 0 {
            let filled = self.registry.get(slot as usize).is_some_and(AdapterSlot::is_filled);
            if !filled {
                return Err(PoolError::EmptySlot { row, slot });
            }
        }
        Ok(())
    }

    /// Set the segments of the next prefill batch: `cu_seqlens` is the
    /// `[n + 1]` prefix sum of the sequence lengths, `slots[i]` the slot of
    /// sequence `i` (`-1`: base model).
    pub fn set_prefill_segments(&mut self, cu_seqlens: &[usize], slots: &[i32]) -> Result<(), PoolError> {
        if slots.len() > self.capacity.max_segments {
            return Err(PoolError::BatchTooLarge {
                what: "prefill segments",
                got: slots.len(),
                capacity: self.capacity.max_segments,
            });
        }
        if cu_seqlens.len() != slots.len() + 1 || cu_seqlens.first() != Some(&0) {
            return Err(PoolError::Batch(format!(
                "cu_seqlens must be a prefix sum from 0 with {} entries",
                slots.len() + 1
            )));
        }
        if cu_seqlens.windows(2).any(|w| w[1] < w[0]) {
            return Err(PoolError::Batch("cu_seqlens decreases".into()));
        }
        let total = cu_seqlens[slots.len()];
        if total > self.capacity.max_rows {
            return Err(PoolError::BatchTooLarge {
                what: "prefill rows",
                got: total,
                capacity: self.capacity.max_rows,
            });
        }
        for (seq, &slot) in slots.iter().enumerate() {
            self.check_row_slot(seq, slot)?;
        }
        let cu: Vec<i32> = cu_seqlens.iter().map(|&c| c as i32).collect();
        self.cu_seqlens.write(0, &cu)?;
        self.seg_slot.write(0, slots)?;
        self.segments = slots.len();
        self.prefill_rows = total;
        Ok(())
    }

    fn check_inputs(&self, layer: usize, modules: &[ModuleTarget], x_width: usize) -> Result<(), PoolError> {
        for m in modules {
            let entry = self.layout.entry(layer, m.module).ok_or(PoolError::NoSuchModule {
                layer,
                module: m.module,
            })?;
            if entry.in_dim != x_width {
                return Err(PoolError::Batch(format!(
                    "layer {layer} {}: x rows are {x_width} wide, the module takes {}",
                    m.module, entry.in_dim
                )));
            }
        }
        Ok(())
    }

    /// Decode apply: `y[row, cols of module] += scale · B (A x[row])` for
    /// each row's slot (set by [`LoraPool::set_decode_rows`]) and each module
    /// (which share the input x), in one launch. Graph-capturable.
    pub fn apply_decode<Y: OutputElem>(
        &self,
        layer: usize,
        modules: &[ModuleTarget],
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        self.check_inputs(layer, modules, x.width)?;
        if x.n_rows != self.decode_rows {
            return Err(PoolError::Batch(format!(
                "x has {} rows, the decode batch {}",
                x.n_rows, self.decode_rows
            )));
        }
        let targets = targets(&self.table, &self.layout, self.opts.max_loras, layer, modules)?;
        bgmv(&self.device, x, &self.seq_slot, &targets, self.opts.max_rank, y)?;
        Ok(())
    }

    /// Prefill apply over the segments set by
    /// [`LoraPool::set_prefill_segments`]. Graph-capturable.
    pub fn apply_prefill<Y: OutputElem>(
        &mut self,
        layer: usize,
        modules: &[ModuleTarget],
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        self.check_inputs(layer, modules, x.width)?;
        if x.n_rows != self.prefill_rows {
            return Err(PoolError::Batch(format!(
                "x has {} rows, the prefill batch {}",
                x.n_rows, self.prefill_rows
            )));
        }
        let segments = Segments {
            cu_seqlens: &self.cu_seqlens,
            seg_slot: &self.seg_slot,
            n_segments: self.segments,
        };
        let targets = targets(&self.table, &self.layout, self.opts.max_loras, layer, modules)?;
        sgmv(
            &self.device,
            x,
            &segments,
            &targets,
            self.opts.max_rank,
            y,
            &mut self.workspace,
        )?;
        Ok(())
    }

    /// One-adapter prefill: every row of x takes `slot`'s pair.
    pub fn apply_one_adapter<Y: OutputElem>(
        &mut self,
        slot: usize,
        layer: usize,
        modules: &[ModuleTarget],
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        self.check_inputs(layer, modules, x.width)?;
        self.check_row_slot(0, i32::try_from(slot).unwrap_or(i32::MAX))?;
        self.check_slot(slot)?;
        let targets = targets(&self.table, &self.layout, self.opts.max_loras, layer, modules)?;
        one_adapter(
            &self.device,
            x,
            slot,
            &targets,
            self.opts.max_rank,
            y,
            &mut self.workspace,
        )?;
        Ok(())
    }
}

/// The kernel targets of `modules` at `layer`: each module's `[max_loras]`
/// range of the pool's table.
fn targets<'t>(
    table: &'t DeviceBuffer<PairEntry>,
    layout: &SlotLayout,
    max_loras: usize,
    layer: usize,
    modules: &[ModuleTarget],
) -> Result<Vec<LoraTarget<'t>>, PoolError> {
    modules
        .iter()
        .map(|m| {
            let entry = layout.entry(layer, m.module).ok_or(PoolError::NoSuchModule {
                layer,
                module: m.module,
            })?;
            Ok(LoraTarget {
                table,
                table_offset: (layer * LoraModule::ALL.len() + m.module.index()) * max_loras,
                n_entries: max_loras,
                out_dim: entry.out_dim,
                y_col_offset: m.y_col_offset,
            })
        })
        .collect()
}

/// Whether an audit lets the adapter go straight from its file: servable,
/// and dense pairs only.
fn dense_only(report: &AuditReport) -> bool {
    report.is_servable() && report.experts.is_empty() && report.overlay.is_empty()
}

fn check_unique_names(adapters: &[AdapterSource<'_>]) -> Result<(), PoolError> {
    for (i, a) in adapters.iter().enumerate() {
        if a.name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        if adapters[..i].iter().any(|b| b.name == a.name) {
            return Err(PoolError::DuplicateName(a.name.to_string()));
        }
    }
    Ok(())
}
