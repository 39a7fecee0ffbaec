//! The peer's adapters: audited once at startup, staged lazily per
//! requested geometry, and served only from what was staged.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use lora_audit::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, AuditError, LoadedSafetensors, LoraOptions, TensorInfo};
use lora_audit::{audit_adapter, prepare_adapter};
use lora_layout::ModelConfig;

use crate::fingerprint::model_fingerprint;
use crate::manifest::{Location, Manifest, ManifestEntry, WireKey, WireTensor};
use crate::protocol::{MAX_STAGED_RANK, PeerRefusal, ReadRange, RefusalCode, TransportKind};
use crate::stage::{StagedPart, stage_adapter};

/// Limits and switches of a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// Audit with `allow_partial` (skippable targets are skipped, listed).
    pub allow_partial: bool,
    /// Stage routed-expert and router pairs (off: such adapters are refused).
    pub experts: bool,
    /// Stagings kept at once; the oldest is dropped past it.
    pub max_staged: usize,
    /// Largest single staging, in bytes.
    pub max_stage_bytes: usize,
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
            corrupt_staged_byte: false,
        }
    }
}

/// An adapter the peer serves.
#[derive(Debug, Clone)]
struct Served {
    dir: PathBuf,
    /// Largest dense rank (0: none).
    dense_rank: usize,
    /// Largest expert/router rank (0: none).
    expert_rank: usize,
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

/// One staging: an adapter at one (max_rank, expert_rank).
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

type StageKey = (String, u32, u32);

/// A checked read range: the staging and the byte range in it.
pub(crate) type ResolvedRange = (Arc<Staged>, std::ops::Range<usize>);

/// One geometry's staging, set once by the request that stages it.
type StageCell = OnceLock<Result<Arc<Staged>, PeerRefusal>>;

#[derive(Default)]
struct StageCache {
    next_region: u32,
    by_key: HashMap<StageKey, Arc<StageCell>>,
    by_region: HashMap<u32, Arc<Staged>>,
    order: VecDeque<StageKey>,
}

/// The adapters a peer serves, and their stagings.
pub struct PeerStore {
    cfg: ModelConfig,
    model: u64,
    options: StoreOptions,
    served: BTreeMap<String, Served>,
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

    fn audit_options(&self, max_rank: usize, expert_rank: usize) -> LoraOptions {
        LoraOptions {
            max_rank,
            expert_rank,
            experts: self.options.experts,
            allow_partial: self.options.allow_partial,
            ..LoraOptions::default()
        }
    }

