//! Minimal line charts written as PNG: enough for `usher sim --plot` and
//! `usher demo --plot` to draw capacity, wants and has over time, with
//! axes, tick labels and a legend. The PNG is written uncompressed (stored
//! deflate blocks), so no image or compression library is needed.

use std::io::Write;

/// One line of a chart.
pub struct Series {
    pub name: String,
    pub rgb: [u8; 3],
    pub points: Vec<(f64, f64)>,
}

const W: usize = 900;
const H: usize = 440;
const LEFT: usize = 70;
const RIGHT: usize = 20;
const TOP: usize = 50;
const BOTTOM: usize = 50;

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Canvas { px: vec![255; W * H * 3] }
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            let i = (y as usize * W + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: [u8; 3], thick: bool) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.set(x, y, c);
            if thick {
                self.set(x, y + 1, c);
                self.set(x + 1, y, c);
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Draws `text` with a 3×5 pixel font scaled by 2, top-left at (x, y).
    fn text(&mut self, x: i64, y: i64, text: &str, c: [u8; 3]) {
        for (i, ch) in text.chars().enumerate() {
            let rows = glyph(ch);
            for (r, bits) in rows.iter().enumerate() {
                for col in 0..3 {
                    if bits & (0b100 >> col) != 0 {
                        for (ox, oy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                            self.set(x + (i as i64) * 8 + col * 2 + ox, y + r as i64 * 2 + oy, c);
                        }
                    }
                }
            }
        }
    }
}

fn glyph(c: char) -> [u8; 5] {
    match c {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 2, 2],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        '/' => [1, 1, 2, 4, 4],
        '(' => [2, 4, 4, 4, 2],
        ')' => [2, 1, 1, 1, 2],
        ':' => [0, 2, 0, 2, 0],
        'a' => [0, 7, 1, 7, 7],
        'c' => [0, 7, 4, 4, 7],
        'd' => [1, 7, 5, 5, 7],
        'e' => [0, 7, 7, 4, 7],
        'h' => [4, 4, 7, 5, 5],
        'i' => [2, 0, 2, 2, 2],
        'l' => [6, 2, 2, 2, 7],
        'm' => [0, 7, 7, 5, 5],
        'n' => [0, 6, 5, 5, 5],
        'o' => [0, 7, 5, 5, 7],
        'p' => [0, 7, 5, 7, 4],
        'r' => [0, 7, 4, 4, 4],
        's' => [0, 7, 6, 3, 7],
        't' => [2, 7, 2, 2, 3],
        'u' => [0, 5, 5, 5, 7],
        'w' => [0, 5, 5, 7, 7],
        'y' => [0, 5, 7, 1, 7],
        'b' => [4, 7, 5, 5, 7],
        'f' => [3, 2, 7, 2, 2],
        'g' => [0, 7, 5, 7, 3],
        'k' => [4, 5, 6, 5, 5],
        'v' => [0, 5, 5, 5, 2],
        'x' => [0, 5, 2, 2, 5],
        'z' => [0, 7, 1, 4, 7],
        'q' => [0, 7, 5, 7, 1],
        'j' => [1, 0, 1, 1, 6],
        _ => [0, 0, 0, 0, 0],
    }
}

/// The smallest 5 steps of 1, 2, 2.5 or 5 × 10^k that reach `v`.
fn nice(v: f64) -> f64 {
    let step = v / 5.0;
    let mag = 10f64.powf(step.log10().floor());
    let unit = [1.0, 2.0, 2.5, 5.0, 10.0].into_iter().map(|m| m * mag).find(|u| *u >= step).unwrap_or(10.0 * mag);
    unit * 5.0
}

fn label(v: f64) -> String {
    if v.abs() >= 100.0 || v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.1}") }
}

/// Writes a line chart of `series` to `path` (x in seconds).
pub fn line_chart(path: &std::path::Path, title: &str, series: &[Series]) -> std::io::Result<()> {
    line_chart_with_x(path, title, "t (s)", series)
}

/// Writes a line chart of `series` to `path`, with `x_label` under the x axis.
pub fn line_chart_with_x(path: &std::path::Path, title: &str, x_label: &str, series: &[Series]) -> std::io::Result<()> {
    write_png(path, &draw(title, x_label, series).px, W, H)
}

/// One chart of a [`grid`].
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub series: Vec<Series>,
}

/// Writes `panels` as one PNG of charts, `columns` to a row (a dashboard picture).
pub fn grid(path: &std::path::Path, panels: &[Panel], columns: usize) -> std::io::Result<()> {
    let columns = columns.max(1);
    let rows = panels.len().div_ceil(columns).max(1);
    let (gw, gh) = (W * columns, H * rows);
    let mut px = vec![255; gw * gh * 3];
    for (i, p) in panels.iter().enumerate() {
        let c = draw(&p.title, &p.x_label, &p.series);
        let (ox, oy) = ((i % columns) * W, (i / columns) * H);
        for y in 0..H {
            let dst = ((oy + y) * gw + ox) * 3;
            px[dst..dst + W * 3].copy_from_slice(&c.px[y * W * 3..(y + 1) * W * 3]);
        }
    }
    write_png(path, &px, gw, gh)
}

