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

/// JSON numbers without an exponent (what a number with bounds or a decimal `multipleOf` is written as).
pub const PLAIN_NUMBER: &str = "-?(?:0|[1-9][0-9]*)(?:\\.[0-9]+)?";

/// A finite decimal as written: whether it is negative, its integer part and its fraction's digits (no trailing
/// zeros).
struct Decimal {
    negative: bool,
    int: u64,
    frac: Vec<u8>,
}

impl Decimal {
    /// The shortest decimal that reads back as `x` (how the schema most likely wrote it).
    fn of(x: f64) -> Result<Decimal, String> {
        if !x.is_finite() || x.abs() > 9_007_199_254_740_992.0 {
            return Err(format!(
                "a bound of {x} is not supported (at most 2^53 either way)"
            ));
        }
        let text = format!("{}", x.abs());
        let (int, frac) = text.split_once('.').unwrap_or((&text, ""));
        let frac = frac.trim_end_matches('0');
        if frac.len() > 15 {
            return Err(format!(
                "a bound of {x} has more fraction digits than supported (15)"
            ));
        }
        Ok(Decimal {
            negative: x < 0.0,
            int: int
                .parse()
                .map_err(|_| format!("a bound of {x} could not be read"))?,
            frac: frac.bytes().collect(),
        })
    }
}

/// Digits after the point (possibly none) whose fraction compares with 0.`f` as `order` asks (Less / Greater,
/// and with `or_equal` also equal); None when no digits do. Trailing zeros are implicit on both sides.
fn fraction_tail(f: &[u8], order: std::cmp::Ordering, or_equal: bool) -> Option<String> {
    use std::cmp::Ordering::*;
    let Some((&first, rest)) = f.split_first() else {
        // Past the bound's digits (all zeros now): any digits are >= it, all zeros equal it.
        return match (order, or_equal) {
            (Greater, true) => Some("[0-9]*".into()),
            (Greater, false) => Some("[0-9]*[1-9][0-9]*".into()),
            (Less, true) => Some("0*".into()),
            _ => None,
        };
    };
    let d = first - b'0';
    let mut alts = Vec::new();
    if order == Less {
        // Ending here reads as zeros, below the bound's remaining digits (the last one is not zero).
        alts.push(String::new());
        if d > 0 {
            alts.push(format!("[0-{}][0-9]*", d - 1));
        }
    } else if d < 9 {
        alts.push(format!("[{}-9][0-9]*", d + 1));
    }
    if let Some(t) = fraction_tail(rest, order, or_equal) {
        alts.push(format!("{}{t}", first as char));
    }
    (!alts.is_empty()).then(|| format!("(?:{})", alts.join("|")))
}

/// Non-negative decimal texts (integer part, optional point and digits; an intersection with PLAIN_NUMBER
/// makes them JSON) that compare with `d` (read without its sign) as `order` asks.
fn magnitude(d: &Decimal, order: std::cmp::Ordering, or_equal: bool) -> Option<String> {
    use std::cmp::Ordering::*;
    let any_fraction = "(?:\\.[0-9]*)?";
    let mut alts = Vec::new();
    // Integer parts strictly beyond the bound's.
    match order {
        Greater => alts.push(format!("{}{any_fraction}", whole_range(d.int + 1, None)?)),
        _ if d.int > 0 => alts.push(format!(
            "{}{any_fraction}",
            whole_range(0, Some(d.int - 1))?
        )),
        _ => {}
    }
    // The bound's own integer part: its fraction decides; written without one, it reads as a fraction of
    // zeros, which the bound takes below a fraction of its own and, with equality, at a whole bound.
    if let Some(tail) = fraction_tail(&d.frac, order, or_equal) {
        alts.push(format!("{}\\.{tail}", d.int));
        let bare = match order {
            Less => or_equal || !d.frac.is_empty(),
            _ => or_equal && d.frac.is_empty(),
        };
        if bare {
            alts.push(d.int.to_string());
        }
    }
    (!alts.is_empty()).then(|| format!("(?:{})", alts.join("|")))
}

/// The texts of numbers on the allowed side of one bound: at or above `x` (`lower`) or at or below it,
/// `exclusive` leaving `x` out. Meant to be intersected with PLAIN_NUMBER (a bare `1.` or `-0` may match here).
pub fn decimal_bound(x: f64, lower: bool, exclusive: bool) -> Result<String, String> {
    use std::cmp::Ordering::*;
    let d = Decimal::of(x)?;
    let any = "[0-9]+(?:\\.[0-9]*)?";
    // Negative numbers below a non-negative upper bound: any magnitude but zero (`-0` is 0, not below 0).
    let nonzero = "(?:[0-9]*[1-9][0-9]*(?:\\.[0-9]*)?|[0-9]+\\.[0-9]*[1-9][0-9]*)";
    let (order, or_equal) = (if lower { Greater } else { Less }, !exclusive);
    // A non-negative bound: numbers of one sign are all on the allowed side (negatives below a lower bound are
    // not, below an upper one they are); the others compare by magnitude.
    let (positive, negative) = if !d.negative {
        (
            magnitude(&d, order, or_equal),
            (!lower).then(|| nonzero.to_string()),
        )
    } else {
        let flipped = if lower { Less } else { Greater };
        (
            (lower).then(|| any.to_string()),
            magnitude(&d, flipped, or_equal),
        )
    };
    let mut alts = Vec::new();
    if let Some(p) = positive {
        alts.push(p);
    }
    if let Some(n) = negative {
        alts.push(format!("-{n}"));
    }
    if alts.is_empty() {
        return Err(format!(
            "no number is {} {x}",
            if lower { "above" } else { "below" }
        ));
    }
    Ok(format!("(?:{})", alts.join("|")))
}

