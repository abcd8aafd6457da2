//! Byte automata for the values a schema shapes beyond JSON's own syntax: a string's `pattern` or `format`, a
//! number's bounds or `multipleOf`. Each is a table DFA over bytes whose every state can still reach an accepting
//! one (`live`), so the output automaton never walks into a value it cannot finish: a token is refused as soon as
//! its bytes leave what some complete value begins with.
//!
//! Regexes are compiled by regex-automata (a dense DFA, anchored, every match kept) and copied into a table of our
//! own, restricted to the bytes the value may hold (inside a JSON string: no quote, backslash or control byte, so
//! the string's text is its value), then pruned to live states. Automata intersect (a pattern and a length, a
//! range and a multiple) by the product construction.

use std::collections::{HashMap, VecDeque};

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::nfa::thompson;
use regex_automata::util::{start, syntax};
use regex_automata::{Anchored, MatchKind};

/// A transition to no state.
const DEAD: u16 = u16::MAX;
/// States an automaton may keep (its table is 512 bytes a state).
pub const MAX_STATES: usize = 8192;
/// Memory regex-automata may use to build one DFA.
const BUILD_LIMIT: usize = 16 << 20;

/// An error with its causes (regex-automata's own text is "error building NFA"; the cause says why).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text = format!("{text}: {c}");
        cause = c.source();
    }
    // A parse error quotes the regex over several lines and ends in "error: WHY": WHY is what a client needs.
    match text.lines().rev().find_map(|l| l.strip_prefix("error: ")) {
        Some(why) => why.to_string(),
        None => text,
    }
}

/// A DFA over bytes; state 0 is the start, and every state can reach an accepting one.
#[derive(Clone)]
pub struct ByteDfa {
    /// `next[state * 256 + byte]`: the next state, or DEAD.
    next: Vec<u16>,
    accepts: Vec<bool>,
    /// The fewest characters (bytes that are not UTF-8 continuation bytes) from each state to an accepting one.
    chars_left: Vec<u32>,
}

impl std::fmt::Debug for ByteDfa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ByteDfa({} states)", self.accepts.len())
    }
}

impl ByteDfa {
    /// States held (each a 256-entry row).
    pub fn states(&self) -> usize {
        self.accepts.len()
    }

    /// The state after `b` in `state`, None where no value continues so.
    pub fn next(&self, state: u16, b: u8) -> Option<u16> {
        let n = self.next[state as usize * 256 + b as usize];
        (n != DEAD).then_some(n)
    }

    /// The fewest characters that take `state` to a whole value.
    pub fn chars_left(&self, state: u16) -> u32 {
        self.chars_left[state as usize]
    }

    /// Whether the bytes that led to `state` are a whole value.
    pub fn accepts(&self, state: u16) -> bool {
        self.accepts[state as usize]
    }

    /// Whether the automaton takes all of `bytes` from the start and ends accepting.
    #[cfg(test)]
    pub fn matches(&self, bytes: &[u8]) -> bool {
        let mut s = 0;
        for &b in bytes {
            match self.next(s, b) {
                Some(n) => s = n,
                None => return false,
            }
        }
        self.accepts(s)
    }

