//! Byte sizes and counts: written for reports, and read from a user's
//! `8GiB`, `12 GB` or `512MiB` (binary GiB/MiB/TiB, decimal GB/MB/TB).

const KIB: f64 = 1024.0;

/// A size that does not parse, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not a memory size: {reason}")]
pub struct SizeError {
    pub text: String,
    pub reason: &'static str,
}

/// Splits `7.5 GiB` into its number and its unit, lower-cased and trimmed.
fn split(text: &str) -> (&str, String) {
    let text = text.trim();
    let at = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(at);
    (number, unit.trim().to_ascii_lowercase())
}

fn scale(unit: &str) -> Option<f64> {
    Some(match unit {
        "tib" => (1u64 << 40) as f64,
        "gib" => (1u64 << 30) as f64,
        "mib" => (1u64 << 20) as f64,
        "kib" => KIB,
        "tb" => 1e12,
        "gb" => 1e9,
        "mb" => 1e6,
        "kb" => 1e3,
        _ => return None,
    })
}

/// Whether `text` is written as a size (a number and a byte unit), valid or
/// not, rather than as a name such as `rtx4090`.
pub fn looks_like_size(text: &str) -> bool {
    let (number, unit) = split(text);
    !number.is_empty() && (unit.is_empty() || scale(&unit).is_some())
}

/// Bytes of `8GiB`, `12 GB`, `7.5 GiB` or `16384MiB`, rounded to the nearest byte.
pub fn parse_bytes(text: &str) -> Result<u64, SizeError> {
    let bad = |reason| SizeError { text: text.to_owned(), reason };
    let (number, unit) = split(text);
    if unit.is_empty() {
        return Err(bad("give a unit: GiB, GB, MiB or MB"));
    }
    let scale = scale(&unit).ok_or_else(|| bad("give a unit: GiB, GB, MiB or MB"))?;
    let value: f64 = number.parse().map_err(|_| bad("the number does not parse"))?;
    let bytes = (value * scale).round();
    if bytes < 1.0 || !bytes.is_finite() {
        return Err(bad("the size must be positive"));
    }
    Ok(bytes as u64)
}

/// A whole number of at least 1, as a flag takes it.
pub fn parse_positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err("expected a whole number of at least 1".to_owned()),
    }
}

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

/// `57%` of a fraction in 0..=1; `-` for none.
pub fn percent_of_one(value: Option<f64>) -> String {
    value.filter(|v| !v.is_nan()).map_or_else(|| "-".to_owned(), |v| format!("{:.0}%", 100.0 * v))
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

    #[test]
    fn reads_sizes_in_binary_and_decimal_units() {
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes(" 7.5 GiB"), Ok(15 << 29));
        assert_eq!(parse_bytes("12GB"), Ok(12_000_000_000));
        assert_eq!(parse_bytes("16384MiB"), Ok(16 << 30));
        assert_eq!(parse_bytes("0.1B").unwrap_err().reason, "give a unit: GiB, GB, MiB or MB");
        for (text, reason) in [("8", "give a unit"), ("0GiB", "positive"), ("1.2.3GiB", "does not parse"), ("8 parsecs", "give a unit")] {
            let err = parse_bytes(text).unwrap_err().to_string();
            assert!(err.contains(reason) && err.contains(text.trim()), "{text}: {err}");
        }
        assert!(looks_like_size("8GiB") && looks_like_size("8") && !looks_like_size("rtx4090") && !looks_like_size("3060laptop"));
    }
}