fn draw(title: &str, x_label: &str, series: &[Series]) -> Canvas {
    let mut c = Canvas::new();
    let pts = series.iter().flat_map(|s| s.points.iter());
    let x_max = pts.clone().map(|p| p.0).fold(1.0, f64::max);
    let y_max = nice(pts.map(|p| p.1).filter(|y| y.is_finite()).fold(1.0, f64::max) * 1.05);
    let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
    let to_px = |x: f64, y: f64| -> (i64, i64) {
        ((LEFT as f64 + x / x_max * pw) as i64, (TOP as f64 + ph - (y.clamp(0.0, y_max) / y_max) * ph) as i64)
    };
    let grey = [225, 225, 225];
    let black = [40, 40, 40];
    for i in 0..=5 {
        let y = y_max * i as f64 / 5.0;
        let (_, py) = to_px(0.0, y);
        c.line((LEFT as i64, py), ((W - RIGHT) as i64, py), grey, false);
        let l = label(y);
        c.text(LEFT as i64 - 8 - 8 * l.len() as i64, py - 5, &l, black);
        let x = x_max * i as f64 / 5.0;
        let (px, _) = to_px(x, 0.0);
        c.line((px, TOP as i64), (px, (H - BOTTOM) as i64), grey, false);
        let l = label(x);
        c.text(px - 4 * l.len() as i64, (H - BOTTOM) as i64 + 8, &l, black);
    }
    c.line((LEFT as i64, TOP as i64), (LEFT as i64, (H - BOTTOM) as i64), black, false);
    c.line((LEFT as i64, (H - BOTTOM) as i64), ((W - RIGHT) as i64, (H - BOTTOM) as i64), black, false);
    c.text((W / 2) as i64 - 4 * x_label.len() as i64, (H - BOTTOM) as i64 + 28, x_label, black);
    c.text(LEFT as i64, 12, &title.to_lowercase(), black);
    let mut lx = LEFT as i64 + 10;
    for s in series {
        for w in s.points.windows(2) {
            c.line(to_px(w[0].0, w[0].1), to_px(w[1].0, w[1].1), s.rgb, true);
        }
        for dy in 0..8 {
            c.line((lx, 32 + dy), (lx + 14, 32 + dy), s.rgb, false);
        }
        c.text(lx + 20, 31, &s.name.to_lowercase(), black);
        lx += 40 + 8 * s.name.len() as i64;
    }
    c
}

fn crc32(data: &[u8], mut crc: u32) -> u32 {
    crc = !crc;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { 0xEDB8_8320 ^ (crc >> 1) } else { crc >> 1 };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(data, crc32(kind, 0));
    out.extend_from_slice(&crc.to_be_bytes());
}

fn write_png(path: &std::path::Path, rgb: &[u8], w: usize, h: usize) -> std::io::Result<()> {
    let mut raw = Vec::with_capacity((w * 3 + 1) * h);
    for row in rgb.chunks(w * 3) {
        raw.push(0); // filter: none
        raw.extend_from_slice(row);
    }
    // zlib stream of stored (uncompressed) deflate blocks.
    let mut z = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, b) in blocks.iter().enumerate() {
        z.push(u8::from(i + 1 == blocks.len()));
        z.extend_from_slice(&(b.len() as u16).to_le_bytes());
        z.extend_from_slice(&(!(b.len() as u16)).to_le_bytes());
        z.extend_from_slice(b);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut png, b"IHDR", &ihdr);
    chunk(&mut png, b"IDAT", &z);
    chunk(&mut png, b"IEND", &[]);
    std::fs::File::create(path)?.write_all(&png)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_the_png_reference_value() {
        // The CRC of the IEND chunk type is fixed by the PNG specification.
        assert_eq!(crc32(b"IEND", 0), 0xAE42_6082);
    }

    #[test]
    fn writes_a_png_with_the_right_header_and_size() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.png");
        let s = vec![Series { name: "has".into(), rgb: [0, 150, 0], points: vec![(0.0, 1.0), (10.0, 5.0)] }];
        line_chart(&p, "test", &s).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&bytes[12..16], b"IHDR");
        assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), W as u32);
        assert!(bytes.ends_with(&[0xAE, 0x42, 0x60, 0x82]));
    }

    #[test]
    fn a_grid_tiles_its_panels() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.png");
        let panel = |t: &str| Panel {
            title: t.into(),
            x_label: "t (s)".into(),
            series: vec![Series { name: "x".into(), rgb: [0, 0, 200], points: vec![(0.0, 1.0), (5.0, 2.0)] }],
        };
        grid(&p, &[panel("a"), panel("b"), panel("c")], 2).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 2 * W as u32);
        assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 2 * H as u32);
    }
}
