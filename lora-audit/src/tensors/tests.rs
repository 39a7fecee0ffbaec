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
    let infos = MappedSafetensors::open(&path).unwrap().infos().unwrap();
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
        if let Ok(m) = MappedSafetensors::open(&path) {
            let _ = m.infos();
            let _ = m.metadata();
        }
    }
}

#[test]
fn an_opened_file_locates_the_same_tensors_as_a_mapped_one() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/llama/dense_all_linear_bf16/adapter_model.safetensors");
    let mapped = MappedSafetensors::open(&path).unwrap();
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
