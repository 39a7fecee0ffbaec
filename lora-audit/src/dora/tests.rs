use super::*;

fn bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|x| bf16::from_f32(*x)).collect()
}

#[test]
fn magnitude_keys_name_their_module() {
    let key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
    assert_eq!(
        magnitude_module(key),
        Some("base_model.model.model.layers.0.self_attn.q_proj")
    );
    assert_eq!(
        magnitude_module("x.q_proj.lora_magnitude_vector.weight"),
        Some("x.q_proj")
    );
    assert_eq!(magnitude_module("x.q_proj.lora_A.weight"), None);
}

#[test]
fn row_scale_is_the_magnitude_over_the_adapted_row_norm() {
    // out 2, in 3, rank 1: W + s·B A by hand.
    let w = [1.0f32, 0.0, 2.0, -1.0, 3.0, 0.5];
    let a = bf(&[0.5, -1.0, 0.25]);
    let b = bf(&[2.0, -0.5]);
    let s = 0.75f32;
    let m = [1.5f32, 2.0];
    let g = row_scale(
        &m,
        &w,
        &a,
        &b,
        DoraShape {
            out: 2,
            inp: 3,
            rank: 1,
        },
        s,
    )
    .unwrap();
    for o in 0..2 {
        let bo = b[o].to_f32() as f64;
        let norm: f64 = (0..3)
            .map(|i| {
                let v = w[o * 3 + i] as f64 + s as f64 * bo * a[i].to_f32() as f64;
                v * v
            })
            .sum::<f64>()
            .sqrt();
        let want = m[o] as f64 / norm;
        assert!(
            (g[o] as f64 - want).abs() <= 1e-6 * want.abs(),
            "{o}: {} vs {want}",
            g[o]
        );
    }
}

#[test]
fn bad_lengths_and_zero_norms_are_errors() {
    let shape = DoraShape {
        out: 1,
        inp: 2,
        rank: 1,
    };
    let (a, b) = (bf(&[0.0, 0.0]), bf(&[0.0]));
    let err = row_scale(&[1.0], &[1.0], &a, &b, shape, 1.0).unwrap_err();
    assert!(
        matches!(
            err,
            DoraError::Length {
                what: "the base weight",
                ..
            }
        ),
        "{err}"
    );
    let err = row_scale(&[1.0], &[0.0, 0.0], &a, &b, shape, 1.0).unwrap_err();
    assert!(matches!(err, DoraError::NonFinite { row: 0, .. }), "{err}");
}

#[test]
fn the_rescale_keeps_the_bias_outside() {
    // y = Wx + b + delta = 3 + 1; g·(y − b) + b = 2·3 + 1.
    assert_eq!(rescale(4.0, 2.0, 1.0), 7.0);
    assert_eq!(rescale(4.0, 1.0, 0.0), 4.0);
}
