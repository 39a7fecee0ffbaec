use proptest::prelude::*;

use super::*;

#[test]
fn sorts_expanded_rows_by_expert_stably() {
    // Tokens 0 and 1, top_k 2: token 0 -> experts 1, 0; token 1 -> 2, 1.
    let s = SortedRouting::from_topk(&[1, 0, 2, 1], 2, 3).unwrap();
    assert_eq!(s.expert_offsets, [0, 1, 3, 4]);
    assert_eq!(s.sorted_token, [1, 0, 3, 2]);
    assert_eq!(s.n_sorted(), 4);
    let items = s.work_items(&[2, 0, 1]);
    let blocks: Vec<(usize, usize, usize)> = items.iter().map(|w| (w.expert, w.row_start, w.rows)).collect();
    assert_eq!(blocks, [(2, 3, 1), (0, 0, 1), (1, 1, 2)]);
}

#[test]
fn an_expert_without_rows_has_no_work_item() {
    let s = SortedRouting::from_topk(&[0, 0, 2], 1, 4).unwrap();
    assert_eq!(s.expert_offsets, [0, 2, 2, 3, 3]);
    assert!(s.work_items(&[1, 3, 7]).is_empty());
}

#[test]
fn refuses_impossible_routing() {
    assert!(matches!(
        SortedRouting::from_topk(&[0, 4], 1, 4),
        Err(MoeError::Routing {
            arg: "topk_ids",
            position: 1,
            value: 4,
            ..
        })
    ));
    assert!(matches!(
        SortedRouting::from_topk(&[0, -1], 2, 4),
        Err(MoeError::Routing {
            position: 1,
            value: -1,
            ..
        })
    ));
    assert!(matches!(
        SortedRouting::from_topk(&[0, 1, 2], 2, 4),
        Err(MoeError::Shape { arg: "topk_ids", .. })
    ));
    assert!(SortedRouting::from_topk(&[], 0, 4).is_err());
    assert!(SortedRouting::from_topk(&[], 1, 0).is_err());
}

fn routing() -> impl Strategy<Value = (Vec<i32>, usize, usize)> {
    (1usize..5, 1usize..9, 0usize..24).prop_flat_map(|(top_k, experts, tokens)| {
        (
            proptest::collection::vec(0..experts as i32, tokens * top_k),
            Just(top_k),
            Just(experts),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The sort is a stable permutation of the expanded rows whose blocks
    /// hold exactly each expert's rows.
    #[test]
    fn sorted_blocks_hold_each_experts_rows_in_order((topk, top_k, experts) in routing()) {
        let s = SortedRouting::from_topk(&topk, top_k, experts).unwrap();
        let offsets = s.offsets();
        prop_assert_eq!(offsets.len(), experts + 1);
        prop_assert_eq!(offsets[0], 0);
        prop_assert_eq!(offsets[experts], topk.len());
        let mut seen = vec![false; topk.len()];
        for e in 0..experts {
            prop_assert!(offsets[e] <= offsets[e + 1]);
            let block = &s.sorted_token[offsets[e]..offsets[e + 1]];
            prop_assert!(block.windows(2).all(|w| w[0] < w[1]), "block of expert {} is not stable", e);
            for &row in block {
                prop_assert_eq!(topk[row as usize], e as i32);
                prop_assert!(!seen[row as usize]);
                seen[row as usize] = true;
            }
        }
        prop_assert!(seen.iter().all(|&s| s));
        let all: Vec<usize> = (0..experts).collect();
        let rows: usize = s.work_items(&all).iter().map(|w| w.rows).sum();
        prop_assert_eq!(rows, topk.len());
    }
}
