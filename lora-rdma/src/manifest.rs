//! The manifest a peer serves for one staged adapter, and its check against
//! the engine's own plan.
//!
//! The manifest says what the peer staged and where to read it; it never
//! says where bytes land. [`match_manifest`] pairs every entry with a pair
//! part the engine's own audit expects, with the length the engine's own
//! layout gives for its rank (a tensor-parallel rank's shard of each pair,
//! an expert-parallel rank's experts); anything else refuses the whole
//! manifest. The manifest names the placement it was staged for, and the
//! engine refuses one staged for another rank or another cut (its
//! [`WirePlacement`] carries the vocab-parallel and fully-sharded options
//! beside the ranks) before anything else.

use std::collections::{BTreeMap, BTreeSet};

use lora_layout::{ExpertProj, ExpertSite, LoraModule, PairKey, PairLayout, Placement, PlacementError};
use lora_pool::image::{PairMeta, PairPart};
use serde::{Deserialize, Serialize};

/// The largest number of entries a manifest may list (a DeepSeek-V3 with
/// every dense module and every expert of every layer adapted stays far
/// below it).
pub const MAX_MANIFEST_ENTRIES: usize = 1 << 20;

/// A pair part's name on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WirePart {
    /// A.
    A,
    /// B.
    B,
    /// A DoRA pair's magnitude `m` (f32 little-endian, one value per
    /// output row the rank holds).
    Magnitude,
}

impl WirePart {
    /// The image half this part lands in (`None` for a magnitude, which
    /// lands beside the images).
    pub fn pair_part(self) -> Option<PairPart> {
        match self {
            WirePart::A => Some(PairPart::A),
            WirePart::B => Some(PairPart::B),
            WirePart::Magnitude => None,
        }
    }
}

impl From<PairPart> for WirePart {
    fn from(p: PairPart) -> WirePart {
        match p {
            PairPart::A => WirePart::A,
            PairPart::B => WirePart::B,
        }
    }
}

/// A [`Placement`] on the wire: the tensor- and expert-parallel rank the
/// engine's pool holds and its cut options, which the peer stages for and
/// its manifest names.
///
/// The cut options travel as one flags byte ([`WirePlacement::VOCAB_PARALLEL`],
/// [`WirePlacement::FULLY_SHARDED`]); a bit outside
/// [`WirePlacement::KNOWN_FLAGS`] names no placement and is refused
/// ([`WirePlacementError::UnknownFlags`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WirePlacement {
    /// The tensor-parallel rank.
    pub tp_rank: u32,
    /// The tensor-parallel world size.
    pub tp_world: u32,
    /// The expert-parallel rank.
    pub ep_rank: u32,
    /// The expert-parallel world size.
    pub ep_world: u32,
    /// The cut options: [`WirePlacement::VOCAB_PARALLEL`] |
    /// [`WirePlacement::FULLY_SHARDED`].
    pub flags: u8,
}

/// Why a [`WirePlacement`] names no [`Placement`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WirePlacementError {
    /// A zero world, or a rank past its world.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// Flag bits this build does not know.
    #[error("placement flags {flags:#04x} carry unknown bits {unknown:#04x}")]
    UnknownFlags {
        /// The flags byte.
        flags: u8,
        /// Its bits outside [`WirePlacement::KNOWN_FLAGS`].
        unknown: u8,
    },
}

impl WirePlacement {
    /// Flag: the embedding and head pairs follow the vocab-parallel cut
    /// ([`Placement::vocab_parallel`]).
    pub const VOCAB_PARALLEL: u8 = 1 << 0;
    /// Flag: column-parallel A cut by rank rows
    /// ([`Placement::fully_sharded`]).
    pub const FULLY_SHARDED: u8 = 1 << 1;
    /// Every flag this build knows.
    pub const KNOWN_FLAGS: u8 = WirePlacement::VOCAB_PARALLEL | WirePlacement::FULLY_SHARDED;

    /// No tensor or expert parallelism, no cut option.
    pub const SINGLE: WirePlacement = WirePlacement {
        tp_rank: 0,
        tp_world: 1,
        ep_rank: 0,
        ep_world: 1,
        flags: 0,
    };

    /// The wire form of `p` (a world past `u32::MAX` saturates, and the
    /// peer refuses it).
    pub fn from_placement(p: Placement) -> WirePlacement {
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        WirePlacement {
            tp_rank: n(p.tp_rank()),
            tp_world: n(p.tp_world()),
            ep_rank: n(p.ep_rank()),
            ep_world: n(p.ep_world()),
            flags: flag(p.vocab_parallel(), WirePlacement::VOCAB_PARALLEL)
                | flag(p.fully_sharded(), WirePlacement::FULLY_SHARDED),
        }
    }

