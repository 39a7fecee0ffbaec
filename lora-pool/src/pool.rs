//! [`LoraPool`]: `max_loras` equal slots padded to `max_rank` in one device
//! allocation whose address never changes, per-(layer, module) PairEntry
//! tables the kernels read, an optional expert/router pool, and the
//! two-phase load and swap that keep every failure away from live slots.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use half::bf16;
use lora_audit::{
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, AuditError, AuditReport, HostOverlay, LoraOptions, PreparedAdapter, Refusal,
    UnparsedSafetensors, audit_adapter, audit_header, prepare_adapter,
};
use lora_kernels::{
    DecodeOptions, DecodePlan, Device, DeviceBuffer, Lane, LoraTarget, LoraWorkspace, OutputElem, PairEntry, RankPart,
    RepackRegion, Rows, RowsMut, Segments, ValueScan, WorkspaceSpec, bgmv_candidates, bgmv_plan, bgmv_with,
    one_adapter, repack_if_finite, sgmv,
};
use lora_layout::{
    ExpertLayout, LoraModule, ModelConfig, MoeAdapterState, MoeLoraRoute, PairKey, ShardKind, SlotLayout,
    resolve_moe_lora_route, select_victim_slot,
};

use crate::companion::{NoCompanion, SlotCompanion};
use crate::error::PoolError;
use crate::expert::ExpertPool;
use crate::gather::RankGather;
use crate::host_tier::{HostImage, HostTier};
use crate::image::{ImageError, PackPlan, PairMeta, PairPart, SlotImage, dense_sources, expert_sources, file_sources};
use crate::lease::{SlotLease, SlotUse};
use crate::prefetch::{PrefetchEvent, Prefetcher};
use crate::registry::{AdapterSlot, SlotRegistry};
use crate::slot::{RowSlot, SlotId};
use crate::staging::{Staging, StagingTuning};
use crate::step::{DecodeStep, PrefillSeq, PrefillStep, Step, StepKind, StepRow, StepRows, StepSlots, sealed::Sealed};
use crate::target::FusedTargets;

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
    pub slot: SlotId,
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
    /// Dense pairs written as DoRA pairs (their rescale with them).
    pub dora_pairs: usize,
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
    /// A packed image of the host tier, copied as it is: no read, audit or
    /// parse (a DoRA adapter's goes through the device staging slot, where
    /// its rescale is computed from it).
    HostTier,
}

/// What a peer landing hands [`LoraPool::publish_landed`]: the landed
/// images, checked by the caller, and what the pool needs beside them.
#[derive(Debug, Clone)]
pub struct LandedImages {
    /// The dense image, over the pool's slot layout.
    pub dense: SlotImage,
    /// The expert image over its expert layout (`None`: no expert or
    /// router pair on this rank).
    pub experts: Option<(ExpertLayout, SlotImage)>,
    /// Whether the adapter has expert or router pairs on some rank of the
    /// expert-parallel group (this rank may hold none of them).
    pub group_expert_deltas: bool,
    /// A DoRA adapter's magnitudes (`None` for a plain adapter).
    pub dora: Option<crate::dora::DoraMagnitudes>,
}

impl LandedImages {
    /// A plain adapter's landed images.
    pub fn new(dense: SlotImage, experts: Option<(ExpertLayout, SlotImage)>) -> LandedImages {
        LandedImages {
            group_expert_deltas: experts.is_some(),
            dense,
            experts,
            dora: None,
        }
    }
}

/// An adapter staged off to the side: everything a publish writes, checked.
struct Staged<S> {
    name: String,
    route: SwapRoute,
    dense: DenseSource,
    dense_pairs: Vec<PairMeta>,
    experts: Option<Arc<(ExpertLayout, SlotImage)>>,
    /// Expert or router pairs on some rank of the expert-parallel group
    /// (`AdapterSlot::group_expert_deltas`).
    group_expert_deltas: bool,
    companion: Option<S>,
    has_overlay: bool,
    /// DoRA pairs' rescales (written at publish; none clears the slot's).
    dora: Vec<crate::dora::StagedScale>,
}

/// Where a staged adapter's dense slot image is.
enum DenseSource {
    /// Packed and uploaded into the pool's device staging slot.
    Staging,
    /// A file's data section copied as it is into the device staging slot
    /// (its first `bytes` bytes), placed by `regions` (offsets within a
    /// slot) once `scan`, queued over the same regions, finds every value
    /// finite; `refusal` says what to refuse otherwise.
    Raw {
        regions: Vec<RepackRegion>,
        bytes: usize,
        scan: ValueScan,
        refusal: Box<ScanRefusal>,
    },
    /// A landed image.
    Image(SlotImage),
    /// A host-tier image (held until publish has queued its copy; the
    /// image's buffer outlives the copy).
    Host(Arc<HostImage>),
}

/// What a raw-route swap refuses when its value scan finds a value that is
/// not finite: the audit's report, and the pair each place of the plan
/// holds (regions `2p` and `2p + 1` are place `p`'s A and B). The tensor
/// names are looked up only for a refusal.
struct ScanRefusal {
    report: AuditReport,
    places: Vec<Option<PairKey>>,
}

impl ScanRefusal {
    /// The served tensor region `r` comes from.
    fn tensor(&self, r: usize) -> String {
        let part = if r.is_multiple_of(2) { PairPart::A } else { PairPart::B };
        match self.places.get(r / 2).copied().flatten() {
            Some(key) => served_tensor(&self.report, key, part),
            None => format!("place {}", r / 2),
        }
    }
}

/// The adapter tensor the audit placed as `part` of pair `key` (the key's
/// own name where the report holds no such pair).
pub(crate) fn served_tensor(report: &AuditReport, key: PairKey, part: PairPart) -> String {
    let embedding = report
        .embedding
        .as_ref()
        .filter(|_| key == PairKey::Embedding)
        .map(|e| (&e.a_key, &e.b_key));
    let head = report
        .lm_head
        .as_ref()
        .filter(|_| key == PairKey::LmHead)
        .map(|e| (&e.a_key, &e.b_key));
    report
        .placed
        .iter()
        .find(|p| {
            PairKey::Dense {
                layer: p.layer,
                module: p.module,
            } == key
        })
        .map(|p| (&p.a_key, &p.b_key))
        .or(embedding)
        .or(head)
        .map_or_else(
            || key.to_string(),
            |(a, b)| match part {
                PairPart::A => a.clone(),
                PairPart::B => b.clone(),
            },
        )
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
    /// DoRA rescales and base biases (`opts.dora` only).
    dora: Option<crate::dora::DoraState>,
    /// This pool's identity, so a step or lease of another pool is refused.
    id: u64,
    next_step: u64,
    /// The decode step the row buffer holds, and the slots it names.
    decode_current: Option<CurrentStep>,
    /// The prefill step the segment buffers hold, and the slots it names.
    prefill_current: Option<CurrentStep>,
    seq_slot: DeviceBuffer<i32>,
    cu_seqlens: DeviceBuffer<i32>,
    seg_slot: DeviceBuffer<i32>,
    /// Per prefill token: its sequence's slot (for companion kernels).
    prefill_row_slot: DeviceBuffer<i32>,
    /// Scratch of the prefill applies; behind a lock so that every apply
    /// takes `&self`.
    workspace: Mutex<LoraWorkspace>,
    /// The rank's shrink output and the gathered shrink outputs of the
    /// fully-sharded apply (the placement's fully-sharded option only).
    split: Option<Mutex<SplitScratch>>,
    staging: Staging,
    /// Packed images in pinned host memory (`host_tier_bytes` > 0), shared
    /// with the prefetch worker that fills it.
    tier: Option<Arc<Mutex<HostTier>>>,
    prefetcher: Option<Prefetcher>,
    /// A swap whose slot bytes are queued on the copy lane, not yet
    /// published ([`LoraPool::begin_swap`]).
    pending: Option<Pending<C::Staged>>,
}

/// The fully-sharded apply's buffers: the rank's shrink output `[max_rows,
/// MAX_TARGETS, max_rank / tp_world]` and the ranks' outputs gathered,
/// `tp_world` times that (f32).
struct SplitScratch {
    part: DeviceBuffer<f32>,
    gathered: DeviceBuffer<f32>,
}

/// A swap between its two halves: the slot's bytes queued on the copy lane,
/// its tables, companion and registry entry not yet written.
struct Pending<S> {
    slot: SlotId,
    staged: Staged<S>,
    /// The slot's new pair table, built while the device copied.
    table: Vec<PairEntry>,
    /// The slot's registry entry before the swap (restored on a value-scan
    /// refusal: the gated repack wrote no slot byte).
    previous: AdapterSlot,
    /// Recorded on the copy lane after the slot's last write.
    landed: lora_kernels::DeviceEvent,
    started: std::time::Instant,
    stage_us: f64,
    audit_us: f64,
}

impl<C: SlotCompanion> Drop for LoraPool<C> {
    fn drop(&mut self) {
        // A begun swap's copies may still write the slot pool and read the
        // staging buffers: let them finish before the buffers are freed. A
        // failed wait means the context is gone, and the memory with it.
        if self.pending.is_some() {
            let _ = self.device.synchronize();
        }
    }
}

/// The step a row buffer currently holds.
#[derive(Debug, Clone)]
struct CurrentStep {
    id: u64,
    slots: Vec<SlotId>,
    kernel_rows: usize,
}

/// Source of pool identities.
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

fn audit_err(adapter: &str) -> impl FnOnce(lora_audit::AuditError) -> PoolError + '_ {
    move |e| PoolError::Audit {
        adapter: adapter.to_string(),
        source: Box::new(e),
    }
}

