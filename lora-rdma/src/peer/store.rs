//! The peer's adapters: audited at startup and again whenever their files
//! change, staged lazily per geometry into a cache with a memory budget,
//! and served only from what was staged.
//!
//! A staging is keyed by what changes its bytes only: the dense stride
//! (`max_rank`) when the adapter has dense pairs, the expert stride
//! (`expert_packed_stride(expert_rank)`) when it has expert or router
//! pairs, the engine's whole placement (a tensor-parallel rank stages its
//! shard of each pair, an expert-parallel rank its experts and the router,
//! under the vocab-parallel and fully-sharded options as they are on or
//! off: the cut the rank's own layout walk gives, [`crate::stage`]), and the
//! version of its files. Past the budget (bytes, and a
//! count), the least recently used staging is dropped, except one an active
//! landing has pinned: when pinned stagings leave no room, the request is
//! refused [`RefusalCode::Busy`] rather than the budget exceeded. A staging
//! in progress reserves its bytes in the budget before it allocates them,
//! so stagings being built on many connections at once count too.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::SystemTime;

use lora_audit::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, AuditError, LoadedSafetensors, LoraOptions, TensorInfo};
use lora_audit::{audit_adapter, prepare_adapter};
use lora_layout::{ModelConfig, Placement, expert_packed_stride};

use crate::fingerprint::model_fingerprint;
use crate::manifest::{Location, Manifest, ManifestEntry, WireKey, WirePlacement, WireTensor};
use crate::protocol::{MAX_READ_BYTES, MAX_STAGED_RANK, PeerRefusal, ReadRange, RefusalCode, TransportKind};
use crate::stage::{StagedPart, plan_staging};

/// Limits and switches of a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// Audit with `allow_partial` (skippable targets are skipped, listed).
    pub allow_partial: bool,
    /// Stage routed-expert and router pairs (off: such adapters are refused).
    pub experts: bool,
    /// Stagings kept at once; past it the least recently used one that no
    /// landing pins is dropped.
    pub max_staged: usize,
    /// Largest single staging, in bytes (never more than `max_cache_bytes`
    /// or [`MAX_READ_BYTES`]).
    pub max_stage_bytes: usize,
    /// The memory budget of all stagings kept or in progress, in bytes:
    /// least recently used stagings no landing pins are dropped to fit a
    /// new one, whose bytes are reserved before they are allocated.
    pub max_cache_bytes: usize,
    /// Test only: flip one staged byte after its checksum is computed.
    pub corrupt_staged_byte: bool,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            allow_partial: false,
            experts: true,
            max_staged: 16,
            max_stage_bytes: 8 << 30,
            max_cache_bytes: 16 << 30,
            corrupt_staged_byte: false,
        }
    }
}

/// One file's identity and version: any rewrite, truncation or
/// replacement changes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<SystemTime>,
    /// Inode and status-change time (which no one can set back), on Unix.
    inode: u64,
    changed: (i64, i64),
}

/// The version of an adapter's two files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp([FileStamp; 2]);

impl Stamp {
    fn of(dir: &Path) -> Result<Stamp, String> {
        let file = |name: &str| {
            let path = dir.join(name);
            let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            #[cfg(unix)]
            let (inode, changed) = {
                use std::os::unix::fs::MetadataExt;
                (meta.ino(), (meta.ctime(), meta.ctime_nsec()))
            };
            #[cfg(not(unix))]
            let (inode, changed) = (0, (0, 0));
            Ok::<_, String>(FileStamp {
                len: meta.len(),
                modified: meta.modified().ok(),
                inode,
                changed,
            })
        };
        Ok(Stamp([file(ADAPTER_CONFIG)?, file(ADAPTER_WEIGHTS)?]))
    }
}

/// The largest ranks of a servable adapter (0: no such pairs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ranks {
    dense: usize,
    expert: usize,
}

