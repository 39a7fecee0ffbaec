use super::*;
use crate::testing::Rng;

#[test]
fn row_diff_flags_rows_past_the_threshold_and_nan() {
    let d = Device::cpu();
    let mut rng = Rng::new(51);
    let (vocab, h) = (12, 10);
    let base = rng.bf16_vec(vocab * h, 1.0);
    let mut table = base.clone();
    table[3 * h + 4] = bf16::from_f32(table[3 * h + 4].to_f32() + 0.25);
    table[5 * h + 9] = bf16::from_f32(table[5 * h + 9].to_f32() + 0.015625);
    table[8 * h] = bf16::NAN;
    let (b, t) = (d.upload(&base).unwrap(), d.upload(&table).unwrap());
    let mut out = d.upload(&vec![9u8; vocab]).unwrap();
    row_diff(&d, Rows::dense(&t, vocab, h), Rows::dense(&b, vocab, h), 0.1, &mut out).unwrap();
    let got = out.download().unwrap();
    let want: Vec<u8> = (0..vocab).map(|v| u8::from(v == 3 || v == 8)).collect();
    assert_eq!(got, want);
    row_diff(&d, Rows::dense(&t, vocab, h), Rows::dense(&b, vocab, h), 0.0, &mut out).unwrap();
    assert_eq!(out.download().unwrap()[5], 1);
}

#[test]
fn embedding_takes_overlay_rows_of_the_rows_slot() {
    let d = Device::cpu();
    let mut rng = Rng::new(52);
    let (vocab, h) = (10, 6);
    let base = rng.bf16_vec(vocab * h, 1.0);
    let rows = rng.bf16_vec(2 * h, 1.0);
    let mut map = vec![-1i32; vocab];
    map[4] = 1;
    map[7] = 0;
    let (base_d, rows_d, map_d) = (
        d.upload(&base).unwrap(),
        d.upload(&rows).unwrap(),
        d.upload(&map).unwrap(),
    );
    let ents = d
        .upload(&[
            EmbedOverlayEntry::default(),
            EmbedOverlayEntry {
                slot_map: map_d.device_addr(),
                rows: rows_d.device_addr(),
                n_rows: 2,
                pad: 0,
            },
        ])
        .unwrap();
    let ids = [4u32, 4, 7, 2, 7];
    let slots = [1i32, 0, 1, 1, -1];
    let (ids_d, slots_d) = (d.upload(&ids).unwrap(), d.upload(&slots).unwrap());
    let mut out = d.upload(&vec![bf16::NAN; 5 * h]).unwrap();
    embed_overlay(
        &d,
        &ids_d,
        Some(&slots_d),
        Rows::dense(&base_d, vocab, h),
        &ents,
        RowsMut::dense(&mut out, 5, h),
    )
    .unwrap();
    let got = out.download().unwrap();
    let row = |v: &[bf16], i: usize| v[i * h..(i + 1) * h].to_vec();
    assert_eq!(row(&got, 0), row(&rows, 1));
    assert_eq!(row(&got, 1), row(&base, 4));
    assert_eq!(row(&got, 2), row(&rows, 0));
    assert_eq!(row(&got, 3), row(&base, 2));
    assert_eq!(row(&got, 4), row(&base, 7));
    // No row_slot at all: the base table.
    embed_overlay(
        &d,
        &ids_d,
        None,
        Rows::dense(&base_d, vocab, h),
        &ents,
        RowsMut::dense(&mut out, 5, h),
    )
    .unwrap();
    assert_eq!(row(&out.download().unwrap(), 0), row(&base, 4));
    // Hostile input: an id past the vocab, a slot past the table, a map row past the rows.
    let bad_ids = d.upload(&[10u32, 0, 0, 0, 0]).unwrap();
    assert!(
        embed_overlay(
            &d,
            &bad_ids,
            None,
            Rows::dense(&base_d, vocab, h),
            &ents,
            RowsMut::dense(&mut out, 5, h)
        )
        .is_err()
    );
    let bad_slots = d.upload(&[2i32, 0, 0, 0, 0]).unwrap();
    let r = embed_overlay(
        &d,
        &ids_d,
        Some(&bad_slots),
        Rows::dense(&base_d, vocab, h),
        &ents,
        RowsMut::dense(&mut out, 5, h),
    );
    assert!(r.is_err());
    map[4] = 2;
    let map_bad = d.upload(&map).unwrap();
    let ents_bad = d
        .upload(&[EmbedOverlayEntry {
            slot_map: map_bad.device_addr(),
            rows: rows_d.device_addr(),
            n_rows: 2,
            pad: 0,
        }])
        .unwrap();
    let zero_slots = d.upload(&[0i32; 5]).unwrap();
    let r = embed_overlay(
        &d,
        &ids_d,
        Some(&zero_slots),
        Rows::dense(&base_d, vocab, h),
        &ents_bad,
        RowsMut::dense(&mut out, 5, h),
    );
    assert!(r.is_err());
}

