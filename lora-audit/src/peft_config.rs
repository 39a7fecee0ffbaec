//! `adapter_config.json`: every field that changes the math, read with
//! PEFT's defaults, and the refusals the config alone proves.
//!
//! `rank_pattern` and `alpha_pattern` are read in file order (PEFT tries
//! their keys in dict order, which is the file's), by a small
//! order-preserving visitor: `serde_json`'s own maps are sorted.

use std::collections::HashMap;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::Value;

use crate::error::{AuditError, Refusal, RejectCode};
use crate::pattern::{MAX_PATTERN_KEYS, PatternTable};

/// The largest `adapter_config.json` read, in bytes (8 MiB). A PEFT config
/// is a few kilobytes; the largest real ones carry one `rank_pattern` and
/// one `alpha_pattern` entry per module, about 2.5 MB each for a
/// transformers 4.x per-expert adapter of DeepSeek-V3 (45k modules). Past
/// it, the text is not parsed: [`AuditError::ConfigTooLarge`]. This bounds
/// the work and memory of the audit of any config, a peer's included.
pub const MAX_ADAPTER_CONFIG_BYTES: usize = 8 << 20;

/// `target_modules` as PEFT reads it. Selection only: the tensors present
/// are the truth, so the audit never evaluates it against the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetModules {
    /// A list of names (exact, or a `.`-suffix of the module path).
    List(Vec<String>),
    /// A regex string matched with `re.fullmatch`, or `all-linear`.
    Regex(String),
}

/// `trainable_token_indices`: ids whose rows are trained as ABSOLUTE values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrainableTokenIndices {
    /// The list form: ids of the input embedding (and of a tied lm_head).
    List(Vec<u32>),
    /// The dict form: `{module name: ids}` in file order.
    PerModule(Vec<(String, Vec<u32>)>),
}

/// `init_lora_weights`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitLoraWeights {
    /// `true` (B zero) or `false` (random, for tests).
    Bool(bool),
    /// A named initialisation (`gaussian`, `pissa`, `olora`, ...).
    Named(String),
}

/// The parsed `adapter_config.json` (PEFT 0.21 field names and defaults).
#[derive(Debug, Clone)]
pub struct PeftAdapterConfig {
    /// `peft_type` (default `LORA`).
    pub peft_type: String,
    /// `r` (default 8): the default rank; tensor shapes are the truth.
    pub r: usize,
    /// `lora_alpha` (default 8).
    pub lora_alpha: f64,
    /// `use_rslora`: scale `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// `rank_pattern`, in file order.
    pub rank_pattern: PatternTable<usize>,
    /// `alpha_pattern`, in file order.
    pub alpha_pattern: PatternTable<f64>,
    /// `target_modules` (selection only).
    pub target_modules: Option<TargetModules>,
    /// `target_parameters`: `nn.Parameter` targets (5.x fused experts, routers).
    pub target_parameters: Vec<String>,
    /// `modules_to_save`: full replacement tables.
    pub modules_to_save: Vec<String>,
    /// `trainable_token_indices`.
    pub trainable_token_indices: Option<TrainableTokenIndices>,
    /// `use_dora`.
    pub use_dora: bool,
    /// `lora_bias`.
    pub lora_bias: bool,
    /// `bias` (`none`, `all`, `lora_only`).
    pub bias: String,
    /// `init_lora_weights` (default `true`).
    pub init_lora_weights: InitLoraWeights,
    /// `alora_invocation_tokens` is set.
    pub alora: bool,
    /// `layer_replication` is set.
    pub layer_replication: bool,
    /// `use_qalora`.
    pub use_qalora: bool,
    /// `use_bdlora` is set.
    pub use_bdlora: bool,
    /// Other LoRA-variant fields that are set (`velora_config`, ...).
    pub other_variants: Vec<&'static str>,
    /// `base_model_name_or_path`, for reports.
    pub base_model_name_or_path: Option<String>,
}

/// Variant fields PEFT tags `is_lora_variant` beyond those with their own code.
const OTHER_VARIANT_FIELDS: [&str; 4] = ["velora_config", "monteclora_config", "arrow_config", "kasa_config"];