/// An adapter the peer serves: the audit's verdict on one version of its
/// files.
#[derive(Debug, Clone)]
struct Served {
    dir: PathBuf,
    /// The version the verdict is for.
    stamp: Stamp,
    /// Bumped at every re-audit: stagings of an older version are never
    /// served again.
    generation: u64,
    /// Servable with these ranks, or refused with why.
    verdict: Result<Ranks, String>,
}

/// An adapter the startup audit refused, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedAdapter {
    /// Its name.
    pub name: String,
    /// The reason (refusal codes, or the read error).
    pub reason: String,
}

/// Staged bytes: plain memory, or registered for remote read when the
/// peer serves RDMA.
pub(crate) enum StagedMemory {
    /// Read over TCP only.
    Plain(Box<[u8]>),
    /// Also readable by RDMA READ.
    #[cfg(feature = "ibverbs")]
    Registered(crate::verbs::RegisteredBytes),
}

impl StagedMemory {
    /// The staged bytes (the HCA only ever reads them).
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            StagedMemory::Plain(b) => b,
            #[cfg(feature = "ibverbs")]
            StagedMemory::Registered(r) => r.bytes(),
        }
    }
}

/// One staging: an adapter at one (max_rank, expert_rank, placement).
pub(crate) struct Staged {
    pub(crate) region: u32,
    pub(crate) memory: StagedMemory,
    parts: Vec<StagedPart>,
    adapter_config: String,
    tensors: Vec<WireTensor>,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("region", &self.region)
            .field("bytes", &self.memory.bytes().len())
            .field("parts", &self.parts.len())
            .finish()
    }
}

/// What a staging's bytes depend on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct StageKey {
    adapter: String,
    /// The [`Served::generation`] staged.
    generation: u64,
    /// The dense B stride (`max_rank`); 0 for an adapter without dense pairs.
    dense_stride: usize,
    /// The expert and router B stride; 0 for an adapter without them.
    expert_stride: usize,
    /// The engine's rank, cut options included.
    placement: Placement,
}

/// A checked read range: the staging and the byte range in it.
pub(crate) type ResolvedRange = (Arc<Staged>, std::ops::Range<usize>);

/// A staging in progress: requests for the same key wait for its outcome.
type InFlight = OnceLock<Result<(), PeerRefusal>>;

/// A kept staging.
struct Entry {
    key: StageKey,
    staged: Arc<Staged>,
    /// Active landings using it: never dropped while any.
    pins: usize,
    /// When it was last handed out (the cache's clock).
    used: u64,
}

#[derive(Default)]
struct StageCache {
    next_region: u32,
    clock: u64,
    /// Bytes of every kept staging.
    bytes: usize,
    /// Bytes reserved by stagings in progress (not yet kept).
    reserved: usize,
    regions: HashMap<u32, Entry>,
    by_key: HashMap<StageKey, u32>,
    in_flight: HashMap<StageKey, Arc<InFlight>>,
}

impl StageCache {
    /// Pin the staging of `key`, if kept.
    fn pin(&mut self, key: &StageKey) -> Option<(u32, Arc<Staged>)> {
        let region = *self.by_key.get(key)?;
        let entry = self.regions.get_mut(&region)?;
        self.clock += 1;
        entry.pins += 1;
        entry.used = self.clock;
        Some((region, Arc::clone(&entry.staged)))
    }

    /// Drop least recently used unpinned stagings until `len` more bytes
    /// (and, with `entry`, one more staging) fit beside the kept and
    /// reserved ones; refused [`RefusalCode::Busy`] when pinned stagings
    /// leave no room.
    fn make_room(&mut self, len: usize, entry: bool, options: &StoreOptions) -> Result<(), PeerRefusal> {
        while (entry && self.regions.len() >= options.max_staged.max(1))
            || self.bytes.saturating_add(self.reserved).saturating_add(len) > options.max_cache_bytes
        {
            let victim = self
                .regions
                .iter()
                .filter(|(_, e)| e.pins == 0)
                .min_by_key(|(_, e)| e.used)
                .map(|(&region, _)| region);
            let Some(region) = victim else {
                return Err(refuse(
                    RefusalCode::Busy,
                    format!(
                        "active landings pin every staging ({} bytes kept, {} reserved by stagings in progress, \
                         budget {}); a staging of {len} bytes does not fit",
                        self.bytes, self.reserved, options.max_cache_bytes
                    ),
                ));
            };
            if let Some(old) = self.regions.remove(&region) {
                self.bytes -= old.staged.memory.bytes().len();
                self.by_key.remove(&old.key);
            }
        }
        Ok(())
    }

