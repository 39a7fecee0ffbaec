//! A served value that is not finite (NaN, ±Inf, or a finite F32 that
//! rounds to an infinity in BF16) is refused with `REJECT[non-finite]`
//! naming the tensor, on every disk route into the pool — startup load,
//! device-repack swap, host-pack swap — and a refused swap changes nothing.

mod common;

use std::path::{Path, PathBuf};

use common::{dir, model_config, options, pool_with, slot, snapshot};
use lora_audit::{AuditError, RejectCode, SafetensorsFile, TensorDtype};
use lora_kernels::Device;
use lora_pool::{AdapterSource, BatchCapacity, LandedImages, LoraPool, PoolError, StagingTuning};

/// A copy of fixture adapter `adapter` whose served tensor `tensor` (the
/// first `lora_B` when `None`) has `value` at element 3.
fn poisoned(adapter: &str, value: f32, tag: &str) -> (PathBuf, String) {
    poisoned_in(adapter, "lora_B", value, tag)
}

/// As [`poisoned`], in the first tensor whose name contains `part`.
fn poisoned_in(adapter: &str, part: &str, value: f32, tag: &str) -> (PathBuf, String) {
    let src = dir(adapter);
    let dst = std::env::temp_dir().join(format!("lora-pool-non-finite-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dst).expect("temp dir");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dst.join(f)).expect("copy");
    }
    let weights = dst.join("adapter_model.safetensors");
    let file = SafetensorsFile::open(&weights).expect("header");
    let bytes = std::fs::read(&weights).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut names: Vec<String> = st
        .names()
        .into_iter()
        .filter(|n| n.contains(part))
        .map(str::to_string)
        .collect();
    names.sort();
    let tensor = names.first().expect("a tensor of that part").clone();
    let (dtype, _, offset, _) = file.tensor(&tensor).expect("tensor");
    let at = offset as usize;
    let mut bytes = bytes.clone();
    match dtype {
        TensorDtype::F32 => bytes[at + 12..at + 16].copy_from_slice(&value.to_le_bytes()),
        TensorDtype::BF16 => bytes[at + 6..at + 8].copy_from_slice(&half::bf16::from_f32(value).to_le_bytes()),
        TensorDtype::F16 => bytes[at + 6..at + 8].copy_from_slice(&half::f16::from_f32(value).to_le_bytes()),
        other => panic!("{tensor}: unexpected dtype {other:?}"),
    }
    std::fs::write(&weights, bytes).expect("write");
    (dst, tensor)
}

fn assert_non_finite(err: PoolError, tensor: &str) {
    let PoolError::Audit { source, .. } = &err else {
        panic!("expected an audit refusal, got {err}");
    };
    let AuditError::Refused(report) = source.as_ref() else {
        panic!("expected a refused report, got {source}");
    };
    let hit = report.refused.iter().find(|r| r.code == RejectCode::NonFinite);
    let hit = hit.unwrap_or_else(|| panic!("no REJECT[non-finite] in {:?}", report.refused));
    assert_eq!(hit.subject, tensor, "the refusal names the tensor");
}

fn swap_is_refused(device_repack: bool, value: f32, tag: &str) {
    swap_of_part_is_refused(device_repack, "lora_B", value, tag);
}

fn swap_of_part_is_refused(device_repack: bool, part: &str, value: f32, tag: &str) {
    let (bad, tensor) = poisoned_in("demo_r4_plain", part, value, tag);
    let mut pool = pool_with(options(2, 0), &[("plain", "demo_r4_plain")]);
    pool.tune_staging(StagingTuning {
        device_repack,
        ..StagingTuning::default()
    })
    .expect("tuning");
    let before = snapshot(&pool);
    let err = pool.swap_from_disk(slot(1), "bad", &bad).expect_err("refused");
    assert_non_finite(err, &tensor);
    assert_eq!(snapshot(&pool), before, "a refused swap changes nothing");
    let err = pool.swap_from_disk(slot(0), "bad", &bad).expect_err("refused");
    assert_non_finite(err, &tensor);
    assert_eq!(
        snapshot(&pool),
        before,
        "a refused swap onto a filled slot changes nothing"
    );
    std::fs::remove_dir_all(&bad).ok();
}

#[test]
fn nan_is_refused_on_the_device_repack_route() {
    swap_is_refused(true, f32::NAN, "repack-nan");
}

#[test]
fn an_a_matrix_with_an_infinity_is_refused_by_its_own_name_on_both_routes() {
    swap_of_part_is_refused(true, "lora_A", f32::INFINITY, "repack-a-inf");
    swap_of_part_is_refused(false, "lora_A", f32::INFINITY, "hostpack-a-inf");
}

#[test]
fn infinity_is_refused_on_the_host_pack_route() {
    swap_is_refused(false, f32::NEG_INFINITY, "hostpack-inf");
}

#[test]
fn a_finite_value_that_rounds_to_infinity_is_refused() {
    // Finite in F32, an infinity in BF16 (the fixture is F32; in a BF16 or
    // F16 file it is already an infinity).
    swap_is_refused(true, f32::MAX, "repack-max");
    swap_is_refused(false, f32::MAX, "hostpack-max");
}

#[test]
fn a_startup_load_refuses_it_too() {
    let (bad, tensor) = poisoned("demo_r4_plain", f32::NAN, "load");
    let sources = [AdapterSource {
        name: "bad",
        dir: Path::new(&bad),
    }];
    let Err(err) = LoraPool::load(
        &Device::cpu(),
        model_config("llama"),
        options(2, 0),
        BatchCapacity::default(),
        &sources,
    ) else {
        panic!("a non-finite adapter loaded");
    };
    assert_non_finite(err, &tensor);
    std::fs::remove_dir_all(&bad).ok();
}

/// A peer's landed image is the peer's bytes: a NaN in it is refused before
/// anything is written.
#[test]
fn a_landed_image_with_a_nan_is_refused() {
    use lora_layout::{LoraModule, PairKey};
    use lora_pool::image::{PairMeta, PairPart, SlotImage};
    let mut pool = pool_with(options(2, 0), &[("plain", "demo_r4_plain")]);
    let mut image = SlotImage::zeroed(pool.layout());
    let key = PairKey::Dense {
        layer: 0,
        module: LoraModule::QProj,
    };
    image
        .declare(
            pool.layout(),
            PairMeta {
                key,
                rank: 2,
                scale: 1.0,
            },
        )
        .expect("declared");
    let b = image.region_mut(pool.layout(), key, PairPart::B).expect("region");
    b[..2].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    let before = snapshot(&pool);
    let err = pool
        .publish_landed(slot(1), "landed", LandedImages::new(image, None))
        .expect_err("refused");
    assert!(err.to_string().contains("must be finite"), "{err}");
    assert_eq!(snapshot(&pool), before, "a refused landing changes nothing");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn a_refused_device_repack_swap_on_cuda_writes_no_slot_byte_and_the_next_swap_lands() {
    let Some(device) = lora_kernels::testing::cuda_or_skip(
        "a_refused_device_repack_swap_on_cuda_writes_no_slot_byte_and_the_next_swap_lands",
    ) else {
        return;
    };
    let (bad, tensor) = poisoned_in("demo_r4_plain", "lora_B", f32::NAN, "cuda-repack-nan");
    let (seed, good) = (dir("demo_r8_rslora"), dir("demo_r4_plain"));
    let load = |device: &Device, second: Option<&Path>| {
        let mut sources = vec![AdapterSource { name: "x", dir: &seed }];
        if let Some(d) = second {
            sources.push(AdapterSource { name: "good", dir: d });
        }
        LoraPool::load(
            device,
            model_config("llama"),
            options(2, 0),
            BatchCapacity::default(),
            &sources,
        )
        .expect("load")
    };
    let mut pool = load(&device, None);
    pool.tune_staging(StagingTuning {
        device_repack: true,
        ..StagingTuning::default()
    })
    .expect("tuning");
    let before = snapshot(&pool);
    for s in [1, 0] {
        let err = pool.swap_from_disk(slot(s), "bad", &bad).expect_err("refused");
        assert_non_finite(err, &tensor);
        assert_eq!(snapshot(&pool), before, "a refused swap into slot {s} changes nothing");
    }
    let report = pool.swap_from_disk(slot(1), "good", &good).expect("a clean swap");
    assert_eq!(report.route, lora_pool::SwapRoute::DeviceRepack);
    let reference = load(&Device::cpu(), Some(&good));
    for s in [0, 1] {
        assert_eq!(
            pool.slot_contents(slot(s)).expect("contents"),
            reference.slot_contents(slot(s)).expect("contents"),
            "slot {s} equals a CPU pool loaded with the same adapters"
        );
    }
    std::fs::remove_dir_all(&bad).ok();
}
