//! Byte and count formatting for reports.

const KIB: f64 = 1024.0;

/// `1,234,567`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Binary units with three significant figures: `574 KiB`, `97.5 MiB`, `7.83 GiB`.
pub fn human(bytes: u64) -> String {
    let mut value = bytes as f64;
    let mut unit = "B";
    for next in ["KiB", "MiB", "GiB", "TiB"] {
        if value < KIB {
            break;
        }
        value /= KIB;
        unit = next;
    }
    if unit == "B" {
        format!("{bytes} B")
    } else if value >= 100.0 {
        format!("{value:.0} {unit}")
    } else if value >= 10.0 {
        format!("{value:.1} {unit}")
    } else {
        format!("{value:.2} {unit}")
    }
}

/// `12.3%` of `whole`.
pub fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".to_owned();
    }
    format!("{:.1}%", 100.0 * part as f64 / whole as f64)
}

/// `3.2 G`, `812 M`: MAC counts.
pub fn si(n: u64) -> String {
    let value = n as f64;
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.1} k", value / 1e3),
        1_000_000..=999_999_999 => format!("{:.1} M", value / 1e6),
        _ => format!("{:.2} G", value / 1e9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_bytes_and_counts() {
        assert_eq!(grouped(25_557_032), "25,557,032");
        assert_eq!(grouped(602_112), "602,112");
        assert_eq!(grouped(12), "12");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(602_112), "588 KiB");
        assert_eq!(human(8 << 30), "8.00 GiB");
        assert_eq!(human(102_228_128), "97.5 MiB");
        assert_eq!(percent(1, 8), "12.5%");
        assert_eq!(si(4_110_000_000), "4.11 G");
    }
}