    /// Keep `staged` under `key`, pinned, its bytes moved from `reservation`
    /// (which reserved them) into the kept ones, dropping least recently
    /// used unpinned stagings until it fits the budget; refused when pinned
    /// stagings leave no room.
    fn insert(
        &mut self,
        key: StageKey,
        mut staged: Staged,
        reservation: Reservation<'_>,
        options: &StoreOptions,
    ) -> Result<(u32, Arc<Staged>), PeerRefusal> {
        reservation.settle(self);
        let len = staged.memory.bytes().len();
        self.make_room(len, true, options)?;
        let mut region = self.next_region;
        // After a wrap, skip the (at most `max_staged`) ids still kept.
        while self.regions.contains_key(&region) {
            region = region.wrapping_add(1);
        }
        self.next_region = region.wrapping_add(1);
        staged.region = region;
        let staged = Arc::new(staged);
        self.clock += 1;
        self.bytes += len;
        self.by_key.insert(key.clone(), region);
        self.regions.insert(
            region,
            Entry {
                key,
                staged: Arc::clone(&staged),
                pins: 1,
                used: self.clock,
            },
        );
        Ok((region, staged))
    }
}

/// Bytes a staging in progress holds in the budget: released when dropped,
/// or moved into the kept bytes when the staging is kept.
pub(crate) struct Reservation<'a> {
    store: &'a PeerStore,
    len: usize,
}

impl Reservation<'_> {
    /// Release the reserved bytes under the lock the caller holds.
    fn settle(mut self, cache: &mut StageCache) {
        cache.reserved -= self.len;
        self.len = 0;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.len > 0 {
            self.store.lock().reserved -= self.len;
        }
    }
}

/// A staging an active landing uses: it stays in the cache (its region
/// readable) until the pin is dropped.
pub(crate) struct RegionPin<'a> {
    store: &'a PeerStore,
    region: u32,
    len: usize,
}

impl RegionPin<'_> {
    /// The pinned region.
    pub(crate) fn region(&self) -> u32 {
        self.region
    }

    /// Its bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for RegionPin<'_> {
    fn drop(&mut self) {
        if let Some(entry) = self.store.lock().regions.get_mut(&self.region) {
            entry.pins = entry.pins.saturating_sub(1);
        }
    }
}

/// The adapters a peer serves, and their stagings.
pub struct PeerStore {
    cfg: ModelConfig,
    model: u64,
    options: StoreOptions,
    /// One lock per adapter: a re-audit holds it, other adapters go on.
    served: BTreeMap<String, Mutex<Served>>,
    refused: Vec<RefusedAdapter>,
    cache: Mutex<StageCache>,
    #[cfg(feature = "ibverbs")]
    rdma: Option<crate::verbs::PeerDevice>,
}

/// An adapter directory's config text and tensor header, read together.
fn read_header(dir: &Path) -> Result<(String, Vec<TensorInfo>), AuditError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|source| AuditError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let infos = LoadedSafetensors::open(&dir.join(ADAPTER_WEIGHTS))?.infos()?;
    Ok((text, infos))
}

fn refuse(code: RefusalCode, message: impl Into<String>) -> PeerRefusal {
    PeerRefusal::new(code, message)
}

impl PeerStore {
    /// A store for the model `cfg` with no adapters.
    pub fn new(cfg: ModelConfig, options: StoreOptions) -> PeerStore {
        PeerStore {
            model: model_fingerprint(&cfg),
            cfg,
            options,
            served: BTreeMap::new(),
            refused: Vec::new(),
            cache: Mutex::new(StageCache::default()),
            #[cfg(feature = "ibverbs")]
            rdma: None,
        }
    }

