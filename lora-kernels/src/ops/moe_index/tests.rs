use super::*;
use crate::testing::Rng;

/// The owning expert by a plain linear scan (independent of the binary search).
fn expert_by_scan(offsets: &[i32], i: usize) -> Option<usize> {
    (0..offsets.len() - 1).find(|&e| offsets[e] as i64 <= i as i64 && (i as i64) < offsets[e + 1] as i64)
}

#[test]
fn decode_index_follows_the_formula() {
    let d = Device::cpu();
    let mut rng = Rng::new(41);
    let routing = MoeRouting {
        top_k: 3,
        max_loras: 5,
        n_experts: 7,
    };
    let n_tokens = 20;
    let ra: Vec<i32> = (0..n_tokens)
        .map(|i| if i % 4 == 0 { -1 } else { rng.below(5) as i32 })
        .collect();
    let ids: Vec<i32> = (0..n_tokens * 3).map(|_| rng.below(7) as i32).collect();
    let (ra_d, ids_d) = (d.upload(&ra).unwrap(), d.upload(&ids).unwrap());
    let mut idx = d.upload(&vec![i32::MIN; n_tokens * 3]).unwrap();
    moe_decode_index(&d, &ra_d, &ids_d, n_tokens, routing, &mut idx).unwrap();
    let got = idx.download().unwrap();
    for r in 0..n_tokens * 3 {
        let a = ra[r / 3];
        let want = if a < 0 { -1 } else { ids[r] * 5 + a };
        assert_eq!(got[r], want, "row {r}");
    }
}

#[test]
fn decode_index_refuses_bad_adapters_and_experts() {
    let d = Device::cpu();
    let routing = MoeRouting {
        top_k: 2,
        max_loras: 2,
        n_experts: 4,
    };
    let ids = d.upload(&[0i32, 1, 2, 3]).unwrap();
    let mut idx = d.alloc_zeros::<i32>(4).unwrap();
    let ra = d.upload(&[0i32, 2]).unwrap();
    assert!(matches!(
        moe_decode_index(&d, &ra, &ids, 2, routing, &mut idx),
        Err(KernelError::BadIndex { .. })
    ));
    let ra = d.upload(&[0i32, 1]).unwrap();
    let bad_ids = d.upload(&[0i32, 1, 4, 3]).unwrap();
    assert!(moe_decode_index(&d, &ra, &bad_ids, 2, routing, &mut idx).is_err());
    assert!(
        moe_decode_index(&d, &ra, &ids, 3, routing, &mut idx).is_err(),
        "too few ids"
    );
    assert!(moe_decode_index(&d, &ra, &ids, 2, MoeRouting { top_k: 0, ..routing }, &mut idx).is_err());
}

#[test]
fn sorted_index_combines_owning_expert_and_token_adapter() {
    let d = Device::cpu();
    let mut rng = Rng::new(42);
    let routing = MoeRouting {
        top_k: 2,
        max_loras: 3,
        n_experts: 6,
    };
    let n_tokens = 15;
    let ra: Vec<i32> = (0..n_tokens)
        .map(|i| if i % 5 == 0 { -1 } else { rng.below(3) as i32 })
        .collect();
    let topk: Vec<i32> = (0..n_tokens * 2).map(|_| rng.below(6) as i32).collect();
    let mut sorted = Vec::new();
    let mut offsets = vec![0i32];
    for e in 0..6 {
        sorted.extend(topk.iter().enumerate().filter(|(_, x)| **x == e).map(|(r, _)| r as i32));
        sorted.push(-1); // padding row inside the expert's block
        offsets.push(sorted.len() as i32);
    }
    sorted.extend([(n_tokens * 2) as i32, 0]); // rows past the last expert
    let st = d.upload(&sorted).unwrap();
    let off = d.upload(&offsets).unwrap();
    let ra_d = d.upload(&ra).unwrap();
    let mut idx = d.upload(&vec![i32::MIN; sorted.len()]).unwrap();
    moe_sorted_index(&d, &st, sorted.len(), &off, &ra_d, n_tokens, routing, &mut idx).unwrap();
    let got = idx.download().unwrap();
    for (i, &src) in sorted.iter().enumerate() {
        let want = match expert_by_scan(&offsets, i) {
            Some(e) if src >= 0 && (src as usize) < n_tokens * 2 => {
                let a = ra[src as usize / 2];
                if a < 0 { -1 } else { e as i32 * 3 + a }
            }
            _ => -1,
        };
        assert_eq!(got[i], want, "sorted row {i}");
    }
}

#[test]
fn binary_search_agrees_with_a_scan_on_any_offsets() {
    let mut rng = Rng::new(43);
    for _ in 0..200 {
        let n_experts = 1 + rng.below(9);
        let mut off: Vec<i32> = (0..=n_experts).map(|_| rng.below(30) as i32).collect();
        if rng.below(2) == 0 {
            off.sort_unstable();
        }
        for i in 0..35 {
            if off.windows(2).all(|w| w[0] <= w[1]) {
                assert_eq!(
                    owning_expert(&off, n_experts, i as i64),
                    expert_by_scan(&off, i),
                    "{off:?} row {i}"
                );
            }
        }
    }
}
