//! The engine side of a peer landing: check a manifest against the engine's
//! own audit and layout, land every part into fresh host images, verify.
//!
//! A placed engine (a tensor- or expert-parallel rank's pool) asks for its
//! rank's bytes only: its request names its placement, cut options
//! included (vocab-parallel, fully sharded), the manifest must name the
//! same, and every entry's length must be what the rank's own layout gives
//! (A of the rank's input columns and, fully sharded, of its block of rank
//! rows; B of its output rows; the embedding and head pairs' vocabulary
//! block under the vocab-parallel cut; the rank's experts and the router),
//! so the landed images are the bytes the rank's disk swap packs. A DoRA pair's magnitude lands beside the images
//! ([`Landed::dora`]); the pool computes its rescale from it and its own
//! base weights when it publishes.
//!
//! The peer never chooses where bytes go: every landing region is
//! [`SlotImage::region_mut`] of a pair the engine's own audit of the
//! adapter's config and tensor header expects, at the length its own layout
//! gives. The images are touched only once the manifest passed that check;
//! from then on any failure replaces both with fresh zeroed images, so a
//! target handed over empty is left empty and nothing is published.
//!
//! Every part is checked (its XXH64, and a B's padding columns for zeros)
//! before anything is published. On a host of few cores each part is
//! checked on the receiving thread as soon as the transport says it landed
//! ([`LandingSink::landed`]), while the next part's bytes are on the wire;
//! otherwise, and for any part the transport did not say landed or asked
//! for again afterwards, once the read returns, in parallel. A part that
//! fails is reported the same way either way ([`LandingTuning`]).
//!
//! The fresh images are advised onto transparent huge pages before the
//! first byte lands, and on a host with cores to spare a helper thread
//! faults their pages in ahead of the bytes (`pages`): first-touch faults
//! otherwise cost about as much as the copy itself.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use lora_audit::{AuditError, AuditReport, LoraOptions, TensorDtype, TensorInfo, audit_header};
use lora_layout::{ExpertLayout, LayoutError, ModelConfig, PairKey, PairLayout, PairPlace, SlotLayout};
use lora_pool::image::{ImageError, PairMeta, PairPart, SlotImage};
use lora_pool::{DoraMagnitude, DoraMagnitudes, LandedImages};
use rayon::prelude::*;

use crate::checksum::xxh64;
use crate::fingerprint::model_fingerprint;
use crate::manifest::{
    ExpectedPart, Identity, Location, Manifest, ManifestError, WirePart, WirePlacement, WireTensor, check_identity,
    expected_magnitudes, expected_parts, match_manifest,
};
use crate::transport::{LandingSink, ReadOp, Transport, TransportError};

mod pages;

/// Where the victim slot's images live until the pool publishes them.
///
/// Once the manifest passed its check, the lander replaces both with fresh
/// zeroed images of the right layouts (so their previous content never
/// matters) and fills them; if anything fails after that, it replaces them
/// with fresh zeroed images again.
pub trait LandingTarget {
    /// The dense image (engine slot layout) and the expert image (the
    /// adapter's expert layout).
    fn images(&mut self) -> (&mut SlotImage, &mut SlotImage);
}

/// A [`LandingTarget`] that simply owns the two images: what tests land
/// into, and what a pool can publish from.
#[derive(Debug, Clone)]
pub struct HostLanding {
    dense: SlotImage,
    experts: SlotImage,
}

impl HostLanding {
    /// Empty images for `layout` (and no expert pairs).
    pub fn new(layout: &SlotLayout) -> HostLanding {
        HostLanding {
            dense: SlotImage::zeroed(layout),
            experts: SlotImage::zeroed(&NoPairs),
        }
    }

    /// The dense image.
    pub fn dense(&self) -> &SlotImage {
        &self.dense
    }

    /// The expert image.
    pub fn experts(&self) -> &SlotImage {
        &self.experts
    }

    /// Both images, for publishing.
    pub fn into_images(self) -> (SlotImage, SlotImage) {
        (self.dense, self.experts)
    }
}

impl LandingTarget for HostLanding {
    fn images(&mut self) -> (&mut SlotImage, &mut SlotImage) {
        (&mut self.dense, &mut self.experts)
    }
}

