//! The host tier: audited, packed slot images kept in pinned host memory
//! behind the device slots, so promoting an adapter held there is one copy
//! into its slot (and the table refresh) — no file read, audit or parse.
//!
//! The tier is bounded by bytes ([`LoraOptions::host_tier_bytes`]), least
//! recently used first out, and never evicts a pinned name. An image is
//! tied to the files it came from ([`FileStamp`]): a changed file makes it
//! stale, and the next swap of that adapter goes to disk again. The tier
//! never touches the device: images are filled on the host (the prefetch
//! worker, [`crate::prefetch`]) and copied by the pool's publish.
//!
//! [`LoraOptions::host_tier_bytes`]: lora_audit::LoraOptions::host_tier_bytes

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use half::bf16;
use lora_audit::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, HostOverlay};
use lora_kernels::PinnedHostBuffer;
use lora_layout::ExpertLayout;

use crate::dora::DoraMagnitudes;
use crate::image::{PairMeta, SlotImage};

/// Length and modification time of an adapter's config and weights files
/// (`adapter_model.safetensors`, else `adapter_model.bin`): an image is
/// served only while they are what they were when it was audited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileStamp(Vec<(PathBuf, u64, Option<SystemTime>)>);

impl FileStamp {
    /// The stamp of the adapter in `dir` (I/O errors as they come).
    pub(crate) fn of(dir: &Path) -> std::io::Result<FileStamp> {
        let weights = dir.join(ADAPTER_WEIGHTS);
        let weights = if weights.is_file() {
            weights
        } else {
            dir.join("adapter_model.bin")
        };
        let mut files = Vec::with_capacity(2);
        for path in [dir.join(ADAPTER_CONFIG), weights] {
            let meta = std::fs::metadata(&path)?;
            files.push((path, meta.len(), meta.modified().ok()));
        }
        Ok(FileStamp(files))
    }
}

/// One adapter's slot image, ready to be copied into any slot.
pub(crate) struct HostImage {
    /// The directory it was read from, and its files' stamp then.
    pub(crate) dir: PathBuf,
    pub(crate) stamp: FileStamp,
    /// The whole dense slot image (rank padding and unadapted places zero).
    pub(crate) dense: PinnedHostBuffer<bf16>,
    pub(crate) dense_pairs: Vec<PairMeta>,
    pub(crate) experts: Option<Arc<(ExpertLayout, SlotImage)>>,
    /// Expert or router pairs on some rank of the expert-parallel group.
    pub(crate) group_expert_deltas: bool,
    pub(crate) overlay: HostOverlay,
    pub(crate) has_overlay: bool,
    /// A DoRA adapter's magnitudes: its rescale is computed from them and
    /// the pool's base weights when it is promoted, as a disk swap's is.
    pub(crate) dora: Option<DoraMagnitudes>,
}

impl HostImage {
    /// Host bytes the image holds (what the tier's budget counts).
    pub(crate) fn bytes(&self) -> usize {
        let experts = self.experts.as_ref().map_or(0, |e| 2 * e.1.as_elems().len());
        let magnitudes = self
            .dora
            .as_ref()
            .map_or(0, |d| d.pairs.iter().map(|p| 4 * p.magnitude.len()).sum());
        (2 * self.dense.len())
            .saturating_add(experts)
            .saturating_add(magnitudes)
    }

    /// Whether the image is still what `dir` holds.
    pub(crate) fn is_current(&self, dir: &Path) -> bool {
        self.dir == dir && FileStamp::of(dir).is_ok_and(|now| now == self.stamp)
    }
}

/// Why an image did not enter the tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    /// The pool has no host tier (`host_tier_bytes` is 0).
    #[error("the pool has no host tier (LORA_HOST_TIER_BYTES is 0)")]
    Disabled,
    /// The image is larger than the whole tier.
    #[error("adapter `{adapter}`: its image of {bytes} bytes exceeds the host tier's {budget}")]
    TooLarge {
        /// The adapter.
        adapter: String,
        /// The image's bytes.
        bytes: usize,
        /// The tier's budget in bytes.
        budget: usize,
    },
    /// Pinned names hold so much of the tier that the image cannot fit.
    #[error("adapter `{adapter}`: {bytes} bytes do not fit the host tier: {pinned} of its {budget} bytes are pinned")]
    Pinned {
        /// The adapter.
        adapter: String,
        /// The image's bytes.
        bytes: usize,
        /// Bytes held by pinned names.
        pinned: usize,
        /// The tier's budget in bytes.
        budget: usize,
    },
}

