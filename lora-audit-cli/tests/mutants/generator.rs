//! The mutant generator of the hostile-input harness (issue 42): a few
//! hundred seeded mutants of the bundled llama fixtures. One file, used by
//! `lora-audit-cli/tests/mutants.rs` (the `check` and `probe` processes) and by
//! `lora-pool/tests/mutants.rs` (the disk swap into a CPU pool) through
//! `#[path]`, so that both see the same mutants.
//!
//! Families: truncations at every header boundary, rewritten length
//! prefixes, seeded bit flips, header rewrites (offsets huge, negative,
//! overlapping, past the end; names repeated, not UTF-8; dtypes unknown;
//! shapes that do not match the bytes; entries of the wrong type), NaN and
//! Inf data, and JSON mutations of `adapter_config.json` and of the model's
//! `config.json`. Every mutant says what it may do ([`Expect`]).
//!
//! `MUTANTS_SEED=<u64>` picks another seed (the default is fixed, so CI sees
//! the same mutants on every run).

#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// The fixture model the mutants are of.
pub const MODEL: &str = "llama";

/// The adapters mutated: F32, BF16 and F16 files, rank and alpha patterns,
/// trainable tokens, `modules_to_save` tables, and one the audit refuses.
pub const FIXTURES: &[&str] = &[
    "demo_r4_plain",
    "dense_all_linear_bf16",
    "dense_all_linear_f16",
    "rank_alpha_pattern",
    "trainable_tokens_untied_dict",
    "modules_to_save_embed_lm_head",
    "dora",
];

/// The default seed.
pub const DEFAULT_SEED: u64 = 0x0069_7373_7565_3432;

/// The seed in use: `MUTANTS_SEED`, else [`DEFAULT_SEED`].
pub fn seed() -> u64 {
    std::env::var("MUTANTS_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_SEED)
}

/// `fixtures/` at the workspace root (`LORA_FIXTURES_DIR` when set).
pub fn fixtures_root() -> PathBuf {
    std::env::var_os("LORA_FIXTURES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures"))
}

/// `fixtures/llama/<adapter>`.
pub fn fixture_dir(adapter: &str) -> PathBuf {
    fixtures_root().join(MODEL).join(adapter)
}

/// `fixtures/llama/config.json`.
pub fn model_config_path() -> PathBuf {
    fixtures_root().join(MODEL).join("config.json")
}

/// A small seeded generator (splitmix64).
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            lo
        } else {
            lo + (self.next_u64() % (hi - lo) as u64) as usize
        }
    }
}

/// What a mutant may do, beyond never crashing, hanging or changing the
/// pool on a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Anything that is an answer: it may still be a valid adapter.
    Any,
    /// Exactly what the unmutated fixture does (a rewrite that changes no
    /// meaning: the header rebuilt, padded, fields reordered, ...).
    Same,
    /// Never servable: refused (exit 1) or unreadable (exit 2).
    NotServable,
    /// Invalid input, a typed error: exit 2 (not a refusal).
    Unreadable,
}

/// One mutant: the adapter's two files, and the model config when that is
/// what was mutated.
pub struct Mutant {
    /// Its index in [`mutants`].
    pub id: usize,
    /// The fixture adapter it was made from.
    pub fixture: &'static str,
    /// What was done to it.
    pub what: String,
    /// What it may do.
    pub expect: Expect,
    /// `adapter_config.json`.
    pub config: Vec<u8>,
    /// `adapter_model.safetensors`.
    pub weights: Vec<u8>,
    /// A mutated model `config.json`; `None`: the fixture model's.
    pub model: Option<Vec<u8>>,
}

impl Mutant {
    /// `#id fixture: what`, for messages.
    pub fn label(&self) -> String {
        format!("#{} {}: {}", self.id, self.fixture, self.what)
    }

    /// Write the adapter (`adapter_config.json`, `adapter_model.safetensors`)
    /// into `dir`, creating it.
    pub fn write_adapter(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("adapter_config.json"), &self.config).unwrap();
        std::fs::write(dir.join("adapter_model.safetensors"), &self.weights).unwrap();
    }
}