/// The layout of an image with no pairs: the expert image of an adapter
/// without expert deltas, before any landing.
struct NoPairs;

impl PairLayout for NoPairs {
    fn stride(&self) -> usize {
        1
    }
    fn total_bytes(&self) -> usize {
        0
    }
    fn len(&self) -> usize {
        0
    }
    fn place(&self, _: usize) -> Option<PairPlace> {
        None
    }
    fn position(&self, _: PairKey) -> Option<usize> {
        None
    }
}

/// Why a landing failed. Any of these leaves the target's images fresh and
/// zeroed.
#[derive(Debug, thiserror::Error)]
pub enum LandError {
    /// Talking to the peer failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The manifest does not match what the engine expects.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The manifest is for another adapter than the one asked for.
    #[error("asked for adapter `{asked}`, the peer's manifest is for `{got}`")]
    AdapterName {
        /// The name asked for.
        asked: String,
        /// The manifest's.
        got: String,
    },
    /// A tensor of the manifest's header cannot be represented.
    #[error("manifest tensor `{name}`: {reason}")]
    Tensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The engine's audit of the manifest's config could not run.
    #[error(transparent)]
    Audit(#[from] AuditError),
    /// The engine's own audit refuses the adapter.
    #[error("the engine's audit refuses `{}`: {:?}", .0.adapter, .0.refused_codes())]
    Refused(Box<AuditReport>),
    /// The adapter has token overlays, which the peer protocol does not carry.
    #[error("adapter `{0}` has token overlays; peer landing carries LoRA pairs only")]
    Overlay(String),
    /// The engine's limits do not fit the wire (a rank above `u32::MAX`) or
    /// its layout overflows.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A pair the audit placed has no place in the layout.
    #[error("{0}: no place in the engine's layout")]
    NotInLayout(PairKey),
    /// Declaring a pair in an image failed.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// Landed bytes do not have the manifest's checksum.
    #[error("{key} {part:?}: checksum {got:#018x}, the manifest says {expected:#018x}")]
    Checksum {
        /// The pair.
        key: PairKey,
        /// A, B or the magnitude.
        part: WirePart,
        /// The manifest's.
        expected: u64,
        /// The landed bytes'.
        got: u64,
    },
    /// A landed DoRA magnitude holds a value that is not finite.
    #[error("{key}: magnitude value {index} is {value}; every magnitude must be finite")]
    NonFiniteMagnitude {
        /// The pair.
        key: PairKey,
        /// The output row.
        index: usize,
        /// The value.
        value: f32,
    },
    /// A landed B has non-zero columns past its rank.
    #[error("{key}: B has non-zero padding columns past rank {rank}")]
    Padding {
        /// The pair.
        key: PairKey,
        /// Its rank.
        rank: usize,
    },
}

/// Which buffer a part lands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Image {
    Dense,
    Experts,
    /// The DoRA magnitudes, beside the images.
    Magnitudes,
}

/// One checked part: where it lands (computed locally), what it must hash
/// to, and where the peer keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedPart {
    /// The pair.
    pub key: PairKey,
    /// A, B or a DoRA pair's magnitude.
    pub part: WirePart,
    /// The pair's rank (from the engine's audit).
    pub rank: usize,
    /// The layout's rank stride.
    pub stride: usize,
    /// Byte range in its image (a magnitude's: in the magnitudes beside
    /// the images, [`LandingPlan::magnitudes`]).
    pub range: Range<usize>,
    /// Expected XXH64.
    pub checksum: u64,
    /// Where the peer keeps it.
    pub location: Location,
}

impl PlannedPart {
    fn image(&self) -> Image {
        match (self.part, self.key) {
            (WirePart::Magnitude, _) => Image::Magnitudes,
            (_, PairKey::Dense { .. } | PairKey::Embedding | PairKey::LmHead) => Image::Dense,
            (_, PairKey::Expert { .. }) => Image::Experts,
        }
    }
}