/// Initialisations that rewrite the base weights (the adapter is relative to
/// a modified base): PEFT's `pissa*`, `corda*`, `olora`, `loftq`, `lora_ga`.
fn init_mutates_base(name: &str) -> bool {
    name.starts_with("pissa")
        || name.starts_with("corda")
        || name.eq_ignore_ascii_case("olora")
        || name == "loftq"
        || name == "lora_ga"
}

/// Initialisations that only choose the starting A and B.
const PLAIN_INITS: [&str; 3] = ["gaussian", "eva", "orthogonal"];

/// Parse `adapter_config.json` and refuse what the config alone proves
/// unservable: `Err(AuditError::ConfigRefused)` lists every such refusal.
/// [`PeftAdapterConfig::from_json`] parses without refusing.
pub fn parse_peft_adapter_config(json: &str) -> Result<PeftAdapterConfig, AuditError> {
    let cfg = PeftAdapterConfig::from_json(json)?;
    let refusals = cfg.refusals();
    if refusals.is_empty() {
        Ok(cfg)
    } else {
        Err(AuditError::ConfigRefused(refusals))
    }
}

impl PeftAdapterConfig {
    /// Parse the JSON text; an error only for text that is not a JSON object
    /// or a field of the wrong type. Refusals are [`refusals`](Self::refusals).
    ///
    /// Bounds: the text is at most [`MAX_ADAPTER_CONFIG_BYTES`]
    /// ([`AuditError::ConfigTooLarge`]); `rank_pattern` and `alpha_pattern`
    /// have at most [`MAX_PATTERN_KEYS`] distinct keys each
    /// ([`AuditError::PatternLimit`]). Parsing and compiling are linear in
    /// the text's size.
    pub fn from_json(json: &str) -> Result<PeftAdapterConfig, AuditError> {
        if json.len() > MAX_ADAPTER_CONFIG_BYTES {
            return Err(AuditError::ConfigTooLarge {
                bytes: json.len() as u64,
                limit: MAX_ADAPTER_CONFIG_BYTES,
            });
        }
        let top = OrderedConfig::parse(json)?;
        for (field, keys) in [
            ("rank_pattern", top.rank_pattern.len()),
            ("alpha_pattern", top.alpha_pattern.len()),
        ] {
            if keys > MAX_PATTERN_KEYS {
                return Err(AuditError::PatternLimit {
                    field,
                    keys,
                    limit: MAX_PATTERN_KEYS,
                });
            }
        }
        let f = Fields(&top);
        let other_variants = OTHER_VARIANT_FIELDS
            .into_iter()
            .filter(|field| f.truthy(field))
            .collect();
        Ok(PeftAdapterConfig {
            peft_type: f.string("peft_type")?.unwrap_or_else(|| "LORA".to_string()),
            r: f.rank("r")?.unwrap_or(8),
            lora_alpha: f.number("lora_alpha")?.unwrap_or(8.0),
            use_rslora: f.bool("use_rslora")?,
            rank_pattern: PatternTable::new(pattern_values(&top.rank_pattern, "rank_pattern", as_rank)?),
            alpha_pattern: PatternTable::new(pattern_values(&top.alpha_pattern, "alpha_pattern", as_number)?),
            target_modules: match f.get("target_modules") {
                None => None,
                Some(Value::String(s)) => Some(TargetModules::Regex(s.clone())),
                Some(v) => Some(TargetModules::List(string_list(v, "target_modules")?)),
            },
            target_parameters: f.string_list("target_parameters")?,
            modules_to_save: f.string_list("modules_to_save")?,
            trainable_token_indices: match f.get("trainable_token_indices") {
                None => None,
                Some(Value::Object(map)) => Some(TrainableTokenIndices::PerModule(
                    map.iter()
                        .map(|(k, v)| Ok((k.clone(), token_ids(v, "trainable_token_indices")?)))
                        .collect::<Result<_, AuditError>>()?,
                )),
                Some(v) => Some(TrainableTokenIndices::List(token_ids(v, "trainable_token_indices")?)),
            },
            use_dora: f.bool("use_dora")?,
            lora_bias: f.bool("lora_bias")?,
            bias: f.string("bias")?.unwrap_or_else(|| "none".to_string()),
            init_lora_weights: match f.get("init_lora_weights") {
                None => InitLoraWeights::Bool(true),
                Some(Value::Bool(b)) => InitLoraWeights::Bool(*b),
                Some(Value::String(s)) => InitLoraWeights::Named(s.clone()),
                Some(v) => return Err(AuditError::field("init_lora_weights", format!("unexpected value {v}"))),
            },
            alora: f.truthy("alora_invocation_tokens"),
            layer_replication: f.truthy("layer_replication"),
            use_qalora: f.bool("use_qalora")?,
            use_bdlora: f.truthy("use_bdlora"),
            other_variants,
            base_model_name_or_path: f.string("base_model_name_or_path")?,
        })
    }