/// A scratch directory unique to this process and tag, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// A fresh `lora-mutants-<tag>-<pid>-<nanos>` under the temp dir.
    pub fn new(tag: &str) -> Scratch {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!("lora-mutants-{tag}-{}-{nanos}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// A path inside it.
    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tensor of a fixture's header.
#[derive(Debug, Clone)]
struct Tensor {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

impl Tensor {
    fn elem_bytes(&self) -> usize {
        match self.dtype.as_str() {
            "F32" | "I32" => 4,
            "F16" | "BF16" => 2,
            _ => 8,
        }
    }
}

/// One header entry as raw JSON pieces, so that any piece can be replaced
/// by anything.
#[derive(Debug, Clone)]
struct RawEntry {
    /// The key, as raw bytes (a JSON string literal, or not).
    key: Vec<u8>,
    dtype: String,
    shape: String,
    offsets: String,
    /// Appended after the three fields (`,"x":...`).
    extra: String,
    /// Replaces the whole value when set.
    whole: Option<String>,
}

impl RawEntry {
    fn of(t: &Tensor) -> RawEntry {
        RawEntry {
            key: json_str(&t.name).into_bytes(),
            dtype: json_str(&t.dtype),
            shape: format!("{:?}", t.shape),
            offsets: format!("[{},{}]", t.start, t.end),
            extra: String::new(),
            whole: None,
        }
    }

    fn render(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key);
        out.push(b':');
        match &self.whole {
            Some(w) => out.extend_from_slice(w.as_bytes()),
            None => out.extend_from_slice(
                format!(
                    "{{\"dtype\":{},\"shape\":{},\"data_offsets\":{}{}}}",
                    self.dtype, self.shape, self.offsets, self.extra
                )
                .as_bytes(),
            ),
        }
    }
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

/// A fixture adapter read and its header parsed.
struct Fixture {
    name: &'static str,
    config: Vec<u8>,
    weights: Vec<u8>,
    header_len: usize,
    /// Sorted by data offset.
    tensors: Vec<Tensor>,
    /// The raw `__metadata__` value, if any.
    metadata: Option<String>,
}

impl Fixture {
    fn read(name: &'static str) -> Fixture {
        let dir = fixture_dir(name);
        let config = std::fs::read(dir.join("adapter_config.json")).unwrap();
        let weights = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
        let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
        let header: Map<String, Value> = serde_json::from_slice(&weights[8..8 + header_len]).unwrap();
        let mut tensors = Vec::new();
        let mut metadata = None;
        for (k, v) in header {
            if k == "__metadata__" {
                metadata = Some(v.to_string());
                continue;
            }
            let offsets = v["data_offsets"].as_array().unwrap();
            tensors.push(Tensor {
                name: k,
                dtype: v["dtype"].as_str().unwrap().to_string(),
                shape: v["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize)
                    .collect(),
                start: offsets[0].as_u64().unwrap() as usize,
                end: offsets[1].as_u64().unwrap() as usize,
            });
        }
        tensors.sort_by_key(|t| t.start);
        Fixture {
            name,
            config,
            weights,
            header_len,
            tensors,
            metadata,
        }
    }

    fn data_start(&self) -> usize {
        8 + self.header_len
    }

    fn data(&self) -> &[u8] {
        &self.weights[self.data_start()..]
    }

    fn raw_entries(&self) -> Vec<RawEntry> {
        self.tensors.iter().map(RawEntry::of).collect()
    }

    /// A file of `entries` (and the metadata, unless `metadata` overrides
    /// it: `Some(None)` drops it) over `data`.
    fn file(&self, entries: &[RawEntry], metadata: Option<Option<&str>>, data: &[u8]) -> Vec<u8> {
        let mut header = vec![b'{'];
        let meta = match metadata {
            Some(m) => m.map(str::to_string),
            None => self.metadata.clone(),
        };
        let mut first = true;
        if let Some(m) = meta {
            header.extend_from_slice(format!("\"__metadata__\":{m}").as_bytes());
            first = false;
        }
        for e in entries {
            if !first {
                header.push(b',');
            }
            first = false;
            e.render(&mut header);
        }
        header.push(b'}');
        with_header(&header, data)
    }
}

/// `len | header | data`.
fn with_header(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// `json` (an object) with each `(key, raw)` set to the raw JSON text `raw`
/// (`None`: the key removed).
fn json_with(json: &[u8], edits: &[(&str, Option<&str>)]) -> Vec<u8> {
    let mut obj: Map<String, Value> = serde_json::from_slice(json).unwrap();
    let mut raws = Vec::new();
    for (i, (key, raw)) in edits.iter().enumerate() {
        match raw {
            None => {
                obj.remove(*key);
            }
            Some(raw) => {
                let placeholder = format!("@@RAW{i}@@");
                obj.insert(key.to_string(), Value::String(placeholder.clone()));
                raws.push((format!("\"{placeholder}\""), raw.to_string()));
            }
        }
    }
    let mut text = serde_json::to_string_pretty(&obj).unwrap();
    for (placeholder, raw) in raws {
        text = text.replacen(&placeholder, &raw, 1);
    }
    text.into_bytes()
}

/// `n` nested arrays.
fn nested(n: usize) -> String {
    format!("{}{}", "[".repeat(n), "]".repeat(n))
}

/// Encodings of a value in a tensor of `dtype`.
fn encode(dtype: &str, value: f32) -> Vec<u8> {
    match dtype {
        "F32" => value.to_le_bytes().to_vec(),
        "BF16" => half::bf16::from_f32(value).to_le_bytes().to_vec(),
        "F16" => half::f16::from_f32(value).to_le_bytes().to_vec(),
        other => panic!("unexpected dtype {other}"),
    }
}

/// Mutants are collected here.
struct Out {
    mutants: Vec<Mutant>,
}

impl Out {
    fn push(&mut self, f: &Fixture, what: impl Into<String>, expect: Expect, config: Vec<u8>, weights: Vec<u8>) {
        let id = self.mutants.len();
        self.mutants.push(Mutant {
            id,
            fixture: f.name,
            what: what.into(),
            expect,
            config,
            weights,
            model: None,
        });
    }

    fn weights(&mut self, f: &Fixture, what: impl Into<String>, expect: Expect, weights: Vec<u8>) {
        self.push(f, what, expect, f.config.clone(), weights);
    }

    fn config(&mut self, f: &Fixture, what: impl Into<String>, expect: Expect, config: Vec<u8>) {
        self.push(f, what, expect, config, f.weights.clone());
    }

    fn model(&mut self, f: &Fixture, what: impl Into<String>, expect: Expect, model: Vec<u8>) {
        self.push(f, what, expect, f.config.clone(), f.weights.clone());
        self.mutants.last_mut().unwrap().model = Some(model);
    }
}

/// Every mutant, deterministic for a seed.
pub fn mutants(seed: u64) -> Vec<Mutant> {
    let mut rng = SplitMix::new(seed);
    let fixtures: Vec<Fixture> = FIXTURES.iter().map(|n| Fixture::read(n)).collect();
    let mut out = Out { mutants: Vec::new() };
    for f in &fixtures {
        truncations(&mut out, f);
        length_prefixes(&mut out, f);
        bit_flips(&mut out, f, &mut rng);
        data_values(&mut out, f, &mut rng);
    }
    // The longer families go to two fixtures each, in turn.
    let n = fixtures.len();
    for (i, m) in header_mutations().into_iter().enumerate() {
        for k in [i % n, (i + 3) % n] {
            let f = &fixtures[k];
            let (what, expect, weights) = m(f, &mut rng);
            out.weights(f, what, expect, weights);
        }
    }
    for (i, (what, edits, expect)) in config_edits().into_iter().enumerate() {
        for k in [i % n, (i + 2) % n] {
            let f = &fixtures[k];
            let edits: Vec<(&str, Option<&str>)> = edits.iter().map(|(k, r)| (*k, r.as_deref())).collect();
            let config = json_with(&f.config, &edits);
            out.config(f, what.clone(), expect, config);
        }
    }
    for i in 0..config_texts(&fixtures[0].config).len() {
        let f = &fixtures[i % n];
        let (what, config, expect) = config_texts(&f.config).swap_remove(i);
        out.config(f, what, expect, config);
    }
    let model = std::fs::read(model_config_path()).unwrap();
    for (i, (what, text, expect)) in model_mutations(&model).into_iter().enumerate() {
        // Dense MLP adapters, trainable tokens, plain attention in turn.
        let f = &fixtures[[1, 4, 0][i % 3]];
        out.model(f, what, expect, text);
    }
    out.mutants
}

/// Cuts at every boundary: inside the 8-byte prefix, inside the header, at
/// the header/data boundary, at tensor boundaries, inside the data.
fn truncations(out: &mut Out, f: &Fixture) {
    let (d, len) = (f.data_start(), f.weights.len());
    let first_end = d + f.tensors[0].end;
    let mut cuts = vec![
        0,
        1,
        4,
        7,
        8,
        9,
        8 + f.header_len / 2,
        d - 1,
        d,
        d + 1,
        first_end - 1,
        first_end,
        d + (len - d) / 2,
        len - 1,
    ];
    cuts.sort_unstable();
    cuts.dedup();
    for cut in cuts.into_iter().filter(|&c| c < len) {
        out.weights(
            f,
            format!("weights cut to {cut} of {len} bytes"),
            Expect::Unreadable,
            f.weights[..cut].to_vec(),
        );
    }
    out.weights(
        f,
        "one byte appended",
        Expect::Unreadable,
        [f.weights.as_slice(), &[0]].concat(),
    );
}

/// The header length rewritten.
fn length_prefixes(out: &mut Out, f: &Fixture) {
    let n = f.header_len as u64;
    let total = f.weights.len() as u64;
    for (what, value) in [
        ("0", 0),
        ("n - 1", n - 1),
        ("n + 1", n + 1),
        ("the whole rest of the file", total - 8),
        ("past the end of the file", total),
        ("2^40", 1 << 40),
        ("u64::MAX", u64::MAX),
        ("n + 2^32", n + (1 << 32)),
    ] {
        let mut w = f.weights.clone();
        w[..8].copy_from_slice(&value.to_le_bytes());
        out.weights(f, format!("header length {what}"), Expect::Unreadable, w);
    }
}

/// Seeded bit flips in the prefix, the header and the data.
fn bit_flips(out: &mut Out, f: &Fixture, rng: &mut SplitMix) {
    let (d, len) = (f.data_start(), f.weights.len());
    for (region, lo, hi, count) in [("prefix", 0, 8, 2), ("header", 8, d, 4), ("data", d, len, 3)] {
        for _ in 0..count {
            let at = rng.range(lo, hi);
            let bit = rng.range(0, 8);
            let mut w = f.weights.clone();
            w[at] ^= 1 << bit;
            out.weights(f, format!("{region} bit {bit} of byte {at} flipped"), Expect::Any, w);
        }
    }
    // A burst of random bytes in the header.
    let mut w = f.weights.clone();
    let at = rng.range(8, d - 16);
    for b in &mut w[at..at + 16] {
        *b = rng.next_u64() as u8;
    }
    out.weights(f, format!("16 random header bytes at {at}"), Expect::Any, w);
}

/// NaN, ±Inf, and finite values into a random element of a random tensor.
fn data_values(out: &mut Out, f: &Fixture, rng: &mut SplitMix) {
    let values: [(&str, f32, Expect); 6] = [
        ("NaN", f32::NAN, Expect::NotServable),
        ("-NaN", -f32::NAN, Expect::NotServable),
        ("+Inf", f32::INFINITY, Expect::NotServable),
        ("-Inf", f32::NEG_INFINITY, Expect::NotServable),
        ("f32::MAX (an infinity in BF16)", f32::MAX, Expect::NotServable),
        ("0.125", 0.125, Expect::Any),
    ];
    for (what, value, expect) in values {
        let t = &f.tensors[rng.range(0, f.tensors.len())];
        let elems = (t.end - t.start) / t.elem_bytes();
        let i = rng.range(0, elems);
        let bytes = encode(&t.dtype, value);
        // f32::MAX only overflows where the file is F32; in BF16/F16 files
        // it is already an infinity when encoded.
        let expect = if value == f32::MAX && t.dtype != "F32" {
            let finite = match t.dtype.as_str() {
                "BF16" => half::bf16::from_le_bytes([bytes[0], bytes[1]]).is_finite(),
                _ => half::f16::from_le_bytes([bytes[0], bytes[1]]).is_finite(),
            };
            if finite { Expect::Any } else { Expect::NotServable }
        } else {
            expect
        };
        let at = f.data_start() + t.start + i * t.elem_bytes();
        let mut w = f.weights.clone();
        w[at..at + bytes.len()].copy_from_slice(&bytes);
        out.weights(f, format!("{what} at element {i} of {}", t.name), expect, w);
    }
}

/// A header mutation: what it did, what it may do, the file.
type HeaderMutation = fn(&Fixture, &mut SplitMix) -> (String, Expect, Vec<u8>);

/// Two distinct tensor indices.
fn two(f: &Fixture, rng: &mut SplitMix) -> (usize, usize) {
    let a = rng.range(0, f.tensors.len());
    let b = (a + 1 + rng.range(0, f.tensors.len() - 1)) % f.tensors.len();
    (a, b)
}

fn header_mutations() -> Vec<HeaderMutation> {
    vec![
        |f, _| {
            let e = f.raw_entries();
            (
                "the header rebuilt as it was".into(),
                Expect::Same,
                f.file(&e, None, f.data()),
            )
        },
        |f, _| {
            let mut e = f.raw_entries();
            e.reverse();
            (
                "header entries in reverse order".into(),
                Expect::Same,
                f.file(&e, None, f.data()),
            )
        },
        |f, _| {
            let mut header = f.weights[8..f.data_start()].to_vec();
            header.extend_from_slice(b"       ");
            (
                "header padded with spaces".into(),
                Expect::Same,
                with_header(&header, f.data()),
            )
        },
        |f, _| {
            let e = f.raw_entries();
            ("no __metadata__".into(), Expect::Same, f.file(&e, Some(None), f.data()))
        },
        |f, _| {
            let mut e = f.raw_entries();
            e[0].extra = ",\"x\":[1,{\"k\":[2,3]},\"s\",null,{\"deep\":[[[[{}]]]]}]".into();
            (
                "an entry with nested garbage fields".into(),
                Expect::Same,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].offsets = format!("[{},18446744073709551615]", f.tensors[t].start);
            (
                format!("tensor {t} ends at u64::MAX"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].offsets = format!("[{},18446744073709551616]", f.tensors[t].start);
            (
                format!("tensor {t} ends at 2^64"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].offsets = format!("[-8,{}]", f.tensors[t].end);
            (
                format!("tensor {t} starts at -8"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].offsets = format!("[{}.0,{}.5]", f.tensors[t].start, f.tensors[t].end);
            (
                format!("tensor {t} offsets as floats"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let (a, b) = two(f, rng);
            let len_b = f.tensors[b].end - f.tensors[b].start;
            e[b].offsets = format!("[{},{}]", f.tensors[a].start, f.tensors[a].start + len_b);
            (
                format!("tensor {b} overlaps tensor {a}"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].offsets = format!("[{},{}]", f.tensors[t].end, f.tensors[t].start);
            (
                format!("tensor {t} ends before it starts"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, _| {
            let mut e = f.raw_entries();
            let last = f.tensors.len() - 1;
            e[last].offsets = format!("[{},{}]", f.tensors[last].start, f.tensors[last].end + 4);
            (
                "the last tensor ends past the data".into(),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, _| {
            let mut e = f.raw_entries();
            for (e, t) in e.iter_mut().zip(&f.tensors) {
                e.offsets = format!("[{},{}]", t.start + 1, t.end + 1);
            }
            let data = [f.data(), &[0]].concat();
            (
                "every offset shifted by one".into(),
                Expect::Unreadable,
                f.file(&e, None, &data),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e.push(e[t].clone());
            (
                format!("tensor {t} repeated verbatim"),
                Expect::Any,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let (a, b) = two(f, rng);
            let mut dup = e[a].clone();
            dup.offsets.clone_from(&e[b].offsets);
            e.insert(0, dup);
            (
                format!("tensor {a} given first with tensor {b}'s offsets, then its own"),
                Expect::Any,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let (a, b) = two(f, rng);
            let mut dup = e[a].clone();
            dup.offsets.clone_from(&e[b].offsets);
            e.push(dup);
            (
                format!("tensor {a} repeated last with tensor {b}'s offsets"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let (a, b) = two(f, rng);
            e[b].key = e[a].key.clone();
            (
                format!("tensor {b} renamed to tensor {a}'s name"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let key = &mut e[t].key;
            let at = key.len() - 5;
            key.splice(at..at, [0xFF, 0xFE]);
            (
                format!("tensor {t}'s name not UTF-8"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let key = &mut e[t].key;
            let at = key.len() - 1;
            key.splice(at..at, b"\\ud800".iter().copied());
            (
                format!("tensor {t}'s name ends in a lone surrogate"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].key = json_str(&format!("{}\u{0}\u{202e}é", f.tensors[t].name)).into_bytes();
            (
                format!("tensor {t}'s name with a NUL and odd code points"),
                Expect::NotServable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].key = b"\"\"".to_vec();
            (
                format!("tensor {t}'s name empty"),
                Expect::NotServable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let name = f.tensors[t].name.replacen("layers.", "layers.99", 1);
            e[t].key = json_str(&name).into_bytes();
            (
                format!("tensor {t} moved to a layer past the model"),
                Expect::NotServable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let name = f.tensors[t].name.replacen("layers.", "layers.-", 1);
            e[t].key = json_str(&name).into_bytes();
            (
                format!("tensor {t} moved to layer -n"),
                Expect::NotServable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].dtype = rng_pick(rng, &["\"Q4\"", "\"f32\"", "\"\"", "7", "null", "\"F8_E9M9\""]).into();
            (
                format!("tensor {t} dtype {}", e[t].dtype),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].dtype = "\"F64\"".into();
            (
                format!("tensor {t} dtype F64 over its bytes"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let same_size = match f.tensors[t].dtype.as_str() {
                "F32" => "\"I32\"",
                _ => "\"I16\"",
            };
            e[t].dtype = same_size.into();
            (
                format!("tensor {t} dtype {same_size} over the same bytes"),
                Expect::NotServable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let mut shape = f.tensors[t].shape.clone();
            shape[0] += 1;
            e[t].shape = format!("{shape:?}");
            (
                format!("tensor {t} shape {shape:?} over fewer bytes"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].shape = rng_pick(
                rng,
                &[
                    "[4611686018427387904,8]",
                    "[4294967296,4294967296]",
                    "[-1,4]",
                    "[1.5]",
                    "\"4\"",
                ],
            )
            .into();
            (
                format!("tensor {t} shape {}", e[t].shape),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].shape = "[]".into();
            (
                format!("tensor {t} a scalar over its bytes"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let mut shape = f.tensors[t].shape.clone();
            shape.reverse();
            let expect = if shape == f.tensors[t].shape {
                Expect::Any
            } else {
                Expect::NotServable
            };
            e[t].shape = format!("{shape:?}");
            (
                format!("tensor {t} transposed to {shape:?}"),
                expect,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let elems: usize = f.tensors[t].shape.iter().product();
            e[t].shape = format!("[{elems}]");
            (
                format!("tensor {t} flattened"),
                Expect::NotServable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let mut shape = f.tensors[t].shape.clone();
            shape.push(1);
            e[t].shape = format!("{shape:?}");
            (
                format!("tensor {t} given a trailing 1 dim"),
                Expect::Any,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let which = rng.range(0, 3);
            let t_ = &f.tensors[t];
            e[t].whole = Some(match which {
                0 => format!(
                    "{{\"shape\":{:?},\"data_offsets\":[{},{}]}}",
                    t_.shape, t_.start, t_.end
                ),
                1 => format!(
                    "{{\"dtype\":\"{}\",\"data_offsets\":[{},{}]}}",
                    t_.dtype, t_.start, t_.end
                ),
                _ => format!("{{\"dtype\":\"{}\",\"shape\":{:?}}}", t_.dtype, t_.shape),
            });
            (
                format!("tensor {t} missing field {which}"),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            e[t].whole = Some(rng_pick(rng, &["5", "\"x\"", "null", "[]", "true", "{}"]).into());
            (
                format!("tensor {t} entry is {}", e[t].whole.as_deref().unwrap_or("")),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let t_ = &f.tensors[t];
            e[t].whole = Some(format!("[\"{}\",{:?},[{},{}]]", t_.dtype, t_.shape, t_.start, t_.end));
            (
                format!("tensor {t} entry as an array"),
                Expect::Same,
                f.file(&e, None, f.data()),
            )
        },
        |f, _| {
            let mut e = f.raw_entries();
            e[0].extra = format!(",\"x\":{}", nested(200));
            (
                "an entry nested 200 deep".into(),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, _| {
            let mut e = f.raw_entries();
            e[0].extra = format!(",\"x\":{}", nested(100_000));
            (
                "an entry nested 100000 deep".into(),
                Expect::Unreadable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let e = f.raw_entries();
            let meta = rng_pick(
                rng,
                &["{\"format\":1}", "[]", "\"pt\"", "{\"a\":\"\\ud800\"}", "{\"a\":{}}"],
            );
            (
                format!("__metadata__ {meta}"),
                Expect::Unreadable,
                f.file(&e, Some(Some(meta)), f.data()),
            )
        },
        |f, _| {
            let e = f.raw_entries();
            let meta: Vec<String> = (0..5000).map(|i| format!("\"k{i}\":\"v\"")).collect();
            let meta = format!("{{{}}}", meta.join(","));
            (
                "__metadata__ of 5000 keys".into(),
                Expect::Same,
                f.file(&e, Some(Some(&meta)), f.data()),
            )
        },
        |f, _| {
            (
                "the header {} over the data".into(),
                Expect::Unreadable,
                with_header(b"{}", f.data()),
            )
        },
        |_, _| {
            (
                "the header {} and no data".into(),
                Expect::NotServable,
                with_header(b"{}", &[]),
            )
        },
        |f, _| {
            (
                "the header a JSON array".into(),
                Expect::Unreadable,
                with_header(b"[1,2,3]", f.data()),
            )
        },
        |f, _| {
            let mut header = b"  ".to_vec();
            header.extend_from_slice(&f.weights[8..f.data_start()]);
            (
                "the header after leading spaces".into(),
                Expect::Any,
                with_header(&header, f.data()),
            )
        },
        |f, rng| {
            // Drop one tensor and its bytes: a valid file missing a tensor.
            let t = rng.range(0, f.tensors.len());
            let mut e = Vec::new();
            let mut data = Vec::new();
            for (i, x) in f.tensors.iter().enumerate() {
                if i == t {
                    continue;
                }
                let bytes = &f.data()[x.start..x.end];
                let mut r = RawEntry::of(x);
                r.offsets = format!("[{},{}]", data.len(), data.len() + bytes.len());
                data.extend_from_slice(bytes);
                e.push(r);
            }
            let expect = if f.tensors[t].name.contains("lora_") {
                Expect::NotServable
            } else {
                Expect::Any
            };
            (
                format!("tensor {t} ({}) removed", f.tensors[t].name),
                expect,
                f.file(&e, None, &data),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            let name = f.tensors[t]
                .name
                .replace("lora_A", "lora_C")
                .replace("lora_B", "lora_C");
            e[t].key = json_str(&name).into_bytes();
            (
                format!("tensor {t} renamed to {name}"),
                Expect::NotServable,
                f.file(&e, None, f.data()),
            )
        },
        |f, rng| {
            let mut e = f.raw_entries();
            let t = rng.range(0, e.len());
            // The same bytes read as another float type: a still-valid file.
            let other = match f.tensors[t].dtype.as_str() {
                "BF16" => "\"F16\"",
                "F16" => "\"BF16\"",
                _ => "\"F32\"",
            };
            e[t].dtype = other.into();
            (
                format!("tensor {t} read as {other}"),
                Expect::Any,
                f.file(&e, None, f.data()),
            )
        },
    ]
}

fn rng_pick<'a>(rng: &mut SplitMix, xs: &[&'a str]) -> &'a str {
    xs[rng.range(0, xs.len())]
}

/// `(key, raw JSON)` edits of a JSON object; `None` removes the key.
type Edits = Vec<(&'static str, Option<String>)>;

/// `adapter_config.json` edits: what, the edits, what the mutant may do.
fn config_edits() -> Vec<(String, Edits, Expect)> {
    use Expect::{Any, NotServable, Same};
    let one = |key: &'static str, raw: Option<&'static str>, expect: Expect| {
        let what = match raw {
            Some(r) => format!("config {key} = {}", if r.len() > 40 { &r[..40] } else { r }),
            None => format!("config without {key}"),
        };
        (what, vec![(key, raw.map(str::to_string))], expect)
    };
    vec![
        ("config re-serialized".to_string(), vec![], Same),
        one("r", Some("0"), NotServable),
        one("r", Some("-4"), NotServable),
        one("r", Some("4.5"), NotServable),
        one("r", Some("1e400"), NotServable),
        one("r", Some("1099511627776"), NotServable),
        one("r", Some("18446744073709551616"), NotServable),
        one("r", Some("\"8\""), NotServable),
        one("r", Some("true"), NotServable),
        one("r", Some("[8]"), NotServable),
        one("r", Some("{\"r\":8}"), NotServable),
        one("r", None, Any),
        one("lora_alpha", Some("1e40"), NotServable),
        one("lora_alpha", Some("-1e308"), NotServable),
        one("lora_alpha", Some("1e400"), NotServable),
        one("lora_alpha", Some("-8"), Any),
        one("lora_alpha", Some("0"), Any),
        one("lora_alpha", Some("\"8\""), NotServable),
        one("lora_alpha", Some("NaN"), NotServable),
        one("lora_alpha", Some("Infinity"), NotServable),
        one("lora_alpha", None, Any),
        one("peft_type", Some("\"LOHA\""), NotServable),
        one("peft_type", Some("7"), NotServable),
        one("peft_type", None, Any),
        one("use_dora", Some("true"), NotServable),
        one("use_dora", Some("\"yes\""), NotServable),
        one("use_rslora", Some("1"), Any),
        one("target_modules", Some("42"), Any),
        one("target_modules", None, Any),
        one("fan_in_fan_out", Some("true"), Any),
        one("rank_pattern", Some("{\"q_proj\": 0}"), Any),
        one("rank_pattern", Some("{\"q_proj\": 1e12}"), Any),
        one("rank_pattern", Some("{\"q_proj\": -1}"), Any),
        one("rank_pattern", Some("[]"), NotServable),
        one("alpha_pattern", Some("{\"q_proj\": 1e40}"), Any),
        one("alpha_pattern", Some("{\"(?i)Q_PROJ\": 1000}"), Any),
        one("alpha_pattern", Some("{\"(\": 2}"), Any),
        one("alpha_pattern", Some("{\"q_proj\": \"x\"}"), Any),
        one("layers_to_transform", Some("[-1]"), Any),
        one("layers_to_transform", Some("1e400"), NotServable),
        one("modules_to_save", Some("[\"lm_head\", 5]"), Any),
        one("trainable_token_indices", Some("{\"embed_tokens\": [99999999]}"), Any),
        one("trainable_token_indices", Some("[-1]"), Any),
        one("garbage", Some("[[[[{\"a\":[1,{\"b\":null}]}]]]]"), Any),
        (
            "config key nested 100000 deep".into(),
            vec![("garbage", Some(nested(100_000)))],
            NotServable,
        ),
        (
            "r and lora_alpha both huge".into(),
            vec![("r", Some("4294967296".into())), ("lora_alpha", Some("1e300".into()))],
            NotServable,
        ),
    ]
}

/// Whole-text mutations of `adapter_config.json`, in a fixed order (the
/// caller takes entry `i` of another fixture's list).
fn config_texts(config: &[u8]) -> Vec<(String, Vec<u8>, Expect)> {
    use Expect::{Any, NotServable, Unreadable};
    let text = String::from_utf8(config.to_vec()).unwrap();
    let peft = text.find("\"LORA\"").unwrap() + 2;
    let mut non_utf8 = config.to_vec();
    non_utf8.splice(peft..peft, [0xFF]);
    let mut overlong = config.to_vec();
    overlong.splice(peft..peft, [0xC0, 0x80]);
    let mut surrogate = config.to_vec();
    surrogate.splice(peft..peft, b"\\ud800".iter().copied());
    let duplicate = text.replacen("\"r\": ", "\"r\": 64, \"r\": ", 1).into_bytes();
    let mut bom = vec![0xEF, 0xBB, 0xBF];
    bom.extend_from_slice(config);
    let mut huge = config.to_vec();
    huge.pop();
    huge.resize(9 << 20, b' ');
    huge.push(b'}');
    vec![
        ("config empty".into(), Vec::new(), NotServable),
        ("config null".into(), b"null".to_vec(), NotServable),
        ("config []".into(), b"[]".to_vec(), NotServable),
        (
            "config cut in half".into(),
            config[..config.len() / 2].to_vec(),
            NotServable,
        ),
        ("config with a 0xFF byte in a string".into(), non_utf8, NotServable),
        ("config with an overlong UTF-8 NUL".into(), overlong, NotServable),
        ("config with a lone surrogate".into(), surrogate, NotServable),
        ("config with r given twice".into(), duplicate, Any),
        ("config after a UTF-8 BOM".into(), bom, Any),
        (
            "config of 9 MiB (past MAX_ADAPTER_CONFIG_BYTES)".into(),
            huge,
            Unreadable,
        ),
        (
            "config of trailing garbage".into(),
            [config, b"}{"].concat(),
            NotServable,
        ),
    ]
}

/// Model `config.json` mutations.
fn model_mutations(model: &[u8]) -> Vec<(String, Vec<u8>, Expect)> {
    use Expect::{Any, NotServable};
    let edits: Vec<(&str, Option<&str>, Expect)> = vec![
        ("intermediate_size", Some("1e12"), NotServable),
        ("intermediate_size", Some("1000000000000"), NotServable),
        ("intermediate_size", Some("1e400"), NotServable),
        ("intermediate_size", Some("-1"), NotServable),
        ("intermediate_size", Some("0"), NotServable),
        ("intermediate_size", Some("\"128\""), NotServable),
        ("intermediate_size", Some("16777216"), Any),
        ("intermediate_size", Some("256"), Any),
        ("hidden_size", Some("0"), NotServable),
        ("hidden_size", Some("1099511627776"), NotServable),
        ("hidden_size", Some("-64"), NotServable),
        ("hidden_size", Some("65"), NotServable),
        ("hidden_size", None, NotServable),
        ("num_hidden_layers", Some("0"), NotServable),
        ("num_hidden_layers", Some("-3"), NotServable),
        ("num_hidden_layers", Some("1000000000"), NotServable),
        ("num_hidden_layers", Some("4096"), Any),
        ("num_hidden_layers", Some("1.5"), NotServable),
        ("num_attention_heads", Some("0"), NotServable),
        ("num_attention_heads", Some("-4"), NotServable),
        ("num_key_value_heads", Some("0"), NotServable),
        ("num_key_value_heads", Some("3"), Any),
        ("head_dim", Some("0"), NotServable),
        ("head_dim", Some("1e12"), NotServable),
        ("vocab_size", Some("0"), Any),
        ("vocab_size", Some("1e12"), NotServable),
        ("vocab_size", Some("-1"), NotServable),
        ("model_type", Some("\"gpt_neox\""), NotServable),
        ("model_type", Some("5"), NotServable),
        ("model_type", None, NotServable),
        ("tie_word_embeddings", Some("\"yes\""), Any),
        (
            "rope_parameters",
            Some("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"),
            Any,
        ),
    ];
    let mut out: Vec<(String, Vec<u8>, Expect)> = edits
        .into_iter()
        .map(|(key, raw, expect)| {
            let what = match raw {
                Some(r) => format!("model {key} = {}", if r.len() > 40 { &r[..40] } else { r }),
                None => format!("model without {key}"),
            };
            (what, json_with(model, &[(key, raw)]), expect)
        })
        .collect();
    let mut non_utf8 = model.to_vec();
    non_utf8.insert(model.len() / 2, 0xFF);
    out.push(("model config empty".into(), Vec::new(), NotServable));
    out.push((
        "model config cut in half".into(),
        model[..model.len() / 2].to_vec(),
        NotServable,
    ));
    out.push(("model config not UTF-8".into(), non_utf8, NotServable));
    out.push((
        "model config nested 100000 deep".into(),
        nested(100_000).into_bytes(),
        NotServable,
    ));
    out
}