/// A manifest that passed the check: the engine's own audit, pair metas
/// and landing parts.
#[derive(Debug, Clone)]
pub struct LandingPlan {
    /// The engine's audit of the manifest's config and tensor header.
    pub report: AuditReport,
    /// Dense pairs, rank and scale from that audit.
    pub dense: Vec<PairMeta>,
    /// Expert and router pairs, rank and scale from that audit.
    pub experts: Vec<PairMeta>,
    /// The adapter's expert layout at the engine's expert rank.
    pub expert_layout: ExpertLayout,
    /// The DoRA pairs, each with its magnitude's byte range in the
    /// magnitudes that land beside the images (computed locally, in the
    /// audit's order).
    pub magnitudes: Vec<(PairKey, Range<usize>)>,
    /// One part per manifest entry, in manifest order.
    pub parts: Vec<PlannedPart>,
}

impl LandingPlan {
    /// Bytes of the magnitudes beside the images.
    fn magnitude_bytes(&self) -> usize {
        self.magnitudes.iter().map(|(_, r)| r.end).max().unwrap_or(0)
    }

    /// Bytes that travel.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.range.len()).sum()
    }
}

/// A landed, verified adapter, ready to publish from the target's images.
#[derive(Debug, Clone)]
pub struct Landed {
    /// The adapter's name.
    pub adapter: String,
    /// The engine's audit.
    pub report: AuditReport,
    /// Dense pairs the dense image holds.
    pub dense: Vec<PairMeta>,
    /// Expert and router pairs the expert image holds.
    pub experts: Vec<PairMeta>,
    /// The expert image's layout.
    pub expert_layout: ExpertLayout,
    /// Whether the adapter has expert or router pairs on some rank of the
    /// expert-parallel group (this rank may hold none).
    pub group_expert_deltas: bool,
    /// A DoRA adapter's landed magnitudes, with the engine's audit.
    pub dora: Option<DoraMagnitudes>,
    /// Bytes landed.
    pub bytes: usize,
}

impl Landed {
    /// What [`lora_pool::LoraPool::publish_landed`] takes: this landing's
    /// facts with the target's images.
    pub fn into_images(self, dense: SlotImage, experts: SlotImage) -> LandedImages {
        LandedImages {
            dense,
            experts: (!self.experts.is_empty()).then_some((self.expert_layout, experts)),
            group_expert_deltas: self.group_expert_deltas,
            dora: self.dora,
        }
    }
}

/// How a landing spends the host's cores. [`Lander::new`] takes
/// [`LandingTuning::for_host`]; [`Lander::with_tuning`] sets another. Every
/// choice lands the same bytes and refuses the same peers: only where the
/// work runs differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LandingTuning {
    /// Fault the pages the parts land in from a helper thread, ahead of the
    /// bytes, so the receiving thread only copies (the kernel zeroes a
    /// fresh page before its first write; on a host with slow memory that
    /// is most of a core for the landing's length).
    pub populate_ahead: bool,
    /// Check each part on the receiving thread as soon as the transport
    /// says it landed, while the next part's bytes are on the wire;
    /// otherwise every part is checked in parallel once the read returns.
    pub check_as_landed: bool,
}

impl LandingTuning {
    /// The fewest cores at which the helpers pay: the receiving thread, the
    /// kernel's network work, the populating helper and, in the benchmark,
    /// a peer on the same host each keep one busy. Measured on the 84 MB
    /// benchmark over loopback: on 2 cores the helper cost more than it
    /// saved (80 % of the plain socket copy's rate against 97 % without),
    /// and checking each part as it landed beat the parallel check after
    /// the read (97 % against 89 %); on 16 cores the helper and the
    /// parallel check after the read gave 95–105 %, against 55–66 % for the
    /// 2-core choice.
    pub const SPARE_CORES_FROM: usize = 4;

    /// The choice for a host of `cores` cores.
    pub fn for_cores(cores: usize) -> LandingTuning {
        let spare = cores >= LandingTuning::SPARE_CORES_FROM;
        LandingTuning {
            populate_ahead: spare,
            check_as_landed: !spare,
        }
    }

