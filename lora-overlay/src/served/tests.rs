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

/// Under the vocab-parallel cut a rank's tables are its rows of both
/// (a tied head the embedding's same rows); a vocabulary that does not
/// divide is refused naming `vocab_size`; `holding` refuses rows past the
/// vocabulary.
#[test]
fn a_vocab_parallel_rank_serves_its_rows_of_both_tables() {
    let dev = Device::cpu();
    let mut rng = Rng::new(32);
    let embed = rng.bf16_vec(VOCAB * HIDDEN, 1.0);
    let head = rng.bf16_vec(VOCAB * HIDDEN, 1.0);
    let untied = BaseTables {
        embed: Some(embed.clone()),
        lm_head: Some(head.clone()),
    };
    let cfg = llama_like(VOCAB, HIDDEN, false);
    for world in [1usize, 2, 3, 4] {
        for p in Placement::new(0, world).unwrap().with_vocab_parallel(true).ranks() {
            let t = ServedTables::upload_at(&dev, &untied, &cfg, p).unwrap();
            let held = p.vocab_range(VOCAB).unwrap();
            assert_eq!((t.held(), t.vocab(), t.vocab_size()), (held.clone(), held.len(), VOCAB));
            let rows = held.start * HIDDEN..held.end * HIDDEN;
            assert_eq!(t.embed().download().unwrap(), embed[rows.clone()]);
            assert_eq!(t.head_table().unwrap().download().unwrap(), head[rows]);
            assert_eq!(t.local_id(held.start as u32), Some(0));
            assert_eq!(t.local_id(held.end as u32), None);
        }
    }
    let tied = BaseTables {
        embed: Some(embed.clone()),
        lm_head: None,
    };
    let p = Placement::new(1, 2).unwrap().with_vocab_parallel(true);
    let t = ServedTables::upload_at(&dev, &tied, &llama_like(VOCAB, HIDDEN, true), p).unwrap();
    assert_eq!(t.head_table().unwrap().download().unwrap(), embed[6 * HIDDEN..]);
    let p5 = Placement::new(0, 5).unwrap().with_vocab_parallel(true);
    let r = ServedTables::upload_at(&dev, &untied, &cfg, p5);
    assert!(
        matches!(&r, Err(e @ OverlayError::Placement(_)) if e.to_string().contains("vocab_size")),
        "{r:?}"
    );
    let whole = ServedTables::upload(&dev, &untied, &cfg).unwrap();
    assert!(whole.clone().holding(1, VOCAB).is_err());
    assert!(whole.holding(0, VOCAB).is_ok());
}