    /// Audit the adapter in `dir` under `name` (at the widest ranks the peer
    /// stages for). A refused adapter is recorded and never served; the
    /// returned error says why.
    pub fn add_adapter(&mut self, name: &str, dir: &Path) -> Result<(), RefusedAdapter> {
        let wide = MAX_STAGED_RANK as usize;
        let verdict = match audit_adapter(dir, &self.cfg, &self.audit_options(wide, wide)) {
            Err(e) => Err(e.to_string()),
            Ok(report) if !report.is_servable() => Err(format!("refused by the audit: {:?}", report.refused_codes())),
            Ok(report) if !report.overlay.is_empty() => {
                Err("has token overlays, which the peer protocol does not carry".to_string())
            }
            Ok(_) if self.served.contains_key(name) => Err(format!("a second adapter named `{name}`")),
            Ok(report) => Ok(Served {
                dir: dir.to_path_buf(),
                dense_rank: report.placed.iter().map(|p| p.rank).max().unwrap_or(0),
                expert_rank: report.experts.iter().map(|p| p.rank).max().unwrap_or(0),
            }),
        };
        match verdict {
            Ok(served) => {
                self.served.insert(name.to_string(), served);
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

    fn lock(&self) -> std::sync::MutexGuard<'_, StageCache> {
        // A panic while holding the lock cannot leave the cache half-written
        // in a way that matters: entries are inserted whole.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stage `adapter` for this geometry (once; later requests reuse it) and
    /// return its manifest with locations for `transport`.
    pub fn manifest(
        &self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        transport: TransportKind,
    ) -> Result<Manifest, PeerRefusal> {
        let served = self
            .served
            .get(adapter)
            .ok_or_else(|| refuse(RefusalCode::UnknownAdapter, format!("no adapter `{adapter}` is served")))?;
        for (what, asked, needed) in [
            ("max_rank", max_rank, served.dense_rank),
            ("expert_rank", expert_rank, served.expert_rank),
        ] {
            if asked == 0 || asked > MAX_STAGED_RANK || (asked as usize) < needed {
                return Err(refuse(
                    RefusalCode::Rank,
                    format!("{what} {asked}: `{adapter}` needs {needed}..={MAX_STAGED_RANK}"),
                ));
            }
        }
        let staged = self.staged(adapter, served, max_rank, expert_rank)?;
        let entries = staged
            .parts
            .iter()
            .map(|p| {
                Some(ManifestEntry {
                    key: WireKey::from_key(p.key),
                    part: p.part.into(),
                    len: p.len as u64,
                    checksum: p.checksum,
                    location: PeerStore::location(&staged, p.offset, transport)?,
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| refuse(RefusalCode::NoRdma, "this peer serves no RDMA device"))?;
        Ok(Manifest {
            adapter: adapter.to_string(),
            model: self.model,
            max_rank,
            expert_rank,
            adapter_config: staged.adapter_config.clone(),
            tensors: staged.tensors.clone(),
            entries,
        })
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

    /// The staging of (adapter, max_rank, expert_rank), staging it now if
    /// needed. Staging runs outside the cache lock, so reads of other
    /// stagings go on meanwhile; concurrent requests for the same geometry
    /// wait for the one staging. A failed staging is forgotten (the next
    /// request tries again).
    fn staged(
        &self,
        adapter: &str,
        served: &Served,
        max_rank: u32,
        expert_rank: u32,
    ) -> Result<Arc<Staged>, PeerRefusal> {
        let key = (adapter.to_string(), max_rank, expert_rank);
        let (cell, region) = {
            let mut cache = self.lock();
            match cache.by_key.get(&key) {
                Some(cell) => (Arc::clone(cell), None),
                None => {
                    let cell = Arc::new(StageCell::new());
                    cache.by_key.insert(key.clone(), Arc::clone(&cell));
                    let region = cache.next_region;
                    cache.next_region = region.wrapping_add(1);
                    (cell, Some(region))
                }
            }
        };
        let Some(region) = region else {
            return cell.wait().clone();
        };
        let result = self
            .stage(region, served, max_rank as usize, expert_rank as usize)
            .map(Arc::new);
        let mut cache = self.lock();
        match &result {
            Ok(staged) => {
                while cache.order.len() >= self.options.max_staged.max(1) {
                    let Some(old) = cache.order.pop_front() else { break };
                    if let Some(Ok(s)) = cache.by_key.remove(&old).as_deref().and_then(StageCell::get) {
                        cache.by_region.remove(&s.region);
                    }
                }
                cache.by_region.insert(region, Arc::clone(staged));
                cache.order.push_back(key);
            }
            Err(_) => {
                cache.by_key.remove(&key);
            }
        }
        // Set while holding the lock: a waiter never sees a result whose
        // region is not yet readable.
        let _ = cell.set(result.clone());
        result
    }

    fn stage(&self, region: u32, served: &Served, max_rank: usize, expert_rank: usize) -> Result<Staged, PeerRefusal> {
        let staging_err = |e: &dyn std::fmt::Display| refuse(RefusalCode::Staging, e.to_string());
        let (text, infos) = read_header(&served.dir).map_err(|e| staging_err(&e))?;
        let prepared = prepare_adapter(&served.dir, &self.cfg, &self.audit_options(max_rank, expert_rank))
            .map_err(|e| staging_err(&e))?;
        // The manifest's config and header must describe the staged bytes.
        let (text_after, infos_after) = read_header(&served.dir).map_err(|e| staging_err(&e))?;
        if text_after != text || infos_after != infos {
            return Err(refuse(
                RefusalCode::Staging,
                "the adapter changed on disk while it was staged",
            ));
        }
        let mut staging = stage_adapter(&prepared, max_rank, expert_rank, self.options.max_stage_bytes)
            .map_err(|e| staging_err(&e))?;
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
        Ok(Staged {
            region,
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
        })
    }

    /// Resolve every range of a read request to its staged bytes, or refuse
    /// the whole request: an unknown region, or a range leaving its region.
    pub(crate) fn resolve(&self, ranges: &[ReadRange]) -> Result<Vec<ResolvedRange>, PeerRefusal> {
        let cache = self.lock();
        ranges
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let staged = cache.by_region.get(&r.region).ok_or_else(|| {
                    refuse(
                        RefusalCode::BadRead,
                        format!("range {i}: region {} is not staged", r.region),
                    )
                })?;
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
            .collect()
    }
}

#[cfg(test)]
mod tests;
