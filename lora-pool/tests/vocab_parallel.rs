//! The vocab-parallel cut of the embedding and head pairs
//! (`Placement::vocab_parallel`, `LORA_VOCAB_PARALLEL`) end to end on the
//! CPU backend, for world sizes 1, 2 and 4 (the llama fixtures' vocabulary
//! of 256 divides by each): every rank's pool is built from the same
//! adapter by every route (startup load, disk swap, a prepared adapter, the
//! host tier); each rank's slot holds A's vocabulary columns of its block
//! (embedding) or B's vocabulary rows (head) and the ranks' slot bytes add
//! up to the unsharded slot's plus the whole halves every rank keeps; the
//! ranks' embedding deltas summed equal the unsharded pool's (a token adds
//! its delta only on the rank that holds it), and their head deltas
//! concatenated in rank order equal the unsharded pool's logits. A rank
//! reads only its own bytes of the file: a NaN in another rank's
//! vocabulary columns is never seen.

#![allow(clippy::unwrap_used)]

mod common;

use common::placed::{
    HEAD_ROWS, MAX_RANK, ModelPair, ROUTES, pair_options, pair_pool_by_every_route, pair_rows, poisoned_copy,
};
use common::{model_config, rel_error};
use lora_kernels::Device;
use lora_layout::{Placement, ShardKind, SlotLayout};
use lora_pool::{AdapterSource, BatchCapacity, LoraPool, SlotId};

/// Reassembled ranks against the unsharded pool (the bound).
const SHARD_TOL: f64 = 1e-3;

/// One rank's pool of `which` (every route into a slot): the slot bytes
/// and the rows each route's slot serves.
fn serve(device: &Device, which: ModelPair, p: Placement, ids: &[u32]) -> (usize, Vec<Vec<f32>>) {
    let cfg = model_config("llama");
    let mut pool = pair_pool_by_every_route(device, which, p);
    let layout = pool.layout().clone();
    let i = layout.entries().len();
    let shard = *layout.shard(i).unwrap();
    let held = p.vocab_range(cfg.vocab_size).unwrap();
    match which {
        ModelPair::Embedding => {
            let e = layout.embedding().unwrap();
            assert_eq!((e.vocab_start, e.vocab), (held.start, held.len()), "{p:?}");
            assert_eq!((shard.in_start, shard.in_len), (held.start, held.len()));
        }
        ModelPair::LmHead => {
            let h = layout.lm_head().unwrap();
            assert_eq!((h.vocab_start, h.vocab), (held.start, held.len()), "{p:?}");
            assert_eq!(shard.src_row(0), Some(held.start));
        }
    }
    if p.tp_world() > 1 {
        let kind = match which {
            ModelPair::Embedding => ShardKind::Row,
            ModelPair::LmHead => ShardKind::Column,
        };
        assert_eq!(shard.kind, kind, "{p:?}");
    }
    let a_offset = match which {
        ModelPair::Embedding => layout.embedding().unwrap().a_offset,
        ModelPair::LmHead => layout.lm_head().unwrap().a_offset,
    };
    let region = a_offset / 2..layout.slot_bytes() / 2;
    let first = pool.slot_contents(SlotId::new(0)).unwrap()[region.clone()].to_vec();
    for (s, name) in ROUTES.iter().enumerate() {
        let bytes = pool.slot_contents(SlotId::new(s)).unwrap()[region.clone()].to_vec();
        assert_eq!(bytes, first, "{p:?} {name}: every route holds the same rank's pair");
    }
    let rows = pair_rows(&mut pool, which, ids);
    (layout.slot_bytes(), rows)
}

