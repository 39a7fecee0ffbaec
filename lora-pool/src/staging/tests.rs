use super::*;
use crate::image::{Elems, PairMeta, PairSource, SlotImage};
use lora_audit::{SafetensorsFile, TensorDtype};
use lora_layout::{LoraModule, ModelConfig, PairKey};
use proptest::prelude::*;

fn cfg() -> ModelConfig {
    ModelConfig::from_hf_config(
        r#"{"model_type": "llama", "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 80, "vocab_size": 16}"#,
    )
    .unwrap()
}

/// Every (layer, module) of `cfg` with a distinct ramp, at ranks 1..=stride.
fn pairs(cfg: &ModelConfig, layout: &SlotLayout, stride: usize) -> Vec<(PairMeta, Vec<bf16>, Vec<bf16>)> {
    let mut out = Vec::new();
    for layer in 0..cfg.num_hidden_layers {
        for (i, module) in LoraModule::ALL.iter().copied().enumerate() {
            if layout.entry(layer, module).is_none() {
                continue;
            }
            let (o, inp) = module.dims(cfg);
            let rank = 1 + (layer * 7 + i) % stride;
            let ramp = |len: usize, seed: usize| -> Vec<bf16> {
                (0..len)
                    .map(|k| bf16::from_f32(((k * 13 + seed * 101) % 509 + 1) as f32))
                    .collect()
            };
            let meta = PairMeta {
                key: PairKey::Dense { layer, module },
                rank,
                scale: 0.25,
            };
            out.push((meta, ramp(rank * inp, 2 * out.len()), ramp(o * rank, 2 * out.len() + 1)));
        }
    }
    out
}

fn sources(pairs: &[(PairMeta, Vec<bf16>, Vec<bf16>)]) -> Vec<PairSource<'_>> {
    pairs
        .iter()
        .map(|(meta, a, b)| PairSource {
            meta: *meta,
            a: Elems::Bf16(a),
            b: Elems::Bf16(b),
        })
        .collect()
}

/// The device staging slot after a pipelined pack, against a plain image.
fn staged_equals_image(chunk_bytes: usize) {
    let cfg = cfg();
    let layout = SlotLayout::new(&cfg, 8).unwrap();
    let pairs = pairs(&cfg, &layout, 8);
    let sources = sources(&pairs);
    let device = Device::cpu();
    let mut staging = Staging::new(&device, &layout, chunked(chunk_bytes)).unwrap();
    let plan = PackPlan::new(&layout, &sources).unwrap();
    staging.pack_and_upload(&layout, &plan, image_error).unwrap();
    let image = SlotImage::pack(&layout, &sources).unwrap();
    assert_eq!(
        staging.device.download().unwrap(),
        image.as_elems(),
        "chunks of {chunk_bytes} bytes"
    );
}

fn chunked(chunk_bytes: usize) -> StagingTuning {
    StagingTuning {
        chunk_bytes,
        ..StagingTuning::default()
    }
}

fn image_error(e: ImageError) -> PoolError {
    PoolError::Image {
        adapter: "test".into(),
        source: e,
    }
}

#[test]
fn one_chunk_and_one_chunk_per_place_stage_the_same_bytes() {
    staged_equals_image(usize::MAX / 4);
    staged_equals_image(1);
}

#[test]
fn called_from_inside_a_rayon_pool_the_staging_is_the_same() {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| staged_equals_image(4096));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Whatever the chunk size, the staged slot is the packed image.
    #[test]
    fn any_chunk_size_stages_the_packed_image(chunk_bytes in 1usize..40_000) {
        staged_equals_image(chunk_bytes);
    }
}

/// A BF16 safetensors file of `tensors`, written by hand.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, Vec<usize>, &[bf16])]) {
    let mut header = String::from("{");
    let mut offset = 0;
    for (i, (name, shape, data)) in tensors.iter().enumerate() {
        let end = offset + 2 * data.len();
        header += &format!(
            r#"{}"{name}":{{"dtype":"BF16","shape":{shape:?},"data_offsets":[{offset},{end}]}}"#,
            if i > 0 { "," } else { "" }
        );
        offset = end;
    }
    header += "}";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    for (_, _, data) in tensors {
        bytes.extend_from_slice(bytemuck::cast_slice(data));
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_read_that_fails_mid_pack_stops_every_worker_and_is_returned() {
    let cfg = cfg();
    let layout = SlotLayout::new(&cfg, 8).unwrap();
    let pairs = pairs(&cfg, &layout, 8);
    let dir = std::env::temp_dir().join(format!("lora-staging-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.safetensors");
    let named: Vec<(String, Vec<usize>, &[bf16])> = pairs
        .iter()
        .enumerate()
        .flat_map(|(i, (m, a, b))| {
            let r = m.rank;
            [
                (format!("{i}.a"), vec![r, a.len() / r], a.as_slice()),
                (format!("{i}.b"), vec![b.len() / r, r], b.as_slice()),
            ]
        })
        .collect();
    write_safetensors(&path, &named);
    let file = SafetensorsFile::open(&path).unwrap();
    let elems = |name: String| {
        let (dtype, _, offset, bytes) = file.tensor(&name).unwrap();
        assert_eq!(dtype, TensorDtype::BF16);
        Elems::File {
            file: &file,
            offset,
            dtype,
            len: bytes / 2,
        }
    };
    let sources: Vec<PairSource<'_>> = pairs
        .iter()
        .enumerate()
        .map(|(i, (meta, ..))| PairSource {
            meta: *meta,
            a: elems(format!("{i}.a")),
            b: elems(format!("{i}.b")),
        })
        .collect();
    let plan = PackPlan::new(&layout, &sources).unwrap();
    let device = Device::cpu();
    let mut staging = Staging::new(&device, &layout, chunked(2048)).unwrap();
    assert!(staging.chunk_count() > 4);
    // Intact file: the staged slot is the image of the same pairs.
    staging.pack_and_upload(&layout, &plan, image_error).unwrap();
    let owned = self::sources(&pairs);
    let image = SlotImage::pack(&layout, &owned).unwrap();
    assert_eq!(staging.device.download().unwrap(), image.as_elems());
    // Cut the file after open: reads past the cut fail, the error comes back.
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = staging.pack_and_upload(&layout, &plan, image_error).unwrap_err();
    assert!(
        matches!(
            &err,
            PoolError::Image {
                source: ImageError::Read { .. },
                ..
            }
        ),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
