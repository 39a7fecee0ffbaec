//! SVG plots of a `cargo xtask bench` report (its JSON): time per op
//! against batch size and against distinct adapters, with the bytes floor
//! and the PyTorch baseline on the same axes, for decode and prefill, and
//! the whole decode step. `cargo xtask bench` writes them beside its JSON;
//! `cargo xtask plot REPORT.json [DIR]` redraws them from a saved report.
//!
//! A plot whose cases the report lacks (a run of other sections, `--only`)
//! is left out, never drawn empty.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

/// One measured case of the report, as a plot needs it.
#[derive(Debug, Clone)]
struct Case {
    kind: String,
    n: f64,
    distinct: f64,
    in_dim: u64,
    out_dim: u64,
    rank: u64,
    targets: u64,
    isolated_us: f64,
    graph_us: Option<f64>,
    floor_us: f64,
    torch_us: Option<f64>,
    torch_graph_us: Option<f64>,
}

/// The default-plan rows of a report (sweep variants left out).
fn cases(report: &Value) -> Vec<Case> {
    let Some(rows) = report["rows"].as_array() else {
        return Vec::new();
    };
    rows.iter()
        .filter(|r| r["variant"].as_str().is_none_or(|v| v == "default"))
        .filter_map(|r| {
            let s = &r["shape"];
            Some(Case {
                kind: s["kind"].as_str()?.to_string(),
                n: s["n"].as_f64()?,
                distinct: s["distinct"].as_f64().unwrap_or(0.0),
                in_dim: s["in"].as_u64().unwrap_or(0),
                out_dim: s["out"].as_u64().unwrap_or(0),
                rank: s["r"].as_u64().unwrap_or(0),
                targets: s["targets"].as_u64().unwrap_or(1),
                isolated_us: r["median_us"].as_f64()?,
                graph_us: r["in_graph"]["median_us"].as_f64(),
                floor_us: r["floor_us"].as_f64()?,
                torch_us: r["torch_us"].as_f64(),
                torch_graph_us: r["torch_in_graph_us"].as_f64(),
            })
        })
        .collect()
}

