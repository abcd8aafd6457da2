//! JSON mode (OpenAI's `response_format: {"type": "json_object"}`): the output is constrained to one JSON object.
//!
//! A byte-level automaton ([`JsonState`]) accepts exactly the prefixes of `ws* object`, where `object` is a JSON
//! object (RFC 8259; strings may hold any byte of 0x20 and up, so a token may end inside a UTF-8 character). Before
//! each token is chosen, every token whose bytes would leave that language gets a logit of minus infinity; stop
//! tokens are allowed only once the object is closed, and then only they are. The mask is a logit adjustment like
//! the penalties (decode/generation.rs), applied to each verify row after the draft tokens it follows, so
//! speculation stays lossless against plain decoding in JSON mode; drafters propose without it and lose only
//! acceptance.
//!
//! A mask depends only on the automaton's state, which is small and `Copy`; [`JsonVocabulary`] computes each
//! state's mask once (a pass over the vocabulary) and keeps it for every request of the same tokenizer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// Containers (objects and arrays) open at once, at most.
pub const MAX_DEPTH: u8 = 64;
/// Whitespace bytes in a row, at most: JSON allows any number, and a model that starts emitting blank lines
/// inside a constrained object may never stop.
pub const MAX_WHITESPACE_RUN: u8 = 64;
/// States whose masks are kept (about vocabulary / 8 bytes each: 19 KB for Qwen's 151,936 tokens).
const MASK_CACHE_STATES: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mode {
    /// Before the object: whitespace or `{`.
    Start,
    /// After `{`: a key or `}`.
    ObjectOpen,
    /// After `,` in an object: a key.
    KeyNext,
    /// After a key: `:`.
    Colon,
    /// After `:`, or `,` in an array: a value.
    Value,
    /// After `[`: a value or `]`.
    ArrayOpen,
    /// After a value in a container: `,` or the container's closing bracket.
    AfterValue,
    String {
        key: bool,
        escape: Escape,
    },
    Number(NumberPart),
    /// `true`, `false` or `null` (index into LITERALS), `matched` bytes of it read.
    Literal {
        word: u8,
        matched: u8,
    },
    /// The object is closed: only a stop token may follow.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Escape {
    None,
    Backslash,
    /// Hex digits of a `\u` escape still to come.
    Hex(u8),
}

/// Where a number is: after `-`, a lone `0`, integer digits, `.`, fraction digits, `e`, the exponent's sign, its
/// digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum NumberPart {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// How far a prefix of the output has come through one JSON object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct JsonState {
    mode: Mode,
    /// Containers open.
    depth: u8,
    /// Bit i: container i (0 outermost) is an object, else an array.
    objects: u64,
    /// Whitespace bytes just read in a row.
    spaces: u8,
}

impl Default for JsonState {
    fn default() -> Self {
        JsonState {
            mode: Mode::Start,
            depth: 0,
            objects: 0,
            spaces: 0,
        }
    }
}

impl JsonState {
    /// The object is complete.
    pub fn is_done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// The state after `bytes`, or None where they leave the language.
    pub fn after(mut self, bytes: &[u8]) -> Option<JsonState> {
        for &b in bytes {
            if !self.step(b) {
                return None;
            }
        }
        Some(self)
    }

    fn in_object(&self) -> bool {
        self.depth > 0 && self.objects >> (self.depth - 1) & 1 == 1
    }

    fn open(&mut self, object: bool) -> bool {
        if self.depth >= MAX_DEPTH {
            return false;
        }
        let bit = 1u64 << self.depth;
        self.objects = if object {
            self.objects | bit
        } else {
            self.objects & !bit
        };
        self.depth += 1;
        self.mode = if object {
            Mode::ObjectOpen
        } else {
            Mode::ArrayOpen
        };
        true
    }

    fn close(&mut self) -> bool {
        self.depth -= 1;
        self.objects &= !(1u64 << self.depth);
        self.mode = if self.depth == 0 {
            Mode::Done
        } else {
            Mode::AfterValue
        };
        true
    }

    /// The first byte of a value.
    fn value(&mut self, b: u8) -> bool {
        self.mode = match b {
            b'{' => return self.open(true),
            b'[' => return self.open(false),
            b'"' => Mode::String {
                key: false,
                escape: Escape::None,
            },
            b'-' => Mode::Number(NumberPart::Minus),
            b'0' => Mode::Number(NumberPart::Zero),
            b'1'..=b'9' => Mode::Number(NumberPart::Int),
            b't' => Mode::Literal {
                word: 0,
                matched: 1,
            },
            b'f' => Mode::Literal {
                word: 1,
                matched: 1,
            },
            b'n' => Mode::Literal {
                word: 2,
                matched: 1,
            },
            _ => return false,
        };
        true
    }

