use super::*;
use crate::test_support::{ScratchDir, f32_tensor, safetensors_bytes};
use proptest::prelude::*;

fn write(dir: &ScratchDir, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn sample_bytes() -> Vec<u8> {
    let f16_bytes: Vec<u8> = [1.0f32, -2.5, 65504.0]
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect();
    let bf16_bytes: Vec<u8> = [0.1f32, 3.0]
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
        .collect();
    safetensors_bytes(&[
        f32_tensor("a", &[2, 2], &[1.0, 1.0 + 1.0 / 512.0, -3.3, 1e-40]),
        ("h".into(), Dtype::F16, vec![3], f16_bytes),
        ("b".into(), Dtype::BF16, vec![1, 2], bf16_bytes),
    ])
}

#[test]
fn floats_become_bf16_rounded_to_nearest() {
    let dir = ScratchDir::new("tensors");
    let path = write(&dir, "adapter_model.safetensors", &sample_bytes());
    let t = load_adapter_safetensors(&path).unwrap();
    let a = &t["a"];
    assert_eq!(a.shape, [2, 2]);
    let want: Vec<bf16> = [1.0f32, 1.0 + 1.0 / 512.0, -3.3, 1e-40]
        .iter()
        .map(|v| bf16::from_f32(*v))
        .collect();
    assert_eq!(a.data, want);
    let want_h: Vec<bf16> = [1.0f32, -2.5, 65504.0].iter().map(|v| bf16::from_f32(*v)).collect();
    assert_eq!(t["h"].data, want_h);
    assert_eq!(t["b"].data, [bf16::from_f32(0.1), bf16::from_f32(3.0)]);
    // A directory resolves to its adapter_model.safetensors.
    assert_eq!(load_adapter_safetensors(&dir.0).unwrap(), t);
}

#[test]
fn header_infos_are_sorted_by_name() {
    let dir = ScratchDir::new("infos");
    let path = write(&dir, "x.safetensors", &sample_bytes());
    let infos = LoadedSafetensors::open(&path).unwrap().infos().unwrap();
    let names: Vec<&str> = infos.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "h"]);
    assert_eq!(infos[2].dtype, TensorDtype::F16);
}

#[test]
fn a_pickle_is_never_read() {
    let dir = ScratchDir::new("pickle");
    let path = write(&dir, "adapter_model.bin", b"\x80\x02}q\x00.");
    let err = load_adapter_safetensors(&path).unwrap_err();
    assert!(err.to_string().contains("pickle"), "{err}");
}

#[test]
fn other_dtypes_are_errors_naming_the_tensor() {
    let dir = ScratchDir::new("dtype");
    let bytes = safetensors_bytes(&[("ids".into(), Dtype::I64, vec![2], vec![0u8; 16])]);
    let path = write(&dir, "adapter_model.safetensors", &bytes);
    match load_adapter_safetensors(&path) {
        Err(AuditError::Tensor { name, .. }) => assert_eq!(name, "ids"),
        other => panic!("expected a tensor error, got {other:?}"),
    }
}