    /// The choice for this host's available parallelism.
    pub fn for_host() -> LandingTuning {
        LandingTuning::for_cores(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

/// The engine's side of peer landing, for one model and pool geometry.
#[derive(Debug, Clone)]
pub struct Lander {
    cfg: ModelConfig,
    opts: LoraOptions,
    layout: SlotLayout,
    identity: Identity,
    tuning: LandingTuning,
}

fn wire_rank(rank: usize) -> Result<u32, LayoutError> {
    u32::try_from(rank).map_err(|_| LayoutError::Overflow {
        what: "rank on the wire",
    })
}

impl Lander {
    /// A lander for `cfg` with the pool limits of `opts` (`max_rank`,
    /// `expert_rank`, `experts`, `allow_partial`, `dora`) and its rank
    /// (`placement`, its cut options included): it asks the peer for that
    /// rank's bytes and lands them into the rank's layout.
    pub fn new(cfg: ModelConfig, opts: LoraOptions) -> Result<Lander, LandError> {
        let layout = opts.slot_layout(&cfg)?;
        Ok(Lander {
            identity: Identity {
                model: model_fingerprint(&cfg),
                max_rank: wire_rank(opts.max_rank)?,
                expert_rank: wire_rank(opts.expert_rank)?,
                placement: WirePlacement::from_placement(opts.placement),
            },
            cfg,
            opts,
            layout,
            tuning: LandingTuning::for_host(),
        })
    }

    /// This lander with `tuning` instead of the host's default.
    pub fn with_tuning(mut self, tuning: LandingTuning) -> Lander {
        self.tuning = tuning;
        self
    }

    /// How this lander spends the host's cores.
    pub fn tuning(&self) -> LandingTuning {
        self.tuning
    }

    /// The engine's slot layout.
    pub fn layout(&self) -> &SlotLayout {
        &self.layout
    }

    /// The engine's model fingerprint.
    pub fn fingerprint(&self) -> u64 {
        self.identity.model
    }

    /// Check `manifest` for `adapter`: identity, the engine's own audit of
    /// its config and tensor header, then every entry against the parts
    /// that audit and the engine's layouts expect. Refuses it whole on any
    /// mismatch.
    pub fn check(&self, adapter: &str, manifest: &Manifest) -> Result<LandingPlan, LandError> {
        if manifest.adapter != adapter {
            return Err(LandError::AdapterName {
                asked: adapter.to_string(),
                got: manifest.adapter.clone(),
            });
        }
        check_identity(manifest, &self.identity)?;
        let tensors = manifest
            .tensors
            .iter()
            .map(tensor_info)
            .collect::<Result<Vec<_>, _>>()?;
        let report = audit_header(adapter, &manifest.adapter_config, tensors, &self.cfg, &self.opts)?;
        if !report.is_servable() {
            return Err(LandError::Refused(Box::new(report)));
        }
        if !report.overlay.is_empty() {
            return Err(LandError::Overlay(adapter.to_string()));
        }
        let dense: Vec<PairMeta> = report
            .placed
            .iter()
            .map(|p| {
                let key = PairKey::Dense {
                    layer: p.layer,
                    module: p.module,
                };
                PairMeta {
                    key,
                    rank: p.rank,
                    scale: p.scale,
                }
            })
            .chain(report.embedding.as_ref().map(|e| PairMeta {
                key: PairKey::Embedding,
                rank: e.rank,
                scale: e.scale,
            }))
            .chain(report.lm_head.as_ref().map(|e| PairMeta {
                key: PairKey::LmHead,
                rank: e.rank,
                scale: e.scale,
            }))
            .collect();
        let experts: Vec<PairMeta> = report
            .experts
            .iter()
            .map(|p| {
                let key = PairKey::Expert {
                    layer: p.layer,
                    site: p.site,
                };
                PairMeta {
                    key,
                    rank: p.rank,
                    scale: p.scale,
                }
            })
            .collect();
        let expert_layout = ExpertLayout::new(
            &self.cfg,
            self.opts.expert_rank,
            report.experts.iter().map(|p| (p.layer, p.site)),
        )?;
        let dora_keys: Vec<PairKey> = report
            .placed
            .iter()
            .filter(|p| p.magnitude_key.is_some())
            .map(|p| PairKey::Dense {
                layer: p.layer,
                module: p.module,
            })
            .collect();
        let mut expected: Vec<ExpectedPart> = expected_parts(&self.layout, &dense).map_err(LandError::NotInLayout)?;
        expected.extend(expected_parts(&expert_layout, &experts).map_err(LandError::NotInLayout)?);
        let magnitude_parts = expected_magnitudes(&self.layout, &dora_keys).map_err(LandError::NotInLayout)?;
        let mut magnitudes = Vec::with_capacity(magnitude_parts.len());
        let mut at = 0usize;
        for m in &magnitude_parts {
            let len = m.len as usize;
            magnitudes.push((m.key, at..at + len));
            at += len;
        }
        expected.extend(magnitude_parts);
        let ops = match_manifest(manifest, &self.identity, &expected)?;
        let ranks: HashMap<PairKey, usize> = dense.iter().chain(&experts).map(|m| (m.key, m.rank)).collect();
        let parts = ops
            .iter()
            .map(|op| {
                let (place, stride) = match op.key {
                    PairKey::Dense { .. } | PairKey::Embedding | PairKey::LmHead => {
                        (place_of(&self.layout, op.key), self.layout.stride())
                    }
                    PairKey::Expert { .. } => (place_of(&expert_layout, op.key), expert_layout.stride()),
                };
                let place = place.ok_or(LandError::NotInLayout(op.key))?;
                let start = match op.part {
                    WirePart::A => place.a_offset,
                    WirePart::B => place.b_offset,
                    WirePart::Magnitude => magnitudes
                        .iter()
                        .find(|(key, _)| *key == op.key)
                        .map(|(_, r)| r.start)
                        .ok_or(LandError::NotInLayout(op.key))?,
                };
                Ok(PlannedPart {
                    key: op.key,
                    part: op.part,
                    rank: *ranks.get(&op.key).ok_or(LandError::NotInLayout(op.key))?,
                    stride,
                    range: start..start + op.len,
                    checksum: op.checksum,
                    location: op.location,
                })
            })
            .collect::<Result<Vec<_>, LandError>>()?;
        Ok(LandingPlan {
            report,
            dense,
            experts,
            expert_layout,
            magnitudes,
            parts,
        })
    }

    /// Fetch `adapter`'s manifest over `transport`, check it, land every
    /// part into `target`'s images and verify every checksum. On error the
    /// images are fresh and zeroed again.
    pub fn land(
        &self,
        transport: &mut dyn Transport,
        adapter: &str,
        target: &mut dyn LandingTarget,
    ) -> Result<Landed, LandError> {
        let manifest = transport.fetch_manifest(
            adapter,
            self.identity.max_rank,
            self.identity.expert_rank,
            self.identity.placement,
        )?;
        let plan = self.check(adapter, &manifest)?;
        drop(manifest);
        let (dense, experts) = target.images();
        let mut magnitudes = vec![0u8; plan.magnitude_bytes()];
        let result = self
            .land_plan(transport, &plan, dense, experts, &mut magnitudes)
            .and_then(|()| dora_magnitudes(&plan, &magnitudes));
        if result.is_err() {
            *dense = SlotImage::zeroed(&self.layout);
            *experts = SlotImage::zeroed(&plan.expert_layout);
        }
        let pairs = result?;
        let bytes = plan.bytes();
        let group_expert_deltas = plan.report.group_expert_pairs > 0;
        let dora = (!pairs.is_empty()).then(|| DoraMagnitudes {
            report: plan.report.clone(),
            pairs,
        });
        Ok(Landed {
            adapter: adapter.to_string(),
            report: plan.report,
            dense: plan.dense,
            experts: plan.experts,
            expert_layout: plan.expert_layout,
            group_expert_deltas,
            dora,
            bytes,
        })
    }

    fn land_plan(
        &self,
        transport: &mut dyn Transport,
        plan: &LandingPlan,
        dense: &mut SlotImage,
        experts: &mut SlotImage,
        magnitudes: &mut [u8],
    ) -> Result<(), LandError> {
        *dense = SlotImage::zeroed(&self.layout);
        *experts = SlotImage::zeroed(&plan.expert_layout);
        // Before the first byte lands: fresh pages fault in 2 MiB at a time.
        let advised: Vec<Range<usize>> = [
            pages::advise_huge_pages(dense.as_bytes()),
            pages::advise_huge_pages(experts.as_bytes()),
        ]
        .into_iter()
        .flatten()
        .collect();
        for meta in &plan.dense {
            dense.declare(&self.layout, *meta)?;
        }
        for meta in &plan.experts {
            experts.declare(&plan.expert_layout, *meta)?;
        }
        let ops: Vec<ReadOp> = plan
            .parts
            .iter()
            .map(|p| ReadOp {
                location: p.location,
                len: p.range.len(),
            })
            .collect();
        // The pages the parts land in, for the helper to fault in ahead.
        let bases = [dense.as_bytes().as_ptr() as usize, experts.as_bytes().as_ptr() as usize];
        let addresses = plan.parts.iter().filter(|p| p.image() != Image::Magnitudes).map(|p| {
            let base = bases[usize::from(p.image() == Image::Experts)];
            base + p.range.start..base + p.range.end
        });
        let spans = match pages::page_size() {
            Some(page) if self.tuning.populate_ahead && !advised.is_empty() => {
                pages::landing_spans(addresses, &advised, page)
            }
            _ => Vec::new(),
        };
        let stop = AtomicBool::new(false);
        let (read, states) = std::thread::scope(|scope| {
            if !spans.is_empty() {
                // Without the helper (no thread to be had) the first writes
                // fault the pages in, as they would anyway.
                let _ = std::thread::Builder::new()
                    .name("lora-land-pages".into())
                    .spawn_scoped(scope, || {
                        // SAFETY: the spans are whole pages inside the two
                        // images' heap allocations (`landing_spans` keeps
                        // them to what `advise_huge_pages` found inside
                        // each), which this function holds by `&mut` and
                        // neither frees nor reallocates before the scope
                        // has joined this thread.
                        unsafe { pages::populate(&spans, &stop) }
                    });
            }
            let mut sink = ImageSink {
                layout: &self.layout,
                expert_layout: &plan.expert_layout,
                dense: &mut *dense,
                experts: &mut *experts,
                magnitudes: &mut *magnitudes,
                parts: &plan.parts,
                states: vec![PartState::Waiting; plan.parts.len()],
                check_as_landed: self.tuning.check_as_landed,
            };
            let read = transport.read(&ops, &mut sink);
            stop.store(true, Ordering::Relaxed);
            (read, sink.states)
        });
        read?;
        verify(&plan.parts, &states, [dense.as_bytes(), experts.as_bytes(), magnitudes])
    }
}

/// The landed magnitudes of `plan`'s DoRA pairs as f32, each checked
/// finite.
fn dora_magnitudes(plan: &LandingPlan, bytes: &[u8]) -> Result<Vec<DoraMagnitude>, LandError> {
    plan.magnitudes
        .iter()
        .map(|(key, range)| {
            let PairKey::Dense { layer, module } = *key else {
                return Err(LandError::NotInLayout(*key));
            };
            let raw = bytes.get(range.clone()).ok_or(LandError::NotInLayout(*key))?;
            let magnitude: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some((index, &value)) = magnitude.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(LandError::NonFiniteMagnitude {
                    key: *key,
                    index,
                    value,
                });
            }
            Ok(DoraMagnitude {
                layer,
                module,
                magnitude,
            })
        })
        .collect()
}

/// A tensor of the manifest's header as the audit reads it.
fn tensor_info(t: &WireTensor) -> Result<TensorInfo, LandError> {
    let shape = t
        .shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| LandError::Tensor {
            name: t.name.clone(),
            reason: format!("shape {:?} does not fit this host", t.shape),
        })?;
    Ok(TensorInfo {
        name: t.name.clone(),
        dtype: dtype_from_name(&t.dtype),
        shape,
    })
}

/// A dtype name as safetensors (and [`TensorDtype`]'s `Display`) spells it.
pub(crate) fn dtype_from_name(name: &str) -> TensorDtype {
    match name {
        "F32" => TensorDtype::F32,
        "F16" => TensorDtype::F16,
        "BF16" => TensorDtype::BF16,
        "I64" => TensorDtype::I64,
        "I32" => TensorDtype::I32,
        "F64" => TensorDtype::Other("F64"),
        "I8" => TensorDtype::Other("I8"),
        "U8" => TensorDtype::Other("U8"),
        "I16" => TensorDtype::Other("I16"),
        "U16" => TensorDtype::Other("U16"),
        "U32" => TensorDtype::Other("U32"),
        "U64" => TensorDtype::Other("U64"),
        "BOOL" => TensorDtype::Other("BOOL"),
        _ => TensorDtype::Other("an unsupported dtype"),
    }
}

fn place_of(layout: &impl PairLayout, key: PairKey) -> Option<PairPlace> {
    layout.position(key).and_then(|i| layout.place(i))
}

/// Where a part's bytes stand while a read is in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartState {
    /// Not handed to the transport yet.
    Waiting,
    /// Handed out, and maybe being written.
    Handed,
    /// Told landed and checked since it was last handed out: its checksum
    /// and padding hold, and the transport cannot write it any more
    /// without asking for it again (which makes it `Handed` again).
    Checked,
}