/// A named series of (x, µs) points.
type Series = (&'static str, RGBColor, Vec<(f64, f64)>);

/// The series of `cases` against `x`: ours (isolated, in a graph), the
/// floor, PyTorch (isolated, in a graph); empty series dropped.
fn series_of(cases: &[&Case], x: impl Fn(&Case) -> f64) -> Vec<Series> {
    let pts = |f: &dyn Fn(&Case) -> Option<f64>| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = cases.iter().filter_map(|c| Some((x(c), f(c)?))).collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let all: Vec<Series> = vec![
        ("ours, in a graph", RGBColor(200, 30, 30), pts(&|c| c.graph_us)),
        ("ours, isolated", RGBColor(240, 140, 40), pts(&|c| Some(c.isolated_us))),
        ("bytes floor", RGBColor(40, 40, 40), pts(&|c| Some(c.floor_us))),
        ("PyTorch, in a graph", RGBColor(30, 80, 200), pts(&|c| c.torch_graph_us)),
        ("PyTorch, isolated", RGBColor(90, 160, 230), pts(&|c| c.torch_us)),
    ];
    all.into_iter().filter(|(_, _, p)| !p.is_empty()).collect()
}

/// One log-log line plot as SVG text.
fn draw(title: &str, x_desc: &str, series: &[Series]) -> Result<String, String> {
    draw_with(
        title,
        x_desc,
        "µs per op (median)",
        SeriesLabelPosition::UpperLeft,
        series,
    )
}

/// [`draw`] with the y axis' words and the legend's place.
fn draw_with(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    legend: SeriesLabelPosition,
    series: &[Series],
) -> Result<String, String> {
    let points = series.iter().flat_map(|(_, _, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !(x0.is_finite() && y0.is_finite() && x0 > 0.0 && y0 > 0.0) {
        return Err(format!("{title}: no positive points"));
    }
    let mut svg = String::new();
    {
        let e = |e: &dyn std::fmt::Display| format!("{title}: {e}");
        let root = SVGBackend::with_string(&mut svg, (860, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d((x0 / 1.3..x1 * 1.3).log_scale(), (y0 / 1.5..y1 * 1.5).log_scale())
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(|x| e(&x))?;
        for (label, color, pts) in series {
            let color = *color;
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|x| e(&x))?
                .label(*label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|x| e(&x))?;
        }
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
        root.present().map_err(|x| e(&x))?;
    }
    Ok(svg)
}

/// Every plot the report has the cases for: file name and SVG text.
pub fn plots(report: &Value) -> Result<Vec<(String, String)>, String> {
    let device = report["device"].as_str().unwrap_or("unknown device");
    let all = cases(report);
    let mut out = Vec::new();
    // Decode against batch size: 4096 x 4096, rank 16, one target, every row its own adapter.
    let by_rows: Vec<&Case> = all
        .iter()
        .filter(|c| c.kind == "decode" && (c.in_dim, c.out_dim, c.rank, c.targets) == (4096, 4096, 16, 1))
        .filter(|c| c.distinct == c.n)
        .collect();
    if by_rows.len() >= 2 {
        let title = format!("decode, 4096 x 4096, rank 16, one adapter per row ({device})");
        out.push((
            "decode_rows.svg".to_string(),
            draw(&title, "rows in the batch (n)", &series_of(&by_rows, |c| c.n))?,
        ));
    }
    // Decode against distinct adapters: 64 rows of 4096 x 4096 at rank 16.
    let by_adapters: Vec<&Case> = all
        .iter()
        .filter(|c| c.kind == "decode" && (c.in_dim, c.out_dim, c.rank, c.targets) == (4096, 4096, 16, 1))
        .filter(|c| c.n == 64.0)
        .collect();
    if by_adapters.len() >= 2 {
        let title = format!("decode, 64 rows, 4096 x 4096, rank 16 ({device})");
        out.push((
            "decode_adapters.svg".to_string(),
            draw(
                &title,
                "distinct adapters in the batch",
                &series_of(&by_adapters, |c| c.distinct),
            )?,
        ));
    }
    // Prefill against rows.
    let prefill: Vec<&Case> = all.iter().filter(|c| c.kind == "prefill").collect();
    if !prefill.is_empty() {
        let title = format!("prefill, 4096 x 4096 (rank 16 and 64) ({device})");
        out.push((
            "prefill.svg".to_string(),
            draw(&title, "rows (tokens) in the batch", &series_of(&prefill, |c| c.n))?,
        ));
    }
    // The whole decode step against its rows.
    if let Some(steps) = report["steps"].as_array().filter(|s| s.len() >= 2) {
        let pts = |overlap: bool, f: &dyn Fn(&Value) -> Option<f64>| -> Vec<(f64, f64)> {
            let mut v: Vec<(f64, f64)> = steps
                .iter()
                .filter(|s| s["overlap"].as_bool().unwrap_or(false) == overlap)
                .filter_map(|s| Some((s["n"].as_f64()?, f(s)?)))
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v
        };
        let series: Vec<Series> = vec![
            (
                "LoRA, the engine's applies (overlap promise)",
                RGBColor(200, 30, 30),
                pts(true, &|s| s["median_us"].as_f64()),
            ),
            (
                "LoRA, plain applies",
                RGBColor(240, 140, 40),
                pts(false, &|s| s["median_us"].as_f64()),
            ),
            (
                "bytes floor",
                RGBColor(40, 40, 40),
                pts(false, &|s| s["floor_us"].as_f64()),
            ),
            (
                "base projections (cuBLAS)",
                RGBColor(30, 80, 200),
                pts(false, &|s| s["base_us"].as_f64()),
            ),
        ]
        .into_iter()
        .filter(|(_, _, p)| !p.is_empty())
        .collect();
        let title = format!("Llama-3.1-8B decode step, 32 layers, rank 16 ({device})");
        out.push((
            "decode_step.svg".to_string(),
            draw_with(
                &title,
                "rows of distinct adapters (n)",
                "µs per step (median)",
                SeriesLabelPosition::LowerRight,
                &series,
            )?,
        ));
    }
    Ok(out)
}

/// Write every plot of `report` into `dir`; the files written.
pub fn write_plots(report: &Value, dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    plots(report)?
        .into_iter()
        .map(|(name, svg)| {
            let path = dir.join(name);
            std::fs::write(&path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            Ok(path)
        })
        .collect()
}

/// `cargo xtask plot REPORT.json [DIR]`: redraw a saved report's plots
/// (into DIR, by default the report's folder).
pub fn run(args: &[String]) -> Result<(), String> {
    let (report, dir) = match args {
        [report] => (PathBuf::from(report), None),
        [report, dir] => (PathBuf::from(report), Some(PathBuf::from(dir))),
        _ => return Err("usage: cargo xtask plot REPORT.json [DIR]".into()),
    };
    let text = std::fs::read_to_string(&report).map_err(|e| format!("{}: {e}", report.display()))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", report.display()))?;
    let dir = dir.unwrap_or_else(|| report.parent().map(Path::to_path_buf).unwrap_or_default());
    for path in write_plots(&value, &dir)? {
        eprintln!("plot: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(kind: &str, n: u64, distinct: u64, us: f64, variant: &str) -> Value {
        json!({
            "variant": variant,
            "shape": {"kind": kind, "n": n, "distinct": distinct, "in": 4096, "out": 4096, "r": 16, "targets": 1},
            "median_us": us, "floor_us": us / 3.0, "torch_us": us * 4.0,
            "in_graph": {"median_us": us / 2.0}, "torch_in_graph_us": null,
        })
    }

    #[test]
    fn a_report_draws_each_plot_it_has_cases_for() {
        let report = json!({
            "device": "test card",
            "rows": [
                row("decode", 1, 1, 8.0, "default"), row("decode", 16, 16, 9.0, "default"),
                row("decode", 64, 64, 11.0, "default"), row("decode", 64, 8, 7.0, "default"),
                row("decode", 64, 64, 99.0, "rows (overlap)"),
                row("prefill", 4096, 8, 34.0, "default"), row("prefill", 8192, 32, 80.0, "default"),
            ],
            "steps": [
                {"n": 1, "overlap": false, "median_us": 700.0, "floor_us": 21.0, "base_us": 3700.0},
                {"n": 64, "overlap": false, "median_us": 2900.0, "floor_us": 1900.0, "base_us": 4000.0},
                {"n": 1, "overlap": true, "median_us": 420.0, "floor_us": 21.0},
                {"n": 64, "overlap": true, "median_us": 2770.0, "floor_us": 1900.0},
            ],
        });
        let plots = plots(&report).expect("plots");
        let names: Vec<&str> = plots.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "decode_rows.svg",
                "decode_adapters.svg",
                "prefill.svg",
                "decode_step.svg"
            ]
        );
        for (name, svg) in &plots {
            assert!(svg.starts_with("<svg") && svg.contains("bytes floor"), "{name}");
            assert!(svg.contains("test card"), "{name}");
        }
        // Sweep variants are not the default plan: never drawn.
        assert!(cases(&report).iter().all(|c| c.isolated_us != 99.0));
    }

    #[test]
    fn a_report_without_the_cases_draws_nothing() {
        assert!(plots(&json!({"rows": [], "steps": []})).expect("plots").is_empty());
        assert!(plots(&json!({"io": []})).expect("plots").is_empty());
    }
}
