use half::bf16;

use super::*;
use crate::testing::Rng;

/// Two slots' embedding pairs in one buffer: slot 0 rank 3, slot 1 rank 2,
/// padded to `stride`, A `[stride, vocab]` then B `[h, stride]` each.
struct Pool {
    weights: DeviceBuffer<bf16>,
    table: DeviceBuffer<PairEntry>,
    /// Per slot: (rank, scale, A [rank, vocab], B [h, rank]) as f32.
    pairs: Vec<(usize, f32, Vec<f32>, Vec<f32>)>,
}

fn pool(d: &Device, rng: &mut Rng, vocab: usize, h: usize, stride: usize) -> Pool {
    let specs = [(3usize, 0.5f32), (2, -1.25)];
    let pair_elems = stride * vocab + h * stride;
    let mut host = vec![bf16::ZERO; specs.len() * pair_elems];
    let mut pairs = Vec::new();
    for (s, &(rank, scale)) in specs.iter().enumerate() {
        let a = rng.bf16_vec(rank * vocab, 1.0);
        let b = rng.bf16_vec(h * rank, 1.0);
        let base = s * pair_elems;
        host[base..base + rank * vocab].copy_from_slice(&a);
        for o in 0..h {
            let dst = base + stride * vocab + o * stride;
            host[dst..dst + rank].copy_from_slice(&b[o * rank..(o + 1) * rank]);
        }
        let wide = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        pairs.push((rank, scale, wide(&a), wide(&b)));
    }
    let weights = d.upload(&host).unwrap();
    let entries: Vec<PairEntry> = specs
        .iter()
        .enumerate()
        .map(|(s, &(rank, scale))| PairEntry {
            a: weights.addr_at(s * pair_elems).unwrap(),
            b: weights.addr_at(s * pair_elems + stride * vocab).unwrap(),
            scale,
            rank: rank as u32,
        })
        .collect();
    let table = d.upload(&entries).unwrap();
    Pool { weights, table, pairs }
}

