//! Plots for the reports (plotters): SVG inline in the HTML report, PNG for the model card. Text is drawn
//! with a bundled font (DejaVu Sans Mono, `fonts/LICENSE-DejaVu`) so plots look the same on every machine
//! and need no system fonts.

use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::ReportError;

static FONT: &[u8] = include_bytes!("fonts/DejaVuSansMono.ttf");
const FAMILY: &str = "sans-serif";
const BAR: RGBColor = RGBColor(70, 110, 170);
const MARK: RGBColor = RGBColor(200, 80, 40);

fn plot_err(name: &str) -> impl Fn(&dyn std::fmt::Display) -> ReportError + '_ {
    move |e| ReportError::Plot { name: name.to_string(), message: e.to_string() }
}

pub(crate) fn ensure_font() -> Result<(), ReportError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        [FontStyle::Normal, FontStyle::Bold]
            .into_iter()
            .all(|style| plotters::style::register_font(FAMILY, style, FONT).is_ok())
    });
    if ok {
        Ok(())
    } else {
        Err(ReportError::Plot { name: "font".into(), message: "bundled font did not load".into() })
    }
}

/// One histogram bar: values in `lo..hi` (integers), and how many there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bin {
    pub lo: u64,
    pub hi: u64,
    pub count: u64,
}

/// At most `max_bins` equal-width integer bins from the smallest to the largest value.
pub fn bins(values: &[u32], max_bins: usize) -> Vec<Bin> {
    let (Some(&min), Some(&max)) = (values.iter().min(), values.iter().max()) else { return Vec::new() };
    let (min, max) = (u64::from(min), u64::from(max));
    let width = (max - min + 1).div_ceil(max_bins.max(1) as u64).max(1);
    let n = ((max - min) / width + 1) as usize;
    let mut out: Vec<Bin> =
        (0..n as u64).map(|i| Bin { lo: min + i * width, hi: min + (i + 1) * width, count: 0 }).collect();
    for &v in values {
        out[((u64::from(v) - min) / width) as usize].count += 1;
    }
    out
}

/// A histogram as an SVG document, with vertical markers (p50, p95, …) drawn over it.
pub fn histogram_svg(
    title: &str,
    x_label: &str,
    values: &[u32],
    markers: &[(&str, u64)],
) -> Result<String, ReportError> {
    ensure_font()?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 280)).into_drawing_area();
        draw_histogram(&root, title, x_label, &bins(values, 40), markers).map_err(|e| plot_err(title)(&e))?;
    }
    Ok(svg)
}

fn draw_histogram<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    bins: &[Bin],
    markers: &[(&str, u64)],
) -> Result<(), Box<dyn std::error::Error + 'static>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let x0 = bins.first().map_or(0, |b| b.lo) as f64;
    let x1 = bins.last().map_or(1, |b| b.hi) as f64;
    let top = bins.iter().map(|b| b.count).max().unwrap_or(1).max(1) as f64 * 1.1;
    // Narrow integer ranges (command units per turn) get one label per integer and none between.
    let span = x1 - x0;
    let x_labels = if span <= 12.0 { span as usize + 1 } else { 10 };
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FAMILY, 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(x_label)
        .y_desc("count")
        .x_labels(x_labels)
        .x_label_formatter(&|x| if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style((FAMILY, 12))
        .axis_desc_style((FAMILY, 13))
        .draw()?;
    chart.draw_series(
        bins.iter().map(|b| Rectangle::new([(b.lo as f64, 0.0), (b.hi as f64, b.count as f64)], BAR.filled())),
    )?;
    for (name, x) in markers {
        let x = *x as f64 + 0.5;
        chart.draw_series(LineSeries::new([(x, 0.0), (x, top)], MARK.stroke_width(2)))?;
        chart.draw_series(std::iter::once(Text::new(
            format!("{name}={}", x.floor()),
            (x, top * 0.95),
            (FAMILY, 12),
        )))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_cover_every_value_once() {
        let values: Vec<u32> = (0..1000).map(|i| (i * 37) % 501).collect();
        let b = bins(&values, 40);
        assert!(b.len() <= 40);
        assert_eq!(b.iter().map(|b| b.count).sum::<u64>(), 1000);
        assert_eq!(b[0].lo, 0);
        assert!(b.last().unwrap().hi > 500);
        assert_eq!(bins(&[5, 5, 5], 10), [Bin { lo: 5, hi: 6, count: 3 }]);
        assert!(bins(&[], 10).is_empty());
    }

    #[test]
    fn histogram_is_an_svg_document() {
        let svg = histogram_svg("tokens per sample", "tokens", &[10, 20, 20, 30, 400], &[("p50", 20)]).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        assert!(svg.contains("tokens per sample") && svg.contains("p50=20"));
        assert!(doc.descendants().filter(|n| n.has_tag_name("rect")).count() >= 3);
    }
}