#[test]
fn lm_head_overlay_rewrites_only_overridden_logits_of_overlaid_rows() {
    let d = Device::cpu();
    let mut rng = Rng::new(53);
    let (vocab, h, n) = (9, 5, 3);
    let hidden = rng.bf16_vec(n * h, 1.0);
    let rows = rng.bf16_vec(2 * h, 1.0);
    let ids = [6u32, 1];
    let (hidden_d, rows_d, ids_d) = (
        d.upload(&hidden).unwrap(),
        d.upload(&rows).unwrap(),
        d.upload(&ids).unwrap(),
    );
    let ents = d
        .upload(&[
            LmHeadOverlayEntry {
                ids: ids_d.device_addr(),
                rows: rows_d.device_addr(),
                count: 2,
                pad: 0,
            },
            LmHeadOverlayEntry::default(),
        ])
        .unwrap();
    let slots = d.upload(&[0i32, -1, 1]).unwrap();
    let logits0: Vec<f32> = (0..n * vocab).map(|_| rng.uniform()).collect();
    let mut logits = d.upload(&logits0).unwrap();
    lm_head_overlay(
        &d,
        Rows::dense(&hidden_d, n, h),
        &slots,
        &ents,
        RowsMut::dense(&mut logits, n, vocab),
    )
    .unwrap();
    let got = logits.download().unwrap();
    let mut want = logits0.clone();
    for (k, &id) in ids.iter().enumerate() {
        let dot: f64 = (0..h)
            .map(|j| f64::from(hidden[j].to_f32()) * f64::from(rows[k * h + j].to_f32()))
            .sum();
        want[id as usize] = dot as f32;
    }
    assert!(crate::testing::rel_error(&got, &want) < 1e-6);
    assert_eq!(&got[vocab..], &logits0[vocab..], "rows of no head overlay untouched");
    let bad_ids = d.upload(&[9u32, 1]).unwrap();
    let ents_bad = d
        .upload(&[LmHeadOverlayEntry {
            ids: bad_ids.device_addr(),
            rows: rows_d.device_addr(),
            count: 2,
            pad: 0,
        }])
        .unwrap();
    let zero = d.upload(&[0i32; 3]).unwrap();
    assert!(
        lm_head_overlay(
            &d,
            Rows::dense(&hidden_d, n, h),
            &zero,
            &ents_bad,
            RowsMut::dense(&mut logits, n, vocab)
        )
        .is_err()
    );
}

/// A vocab-parallel rank's lookup (`embed_overlay_at`): its tables hold
/// the rows of ids `held` (the slot map indexed by `id - held.start`); a
/// token of another rank gets a zero row, an id past the vocabulary is an
/// error with nothing written.
#[test]
fn a_vocab_parallel_lookup_zeroes_other_ranks_tokens() {
    let d = Device::cpu();
    let mut rng = Rng::new(53);
    let (held, size, h) = (8usize..12, 16usize, 6);
    let base = rng.bf16_vec(held.len() * h, 1.0);
    let rows = rng.bf16_vec(h, 1.0);
    let mut map = vec![-1i32; held.len()];
    map[10 - held.start] = 0;
    let (base_d, rows_d, map_d) = (
        d.upload(&base).unwrap(),
        d.upload(&rows).unwrap(),
        d.upload(&map).unwrap(),
    );
    let ents = d
        .upload(&[EmbedOverlayEntry {
            slot_map: map_d.device_addr(),
            rows: rows_d.device_addr(),
            n_rows: 1,
            pad: 0,
        }])
        .unwrap();
    let ids = [10u32, 10, 3, 11, 8, 15];
    let slots = [0i32, -1, 0, 0, 0, 0];
    let (ids_d, slots_d) = (d.upload(&ids).unwrap(), d.upload(&slots).unwrap());
    let mut out = d.upload(&vec![bf16::NAN; ids.len() * h]).unwrap();
    let run = |ids: &DeviceBuffer<u32>, n: usize, out: &mut DeviceBuffer<bf16>| {
        embed_overlay_at(
            &d,
            ids,
            Some(&slots_d),
            Rows::dense(&base_d, held.len(), h),
            held.clone(),
            size,
            &ents,
            RowsMut::dense(out, n, h),
        )
    };
    run(&ids_d, ids.len(), &mut out).unwrap();
    let got = out.download().unwrap();
    let row = |v: &[bf16], i: usize| v[i * h..(i + 1) * h].to_vec();
    let zeros = vec![bf16::ZERO; h];
    assert_eq!(row(&got, 0), row(&rows, 0));
    assert_eq!(row(&got, 1), row(&base, 2));
    assert_eq!(row(&got, 2), zeros);
    assert_eq!(row(&got, 3), row(&base, 3));
    assert_eq!(row(&got, 4), row(&base, 0));
    assert_eq!(row(&got, 5), zeros);
    let bad = d.upload(&[9u32, 16]).unwrap();
    let mut out = d.upload(&vec![bf16::NAN; 2 * h]).unwrap();
    assert!(matches!(
        run(&bad, 2, &mut out),
        Err(KernelError::BadIndex {
            arg: "ids",
            index: 16,
            ..
        })
    ));
    assert!(out.download().unwrap().iter().all(|v| v.is_nan()), "nothing written");
}