    /// The placement it names, or why it names none (unknown flag bits, a
    /// zero world, a rank past its world).
    pub fn to_placement(self) -> Result<Placement, WirePlacementError> {
        let unknown = self.flags & !WirePlacement::KNOWN_FLAGS;
        if unknown != 0 {
            return Err(WirePlacementError::UnknownFlags {
                flags: self.flags,
                unknown,
            });
        }
        Ok(Placement::new(self.tp_rank as usize, self.tp_world as usize)?
            .with_experts(self.ep_rank as usize, self.ep_world as usize)?
            .with_vocab_parallel(self.flags & WirePlacement::VOCAB_PARALLEL != 0)
            .with_fully_sharded(self.flags & WirePlacement::FULLY_SHARDED != 0))
    }
}

impl std::fmt::Display for WirePlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tp rank {}/{}, ep rank {}/{}",
            self.tp_rank, self.tp_world, self.ep_rank, self.ep_world
        )?;
        for (bit, name) in [
            (WirePlacement::VOCAB_PARALLEL, "vocab-parallel"),
            (WirePlacement::FULLY_SHARDED, "fully sharded"),
        ] {
            if self.flags & bit != 0 {
                write!(f, ", {name}")?;
            }
        }
        let unknown = self.flags & !WirePlacement::KNOWN_FLAGS;
        if unknown != 0 {
            write!(f, ", unknown flags {unknown:#04x}")?;
        }
        Ok(())
    }
}

/// A pair's name on the wire: a plain mirror of [`PairKey`] (modules and
/// projections by their index in `ALL`), converted back with checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WireKey {
    /// `PairKey::Dense`.
    Dense {
        /// Layer.
        layer: u32,
        /// `LoraModule::index()`.
        module: u8,
    },
    /// `PairKey::Expert` with an expert site.
    Expert {
        /// Layer.
        layer: u32,
        /// Expert index.
        expert: u32,
        /// `ExpertProj::index()`.
        proj: u8,
    },
    /// `PairKey::Expert` with the router site.
    Router {
        /// Layer.
        layer: u32,
    },
    /// `PairKey::Embedding`.
    Embedding,
    /// `PairKey::LmHead`.
    LmHead,
}

impl WireKey {
    /// The wire name of `key`.
    pub fn from_key(key: PairKey) -> WireKey {
        let layer = |l: usize| u32::try_from(l).unwrap_or(u32::MAX);
        match key {
            PairKey::Dense { layer: l, module } => WireKey::Dense {
                layer: layer(l),
                module: module.index() as u8,
            },
            PairKey::Expert {
                layer: l,
                site: ExpertSite::Expert { expert, proj },
            } => WireKey::Expert {
                layer: layer(l),
                expert: u32::try_from(expert).unwrap_or(u32::MAX),
                proj: proj.index() as u8,
            },
            PairKey::Expert {
                layer: l,
                site: ExpertSite::Router,
            } => WireKey::Router { layer: layer(l) },
            PairKey::Embedding => WireKey::Embedding,
            PairKey::LmHead => WireKey::LmHead,
        }
    }

    /// The pair this wire name denotes, or `None` for an unknown module or
    /// projection index.
    pub fn to_key(self) -> Option<PairKey> {
        Some(match self {
            WireKey::Dense { layer, module } => PairKey::Dense {
                layer: layer as usize,
                module: *LoraModule::ALL.get(module as usize)?,
            },
            WireKey::Expert { layer, expert, proj } => PairKey::Expert {
                layer: layer as usize,
                site: ExpertSite::Expert {
                    expert: expert as usize,
                    proj: *ExpertProj::ALL.get(proj as usize)?,
                },
            },
            WireKey::Router { layer } => PairKey::Expert {
                layer: layer as usize,
                site: ExpertSite::Router,
            },
            WireKey::Embedding => PairKey::Embedding,
            WireKey::LmHead => PairKey::LmHead,
        })
    }
}

/// Where the engine reads an entry's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Location {
    /// A byte range of a peer staging region, read over the TCP transport.
    Tcp {
        /// The peer's region id.
        region: u32,
        /// Byte offset in the region.
        offset: u64,
    },
    /// A remote address and key, read with RDMA READ.
    Rdma {
        /// Remote virtual address.
        addr: u64,
        /// Remote key of the registered region.
        rkey: u32,
    },
}

/// One staged tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// The pair it belongs to.
    pub key: WireKey,
    /// A, B or a DoRA pair's magnitude.
    pub part: WirePart,
    /// Bytes staged for the rank: A `rank * in_r * 2`, B `out_r * stride *
    /// 2`, a magnitude `out_r * 4`.
    pub len: u64,
    /// XXH64 of the staged bytes.
    pub checksum: u64,
    /// Where to read them.
    pub location: Location,
}