    /// The bytes a value may begin with.
    pub fn first_bytes(&self) -> impl Iterator<Item = u8> + '_ {
        (0..=255u8).filter(|&b| self.next(0, b).is_some())
    }

    /// The whole-string matches of `regex` (Rust syntax, Unicode, matching only well-formed UTF-8), over the
    /// bytes `allowed` lets through. Errors name what is wrong with the regex, or that nothing matches.
    pub fn from_regex(regex: &str, allowed: impl Fn(u8) -> bool) -> Result<ByteDfa, String> {
        let dfa = dense::Builder::new()
            .syntax(
                syntax::Config::new()
                    .utf8(true)
                    .unicode(true)
                    .nest_limit(64),
            )
            .thompson(thompson::Config::new().nfa_size_limit(Some(BUILD_LIMIT)))
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .minimize(false)
                    .dfa_size_limit(Some(BUILD_LIMIT))
                    .determinize_size_limit(Some(BUILD_LIMIT)),
            )
            .build(regex)
            .map_err(|e| error_chain(&e))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| e.to_string())?;
        // Breadth first from the start, numbering states as they are found.
        let mut ids = HashMap::from([(start, 0u16)]);
        let mut order = vec![start];
        let mut queue = VecDeque::from([start]);
        let mut next = Vec::new();
        let mut accepts = Vec::new();
        while let Some(s) = queue.pop_front() {
            accepts.push(dfa.is_match_state(dfa.next_eoi_state(s)));
            for b in 0..=255u8 {
                let t = dfa.next_state(s, b);
                if !allowed(b) || dfa.is_dead_state(t) {
                    next.push(DEAD);
                    continue;
                }
                if dfa.is_quit_state(t) {
                    return Err(
                        "it needs a feature these automata lack (a Unicode word boundary?)".into(),
                    );
                }
                let id = match ids.get(&t) {
                    Some(&id) => id,
                    None => {
                        if order.len() >= MAX_STATES {
                            return Err(format!(
                                "it needs more than {MAX_STATES} automaton states"
                            ));
                        }
                        let id = order.len() as u16;
                        ids.insert(t, id);
                        order.push(t);
                        queue.push_back(t);
                        id
                    }
                };
                next.push(id);
            }
        }
        ByteDfa {
            next,
            accepts,
            chars_left: Vec::new(),
        }
        .pruned()
    }

    /// Byte strings of `min..=max` characters (a character: a byte that is not a UTF-8 continuation byte), any
    /// bytes; meant to be intersected with an automaton that keeps UTF-8 well formed. `max` None: no bound.
    pub fn char_count(min: u32, max: Option<u32>) -> Result<ByteDfa, String> {
        let last = max.unwrap_or(min) as usize;
        if last >= MAX_STATES {
            return Err(format!(
                "a length bound of {last} is too large here (at most {})",
                MAX_STATES - 1
            ));
        }
        let mut next = Vec::with_capacity((last + 1) * 256);
        for count in 0..=last {
            for b in 0..=255u8 {
                let continuation = (0x80..=0xBF).contains(&b);
                next.push(if continuation {
                    count as u16
                } else if count < last {
                    count as u16 + 1
                } else if max.is_none() {
                    count as u16
                } else {
                    DEAD
                });
            }
        }
        let accepts = (0..=last).map(|c| c as u32 >= min).collect();
        ByteDfa {
            next,
            accepts,
            chars_left: Vec::new(),
        }
        .pruned()
    }

    /// Decimal integers (an optional `-`, digits) that are multiples of `m`; any digits, so intersect it with an
    /// automaton of the integers' form.
    pub fn multiples_of(m: u64) -> Result<ByteDfa, String> {
        // Compared as u64: `m as usize + 2` wrapped for m near u64::MAX (a schema's multipleOf of 1e300
        // saturates there) and passed, leaving a one-state table whose transitions pointed past it.
        if m == 0 || m > (MAX_STATES - 2) as u64 {
            return Err(format!(
                "multipleOf {m} is not supported (a whole number from 1 to {})",
                MAX_STATES - 2
            ));
        }
        // 0: start, 1: after '-', 2 + r: digits read so far with remainder r.
        let states = m as usize + 2;
        let mut next = vec![DEAD; states * 256];
        next[b'-' as usize] = 1;
        for s in 0..states {
            let r = if s < 2 { 0 } else { (s - 2) as u64 };
            for d in 0..10u8 {
                next[s * 256 + (b'0' + d) as usize] = (2 + (r * 10 + d as u64) % m) as u16;
            }
        }
        let accepts = (0..states).map(|s| s == 2).collect();
        ByteDfa {
            next,
            accepts,
            chars_left: Vec::new(),
        }
        .pruned()
    }

    /// The values both automata take.
    pub fn intersect(&self, other: &ByteDfa) -> Result<ByteDfa, String> {
        let mut ids = HashMap::from([((0u16, 0u16), 0u16)]);
        let mut queue = VecDeque::from([(0u16, 0u16)]);
        let mut next = Vec::new();
        let mut accepts = Vec::new();
        while let Some((a, b)) = queue.pop_front() {
            accepts.push(self.accepts(a) && other.accepts(b));
            for byte in 0..=255u8 {
                let (Some(x), Some(y)) = (self.next(a, byte), other.next(b, byte)) else {
                    next.push(DEAD);
                    continue;
                };
                let id = match ids.get(&(x, y)) {
                    Some(&id) => id,
                    None => {
                        if ids.len() >= MAX_STATES {
                            return Err(format!(
                                "together they need more than {MAX_STATES} automaton states"
                            ));
                        }
                        let id = ids.len() as u16;
                        ids.insert((x, y), id);
                        queue.push_back((x, y));
                        id
                    }
                };
                next.push(id);
            }
        }
        ByteDfa {
            next,
            accepts,
            chars_left: Vec::new(),
        }
        .pruned()
    }

    /// Keeps the states from which an accepting one can be reached (transitions into the others become dead),
    /// renumbered with the start first; errors when the start is not among them (nothing matches).
    fn pruned(self) -> Result<ByteDfa, String> {
        let n = self.accepts.len();
        let mut into: Vec<Vec<u16>> = vec![Vec::new(); n];
        for s in 0..n {
            for &t in &self.next[s * 256..(s + 1) * 256] {
                if t != DEAD && into[t as usize].last() != Some(&(s as u16)) {
                    into[t as usize].push(s as u16);
                }
            }
        }
        let mut live = self.accepts.clone();
        let mut queue: VecDeque<usize> = (0..n).filter(|&s| live[s]).collect();
        while let Some(t) = queue.pop_front() {
            for &s in &into[t] {
                if !live[s as usize] {
                    live[s as usize] = true;
                    queue.push_back(s as usize);
                }
            }
        }
        if !live[0] {
            return Err("no value matches it".into());
        }
        let mut renumber = vec![DEAD; n];
        let mut kept = 0u16;
        for s in 0..n {
            if live[s] {
                renumber[s] = kept;
                kept += 1;
            }
        }
        let mut next = Vec::with_capacity(kept as usize * 256);
        let mut accepts = Vec::with_capacity(kept as usize);
        for s in (0..n).filter(|&s| live[s]) {
            accepts.push(self.accepts[s]);
            next.extend(self.next[s * 256..(s + 1) * 256].iter().map(|&t| {
                if t == DEAD {
                    DEAD
                } else {
                    renumber[t as usize]
                }
            }));
        }
        let chars_left = chars_left(&next, &accepts);
        Ok(ByteDfa {
            next,
            accepts,
            chars_left,
        })
    }
}