    /// Everything the config alone proves unservable, each naming its field.
    pub fn refusals(&self) -> Vec<Refusal> {
        let mut out = Vec::new();
        let mut refuse = |code, field: &str, reason: String| out.push(Refusal::new(code, field, reason));
        if self.peft_type != "LORA" {
            refuse(
                RejectCode::PeftType,
                "peft_type",
                format!("`{}` is not a LoRA adapter", self.peft_type),
            );
        }
        if self.use_dora {
            refuse(
                RejectCode::Dora,
                "use_dora",
                "DoRA rescales each output row by the magnitude over the adapted weight's row norm; this pool is not built for it (LoraOptions::dora, LORA_DORA=1, --dora)".into(),
            );
        }
        if self.lora_bias {
            refuse(
                RejectCode::LoraBias,
                "lora_bias",
                "lora_B.bias terms have no space in the pool".into(),
            );
        }
        match &self.init_lora_weights {
            InitLoraWeights::Named(name) if init_mutates_base(name) => refuse(
                RejectCode::InitMutatesBase,
                "init_lora_weights",
                format!("`{name}` rewrites the base weights; the adapter is relative to a base this model is not"),
            ),
            InitLoraWeights::Named(name) if name == "mica" => refuse(
                RejectCode::LoraVariant,
                "init_lora_weights",
                "`mica` selects the MiCA LoRA variant".into(),
            ),
            InitLoraWeights::Named(name) if !PLAIN_INITS.contains(&name.as_str()) => refuse(
                RejectCode::InitMutatesBase,
                "init_lora_weights",
                format!("unknown initialisation `{name}` may rewrite the base weights"),
            ),
            _ => {}
        }
        if self.alora {
            refuse(
                RejectCode::Alora,
                "alora_invocation_tokens",
                "activated LoRA applies only after its invocation tokens".into(),
            );
        }
        if self.layer_replication {
            refuse(
                RejectCode::LayerReplication,
                "layer_replication",
                "the adapter stacks replicated layers the base model does not have".into(),
            );
        }
        if self.use_qalora {
            refuse(
                RejectCode::Qalora,
                "use_qalora",
                "QALoRA pools the inputs of a quantized base".into(),
            );
        }
        if self.use_bdlora {
            refuse(
                RejectCode::Bdlora,
                "use_bdlora",
                "block-diagonal LoRA factors are not plain pairs".into(),
            );
        }
        for field in &self.other_variants {
            refuse(
                RejectCode::LoraVariant,
                field,
                "a LoRA variant whose math is not a plain pair".into(),
            );
        }
        for name in &self.modules_to_save {
            if table_of_module(name).is_none() {
                refuse(
                    RejectCode::ModulesToSave,
                    "modules_to_save",
                    format!("`{name}` is not embed_tokens or lm_head; only token tables can be overlaid"),
                );
            }
        }
        if let Some(TrainableTokenIndices::PerModule(per_module)) = &self.trainable_token_indices {
            for (name, _) in per_module {
                if table_of_module(name).is_none() {
                    refuse(
                        RejectCode::TrainableTokens,
                        "trainable_token_indices",
                        format!("`{name}` is not embed_tokens or lm_head"),
                    );
                }
            }
        }
        for (field, errors) in [
            ("rank_pattern", pattern_errors(&self.rank_pattern)),
            ("alpha_pattern", pattern_errors(&self.alpha_pattern)),
        ] {
            for (key, why) in errors {
                refuse(RejectCode::PatternRegex, field, format!("key `{key}`: {why}"));
            }
        }
        out
    }