    /// Serve RDMA READ from `device`: every staging is registered with it
    /// for remote read only.
    #[cfg(feature = "ibverbs")]
    pub fn with_rdma(mut self, device: crate::verbs::PeerDevice) -> PeerStore {
        self.rdma = Some(device);
        self
    }

    /// The RDMA device, when the peer serves RDMA READ.
    #[cfg(feature = "ibverbs")]
    pub(crate) fn rdma(&self) -> Option<&crate::verbs::PeerDevice> {
        self.rdma.as_ref()
    }

    /// The model's geometry fingerprint.
    pub fn fingerprint(&self) -> u64 {
        self.model
    }

    fn audit_options(&self, max_rank: usize, expert_rank: usize, placement: Placement) -> LoraOptions {
        LoraOptions {
            max_rank,
            expert_rank,
            placement,
            experts: self.options.experts,
            allow_partial: self.options.allow_partial,
            // The peer stages embedding and head pairs whatever its own pool
            // does: the engine's audit decides whether its slots have the places.
            embedding_lora: true,
            lm_head_lora: true,
            // Likewise DoRA pairs with their magnitudes, for an unplaced
            // engine (a placed pool serves no DoRA; its audit refuses it).
            dora: placement.tp_world() == 1 && placement.ep_world() == 1,
            ..LoraOptions::default()
        }
    }

    /// The startup audit's verdict on the adapter in `dir` (at the widest
    /// ranks the peer stages for).
    fn verdict(&self, dir: &Path) -> Result<Ranks, String> {
        let wide = MAX_STAGED_RANK as usize;
        match audit_adapter(dir, &self.cfg, &self.audit_options(wide, wide, Placement::SINGLE)) {
            Err(e) => Err(e.to_string()),
            Ok(report) if !report.is_servable() => Err(format!("refused by the audit: {:?}", report.refused_codes())),
            Ok(report) if !report.overlay.is_empty() => {
                Err("has token overlays, which the peer protocol does not carry".to_string())
            }
            Ok(report) => Ok(Ranks {
                dense: report.placed.iter().map(|p| p.rank).max().unwrap_or(0),
                expert: report.experts.iter().map(|p| p.rank).max().unwrap_or(0),
            }),
        }
    }

    /// Audit the adapter in `dir` under `name` (at the widest ranks the peer
    /// stages for). A refused adapter is recorded and never served; the
    /// returned error says why. A served adapter is audited again whenever
    /// its files change.
    pub fn add_adapter(&mut self, name: &str, dir: &Path) -> Result<(), RefusedAdapter> {
        let served = if self.served.contains_key(name) {
            Err(format!("a second adapter named `{name}`"))
        } else {
            Stamp::of(dir).and_then(|stamp| {
                Ok(Served {
                    dir: dir.to_path_buf(),
                    stamp,
                    generation: 0,
                    verdict: Ok(self.verdict(dir)?),
                })
            })
        };
        match served {
            Ok(served) => {
                self.served.insert(name.to_string(), Mutex::new(served));
                Ok(())
            }
            Err(reason) => {
                let refused = RefusedAdapter {
                    name: name.to_string(),
                    reason,
                };
                self.refused.push(refused.clone());
                Err(refused)
            }
        }
    }

    /// The names of the adapters served.
    pub fn served(&self) -> impl Iterator<Item = &str> {
        self.served.keys().map(String::as_str)
    }

    /// The adapters refused at startup.
    pub fn refused(&self) -> &[RefusedAdapter] {
        &self.refused
    }