/// What the host tier holds ([`LoraPool::host_tier`](crate::LoraPool::host_tier)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTierView {
    /// The adapters held, least recently used first.
    pub names: Vec<String>,
    /// Those of them pinned (kept from eviction), sorted.
    pub pinned: Vec<String>,
    /// Bytes their images hold.
    pub used: usize,
    /// Bytes the tier may hold.
    pub budget: usize,
}

/// A tier entry: the image and when it was last used.
struct Entry {
    image: Arc<HostImage>,
    bytes: usize,
    last_used: u64,
}

/// The images, their byte budget, LRU order and pins.
pub(crate) struct HostTier {
    budget: usize,
    used: usize,
    clock: u64,
    entries: HashMap<String, Entry>,
    pinned: HashSet<String>,
}

impl HostTier {
    /// An empty tier of `budget` bytes.
    pub(crate) fn new(budget: usize) -> HostTier {
        HostTier {
            budget,
            used: 0,
            clock: 0,
            entries: HashMap::new(),
            pinned: HashSet::new(),
        }
    }

    /// What the tier holds now.
    pub(crate) fn view(&self) -> HostTierView {
        let mut names: Vec<(&String, u64)> = self.entries.iter().map(|(n, e)| (n, e.last_used)).collect();
        names.sort_by_key(|&(_, t)| t);
        let mut pinned: Vec<String> = self.pinned.iter().cloned().collect();
        pinned.sort();
        HostTierView {
            names: names.into_iter().map(|(n, _)| n.clone()).collect(),
            pinned,
            used: self.used,
            budget: self.budget,
        }
    }

    /// `name`'s image, marked as just used.
    pub(crate) fn get(&mut self, name: &str) -> Option<Arc<HostImage>> {
        self.clock += 1;
        let clock = self.clock;
        let entry = self.entries.get_mut(name)?;
        entry.last_used = clock;
        Some(Arc::clone(&entry.image))
    }

    /// Hold `image` as `name` (replacing an earlier image of that name),
    /// evicting least recently used unpinned names until it fits. Refused,
    /// with the tier unchanged, when it cannot fit.
    pub(crate) fn insert(&mut self, name: &str, image: HostImage) -> Result<(), TierError> {
        let bytes = image.bytes();
        if bytes > self.budget {
            return Err(TierError::TooLarge {
                adapter: name.to_string(),
                bytes,
                budget: self.budget,
            });
        }
        let pinned: usize = self
            .entries
            .iter()
            .filter(|(n, _)| self.pinned.contains(*n) && n.as_str() != name)
            .map(|(_, e)| e.bytes)
            .sum();
        if pinned.saturating_add(bytes) > self.budget {
            return Err(TierError::Pinned {
                adapter: name.to_string(),
                bytes,
                pinned,
                budget: self.budget,
            });
        }
        if let Some(old) = self.entries.remove(name) {
            self.used -= old.bytes;
        }
        while self.used + bytes > self.budget {
            let victim = self
                .entries
                .iter()
                .filter(|(n, _)| !self.pinned.contains(*n))
                .min_by_key(|(_, e)| e.last_used)
                .map(|(n, _)| n.clone());
            // Unpinned bytes are enough (checked above), so a victim exists.
            let Some(victim) = victim else { break };
            self.remove(&victim);
        }
        self.clock += 1;
        self.used += bytes;
        self.entries.insert(
            name.to_string(),
            Entry {
                image: Arc::new(image),
                bytes,
                last_used: self.clock,
            },
        );
        Ok(())
    }

    /// Drop `name`'s image (a copy from it still queued finishes first:
    /// the publish holds the image until then).
    pub(crate) fn remove(&mut self, name: &str) -> bool {
        match self.entries.remove(name) {
            Some(e) => {
                self.used -= e.bytes;
                true
            }
            None => false,
        }
    }

    /// Keep `name` (now or when it arrives) from eviction, or release it.
    pub(crate) fn pin(&mut self, name: &str, pinned: bool) {
        if pinned {
            self.pinned.insert(name.to_string());
        } else {
            self.pinned.remove(name);
        }
    }
}

#[cfg(test)]
mod tests;
