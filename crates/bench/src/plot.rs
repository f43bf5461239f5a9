//! PNG charts of a run: the propagation latency distribution per cluster
//! size (as a CDF) and the acknowledged writes per 100 ms of the
//! throughput run.
//!
//! Drawn with plotters' bitmap backend. Text uses a font embedded at build
//! time (Hack, from `epaint_default_fonts`), so no system fonts, fontconfig
//! or freetype are needed.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

const FONT: &str = "sans-serif";
const SIZE: (u32, u32) = (960, 560);
/// Line colours that stay readable on white.
const COLORS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::HACK_REGULAR)
            .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded chart font could not be parsed"))
    }
}

/// Writes a CDF of every latency sample per cluster size to `path`.
pub fn latency_cdf(path: &Path, series: &[(usize, Vec<f64>)]) -> Result<()> {
    ensure_font()?;
    let x_max = series
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .fold(1.0_f64, f64::max)
        * 1.05;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Propagation latency: one write on node 0, seen by all others",
            (FONT, 20),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("latency (ms)")
        .y_desc("fraction of writes")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    for (idx, (n, samples)) in series.iter().enumerate() {
        let mut s = samples.clone();
        s.sort_by(f64::total_cmp);
        let len = s.len().max(1) as f64;
        // A step function: the fraction rises at each observed latency.
        let mut points = vec![(0.0, 0.0)];
        for (i, x) in s.iter().enumerate() {
            points.push((*x, i as f64 / len));
            points.push((*x, (i + 1) as f64 / len));
        }
        let color = COLORS[idx % COLORS.len()].to_rgba();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(format!("N = {n} ({} samples)", s.len()))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Writes acknowledged writes per 100 ms (`counts[i]` in the i-th 100 ms
/// since the first request) to `path`, with a line where all nodes had
/// converged.
pub fn throughput(path: &Path, counts: &[u32], converged_ms: f64) -> Result<()> {
    ensure_font()?;
    let buckets = counts.len().max(1);
    let total: u32 = counts.iter().sum();
    let y_max = f64::from(counts.iter().copied().max().unwrap_or(1).max(1)) * 1.15;
    let x_max = (buckets as f64 * 0.1).max(converged_ms / 1e3 + 0.1);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Throughput: {total} writes on node 0, 3 nodes"),
            (FONT, 20),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("time since the first request (s)")
        .y_desc("acknowledged writes per 100 ms")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    let bar = BLUE.mix(0.6).filled();
    chart
        .draw_series(counts.iter().enumerate().map(|(i, c)| {
            let x0 = i as f64 * 0.1;
            Rectangle::new([(x0, 0.0), (x0 + 0.1, f64::from(*c))], bar)
        }))?
        .label("acknowledged writes")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], bar));
    let conv_s = converged_ms / 1e3;
    chart
        .draw_series(LineSeries::new(
            vec![(conv_s, 0.0), (conv_s, y_max)],
            RED.stroke_width(2),
        ))?
        .label(format!("all nodes converged ({:.2} s)", conv_s))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], RED.stroke_width(2)));
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Idle anti-entropy bytes per peer per round against the number of
/// containers, both axes logarithmic. `series` is (tool, points).
pub fn containers(path: &Path, series: &[(String, Vec<(f64, f64)>)]) -> Result<()> {
    ensure_font()?;
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let x_max = pts.clone().map(|p| p.0).fold(10.0, f64::max) * 2.0;
    let y_max = pts.map(|p| p.1).fold(1024.0, f64::max) * 4.0;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Idle anti-entropy against the number of containers",
            (FONT, 20),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d((1.0..x_max).log_scale(), (10.0..y_max).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("containers held by both devices")
        .y_desc("bytes per peer per round")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    chart
        .draw_series(LineSeries::new(
            vec![(1.0, 1024.0), (x_max, 1024.0)],
            BLACK.mix(0.5).stroke_width(1),
        ))?
        .label("target: 1 KB at 10,000 containers")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.mix(0.5)));
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: both charts render to valid PNG files with the embedded font;
    // method: draw small synthetic data into a temp dir and check the
    // PNG signature.
    #[test]
    fn charts_render_png() {
        let dir = tempfile::tempdir().unwrap();
        let lat = dir.path().join("latency.png");
        let thr = dir.path().join("throughput.png");
        latency_cdf(&lat, &[(3, vec![1.0, 2.0, 5.0]), (5, vec![2.0, 3.0, 9.0])]).unwrap();
        throughput(&thr, &[2, 2, 1], 300.0).unwrap();
        let ct = dir.path().join("containers.png");
        containers(
            &ct,
            &[(
                "nuwa-node".into(),
                vec![(10.0, 163.0), (1000.0, 164.0), (10000.0, 164.0)],
            )],
        )
        .unwrap();
        for p in [lat, thr, ct] {
            let bytes = std::fs::read(&p).unwrap();
            assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{}", p.display());
        }
    }
}