/// One tensor of the adapter's safetensors header, as the peer read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireTensor {
    /// The tensor key.
    pub name: String,
    /// Its dtype name (`F32`, `F16`, `BF16`, ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
}

/// What a peer staged for one adapter at one engine geometry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The adapter's name at the peer.
    pub adapter: String,
    /// Fingerprint of the model geometry it was audited against.
    pub model: u64,
    /// The slot pool's `max_rank` it was staged for.
    pub max_rank: u32,
    /// The expert pool's rank it was staged for.
    pub expert_rank: u32,
    /// The rank it was staged for: every entry is that rank's bytes.
    pub placement: WirePlacement,
    /// The adapter's `adapter_config.json`, verbatim: the engine audits it
    /// itself.
    pub adapter_config: String,
    /// The adapter's tensor header, for the engine's own audit.
    pub tensors: Vec<WireTensor>,
    /// The staged tensors.
    pub entries: Vec<ManifestEntry>,
}

/// Why a manifest was refused. Any of these refuses it whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// Staged for another model.
    #[error("manifest is for model {got:#018x}, this engine serves {expected:#018x}")]
    ModelMismatch {
        /// The engine's fingerprint.
        expected: u64,
        /// The manifest's.
        got: u64,
    },
    /// Staged at another rank.
    #[error("manifest is staged at {what} {got}, this engine needs {expected}")]
    RankMismatch {
        /// `max_rank` or `expert_rank`.
        what: &'static str,
        /// The engine's.
        expected: u32,
        /// The manifest's.
        got: u32,
    },
    /// Staged for another tensor- or expert-parallel rank, or another cut
    /// (the vocab-parallel or fully-sharded option on one side only).
    #[error("manifest is staged for {got}, this engine's pool is {expected}")]
    PlacementMismatch {
        /// The engine's placement.
        expected: WirePlacement,
        /// The manifest's.
        got: WirePlacement,
    },
    /// Too many entries.
    #[error("manifest lists {0} entries, over the limit")]
    TooManyEntries(usize),
    /// An entry names a module or projection that does not exist.
    #[error("entry {index} names no known pair ({key:?})")]
    UnknownKey {
        /// Entry index.
        index: usize,
        /// Its key.
        key: WireKey,
    },
    /// An entry names a pair the engine's audit does not expect.
    #[error("entry {index} ({key} {part:?}) is not a pair this engine's audit expects")]
    Unexpected {
        /// Entry index.
        index: usize,
        /// The pair.
        key: PairKey,
        /// A, B or the magnitude.
        part: WirePart,
    },
    /// The same (pair, part) twice.
    #[error("entry {index} repeats {key} {part:?}")]
    Duplicate {
        /// Entry index.
        index: usize,
        /// The pair.
        key: PairKey,
        /// A, B or the magnitude.
        part: WirePart,
    },
    /// An entry's length is not what the engine's layout gives.
    #[error("entry {index} ({key} {part:?}) is {got} bytes, this engine's layout needs {expected}")]
    Length {
        /// Entry index.
        index: usize,
        /// The pair.
        key: PairKey,
        /// A, B or the magnitude.
        part: WirePart,
        /// The manifest's length.
        got: u64,
        /// The layout's.
        expected: u64,
    },
    /// An expected pair has no entry.
    #[error("manifest has no entry for {key} {part:?}")]
    Missing {
        /// The pair.
        key: PairKey,
        /// A, B or the magnitude.
        part: WirePart,
    },
}

/// One checked read: the pair part it fills, how many bytes, their
/// checksum, and where the peer keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LandingOp {
    /// The pair.
    pub key: PairKey,
    /// A, B or the magnitude.
    pub part: WirePart,
    /// Bytes.
    pub len: usize,
    /// Expected XXH64.
    pub checksum: u64,
    /// Source.
    pub location: Location,
}

/// One pair part the engine expects to land, with the length its own layout
/// gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedPart {
    /// The pair.
    pub key: PairKey,
    /// A, B or the magnitude.
    pub part: WirePart,
    /// Bytes: A `rows * in * 2` (only the true rank's rows the place holds
    /// travel, `PairPlace::a_used_rows`: `rank` rows, or under the
    /// fully-sharded option the part of the rank's block below `rank`), B
    /// `out * stride * 2` (staged with its zero columns), a magnitude
    /// `out * 4`; `in` and `out` are the rank's (its place's dims).
    pub len: u64,
}