/// The fewest characters from each state to an accepting one (a breadth-first search backwards from the accepting
/// states, where a UTF-8 continuation byte adds no character).
fn chars_left(next: &[u16], accepts: &[bool]) -> Vec<u32> {
    let n = accepts.len();
    let mut into: Vec<Vec<(u16, bool)>> = vec![Vec::new(); n];
    for s in 0..n {
        for (b, &t) in next[s * 256..(s + 1) * 256].iter().enumerate() {
            if t != DEAD {
                into[t as usize].push((s as u16, !(0x80..=0xBF).contains(&b)));
            }
        }
    }
    let mut dist = vec![u32::MAX; n];
    let mut queue = VecDeque::new();
    for s in (0..n).filter(|&s| accepts[s]) {
        dist[s] = 0;
        queue.push_back(s);
    }
    // 0-1 breadth first: a continuation byte's edge goes to the front.
    while let Some(t) = queue.pop_front() {
        for &(s, counts) in &into[t] {
            let d = dist[t] + u32::from(counts);
            if d < dist[s as usize] {
                dist[s as usize] = d;
                if counts {
                    queue.push_back(s as usize);
                } else {
                    queue.push_front(s as usize);
                }
            }
        }
    }
    dist
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(_: u8) -> bool {
        true
    }

    #[test]
    fn regexes_match_whole_strings_only() {
        let d = ByteDfa::from_regex("ab|abc|x[0-9]+", any).unwrap();
        for (s, m) in [
            ("ab", true),
            ("abc", true),
            ("a", false),
            ("abcd", false),
            ("x1", true),
            ("x", false),
            ("x12a", false),
        ] {
            assert_eq!(d.matches(s.as_bytes()), m, "{s}");
        }
        // Anchors resolve at the ends; `$` needs the end of the input.
        let d = ByteDfa::from_regex("(?s:.)*(?:^a|b$)(?s:.)*", any).unwrap();
        for (s, m) in [
            ("a", true),
            ("ax", true),
            ("xa", false),
            ("xb", true),
            ("bx", false),
        ] {
            assert_eq!(d.matches(s.as_bytes()), m, "{s}");
        }
    }

    #[test]
    fn every_state_can_still_finish() {
        // Without quotes allowed, `"` can never be written: the alternative that needs it is gone, and no state
        // leads only into it.
        let d = ByteDfa::from_regex("a\"b|ac", |b| b != b'"').unwrap();
        assert!(d.matches(b"ac"));
        assert_eq!(d.next(0, b'a').and_then(|s| d.next(s, b'"')), None);
        let e = ByteDfa::from_regex("\"", |b| b != b'"').unwrap_err();
        assert!(e.contains("no value"), "{e}");
        // A regex that could match invalid UTF-8 is refused; so is one regex-automata cannot build.
        assert!(ByteDfa::from_regex("(?-u:\\xFF)", any).is_err());
        assert!(ByteDfa::from_regex("a(", any).is_err());
    }

    #[test]
    fn intersections_take_what_both_take() {
        let letters = ByteDfa::from_regex("[a-zé]+", any).unwrap();
        let two_or_three = ByteDfa::char_count(2, Some(3)).unwrap();
        let d = letters.intersect(&two_or_three).unwrap();
        for (s, m) in [
            ("a", false),
            ("ab", true),
            ("éé", true),
            ("abé", true),
            ("abcd", false),
        ] {
            assert_eq!(d.matches(s.as_bytes()), m, "{s}");
        }
        // No state is left that cannot finish: after three letters only the end remains.
        let s = b"abc".iter().try_fold(0, |s, &b| d.next(s, b)).unwrap();
        assert!(
            d.accepts(s)
                && d.first_bytes().count() > 0
                && (0..=255).all(|b| d.next(s, b).is_none())
        );
        // The fewest characters still to write: "ab" -> 0 more, "a" -> 1, start -> 2.
        assert_eq!(d.chars_left(0), 2);
        assert_eq!(d.chars_left(d.next(0, b'a').unwrap()), 1);
        let e = d.next(0, 0xC3).unwrap();
        // A lead byte counts its character; its continuation byte adds none.
        assert_eq!(
            (d.chars_left(e), d.chars_left(d.next(e, 0xA9).unwrap())),
            (1, 1)
        );
        let at_least_two = ByteDfa::char_count(2, None).unwrap();
        assert!(!at_least_two.matches(b"a") && at_least_two.matches("aé".as_bytes()));
        assert!(ByteDfa::from_regex("a{5}", any)
            .unwrap()
            .intersect(&ByteDfa::char_count(0, Some(3)).unwrap())
            .is_err());
    }

    #[test]
    fn multiples_follow_the_remainder() {
        let ints = ByteDfa::from_regex("-?(?:0|[1-9][0-9]*)", any).unwrap();
        let d = ints.intersect(&ByteDfa::multiples_of(7).unwrap()).unwrap();
        for n in -200i64..=200 {
            assert_eq!(d.matches(n.to_string().as_bytes()), n % 7 == 0, "{n}");
        }
        assert!(!d.matches(b"07") && !d.matches(b"-"));
        assert!(ByteDfa::multiples_of(0).is_err());
        // Found by the output-constraint fuzz target: sizes near u64::MAX are refused, not wrapped.
        for m in [u64::MAX, u64::MAX - 1, (MAX_STATES - 1) as u64] {
            assert!(ByteDfa::multiples_of(m).is_err(), "{m}");
        }
        assert!(ByteDfa::multiples_of((MAX_STATES - 2) as u64).is_ok());
    }
}
