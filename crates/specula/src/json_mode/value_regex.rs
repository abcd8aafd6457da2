//! Regexes (Rust syntax) for the values schema keywords describe: `pattern` (ECMA-262, found anywhere in the
//! string), the string `format`s OpenAI's structured outputs list, and numbers within bounds. Each is sound (every
//! text it matches is valid for its keyword) where the keyword's full language would need more than a regex: dates
//! check the days of each month and leap years, but a number within bounds is written without an exponent.

/// The formats enforced, for error messages.
pub const FORMATS: &[&str] = &[
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uuid",
    "uri",
];

const DIGIT: &str = "[0-9]";
const HEX: &str = "[0-9A-Fa-f]";

/// A year 0001-9999, and the leap years among them.
fn year() -> &'static str {
    "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
}
fn leap_year() -> &'static str {
    "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
}

fn date() -> String {
    format!(
        "(?:{y}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))|{l}-02-29)",
        y = year(),
        l = leap_year()
    )
}

/// RFC 3339 full-time (no leap second).
fn time() -> &'static str {
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
}

/// A hostname label: letters, digits and inner hyphens, 1-63 bytes.
fn label() -> &'static str {
    "[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
}

fn ipv4() -> &'static str {
    "(?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
}

/// RFC 4291 text forms: eight groups, or `::` standing for at least one zero group, optionally ending in an
/// IPv4 address in place of the last two groups.
fn ipv6() -> String {
    let h = format!("{HEX}{{1,4}}");
    let v4 = ipv4();
    let mut forms = vec![format!("(?:{h}:){{7}}{h}"), format!("(?:{h}:){{6}}{v4}")];
    for left in 0..=7usize {
        let l = if left == 0 {
            String::new()
        } else {
            format!("(?:{h}:){{{}}}{h}", left - 1)
        };
        // Groups after `::`, at most 7 - left (one group at least is compressed).
        let room = 7 - left;
        let r = if room == 0 {
            String::new()
        } else {
            format!("(?:{h}(?::{h}){{0,{}}})?", room - 1)
        };
        forms.push(format!("{l}::{r}"));
        // With an IPv4 tail (two groups' worth): at most 5 - left groups between.
        if left <= 5 {
            forms.push(format!("{l}::(?:{h}:){{0,{}}}{v4}", 5 - left));
        }
    }
    format!("(?:{})", forms.join("|"))
}

/// RFC 3986 URIs with a registered-name host (no IP literals): scheme, then an authority and path, or a path.
fn uri() -> String {
    let unreserved = "A-Za-z0-9._~\\-";
    let sub = "!$&'()*+,;=";
    let pct = format!("%{HEX}{{2}}");
    let pchar = format!("(?:[{unreserved}{sub}:@]|{pct})");
    let userinfo = format!("(?:[{unreserved}{sub}:]|{pct})*");
    let host = format!("(?:[{unreserved}{sub}]|{pct})*");
    let authority = format!("(?:{userinfo}@)?{host}(?::{DIGIT}*)?");
    let segments = format!("(?:/{pchar}*)*");
    let hier = format!("(?://{authority}{segments}|/(?:{pchar}+{segments})?|{pchar}+{segments})?");
    let tail = format!("(?:{pchar}|[/?])*");
    format!("[A-Za-z][A-Za-z0-9+.\\-]*:{hier}(?:\\?{tail})?(?:#{tail})?")
}

/// ISO 8601 durations as RFC 3339's appendix A writes them.
fn duration() -> String {
    let n = "[0-9]+";
    let time = format!("T(?:{n}H(?:{n}M(?:{n}S)?)?|{n}M(?:{n}S)?|{n}S)");
    let date = format!("(?:{n}D|{n}M(?:{n}D)?|{n}Y(?:{n}M(?:{n}D)?)?)");
    format!("P(?:{date}(?:{time})?|{time}|{n}W)")
}