/// The parts of `pairs` (from the engine's own audit) in `layout` (the slot
/// layout for dense pairs, the adapter's expert layout for expert pairs).
/// `None` names a pair the layout does not hold.
pub fn expected_parts(layout: &impl PairLayout, pairs: &[PairMeta]) -> Result<Vec<ExpectedPart>, PairKey> {
    let stride = layout.stride();
    let mut parts = Vec::with_capacity(2 * pairs.len());
    for meta in pairs {
        let place = layout
            .position(meta.key)
            .and_then(|i| layout.place(i))
            .ok_or(meta.key)?;
        parts.push(ExpectedPart {
            key: meta.key,
            part: WirePart::A,
            len: (place.a_used_rows(stride, meta.rank).len() * place.in_dim * 2) as u64,
        });
        parts.push(ExpectedPart {
            key: meta.key,
            part: WirePart::B,
            len: (place.out_dim * stride * 2) as u64,
        });
    }
    Ok(parts)
}

/// The magnitude parts of the DoRA pairs `keys` (from the engine's own
/// audit) in `layout`: `out * 4` bytes each. `Err` names a pair the layout
/// does not hold.
pub fn expected_magnitudes(layout: &impl PairLayout, keys: &[PairKey]) -> Result<Vec<ExpectedPart>, PairKey> {
    keys.iter()
        .map(|&key| {
            let place = layout.position(key).and_then(|i| layout.place(i)).ok_or(key)?;
            Ok(ExpectedPart {
                key,
                part: WirePart::Magnitude,
                len: (place.out_dim * 4) as u64,
            })
        })
        .collect()
}

/// What a manifest must have been staged for: the engine's model, ranks
/// and placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// The model fingerprint.
    pub model: u64,
    /// The slot pool's `max_rank`.
    pub max_rank: u32,
    /// The expert pool's rank.
    pub expert_rank: u32,
    /// The pool's tensor- and expert-parallel rank.
    pub placement: WirePlacement,
}

/// The checks that need no audit: the manifest is for this model, these
/// ranks and this placement, and its entry count is in bounds.
/// [`match_manifest`] runs them first; a lander runs them before spending
/// an audit on the manifest.
pub fn check_identity(manifest: &Manifest, identity: &Identity) -> Result<(), ManifestError> {
    let Identity {
        model,
        max_rank,
        expert_rank,
        placement,
    } = *identity;
    if manifest.model != model {
        return Err(ManifestError::ModelMismatch {
            expected: model,
            got: manifest.model,
        });
    }
    for (what, want, got) in [
        ("max_rank", max_rank, manifest.max_rank),
        ("expert_rank", expert_rank, manifest.expert_rank),
    ] {
        if want != got {
            return Err(ManifestError::RankMismatch {
                what,
                expected: want,
                got,
            });
        }
    }
    if manifest.placement != placement {
        return Err(ManifestError::PlacementMismatch {
            expected: placement,
            got: manifest.placement,
        });
    }
    if manifest.entries.len() > MAX_MANIFEST_ENTRIES {
        return Err(ManifestError::TooManyEntries(manifest.entries.len()));
    }
    Ok(())
}

/// Check `manifest` against what the engine expects and return one
/// [`LandingOp`] per part. Refuses the whole manifest on any mismatch.
pub fn match_manifest(
    manifest: &Manifest,
    identity: &Identity,
    expected: &[ExpectedPart],
) -> Result<Vec<LandingOp>, ManifestError> {
    check_identity(manifest, identity)?;
    let want: BTreeMap<(PairKey, WirePart), u64> = expected.iter().map(|e| ((e.key, e.part), e.len)).collect();
    let mut ops = Vec::with_capacity(manifest.entries.len());
    let mut seen = BTreeSet::new();
    for (index, e) in manifest.entries.iter().enumerate() {
        let key = e.key.to_key().ok_or(ManifestError::UnknownKey { index, key: e.key })?;
        let part = e.part;
        let &len = want
            .get(&(key, part))
            .ok_or(ManifestError::Unexpected { index, key, part })?;
        if !seen.insert((key, part)) {
            return Err(ManifestError::Duplicate { index, key, part });
        }
        if e.len != len {
            return Err(ManifestError::Length {
                index,
                key,
                part,
                got: e.len,
                expected: len,
            });
        }
        ops.push(LandingOp {
            key,
            part,
            len: len as usize,
            checksum: e.checksum,
            location: e.location,
        });
    }
    if let Some(&(key, part)) = want.keys().find(|k| !seen.contains(*k)) {
        return Err(ManifestError::Missing { key, part });
    }
    Ok(ops)
}

#[cfg(test)]
mod tests;
