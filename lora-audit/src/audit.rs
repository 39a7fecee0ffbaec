//! The audit: place every tensor of an adapter exactly, or refuse it with a
//! reason, and report what serving it costs ([`AuditReport`]).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::Path;

use lora_layout::{ExpertProj, ExpertSite, GateUpLayout, ModelConfig, ModelFamily, expert_router_bytes};

use rayon::prelude::*;

use crate::error::{AuditError, Refusal, RejectCode};
use crate::key::{AdapterAb, LoraTarget, classify_key};
use crate::options::LoraOptions;
use crate::overlay::{OverlayModule, OverlayTensors, classify_overlay_key, id_in_vocab};
use crate::peft_config::{MAX_ADAPTER_CONFIG_BYTES, PeftAdapterConfig, TargetModules, TrainableTokenIndices};
use crate::report::{
    AuditReport, AuditedOverlay, ExpertSlice, LmHeadMode, PlacedEmbedding, PlacedExpertPair, PlacedHead, PlacedPair,
};
use crate::tensors::{LoadedSafetensors, TensorInfo, first_non_finite_raw};

/// The adapter's config file name.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights file name.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The pickle weights file name PEFT writes with `safe_serialization=False`.
pub const ADAPTER_PICKLE: &str = "adapter_model.bin";

/// Config-level target checks: `target_modules` names that exist in the
/// model family but can never take a delta here (gated-delta-net inputs).
/// `embed_tokens` and `lm_head` are judged on their tensors
/// (`lora_embedding_A/B`, `lm_head.lora_A/B`). Names the model does not have are ignored
/// (PEFT matched the tensors; they are the truth), and so are regex strings.
/// Ranks are checked on the tensor shapes, per pair, by [`audit_adapter`]:
/// a `rank_pattern` entry no tensor uses cannot refuse an adapter.
pub fn validate_peft_config(config: &PeftAdapterConfig, cfg: &ModelConfig) -> Vec<Refusal> {
    let Some(TargetModules::List(names)) = &config.target_modules else {
        return Vec::new();
    };
    let qwen3_next = cfg.linear_attn.is_some();
    names
        .iter()
        .filter_map(|name| {
            let last = name.rsplit('.').next().unwrap_or(name);
            let (code, why) = match last {
                "in_proj_qkvz" | "in_proj_ba" | "conv1d" if qwen3_next => (
                    RejectCode::GdnTarget,
                    "a gated-delta-net input; only linear_attn.out_proj can take a delta",
                ),
                _ => return None,
            };
            Some(Refusal::new(code, "target_modules", format!("`{name}`: {why}")))
        })
        .collect()
}

/// A pair's two tensors, as found.
#[derive(Default)]
struct Halves {
    a: Option<TensorInfo>,
    b: Option<TensorInfo>,
    /// DoRA's `lora_magnitude_vector`.
    m: Option<TensorInfo>,
    module_path: String,
}

/// Audit the adapter in `dir` against the model and the pool limits. An
/// error only when the input is unreadable or corrupt; every refusal and
/// skip lives in the report.
///
/// Unlike [`audit_header`], it reads the values of every tensor the report
/// serves ([`AuditReport::served_tensors`]) from the read file, as
/// served (converted to BF16), and refuses any NaN or infinity naming the
/// tensor (`REJECT[non-finite]`).
pub fn audit_adapter(dir: &Path, cfg: &ModelConfig, opts: &LoraOptions) -> Result<AuditReport, AuditError> {
    let (_, mut report, mapped) = audit_with_config(dir, cfg, opts)?;
    if let Some(mapped) = &mapped {
        refuse_non_finite(&mut report, mapped)?;
    }
    Ok(report)
}

/// Check the values of every served tensor of `report` in `mapped`.
fn refuse_non_finite(report: &mut AuditReport, mapped: &LoadedSafetensors) -> Result<(), AuditError> {
    let names: Vec<String> = report.served_tensors().into_iter().collect();
    let found = names
        .par_iter()
        .map(|name| {
            let (dtype, _, bytes) = mapped.tensor(name)?;
            Ok(first_non_finite_raw(dtype, bytes).map(|(index, stored)| Refusal::non_finite(name, index, stored)))
        })
        .collect::<Result<Vec<Option<Refusal>>, AuditError>>()?;
    for refusal in found.into_iter().flatten() {
        report.refuse(refusal);
    }
    Ok(())
}

/// Read `adapter_config.json`, refusing one over [`MAX_ADAPTER_CONFIG_BYTES`]
/// without reading it all.
fn read_config(path: &Path) -> Result<String, AuditError> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| AuditError::io(path, e))?;
    let len = file.metadata().map_err(|e| AuditError::io(path, e))?.len();
    let too_large = |bytes: u64| AuditError::ConfigTooLarge {
        bytes,
        limit: MAX_ADAPTER_CONFIG_BYTES,
    };
    if len > MAX_ADAPTER_CONFIG_BYTES as u64 {
        return Err(too_large(len));
    }
    let mut text = String::new();
    // One byte past the limit tells a file that grew since its metadata.
    file.take(MAX_ADAPTER_CONFIG_BYTES as u64 + 1)
        .read_to_string(&mut text)
        .map_err(|e| AuditError::io(path, e))?;
    if text.len() > MAX_ADAPTER_CONFIG_BYTES {
        return Err(too_large(text.len() as u64));
    }
    Ok(text)
}