    fn step(&mut self, b: u8) -> bool {
        let whitespace = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        // A number ends at the first byte that cannot continue it, which the container then reads.
        if let Mode::Number(part) = self.mode {
            let next = match (part, b) {
                (NumberPart::Minus, b'0') => Some(NumberPart::Zero),
                (NumberPart::Minus, b'1'..=b'9') => Some(NumberPart::Int),
                (NumberPart::Int, b'0'..=b'9') => Some(NumberPart::Int),
                (NumberPart::Zero | NumberPart::Int, b'.') => Some(NumberPart::Dot),
                (NumberPart::Dot | NumberPart::Frac, b'0'..=b'9') => Some(NumberPart::Frac),
                (NumberPart::Zero | NumberPart::Int | NumberPart::Frac, b'e' | b'E') => {
                    Some(NumberPart::E)
                }
                (NumberPart::E, b'+' | b'-') => Some(NumberPart::ESign),
                (NumberPart::E | NumberPart::ESign | NumberPart::Exp, b'0'..=b'9') => {
                    Some(NumberPart::Exp)
                }
                _ => None,
            };
            match next {
                Some(part) => {
                    self.mode = Mode::Number(part);
                    return true;
                }
                None if matches!(
                    part,
                    NumberPart::Zero | NumberPart::Int | NumberPart::Frac | NumberPart::Exp
                ) =>
                {
                    self.mode = Mode::AfterValue
                }
                None => return false,
            }
        }
        if whitespace
            && matches!(
                self.mode,
                Mode::Start
                    | Mode::ObjectOpen
                    | Mode::KeyNext
                    | Mode::Colon
                    | Mode::Value
                    | Mode::ArrayOpen
                    | Mode::AfterValue
            )
        {
            if self.spaces >= MAX_WHITESPACE_RUN {
                return false;
            }
            self.spaces += 1;
            return true;
        }
        self.spaces = 0;
        match self.mode {
            Mode::Start => b == b'{' && self.open(true),
            Mode::ObjectOpen | Mode::KeyNext => match b {
                b'"' => {
                    self.mode = Mode::String {
                        key: true,
                        escape: Escape::None,
                    };
                    true
                }
                b'}' if self.mode == Mode::ObjectOpen => self.close(),
                _ => false,
            },
            Mode::Colon => {
                self.mode = Mode::Value;
                b == b':'
            }
            Mode::Value => self.value(b),
            Mode::ArrayOpen => {
                if b == b']' {
                    self.close()
                } else {
                    self.value(b)
                }
            }
            Mode::AfterValue => match b {
                b',' => {
                    self.mode = if self.in_object() {
                        Mode::KeyNext
                    } else {
                        Mode::Value
                    };
                    true
                }
                b'}' if self.in_object() => self.close(),
                b']' if !self.in_object() => self.close(),
                _ => false,
            },
            Mode::String { key, escape } => {
                let escape = match (escape, b) {
                    (Escape::None, b'"') => {
                        self.mode = if key { Mode::Colon } else { Mode::AfterValue };
                        return true;
                    }
                    (Escape::None, b'\\') => Escape::Backslash,
                    (Escape::None, 0..=0x1f) => return false,
                    (Escape::None, _) => Escape::None,
                    (Escape::Backslash, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                        Escape::None
                    }
                    (Escape::Backslash, b'u') => Escape::Hex(4),
                    (Escape::Hex(n), b) if b.is_ascii_hexdigit() => {
                        if n == 1 {
                            Escape::None
                        } else {
                            Escape::Hex(n - 1)
                        }
                    }
                    _ => return false,
                };
                self.mode = Mode::String { key, escape };
                true
            }
            Mode::Literal { word, matched } => {
                let literal = LITERALS[word as usize];
                if literal[matched as usize] != b {
                    return false;
                }
                let matched = matched + 1;
                self.mode = if matched as usize == literal.len() {
                    Mode::AfterValue
                } else {
                    Mode::Literal { word, matched }
                };
                true
            }
            Mode::Number(_) => unreachable!("a number reads its own bytes above"),
            Mode::Done => false,
        }
    }
}

/// A tokenizer's tokens as bytes, with the masks of the states met so far: one a tokenizer, shared by every
/// request in JSON mode.
pub struct JsonVocabulary {
    /// Each token's bytes; None for tokens that never appear in JSON output (special tokens that do not stop).
    tokens: Vec<Option<Box<[u8]>>>,
    /// Sorted.
    stop: Vec<u32>,
    masks: Mutex<HashMap<JsonState, Arc<[u64]>>>,
}

