//! Human byte sizes: parsing `4GiB`, `512MiB`, `256KiB`, `1.5GiB`, `4096`
//! from the command line, and printing sizes back the same way.
//!
//! Units (case-insensitive, optional space before the unit):
//!
//! | unit | factor |
//! |---|---|
//! | none, `B` | 1 |
//! | `K`, `KiB` / `M`, `MiB` / `G`, `GiB` / `T`, `TiB` | 2^10, 2^20, 2^30, 2^40 |
//! | `KB`, `MB`, `GB`, `TB` | 10^3, 10^6, 10^9, 10^12 |
//!
//! A single letter means the binary unit, as in `dd` and `fio`. A fraction
//! (`1.5GiB`) is allowed when the result is a whole number of bytes.

/// Parses a size such as `4GiB`, `512MiB`, `256KiB`, `1.5GiB` or `4096`.
///
/// Errors (with a message fit for the user) on an empty string, a missing
/// or malformed number, an unknown unit, a fractional byte count, or a
/// value that does not fit in `u64`.
pub fn parse_size(input: &str) -> Result<u64, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("empty size (expected e.g. 4GiB, 512MiB, 256KiB or 4096)".into());
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: String = num.chars().filter(|&c| c != '_').collect();
    let unit = unit.trim();
    let factor: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "unknown unit {unit:?} in size {input:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
            ));
        }
    };
    let (int_part, frac_part) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num.as_str(), ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(format!(
            "size {input:?} has no number (expected e.g. 4GiB, 512MiB, 256KiB or 4096)"
        ));
    }
    if frac_part.contains('.') || frac_part.len() > 18 {
        return Err(format!("malformed number in size {input:?}"));
    }
    let too_big = || format!("size {input:?} is too large");
    let int: u128 = if int_part.is_empty() {
        0
    } else {
        int_part.parse().map_err(|_| too_big())?
    };
    let frac: u128 = if frac_part.is_empty() {
        0
    } else {
        frac_part
            .parse()
            .map_err(|_| format!("malformed number in size {input:?}"))?
    };
    let denom: u128 = 10u128.pow(frac_part.len() as u32);
    let whole = int.checked_mul(factor).ok_or_else(too_big)?;
    let frac_bytes = frac.checked_mul(factor).ok_or_else(too_big)?;
    if !frac_bytes.is_multiple_of(denom) {
        return Err(format!("size {input:?} is not a whole number of bytes"));
    }
    let total = whole.checked_add(frac_bytes / denom).ok_or_else(too_big)?;
    u64::try_from(total).map_err(|_| too_big())
}

/// Formats `bytes` with the largest binary unit that keeps the number at
/// least 1: `2 MiB`, `1.5 GiB`, `4096 B` is `4 KiB`, `1000 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, factor) in UNITS {
        if bytes >= factor {
            if bytes.is_multiple_of(factor) {
                return format!("{} {name}", bytes / factor);
            }
            let v = bytes as f64 / factor as f64;
            return format!("{v:.2} {name}");
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_numbers_and_binary_units() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4096B"), Ok(4096));
        assert_eq!(parse_size("256KiB"), Ok(256 << 10));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("16m"), Ok(16 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("8k"), Ok(8192));
    }

    #[test]
    fn case_spaces_underscores_and_decimal_units() {
        assert_eq!(parse_size(" 2 mib "), Ok(2 << 20));
        assert_eq!(parse_size("2 MIB"), Ok(2 << 20));
        assert_eq!(parse_size("1_048_576"), Ok(1 << 20));
        assert_eq!(parse_size("4KB"), Ok(4000));
        assert_eq!(parse_size("3MB"), Ok(3_000_000));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("2TB"), Ok(2_000_000_000_000));
    }

    #[test]
    fn fractions_must_give_whole_bytes() {
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0.5MiB"), Ok(512 << 10));
        assert_eq!(parse_size(".25KiB"), Ok(256));
        assert_eq!(parse_size("2.KiB"), Ok(2048));
        assert!(parse_size("1.5").is_err());
        assert!(parse_size("0.1KiB").is_err());
        assert!(parse_size("1.2.3MiB").is_err());
    }

    #[test]
    fn rejects_garbage_with_a_message() {
        for bad in [
            "",
            "  ",
            "MiB",
            "abc",
            "4 parsecs",
            "4GiBs",
            "-4KiB",
            "1e9",
            ".",
        ] {
            let err = parse_size(bad).expect_err(bad);
            assert!(!err.is_empty());
        }
        assert!(parse_size("4XB").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn rejects_overflow() {
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert!(parse_size("18446744073709551616").is_err());
        assert!(parse_size("16777216TiB").is_err());
        assert!(parse_size("99999999999999999999999999999999999999999999").is_err());
    }

    #[test]
    fn formats_round_trip() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1000), "1000 B");
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(256 << 10), "256 KiB");
        assert_eq!(format_size(2 << 20), "2 MiB");
        assert_eq!(format_size(3 << 29), "1.50 GiB");
        assert_eq!(format_size(4 << 30), "4 GiB");
        for n in [4096u64, 256 << 10, 2 << 20, 16 << 20, 4 << 30] {
            assert_eq!(parse_size(&format_size(n).replace(' ', "")), Ok(n));
        }
    }
}