/// The header-only audit of the adapter in `dir`: the parsed config, the
/// report, and the read weights (`None` for a pickle or another method's
/// adapter, whose tensors are never read).
pub(crate) fn audit_with_config(
    dir: &Path,
    cfg: &ModelConfig,
    opts: &LoraOptions,
) -> Result<(PeftAdapterConfig, AuditReport, Option<LoadedSafetensors>), AuditError> {
    if !dir.is_dir() {
        return Err(AuditError::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such adapter directory"),
        ));
    }
    let config_path = dir.join(ADAPTER_CONFIG);
    let text = read_config(&config_path)?;
    let config = PeftAdapterConfig::from_json(&text).map_err(|e| e.in_config_file(&config_path))?;
    let weights = dir.join(ADAPTER_WEIGHTS);
    let mut mapped = None;
    let header = || {
        if !weights.exists() && dir.join(ADAPTER_PICKLE).exists() {
            Ok(None)
        } else {
            let m = LoadedSafetensors::open(&weights)?;
            let infos = m.infos()?;
            mapped = Some(m);
            Ok(Some(infos))
        }
    };
    let report = audit_parsed(&dir.display().to_string(), &config, header, cfg, opts)?;
    Ok((config, report, mapped))
}

/// Audit an adapter from its `adapter_config.json` text and its safetensors
/// header (names, dtypes, shapes) alone, without any tensor data: what a
/// weight peer's manifest carries, which the engine audits itself. The same
/// checks as [`audit_adapter`], which reads both from a directory; `name`
/// becomes the report's `adapter`. The order of `tensors` does not matter.
///
/// It sees no values, so it cannot refuse NaN or infinite weights
/// (`REJECT[non-finite]`) as [`audit_adapter`] and
/// [`prepare_adapter`](crate::prepare_adapter) do: a path that serves the
/// tensor bytes after it (the pool's disk swap, a peer landing) must check
/// every tensor of [`AuditReport::served_tensors`] itself, with
/// [`first_non_finite_raw`](crate::first_non_finite_raw) on the raw bytes or
/// [`first_non_finite`](crate::first_non_finite) on BF16, and refuse with
/// [`Refusal::non_finite`] ([`AuditReport::refuse`]).
pub fn audit_header(
    name: &str,
    config_text: &str,
    mut tensors: Vec<TensorInfo>,
    cfg: &ModelConfig,
    opts: &LoraOptions,
) -> Result<AuditReport, AuditError> {
    let config = PeftAdapterConfig::from_json(config_text)?;
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    audit_parsed(name, &config, || Ok(Some(tensors)), cfg, opts)
}

/// The audit of a parsed config; `header` gives the tensor header, or
/// `None` when the weights are a pickle. It is read only for a LoRA config.
fn audit_parsed(
    name: &str,
    config: &PeftAdapterConfig,
    header: impl FnOnce() -> Result<Option<Vec<TensorInfo>>, AuditError>,
    cfg: &ModelConfig,
    opts: &LoraOptions,
) -> Result<AuditReport, AuditError> {
    let mut audit = Audit::new(cfg, opts, config);
    // On a pool built for DoRA, `use_dora` is served: each pair then needs
    // its magnitude vector (checked where the pair is placed).
    audit.issues.extend(
        config
            .refusals()
            .into_iter()
            .filter(|r| !(opts.dora && r.code == RejectCode::Dora)),
    );
    audit.issues.extend(validate_peft_config(config, cfg));
    if config.peft_type != "LORA" {
        // Another method's tensors mean nothing to a LoRA audit; the
        // peft-type refusal says all there is to say.
    } else if let Some(infos) = header()? {
        audit.tensors(infos);
    } else {
        audit.issues.push(Refusal::new(
            RejectCode::Pickle,
            ADAPTER_PICKLE,
            "the weights are a pickle, which is never unpickled; save with safe_serialization=True",
        ));
    }
    audit.finish(name)
}

/// The audit's working state.
struct Audit<'a> {
    cfg: &'a ModelConfig,
    opts: &'a LoraOptions,
    config: &'a PeftAdapterConfig,
    issues: Vec<Refusal>,
    placed: Vec<PlacedPair>,
    experts: Vec<PlacedExpertPair>,
    embedding: Option<PlacedEmbedding>,
    /// `lm_head.lora_A/B` as found, placed by `place_head`.
    head: Halves,
    lm_head: Option<PlacedHead>,
    overlay: OverlayTensors,
    shapes: BTreeMap<String, Vec<usize>>,
    has_expert_deltas: bool,
    /// Alpha sources already refused for a non-finite scale.
    scale_refused: BTreeSet<(&'static str, Option<String>)>,
}