/// Hands the transport each part's landing region, and (with
/// `check_as_landed`) checks each part as soon as the transport says it is
/// filled, while its bytes are in cache and the next part's are on the
/// wire.
struct ImageSink<'a> {
    layout: &'a SlotLayout,
    expert_layout: &'a ExpertLayout,
    dense: &'a mut SlotImage,
    experts: &'a mut SlotImage,
    magnitudes: &'a mut [u8],
    parts: &'a [PlannedPart],
    states: Vec<PartState>,
    check_as_landed: bool,
}

impl LandingSink for ImageSink<'_> {
    fn region(&mut self, index: usize) -> Result<&mut [u8], TransportError> {
        let part = self.parts.get(index).ok_or(TransportError::NoSuchOp(index))?;
        if let Some(state) = self.states.get_mut(index) {
            *state = PartState::Handed;
        }
        let half = part.part.pair_part().unwrap_or(PairPart::A);
        let region = match part.image() {
            Image::Dense => self.dense.region_mut(self.layout, part.key, half)?,
            Image::Experts => self.experts.region_mut(self.expert_layout, part.key, half)?,
            Image::Magnitudes => self
                .magnitudes
                .get_mut(part.range.clone())
                .ok_or(TransportError::NoSuchOp(index))?,
        };
        Ok(region)
    }

    fn landed(&mut self, index: usize) {
        if !self.check_as_landed {
            return;
        }
        let (Some(part), Some(state)) = (self.parts.get(index), self.states.get_mut(index)) else {
            return;
        };
        if *state != PartState::Handed {
            return;
        }
        let image = match part.image() {
            Image::Dense => self.dense.as_bytes(),
            Image::Experts => self.experts.as_bytes(),
            Image::Magnitudes => &*self.magnitudes,
        };
        // A part that fails here is checked again after the read, which
        // reports it: the error is the same, and the read finishes in step
        // with the peer.
        if check_part(part, image).is_ok() {
            *state = PartState::Checked;
        }
    }
}