/// The expert slot image of `adapter`'s expert and router pairs, in the
/// expert layout of the sites it adapts (`None` without any).
pub(crate) fn pack_experts(
    cfg: &ModelConfig,
    expert_rank: usize,
    name: &str,
    adapter: &PreparedAdapter,
) -> Result<Option<(ExpertLayout, SlotImage)>, PoolError> {
    if adapter.experts.is_empty() {
        return Ok(None);
    }
    let sites = adapter.experts.iter().map(|p| (p.layer, p.site));
    let layout = ExpertLayout::new(cfg, expert_rank, sites)?;
    let image = SlotImage::pack(&layout, &expert_sources(adapter)).map_err(image_err(name))?;
    Ok(Some((layout, image)))
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
        if opts.max_loras == 0 || i32::try_from(opts.max_loras).is_err() {
            return Err(PoolError::TooManyAdapters {
                adapters: 0,
                max_loras: opts.max_loras,
            });
        }
        if i32::try_from(capacity.max_rows).is_err() {
            return Err(PoolError::BatchTooLarge {
                what: "capacity rows",
                got: capacity.max_rows,
                capacity: i32::MAX as usize,
            });
        }
        // The rank's shard of every pair (the whole pair at world 1), the
        // embedding pair's place (replicated) when the options give one.
        let layout = opts.slot_layout(&cfg)?;
        let slot_elems = layout.slot_bytes() / 2;
        let pool_elems = mul(slot_elems, opts.max_loras, "pool")?;
        // One `[max_loras]` table per (layer, module), then the embedding's,
        // then the head's.
        let tables = mul(cfg.num_hidden_layers, LoraModule::ALL.len(), "tables")?
            .checked_add(usize::from(layout.embedding().is_some()) + usize::from(layout.lm_head().is_some()))
            .ok_or(PoolError::Layout(lora_layout::LayoutError::Overflow { what: "tables" }))?;
        let table_len = mul(tables, opts.max_loras, "tables")?;
        let expert_bytes = opts.expert_slot_bytes.unwrap_or(expert_slot_bytes);
        let serve_experts = opts.experts && cfg.moe.is_some();
        // Experts are placed by expert parallelism (whole experts, a block
        // per rank); cut by tensor parallelism they are not built.
        if serve_experts && opts.placement.tp_world() > 1 && opts.placement.ep_world() == 1 {
            return Err(PoolError::ExpertsUnderTensorParallel {
                tp_world: opts.placement.tp_world(),
            });
        }
        // DoRA's rescale divides by the norm of each whole weight row, which
        // a row-parallel rank does not hold: refused on any placed pool
        // rather than served wrong.
        if opts.dora && (opts.placement.tp_world() > 1 || opts.placement.ep_world() > 1) {
            return Err(PoolError::DoraPlaced {
                tp_world: opts.placement.tp_world(),
                ep_world: opts.placement.ep_world(),
            });
        }
        if let Some(moe) = cfg.moe.as_ref().filter(|_| serve_experts) {
            opts.placement
                .expert_range(moe.num_experts)
                .map_err(lora_layout::LayoutError::from)?;
        }
        let ws_spec = WorkspaceSpec {
            max_rows: capacity.max_rows,
            max_rank: opts.max_rank,
            max_segments: capacity.max_segments,
            max_targets: lora_kernels::MAX_TARGETS,
        };
        let world = opts.placement.tp_world();
        let split_elems = if opts.placement.fully_sharded() {
            mul(
                capacity.max_rows,
                lora_kernels::MAX_TARGETS * (opts.max_rank / world),
                "split scratch",
            )?
        } else {
            0
        };
        let needed = [
            mul(pool_elems, 2, "pool")?,
            // The fully-sharded apply's part and gathered parts, f32.
            mul(split_elems, 4 * (1 + world), "split scratch")?,
            // The device staging slot.
            layout.slot_bytes(),
            mul(table_len, std::mem::size_of::<PairEntry>(), "tables")?,
            if serve_experts {
                mul(expert_bytes.div_ceil(16) * 16, opts.max_loras, "expert pool")?
                    .saturating_add(ExpertPool::table_len(&cfg, opts.max_loras)? * std::mem::size_of::<PairEntry>())
            } else {
                0
            },
            (3 * capacity.max_rows + 2 * capacity.max_segments + 1) * 4,
            // Workspace: targets x k-splits x rows x padded rank, f32.
            lora_kernels::MAX_TARGETS * 4 * capacity.max_rows * opts.max_rank.div_ceil(16) * 16 * 4,
            crate::dora::dora_bytes(&cfg, &layout, &opts).ok_or(PoolError::Layout(
                lora_layout::LayoutError::Overflow { what: "DoRA state" },
            ))?,
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
        let dora = if opts.dora {
            Some(crate::dora::DoraState::new(device, &cfg, &layout, opts.max_loras)?)
        } else {
            None
        };
        let (tier, prefetcher) = if opts.host_tier_bytes > 0 {
            let tier = Arc::new(Mutex::new(HostTier::new(opts.host_tier_bytes)));
            let prefetcher = Prefetcher::start(device, &cfg, &opts, &layout, Arc::clone(&tier))?;
            (Some(tier), Some(prefetcher))
        } else {
            (None, None)
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
            dora,
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            next_step: 1,
            decode_current: None,
            prefill_current: None,
            seq_slot: device.upload(&vec![-1i32; capacity.max_rows.max(1)])?,
            cu_seqlens: device.alloc_zeros(capacity.max_segments + 1)?,
            seg_slot: device.upload(&vec![-1i32; capacity.max_segments.max(1)])?,
            prefill_row_slot: device.upload(&vec![-1i32; capacity.max_rows.max(1)])?,
            workspace: Mutex::new(LoraWorkspace::new(device, ws_spec)?),
            split: if opts.placement.fully_sharded() {
                Some(Mutex::new(SplitScratch {
                    part: device.alloc_zeros(split_elems.max(1))?,
                    gathered: device.alloc_zeros(mul(split_elems, world, "split scratch")?.max(1))?,
                }))
            } else {
                None
            },
            staging: Staging::new(device, &layout, StagingTuning::default())?,
            tier,
            prefetcher,
            pending: None,
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
        LoraPool::load_with_base_weights(device, cfg, opts, capacity, adapters, companion, None)
    }

    /// [`LoraPool::load_with_companion`] on a pool built for DoRA, given the
    /// engine's base weights first ([`LoraPool::set_base_weights`]) so that
    /// DoRA adapters load at startup; `None` is `load_with_companion`.
    pub fn load_with_base_weights(
        device: &Device,
        cfg: ModelConfig,
        opts: LoraOptions,
        capacity: BatchCapacity,
        adapters: &[AdapterSource<'_>],
        companion: C,
        base: Option<Arc<dyn crate::dora::BaseWeights>>,
    ) -> Result<LoraPool<C>, PoolError> {
        if adapters.len() > opts.max_loras {
            return Err(PoolError::TooManyAdapters {
                adapters: adapters.len(),
                max_loras: opts.max_loras,
            });
        }
        check_unique_names(adapters)?;
        // The audit of each header alone sizes the expert pool; the tensors
        // are read once, when each adapter is staged (a rank's pool: only
        // its shard's bytes of a dense-only adapter).
        let expert_bytes = adapters
            .iter()
            .map(|a| {
                let report = header_report(a.dir, &cfg, &opts).map_err(audit_err(a.name))?;
                Ok(if report.is_servable() { report.expert_bytes } else { 0 })
            })
            .collect::<Result<Vec<usize>, PoolError>>()?
            .into_iter()
            .max()
            .unwrap_or(0);
        let mut pool = LoraPool::with_companion(device, cfg, opts, capacity, companion, expert_bytes)?;
        if let Some(base) = base {
            pool.set_base_weights(base)?;
        }
        for (slot, src) in adapters.iter().enumerate() {
            let (staged, _) = pool.stage_from_dir(src.name, src.dir)?;
            pool.publish(SlotId::new(slot), staged)?;
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

    /// The batch capacity the row buffers were sized for.
    pub fn capacity(&self) -> BatchCapacity {
        self.capacity
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
    pub fn slot_of(&self, name: &str) -> Option<SlotId> {
        self.registry.slot_of(name).map(SlotId::new)
    }

    /// Every slot of the pool, in order.
    pub fn slot_ids(&self) -> impl Iterator<Item = SlotId> + use<C> {
        (0..self.opts.max_loras).map(SlotId::new)
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
        module_table_offset(layer, module, self.opts.max_loras)
    }

    /// First entry of the input embedding's `[max_loras]` table (after every
    /// (layer, module) table), when the pool's slots have an embedding place.
    pub fn embedding_table_offset(&self) -> Option<usize> {
        self.layout.embedding()?;
        Some(self.cfg.num_hidden_layers * LoraModule::ALL.len() * self.opts.max_loras)
    }

    /// First entry of the output head's `[max_loras]` table (after the
    /// embedding's, if any), when the pool's slots have a head place.
    pub fn lm_head_table_offset(&self) -> Option<usize> {
        self.layout.lm_head()?;
        let tables =
            self.cfg.num_hidden_layers * LoraModule::ALL.len() + usize::from(self.layout.embedding().is_some());
        Some(tables * self.opts.max_loras)
    }

    /// The head pair's table entry in `slot`, as last published.
    pub fn lm_head_entry(&self, slot: SlotId) -> Option<PairEntry> {
        if slot.index() >= self.opts.max_loras {
            return None;
        }
        self.host_table
            .get(self.lm_head_table_offset()? + slot.index())
            .copied()
    }

    /// The embedding pair's table entry in `slot`, as last published.
    pub fn embedding_entry(&self, slot: SlotId) -> Option<PairEntry> {
        if slot.index() >= self.opts.max_loras {
            return None;
        }
        self.host_table
            .get(self.embedding_table_offset()? + slot.index())
            .copied()
    }

    /// The table entry of (layer, module) in `slot`, as last published.
    pub fn entry(&self, layer: usize, module: LoraModule, slot: SlotId) -> Option<PairEntry> {
        if slot.index() >= self.opts.max_loras {
            return None;
        }
        self.host_table
            .get(self.table_offset(layer, module)? + slot.index())
            .copied()
    }

    /// The bytes of slot `slot`, read back from the device.
    pub fn slot_contents(&self, slot: SlotId) -> Result<Vec<bf16>, PoolError> {
        self.check_slot(slot)?;
        let elems = self.layout.slot_bytes() / 2;
        Ok(self.weights.download_range(slot.index() * elems, elems)?)
    }

    /// The MoE state of the adapter in `slot`, for
    /// `lora_layout::resolve_moe_lora_route`.
    pub fn moe_state(&self, slot: SlotId) -> Option<MoeAdapterState> {
        let s = self.registry.get(slot.index()).filter(|s| s.is_servable())?;
        Some(MoeAdapterState {
            has_expert_deltas: s.has_expert_deltas(),
            expert_slot: (s.has_expert_deltas() && self.experts.is_some()).then_some(slot.index()),
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
        Ok(SlotLease::take(&self.uses, SlotId::new(slot), id))
    }

    /// Live leases on `slot` (a step holds one on every slot it names).
    pub fn ref_count(&self, slot: SlotId) -> u32 {
        self.uses.ref_count(slot.index())
    }

    fn check_slot(&self, slot: SlotId) -> Result<(), PoolError> {
        if slot.index() >= self.opts.max_loras {
            return Err(PoolError::NoSuchSlot {
                slot: slot.index(),
                max_loras: self.opts.max_loras,
            });
        }
        Ok(())
    }

    fn check_idle(&self, slot: SlotId) -> Result<(), PoolError> {
        self.check_slot(slot)?;
        match self.uses.ref_count(slot.index()) {
            0 => Ok(()),
            leases => Err(PoolError::SlotInUse { slot, leases }),
        }
    }

    /// Disk swap: audit and convert the adapter in `dir`, stage it, then
    /// write it into `slot` (zeroing the rank padding), refresh the slot's
    /// table entries, and bump its generation. Any failure — unreadable
    /// files, a refused adapter, a rank over `max_rank`, no memory, a slot in
    /// use — leaves every slot serving what it served, bit for bit.
    pub fn swap_from_disk(&mut self, slot: SlotId, name: &str, dir: &Path) -> Result<SwapReport, PoolError> {
        self.begin_swap(slot, name, dir)?;
        self.finish_swap()
    }

    /// The first half of [`LoraPool::swap_from_disk`]: stage `name` (from
    /// the host tier, or read and audited from `dir`) and queue its slot
    /// bytes on the device's copy lane, behind the work already queued on
    /// the compute lane, then return without waiting for them. Decode
    /// graphs and steps over the other slots go on meanwhile; `slot` is
    /// unservable until [`LoraPool::finish_swap`] publishes it, and any
    /// other swap, eviction or landing is refused (`SwapPending`) until
    /// then. Refusals are as `swap_from_disk`'s, and leave every slot as it
    /// was (a value the device scan finds not finite is reported by
    /// `finish_swap`, which then restores the slot). Returns the route.
    pub fn begin_swap(&mut self, slot: SlotId, name: &str, dir: &Path) -> Result<SwapRoute, PoolError> {
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_no_pending()?;
        self.check_idle(slot)?;
        self.check_name_free(name, Some(slot))?;
        let started = std::time::Instant::now();
        if let Some(image) = self.tier_image(name, dir) {
            let staged = self.stage_from_tier(name, image)?;
            let stage_us = started.elapsed().as_secs_f64() * 1e6;
            self.begin_publish(slot, staged, stage_us, 0.0)?;
            return Ok(SwapRoute::HostTier);
        }
        let (staged, audit_us) = self.stage_from_dir(name, dir)?;
        let stage_us = started.elapsed().as_secs_f64() * 1e6;
        let route = staged.route;
        self.begin_publish(slot, staged, stage_us, audit_us)?;
        // The host tier fills on the way: the worker packs the adapter there,
        // off this path (its event comes as a prefetch's would; a DoRA
        // adapter's magnitudes with it).
        if let Some(prefetcher) = &self.prefetcher {
            // A stopped worker only means no tier fill; the swap goes on.
            let _ = prefetcher.request(name, dir);
        }
        Ok(route)
    }

    /// Whether the begun swap's slot bytes have landed on the device, so
    /// that [`LoraPool::finish_swap`] will not make the compute lane wait
    /// (never waits; `None` when no swap is pending).
    pub fn swap_landed(&self) -> Result<Option<bool>, PoolError> {
        match &self.pending {
            Some(p) => Ok(Some(p.landed.is_done()?)),
            None => Ok(None),
        }
    }

    /// The second half of a begun swap: publish it (tables, expert pool,
    /// companion and registry, on the compute lane, which waits on the
    /// device for the slot's bytes; the host waits only for a device-repack
    /// route's value scan). `NoPendingSwap` when none was begun.
    pub fn finish_swap(&mut self) -> Result<SwapReport, PoolError> {
        self.finish_publish()
    }

    /// Queue `name` from `dir` for the host tier: a worker thread audits,
    /// prepares and packs it there, so that its later swap or promotion is
    /// one copy. Returns at once; the outcome comes, once, from
    /// [`LoraPool::prefetch_events`] (a refused adapter's refusal among
    /// them). [`TierError::Disabled`](crate::TierError::Disabled) without a
    /// host tier.
    pub fn prefetch(&self, name: &str, dir: &Path) -> Result<(), PoolError> {
        if name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        match &self.prefetcher {
            Some(p) => p.request(name, dir),
            None => Err(crate::host_tier::TierError::Disabled.into()),
        }
    }

    /// The outcomes of prefetch requests (and of the tier fills disk swaps
    /// queue) since the last call, oldest first; each is given once.
    pub fn prefetch_events(&self) -> Vec<PrefetchEvent> {
        self.prefetcher
            .as_ref()
            .map(Prefetcher::take_events)
            .unwrap_or_default()
    }

    /// Block until every prefetch queued so far has its event (for tests
    /// and benchmarks; an engine polls [`LoraPool::prefetch_events`]).
    pub fn wait_for_prefetch(&self) {
        if let Some(p) = &self.prefetcher {
            p.wait_idle();
        }
    }

    /// Keep `name` in the host tier (now, or once it arrives), or let it go
    /// again. [`TierError::Disabled`](crate::TierError::Disabled) without a
    /// host tier.
    pub fn pin_in_host_tier(&self, name: &str, pinned: bool) -> Result<(), PoolError> {
        let tier = self.tier.as_ref().ok_or(crate::host_tier::TierError::Disabled)?;
        tier.lock().unwrap_or_else(|p| p.into_inner()).pin(name, pinned);
        Ok(())
    }

    /// What the host tier holds now; `None` without one.
    pub fn host_tier(&self) -> Option<crate::host_tier::HostTierView> {
        let tier = self.tier.as_ref()?;
        Some(tier.lock().unwrap_or_else(|p| p.into_inner()).view())
    }

    /// `name`'s host-tier image, if the tier holds one of `dir` as it is now.
    fn tier_image(&self, name: &str, dir: &Path) -> Option<Arc<HostImage>> {
        let mut tier = self.tier.as_ref()?.lock().unwrap_or_else(|p| p.into_inner());
        tier.get(name).filter(|image| image.is_current(dir))
    }

    /// Phase one from a host-tier image: the checks that depend on this
    /// pool (the expert pool's room, the companion's staging); nothing is
    /// read, audited or packed.
    fn stage_from_tier(&mut self, name: &str, image: Arc<HostImage>) -> Result<Staged<C::Staged>, PoolError> {
        if let Some(experts) = &image.experts {
            let pool = self
                .experts
                .as_ref()
                .ok_or_else(|| PoolError::NoExpertPool(name.to_string()))?;
            pool.check_fits(name, &experts.0)?;
        }
        // A DoRA adapter's image goes to the device staging slot first,
        // where its rescale is computed from it as a disk swap's is; the
        // publish then copies the slot from there.
        let (dense, dora) = match &image.dora {
            Some(magnitudes) => {
                let scales = self.stage_dora(name, magnitudes, |staging| {
                    staging.upload_pinned_on(Lane::Copy, 0, &image.dense)
                })?;
                (DenseSource::Staging, scales)
            }
            None => (DenseSource::Host(Arc::clone(&image)), Vec::new()),
        };
        let companion = self.companion.stage(name, &image.overlay)?;
        Ok(Staged {
            name: name.to_string(),
            route: SwapRoute::HostTier,
            dense_pairs: image.dense_pairs.clone(),
            experts: image.experts.clone(),
            group_expert_deltas: image.group_expert_deltas,
            companion: Some(companion),
            has_overlay: image.has_overlay,
            dense,
            dora,
        })
    }

    /// The rescales of a DoRA adapter whose packed dense image arrives by
    /// another route than a disk swap (the host tier, a peer landing):
    /// `upload` queues the image into the device staging slot on the copy
    /// lane, and the rescale is computed there from it, the magnitudes and
    /// the base weights, exactly as [`Self::stage`] computes a disk swap's.
    /// The publish copies the slot from the staging slot.
    fn stage_dora(
        &mut self,
        name: &str,
        magnitudes: &crate::dora::DoraMagnitudes,
        upload: impl FnOnce(&mut DeviceBuffer<bf16>) -> Result<(), lora_kernels::KernelError>,
    ) -> Result<Vec<crate::dora::StagedScale>, PoolError> {
        if self.dora.is_none() {
            return Err(crate::dora::refuse_not_built(name, &magnitudes.report));
        }
        let inputs = magnitudes.inputs()?;
        upload(&mut self.staging.device)?;
        let scales = self.dora_scales_from_staging(name, &magnitudes.report, inputs);
        if scales.is_err() {
            // A refusal before the read-back: the upload's source must
            // outlive its copy, which the caller's image may not.
            self.device.synchronize()?;
        }
        scales
    }

    /// DoRA's rescale from the pairs queued into the staging slot. The
    /// staging copies run on the copy lane and the norm kernels on the
    /// compute lane: the compute lane waits for the copies first, and the
    /// copy lane then waits for the kernels (whatever they returned), so
    /// that no later staging copy rewrites the slot they read.
    fn dora_scales_from_staging<'m>(
        &self,
        name: &str,
        report: &AuditReport,
        inputs: impl IntoIterator<Item = crate::dora::DoraInput<'m>>,
    ) -> Result<Vec<crate::dora::StagedScale>, PoolError> {
        let Some(state) = &self.dora else {
            return Err(crate::dora::refuse_not_built(name, report));
        };
        let packed = self.device.record_event_on(Lane::Copy)?;
        self.device.wait_event(Lane::Compute, &packed)?;
        let scales = state.stage(name, &self.device, &self.layout, &self.staging.device, report, inputs);
        let read = self.device.record_event_on(Lane::Compute)?;
        self.device.wait_event(Lane::Copy, &read)?;
        scales
    }

    /// Tune the swap path for the host at hand: the host side is cut into
    /// pinned chunks, each copied to the device as soon as it is filled
    /// (smaller chunks start the copies sooner, each copy then carries more
    /// fixed cost), and a dense adapter whose data section fits the device
    /// staging slot may go there as it is and be placed by a device repack.
    /// What ends up in a slot is the same on every setting.
    pub fn tune_staging(&mut self, tuning: StagingTuning) -> Result<(), PoolError> {
        self.check_no_pending()?;
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
        slot: SlotId,
        name: &str,
        adapter: &PreparedAdapter,
    ) -> Result<SwapReport, PoolError> {
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_no_pending()?;
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
    pub fn pick_victim(&self, name: &str) -> Result<SlotId, PoolError> {
        let views = self.registry.cache_slot_views(&self.uses);
        select_victim_slot(&views)
            .map(SlotId::new)
            .map_err(|source| PoolError::PoolFull {
                adapter: name.to_string(),
                source,
            })
    }

    /// Empty `slot`: zero its bytes and tables and bump its generation.
    /// Refused while a lease or a step holds the slot. A device failure
    /// part way leaves the slot empty and unservable until a later swap
    /// into it succeeds.
    pub fn evict(&mut self, slot: SlotId) -> Result<(), PoolError> {
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_no_pending()?;
        self.check_idle(slot)?;
        self.release_dropped_rows(slot)?;
        let s = slot.index();
        self.registry.mark_unservable(s);
        let elems = self.layout.slot_bytes() / 2;
        self.weights.zero_range(s * elems, elems)?;
        self.host_table = self.table_with_slot(s, 0, &[]);
        self.table.write(0, &self.host_table)?;
        if let Some(experts) = &mut self.experts {
            experts.clear(s)?;
        }
        if let Some(dora) = &mut self.dora {
            dora.clear(s)?;
        }
        self.companion.clear(s)?;
        self.registry.clear(s);
        Ok(())
    }

    /// Before `slot` is written: a step that named it has been dropped (the
    /// slot is idle), but its rows may still sit in a device row buffer
    /// that a captured graph reads. Reset that buffer to base rows, so a
    /// replay without a new step never serves the slot's next adapter.
    /// The step is forgotten only once its reset is written, so a write
    /// that fails leaves the reset to the next write into the slot.
    fn release_dropped_rows(&mut self, slot: SlotId) -> Result<(), PoolError> {
        let names = |c: &Option<CurrentStep>| c.as_ref().filter(|c| c.slots.contains(&slot)).map(|c| c.kernel_rows);
        if let Some(rows) = names(&self.decode_current) {
            self.seq_slot.write(0, &vec![-1i32; rows])?;
            self.decode_current = None;
        }
        if let Some(rows) = names(&self.prefill_current) {
            self.seg_slot
                .write(0, &vec![-1i32; self.capacity.max_segments.max(1)])?;
            self.prefill_row_slot.write(0, &vec![-1i32; rows])?;
            self.prefill_current = None;
        }
        Ok(())
    }

    /// Publish images landed from a peer into `slot`: the dense image over
    /// the pool's slot layout (a placed pool's: the rank's shard of each
    /// pair), the expert image over its expert layout, and a DoRA
    /// adapter's magnitudes, whose rescale is computed here from the pool's
    /// base weights as a disk swap's is. The caller checked every landed
    /// byte; nothing is read from a peer here.
    pub fn publish_landed(&mut self, slot: SlotId, name: &str, landed: LandedImages) -> Result<SwapReport, PoolError> {
        let LandedImages {
            dense,
            experts,
            group_expert_deltas,
            dora,
        } = landed;
        if !self.opts.rotatable {
            return Err(PoolError::NotRotatable);
        }
        self.check_no_pending()?;
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
        // The peer's bytes were never converted here: every served value
        // must be finite before anything is written.
        crate::image::check_finite(&self.layout, dense.as_elems()).map_err(image_err(name))?;
        if let Some((layout, image)) = &experts {
            crate::image::check_finite(layout, image.as_elems()).map_err(image_err(name))?;
        }
        let dense_pairs = dense.pairs().to_vec();
        let (dense, dora) = match &dora {
            Some(magnitudes) => {
                let scales = self.stage_dora(name, magnitudes, |staging| {
                    staging.write_on(Lane::Copy, 0, dense.as_elems())
                })?;
                (DenseSource::Staging, scales)
            }
            None => (DenseSource::Image(dense), Vec::new()),
        };
        let staged = Staged {
            name: name.to_string(),
            route: SwapRoute::Landed,
            dense_pairs,
            dense,
            group_expert_deltas: group_expert_deltas || experts.is_some(),
            experts: experts.map(Arc::new),
            companion: None,
            has_overlay: false,
            dora,
        };
        self.publish(slot, staged)
    }

    fn check_name_free(&self, name: &str, slot: Option<SlotId>) -> Result<(), PoolError> {
        if name.is_empty() {
            return Err(PoolError::EmptyName);
        }
        match self.registry.slot_of(name) {
            Some(s) if Some(SlotId::new(s)) != slot => Err(PoolError::DuplicateName(name.to_string())),
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
        // A tensor-parallel rank's shard is cut on the host (`PackPlan`):
        // the device repack copies whole tensors only.
        let raw = self.layout.placement().tp_world() == 1 && self.staging.takes_raw(raw_len);
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
        let (file, mut report, audit_us) = audited.map_err(audit_err(name))?;
        if !dense_only(&report) {
            return Ok((self.stage_prepared(name, dir, report)?, audit_us));
        }
        read?;
        let sources = file_sources(&report, &file).map_err(audit_err(name))?;
        let plan = PackPlan::new(&self.layout, &sources).map_err(image_err(name))?;
        let companion = self.companion.stage(name, &HostOverlay::none(self.cfg.hidden_size))?;
        let regions = if raw {
            plan.repack_regions(&self.layout, &file)
        } else {
            None
        };
        // A served tensor whose value is not finite is refused, naming it:
        // the device scans the bytes it was given as they are; the host
        // packer checks each pair as it converts it.
        let dense_pairs = plan.metas().to_vec();
        // An expert-parallel rank may hold none of the adapter's experts:
        // its tokens still carry the slot to the ranks that do.
        let group_expert_deltas = report.group_expert_pairs > 0;
        let (dense, route) = match regions {
            Some(regions) => {
                // Queued behind the copies, not waited for: publish gates
                // its repack on the answer and reads it once, after.
                let scan = lora_kernels::queue_value_scan(
                    &self.device,
                    Lane::Copy,
                    &self.staging.device,
                    raw_len,
                    &regions,
                    &mut self.staging.regions,
                    &mut self.staging.hits,
                )?;
                let places = (0..regions.len().div_ceil(2)).map(|p| plan.key_at(p)).collect();
                let refusal = Box::new(ScanRefusal { report, places });
                (
                    DenseSource::Raw {
                        regions,
                        bytes: raw_len,
                        scan,
                        refusal,
                    },
                    SwapRoute::DeviceRepack,
                )
            }
            None => {
                match self.staging.pack_and_upload(&self.layout, &plan, image_err(name)) {
                    Err(PoolError::Image {
                        source:
                            ImageError::NonFinite {
                                key,
                                part,
                                index,
                                value,
                            },
                        ..
                    }) => {
                        report.refuse(Refusal::non_finite(served_tensor(&report, key, part), index, value));
                        return Err(audit_err(name)(AuditError::Refused(Box::new(report))));
                    }
                    other => other?,
                }
                (DenseSource::Staging, SwapRoute::HostPack)
            }
        };
        let staged = Staged {
            name: name.to_string(),
            route,
            dense,
            dense_pairs,
            experts: None,
            group_expert_deltas,
            companion: Some(companion),
            has_overlay: false,
            dora: Vec::new(),
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
        let experts = pack_experts(&self.cfg, self.opts.expert_rank, name, adapter)?;
        if let Some((layout, _)) = &experts {
            let pool = self
                .experts
                .as_ref()
                .ok_or_else(|| PoolError::NoExpertPool(name.to_string()))?;
            pool.check_fits(name, layout)?;
        }
        if adapter.report.is_dora() && self.dora.is_none() {
            return Err(crate::dora::refuse_not_built(name, &adapter.report));
        }
        let sources = dense_sources(adapter);
        let plan = PackPlan::new(&self.layout, &sources).map_err(image_err(name))?;
        let companion = self.companion.stage(name, &adapter.overlay)?;
        self.staging.pack_and_upload(&self.layout, &plan, image_err(name))?;
        // DoRA's rescale from the pairs just packed into the staging slot.
        let dora = if adapter.report.is_dora() {
            self.dora_scales_from_staging(name, &adapter.report, crate::dora::DoraInput::of_prepared(adapter))?
        } else {
            Vec::new()
        };
        let dense_pairs = plan.metas().to_vec();
        Ok(Staged {
            name: name.to_string(),
            route: SwapRoute::Prepared,
            dense: DenseSource::Staging,
            dense_pairs,
            group_expert_deltas: experts.is_some() || adapter.report.group_expert_pairs > 0,
            experts: experts.map(Arc::new),
            companion: Some(companion),
            has_overlay: !adapter.overlay.is_empty(),
            dora,
        })
    }

    /// Phase two: write the staged adapter into `slot` and make it live
    /// ([`Self::begin_publish`], then [`Self::finish_publish`]).
    fn publish(&mut self, slot: SlotId, staged: Staged<C::Staged>) -> Result<SwapReport, PoolError> {
        self.begin_publish(slot, staged, 0.0, 0.0)?;
        self.finish_publish()
    }

    /// Phase two, first half: queue the slot's bytes on the copy lane,
    /// behind everything the compute lane was given before (a kernel still
    /// reading the slot's old bytes for a step already dropped), and keep
    /// the rest for [`Self::finish_publish`]. What can fail without writing
    /// is done first; from the first device write on, the slot is
    /// unservable (no lease, step or route can name it) until a publish
    /// into it finishes.
    fn begin_publish(
        &mut self,
        slot: SlotId,
        mut staged: Staged<C::Staged>,
        stage_us: f64,
        audit_us: f64,
    ) -> Result<(), PoolError> {
        let started = std::time::Instant::now();
        self.check_no_pending()?;
        self.check_idle(slot)?;
        let s = slot.index();
        let elems = self.layout.slot_bytes() / 2;
        let base = s * elems;
        let base_addr = self.weights.addr_at(base)?;
        if let DenseSource::Raw { regions, .. } = &mut staged.dense {
            // The plan places regions in a slot of its own; this slot starts at `base`.
            for r in regions.iter_mut() {
                r.dst_elem += base as u64;
            }
        }
        // The slot's new table, built on the host while the device may still
        // be copying.
        let table = self.table_with_slot(s, base_addr, &staged.dense_pairs);
        let previous = self.registry.slots()[s].clone();
        // A replay of a dropped step's graph must not read the slot while
        // the copy lane rewrites it: its rows go back to base rows first.
        self.release_dropped_rows(slot)?;
        self.registry.mark_unservable(s);
        let ready = self.device.record_event_on(Lane::Compute)?;
        self.device.wait_event(Lane::Copy, &ready)?;
        match &staged.dense {
            DenseSource::Staging => self
                .weights
                .copy_from_on(Lane::Copy, base, &self.staging.device, 0, elems)?,
            // Gated on the value scan on the device: on a value that is not
            // finite it writes nothing, and finish restores the slot.
            DenseSource::Raw {
                regions, bytes, scan, ..
            } => repack_if_finite(
                &self.device,
                scan,
                &self.staging.hits,
                &self.staging.device,
                *bytes,
                regions,
                &mut self.staging.regions,
                &mut self.weights,
            )?,
            DenseSource::Image(image) => self.weights.write_on(Lane::Copy, base, image.as_elems())?,
            DenseSource::Host(image) => self.weights.upload_pinned_on(Lane::Copy, base, &image.dense)?,
        }
        let landed = self.device.record_event_on(Lane::Copy)?;
        self.pending = Some(Pending {
            slot,
            staged,
            table,
            previous,
            landed,
            started,
            stage_us,
            audit_us,
        });
        Ok(())
    }

    /// Phase two, second half: once the slot's bytes are queued (the
    /// compute lane waits for them on the device, the host only for a
    /// value scan's answer), write the tables, the expert pool and the
    /// companion on the compute lane and make the slot live.
    fn finish_publish(&mut self) -> Result<SwapReport, PoolError> {
        let Some(Pending {
            slot,
            staged,
            table,
            previous,
            landed,
            started,
            stage_us,
            audit_us,
        }) = self.pending.take()
        else {
            return Err(PoolError::NoPendingSwap);
        };
        let s = slot.index();
        if let DenseSource::Raw {
            regions, scan, refusal, ..
        } = &staged.dense
        {
            // Waits for the copies, the scan and the gated repack.
            let found = scan.read(&self.staging.hits)?;
            if let Some((r, index)) = found
                .iter()
                .enumerate()
                .find_map(|(r, hit)| hit.map(|index| (r, index)))
            {
                self.registry.restore(s, previous);
                let value = staged_value(&self.staging.device, &regions[r], index);
                let tensor = refusal.tensor(r);
                let mut report = refusal.report.clone();
                report.refuse(Refusal::non_finite(
                    tensor,
                    usize::try_from(index).unwrap_or(usize::MAX),
                    value,
                ));
                return Err(audit_err(&staged.name)(AuditError::Refused(Box::new(report))));
            }
        }
        self.device.wait_event(Lane::Compute, &landed)?;
        self.host_table = table;
        self.table.write(0, &self.host_table)?;
        if let Some(dora) = &mut self.dora {
            dora.publish(&self.layout, s, &staged.dora)?;
        }
        let mut expert_pairs = Vec::new();
        if let Some(pool) = &mut self.experts {
            match staged.experts.as_deref() {
                Some((layout, image)) => {
                    pool.publish(s, layout, image.as_elems(), image.pairs())?;
                    expert_pairs = image.pairs().to_vec();
                }
                None => pool.clear(s)?,
            }
        }
        match staged.companion {
            Some(c) => self.companion.commit(s, c)?,
            None => self.companion.clear(s)?,
        }
        let next = AdapterSlot {
            name: staged.name.clone(),
            generation: 0,
            pairs: staged.dense_pairs.clone(),
            expert_pairs,
            group_expert_deltas: staged.group_expert_deltas && self.experts.is_some(),
            has_overlay: staged.has_overlay,
            unservable: false,
        };
        let generation = self.registry.publish(s, next).unwrap_or(0);
        self.uses.touch(s);
        let published = &self.registry.slots()[s];
        Ok(SwapReport {
            slot,
            name: staged.name,
            generation,
            adapter_id: published.adapter_id(),
            dense_pairs: published.pairs.len(),
            expert_pairs: published.expert_pairs.len(),
            dora_pairs: staged.dora.len(),
            stage_us,
            audit_us,
            route: staged.route,
            publish_us: started.elapsed().as_secs_f64() * 1e6,
        })
    }

    /// `SwapPending` while a begun swap has not finished.
    fn check_no_pending(&self) -> Result<(), PoolError> {
        match &self.pending {
            Some(p) => Err(PoolError::SwapPending { slot: p.slot }),
            None => Ok(()),
        }
    }

    /// The host table with slot `slot`'s entries replaced by `pairs`' (at
    /// slot address `base_addr`), every other entry as it is.
    fn table_with_slot(&self, slot: usize, base_addr: u64, pairs: &[PairMeta]) -> Vec<PairEntry> {
        let mut table = self.host_table.clone();
        for entry in table.iter_mut().skip(slot).step_by(self.opts.max_loras.max(1)) {
            *entry = PairEntry::default();
        }
        for meta in pairs {
            let place = match meta.key {
                PairKey::Dense { layer, module } => self
                    .layout
                    .entry(layer, module)
                    .map(|p| (p.a_offset, p.b_offset))
                    .zip(self.table_offset(layer, module)),
                PairKey::Embedding => self
                    .layout
                    .embedding()
                    .map(|p| (p.a_offset, p.b_offset))
                    .zip(self.embedding_table_offset()),
                PairKey::LmHead => self
                    .layout
                    .lm_head()
                    .map(|p| (p.a_offset, p.b_offset))
                    .zip(self.lm_head_table_offset()),
                PairKey::Expert { .. } => None,
            };
            let Some(((a_offset, b_offset), offset)) = place else {
                continue;
            };
            if let Some(entry) = table.get_mut(offset + slot) {
                *entry = PairEntry {
                    a: base_addr + a_offset as u64,
                    b: base_addr + b_offset as u64,
                    scale: meta.scale,
                    rank: meta.rank as u32,
                };
            }
        }
        table
    }

    /// Resolve a step's rows: each lease must be this pool's and name a
    /// servable slot, and no MoE route may be `Refuse`. Holds one lease per
    /// distinct slot.
    fn resolve_rows(&self, rows: &[StepRow<'_>], kind: StepKind) -> Result<StepRows, PoolError> {
        let experts = self.opts.experts && self.experts.is_some();
        let mut resolved = StepRows {
            pool: self.id,
            id: 0,
            rows: Vec::with_capacity(rows.len()),
            adapter_ids: Vec::with_capacity(rows.len()),
            routes: Vec::with_capacity(rows.len()),
            leases: Vec::new(),
        };
        for (row, step_row) in rows.iter().enumerate() {
            let (slot, id, state) = match step_row {
                StepRow::Base => (RowSlot::Base, 0, None),
                StepRow::Adapter(lease) => {
                    if !lease.is_of(&self.uses) {
                        return Err(PoolError::ForeignLease { kind, row });
                    }
                    let slot = lease.slot();
                    let Some(current) = self.registry.get(slot.index()) else {
                        return Err(PoolError::NoSuchSlot {
                            slot: slot.index(),
                            max_loras: self.opts.max_loras,
                        });
                    };
                    if !current.is_servable() {
                        return Err(PoolError::EmptySlot { kind, row, slot });
                    }
                    if current.adapter_id() != lease.adapter_id() {
                        return Err(PoolError::StaleLease { kind, row, slot });
                    }
                    if !resolved.leases.iter().any(|l| l.slot() == slot) {
                        resolved.leases.push((*lease).clone());
                    }
                    (RowSlot::Slot(slot), lease.adapter_id(), self.moe_state(slot))
                }
            };
            let route = resolve_moe_lora_route(state, experts);
            if let MoeLoraRoute::Refuse { reason } = route {
                return Err(PoolError::RouteRefused { kind, row, reason });
            }
            resolved.rows.push(slot);
            resolved.adapter_ids.push(id);
            resolved.routes.push(route);
        }
        Ok(resolved)
    }

    fn next_step_id(&mut self) -> u64 {
        let id = self.next_step;
        self.next_step += 1;
        id
    }

    /// Build the next decode step: one row per request (its lease, or
    /// [`StepRow::Base`]), padded with base rows to `padded_rows` (the
    /// kernels' row count, e.g. a captured graph's batch size). Writes the
    /// device row map, which the step's apply calls then read; the previous
    /// decode step is stale from here on. Refused, writing nothing, for a
    /// lease of another pool, a slot that cannot serve, or a `Refuse` MoE
    /// route.
    pub fn decode_step(&mut self, rows: &[StepRow<'_>], padded_rows: usize) -> Result<DecodeStep, PoolError> {
        if rows.len() > padded_rows {
            return Err(PoolError::Batch(format!(
                "decode step: {} rows do not fit the {padded_rows} padded rows asked",
                rows.len()
            )));
        }
        if padded_rows > self.capacity.max_rows {
            return Err(PoolError::BatchTooLarge {
                what: "padded decode rows",
                got: padded_rows,
                capacity: self.capacity.max_rows,
            });
        }
        let mut resolved = self.resolve_rows(rows, StepKind::Decode)?;
        let kernel: Vec<i32> = (0..padded_rows)
            .map(|i| resolved.rows.get(i).map_or(-1, |r| r.kernel_value()))
            .collect();
        self.decode_current = None;
        self.seq_slot.write(0, &kernel)?;
        resolved.id = self.next_step_id();
        self.decode_current = Some(CurrentStep {
            id: resolved.id,
            slots: resolved.slots().collect(),
            kernel_rows: padded_rows,
        });
        Ok(DecodeStep {
            rows: resolved,
            padded_rows,
        })
    }

    /// Build the next prefill step: one segment per sequence (its lease or
    /// [`StepRow::Base`], and its token count), packed in order. Writes the
    /// device segment buffers; the previous prefill step is stale from here
    /// on. Refused, writing nothing, as [`LoraPool::decode_step`], and for
    /// an empty sequence.
    pub fn prefill_step(&mut self, seqs: &[PrefillSeq<'_>]) -> Result<PrefillStep, PoolError> {
        if seqs.len() > self.capacity.max_segments {
            return Err(PoolError::BatchTooLarge {
                what: "prefill segments",
                got: seqs.len(),
                capacity: self.capacity.max_segments,
            });
        }
        let mut cu_seqlens = Vec::with_capacity(seqs.len() + 1);
        cu_seqlens.push(0usize);
        for (seq, s) in seqs.iter().enumerate() {
            if s.len == 0 {
                return Err(PoolError::Batch(format!("prefill sequence {seq} has no tokens")));
            }
            let total = cu_seqlens[seq].saturating_add(s.len);
            if total > self.capacity.max_rows {
                return Err(PoolError::BatchTooLarge {
                    what: "prefill rows",
                    got: total,
                    capacity: self.capacity.max_rows,
                });
            }
            cu_seqlens.push(total);
        }
        let rows: Vec<StepRow<'_>> = seqs.iter().map(|s| s.row).collect();
        let mut resolved = self.resolve_rows(&rows, StepKind::Prefill)?;
        let total = cu_seqlens[seqs.len()];
        let seg: Vec<i32> = resolved.rows.iter().map(|r| r.kernel_value()).collect();
        let mut per_row = Vec::with_capacity(total);
        for (i, r) in resolved.rows.iter().enumerate() {
            per_row.extend(std::iter::repeat_n(r.kernel_value(), cu_seqlens[i + 1] - cu_seqlens[i]));
        }
        // Fits i32: the capacity was checked when the pool was made.
        let cu: Vec<i32> = cu_seqlens.iter().map(|&c| c as i32).collect();
        self.prefill_current = None;
        self.cu_seqlens.write(0, &cu)?;
        self.seg_slot.write(0, &seg)?;
        self.prefill_row_slot.write(0, &per_row)?;
        resolved.id = self.next_step_id();
        self.prefill_current = Some(CurrentStep {
            id: resolved.id,
            slots: resolved.slots().collect(),
            kernel_rows: total,
        });
        Ok(PrefillStep {
            rows: resolved,
            cu_seqlens,
        })
    }

    /// An error unless `step` is this pool's latest step of its kind (the
    /// one the device row buffers hold).
    pub fn check_step<S: Step>(&self, step: &S) -> Result<(), PoolError> {
        let rows = Sealed::step_rows(step);
        let current = match step.kind() {
            StepKind::Decode => &self.decode_current,
            StepKind::Prefill => &self.prefill_current,
        };
        if rows.pool != self.id || current.as_ref().map(|c| c.id) != Some(rows.id) {
            return Err(PoolError::StaleStep { kind: step.kind() });
        }
        Ok(())
    }

    /// The device row map of `step` (one `i32` per kernel row), for
    /// companion kernels such as token overlays. Refused for a stale step.
    pub fn step_slots<S: Step>(&self, step: &S) -> Result<StepSlots<'_>, PoolError> {
        self.check_step(step)?;
        let buffer = match step.kind() {
            StepKind::Decode => &self.seq_slot,
            StepKind::Prefill => &self.prefill_row_slot,
        };
        Ok(StepSlots {
            buffer,
            rows: step.kernel_rows(),
        })
    }

    /// [`LoraPool::check_inputs`], then the kernel targets of the call.
    fn call_targets<S: Step>(
        &self,
        step: &S,
        layer: usize,
        targets: &FusedTargets,
        x: &Rows<'_, bf16>,
    ) -> Result<Vec<LoraTarget<'_>>, PoolError> {
        self.check_inputs(step, layer, targets, x.width, x.n_rows)?;
        self.check_rank_split(layer, targets, false)?;
        kernel_targets(
            &self.table,
            self.dora.as_ref(),
            &self.layout,
            self.opts.max_loras,
            layer,
            targets,
        )
    }

    /// An error unless every target's A holds every rank row (`split`
    /// false: the fused applies) or only the rank's block of them (`split`
    /// true: [`LoraPool::apply_fully_sharded`]).
    fn check_rank_split(&self, layer: usize, targets: &FusedTargets, split: bool) -> Result<(), PoolError> {
        for m in targets.targets() {
            let cut = self
                .layout
                .position(layer, m.module)
                .and_then(|i| self.layout.shard(i))
                .is_some_and(|s| s.rank_parts > 1);
            // Under the option with world 1 a column pair's A is whole and
            // both applies serve it.
            let column_split = self.opts.placement.fully_sharded() && m.module.shard_kind() == ShardKind::Column;
            if split && self.dora.is_some() {
                return Err(PoolError::RankSplit {
                    layer,
                    module: m.module,
                    reason: "a DoRA pool is served by the fused applies (their DoRA epilogue); the fully-sharded apply has none",
                });
            }
            if split && !column_split {
                return Err(PoolError::RankSplit {
                    layer,
                    module: m.module,
                    reason: "the fully-sharded apply serves column-parallel modules of a fully-sharded pool only",
                });
            }
            if !split && cut {
                return Err(PoolError::RankSplit {
                    layer,
                    module: m.module,
                    reason: "its A holds the rank's block of rank rows: use apply_fully_sharded",
                });
            }
        }
        Ok(())
    }

    fn check_inputs<S: Step>(
        &self,
        step: &S,
        layer: usize,
        targets: &FusedTargets,
        x_width: usize,
        x_rows: usize,
    ) -> Result<(), PoolError> {
        self.check_step(step)?;
        // Column offsets counted for another rank would put a module's
        // delta on another module's columns.
        let (t, p) = (targets.placement(), self.layout.placement());
        if (t.tp_rank(), t.tp_world()) != (p.tp_rank(), p.tp_world()) {
            return Err(PoolError::Batch(format!(
                "targets built for tensor-parallel rank {} of {}, the pool is rank {} of {} (use FusedTargets::*_at)",
                targets.placement().tp_rank(),
                targets.placement().tp_world(),
                self.layout.placement().tp_rank(),
                self.layout.placement().tp_world()
            )));
        }
        for m in targets.targets() {
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
        if x_rows != step.kernel_rows() {
            let what = match step.kind() {
                StepKind::Decode => "padded rows",
                StepKind::Prefill => "tokens over its sequences",
            };
            return Err(PoolError::Batch(format!(
                "x has {x_rows} rows; the {} step has {} {what}",
                step.kind(),
                step.kernel_rows()
            )));
        }
        Ok(())
    }

    /// The LoRA on the input embedding: `out[row, :] += scale · B · A[:,
    /// ids[row]]` for each kernel row of `step` whose slot's adapter has one
    /// (`ids` holds the step's token of each row; `out` is `[rows, hidden]`,
    /// the embedding rows after any token overlay, PEFT's order). Rows of
    /// the base model, padding and adapters without it are untouched; a
    /// pool built without the embedding place (no adapter in it can have
    /// one) launches nothing. A vocab-parallel pool
    /// (`Placement::vocab_parallel`) adds the delta only to rows whose
    /// token is in its vocabulary block: the ranks' outputs sum to the
    /// whole delta. Graph-capturable.
    pub fn apply_embedding<S: Step, Y: OutputElem>(
        &self,
        step: &S,
        ids: &DeviceBuffer<u32>,
        out: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        let slots = self.step_slots(step)?;
        if out.n_rows != slots.rows() || out.width != self.cfg.hidden_size {
            return Err(PoolError::Batch(format!(
                "embedding rows are [{}, {}]; the {} step has {} rows of hidden {}",
                out.n_rows,
                out.width,
                step.kind(),
                slots.rows(),
                self.cfg.hidden_size
            )));
        }
        let (Some(offset), Some(place)) = (self.embedding_table_offset(), self.layout.embedding()) else {
            return Ok(());
        };
        // A vocab-parallel rank's A holds its vocabulary columns only:
        // another rank's token adds nothing here.
        let pairs = lora_kernels::EmbeddingPairs {
            table: &self.table,
            table_offset: offset,
            n_entries: self.opts.max_loras,
            stride: self.opts.max_rank,
            vocab: place.vocab,
            vocab_start: place.vocab_start,
            vocab_size: self.cfg.vocab_size,
        };
        lora_kernels::embed_lora(&self.device, ids, slots.buffer(), pairs, out)?;
        Ok(())
    }

    /// The output head's target: its `[max_loras]` table, the slot's head
    /// rows as outputs from column 0 (`vocab`, or a vocab-parallel rank's
    /// block: its logit columns), after checking `step` and x (`[kernel
    /// rows, hidden]`); `None` for a pool without the head place (no
    /// adapter in it has one).
    fn head_target<S: Step>(&self, step: &S, x: &Rows<'_, bf16>) -> Result<Option<LoraTarget<'_>>, PoolError> {
        self.check_step(step)?;
        if x.width != self.cfg.hidden_size || x.n_rows != step.kernel_rows() {
            return Err(PoolError::Batch(format!(
                "lm_head x is [{}, {}]; the {} step has {} rows of hidden {}",
                x.n_rows,
                x.width,
                step.kind(),
                step.kernel_rows(),
                self.cfg.hidden_size
            )));
        }
        let (Some(table_offset), Some(place)) = (self.lm_head_table_offset(), self.layout.lm_head()) else {
            return Ok(None);
        };
        Ok(Some(LoraTarget {
            table: &self.table,
            table_offset,
            n_entries: self.opts.max_loras,
            out_dim: place.vocab,
            y_col_offset: 0,
            dora: None,
        }))
    }

    /// The LoRA on the output head over a decode step: `logits[row, :] +=
    /// scale · B (A h[row])` over the whole vocabulary (a vocab-parallel
    /// pool: over its block, the rank's logit columns from column 0), for
    /// each row whose slot's adapter has one (x: the final hidden rows
    /// `[rows, hidden]`, y: the logits, at least as wide as the slot's head
    /// rows, after the slot's head overlay:
    /// PEFT's order). The decode rule table plans the tall expand (rule 6
    /// where the other forms cannot stage it). A pool without the head
    /// place launches nothing. Graph-capturable.
    pub fn apply_lm_head_decode<Y: OutputElem>(
        &self,
        step: &DecodeStep,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
        options: DecodeOptions,
    ) -> Result<(), PoolError> {
        let Some(target) = self.head_target(step, &x)? else {
            return Ok(());
        };
        bgmv_with(
            &self.device,
            x,
            &self.seq_slot,
            &[target],
            self.opts.max_rank,
            y,
            options,
        )?;
        Ok(())
    }

    /// [`LoraPool::apply_lm_head_decode`] over a prefill step's segments
    /// (every token row). Graph-capturable.
    pub fn apply_lm_head_prefill<Y: OutputElem>(
        &self,
        step: &PrefillStep,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        let Some(target) = self.head_target(step, &x)? else {
            return Ok(());
        };
        self.sgmv_over_segments(step, &[target], x, y)
    }

    /// Decode apply: `y[row, cols of module] += scale · B (A x[row])` for
    /// each row's slot in `step` and each of `targets` (which share the
    /// input x), in one launch. Graph-capturable.
    pub fn apply_decode<Y: OutputElem>(
        &self,
        step: &DecodeStep,
        layer: usize,
        targets: &FusedTargets,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        self.apply_decode_with(step, layer, targets, x, y, DecodeOptions::default())
    }

    /// [`LoraPool::apply_decode`] with the caller's promises: with
    /// `overlap_previous` the apply's first kernel reads the step's row
    /// slots, the tables and the adapters while the stream's previous kernel
    /// finishes (x and y only after it). The promise holds where that kernel
    /// is the base projection writing y (or any kernel that writes none of
    /// those): the pool writes row slots and tables by copies at step
    /// creation and swap time, never from a kernel an apply follows
    /// directly. `options.choice` may name an exact plan (benchmarks).
    pub fn apply_decode_with<Y: OutputElem>(
        &self,
        step: &DecodeStep,
        layer: usize,
        targets: &FusedTargets,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
        options: DecodeOptions,
    ) -> Result<(), PoolError> {
        let kernel_targets = self.call_targets(step, layer, targets, &x)?;
        bgmv_with(
            &self.device,
            x,
            &self.seq_slot,
            &kernel_targets,
            self.opts.max_rank,
            y,
            options,
        )?;
        Ok(())
    }

    /// Give the pool the base model's projection weights, which DoRA
    /// adapters need ([`BaseWeights`](crate::BaseWeights)): every
    /// projection given is checked against the model and its bias uploaded
    /// beside the slots; the pool keeps the handle and reads the weights
    /// only when it stages a DoRA adapter. Call it before loading or
    /// swapping one: without it a DoRA adapter is refused,
    /// `REJECT[dora-needs-base-weights]`. [`PoolError::DoraDisabled`] on a
    /// pool not built for DoRA; [`PoolError::BaseWeightsInUse`] while a
    /// slot serves a rescale computed from the previous ones. On an error
    /// nothing changed.
    pub fn set_base_weights(&mut self, base: Arc<dyn crate::dora::BaseWeights>) -> Result<(), PoolError> {
        // A begun swap's rescale was computed from the current weights.
        self.check_no_pending()?;
        let dora = self.dora.as_mut().ok_or(PoolError::DoraDisabled)?;
        dora.set_base(&self.layout, base)
    }

    /// DoRA pairs `slot` serves now (0 on a pool not built for DoRA).
    pub fn dora_pairs(&self, slot: SlotId) -> usize {
        self.dora.as_ref().map_or(0, |d| d.pairs(slot.index()))
    }

    /// The rescale `g` of every DoRA pair `slot` serves, read back from
    /// the device, in slot-layout order (empty for a plain slot or pool).
    pub fn dora_scales(&self, slot: SlotId) -> Result<Vec<(usize, LoraModule, Vec<f32>)>, PoolError> {
        self.check_slot(slot)?;
        match &self.dora {
            Some(d) => d.slot_scales(&self.layout, slot.index()),
            None => Ok(Vec::new()),
        }
    }

    /// The launch plan [`LoraPool::apply_decode_with`] runs for these
    /// arguments now (for logs and an engine's graph bookkeeping: a captured
    /// graph replays the plan it was captured with); `None` on the CPU.
    pub fn decode_plan<Y: OutputElem>(
        &self,
        step: &DecodeStep,
        layer: usize,
        targets: &FusedTargets,
        x: Rows<'_, bf16>,
        y: &RowsMut<'_, Y>,
        options: DecodeOptions,
    ) -> Result<Option<DecodePlan>, PoolError> {
        let targets = self.call_targets(step, layer, targets, &x)?;
        Ok(bgmv_plan(&self.device, x, &targets, self.opts.max_rank, y, options)?)
    }

    /// Every plan that serves these arguments on this device under the
    /// overlap promise or without it, the rule table's first (for
    /// benchmarks of each form, run as `Choice::Exact`); empty on the CPU.
    pub fn decode_candidates<Y: OutputElem>(
        &self,
        step: &DecodeStep,
        layer: usize,
        targets: &FusedTargets,
        x: Rows<'_, bf16>,
        y: &RowsMut<'_, Y>,
        overlap_previous: bool,
    ) -> Result<Vec<DecodePlan>, PoolError> {
        let targets = self.call_targets(step, layer, targets, &x)?;
        Ok(bgmv_candidates(
            &self.device,
            x,
            &targets,
            self.opts.max_rank,
            y,
            overlap_previous,
        )?)
    }

    /// Prefill apply over `step`'s segments. Graph-capturable.
    pub fn apply_prefill<Y: OutputElem>(
        &self,
        step: &PrefillStep,
        layer: usize,
        targets: &FusedTargets,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        let kernel_targets = self.call_targets(step, layer, targets, &x)?;
        self.sgmv_over_segments(step, &kernel_targets, x, y)
    }

    /// The segment apply of `targets` over `step`'s segments (one per
    /// sequence, its slot's table entry), in the pool's workspace.
    fn sgmv_over_segments<Y: OutputElem>(
        &self,
        step: &PrefillStep,
        targets: &[LoraTarget<'_>],
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        let segments = Segments {
            cu_seqlens: &self.cu_seqlens,
            seg_slot: &self.seg_slot,
            n_segments: step.rows.rows.len(),
        };
        let mut workspace = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        sgmv(
            &self.device,
            x,
            &segments,
            targets,
            self.opts.max_rank,
            y,
            &mut workspace,
        )?;
        Ok(())
    }

    /// The fully-sharded apply over a decode or prefill step: for a pool
    /// built with the placement's fully-sharded option and column-parallel
    /// `targets`, the shrink of the rank's block of A's rank rows into `[rows,
    /// targets, max_rank / tp_world]` (f32), `gather`'s all-gather of every
    /// rank's block, and the expand of the gathered rank vectors by the
    /// rank's B rows onto the rank's output columns: `y[row, cols of module]
    /// += scale · B_r (A x[row])`, the columns the half-sharded rank
    /// computes. Every rank of the group calls it with the same step shape
    /// and targets in the same order (the gather is collective).
    ///
    /// Refused before anything runs: a stale step, targets of another rank,
    /// a module that is not column-parallel, a pool without the option or a
    /// DoRA pool ([`PoolError::RankSplit`]: this apply has no DoRA epilogue;
    /// DoRA is refused on placed pools, [`PoolError::DoraPlaced`], and at
    /// world 1 the fused applies serve a DoRA pool), a gather of another group
    /// ([`PoolError::GatherGroup`]). Graph-capturable when `gather` is
    /// (NCCL's all-gather queued on the device's stream is): the two
    /// kernels allocate nothing and keep their addresses and shapes.
    pub fn apply_fully_sharded<S: Step, Y: OutputElem>(
        &self,
        step: &S,
        layer: usize,
        targets: &FusedTargets,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
        gather: &mut dyn RankGather,
    ) -> Result<(), PoolError> {
        self.check_inputs(step, layer, targets, x.width, x.n_rows)?;
        self.check_rank_split(layer, targets, true)?;
        let p = self.opts.placement;
        if (gather.rank(), gather.world()) != (p.tp_rank(), p.tp_world()) {
            return Err(PoolError::GatherGroup {
                rank: gather.rank(),
                world: gather.world(),
                tp_rank: p.tp_rank(),
                tp_world: p.tp_world(),
            });
        }
        let split = self.split.as_ref().ok_or_else(|| {
            PoolError::Batch("the pool is not built with the fully-sharded option (LORA_FULLY_SHARDED=1)".into())
        })?;
        // No DoRA epilogue here: `check_rank_split` refused a DoRA pool.
        let kernel = kernel_targets(&self.table, None, &self.layout, self.opts.max_loras, layer, targets)?;
        let row_slot = self.step_slots(step)?.buffer();
        let part = RankPart {
            part: p.tp_rank(),
            parts: p.tp_world(),
            stride: self.opts.max_rank,
        };
        let part_len = part.part_len(x.n_rows, kernel.len())?;
        let mut scratch = split.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let SplitScratch {
            part: part_buf,
            gathered,
        } = &mut *scratch;
        lora_kernels::shrink_part(&self.device, x, row_slot, &kernel, part, part_buf)?;
        if x.n_rows > 0 {
            gather.all_gather(part_buf, part_len, gathered)?;
        }
        lora_kernels::expand_gathered(&self.device, gathered, row_slot, &kernel, part, y)?;
        Ok(())
    }

    /// One-adapter prefill: every row of `step` runs the same adapter
    /// ([`PrefillStep::one_adapter`]), applied as one GEMM pair. A step of
    /// base rows only adds nothing; a step mixing adapters is refused (use
    /// [`LoraPool::apply_prefill`]).
    pub fn apply_one_adapter<Y: OutputElem>(
        &self,
        step: &PrefillStep,
        layer: usize,
        targets: &FusedTargets,
        x: Rows<'_, bf16>,
        y: RowsMut<'_, Y>,
    ) -> Result<(), PoolError> {
        self.check_inputs(step, layer, targets, x.width, x.n_rows)?;
        if step.rows.rows.iter().all(|r| *r == RowSlot::Base) {
            return Ok(());
        }
        let slot = step.one_adapter().ok_or(PoolError::NotOneAdapter)?;
        self.check_rank_split(layer, targets, false)?;
        let kernel = kernel_targets(
            &self.table,
            self.dora.as_ref(),
            &self.layout,
            self.opts.max_loras,
            layer,
            targets,
        )?;
        let mut workspace = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        one_adapter(
            &self.device,
            x,
            slot.index(),
            &kernel,
            self.opts.max_rank,
            y,
            &mut workspace,
        )?;
        Ok(())
    }
}

/// First entry of (layer, module)'s `[max_loras]` range in a table laid
/// out per (layer, module) in `LoraModule::ALL` order: the pool's pair
/// table, and the DoRA table beside it. `None` on overflow.
pub(crate) fn module_table_offset(layer: usize, module: LoraModule, max_loras: usize) -> Option<usize> {
    layer
        .checked_mul(LoraModule::ALL.len())?
        .checked_add(module.index())?
        .checked_mul(max_loras)
}

/// The kernel targets of `targets` at `layer`: each module's `[max_loras]`
/// range of the pool's table, and on a DoRA pool the module's DoRA
/// epilogue (its `[max_loras]` range of `g` addresses and its base bias),
/// so one launch applies LoRA and DoRA rows alike.
fn kernel_targets<'t>(
    table: &'t DeviceBuffer<PairEntry>,
    dora: Option<&'t crate::dora::DoraState>,
    layout: &SlotLayout,
    max_loras: usize,
    layer: usize,
    targets: &FusedTargets,
) -> Result<Vec<LoraTarget<'t>>, PoolError> {
    targets
        .targets()
        .iter()
        .map(|m| {
            let entry = layout.entry(layer, m.module).ok_or(PoolError::NoSuchModule {
                layer,
                module: m.module,
            })?;
            Ok(LoraTarget {
                table,
                table_offset: module_table_offset(layer, m.module, max_loras).ok_or(PoolError::Layout(
                    lora_layout::LayoutError::Overflow { what: "pair table" },
                ))?,
                n_entries: max_loras,
                out_dim: entry.out_dim,
                y_col_offset: m.y_col_offset,
                dora: dora.map(|d| d.epilogue(layout, layer, m.module)).transpose()?,
            })
        })
        .collect()
}

/// The stored value of element `index` of `region`'s source block, read
/// back from the device staging slot that holds the file's bytes (NaN if it
/// cannot be read).
fn staged_value(staging: &DeviceBuffer<bf16>, region: &lora_kernels::RepackRegion, index: u64) -> f32 {
    let size: u64 = if region.dtype == lora_kernels::RepackDtype::F32 as u32 {
        4
    } else {
        2
    };
    let read = || {
        let at = index.checked_mul(size)?.checked_add(region.src_byte)?;
        // The BF16 carrier elements that hold bytes `at..at + size`.
        let first = usize::try_from(at / 2).ok()?;
        let last = usize::try_from((at + size).div_ceil(2)).ok()?;
        let elems = staging.download_range(first, last.checked_sub(first)?).ok()?;
        let bytes: &[u8] = bytemuck::cast_slice(&elems);
        let skip = usize::try_from(at % 2).ok()?;
        let b = bytes.get(skip..skip + size as usize)?;
        Some(match region.dtype {
            0 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            1 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        })
    };
    read().unwrap_or(f32::NAN)
}

/// The audit of the adapter in `dir` from its safetensors header and
/// config alone (no tensor value read), or the full audit when it has no
/// safetensors file (a pickle is refused there).
fn header_report(dir: &Path, cfg: &ModelConfig, opts: &LoraOptions) -> Result<AuditReport, AuditError> {
    let weights = dir.join(ADAPTER_WEIGHTS);
    if !weights.is_file() {
        return audit_adapter(dir, cfg, opts);
    }
    let config_path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&config_path).map_err(|e| AuditError::Io {
        path: config_path.display().to_string(),
        source: e,
    })?;
    let file = UnparsedSafetensors::open(&weights)?.parse()?;
    audit_header(&dir.display().to_string(), &text, file.infos(), cfg, opts)
}

/// Whether an audit lets the adapter go straight from its file: servable,
/// dense pairs only, and no DoRA magnitudes (a DoRA adapter is prepared in
/// full, its rescale computed from the packed pairs).
pub(crate) fn dense_only(report: &AuditReport) -> bool {
    report.is_servable() && report.experts.is_empty() && report.overlay.is_empty() && !report.is_dora()
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

#[cfg(test)]
mod fault_tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A swap whose reset of a dropped step's rows faults still resets them
    /// when it is retried: a graph replayed without a new step must never
    /// run those rows with the slot's next adapter.
    #[test]
    fn a_faulted_row_reset_is_redone_by_the_retry() {
        let llama = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/llama");
        let cfg = ModelConfig::from_file(&llama.join("config.json")).unwrap();
        let opts = LoraOptions {
            max_loras: 2,
            max_rank: 16,
            rotatable: true,
            ..LoraOptions::default()
        };
        let capacity = BatchCapacity {
            max_rows: 8,
            max_segments: 2,
        };
        let (a, b) = (llama.join("demo_r4_plain"), llama.join("demo_r8_rslora"));
        let sources = [AdapterSource { name: "a", dir: &a }];
        let with_dropped_steps = || {
            let mut pool = LoraPool::load(&Device::cpu(), cfg.clone(), opts.clone(), capacity, &sources).unwrap();
            let lease = pool.acquire("a").unwrap();
            let row = StepRow::Adapter(&lease);
            drop(pool.decode_step(&[row, StepRow::Base], 4).unwrap());
            drop(pool.prefill_step(&[PrefillSeq { row, len: 3 }]).unwrap());
            drop(lease);
            pool
        };
        let mut pool = with_dropped_steps();
        let before = pool.device().write_count().unwrap();
        pool.swap_from_disk(SlotId::new(0), "b", &b).unwrap();
        let writes = pool.device().write_count().unwrap() - before;
        // Each write of the swap in turn, the three resets among them.
        for n in 0..writes as usize {
            let mut pool = with_dropped_steps();
            pool.device().inject_write_fault_after(n).unwrap();
            let err = pool.swap_from_disk(SlotId::new(0), "b", &b).err();
            assert!(
                matches!(
                    err,
                    Some(PoolError::Kernel(lora_kernels::KernelError::InjectedFault { .. }))
                ),
                "fault {n}: {err:?}"
            );
            pool.swap_from_disk(SlotId::new(0), "b", &b).unwrap();
            assert_eq!(
                pool.seq_slot.download_range(0, 4).unwrap(),
                [-1; 4],
                "fault {n}: decode rows"
            );
            assert_eq!(
                pool.seg_slot.download_range(0, 1).unwrap(),
                [-1],
                "fault {n}: prefill segments"
            );
            assert_eq!(
                pool.prefill_row_slot.download_range(0, 3).unwrap(),
                [-1; 3],
                "fault {n}: prefill rows"
            );
        }
    }
}