    /// The rank the config gives the module at `pattern_path` (PEFT's module
    /// or parameter path): the first matching `rank_pattern` key, else `r`.
    pub fn rank_for(&self, pattern_path: &str) -> usize {
        self.rank_pattern.lookup(pattern_path).map_or(self.r, |(_, r)| r)
    }

    /// The alpha of the module at `pattern_path`: the first matching
    /// `alpha_pattern` key, else `lora_alpha`.
    pub fn alpha_for(&self, pattern_path: &str) -> f64 {
        self.alpha_pattern
            .lookup(pattern_path)
            .map_or(self.lora_alpha, |(_, a)| a)
    }

    /// PEFT's scaling for a pair of rank `rank` (from its shapes) at
    /// `pattern_path`: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA, as
    /// served (f32: an infinity when the quotient overflows it, which the
    /// audit refuses as `REJECT[non-finite-scale]`).
    pub fn scale_for(&self, pattern_path: &str, rank: usize) -> f32 {
        let alpha = self.alpha_for(pattern_path);
        let r = rank as f64;
        let scale = if self.use_rslora { alpha / r.sqrt() } else { alpha / r };
        scale as f32
    }
}

/// Which token table a `modules_to_save` / `trainable_token_indices` name
/// means, by its last path component.
pub(crate) fn table_of_module(name: &str) -> Option<crate::overlay::OverlayModule> {
    match name.rsplit('.').next().unwrap_or(name) {
        "embed_tokens" => Some(crate::overlay::OverlayModule::Embed),
        "lm_head" => Some(crate::overlay::OverlayModule::LmHead),
        _ => None,
    }
}

fn pattern_errors<T: Copy>(table: &PatternTable<T>) -> Vec<(String, String)> {
    table
        .entries()
        .iter()
        .filter_map(|e| e.error().map(|why| (e.key.clone(), why.to_string())))
        .collect()
}

// --- order-preserving JSON reading -----------------------------------------------------------

/// The top-level object: fields (last duplicate wins, as in Python) and the
/// two pattern objects in file order.
#[derive(Default)]
struct OrderedConfig {
    fields: serde_json::Map<String, Value>,
    rank_pattern: Vec<(String, Value)>,
    alpha_pattern: Vec<(String, Value)>,
}

impl OrderedConfig {
    fn parse(json: &str) -> Result<OrderedConfig, AuditError> {
        let mut de = serde_json::Deserializer::from_str(json);
        let cfg = TopVisitor.deserialize(&mut de).map_err(|e| AuditError::ConfigJson {
            path: crate::ADAPTER_CONFIG.to_string(),
            reason: e.to_string(),
        })?;
        de.end().map_err(|e| AuditError::ConfigJson {
            path: crate::ADAPTER_CONFIG.to_string(),
            reason: e.to_string(),
        })?;
        Ok(cfg)
    }
}

struct TopVisitor;

impl<'de> DeserializeSeed<'de> for TopVisitor {
    type Value = OrderedConfig;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<OrderedConfig, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for TopVisitor {
    type Value = OrderedConfig;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedConfig, A::Error> {
        let mut cfg = OrderedConfig::default();
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "rank_pattern" => cfg.rank_pattern = map.next_value_seed(OrderedObject)?,
                "alpha_pattern" => cfg.alpha_pattern = map.next_value_seed(OrderedObject)?,
                _ => {
                    let v: Value = map.next_value()?;
                    cfg.fields.insert(key, v);
                }
            }
        }
        Ok(cfg)
    }
}