/// Check every landed part not checked during the read (every part, for a
/// transport that does not say when a part is filled) against its
/// checksum, and its B padding columns for zeros, in parallel across parts.
fn verify(parts: &[PlannedPart], states: &[PartState], images: [&[u8]; 3]) -> Result<(), LandError> {
    let pending: Vec<&PlannedPart> = parts
        .iter()
        .enumerate()
        .filter(|(i, _)| states.get(*i) != Some(&PartState::Checked))
        .map(|(_, p)| p)
        .collect();
    // Nothing left (the usual case over TCP): no pool threads to wake.
    if pending.is_empty() {
        return Ok(());
    }
    let [dense, experts, magnitudes] = images;
    pending.into_par_iter().try_for_each(|p| {
        let image = match p.image() {
            Image::Dense => dense,
            Image::Experts => experts,
            Image::Magnitudes => magnitudes,
        };
        check_part(p, image)
    })
}

/// One landed part's checksum, and its B padding columns past the rank all
/// zero.
fn check_part(p: &PlannedPart, image: &[u8]) -> Result<(), LandError> {
    let bytes = image.get(p.range.clone()).ok_or(LandError::NotInLayout(p.key))?;
    let got = xxh64(bytes);
    if got != p.checksum {
        return Err(LandError::Checksum {
            key: p.key,
            part: p.part,
            expected: p.checksum,
            got,
        });
    }
    if p.part == WirePart::B && p.rank < p.stride {
        let padded = bytes
            .chunks_exact(2 * p.stride)
            .any(|row| row[2 * p.rank..].iter().any(|&b| b != 0));
        if padded {
            return Err(LandError::Padding {
                key: p.key,
                rank: p.rank,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