impl<'a> Audit<'a> {
    fn new(cfg: &'a ModelConfig, opts: &'a LoraOptions, config: &'a PeftAdapterConfig) -> Audit<'a> {
        Audit {
            cfg,
            opts,
            config,
            issues: Vec::new(),
            placed: Vec::new(),
            experts: Vec::new(),
            embedding: None,
            head: Halves::default(),
            lm_head: None,
            overlay: OverlayTensors::default(),
            shapes: BTreeMap::new(),
            has_expert_deltas: false,
            scale_refused: BTreeSet::new(),
        }
    }

    fn refuse(&mut self, code: RejectCode, subject: impl Into<String>, reason: impl Into<String>) {
        self.issues.push(Refusal::new(code, subject, reason));
    }

    /// Classify every tensor, then place the pairs and check the overlays.
    fn tensors(&mut self, infos: Vec<TensorInfo>) {
        let mut groups: BTreeMap<(usize, LoraTarget), Halves> = BTreeMap::new();
        for info in infos {
            if !info.name.bytes().all(|b| b.is_ascii_graphic()) {
                // Module paths are Python attribute names joined by dots. The
                // pattern lookup is exact for these only: on other text
                // Python's and Rust's `\w`, `\d`, `\s` classes differ.
                self.refuse(
                    RejectCode::UnknownKey,
                    &info.name,
                    "a tensor name outside printable ASCII (no spaces or control characters)",
                );
                continue;
            }
            if !info.dtype.is_float_weight() {
                self.refuse(
                    RejectCode::Dtype,
                    &info.name,
                    format!("dtype {}; adapter tensors must be F32, F16 or BF16", info.dtype),
                );
                continue;
            }
            if let Some(tensor) = classify_overlay_key(&info.name) {
                if let Err(r) = self.overlay.insert(&info.name, tensor) {
                    self.issues.push(r);
                }
                self.shapes.insert(info.name, info.shape);
                continue;
            }
            if self.opts.dora
                && let Some(module) = crate::dora::magnitude_module(&info.name)
            {
                // The magnitude names its module as the factors do: classify
                // the module's own lora_A name to find its pair.
                match classify_key(&format!("{module}.lora_A.weight"), self.cfg) {
                    Ok(key) => {
                        let halves = groups.entry((key.layer, key.target)).or_default();
                        if let Some(previous) = &halves.m {
                            let reason =
                                format!("a second magnitude vector for this pair (first: `{}`)", previous.name);
                            self.refuse(RejectCode::DuplicateTensor, &info.name, reason);
                            continue;
                        }
                        halves.m = Some(info);
                        halves.module_path = key.module_path;
                    }
                    Err(mut refusal) => {
                        refusal.subject = info.name;
                        self.issues.push(refusal);
                    }
                }
                continue;
            }
            if let Some(ab) = head_half(&info.name) {
                let slot = match ab {
                    AdapterAb::A => &mut self.head.a,
                    AdapterAb::B => &mut self.head.b,
                };
                if let Some(previous) = slot {
                    let reason = format!("a second tensor for this pair (first: `{}`)", previous.name);
                    self.refuse(RejectCode::DuplicateTensor, &info.name, reason);
                    continue;
                }
                *slot = Some(info);
                continue;
            }
            match classify_key(&info.name, self.cfg) {
                Ok(key) => {
                    let halves = groups.entry((key.layer, key.target)).or_default();
                    let slot = match key.ab {
                        AdapterAb::A => &mut halves.a,
                        AdapterAb::B => &mut halves.b,
                    };
                    if let Some(previous) = slot {
                        let reason = format!("a second tensor for this pair (first: `{}`)", previous.name);
                        self.refuse(RejectCode::DuplicateTensor, &info.name, reason);
                        continue;
                    }
                    *slot = Some(info);
                    halves.module_path = key.module_path;
                }
                Err(refusal) => {
                    let refusal = self.recode_saved_module(refusal);
                    self.issues.push(refusal);
                }
            }
        }
        for ((layer, target), halves) in groups {
            self.place(layer, target, halves);
        }
        self.check_fused_duplicates();
        self.place_head();
    }

    /// Place the LoRA on the output head (`lm_head.lora_A` `[r, hidden]`,
    /// `lm_head.lora_B` `[vocab, r]`), or refuse it. PEFT wraps the head
    /// like any linear layer: the logits gain `scale · (h Aᵀ) Bᵀ` over the
    /// whole vocabulary, with the same scaling forms (rsLoRA, patterns keyed
    /// by `lm_head`), on top of whatever the wrapped layer computes (its
    /// token adapter or its saved table: the slot's head overlay).
    fn place_head(&mut self) {
        let halves = std::mem::take(&mut self.head);
        let (a, b) = match (halves.a, halves.b) {
            (None, None) => return,
            (Some(a), Some(b)) => (a, b),
            (Some(only), None) | (None, Some(only)) => {
                self.refuse(
                    RejectCode::Unpaired,
                    &only.name,
                    "lora_A and lora_B must both be present; the other half is missing",
                );
                return;
            }
        };
        if !self.opts.lm_head_lora {
            self.refuse(
                RejectCode::LmHeadLoraDisabled,
                &a.name,
                "LoRA on the output head, and the pool has no head place (set LORA_LM_HEAD_LORA=1 or --lm-head-lora)",
            );
            return;
        }
        if self.cfg.tie_word_embeddings {
            self.refuse(
                RejectCode::TiedHead,
                &a.name,
                "LoRA on an output head tied to the input embedding: PEFT's unmerged forward adds the delta to the \
                 logits only, while its merge writes it into the shared table (so the embedding changes too)",
            );
            return;
        }
        if let Some(delta) = self.overlay.lm_head.delta.clone() {
            self.refuse(
                RejectCode::TrainableTokens,
                delta,
                "trainable tokens on an output head that also has a LoRA: PEFT refuses the combination \
                 (trainable_token_indices cannot wrap a lora.Linear)",
            );
            return;
        }
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let ok = a.shape.len() == 2 && b.shape.len() == 2 && a.shape[0] > 0 && a.shape[0] == b.shape[1];
        if !ok {
            self.refuse(
                RejectCode::Shape,
                &b.name,
                format!(
                    "lm_head lora_A is {:?} and lora_B {:?}: not [r, hidden] / [vocab, r]",
                    a.shape, b.shape
                ),
            );
            return;
        }
        if !self.check_dims(&a, &b, (vocab, hidden)) {
            return;
        }
        let path = a.name.strip_prefix("base_model.model.").unwrap_or(&a.name);
        let path = path.strip_suffix(".lora_A.weight").unwrap_or(path).to_string();
        let Some((rank, scale)) = self.rank_and_scale(&a.name, &path, a.shape[0], false) else {
            return;
        };
        self.lm_head = Some(PlacedHead {
            rank,
            scale,
            a_key: a.name,
            b_key: b.name,
        });
    }

    /// A full copy of a module named in `modules_to_save` that is not a token
    /// table: say so rather than "unknown key".
    fn recode_saved_module(&self, refusal: Refusal) -> Refusal {
        if refusal.code != RejectCode::UnknownKey {
            return refusal;
        }
        let path = refusal
            .subject
            .strip_prefix("base_model.model.")
            .unwrap_or(&refusal.subject);
        let module = path.rsplit_once('.').map_or(path, |(m, _)| m);
        let saved = self
            .config
            .modules_to_save
            .iter()
            .any(|name| module.ends_with(name.as_str())); // PEFT's `_set_trainable` matches a plain suffix
        if saved {
            Refusal::new(
                RejectCode::ModulesToSave,
                refusal.subject,
                "a modules_to_save copy of a module that is not a token table",
            )
        } else {
            refusal
        }
    }

    fn place(&mut self, layer: usize, target: LoraTarget, halves: Halves) {
        let magnitude = halves.m;
        let (a, b) = match (halves.a, halves.b) {
            (Some(a), Some(b)) => (a, b),
            (None, None) => {
                if let Some(m) = magnitude {
                    self.refuse(
                        RejectCode::Unpaired,
                        &m.name,
                        "a DoRA magnitude vector without its lora_A / lora_B pair",
                    );
                }
                return;
            }
            (Some(only), None) | (None, Some(only)) => {
                self.refuse(
                    RejectCode::Unpaired,
                    &only.name,
                    "lora_A and lora_B must both be present; the other half is missing",
                );
                return;
            }
        };
        if self.opts.dora && (self.config.use_dora || magnitude.is_some()) && !matches!(target, LoraTarget::Dense(_)) {
            let subject = magnitude.as_ref().map_or(&a.name, |m| &m.name);
            self.refuse(
                RejectCode::Dora,
                subject,
                "DoRA on a routed expert or router: the pool rescales dense projections only",
            );
            return;
        }
        if target.is_expert() {
            self.has_expert_deltas = true;
            if !self.opts.experts {
                self.refuse(
                    RejectCode::ExpertsDisabled,
                    &a.name,
                    "routed-expert / router LoRA is disabled (set LORA_EXPERTS=1 or --experts)",
                );
                return;
            }
        }
        for t in [&a, &b] {
            if t.shape.len() != 2 {
                self.refuse(
                    RejectCode::Shape,
                    &t.name,
                    format!("shape {:?}; a LoRA factor is a matrix", t.shape),
                );
                return;
            }
        }
        let (a_rows, b_cols) = (a.shape[0], b.shape[1]);
        if a_rows == 0 || a_rows != b_cols {
            self.refuse(
                RejectCode::Shape,
                &b.name,
                format!("lora_A is {:?} and lora_B {:?}: their ranks disagree", a.shape, b.shape),
            );
            return;
        }
        match target {
            LoraTarget::Dense(module) => {
                let dims = module.dims(self.cfg);
                if !self.check_dims(&a, &b, dims) {
                    return;
                }
                let path = self.parameter_pattern_path(halves.module_path);
                let Some((rank, scale)) = self.rank_and_scale(&a.name, &path, a_rows, false) else {
                    return;
                };
                let Some(magnitude_key) = self.check_magnitude(&a, magnitude, dims.0) else {
                    return;
                };
                self.placed.push(PlacedPair {
                    layer,
                    module,
                    rank,
                    scale,
                    a_key: a.name,
                    b_key: b.name,
                    magnitude_key,
                });
            }
            LoraTarget::Expert { expert, proj } => {
                let site = ExpertSite::Expert { expert, proj };
                self.place_direct_expert(layer, site, a, b, halves.module_path);
            }
            LoraTarget::Router => {
                let path = self.parameter_pattern_path(halves.module_path);
                self.place_direct_expert(layer, ExpertSite::Router, a, b, path);
            }
            // Inner and outer wrappers are separate groups; the shapes say which parameter each adapts.
            LoraTarget::FusedExperts(_) => self.place_fused(layer, a, b, &halves.module_path),
        }
    }

    /// A dense pair's DoRA magnitude: `Some(None)` for a plain pair,
    /// `Some(Some(key))` for a DoRA pair whose magnitude is `[out]`; `None`
    /// after recording a refusal (a DoRA config without the vector, a
    /// vector without `use_dora`, a wrong shape).
    fn check_magnitude(&mut self, a: &TensorInfo, m: Option<TensorInfo>, out: usize) -> Option<Option<String>> {
        if !self.opts.dora {
            // `use_dora` and every magnitude key are refused as `REJECT[dora]` already.
            return Some(None);
        }
        match (self.config.use_dora, m) {
            (false, None) => Some(None),
            (true, None) => {
                self.refuse(
                    RejectCode::Unpaired,
                    &a.name,
                    "use_dora is set but this pair has no lora_magnitude_vector",
                );
                None
            }
            (false, Some(m)) => {
                self.refuse(
                    RejectCode::Dora,
                    &m.name,
                    "a DoRA magnitude vector in an adapter whose config does not set use_dora",
                );
                None
            }
            (true, Some(m)) if m.shape != [out] => {
                self.refuse(
                    RejectCode::Shape,
                    &m.name,
                    format!("shape {:?}; a DoRA magnitude is [out] = [{out}]", m.shape),
                );
                None
            }
            (true, Some(m)) => Some(Some(m.name)),
        }
    }

    /// Check `[r, in]` / `[out, r]` against the projection's `(out, in)`.
    fn check_dims(&mut self, a: &TensorInfo, b: &TensorInfo, (out, inp): (usize, usize)) -> bool {
        if a.shape[1] != inp || b.shape[0] != out {
            self.refuse(
                RejectCode::Shape,
                &a.name,
                format!(
                    "lora_A {:?} / lora_B {:?} do not fit the projection (out {out}, in {inp})",
                    a.shape, b.shape
                ),
            );
            return false;
        }
        true
    }

    /// The per-pair rank check against the config and the pool, and PEFT's
    /// scale; `None` after recording a refusal.
    fn rank_and_scale(&mut self, subject: &str, pattern_path: &str, rank: usize, expert: bool) -> Option<(usize, f32)> {
        let config_rank = self.config.rank_for(pattern_path);
        if config_rank != rank {
            self.refuse(
                RejectCode::RankMismatch,
                subject,
                format!(
                    "the config gives `{pattern_path}` r={config_rank} (r / rank_pattern) but its tensors have r={rank}"
                ),
            );
            return None;
        }
        let (limit, code, what) = if expert {
            (self.opts.expert_rank, RejectCode::ExpertRank, "expert rank")
        } else {
            (self.opts.max_rank, RejectCode::RankExceedsMax, "max rank")
        };
        if rank > limit {
            self.refuse(code, subject, format!("rank {rank} exceeds the pool's {what} {limit}"));
            return None;
        }
        let scale = self.config.scale_for(pattern_path, rank);
        if !scale.is_finite() {
            self.refuse_scale(subject, pattern_path, rank, scale);
            return None;
        }
        Some((rank, scale))
    }

    /// A pair whose scale is not finite as served (f32): refused once per
    /// alpha source, naming the field and, for `alpha_pattern`, the key
    /// (`lora_alpha = 1e40` passes JSON's f64 but is infinite in f32).
    fn refuse_scale(&mut self, tensor: &str, pattern_path: &str, rank: usize, scale: f32) {
        let (field, key, alpha) = match self.config.alpha_pattern.lookup(pattern_path) {
            Some((key, alpha)) => ("alpha_pattern", Some(key.to_string()), alpha),
            None => ("lora_alpha", None, self.config.lora_alpha),
        };
        if !self.scale_refused.insert((field, key.clone())) {
            return;
        }
        let divisor = if self.config.use_rslora { "sqrt(r)" } else { "r" };
        let source = key.map_or(String::new(), |k| format!("key `{k}`: "));
        self.refuse(
            RejectCode::NonFiniteScale,
            field,
            format!(
                "{source}alpha {alpha} / {divisor} (r={rank}) is {scale} as served (f32), first for `{tensor}`; \
                 the scale must be finite"
            ),
        );
    }

    /// The path PEFT matched `rank_pattern` / `alpha_pattern` against for a
    /// 2-D pair: the module path, or the parameter path (`….weight`) when the
    /// module's weight was targeted through `target_parameters` (5.x routers,
    /// DeepSeek's and GLM-4.5's; dense projections PEFT's 5.x expert
    /// conversion leaves no other way to target, such as shared experts).
    fn parameter_pattern_path(&self, module_path: String) -> String {
        if self.config.target_parameters.is_empty() {
            return module_path;
        }
        let param = format!("{module_path}.weight");
        let by_parameter = self
            .config
            .target_parameters
            .iter()
            .any(|t| param == *t || param.ends_with(&format!(".{t}")));
        if by_parameter { param } else { module_path }
    }

    fn place_direct_expert(&mut self, layer: usize, site: ExpertSite, a: TensorInfo, b: TensorInfo, path: String) {
        let Some(dims) = site.dims(self.cfg) else {
            self.refuse(
                RejectCode::ModelMismatch,
                &a.name,
                format!("the model has no expert site {site:?}"),
            );
            return;
        };
        if !self.check_dims(&a, &b, dims) {
            return;
        }
        let Some((rank, scale)) = self.rank_and_scale(&a.name, &path, a.shape[0], true) else {
            return;
        };
        self.experts.push(PlacedExpertPair {
            layer,
            site,
            rank,
            scale,
            a_key: a.name,
            b_key: b.name,
            slice: ExpertSlice::Direct,
        });
    }

    /// A 5.x fused pair. Which parameter it adapts follows from its shapes:
    /// `gate_up_proj` has A `[E·r, hidden]`, B `[2·inter, E·r]`; `down_proj`
    /// has A `[E·r, inter]`, B `[hidden, E·r]`. The two `(B rows, A cols)`
    /// pairs, `(2·inter, hidden)` and `(hidden, inter)`, are never equal for
    /// positive widths, so the wrapper's nesting order never has to be guessed.
    ///
    /// gpt_oss stores its experts `[E, in, out]` (PEFT reads them so: the
    /// pairs have the same shapes) with gate and up interleaved along
    /// `gate_up_proj`'s output ([`GateUpLayout::Interleaved`]), and has two
    /// more expert parameters, the biases `gate_up_proj_bias` `[E, 2·inter]`
    /// and `down_proj_bias` `[E, hidden]`, which PEFT wraps as 2-D weights (A
    /// `[r, 2·inter]` / `[r, hidden]`, B `[E, r]`). A delta on a bias has no
    /// place in the pool: refused naming the parameter.
    fn place_fused(&mut self, layer: usize, a: TensorInfo, b: TensorInfo, module_path: &str) {
        let (Some(moe), hidden) = (self.cfg.moe.as_ref(), self.cfg.hidden_size) else {
            return;
        };
        let (n_experts, inter) = (moe.num_experts, moe.expert_intermediate_size);
        let (a_rows, a_in, b_out) = (a.shape[0], a.shape[1], b.shape[0]);
        let container = crate::key::strip_base_layers(module_path).0;
        let weight_param = if (b_out, a_in) == (2 * inter, hidden) {
            Some("gate_up_proj")
        } else if (b_out, a_in) == (hidden, inter) {
            Some("down_proj")
        } else {
            None
        };
        let bias_param = match (self.cfg.family, (b_out, a_in)) {
            (ModelFamily::GptOss, shape) if shape == (n_experts, 2 * inter) => Some("gate_up_proj_bias"),
            (ModelFamily::GptOss, shape) if shape == (n_experts, hidden) => Some("down_proj_bias"),
            _ => None,
        };
        let param = match (weight_param, bias_param) {
            (Some(weight), Some(bias)) => {
                self.refuse(
                    RejectCode::Shape,
                    &a.name,
                    format!(
                        "fused experts lora_A {:?} / lora_B {:?} fit both `{weight}` and `{bias}` of this model; \
                         which parameter they adapt cannot be told",
                        a.shape, b.shape
                    ),
                );
                return;
            }
            (None, Some(bias)) => {
                self.refuse(
                    RejectCode::UnsupportedTarget,
                    &a.name,
                    format!(
                        "a LoRA on the expert bias parameter `{container}.{bias}`; expert biases take no delta here"
                    ),
                );
                return;
            }
            (Some(weight), None) => weight,
            (None, None) => {
                self.refuse(
                    RejectCode::Shape,
                    &a.name,
                    format!(
                        "fused experts lora_A {:?} / lora_B {:?} fit neither gate_up_proj (in {hidden}, out {}) \
                     nor down_proj (in {inter}, out {hidden})",
                        a.shape,
                        b.shape,
                        2 * inter
                    ),
                );
                return;
            }
        };
        if a_rows % n_experts != 0 {
            self.refuse(
                RejectCode::Shape,
                &a.name,
                format!("{a_rows} rows of lora_A are not {n_experts} experts x r"),
            );
            return;
        }
        let rank = a_rows / n_experts;
        let path = format!("{container}.{param}");
        let Some((rank, scale)) = self.rank_and_scale(&a.name, &path, rank, true) else {
            return;
        };
        let layout = GateUpLayout::of(self.cfg.family);
        let slices: Vec<(ExpertProj, ExpertSlice)> = match (param, layout) {
            ("gate_up_proj", GateUpLayout::Halves) => vec![
                (ExpertProj::Gate, fused_rows(n_experts, 0..inter)),
                (ExpertProj::Up, fused_rows(n_experts, inter..2 * inter)),
            ],
            ("gate_up_proj", GateUpLayout::Interleaved) => [ExpertProj::Gate, ExpertProj::Up]
                .into_iter()
                .map(|proj| {
                    let slice = ExpertSlice::FusedInterleaved {
                        num_experts: n_experts,
                        first_row: layout.column(proj, 0, inter),
                        rows: inter,
                    };
                    (proj, slice)
                })
                .collect(),
            _ => vec![(ExpertProj::Down, fused_rows(n_experts, 0..hidden))],
        };
        for expert in 0..n_experts {
            for (proj, slice) in &slices {
                self.experts.push(PlacedExpertPair {
                    layer,
                    site: ExpertSite::Expert { expert, proj: *proj },
                    rank,
                    scale,
                    a_key: a.name.clone(),
                    b_key: b.name.clone(),
                    slice: slice.clone(),
                });
            }
        }
    }

    /// Two pairs for one (layer, expert site): both fused wrappers adapting
    /// one parameter, or a fused and a per-expert pair.
    fn check_fused_duplicates(&mut self) {
        self.experts.sort_by_key(|p| (p.layer, p.site));
        let dups: Vec<(String, String)> = self
            .experts
            .windows(2)
            .filter(|w| (w[0].layer, w[0].site) == (w[1].layer, w[1].site))
            .map(|w| (w[1].a_key.clone(), w[0].a_key.clone()))
            .collect();
        for (key, first) in dups {
            self.refuse(
                RejectCode::DuplicateTensor,
                key,
                format!("adapts the same expert projection as `{first}`"),
            );
        }
    }

    /// Place the LoRA on the input embedding (`lora_embedding_A` `[r,
    /// vocab]`, `lora_embedding_B` `[hidden, r]`), or refuse it. PEFT's
    /// `lora.Embedding` adds `scale · (A^T[ids]) B^T` onto the wrapped
    /// lookup with the same scaling forms as a linear pair (rsLoRA,
    /// `rank_pattern` / `alpha_pattern` keyed by the module path); the base
    /// table's `padding_idx` / `max_norm` do not apply to it (transformers'
    /// token embeddings set no `max_norm`, and `padding_idx` only masks
    /// gradients).
    fn place_embedding(&mut self) {
        let t = &self.overlay.embed;
        let (a, b) = match (t.lora_a.clone(), t.lora_b.clone()) {
            (None, None) => return,
            (Some(a), Some(b)) => (a, b),
            (Some(only), None) | (None, Some(only)) => {
                self.refuse(
                    RejectCode::Unpaired,
                    only,
                    "lora_embedding_A and lora_embedding_B must both be present; the other half is missing",
                );
                return;
            }
        };
        if !self.opts.embedding_lora {
            self.refuse(
                RejectCode::EmbeddingLoraDisabled,
                a,
                "LoRA on the input embedding, and the pool has no embedding place (set LORA_EMBEDDING_LORA=1 or \
                 --embedding-lora)",
            );
            return;
        }
        if self.config.use_dora {
            // PEFT's `DoraEmbeddingLayer` rescales the lookup by
            // `m / ‖W + s·(A B)^T‖`; the pool's rescale covers the dense
            // projections only. (Off a DoRA pool `use_dora` is refused
            // already; on one it must not serve the pair as plain LoRA.)
            if self.opts.dora {
                self.refuse(
                    RejectCode::Dora,
                    a,
                    "DoRA on the input embedding: the pool rescales dense projections only",
                );
            }
            return;
        }
        if self.cfg.tie_word_embeddings {
            self.refuse(
                RejectCode::EmbeddingLora,
                a,
                "LoRA on the embedding of a model whose lm_head is tied to it: PEFT's merge writes the delta into \
                 the shared table (so the head changes too) while its forward leaves the head alone",
            );
            return;
        }
        if let Some(delta) = t.delta.clone() {
            self.refuse(
                RejectCode::EmbeddingLora,
                delta,
                "trainable tokens on an embedding that also has a LoRA: PEFT refuses the combination",
            );
            return;
        }
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let shape = |name: &str| self.shapes.get(name).cloned().unwrap_or_default();
        let (a_shape, b_shape) = (shape(&a), shape(&b));
        let rank = a_shape.first().copied().unwrap_or(0);
        if a_shape.len() != 2 || b_shape.len() != 2 || rank == 0 || b_shape[1] != rank {
            self.refuse(
                RejectCode::Shape,
                &b,
                format!(
                    "lora_embedding_A is {a_shape:?} and lora_embedding_B {b_shape:?}: not [r, vocab] / [hidden, r]"
                ),
            );
            return;
        }
        if a_shape[1] != vocab || b_shape[0] != hidden {
            self.refuse(
                RejectCode::Shape,
                &a,
                format!(
                    "lora_embedding_A {a_shape:?} / lora_embedding_B {b_shape:?} do not fit the embedding \
                     (vocab {vocab}, hidden {hidden})"
                ),
            );
            return;
        }
        let path = a.strip_prefix("base_model.model.").unwrap_or(&a);
        let path = path.strip_suffix(".lora_embedding_A").unwrap_or(path).to_string();
        let Some((rank, scale)) = self.rank_and_scale(&a, &path, rank, false) else {
            return;
        };
        self.embedding = Some(PlacedEmbedding {
            rank,
            scale,
            a_key: a,
            b_key: b,
        });
    }

    /// Check the overlay tensors against the config and the model.
    fn audit_overlay(&mut self) -> AuditedOverlay {
        self.place_embedding();
        let (embed_ids, lm_head_ids) = config_token_ids(self.config);
        for module in [OverlayModule::Embed, OverlayModule::LmHead] {
            let ids = match module {
                OverlayModule::Embed => &embed_ids,
                OverlayModule::LmHead => &lm_head_ids,
            };
            self.audit_table(module, ids);
        }
        let tied = self.cfg.tie_word_embeddings;
        let embed_delta = self.overlay.embed.delta.is_some();
        let head_own = self.overlay.lm_head.delta.is_some() || self.overlay.lm_head.base_table().is_some();
        if tied && self.overlay.lm_head.delta.is_some() {
            let key = self.overlay.lm_head.delta.clone().unwrap_or_default();
            self.refuse(
                RejectCode::TiedHead,
                key,
                "lm_head trainable tokens on a tied head: PEFT would write both token lists into one table",
            );
        } else if tied && embed_delta && head_own {
            let key = self.overlay.lm_head.base_table().unwrap_or_default().to_string();
            self.refuse(
                RejectCode::TiedHead,
                key,
                "a tied head with both embedding trainable tokens and its own lm_head table",
            );
        }
        let lm_head = if head_own {
            LmHeadMode::Own
        } else if tied && embed_delta {
            LmHeadMode::TiedTrainableRows
        } else {
            LmHeadMode::None
        };
        AuditedOverlay {
            tensors: self.overlay.clone(),
            embed_ids,
            lm_head_ids,
            lm_head,
        }
    }

    fn audit_table(&mut self, module: OverlayModule, ids: &[u32]) {
        let (vocab, hidden) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let tensors = self.overlay.table(module).clone();
        match (&tensors.delta, ids.is_empty()) {
            (Some(key), true) => self.refuse(
                RejectCode::TrainableTokens,
                key,
                format!("trainable_token_indices gives {} no ids for these rows", module.name()),
            ),
            (None, false) => self.refuse(
                RejectCode::TrainableTokens,
                "trainable_token_indices",
                format!(
                    "{} ids are configured but the adapter has no trainable_tokens_delta",
                    module.name()
                ),
            ),
            (Some(key), false) => {
                let want = [ids.len(), hidden];
                if self.shapes.get(key).map(Vec::as_slice) != Some(&want[..]) {
                    let got = self.shapes.get(key).cloned().unwrap_or_default();
                    self.refuse(
                        RejectCode::Shape,
                        key,
                        format!("shape {got:?}, expected {want:?} (one row per configured id)"),
                    );
                }
                let mut seen = BTreeSet::new();
                let repeated: BTreeSet<u32> = ids.iter().copied().filter(|id| !seen.insert(*id)).collect();
                if !repeated.is_empty() {
                    self.refuse(
                        RejectCode::DuplicateTokenId,
                        "trainable_token_indices",
                        format!(
                            "{} ids {repeated:?} repeat; PEFT's merge of repeated ids is undefined",
                            module.name()
                        ),
                    );
                }
                let outside: Vec<u32> = ids.iter().copied().filter(|&id| !id_in_vocab(id, vocab)).collect();
                if !outside.is_empty() {
                    self.refuse(
                        RejectCode::TokenOutOfVocab,
                        "trainable_token_indices",
                        format!(
                            "{} ids {outside:?} are outside the served vocabulary of {vocab}",
                            module.name()
                        ),
                    );
                }
            }
            (None, true) => {}
        }
        if let Some(key) = tensors.base_table() {
            let want = [vocab, hidden];
            if self.shapes.get(key).map(Vec::as_slice) != Some(&want[..]) {
                let got = self.shapes.get(key).cloned().unwrap_or_default();
                self.refuse(
                    RejectCode::Shape,
                    key,
                    format!("shape {got:?}, expected the served table's {want:?}"),
                );
            }
        }
    }

    fn finish(mut self, name: &str) -> Result<AuditReport, AuditError> {
        let overlay = self.audit_overlay();
        let (mut skipped, mut refused): (Vec<Refusal>, Vec<Refusal>) = self
            .issues
            .into_iter()
            .partition(|r| self.opts.allow_partial && r.code.skippable());
        let nothing_served = self.placed.is_empty()
            && self.experts.is_empty()
            && self.embedding.is_none()
            && self.lm_head.is_none()
            && overlay.is_empty();
        if nothing_served && refused.is_empty() {
            refused.push(Refusal::new(
                RejectCode::Empty,
                ADAPTER_WEIGHTS,
                if skipped.is_empty() {
                    "the adapter has no tensor to serve"
                } else {
                    "every tensor was skipped; nothing is left to serve"
                },
            ));
        }
        skipped.sort_by(|x, y| (x.code, &x.subject).cmp(&(y.code, &y.subject)));
        refused.sort_by(|x, y| (x.code, &x.subject).cmp(&(y.code, &y.subject)));
        self.placed.sort_by_key(|p| (p.layer, p.module));
        // The rank's slot: a placement whose cut does not divide the
        // model's geometry is an error naming the dimension.
        let slot_bytes = self.opts.slot_layout(self.cfg)?.slot_bytes();
        // An expert-parallel rank places its own experts and the
        // (replicated) router; the others are audited, never loaded.
        let group_expert_pairs = self.experts.len();
        if let Some(moe) = self.cfg.moe.as_ref() {
            let placement = self.opts.placement;
            let range = placement
                .expert_range(moe.num_experts)
                .map_err(lora_layout::LayoutError::from)?;
            self.experts.retain(|p| match p.site {
                ExpertSite::Router => true,
                ExpertSite::Expert { expert, .. } => range.contains(&expert),
            });
        }
        let expert_bytes = if self.experts.is_empty() {
            0
        } else {
            expert_router_bytes(
                self.cfg,
                self.opts.expert_rank,
                self.experts.iter().map(|p| (p.layer, p.site)),
            )?
        };
        Ok(AuditReport {
            adapter: name.to_string(),
            placed: self.placed,
            experts: self.experts,
            embedding: self.embedding,
            lm_head: self.lm_head,
            overlay,
            skipped,
            refused,
            has_expert_deltas: self.has_expert_deltas,
            group_expert_pairs,
            slot_bytes,
            expert_bytes,
            max_rank: self.opts.max_rank,
            expert_rank: self.opts.expert_rank,
        })
    }
}

/// Which half of the output head's LoRA pair `name` is
/// (`[base_model.model.][prefix.]lm_head.lora_A.weight` / `lora_B`), or
/// `None`. The head is a model-level module, outside the decoder layers.
fn head_half(name: &str) -> Option<AdapterAb> {
    let path = name.strip_prefix("base_model.model.").unwrap_or(name);
    let (module, ab) = if let Some(m) = path.strip_suffix(".lora_A.weight") {
        (m, AdapterAb::A)
    } else {
        (path.strip_suffix(".lora_B.weight")?, AdapterAb::B)
    };
    (module == "lm_head" || module.ends_with(".lm_head")).then_some(ab)
}

/// A fused pair's contiguous B rows `out_rows`.
fn fused_rows(num_experts: usize, out_rows: Range<usize>) -> ExpertSlice {
    ExpertSlice::Fused { num_experts, out_rows }
}

/// The configured trainable ids: `(embed, lm_head)`. The list form names
/// the input embedding; other modules of the dict form are refused by
/// [`PeftAdapterConfig::refusals`].
fn config_token_ids(config: &PeftAdapterConfig) -> (Vec<u32>, Vec<u32>) {
    let (mut embed, mut head) = (Vec::new(), Vec::new());
    match &config.trainable_token_indices {
        None => {}
        Some(TrainableTokenIndices::List(ids)) => embed.clone_from(ids),
        Some(TrainableTokenIndices::PerModule(per_module)) => {
            for (name, ids) in per_module {
                match crate::peft_config::table_of_module(name) {
                    Some(OverlayModule::Embed) => embed.extend_from_slice(ids),
                    Some(OverlayModule::LmHead) => head.extend_from_slice(ids),
                    None => {}
                }
            }
        }
    }
    (embed, head)
}

#[cfg(test)]
mod tests;