impl JsonVocabulary {
    pub fn new(tokenizer: &Tokenizer) -> Arc<Self> {
        let special = tokenizer.special_tokens();
        let tokens = (0..tokenizer.vocab_size() as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                (!bytes.is_empty() && special.binary_search(&id).is_err())
                    .then(|| bytes.into_boxed_slice())
            })
            .collect();
        Self::from_tokens(tokens, tokenizer.stop_tokens().to_vec())
    }

    /// From tokens' bytes directly (None: never allowed) and the stop tokens.
    pub fn from_tokens(tokens: Vec<Option<Box<[u8]>>>, mut stop: Vec<u32>) -> Arc<Self> {
        stop.sort_unstable();
        stop.dedup();
        Arc::new(JsonVocabulary {
            tokens,
            stop,
            masks: Mutex::new(HashMap::new()),
        })
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    fn is_stop(&self, token: u32) -> bool {
        self.stop.binary_search(&token).is_ok()
    }

    /// The state after `token`: stop tokens leave it as it is; None where the token leaves the language.
    pub fn advance(&self, state: JsonState, token: u32) -> Option<JsonState> {
        if self.is_stop(token) {
            return state.is_done().then_some(state);
        }
        state.after(self.tokens.get(token as usize)?.as_deref()?)
    }

    /// The tokens allowed in `state`, one bit each (bit t % 64 of word t / 64).
    pub fn mask(&self, state: JsonState) -> Arc<[u64]> {
        if let Some(mask) = self
            .masks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&state)
        {
            return mask.clone();
        }
        let mut mask = vec![0u64; self.tokens.len().div_ceil(64)];
        for (t, bytes) in self.tokens.iter().enumerate() {
            let allowed = if self.is_stop(t as u32) {
                state.is_done()
            } else {
                bytes.as_deref().is_some_and(|b| state.after(b).is_some())
            };
            if allowed {
                mask[t / 64] |= 1 << (t % 64);
            }
        }
        let mask: Arc<[u64]> = mask.into();
        let mut masks = self.masks.lock().unwrap_or_else(|e| e.into_inner());
        if masks.len() >= MASK_CACHE_STATES {
            masks.clear();
        }
        masks.insert(state, mask.clone());
        mask
    }

    /// Sets the logits of the tokens `state` does not allow to minus infinity. Errors where it allows none (a
    /// vocabulary without the bytes JSON needs), rather than sampling from nothing.
    pub fn apply(&self, state: JsonState, logits: &mut [f32]) -> Result<()> {
        let mask = self.mask(state);
        let mut any = false;
        // Rows past the tokenizer's vocabulary (a model's padded embedding rows) are never allowed.
        let words = mask.iter().copied().chain(std::iter::repeat(0));
        for (chunk, word) in logits.chunks_mut(64).zip(words) {
            any |= word != 0;
            if word == u64::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if word >> i & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if !any {
            return Err(Error::InvalidArgument(
                "JSON mode: no token of this vocabulary continues the JSON output here".into(),
            ));
        }
        Ok(())
    }
}

impl PartialEq for JsonVocabulary {
    fn eq(&self, other: &Self) -> bool {
        self.tokens == other.tokens && self.stop == other.stop
    }
}