#[test]
fn each_row_gains_its_slots_column_delta() {
    let d = Device::cpu();
    let mut rng = Rng::new(61);
    let (vocab, h, stride) = (11, 5, 4);
    let p = pool(&d, &mut rng, vocab, h, stride);
    let ids = [3u32, 10, 3, 0, 7];
    let slots = [0i32, 1, -1, 1, 0];
    let base: Vec<f32> = (0..ids.len() * h).map(|i| i as f32 * 0.25).collect();
    let (ids_d, slots_d) = (d.upload(&ids).unwrap(), d.upload(&slots).unwrap());
    let mut out = d.upload(&base).unwrap();
    let pairs = EmbeddingPairs {
        table: &p.table,
        table_offset: 0,
        n_entries: 2,
        stride,
        vocab,
        vocab_start: 0,
        vocab_size: vocab,
    };
    embed_lora(&d, &ids_d, &slots_d, pairs, RowsMut::dense(&mut out, ids.len(), h)).unwrap();
    let got = out.download().unwrap();
    for (i, (&t, &s)) in ids.iter().zip(&slots).enumerate() {
        for o in 0..h {
            let want = if s < 0 {
                base[i * h + o]
            } else {
                let (rank, scale, a, b) = &p.pairs[s as usize];
                let dot: f64 = (0..*rank)
                    .map(|k| f64::from(b[o * rank + k]) * f64::from(a[k * vocab + t as usize]))
                    .sum();
                base[i * h + o] + (f64::from(*scale) * dot) as f32
            };
            assert!(
                (got[i * h + o] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "row {i} col {o}"
            );
        }
    }
    let _ = &p.weights;
}

#[test]
fn bad_ids_slots_and_entries_are_errors_and_write_nothing() {
    let d = Device::cpu();
    let mut rng = Rng::new(62);
    let (vocab, h, stride) = (11, 5, 4);
    let p = pool(&d, &mut rng, vocab, h, stride);
    let run = |ids: &[u32], slots: &[i32], stride: usize| {
        let (ids_d, slots_d) = (d.upload(ids).unwrap(), d.upload(slots).unwrap());
        let mut out = d.upload(&vec![7f32; ids.len() * h]).unwrap();
        let pairs = EmbeddingPairs {
            table: &p.table,
            table_offset: 0,
            n_entries: 2,
            stride,
            vocab,
            vocab_start: 0,
            vocab_size: vocab,
        };
        let r = embed_lora(&d, &ids_d, &slots_d, pairs, RowsMut::dense(&mut out, ids.len(), h));
        assert!(out.download().unwrap().iter().all(|&v| v == 7.0), "nothing written");
        r
    };
    assert!(matches!(
        run(&[1, 11], &[0, 1], stride),
        Err(KernelError::BadIndex {
            arg: "ids",
            position: 1,
            index: 11,
            ..
        })
    ));
    assert!(matches!(
        run(&[1, 2], &[0, 2], stride),
        Err(KernelError::BadIndex {
            arg: "row_slot",
            position: 1,
            ..
        })
    ));
    // An entry whose rank exceeds the call's stride.
    assert!(matches!(
        run(&[1], &[0], 2),
        Err(KernelError::BadEntry { entry: 0, .. })
    ));
    // A base row never reads its (out-of-range) id.
    assert!(run(&[99], &[-1], stride).is_ok());
}

#[test]
fn a_short_index_buffer_is_refused_before_any_work() {
    let d = Device::cpu();
    let table = d.upload(&[PairEntry::default()]).unwrap();
    let ids = d.upload(&[0u32]).unwrap();
    let slots = d.upload(&[0i32, 0]).unwrap();
    let mut out = d.alloc_zeros::<f32>(2 * 4).unwrap();
    let pairs = EmbeddingPairs {
        table: &table,
        table_offset: 0,
        n_entries: 1,
        stride: 2,
        vocab: 8,
        vocab_start: 0,
        vocab_size: 8,
    };
    assert!(embed_lora(&d, &ids, &slots, pairs, RowsMut::dense(&mut out, 2, 4)).is_err());
}

/// A vocab-parallel rank's pairs (A's columns `start .. start + vocab` of
/// a vocabulary of `size`): a token of the range reads its column, another
/// rank's token adds nothing, an id past the vocabulary is an error.
#[test]
fn a_vocab_parallel_rank_adds_only_its_tokens_columns() {
    let d = Device::cpu();
    let mut rng = Rng::new(63);
    let (vocab, h, stride, start, size) = (6, 5, 4, 6, 18);
    let p = pool(&d, &mut rng, vocab, h, stride);
    let ids = [6u32, 11, 0, 5, 12, 17, 8];
    let slots = [0i32, 1, 0, 1, 0, 1, -1];
    let base: Vec<f32> = (0..ids.len() * h).map(|i| i as f32 * 0.5).collect();
    let (ids_d, slots_d) = (d.upload(&ids).unwrap(), d.upload(&slots).unwrap());
    let pairs = EmbeddingPairs {
        table: &p.table,
        table_offset: 0,
        n_entries: 2,
        stride,
        vocab,
        vocab_start: start,
        vocab_size: size,
    };
    let mut out = d.upload(&base).unwrap();
    embed_lora(&d, &ids_d, &slots_d, pairs, RowsMut::dense(&mut out, ids.len(), h)).unwrap();
    let got = out.download().unwrap();
    for (i, (&t, &s)) in ids.iter().zip(&slots).enumerate() {
        let t = t as usize;
        for o in 0..h {
            let want = if s < 0 || !(start..start + vocab).contains(&t) {
                base[i * h + o]
            } else {
                let (rank, scale, a, b) = &p.pairs[s as usize];
                let dot: f64 = (0..*rank)
                    .map(|k| f64::from(b[o * rank + k]) * f64::from(a[k * vocab + t - start]))
                    .sum();
                base[i * h + o] + (f64::from(*scale) * dot) as f32
            };
            assert!(
                (got[i * h + o] - want).abs() <= 1e-5 * want.abs().max(1.0),
                "row {i} col {o}"
            );
        }
    }
    let bad = d.upload(&[7u32, 18]).unwrap();
    let mut out = d.upload(&[3f32; 10]).unwrap();
    assert!(matches!(
        embed_lora(&d, &bad, &slots_d, pairs, RowsMut::dense(&mut out, 2, h)),
        Err(KernelError::BadIndex {
            arg: "ids",
            index: 18,
            ..
        })
    ));
    assert!(out.download().unwrap().iter().all(|&v| v == 3.0), "nothing written");
    // Columns past the vocabulary are refused before any work.
    let past = EmbeddingPairs {
        vocab_size: 11,
        ..pairs
    };
    assert!(embed_lora(&d, &ids_d, &slots_d, past, RowsMut::dense(&mut out, 2, h)).is_err());
    let _ = &p.weights;
}