/// Every rank of worlds 1, 2, 4 on `device`: the ranks' embedding rows
/// summed, or head logits concatenated, equal the unsharded pool's; the
/// slot bytes add up. Returns every world's ranks' rows, concatenated, for a
/// comparison across devices.
fn ranks_reassemble(device: &Device, which: ModelPair) -> Vec<Vec<f32>> {
    let cfg = model_config("llama");
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    // Every token id, in a mixed order (each rank's tokens interleaved).
    let ids: Vec<u32> = (0..vocab as u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let (whole_bytes, whole_rows) = serve(device, which, Placement::SINGLE, &ids);
    assert!(whole_rows[0].iter().any(|&v| v != 0.0), "{which:?}: a delta");
    let dense = SlotLayout::new(&cfg, MAX_RANK).unwrap().slot_bytes();
    let kept_whole = MAX_RANK * hidden * 2; // B (embedding) or A (head), bytes
    let mut all = Vec::new();
    for world in [1usize, 2, 4] {
        let mut bytes = 0;
        let mut ranks = Vec::new();
        for p in Placement::new(0, world).unwrap().with_vocab_parallel(true).ranks() {
            let (b, rows) = serve(device, which, p, &ids);
            // The rank's dense shards, then its part of the pair.
            bytes += b - SlotLayout::with_placement(&cfg, MAX_RANK, p).unwrap().slot_bytes();
            for (name, r) in ROUTES.iter().zip(&rows) {
                assert_eq!(r, &rows[0], "{which:?} {p:?} {name}: every route serves the same rows");
            }
            ranks.push(rows.into_iter().next().unwrap());
        }
        assert_eq!(
            bytes,
            whole_bytes - dense + (world - 1) * kept_whole,
            "{which:?} x{world}: the cut halves add up, the whole half is on every rank"
        );
        let reassembled: Vec<f32> = match which {
            ModelPair::Embedding => {
                let mut sum = vec![0f32; ids.len() * hidden];
                for (r, rows) in ranks.iter().enumerate() {
                    let held = Placement::new(r, world)
                        .unwrap()
                        .with_vocab_parallel(true)
                        .vocab_range(vocab)
                        .unwrap();
                    for (t, &id) in ids.iter().enumerate() {
                        let row = &rows[t * hidden..(t + 1) * hidden];
                        if !held.contains(&(id as usize)) {
                            assert!(
                                row.iter().all(|&v| v == 0.0),
                                "x{world} rank {r}: token {id} is not its"
                            );
                        }
                        for (s, v) in sum[t * hidden..(t + 1) * hidden].iter_mut().zip(row) {
                            *s += v;
                        }
                    }
                }
                sum
            }
            ModelPair::LmHead => {
                let part = vocab / world;
                (0..HEAD_ROWS)
                    .flat_map(|t| {
                        ranks
                            .iter()
                            .flat_map(move |rows| rows[t * part..(t + 1) * part].to_vec())
                    })
                    .collect()
            }
        };
        let err = rel_error(&reassembled, &whole_rows[0]);
        assert!(err < SHARD_TOL, "{which:?} x{world}: rel err {err:.2e}");
        all.push(ranks.concat());
    }
    all
}

#[test]
fn vocab_parallel_embedding_ranks_sum_to_the_unsharded_delta() {
    ranks_reassemble(&Device::cpu(), ModelPair::Embedding);
}

#[test]
fn vocab_parallel_head_ranks_concatenate_to_the_unsharded_logits() {
    ranks_reassemble(&Device::cpu(), ModelPair::LmHead);
}

/// Every rank's pool on one GPU (two and four pools on one device as the
/// ranks): the same reassembly through the CUDA embedding gather-expand and
/// the tall-output decode kernels, and every rank's rows equal to the CPU
/// reference's within the served tolerance.
#[test]
#[ignore = "needs a GPU: run with --include-ignored where CUDA is usable"]
fn vocab_parallel_embedding_and_head_ranks_on_one_gpu_equal_the_cpu_reference() {
    let Some(device) = lora_kernels::testing::cuda_or_skip(
        "vocab_parallel_embedding_and_head_ranks_on_one_gpu_equal_the_cpu_reference",
    ) else {
        return;
    };
    for which in [ModelPair::Embedding, ModelPair::LmHead] {
        let gpu = ranks_reassemble(&device, which);
        let cpu = ranks_reassemble(&Device::cpu(), which);
        for (w, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
            let err = rel_error(g, c);
            assert!(
                err < SHARD_TOL,
                "{which:?} world index {w}: CUDA vs CPU rel err {err:.2e}"
            );
        }
    }
}

/// Startup load, disk swap and the host tier read only the rank's
/// vocabulary columns: a NaN in the last token's column is refused by the
/// last rank and never seen by the others.
#[test]
fn a_vocab_parallel_rank_reads_only_its_own_columns() {
    let cfg = model_config("llama");
    // `embedding_lora_no_table` with a NaN in `lora_embedding_A`'s column of
    // token `vocab - 1` (row 0, last column): only the last vocab-parallel
    // rank holds it.
    let bad = poisoned_copy(
        "embedding_lora_no_table",
        "lora-pool-vocab-poison",
        "base_model.model.model.embed_tokens.lora_embedding_A",
        |shape| shape[1] - 1,
    );
    for p in Placement::new(0, 2).unwrap().with_vocab_parallel(true).ranks() {
        let last = p.tp_rank() == 1;
        let sources = [AdapterSource {
            name: "bad",
            dir: bad.as_path(),
        }];
        let loaded = LoraPool::load(
            &Device::cpu(),
            cfg.clone(),
            pair_options(ModelPair::Embedding, p),
            BatchCapacity::default(),
            &sources,
        );
        assert_eq!(loaded.is_err(), last, "{p:?}: {:?}", loaded.as_ref().err());
        if let Err(e) = loaded {
            assert!(e.to_string().contains("non-finite"), "{e}");
            continue;
        }
        let mut pool = loaded.unwrap();
        pool.swap_from_disk(SlotId::new(1), "bad-disk", &bad).unwrap();
        pool.prefetch("bad-tier", &bad).unwrap();
        pool.wait_for_prefetch();
        let events = pool.prefetch_events();
        let tiered = events.iter().find(|e| e.name == "bad-tier").map(|e| &e.outcome);
        assert!(matches!(tiered, Some(Ok(_))), "{tiered:?}");
    }
    // Unsharded, the NaN is read and refused.
    let sources = [AdapterSource {
        name: "bad",
        dir: bad.as_path(),
    }];
    let whole = LoraPool::load(
        &Device::cpu(),
        cfg,
        pair_options(ModelPair::Embedding, Placement::SINGLE),
        BatchCapacity::default(),
        &sources,
    );
    assert!(whole.is_err());
    let _ = std::fs::remove_dir_all(&bad);
}