impl std::fmt::Debug for JsonVocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonVocabulary")
            .field("tokens", &self.tokens.len())
            .field("stop", &self.stop)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(text: &str) -> Option<JsonState> {
        JsonState::default().after(text.as_bytes())
    }

    #[test]
    fn whole_objects_are_accepted_and_done() {
        for doc in [
            "{}",
            " \n{ } ",
            r#"{"a": 1, "b": [true, false, null, -0.5e+10, 0, 12.25E3], "c": {"d": "x\"\\\/\b\f\n\r\t\u00e9"}}"#,
            r#"{"nested": [[[]], {}, [{"k": []}]], "s": "héllo ✓"}"#,
            "{\n  \"pretty\": [\n    1,\n    2\n  ]\n}",
        ] {
            // Whitespace after the object is refused: only a stop token may follow.
            let trimmed = doc.trim_end();
            if trimmed.len() < doc.len() {
                assert!(accepts(doc).is_none(), "{doc:?} was accepted");
            }
            let state = accepts(trimmed).unwrap_or_else(|| panic!("{doc} was refused"));
            assert!(state.is_done(), "{doc}");
            assert!(serde_json::from_str::<serde_json::Value>(doc).is_ok());
        }
    }

    #[test]
    fn prefixes_are_accepted_and_not_done() {
        let doc = r#"{"a": [1.5, "x\u00e9", {"b": null}], "c": -3}"#;
        for end in 0..doc.len() {
            let state = accepts(&doc[..end]).unwrap_or_else(|| panic!("{} refused", &doc[..end]));
            assert!(!state.is_done(), "{} is not a whole object", &doc[..end]);
        }
        assert!(accepts(doc).unwrap().is_done());
    }

    #[test]
    fn invalid_json_is_refused_at_the_first_wrong_byte() {
        for (doc, valid_prefix) in [
            ("[1]", ""),                  // the top level must be an object
            ("\"s\"", ""),                // so must this
            ("{a: 1}", "{"),              // keys are strings
            ("{\"a\" 1}", "{\"a\" "),     // a colon between key and value
            ("{\"a\": 01}", "{\"a\": 0"), // no leading zeros
            ("{\"a\": 1.}", "{\"a\": 1."),
            ("{\"a\": -}", "{\"a\": -"),
            ("{\"a\": tru}", "{\"a\": tru"),
            ("{\"a\": 1,}", "{\"a\": 1,"),
            ("{\"a\": [1,]}", "{\"a\": [1,"),
            ("{\"a\": [1}", "{\"a\": [1"),
            ("{\"a\": \"\\x\"}", "{\"a\": \"\\"),
            ("{\"a\": \"\\u12g4\"}", "{\"a\": \"\\u12"),
            ("{\"a\": \"tab\there\"}", "{\"a\": \"tab"),
            ("{} {}", "{}"),
            ("{}}", "{}"),
        ] {
            assert!(accepts(doc).is_none(), "{doc} was accepted");
            assert!(
                accepts(valid_prefix).is_some(),
                "{valid_prefix} was refused"
            );
            let bad = doc.as_bytes()[valid_prefix.len()];
            assert!(
                accepts(valid_prefix).unwrap().after(&[bad]).is_none(),
                "{doc}: byte {:?} after {valid_prefix}",
                bad as char
            );
        }
    }

    #[test]
    fn depth_and_whitespace_runs_are_bounded() {
        let deep = format!("{{\"a\": {}", "[".repeat(MAX_DEPTH as usize - 1));
        let state = accepts(&deep).unwrap();
        assert!(state.after(b"[").is_none());
        let spaces = " ".repeat(MAX_WHITESPACE_RUN as usize);
        assert!(accepts(&format!("{{{spaces}")).is_some());
        assert!(accepts(&format!("{{{spaces} ")).is_none());
        // A run ends at any other byte.
        assert!(accepts(&format!("{{{spaces}\"a\":{spaces}1{spaces}}}")).is_some());
    }

    #[test]
    fn masks_allow_exactly_the_tokens_that_keep_the_prefix_valid() {
        let words = [
            "{", "}", "{\"", "\":", " ", "\n", "  ", "\"", "a", "key", ",", ":", "[", "]", "1",
            "0", "12", ".", "5", "e", "-", "true", "tr", "ue", "null", "\\", "u", "00", "é", "\"}",
            "}\n",
        ];
        let mut tokens: Vec<Option<Box<[u8]>>> = words
            .iter()
            .map(|w| Some(w.as_bytes().to_vec().into_boxed_slice()))
            .collect();
        tokens.push(None); // a special token
        let stop = tokens.len() as u32;
        tokens.push(Some(b"<|end|>".to_vec().into_boxed_slice()));
        let vocab = JsonVocabulary::from_tokens(tokens, vec![stop]);
        for prefix in [
            "",
            "{",
            "{\"a",
            "{\"a\":",
            "{\"a\": 1",
            "{\"a\": [tr",
            "{\"a\": \"\\u0",
            "{}",
        ] {
            let state = accepts(prefix).unwrap();
            let mask = vocab.mask(state);
            for t in 0..vocab.len() {
                let allowed = mask[t / 64] >> (t % 64) & 1 == 1;
                let expected = if t as u32 == stop {
                    state.is_done()
                } else {
                    words
                        .get(t)
                        .is_some_and(|w| state.after(w.as_bytes()).is_some())
                };
                assert_eq!(allowed, expected, "prefix {prefix:?}, token {t}");
            }
            // A model's padded rows past the tokenizer's vocabulary are masked too.
            let mut logits = vec![0.0f32; vocab.len() + 70];
            vocab.apply(state, &mut logits).unwrap();
            for (t, l) in logits.iter().enumerate() {
                let allowed = t < vocab.len() && mask[t / 64] >> (t % 64) & 1 == 1;
                assert_eq!(l.is_finite(), allowed, "prefix {prefix:?}, token {t}");
            }
        }
        // Once done only the stop token is allowed, and it leaves the state as it is.
        let done = accepts("{}").unwrap();
        assert_eq!(vocab.advance(done, stop), Some(done));
        assert_eq!(vocab.advance(accepts("{").unwrap(), stop), None);
        assert_eq!(vocab.advance(done, 1), None);
        // A state no token continues is an error, not a row of minus infinities.
        let lonely =
            JsonVocabulary::from_tokens(vec![Some(b"x".to_vec().into_boxed_slice())], vec![]);
        let mut logits = vec![0.0f32];
        assert!(lonely.apply(JsonState::default(), &mut logits).is_err());
    }
}
