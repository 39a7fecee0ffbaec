use half::bf16;
use lora_kernels::testing::Rng;

use super::*;
use crate::test_support::llama_like;

const VOCAB: usize = 12;
const HIDDEN: usize = 8;

#[test]
fn tables_are_checked_against_the_vocabulary_width_and_device() {
    let dev = Device::cpu();
    let embed = Arc::new(dev.upload(&[bf16::ZERO; VOCAB * HIDDEN]).unwrap());
    let r = ServedTables::new(&dev, embed.clone(), ServedHead::SharesEmbedding, VOCAB + 1, HIDDEN);
    assert!(
        matches!(
            r,
            Err(OverlayError::TableSize {
                table: "embed_tokens",
                ..
            })
        ),
        "{r:?}"
    );
    let short_head = ServedHead::Own(Arc::new(dev.upload(&[bf16::ZERO; 3]).unwrap()));
    let r = ServedTables::new(&dev, embed.clone(), short_head, VOCAB, HIDDEN);
    assert!(
        matches!(
            r,
            Err(OverlayError::TableSize {
                table: "lm_head",
                len: 3,
                ..
            })
        ),
        "{r:?}"
    );
    let other = Device::cpu();
    let foreign = Arc::new(other.upload(&[bf16::ZERO; VOCAB * HIDDEN]).unwrap());
    let r = ServedTables::new(&dev, foreign, ServedHead::SharesEmbedding, VOCAB, HIDDEN);
    assert!(matches!(r, Err(OverlayError::DeviceMismatch { .. })), "{r:?}");
    let r = ServedTables::new(&dev, embed.clone(), ServedHead::SharesEmbedding, 1 << 31, 0);
    assert!(matches!(r, Err(OverlayError::VocabTooLarge { .. })), "{r:?}");
    let r = ServedTables::new(&dev, embed, ServedHead::Quantized, VOCAB * HIDDEN, 0);
    assert!(matches!(r, Err(OverlayError::TableSize { hidden: 0, .. })), "{r:?}");
}

#[test]
fn uploaded_tables_follow_the_models_tying() {
    let dev = Device::cpu();
    let mut rng = Rng::new(31);
    let embed = rng.bf16_vec(VOCAB * HIDDEN, 1.0);
    let head = rng.bf16_vec(VOCAB * HIDDEN, 1.0);
    let tied = BaseTables {
        embed: Some(embed.clone()),
        lm_head: None,
    };
    let t = ServedTables::upload(&dev, &tied, &llama_like(VOCAB, HIDDEN, true)).unwrap();
    assert!(matches!(t.head(), ServedHead::SharesEmbedding));
    assert_eq!(t.head_table().unwrap().download().unwrap(), embed);
    let r = ServedTables::upload(&dev, &tied, &llama_like(VOCAB, HIDDEN, false));
    assert!(
        matches!(r, Err(OverlayError::MissingTable { table: "lm_head" })),
        "{r:?}"
    );
    let untied = BaseTables {
        embed: Some(embed.clone()),
        lm_head: Some(head.clone()),
    };
    let t = ServedTables::upload(&dev, &untied, &llama_like(VOCAB, HIDDEN, false)).unwrap();
    assert_eq!(t.head_table().unwrap().download().unwrap(), head);
    assert_eq!(t.embed().download().unwrap(), embed);
    assert_eq!((t.vocab(), t.hidden()), (VOCAB, HIDDEN));
    let r = ServedTables::upload(&dev, &BaseTables::default(), &llama_like(VOCAB, HIDDEN, true));
    assert!(
        matches!(r, Err(OverlayError::MissingTable { table: "embed_tokens" })),
        "{r:?}"
    );
    // A config whose vocabulary the tables do not have.
    let r = ServedTables::upload(&dev, &untied, &llama_like(VOCAB + 1, HIDDEN, false));
    assert!(matches!(r, Err(OverlayError::TableSize { .. })), "{r:?}");
}
