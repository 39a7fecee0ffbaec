use super::*;

/// The recorded grid: batch sizes, table sizes and target geometries of
/// every model family the workspace serves, on the two recorded devices.
fn grid() -> Vec<(String, DecodeCall)> {
    let rows = [1, 2, 7, 16, 31, 32, 48, 64, 65, 96, 128, 129, 256, 512, 513, 1024, 2048];
    let entries = [1, 8, 32, 64];
    // (label, in, outs, rank stride, y)
    let geometries: [(&str, usize, &[usize], usize, OutputKind); 11] = [
        ("o", 4096, &[4096], 16, OutputKind::Bf16),
        ("o r64", 4096, &[4096], 64, OutputKind::Bf16),
        ("o r128", 4096, &[4096], 128, OutputKind::Bf16),
        ("o r8", 4096, &[4096], 8, OutputKind::Bf16),
        ("up", 4096, &[14336], 16, OutputKind::Bf16),
        ("qkv", 4096, &[4096, 1024, 1024], 16, OutputKind::Bf16),
        ("gate_up", 4096, &[14336, 14336], 16, OutputKind::Bf16),
        ("down", 14336, &[4096], 16, OutputKind::Bf16),
        ("small r32", 2048, &[2048], 32, OutputKind::Bf16),
        ("router", 5120, &[64], 16, OutputKind::F32),
        ("odd", 4100, &[4100], 16, OutputKind::Bf16),
    ];
    let mut out = Vec::new();
    for (label, in_dim, outs, stride, y) in geometries {
        for &e in &entries {
            let mut col = 0;
            let targets: Vec<CallTarget> = outs
                .iter()
                .map(|&out_dim| {
                    let t = CallTarget {
                        out_dim,
                        y_col_offset: col,
                        n_entries: e,
                    };
                    col += out_dim;
                    t
                })
                .collect();
            for &n in &rows {
                let call = DecodeCall::dense(n, in_dim, stride, y, &targets).expect("a valid call");
                out.push((format!("{label} n{n} e{e}"), call));
            }
        }
    }
    out
}

fn contexts(limits: &DeviceLimits) -> Vec<(&'static str, DecodeContext)> {
    let plain = DecodeContext::default();
    let mut all = vec![
        ("unknown", plain),
        (
            "overlap",
            DecodeContext {
                overlap_previous: true,
                ..plain
            },
        ),
    ];
    if limits.hopper() {
        all.push((
            "root",
            DecodeContext {
                predecessor: Predecessor::NoKernel,
                ..plain
            },
        ));
    }
    all
}

fn table(decide: impl Fn(&DecodeCall, &DeviceLimits, DecodeContext) -> Result<DecodePlan, KernelError>) -> String {
    let mut text = String::new();
    for (device, limits) in [("h200", DeviceLimits::H200), ("sm80", DeviceLimits::SM80)] {
        for (ctx_label, ctx) in contexts(&limits) {
            for (label, call) in grid() {
                let decision = match decide(&call, &limits, ctx) {
                    Ok(plan) => plan.to_string(),
                    Err(e) => format!("refused: {e}"),
                };
                text += &format!("{device} {ctx_label} {label}: {decision}\n");
            }
        }
    }
    text
}

/// Every decision of the rule table, recorded: a changed line is a changed launch.
#[test]
fn the_decisions_are_the_recorded_ones() {
    let text = table(|call, limits, ctx| {
        let tuning = super::super::BgmvTuning {
            overlap_previous: Some(ctx.overlap_previous),
            ..Default::default()
        };
        legacy(call, limits, ctx, tuning)
    });
    crate::ops::golden::check("src/ops/bgmv/plan.golden", &text);
}
