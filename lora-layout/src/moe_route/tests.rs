use super::*;

const HAS: MoeAdapterState = MoeAdapterState {
    has_expert_deltas: true,
    expert_slot: Some(2),
};

#[test]
fn route_resolution_covers_fold_skip_and_both_refusals() {
    assert_eq!(resolve_moe_lora_route(None, true), MoeLoraRoute::Skip);
    let dense_only = MoeAdapterState {
        has_expert_deltas: false,
        expert_slot: None,
    };
    assert_eq!(resolve_moe_lora_route(Some(dense_only), false), MoeLoraRoute::Skip);
    assert_eq!(resolve_moe_lora_route(Some(HAS), true), MoeLoraRoute::Fold { slot: 2 });
    assert_eq!(
        resolve_moe_lora_route(Some(HAS), false),
        MoeLoraRoute::Refuse {
            reason: RefuseReason::ExpertsDisabled
        }
    );
    let evicted = MoeAdapterState {
        has_expert_deltas: true,
        expert_slot: None,
    };
    assert_eq!(
        resolve_moe_lora_route(Some(evicted), true),
        MoeLoraRoute::Refuse {
            reason: RefuseReason::NotResident
        }
    );
}

#[test]
fn a_refused_row_fails_the_batch_before_launch() {
    let refuse = MoeLoraRoute::Refuse {
        reason: RefuseReason::NotResident,
    };
    let routes = [MoeLoraRoute::Fold { slot: 1 }, MoeLoraRoute::Skip, refuse];
    assert!(ensure_decode_route_servable(routes[0], 0).is_ok());
    assert!(ensure_decode_route_servable(routes[1], 1).is_ok());
    let err = ensure_batch_servable(&routes).unwrap_err();
    assert_eq!(
        err,
        RouteRefused {
            row: 2,
            reason: RefuseReason::NotResident
        }
    );
    assert!(err.to_string().contains("row 2"));
    // The map alone would have silently skipped it: that is why the check exists.
    assert_eq!(build_moe_row_adapter_decode(&routes, 4), [1, -1, -1, -1]);
}

#[test]
fn decode_row_adapter_pads_with_minus_one() {
    let routes = [MoeLoraRoute::Fold { slot: 0 }, MoeLoraRoute::Fold { slot: 3 }];
    assert_eq!(build_moe_row_adapter_decode(&routes, 3), [0, 3, -1]);
    assert_eq!(build_moe_row_adapter_decode(&[], 2), [-1, -1]);
}

#[test]
fn prefill_row_adapter_spreads_each_sequence_over_its_rows() {
    assert_eq!(
        build_moe_row_adapter_host(&[0, 2, 2, 5], &[4, 1, -1]).unwrap(),
        [4, 4, -1, -1, -1]
    );
    assert_eq!(build_moe_row_adapter_host(&[0], &[]).unwrap(), Vec::<i32>::new());
    assert_eq!(
        build_moe_row_adapter_host(&[0, 2], &[1, 2]),
        Err(SeqLensError::Length { got: 2, batch: 2 })
    );
    assert_eq!(
        build_moe_row_adapter_host(&[1, 2], &[1]),
        Err(SeqLensError::NotPrefixSum { index: 0 })
    );
    assert_eq!(
        build_moe_row_adapter_host(&[0, 3, 2], &[1, 1]),
        Err(SeqLensError::NotPrefixSum { index: 2 })
    );
}

#[test]
fn workitems_skip_empty_and_out_of_table_experts() {
    // experts 0..4: rows [0,3) [3,3) [3,7) [7,8)
    let offsets = [0, 3, 3, 7, 8];
    let work = expert_delta_workitems(&offsets, &[0, 1, 2, 3, 4, 99]);
    assert_eq!(
        work,
        [
            ExpertWork {
                expert: 0,
                row_start: 0,
                rows: 3
            },
            ExpertWork {
                expert: 2,
                row_start: 3,
                rows: 4
            },
            ExpertWork {
                expert: 3,
                row_start: 7,
                rows: 1
            },
        ]
    );
    assert!(expert_delta_workitems(&offsets, &[usize::MAX]).is_empty());
    assert!(expert_delta_workitems(&[5, 2], &[0]).is_empty(), "end <= start");
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn workitems_cover_exactly_the_adapted_rows(counts in prop::collection::vec(0usize..6, 1..12),
                                                     mask in prop::collection::vec(any::<bool>(), 12)) {
            let mut offsets = vec![0usize];
            for c in &counts { offsets.push(offsets.last().unwrap() + c); }
            let adapted: Vec<usize> = (0..counts.len()).filter(|&e| mask[e]).collect();
            let work = expert_delta_workitems(&offsets, &adapted);
            let covered: usize = work.iter().map(|w| w.rows).sum();
            let expected: usize = adapted.iter().map(|&e| counts[e]).sum();
            prop_assert_eq!(covered, expected);
            for w in &work {
                prop_assert!(w.rows > 0);
                prop_assert_eq!(w.row_start, offsets[w.expert]);
                prop_assert_eq!(w.row_start + w.rows, offsets[w.expert + 1]);
            }
        }

        #[test]
        fn prefill_rows_follow_their_sequence(lens in prop::collection::vec(0usize..5, 0..8)) {
            let mut cu = vec![0usize];
            for l in &lens { cu.push(cu.last().unwrap() + l); }
            let slots: Vec<i32> = (0..lens.len() as i32).map(|b| b * 3 - 4).collect();
            let rows = build_moe_row_adapter_host(&cu, &slots).unwrap();
            prop_assert_eq!(rows.len(), *cu.last().unwrap());
            for (b, w) in cu.windows(2).enumerate() {
                prop_assert!(rows[w[0]..w[1]].iter().all(|&r| r == slots[b]));
            }
        }
    }
}