    fn lock(&self) -> MutexGuard<'_, StageCache> {
        // A panic while holding the lock cannot leave the cache half-written
        // in a way that matters: entries are inserted whole.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `adapter` as its files are now: audited again first when they
    /// changed since the last audit (the stamp is taken before the audit,
    /// so a change during it is audited again next time, and a staging
    /// checks the stamp after reading the files).
    fn current(&self, adapter: &str) -> Result<(Served, Ranks), PeerRefusal> {
        let unknown = || refuse(RefusalCode::UnknownAdapter, format!("no adapter `{adapter}` is served"));
        let mut served = self
            .served
            .get(adapter)
            .ok_or_else(unknown)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let stamp = Stamp::of(&served.dir).map_err(|e| refuse(RefusalCode::Staging, format!("`{adapter}`: {e}")))?;
        if stamp != served.stamp {
            served.verdict = self.verdict(&served.dir);
            served.stamp = stamp;
            served.generation += 1;
        }
        match served.verdict.clone() {
            Ok(ranks) => Ok((served.clone(), ranks)),
            Err(reason) => Err(refuse(
                RefusalCode::UnknownAdapter,
                format!("`{adapter}` changed on disk and its audit refuses it now: {reason}"),
            )),
        }
    }

    /// Stage `adapter` for this geometry and rank (once; later requests
    /// reuse it) and return its manifest with locations for `transport`.
    pub fn manifest(
        &self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        placement: WirePlacement,
        transport: TransportKind,
    ) -> Result<Manifest, PeerRefusal> {
        self.pinned_manifest(adapter, max_rank, expert_rank, placement, transport)
            .map(|(manifest, _)| manifest)
    }