#[test]
fn empty_truncated_and_corrupt_files_are_errors() {
    let dir = ScratchDir::new("corrupt");
    let good = sample_bytes();
    for (name, bytes) in [
        ("empty", Vec::new()),
        ("short", good[..5].to_vec()),
        ("truncated", good[..good.len() - 1].to_vec()),
        ("longer", [good.clone(), vec![0]].concat()),
        (
            "garbage_header",
            [&good[..8], b"{not json".as_slice(), &good[17..]].concat(),
        ),
        ("huge_header", [u64::MAX.to_le_bytes().as_slice(), &good[8..]].concat()),
    ] {
        let path = write(&dir, name, &bytes);
        assert!(
            matches!(load_adapter_safetensors(&path), Err(AuditError::Safetensors { .. })),
            "{name} must be a corrupt-file error"
        );
    }
    assert!(matches!(
        load_adapter_safetensors(&dir.join("missing.safetensors")),
        Err(AuditError::Io { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn every_truncation_is_an_error(cut in 0usize..1000) {
        let dir = ScratchDir::new("trunc");
        let good = sample_bytes();
        let cut = cut % good.len();
        let path = write(&dir, "t.safetensors", &good[..cut]);
        prop_assert!(load_adapter_safetensors(&path).is_err());
    }

    #[test]
    fn corrupted_bytes_never_panic(flips in prop::collection::vec((0usize..1000, any::<u8>()), 1..8)) {
        let dir = ScratchDir::new("flip");
        let mut bytes = sample_bytes();
        for (at, value) in flips {
            let i = at % bytes.len();
            bytes[i] = value;
        }
        let path = write(&dir, "f.safetensors", &bytes);
        let _ = load_adapter_safetensors(&path);
        if let Ok(m) = LoadedSafetensors::open(&path) {
            let _ = m.infos();
            let _ = m.metadata();
        }
    }
}

#[test]
fn an_opened_file_locates_the_same_tensors_as_a_mapped_one() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/llama/dense_all_linear_bf16/adapter_model.safetensors");
    let mapped = LoadedSafetensors::open(&path).unwrap();
    let file = SafetensorsFile::open(&path).unwrap();
    assert_eq!(file.infos(), mapped.infos().unwrap());
    for info in file.infos() {
        let (dtype, shape, offset, len) = file.tensor(&info.name).unwrap();
        let mut bytes = vec![0u8; len];
        file.read_at(&mut bytes, offset).unwrap();
        let (m_dtype, m_shape, m_bytes) = mapped.tensor(&info.name).unwrap();
        assert_eq!(
            (dtype, shape, bytes.as_slice()),
            (m_dtype, m_shape, m_bytes),
            "{}",
            info.name
        );
    }
    assert!(file.tensor("nope").is_err());
}

#[test]
fn a_truncated_or_padded_file_is_an_error() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/llama/dense_all_linear_bf16/adapter_model.safetensors");
    let bytes = std::fs::read(&src).unwrap();
    let dst = std::env::temp_dir().join(format!("lora-audit-truncated-open-{}.safetensors", std::process::id()));
    for cut in [0, 7, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&dst, &bytes[..cut]).unwrap();
        assert!(SafetensorsFile::open(&dst).is_err(), "cut at {cut}");
    }
    let mut padded = bytes.clone();
    padded.push(0);
    std::fs::write(&dst, &padded).unwrap();
    assert!(SafetensorsFile::open(&dst).is_err(), "a trailing byte");
    let _ = std::fs::remove_file(&dst);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn corrupt_headers_never_panic_an_opened_file(cut in 0usize..400, flip in 0usize..400, byte in any::<u8>()) {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/llama/demo_r4_plain/adapter_model.safetensors");
        let mut bytes = std::fs::read(&src).unwrap();
        if flip < bytes.len() { bytes[flip] = byte; }
        bytes.truncate(bytes.len().saturating_sub(cut));
        let dst = std::env::temp_dir().join(format!("lora-audit-prop-open-{}.safetensors", std::process::id()));
        std::fs::write(&dst, &bytes).unwrap();
        let _ = SafetensorsFile::open(&dst);
        let _ = std::fs::remove_file(&dst);
    }
}

#[test]
fn non_finite_values_are_found_as_served_in_bf16() {
    let f32_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    // The largest F32 that rounds to a finite BF16, and the smallest that
    // rounds (half to even) to +inf.
    let (last_finite, first_inf) = (f32::from_bits(0x7F7F_7FFF), f32::from_bits(0x7F7F_8000));
    assert!(bf16::from_f32(last_finite).is_finite() && !bf16::from_f32(first_inf).is_finite());
    assert_eq!(
        first_non_finite_raw(TensorDtype::F32, &f32_bytes(&[1.0, last_finite, -last_finite])),
        None
    );
    assert_eq!(
        first_non_finite_raw(TensorDtype::F32, &f32_bytes(&[1.0, -first_inf, f32::NAN])),
        Some((1, -first_inf))
    );
    let nan = first_non_finite_raw(TensorDtype::F32, &f32_bytes(&[0.0, 0.0, f32::NAN]));
    assert!(matches!(nan, Some((2, v)) if v.is_nan()));
    let h: Vec<u8> = [1.0f32, 65504.0, f32::INFINITY]
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
        .collect();
    assert_eq!(first_non_finite_raw(TensorDtype::F16, &h), Some((2, f32::INFINITY)));
    let b: Vec<u8> = [bf16::MAX, bf16::NEG_INFINITY]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(
        first_non_finite_raw(TensorDtype::BF16, &b),
        Some((1, f32::NEG_INFINITY))
    );
    assert_eq!(
        first_non_finite_raw(TensorDtype::I32, &[0xFF; 8]),
        None,
        "not a float weight"
    );
    assert_eq!(first_non_finite(&[bf16::ONE, bf16::MIN, bf16::NAN]), Some(2));
    assert_eq!(first_non_finite(&[bf16::ONE, bf16::MAX]), None);
    // Past the first parallel chunk, the first hit in order wins.
    let mut big = vec![0.5f32; (1 << 20) + 10];
    big[(1 << 20) + 3] = f32::INFINITY;
    big[(1 << 20) + 7] = f32::NAN;
    assert_eq!(
        first_non_finite_raw(TensorDtype::F32, &f32_bytes(&big)),
        Some(((1 << 20) + 3, f32::INFINITY))
    );
    // The loaders' conversion is the one the check sees.
    let dir = ScratchDir::new("served");
    let bytes = safetensors_bytes(&[f32_tensor("t", &[3], &[1.0, first_inf, last_finite])]);
    let path = write(&dir, "x.safetensors", &bytes);
    let loaded = load_adapter_safetensors(&path).unwrap();
    assert_eq!(first_non_finite(&loaded["t"].data), Some(1));
}

/// A safetensors file from a header text and a data section of `data_len` bytes.
fn file_bytes(header: &[u8], data_len: usize) -> Vec<u8> {
    let mut buf = (header.len() as u64).to_le_bytes().to_vec();
    buf.extend_from_slice(header);
    buf.resize(buf.len() + data_len, 0);
    buf
}

/// Both parsers on the same file: `(mapped, opened)` verdicts, and when
/// both accept, whether they read the same tensors at the same places.
fn both_verdicts(dir: &ScratchDir, bytes: &[u8]) -> (bool, bool, bool) {
    let path = write(dir, "h.safetensors", bytes);
    let mapped = LoadedSafetensors::open(&path);
    let opened = SafetensorsFile::open(&path);
    let same = match (&mapped, &opened) {
        (Ok(m), Ok(f)) => {
            let infos = m.infos().unwrap();
            infos == f.infos()
                && infos.iter().all(|i| {
                    let (_, _, m_bytes) = m.tensor(&i.name).unwrap();
                    let (_, _, offset, len) = f.tensor(&i.name).unwrap();
                    let m_offset = m_bytes.as_ptr() as usize - bytes_start(m);
                    (m_offset as u64, m_bytes.len()) == (offset, len)
                })
        }
        _ => true,
    };
    (mapped.is_ok(), opened.is_ok(), same)
}

/// Where the mapped file's bytes start, to turn a tensor slice into an offset.
fn bytes_start(m: &LoadedSafetensors) -> usize {
    m.bytes().as_ptr() as usize
}

/// One header entry, written out with knobs that hit the crate's rules.
#[derive(Debug, Clone)]
struct EntrySpec {
    name: u8,
    dtype: &'static str,
    shape: Vec<usize>,
    offsets: (usize, usize),
    as_array: bool,
    extra: Option<&'static str>,
}

fn entry_spec() -> impl Strategy<Value = EntrySpec> {
    (
        0u8..4,
        prop::sample::select(vec!["F32", "BF16", "I8", "F4", "Q4"]),
        prop::collection::vec(0usize..4, 0..3),
        (0usize..40, 0usize..40),
        any::<bool>(),
        prop::option::of(prop::sample::select(vec![
            "1",
            "-0",
            "1e999",
            "18446744073709551616",
            "\"\\ud800\"",
            "\"ok\"",
            "[1,{\"k\":2,\"k\":3}]",
            "null",
        ])),
    )
        .prop_map(|(name, dtype, shape, offsets, as_array, extra)| EntrySpec {
            name,
            dtype,
            shape,
            offsets,
            as_array,
            extra,
        })
}

/// A header from entries: each given consistent offsets (laid end to end)
/// unless `raw_offsets`, with an optional metadata value.
fn header_text(entries: &[EntrySpec], raw_offsets: bool, metadata: Option<&str>) -> (String, usize) {
    let mut parts = Vec::new();
    if let Some(m) = metadata {
        parts.push(format!("\"__metadata__\":{m}"));
    }
    let mut next = 0usize;
    for e in entries {
        let bytes = match e.dtype {
            "F32" => 4,
            "BF16" => 2,
            _ => 1,
        } * e.shape.iter().product::<usize>();
        let (start, end) = if raw_offsets { e.offsets } else { (next, next + bytes) };
        next = next.max(end);
        let shape = format!("{:?}", e.shape);
        let body = if e.as_array {
            format!("[\"{}\",{shape},[{start},{end}]]", e.dtype)
        } else {
            let extra = e.extra.map_or(String::new(), |x| format!(",\"x\":{x}"));
            format!(
                "{{\"dtype\":\"{}\",\"shape\":{shape},\"data_offsets\":[{start},{end}]{extra}}}",
                e.dtype
            )
        };
        parts.push(format!("\"t{}\":{body}", e.name));
    }
    (format!("{{{}}}", parts.join(",")), next)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Issue 42 item 6: one set of rules for every path. The mapped file
    /// (the `safetensors` crate) and the opened file (the swap path's own
    /// parser) accept and refuse the same headers — names repeated, metadata
    /// of every shape, entries as arrays, odd ignored fields, bad dtypes and
    /// offsets, byte flips, truncations — and read the same tensors.
    #[test]
    fn mapped_and_opened_files_agree_on_arbitrary_headers(
        entries in prop::collection::vec(entry_spec(), 0..5),
        raw_offsets in any::<bool>(),
        metadata in prop::option::of(prop::sample::select(vec![
            "null", "{}", "{\"a\":\"b\",\"a\":\"c\"}", "{\"a\":1}", "[]", "\"x\"", "{\"a\":\"\\ud800\"}",
        ])),
        twice_metadata in any::<bool>(),
        data_delta in -2i64..3,
        flips in prop::collection::vec((0usize..400, any::<u8>()), 0..3),
        cut in prop::option::of(0usize..400),
    ) {
        let (mut text, data_len) = header_text(&entries, raw_offsets, metadata);
        if twice_metadata {
            text = text.replacen('{', "{\"__metadata__\":null,", 1);
        }
        let mut header = text.into_bytes();
        for (at, byte) in flips {
            if !header.is_empty() {
                let i = at % header.len();
                header[i] = byte;
            }
        }
        if let Some(cut) = cut {
            header.truncate(cut);
        }
        let data_len = usize::try_from(data_len as i64 + data_delta).unwrap_or(0);
        let dir = ScratchDir::new("agree");
        let (mapped, opened, same) = both_verdicts(&dir, &file_bytes(&header, data_len));
        prop_assert_eq!(mapped, opened, "header {:?}", String::from_utf8_lossy(&header));
        prop_assert!(same, "both accept but read differently: {:?}", String::from_utf8_lossy(&header));
    }
}

#[test]
fn a_tensor_repeated_verbatim_is_read_alike_by_both_paths() {
    let e = r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
    let dir = ScratchDir::new("verbatim");
    for header in [
        format!(r#"{{"a":{e},"a":{e}}}"#),
        format!(r#"{{"a":{{"dtype":"F32","shape":[1],"data_offsets":[4,8]}},"a":{e}}}"#),
    ] {
        assert_eq!(
            both_verdicts(&dir, &file_bytes(header.as_bytes(), 4)),
            (true, true, true),
            "{header}"
        );
    }
    // The crate's rule: the last entry counts, so this one leaves a gap.
    let gap = format!(r#"{{"a":{e},"a":{{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}}}"#);
    assert_eq!(
        both_verdicts(&dir, &file_bytes(gap.as_bytes(), 4)),
        (false, false, true)
    );
}

/// A file rewritten or truncated by someone else after it was opened
/// changes nothing already read (the file is read, never mapped: no
/// SIGBUS), and reopening the truncated file is an error.
#[test]
fn a_file_truncated_after_open_neither_crashes_nor_changes_what_was_read() {
    let dir = ScratchDir::new("truncated-after-open");
    let path = write(&dir, "a.safetensors", &sample_bytes());
    let opened = LoadedSafetensors::open(&path).expect("valid");
    let before: Vec<Vec<u8>> = opened
        .infos()
        .expect("infos")
        .iter()
        .map(|i| opened.tensor(&i.name).expect("tensor").2.to_vec())
        .collect();
    std::fs::write(&path, &sample_bytes()[..12]).expect("truncate");
    let after: Vec<Vec<u8>> = opened
        .infos()
        .expect("infos")
        .iter()
        .map(|i| opened.tensor(&i.name).expect("tensor").2.to_vec())
        .collect();
    assert_eq!(before, after);
    assert!(LoadedSafetensors::open(&path).is_err());
}

/// Both parsers on `bytes`, each through every entry point (open, the
/// unparsed header then its parse, the header accessors): never a panic,
/// every failure a typed corrupt-file error with a message, the same
/// verdict from both, and when both accept, the same tensors at the same
/// places.
fn both_parsers_on(bytes: &[u8]) -> Result<(), TestCaseError> {
    let dir = ScratchDir::new("arbitrary");
    let (mapped, opened, same) = both_verdicts(&dir, bytes);
    prop_assert_eq!(mapped, opened, "the parsers disagree on {:?}", bytes);
    prop_assert!(same, "both accept but read differently: {:?}", bytes);
    let path = dir.join("h.safetensors");
    let typed = |e: &AuditError| matches!(e, AuditError::Safetensors { reason, .. } if !reason.trim().is_empty());
    match LoadedSafetensors::open(&path) {
        Ok(m) => {
            let infos = m.infos().expect("infos of an accepted file");
            let _ = m.metadata();
            for i in &infos {
                let (_, shape, data) = m.tensor(&i.name).expect("a listed tensor");
                prop_assert_eq!(shape, i.shape.as_slice());
                let _ = first_non_finite_raw(i.dtype, data);
                let _ = load_f32(&m, &i.name);
                let _ = load_i64(&m, &i.name);
            }
            let _ = load_bf16(&m, |_| true);
        }
        Err(e) => prop_assert!(typed(&e), "untyped error {:?} for {:?}", e, bytes),
    }
    match UnparsedSafetensors::open(&path) {
        Ok(u) => {
            // The data section can be read before the header is trusted;
            // reads past it are errors, never panics.
            let mut buf = vec![0u8; u.data_len().min(64) as usize];
            prop_assert!(u.read_data_at(&mut buf, 0).is_ok());
            prop_assert!(u.read_data_at(&mut [0u8; 1], u64::MAX).is_err());
            prop_assert!(u.read_data_at(&mut [0u8; 1], u.data_len()).is_err());
            match u.parse() {
                Ok(f) => {
                    prop_assert!(opened);
                    for i in f.infos() {
                        let (_, _, offset, len) = f.tensor(&i.name).expect("a listed tensor");
                        let mut buf = vec![0u8; len];
                        prop_assert!(f.read_at(&mut buf, offset).is_ok());
                    }
                }
                Err(e) => prop_assert!(!opened && typed(&e), "{:?} for {:?}", e, bytes),
            }
        }
        Err(e) => prop_assert!(!opened && typed(&e), "{:?} for {:?}", e, bytes),
    }
    Ok(())
}

/// Bytes that reach the JSON parser: a length prefix that fits (or almost
/// fits) the rest, then JSON-ish tokens and raw bytes.
fn json_soup() -> impl Strategy<Value = Vec<u8>> {
    let token = prop_oneof![
        prop::sample::select(vec![
            "{",
            "}",
            "[",
            "]",
            ":",
            ",",
            "\"",
            "\"dtype\"",
            "\"shape\"",
            "\"data_offsets\"",
            "\"__metadata__\"",
            "\"F32\"",
            "\"BF16\"",
            "\"I64\"",
            "\"t\"",
            "0",
            "4",
            "8",
            "-1",
            "1e400",
            "18446744073709551616",
            "null",
            "true",
            " ",
            "\\u0000",
            "\\ud800",
            "\"\\uDFFF\"",
        ])
        .prop_map(|s| s.as_bytes().to_vec()),
        prop::collection::vec(any::<u8>(), 1..4),
    ];
    (
        prop::collection::vec(token, 0..40),
        -2i64..3,
        prop::collection::vec(any::<u8>(), 0..48),
    )
        .prop_map(|(tokens, delta, data)| {
            let header: Vec<u8> = tokens.concat();
            let declared = (header.len() as i64 + delta).max(0) as u64;
            let mut out = declared.to_le_bytes().to_vec();
            out.extend_from_slice(&header);
            out.extend_from_slice(&data);
            out
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Arbitrary bytes: mostly refused at the length prefix.
    #[test]
    fn both_parsers_survive_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        both_parsers_on(&bytes)?;
    }

    /// Arbitrary bytes behind a length prefix that fits them: the JSON
    /// header parser gets arbitrary input.
    #[test]
    fn both_parsers_survive_an_arbitrary_header(
        header in prop::collection::vec(any::<u8>(), 0..256),
        data in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        bytes.extend_from_slice(&data);
        both_parsers_on(&bytes)?;
    }

    /// JSON-ish token soup behind a near-fitting length prefix.
    #[test]
    fn both_parsers_survive_json_soup(bytes in json_soup()) {
        both_parsers_on(&bytes)?;
    }
}

/// A header length past what the file holds, up to `u64::MAX`, is refused
/// before anything of that size is allocated (the rest of the file is 19
/// bytes).
#[test]
fn a_declared_header_length_past_the_file_is_refused_before_allocating() {
    let dir = ScratchDir::new("declared");
    for declared in [20u64, 1 << 20, 99_999_999, 100_000_001, 1 << 40, u64::MAX] {
        let mut bytes = declared.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{\"a\":1}   \0\0\0\0\0\0\0\0\0");
        let path = write(&dir, "big.safetensors", &bytes);
        assert!(
            matches!(UnparsedSafetensors::open(&path), Err(AuditError::Safetensors { .. })),
            "{declared}"
        );
        assert!(
            matches!(LoadedSafetensors::open(&path), Err(AuditError::Safetensors { .. })),
            "{declared}"
        );
    }
}

#[test]
fn dtype_names_of_safetensors_and_torch_agree() {
    for (safetensors, torch) in [
        ("F32", "torch.float32"),
        ("F16", "torch.float16"),
        ("BF16", "torch.bfloat16"),
    ] {
        let a = TensorDtype::from_name(safetensors).expect("safetensors name");
        assert_eq!(TensorDtype::from_name(torch), Some(a));
        assert_eq!(a.to_string(), safetensors);
        assert!(a.is_float_weight());
    }
    assert_eq!(TensorDtype::from_name("torch.float64"), Some(TensorDtype::Other("F64")));
    assert_eq!(TensorDtype::from_name("complex64"), None);
}

#[test]
fn first_non_finite_of_bf16_finds_the_first_like_a_plain_scan() {
    let mut values = vec![bf16::from_f32(1.5); 5000];
    assert_eq!(first_non_finite(&values), None);
    for (at, bad) in [
        (4999, f32::INFINITY),
        (777, f32::NAN),
        (3, f32::NEG_INFINITY),
        (0, f32::NAN),
    ] {
        values[at] = bf16::from_f32(bad);
        let plain = values.iter().position(|v| !v.is_finite());
        assert_eq!(first_non_finite(&values), plain);
        assert_eq!(plain, Some(at));
    }
    // Unaligned starts too.
    assert_eq!(first_non_finite(&values[1..]), Some(2));
    assert_eq!(first_non_finite(&[]), None);
}
