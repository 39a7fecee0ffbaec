use super::*;
use proptest::prelude::*;

fn host(shape: [usize; 2], f: impl Fn(usize) -> f32) -> HostTensor {
    HostTensor {
        shape: shape.to_vec(),
        data: (0..shape[0] * shape[1]).map(|i| bf16::from_f32(f(i))).collect(),
    }
}

/// PEFT's `get_delta_weight` of a fused `ParamWrapper`, written out:
/// `A.reshape(E, r, in)`, `B.reshape(out, r, E)`, `dW[e] = B[:, :, e] @ A[e]`.
fn peft_delta(a: &HostTensor, b: &HostTensor, e_count: usize, e: usize) -> Vec<f32> {
    let (rows, inp) = (a.shape[0], a.shape[1]);
    let out = b.shape[0];
    let r = rows / e_count;
    let a_at = |e: usize, k: usize, i: usize| a.data[(e * r + k) * inp + i].to_f32();
    let b_at = |o: usize, k: usize, e: usize| b.data[o * rows + k * e_count + e].to_f32();
    let mut dw = vec![0.0f32; out * inp];
    for o in 0..out {
        for i in 0..inp {
            dw[o * inp + i] = (0..r).map(|k| b_at(o, k, e) * a_at(e, k, i)).sum();
        }
    }
    dw
}

fn product(a: &[bf16], b: &[bf16], r: usize, out: usize, inp: usize) -> Vec<f32> {
    let mut dw = vec![0.0f32; out * inp];
    for o in 0..out {
        for i in 0..inp {
            dw[o * inp + i] = (0..r).map(|k| b[o * r + k].to_f32() * a[k * inp + i].to_f32()).sum();
        }
    }
    dw
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn split_pairs_reproduce_peft_fused_deltas(e_count in 1usize..5, r in 1usize..4, inp in 1usize..6, half in 1usize..4) {
        let out = 2 * half;
        let a = host([e_count * r, inp], |i| (i as f32 * 0.37).sin());
        let b = host([out, e_count * r], |i| (i as f32 * 0.11).cos());
        for e in 0..e_count {
            let full = peft_delta(&a, &b, e_count, e);
            for rows in [0..half, half..out] {
                let (ae, be) = split_fused(&a, &b, e_count, e, rows.clone()).unwrap();
                prop_assert_eq!(ae.len(), r * inp);
                prop_assert_eq!(be.len(), rows.len() * r);
                let got = product(&ae, &be, r, rows.len(), inp);
                prop_assert_eq!(&got[..], &full[rows.start * inp..rows.end * inp]);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// gpt_oss: gate output j is fused row 2j, up output j row 2j + 1; the
    /// interleaved slices reproduce those rows of PEFT's delta.
    #[test]
    fn interleaved_slices_reproduce_peft_fused_deltas(e_count in 1usize..5, r in 1usize..4, inp in 1usize..6, inter in 1usize..4) {
        let out = 2 * inter;
        let a = host([e_count * r, inp], |i| (i as f32 * 0.37).sin());
        let b = host([out, e_count * r], |i| (i as f32 * 0.11).cos());
        for e in 0..e_count {
            let full = peft_delta(&a, &b, e_count, e);
            for first_row in [0, 1] {
                let slice = ExpertSlice::FusedInterleaved { num_experts: e_count, first_row, rows: inter };
                let rows = slice.out_rows();
                let (ae, be) = split_fused_rows(&a, &b, e_count, e, &rows).unwrap();
                let got = product(&ae, &be, r, inter, inp);
                for (j, &row) in rows.iter().enumerate() {
                    prop_assert_eq!(row, 2 * j + first_row);
                    prop_assert_eq!(&got[j * inp..(j + 1) * inp], &full[row * inp..(row + 1) * inp]);
                }
            }
        }
    }
}

#[test]
fn split_refuses_impossible_cuts() {
    let a = host([4, 3], |_| 1.0);
    let b = host([6, 4], |_| 1.0);
    assert!(split_fused(&a, &b, 2, 1, 0..6).is_ok());
    assert!(split_fused(&a, &b, 3, 0, 0..6).is_err(), "4 rows are not 3 experts");
    assert!(split_fused(&a, &b, 2, 2, 0..6).is_err(), "expert out of range");
    assert!(split_fused(&a, &b, 2, 0, 0..7).is_err(), "rows out of range");
    assert!(
        split_fused(&a, &host([6, 3], |_| 1.0), 2, 0, 0..6).is_err(),
        "ranks disagree"
    );
}