/// The regex a string `format` must match whole, None for a format not enforced.
pub fn format(name: &str) -> Option<String> {
    Some(match name {
        "date" => date(),
        "time" => time().to_string(),
        "date-time" => format!("{}[Tt]{}", date(), time()),
        "duration" => duration(),
        "email" => format!(
            "[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+(?:\\.[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+)*@{l}(?:\\.{l})*",
            l = label()
        ),
        "hostname" => format!("{l}(?:\\.{l})*", l = label()),
        "ipv4" => ipv4().to_string(),
        "ipv6" => ipv6(),
        "uuid" => format!("{HEX}{{8}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{12}}"),
        "uri" => uri(),
        _ => return None,
    })
}

/// A JSON Schema `pattern` (ECMA-262) as a Rust regex matching the strings in which it is found: JSON Schema
/// patterns are not anchored. ECMA's `\d` and `\w` are ASCII classes (Rust's are Unicode), and a `[` inside a
/// class is a literal there; both are rewritten. Errors name a construct with no rewrite.
pub fn pattern(ecma: &str) -> Result<String, String> {
    let mut out = String::with_capacity(ecma.len() + 16);
    let mut chars = ecma.chars().peekable();
    let mut in_class = false;
    let mut class_start = false;
    while let Some(c) = chars.next() {
        let at_class_start = std::mem::take(&mut class_start);
        match c {
            '\\' => {
                let Some(e) = chars.next() else {
                    return Err("it ends in a lone backslash".into());
                };
                match (e, in_class) {
                    ('d', false) => out.push_str("[0-9]"),
                    ('d', true) => out.push_str("0-9"),
                    ('w', false) => out.push_str("[0-9A-Za-z_]"),
                    ('w', true) => out.push_str("0-9A-Za-z_"),
                    ('D', false) => out.push_str("[^0-9]"),
                    ('W', false) => out.push_str("[^0-9A-Za-z_]"),
                    ('D' | 'W', true) => {
                        return Err(format!("\\{e} inside a character class is not supported"))
                    }
                    ('b' | 'B', false) => {
                        return Err(format!("the word boundary \\{e} is not supported"))
                    }
                    _ => {
                        out.push('\\');
                        out.push(e);
                    }
                }
            }
            '[' if !in_class => {
                in_class = true;
                class_start = true;
                out.push('[');
                if chars.peek() == Some(&'^') {
                    out.push(chars.next().expect("peeked"));
                }
                if chars.peek() == Some(&']') {
                    return Err("an empty character class ([] or [^]) is not supported".into());
                }
            }
            ']' if in_class && !at_class_start => {
                in_class = false;
                out.push(']');
            }
            // Literals in an ECMA class that Rust reads as nested classes or set operations.
            '[' | '&' | '~' if in_class => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    if in_class {
        return Err("a character class is not closed".into());
    }
    Ok(format!("(?s:.)*(?:{out})(?s:.)*"))
}

/// `(?:\.[0-9]{1,k})?`-style fractions: any (`digits` None: unbounded), all zeros, or not all zeros.
fn fraction(digits: Option<u32>) -> (String, String, String) {
    let upto = |class: &str| match digits {
        Some(k) => format!("{class}{{1,{k}}}"),
        None => format!("{class}+"),
    };
    let any = format!("(?:\\.{})?", upto(DIGIT));
    let zeros = format!("(?:\\.{})?", upto("0"));
    let nonzero = match digits {
        Some(k) => format!("\\.(?:[0-9]{{0,{}}}[1-9])0{{0,{}}}", k - 1, k - 1),
        None => "\\.[0-9]*[1-9][0-9]*".to_string(),
    };
    (any, zeros, nonzero)
}

/// Canonical non-negative integers (no leading zeros) in `lo..=hi` (`hi` None: no upper bound), or None when
/// there are none.
pub fn whole_range(lo: u64, hi: Option<u64>) -> Option<String> {
    if hi.is_some_and(|h| h < lo) {
        return None;
    }
    let lo_digits = lo.to_string().len();
    let mut alts = Vec::new();
    let top_len = hi.map_or(lo_digits, |h| h.to_string().len());
    for len in lo_digits..=top_len {
        let first = if len == 1 {
            0
        } else {
            10u64.pow(len as u32 - 1)
        };
        let last = 10u64.checked_pow(len as u32).map_or(u64::MAX, |p| p - 1);
        let (a, b) = (lo.max(first), hi.map_or(last, |h| h.min(last)));
        if a <= b {
            alts.push(same_length(&a.to_string(), &b.to_string()));
        }
    }
    if hi.is_none() {
        // Every number longer than `lo`.
        alts.push(format!("[1-9][0-9]{{{lo_digits},}}"));
    }
    Some(format!("(?:{})", alts.join("|")))
}

/// Digit strings of one length from `a` to `b` (a <= b, same length).
fn same_length(a: &str, b: &str) -> String {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let digit_range = |x: u8, y: u8| {
        if x == y {
            (x as char).to_string()
        } else {
            format!("[{}-{}]", x as char, y as char)
        }
    };
    if a.len() == 1 {
        return digit_range(a[0], b[0]);
    }
    let rest = |s: &[u8]| std::str::from_utf8(&s[1..]).expect("digits").to_string();
    if a[0] == b[0] {
        return format!("{}{}", a[0] as char, same_length(&rest(a), &rest(b)));
    }
    let n = a.len() - 1;
    // Leading digits whose rest runs over every value join the free middle (this keeps the regex linear in the
    // number of digits: each level leaves at most one bounded branch on each side).
    let free_low = a[1..].iter().all(|&d| d == b'0');
    let free_high = b[1..].iter().all(|&d| d == b'9');
    let (mid_lo, mid_hi) = (
        if free_low { a[0] } else { a[0] + 1 },
        if free_high { b[0] } else { b[0] - 1 },
    );
    let mut alts = Vec::new();
    if !free_low {
        alts.push(format!(
            "{}{}",
            a[0] as char,
            same_length(&rest(a), &"9".repeat(n))
        ));
    }
    if mid_lo <= mid_hi {
        alts.push(format!("{}[0-9]{{{n}}}", digit_range(mid_lo, mid_hi)));
    }
    if !free_high {
        alts.push(format!(
            "{}{}",
            b[0] as char,
            same_length(&"0".repeat(n), &rest(b))
        ));
    }
    format!("(?:{})", alts.join("|"))
}

/// A bound: its value and whether it is exclusive.
pub type Bound = (i64, bool);

/// Integers in the bounds (as written in JSON: `-` and digits, no leading zeros), None when none is.
pub fn integer_range(lo: Option<Bound>, hi: Option<Bound>) -> Option<String> {
    let lo = lo.map(|(v, excl)| v as i128 + i128::from(excl));
    let hi = hi.map(|(v, excl)| v as i128 - i128::from(excl));
    if let (Some(l), Some(h)) = (lo, hi) {
        if l > h {
            return None;
        }
    }
    let mut alts = Vec::new();
    // Negative numbers: magnitudes from max(1, -hi) to -lo.
    if lo.is_none_or(|l| l < 0) {
        let from = hi.map_or(1, |h| (-h).max(1)) as u64;
        let to = lo.map(|l| (-l) as u64);
        if let Some(r) = whole_range(from, to) {
            alts.push(format!("-{r}"));
        }
    }
    if hi.is_none_or(|h| h >= 0) {
        let from = lo.map_or(0, |l| l.max(0)) as u64;
        if let Some(r) = whole_range(from, hi.map(|h| h as u64)) {
            alts.push(r);
        }
    }
    (!alts.is_empty()).then(|| format!("(?:{})", alts.join("|")))
}

/// Non-negative decimals (no exponent) above `lo` (exclusive or not) and below `hi`, with at most `digits`
/// fraction digits; None when there are none.
fn nonneg_decimals(
    lo: (u64, bool),
    hi: Option<(u64, bool)>,
    digits: Option<u32>,
) -> Option<String> {
    let (any, zeros, nonzero) = fraction(digits);
    let ((a, a_excl), b) = (lo, hi);
    let mut alts = Vec::new();
    match b {
        Some((b, b_excl)) if b == a => {
            if !a_excl && !b_excl {
                alts.push(format!("{a}{zeros}"));
            }
        }
        Some((b, _)) if b < a => {}
        _ => {
            // The integer part equal to `lo`: a fraction above zero where `lo` is excluded.
            alts.push(format!("{a}{}", if a_excl { &nonzero } else { &any }));
            // Integer parts strictly between.
            let inner_hi = b.map(|(b, _)| b - 1);
            if inner_hi.is_none_or(|h| h > a) {
                if let Some(r) = whole_range(a + 1, inner_hi) {
                    alts.push(format!("{r}{any}"));
                }
            }
            // The integer part equal to `hi`: no fraction but zeros, and only where `hi` is included.
            if let Some((b, false)) = b {
                alts.push(format!("{b}{zeros}"));
            }
        }
    }
    (!alts.is_empty()).then(|| format!("(?:{})", alts.join("|")))
}

/// Numbers in the bounds (whole-number bounds; no exponent; at most `digits` fraction digits), None when none
/// is. `-0` is never written.
pub fn number_range(lo: Option<Bound>, hi: Option<Bound>, digits: Option<u32>) -> Option<String> {
    let mut alts = Vec::new();
    // Negative numbers x = -y, y > 0: -hi <= y <= -lo (exclusivity carried over).
    if lo.is_none_or(|(l, _)| l < 0) {
        let y_lo = match hi {
            Some((h, excl)) if h < 0 => ((-(h as i128)) as u64, excl),
            _ => (0, true),
        };
        let y_hi = lo.map(|(l, excl)| ((-(l as i128)) as u64, excl));
        if let Some(r) = nonneg_decimals(y_lo, y_hi, digits) {
            alts.push(format!("-{r}"));
        }
    }
    if hi.is_none_or(|(h, excl)| h > 0 || (h == 0 && !excl)) {
        let x_lo = match lo {
            Some((l, excl)) if l >= 0 => (l as u64, excl),
            _ => (0, false),
        };
        let x_hi = hi.map(|(h, excl)| (h as u64, excl));
        if let Some(r) = nonneg_decimals(x_lo, x_hi, digits) {
            alts.push(r);
        }
    }
    (!alts.is_empty()).then(|| format!("(?:{})", alts.join("|")))
}

#[cfg(test)]
mod tests {
    use super::super::byte_dfa::ByteDfa;
    use super::*;

    fn dfa(regex: &str) -> ByteDfa {
        ByteDfa::from_regex(regex, |b| b >= 0x20 && b != b'"' && b != b'\\')
            .unwrap_or_else(|e| panic!("{}: {e}", &regex[..regex.len().min(200)]))
    }

    #[test]
    fn integer_ranges_hold_exactly_their_integers() {
        let bounds = [
            None,
            Some(-100),
            Some(-7),
            Some(-1),
            Some(0),
            Some(1),
            Some(9),
            Some(10),
            Some(99),
            Some(150),
        ];
        for lo in bounds {
            for hi in bounds {
                for (lo_excl, hi_excl) in
                    [(false, false), (true, false), (false, true), (true, true)]
                {
                    let l = lo.map(|v| (v, lo_excl));
                    let h = hi.map(|v| (v, hi_excl));
                    let inside = |n: i64| {
                        l.is_none_or(|(v, e)| if e { n > v } else { n >= v })
                            && h.is_none_or(|(v, e)| if e { n < v } else { n <= v })
                    };
                    let Some(r) = integer_range(l, h) else {
                        assert!((-300..=300).all(|n| !inside(n)), "{l:?} {h:?}: none?");
                        continue;
                    };
                    let d = dfa(&r);
                    for n in -300i64..=300 {
                        assert_eq!(
                            d.matches(n.to_string().as_bytes()),
                            inside(n),
                            "{l:?} {h:?} {n}"
                        );
                    }
                    for bad in ["-0", "007", "01", "+1", "1.0", ""] {
                        assert!(!d.matches(bad.as_bytes()), "{l:?} {h:?} {bad}");
                    }
                }
            }
        }
        // Large bounds and lengths past them.
        let d = dfa(&integer_range(Some((1_000_000_007, false)), None).unwrap());
        assert!(!d.matches(b"1000000006") && d.matches(b"1000000007") && d.matches(b"99999999999"));
        let d = dfa(&integer_range(None, Some((i64::MAX, false))).unwrap());
        assert!(d.matches(b"9223372036854775807") && !d.matches(b"9223372036854775808"));
    }

    #[test]
    fn number_ranges_hold_exactly_their_decimals() {
        // Every decimal with up to 3 fraction digits in [-12, 12], as thousandths.
        let texts: Vec<(i64, String)> = (-12_000i64..=12_000)
            .filter(|m| m % 7 == 0 || m % 50 == 0)
            .flat_map(|m| {
                let sign = if m < 0 { "-" } else { "" };
                let (i, f) = (m.abs() / 1000, m.abs() % 1000);
                let mut v = vec![(m, format!("{sign}{i}.{f:03}"))];
                if f == 0 {
                    v.push((m, format!("{sign}{i}")));
                    v.push((m, format!("{sign}{i}.0")));
                } else if f % 100 == 0 {
                    v.push((m, format!("{sign}{i}.{}", f / 100)));
                }
                v
            })
            .filter(|(_, t)| t != "-0" && !t.starts_with("-0.000") && t != "-0.0")
            .collect();
        for lo in [None, Some(-5), Some(0), Some(3)] {
            for hi in [None, Some(-2), Some(0), Some(4)] {
                for (lo_excl, hi_excl) in [(false, false), (true, true), (true, false)] {
                    let l = lo.map(|v| (v, lo_excl));
                    let h = hi.map(|v| (v, hi_excl));
                    let inside = |m: i64| {
                        l.is_none_or(|(v, e)| if e { m > v * 1000 } else { m >= v * 1000 })
                            && h.is_none_or(|(v, e)| if e { m < v * 1000 } else { m <= v * 1000 })
                    };
                    let Some(r) = number_range(l, h, None) else {
                        assert!(texts.iter().all(|(m, _)| !inside(*m)), "{l:?} {h:?}");
                        continue;
                    };
                    let d = dfa(&r);
                    for (m, t) in &texts {
                        assert_eq!(d.matches(t.as_bytes()), inside(*m), "{l:?} {h:?} {t}");
                    }
                    for bad in ["-0", "-0.0", "1e3", "01.5", "1.", ".5"] {
                        assert!(!d.matches(bad.as_bytes()), "{l:?} {h:?} {bad}");
                    }
                }
            }
        }
        // Two fraction digits at most (multipleOf 0.01).
        let d = dfa(&number_range(Some((0, false)), Some((10, false)), Some(2)).unwrap());
        for (t, m) in [
            ("9.99", true),
            ("9.999", false),
            ("10.00", true),
            ("10.01", false),
            ("0.5", true),
        ] {
            assert_eq!(d.matches(t.as_bytes()), m, "{t}");
        }
    }

    #[test]
    fn formats_take_valid_values_and_refuse_others() {
        for (format_name, good, bad) in [
            (
                "date",
                &["2024-02-29", "2023-12-31", "2000-02-29", "0001-01-01"][..],
                &[
                    "2023-02-29",
                    "1900-02-29",
                    "2023-04-31",
                    "2023-13-01",
                    "0000-01-01",
                    "2023-1-01",
                ][..],
            ),
            (
                "time",
                &["23:59:59Z", "00:00:00.123+05:30", "12:00:00z"],
                &["24:00:00Z", "12:00:00", "12:60:00Z", "12:00:00+5:00"],
            ),
            (
                "date-time",
                &["2024-01-02T03:04:05Z", "2024-01-02t03:04:05.5-01:00"],
                &["2024-01-02 03:04:05Z", "2024-01-02T03:04Z"],
            ),
            (
                "duration",
                &["P1D", "PT1H30M", "P1Y2M3DT4H5M6S", "P3W"],
                &["P", "PT", "P1H", "1D", "P1DT"],
            ),
            (
                "email",
                &["a.b+c@example.com", "x@y"],
                &["a..b@x.com", "@x.com", "a@-x.com", "a b@x.com"],
            ),
            (
                "hostname",
                &["example.com", "a-b.c0"],
                &["-a.com", "a..b", "a_b.com"],
            ),
            (
                "ipv4",
                &["0.0.0.0", "255.255.255.255", "10.1.2.3"],
                &["256.0.0.1", "01.2.3.4", "1.2.3"],
            ),
            (
                "uuid",
                &["123e4567-e89b-12d3-a456-426614174000"],
                &[
                    "123e4567e89b12d3a456426614174000",
                    "123e4567-e89b-12d3-a456-42661417400g",
                ],
            ),
            (
                "uri",
                &[
                    "https://example.com/a/b?q=1#f",
                    "mailto:a@b.c",
                    "urn:isbn:0451450523",
                    "http://u:p@h:8080/",
                ],
                &["example.com", "http://a b", "1http://x", "http://h:80a/"],
            ),
        ] {
            let d = dfa(&format(format_name).unwrap());
            for g in good {
                assert!(d.matches(g.as_bytes()), "{format_name}: {g} refused");
            }
            for b in bad {
                assert!(!d.matches(b.as_bytes()), "{format_name}: {b} taken");
            }
        }
        assert!(format("color").is_none());
    }

    /// The IPv6 automaton against the standard library's parser: every address it prints is taken, and every
    /// text a random walk through the automaton finishes parses.
    #[test]
    fn ipv6_agrees_with_the_standard_parser() {
        use rand::{Rng, SeedableRng};
        let d = dfa(&format("ipv6").unwrap());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for _ in 0..2000 {
            let mut groups = [0u16; 8];
            for g in &mut groups {
                *g = if rng.random_bool(0.4) {
                    0
                } else {
                    rng.random()
                };
            }
            let a = std::net::Ipv6Addr::from(groups);
            assert!(d.matches(a.to_string().as_bytes()), "{a}");
        }
        for text in [
            "::",
            "::1",
            "1::",
            "1:2:3:4:5:6:7::",
            "::ffff:1.2.3.4",
            "1:2:3:4:5:6:1.2.3.4",
        ] {
            assert!(
                d.matches(text.as_bytes()) && text.parse::<std::net::Ipv6Addr>().is_ok(),
                "{text}"
            );
        }
        for text in [
            "1:2:3:4:5:6:7:8:9",
            "1::2::3",
            ":1",
            "1:2:3:4:5:6:7:1.2.3.4",
            "12345::",
        ] {
            assert!(!d.matches(text.as_bytes()), "{text}");
        }
        let mut walked = 0;
        for _ in 0..3000 {
            let (mut s, mut text) = (0u16, Vec::new());
            loop {
                let next: Vec<u8> = (0..=255u8).filter(|&b| d.next(s, b).is_some()).collect();
                if d.accepts(s) && (next.is_empty() || rng.random_bool(0.15)) {
                    break;
                }
                let b = next[rng.random_range(0..next.len())];
                text.push(b);
                s = d.next(s, b).unwrap();
            }
            let text = String::from_utf8(text).unwrap();
            assert!(text.parse::<std::net::Ipv6Addr>().is_ok(), "{text}");
            walked += 1;
        }
        assert_eq!(walked, 3000);
    }

    #[test]
    fn patterns_are_searched_and_ecma_classes_are_ascii() {
        let p = |s: &str| dfa(&pattern(s).unwrap());
        let d = p("\\d{3}");
        assert!(d.matches(b"ab123cd") && !d.matches(b"12") && !d.matches("١٢٣".as_bytes()));
        let d = p("^[a-z]+$");
        assert!(d.matches(b"abc") && !d.matches(b"abc1") && !d.matches(b""));
        let d = p("^[\\w.]+@[\\w.]+$");
        assert!(d.matches(b"a.b@c_d") && !d.matches(b"a@b c"));
        // `[` and `&&` inside an ECMA class are literals.
        let d = p("^[[&]+$");
        assert!(d.matches(b"[&&[") && !d.matches(b"]"));
        let d = p("^\\/x$");
        assert!(d.matches(b"/x"));
        for bad in ["[]", "[^]", "\\bx", "[\\D]", "abc\\", "[a-z"] {
            assert!(pattern(bad).is_err(), "{bad}");
        }
    }
}