/// A JSON object (or null) as `(key, value)` pairs in file order. A repeated
/// key keeps its first position and takes the last value, as a Python dict
/// built by `json.load` does. Linear: repeats are found through a hash map.
struct OrderedObject;

impl<'de> DeserializeSeed<'de> for OrderedObject {
    type Value = Vec<(String, Value)>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for OrderedObject {
    type Value = Vec<(String, Value)>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object or null")
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out: Vec<(String, Value)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        while let Some(key) = map.next_key::<String>()? {
            let v: Value = map.next_value()?;
            match index.get(&key) {
                Some(&i) => out[i].1 = v,
                None => {
                    index.insert(key.clone(), out.len());
                    out.push((key, v));
                }
            }
        }
        Ok(out)
    }
}

// --- typed field access --------------------------------------------------------------------

struct Fields<'a>(&'a OrderedConfig);

impl Fields<'_> {
    /// The field, `None` when absent or null.
    fn get(&self, field: &str) -> Option<&Value> {
        self.0.fields.get(field).filter(|v| !v.is_null())
    }

    /// Python truthiness of a field PEFT tests with `bool(...)`: objects count
    /// as set whenever present (PEFT turns them into config objects).
    fn truthy(&self, field: &str) -> bool {
        match self.get(field) {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
            Some(Value::String(s)) => !s.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        }
    }

    fn bool(&self, field: &str) -> Result<bool, AuditError> {
        match self.get(field) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(AuditError::field(field, format!("expected a boolean, got {v}"))),
        }
    }

    fn string(&self, field: &str) -> Result<Option<String>, AuditError> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(AuditError::field(field, format!("expected a string, got {v}"))),
        }
    }

    fn number(&self, field: &str) -> Result<Option<f64>, AuditError> {
        self.get(field).map(|v| as_number(v, field)).transpose()
    }

    fn rank(&self, field: &str) -> Result<Option<usize>, AuditError> {
        self.get(field).map(|v| as_rank(v, field)).transpose()
    }

    fn string_list(&self, field: &str) -> Result<Vec<String>, AuditError> {
        self.get(field).map_or(Ok(Vec::new()), |v| string_list(v, field))
    }
}

fn as_number(v: &Value, field: &str) -> Result<f64, AuditError> {
    v.as_f64()
        .filter(|x| x.is_finite())
        .ok_or_else(|| AuditError::field(field, format!("expected a finite number, got {v}")))
}

/// Upper bound on a rank: far above any real adapter, low enough that byte
/// arithmetic on it cannot overflow.
const MAX_CONFIG_RANK: u64 = 1 << 20;

fn as_rank(v: &Value, field: &str) -> Result<usize, AuditError> {
    v.as_u64()
        .filter(|&r| (1..=MAX_CONFIG_RANK).contains(&r))
        .and_then(|r| usize::try_from(r).ok())
        .ok_or_else(|| AuditError::field(field, format!("expected a rank in 1..={MAX_CONFIG_RANK}, got {v}")))
}

fn string_list(v: &Value, field: &str) -> Result<Vec<String>, AuditError> {
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) => items
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| AuditError::field(field, format!("expected strings, got {x}")))
            })
            .collect(),
        _ => Err(AuditError::field(field, format!("expected a list of strings, got {v}"))),
    }
}

fn token_ids(v: &Value, field: &str) -> Result<Vec<u32>, AuditError> {
    let items = v
        .as_array()
        .ok_or_else(|| AuditError::field(field, format!("expected a list of token ids, got {v}")))?;
    items
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| AuditError::field(field, format!("expected a token id in 0..2^32, got {x}")))
        })
        .collect()
}

fn pattern_values<T>(
    entries: &[(String, Value)],
    field: &str,
    convert: impl Fn(&Value, &str) -> Result<T, AuditError>,
) -> Result<Vec<(String, T)>, AuditError> {
    entries
        .iter()
        .map(|(k, v)| Ok((k.clone(), convert(v, &format!("{field}.{k}"))?)))
        .collect()
}

#[cfg(test)]
mod tests;