/// Numbers with at most `k` fraction digits (`multipleOf` 10^-k).
pub fn fraction_digits(k: u32) -> String {
    format!("[^.]*(?:\\.[0-9]{{1,{k}}})?")
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

    /// Numbers within decimal bounds: the intersection the compiler builds (PLAIN_NUMBER, each bound, and the
    /// fraction digits), against exact comparison in thousandths.
    fn number_dfa(
        lo: Option<(f64, bool)>,
        hi: Option<(f64, bool)>,
        digits: Option<u32>,
    ) -> Option<ByteDfa> {
        let mut d = dfa(PLAIN_NUMBER);
        for (b, lower) in [(lo, true), (hi, false)] {
            if let Some((x, excl)) = b {
                let r = decimal_bound(x, lower, excl).ok()?;
                d = d.intersect(&dfa(&r)).ok()?;
            }
        }
        if let Some(k) = digits {
            d = d.intersect(&dfa(&fraction_digits(k))).ok()?;
        }
        Some(d)
    }

    #[test]
    fn number_ranges_hold_exactly_their_decimals() {
        // Decimals with up to 3 fraction digits in [-12, 12], as thousandths, in several spellings.
        let texts: Vec<(i64, String)> = (-12_000i64..=12_000)
            .filter(|m| m % 7 == 0 || m % 25 == 0)
            .flat_map(|m| {
                let sign = if m < 0 { "-" } else { "" };
                let (i, f) = (m.abs() / 1000, m.abs() % 1000);
                let mut v = vec![
                    (m, format!("{sign}{i}.{f:03}")),
                    (m, format!("{sign}{i}.{f:03}0")),
                ];
                if f == 0 {
                    v.push((m, format!("{sign}{i}")));
                } else if f % 10 == 0 {
                    v.push((m, format!("{sign}{i}.{:02}", f / 10)));
                }
                v
            })
            .collect();
        let bounds = [
            None,
            Some(-5.25),
            Some(-2.0),
            Some(-0.5),
            Some(0.0),
            Some(0.05),
            Some(0.5),
            Some(1.0),
            Some(2.125),
            Some(4.0),
        ];
        for lo in bounds {
            for hi in bounds {
                for (lo_excl, hi_excl) in
                    [(false, false), (true, true), (true, false), (false, true)]
                {
                    let l = lo.map(|v| (v, lo_excl));
                    let h = hi.map(|v| (v, hi_excl));
                    let thousandths = |x: f64| (x * 1000.0).round() as i64;
                    let inside = |m: i64| {
                        l.is_none_or(|(v, e)| {
                            if e {
                                m > thousandths(v)
                            } else {
                                m >= thousandths(v)
                            }
                        }) && h.is_none_or(|(v, e)| {
                            if e {
                                m < thousandths(v)
                            } else {
                                m <= thousandths(v)
                            }
                        })
                    };
                    let Some(d) = number_dfa(l, h, None) else {
                        assert!(texts.iter().all(|(m, _)| !inside(*m)), "{l:?} {h:?}: none?");
                        continue;
                    };
                    for (m, t) in &texts {
                        // "-0.000" and the like are zero: on the allowed side only where zero is.
                        assert!(
                            !d.matches(t.as_bytes()) || inside(*m),
                            "{l:?} {h:?} {t} taken"
                        );
                        if !t.starts_with("-0") || *m != 0 {
                            assert_eq!(d.matches(t.as_bytes()), inside(*m), "{l:?} {h:?} {t}");
                        }
                    }
                    for bad in ["1e3", "01.5", "1.", ".5", "--1", "+1"] {
                        assert!(!d.matches(bad.as_bytes()), "{l:?} {h:?} {bad}");
                    }
                }
            }
        }
        // Two fraction digits at most (multipleOf 0.01).
        let d = number_dfa(Some((0.0, false)), Some((10.0, false)), Some(2)).unwrap();
        for (t, m) in [
            ("9.99", true),
            ("9.999", false),
            ("10.00", true),
            ("10.01", false),
            ("0.5", true),
            ("-1", false),
        ] {
            assert_eq!(d.matches(t.as_bytes()), m, "{t}");
        }
        assert!(decimal_bound(1e300, true, false).is_err());
        assert!(decimal_bound(0.1234567890123456, true, false).is_err());
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