    /// [`PeerStore::manifest`], with its staging pinned until the pin is
    /// dropped.
    pub(crate) fn pinned_manifest(
        &self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        wire_placement: WirePlacement,
        transport: TransportKind,
    ) -> Result<(Manifest, RegionPin<'_>), PeerRefusal> {
        let placement = wire_placement
            .to_placement()
            .map_err(|e| refuse(RefusalCode::Placement, format!("{wire_placement}: {e}")))?;
        let (served, ranks) = self.current(adapter)?;
        for (what, asked, needed) in [
            ("max_rank", max_rank, ranks.dense),
            ("expert_rank", expert_rank, ranks.expert),
        ] {
            if asked == 0 || asked > MAX_STAGED_RANK || (asked as usize) < needed {
                return Err(refuse(
                    RefusalCode::Rank,
                    format!("{what} {asked}: `{adapter}` needs {needed}..={MAX_STAGED_RANK}"),
                ));
            }
        }
        let expert_stride = match ranks.expert {
            0 => 0,
            _ => expert_packed_stride(expert_rank as usize).map_err(|e| refuse(RefusalCode::Rank, e.to_string()))?,
        };
        let key = StageKey {
            adapter: adapter.to_string(),
            generation: served.generation,
            dense_stride: if ranks.dense == 0 { 0 } else { max_rank as usize },
            expert_stride,
            placement,
        };
        // The rank's layout must divide the model's geometry; the staging
        // walks it again.
        self.audit_options(max_rank as usize, expert_rank as usize, placement)
            .slot_layout(&self.cfg)
            .map_err(|e| refuse(RefusalCode::Placement, format!("{wire_placement}: {e}")))?;
        let (pin, staged) = self.pinned(key, &served, max_rank as usize, expert_rank as usize)?;
        let entries = staged
            .parts
            .iter()
            .map(|p| {
                Some(ManifestEntry {
                    key: WireKey::from_key(p.key),
                    part: p.part,
                    len: p.len as u64,
                    checksum: p.checksum,
                    location: PeerStore::location(&staged, p.offset, transport)?,
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| refuse(RefusalCode::NoRdma, "this peer serves no RDMA device"))?;
        let manifest = Manifest {
            adapter: adapter.to_string(),
            model: self.model,
            max_rank,
            expert_rank,
            placement: wire_placement,
            adapter_config: staged.adapter_config.clone(),
            tensors: staged.tensors.clone(),
            entries,
        };
        Ok((manifest, pin))
    }

    /// Where the engine reads a staged part: a region offset for TCP, the
    /// registered address and key for RDMA (`None` without a registration).
    fn location(staged: &Staged, offset: usize, transport: TransportKind) -> Option<Location> {
        match transport {
            TransportKind::Tcp => Some(Location::Tcp {
                region: staged.region,
                offset: offset as u64,
            }),
            #[cfg(feature = "ibverbs")]
            TransportKind::Rdma => match &staged.memory {
                StagedMemory::Registered(r) => Some(Location::Rdma {
                    addr: r.region().addr() + offset as u64,
                    rkey: r.region().rkey(),
                }),
                StagedMemory::Plain(_) => None,
            },
            #[cfg(not(feature = "ibverbs"))]
            TransportKind::Rdma => None,
        }
    }

    /// The staging of `key`, pinned, staging it now if needed. Staging runs
    /// outside the cache lock, so reads of other stagings go on meanwhile;
    /// concurrent requests for the same key wait for the one staging. A
    /// failed staging is forgotten (the next request tries again).
    fn pinned(
        &self,
        key: StageKey,
        served: &Served,
        max_rank: usize,
        expert_rank: usize,
    ) -> Result<(RegionPin<'_>, Arc<Staged>), PeerRefusal> {
        let pin = |(region, staged): (u32, Arc<Staged>)| {
            let len = staged.memory.bytes().len();
            (
                RegionPin {
                    store: self,
                    region,
                    len,
                },
                staged,
            )
        };
        // A staging waited for can be dropped again before this request
        // pins it (other stagings need the room); a few rounds settle it.
        for _ in 0..4 {
            let waiting = {
                let mut cache = self.lock();
                if let Some(kept) = cache.pin(&key) {
                    return Ok(pin(kept));
                }
                match cache.in_flight.get(&key) {
                    Some(in_flight) => Some(Arc::clone(in_flight)),
                    None => {
                        cache.in_flight.insert(key.clone(), Arc::new(InFlight::new()));
                        None
                    }
                }
            };
            if let Some(in_flight) = waiting {
                in_flight.wait().clone()?;
                continue;
            }
            let staged = self.stage(&key, served, max_rank, expert_rank);
            let mut cache = self.lock();
            let in_flight = cache.in_flight.remove(&key);
            let result = staged.and_then(|(s, r)| cache.insert(key.clone(), s, r, &self.options));
            if let Some(in_flight) = in_flight {
                // Set under the lock: a waiter never looks before the
                // staging is kept.
                let _ = in_flight.set(result.as_ref().map(|_| ()).map_err(Clone::clone));
            }
            return result.map(pin);
        }
        Err(refuse(
            RefusalCode::Busy,
            "the staging was dropped for others before this request could use it",
        ))
    }

    fn stage(
        &self,
        key: &StageKey,
        served: &Served,
        max_rank: usize,
        expert_rank: usize,
    ) -> Result<(Staged, Reservation<'_>), PeerRefusal> {
        let staging_err = |e: &dyn std::fmt::Display| refuse(RefusalCode::Staging, e.to_string());
        let (text, infos) = read_header(&served.dir).map_err(|e| staging_err(&e))?;
        let options = self.audit_options(max_rank, expert_rank, key.placement);
        let prepared = prepare_adapter(&served.dir, &self.cfg, &options).map_err(|e| staging_err(&e))?;
        // The manifest's config and header must describe the staged bytes,
        // the bytes must be of the audited version, and the key must hold
        // every stride the bytes use.
        let (text_after, infos_after) = read_header(&served.dir).map_err(|e| staging_err(&e))?;
        if text_after != text
            || infos_after != infos
            || Stamp::of(&served.dir).as_ref() != Ok(&served.stamp)
            || prepared.dense.is_empty() != (key.dense_stride == 0)
            // An expert-parallel rank may hold none of the adapter's experts.
            || (!prepared.experts.is_empty() && key.expert_stride == 0)
        {
            return Err(refuse(
                RefusalCode::Staging,
                "the adapter changed on disk while it was staged",
            ));
        }
        let budget = self
            .options
            .max_stage_bytes
            .min(self.options.max_cache_bytes)
            .min(usize::try_from(MAX_READ_BYTES).unwrap_or(usize::MAX));
        let plan = plan_staging(&prepared, &self.cfg, &options, budget).map_err(|e| staging_err(&e))?;
        let reservation = self.reserve(plan.len())?;
        let mut staging = plan.fill();
        if self.options.corrupt_staged_byte
            && let Some(byte) = staging.bytes.get_mut(staging.bytes.len() / 2)
        {
            *byte ^= 0x5a;
        }
        #[cfg(feature = "ibverbs")]
        let memory = match &self.rdma {
            Some(device) => StagedMemory::Registered(
                device
                    .register_remote_read(staging.bytes)
                    .map_err(|e| staging_err(&e))?,
            ),
            None => StagedMemory::Plain(staging.bytes),
        };
        #[cfg(not(feature = "ibverbs"))]
        let memory = StagedMemory::Plain(staging.bytes);
        let staged = Staged {
            // Set when the staging is kept.
            region: 0,
            memory,
            parts: staging.parts,
            adapter_config: text,
            tensors: infos
                .into_iter()
                .map(|t| WireTensor {
                    name: t.name,
                    dtype: t.dtype.to_string(),
                    shape: t.shape.into_iter().map(|d| d as u64).collect(),
                })
                .collect(),
        };
        Ok((staged, reservation))
    }

    /// Resolve every range of a read request to its staged bytes, or refuse
    /// the whole request: an unknown region, a range leaving its region, or
    /// more bytes than [`MAX_READ_BYTES`] or than the regions named hold.
    pub(crate) fn resolve(&self, ranges: &[ReadRange]) -> Result<Vec<ResolvedRange>, PeerRefusal> {
        let cache = self.lock();
        let resolved = ranges
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let staged = &cache
                    .regions
                    .get(&r.region)
                    .ok_or_else(|| {
                        refuse(
                            RefusalCode::BadRead,
                            format!("range {i}: region {} is not staged", r.region),
                        )
                    })?
                    .staged;
                let bytes = r.within(staged.memory.bytes().len()).ok_or_else(|| {
                    refuse(
                        RefusalCode::BadRead,
                        format!(
                            "range {i}: {}+{} leaves region {} of {} bytes",
                            r.offset,
                            r.len,
                            r.region,
                            staged.memory.bytes().len()
                        ),
                    )
                })?;
                Ok((Arc::clone(staged), bytes))
            })
            .collect::<Result<Vec<_>, PeerRefusal>>()?;
        let asked = ranges.iter().fold(0u64, |sum, r| sum.saturating_add(r.len));
        let mut named = HashSet::new();
        let held = resolved
            .iter()
            .filter(|(staged, _)| named.insert(staged.region))
            .fold(0u64, |sum, (staged, _)| {
                sum.saturating_add(staged.memory.bytes().len() as u64)
            });
        if asked > held.min(MAX_READ_BYTES) {
            return Err(refuse(
                RefusalCode::TooManyBytes,
                format!(
                    "the read asks for {asked} bytes; the regions it names hold {held} \
                     (and a read may ask for at most {MAX_READ_BYTES})"
                ),
            ));
        }
        Ok(resolved)
    }

    /// Reserve `len` bytes of the budget for a staging in progress,
    /// dropping least recently used unpinned stagings to make room;
    /// [`RefusalCode::Busy`] when pinned stagings and other reservations
    /// leave none.
    pub(crate) fn reserve(&self, len: usize) -> Result<Reservation<'_>, PeerRefusal> {
        let mut cache = self.lock();
        cache.make_room(len, false, &self.options)?;
        cache.reserved += len;
        Ok(Reservation { store: self, len })
    }

    /// Bytes reserved by stagings in progress.
    #[cfg(test)]
    pub(crate) fn reserved_bytes(&self) -> usize {
        self.lock().reserved
    }

    /// Stagings kept, their bytes and how many are pinned.
    #[cfg(test)]
    pub(crate) fn cache_usage(&self) -> (usize, usize, usize) {
        let cache = self.lock();
        let pinned = cache.regions.values().filter(|e| e.pins > 0).count();
        (cache.regions.len(), cache.bytes, pinned)
    }
}

#[cfg(test)]
mod tests;
