//! The vocab-parallel cut of the embedding and head pairs: a function of
//! (V, W, r) only, covering every token id exactly once, and the ranks'
//! slot bytes adding up to the whole pairs'.

use super::*;
use crate::layout::{BF16_BYTES, LayoutError, ModelPlaces, SlotLayout};
use crate::pair::{PairKey, PairLayout};
use proptest::prelude::*;

fn llama(hidden: usize, vocab: usize) -> ModelConfig {
    ModelConfig::from_hf_value(&serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 1,
        "num_attention_heads": 24, "num_key_value_heads": 24, "head_dim": 4,
        "intermediate_size": 48, "vocab_size": vocab
    }))
    .unwrap()
}

const BOTH: ModelPlaces = ModelPlaces {
    embedding: true,
    lm_head: true,
};

proptest! {
    /// Rank r holds ids `r·V/W .. (r+1)·V/W`: the ranks' ranges tile
    /// `0..V` in rank order; the embedding shard cuts A's columns to the
    /// range (B whole), the head shard B's rows (A whole); the ranks' slot
    /// bytes for the two pairs add up to the whole pairs' bytes. Off, or at
    /// world 1, both pairs are whole on every rank.
    #[test]
    fn the_vocab_cut_tiles_the_vocabulary_and_the_bytes_add_up(
        per in 1usize..40,
        world in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
        hidden in prop::sample::select(vec![8usize, 16, 32]),
        max_rank in 1usize..9,
    ) {
        let vocab = per * world;
        let cfg = llama(hidden, vocab);
        let whole = SlotLayout::walk(&cfg, max_rank, Placement::SINGLE, BOTH).unwrap();
        let dense = SlotLayout::new(&cfg, max_rank).unwrap().slot_bytes();
        let whole_pairs = whole.slot_bytes() - dense;
        let mut next = 0;
        let mut rank_pairs = 0;
        for p in Placement::new(0, world).unwrap().with_vocab_parallel(true).ranks() {
            let range = p.vocab_range(vocab).unwrap();
            prop_assert_eq!(range.clone(), p.tp_rank() * per..(p.tp_rank() + 1) * per);
            prop_assert_eq!(range.start, next);
            next = range.end;
            let e = ModuleShard::embedding(&cfg, p).unwrap();
            prop_assert_eq!((e.in_start, e.in_len, e.dims()), (range.start, per, (hidden, per)));
            prop_assert_eq!(e.segments(), &[OutSegment { start: 0, len: hidden, replicas: world }][..]);
            let h = ModuleShard::lm_head(&cfg, p).unwrap();
            prop_assert_eq!(h.dims(), (per, hidden));
            prop_assert_eq!(h.segments(), &[OutSegment { start: range.start, len: per, replicas: 1 }][..]);
            prop_assert_eq!((h.in_start, h.in_len, h.in_replicas), (0, hidden, world));
            if world > 1 {
                prop_assert_eq!((e.kind, h.kind), (ShardKind::Row, ShardKind::Column));
            }
            let layout = SlotLayout::walk(&cfg, max_rank, p, BOTH).unwrap();
            // The rank's dense shards come first, unmoved.
            let dense_p = SlotLayout::with_placement(&cfg, max_rank, p).unwrap();
            prop_assert_eq!(layout.entries(), dense_p.entries());
            let dense_p = dense_p.slot_bytes();
            let emb = layout.embedding().unwrap();
            prop_assert_eq!((emb.vocab_start, emb.vocab, emb.hidden), (range.start, per, hidden));
            let head = layout.lm_head().unwrap();
            prop_assert_eq!((head.vocab_start, head.vocab, head.hidden), (range.start, per, hidden));
            let i = PairLayout::position(&layout, PairKey::Embedding).unwrap();
            let place = layout.place(i).unwrap();
            prop_assert_eq!((place.out_dim, place.in_dim, place.shard), (hidden, per, e));
            let place = layout.place(i + 1).unwrap();
            prop_assert_eq!((place.out_dim, place.in_dim, place.shard), (per, hidden, h));
            let pairs = layout.slot_bytes() - dense_p;
            prop_assert_eq!(pairs, (max_rank * (per + hidden) * 2) * BF16_BYTES);
            rank_pairs += pairs - 2 * max_rank * hidden * BF16_BYTES;
            // Off: whole on every rank.
            let off = p.with_vocab_parallel(false);
            prop_assert_eq!(off.vocab_range(vocab).unwrap(), 0..vocab);
            prop_assert!(ModuleShard::embedding(&cfg, off).unwrap().is_whole());
            prop_assert!(ModuleShard::lm_head(&cfg, off).unwrap().is_whole());
            prop_assert_eq!(SlotLayout::walk(&cfg, max_rank, off, BOTH).unwrap().slot_bytes() - dense_p, whole_pairs);
        }
        prop_assert_eq!(next, vocab);
        // The cut parts (A's vocabulary columns, B's vocabulary rows) add
        // up to the whole pairs' cut parts; the other halves are whole on
        // every rank.
        prop_assert_eq!(rank_pairs, whole_pairs - 2 * max_rank * hidden * BF16_BYTES);
    }

    /// A vocabulary that does not divide is refused naming `vocab_size`,
    /// by the placement and by the layout walk.
    #[test]
    fn an_indivisible_vocabulary_is_refused_naming_vocab_size(
        vocab in 1usize..200,
        world in prop::sample::select(vec![2usize, 3, 4, 8]),
    ) {
        prop_assume!(!vocab.is_multiple_of(world));
        let cfg = llama(8, vocab);
        let p = Placement::new(world - 1, world).unwrap().with_vocab_parallel(true);
        let want = PlacementError::IndivisibleVocab { vocab_size: vocab, tp_world: world };
        prop_assert_eq!(p.vocab_range(vocab), Err(want.clone()));
        prop_assert_eq!(ModuleShard::embedding(&cfg, p), Err(want.clone()));
        prop_assert_eq!(ModuleShard::lm_head(&cfg, p), Err(want.clone()));
        for places in [ModelPlaces { embedding: true, lm_head: false }, ModelPlaces { embedding: false, lm_head: true }] {
            let err = SlotLayout::walk(&cfg, 4, p, places).unwrap_err();
            prop_assert_eq!(&err, &LayoutError::Placement(want.clone()));
            prop_assert!(err.to_string().contains("vocab_size"), "{}", err);
        }
        // Without the places, or with the cut off, nothing is refused.
        prop_assert!(SlotLayout::walk(&cfg, 4, p, ModelPlaces::default()).is_ok());
        prop_assert!(SlotLayout::walk(&cfg, 4, p.with_vocab_parallel(false), BOTH).is_ok());
    }
}
