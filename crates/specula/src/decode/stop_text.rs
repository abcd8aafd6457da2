//! Stop sequences (OpenAI's `stop`, the CLI's `--stop`): generated text is released as it comes, except its tail
//! while that could still be the start of a stop sequence; once one appears the text before it is the answer
//! and generation stops (the caller sets `GenerateRequest::cancel`, honoured at the next step boundary).

use crate::error::{Error, Result};

/// Checks a request's stop sequences: each non-empty (an empty one would stop before any text).
pub fn check_stop_sequences(stops: &[String]) -> Result<()> {
    if stops.iter().any(String::is_empty) {
        return Err(Error::InvalidArgument(
            "a stop sequence must not be empty".into(),
        ));
    }
    Ok(())
}

/// Where the earliest stop sequence begins in `text[from..]` (a byte offset into `text`), if one does.
/// `from` is the length already released: a sequence cannot begin before it (`releasable` holds back every
/// byte that could).
pub fn find_stop(text: &str, from: usize, stops: &[String]) -> Option<usize> {
    let from = from.min(text.len());
    stops
        .iter()
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| i + from))
        .min()
}

/// How much of `text` may be released while no stop sequence has appeared: all but the last (longest - 1)
/// bytes, cut back to a character boundary.
pub fn releasable(text: &str, stops: &[String]) -> usize {
    let longest = stops.iter().map(|s| s.len()).max().unwrap_or(0);
    if longest == 0 {
        return text.len();
    }
    let mut cut = text.len().saturating_sub(longest - 1);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

/// A generation's text passed through its stop sequences, for callers that only need the text.
#[derive(Debug, Clone, Default)]
pub struct StopText {
    stops: Vec<String>,
    produced: String,
    released: usize,
    stopped: bool,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> Result<Self> {
        check_stop_sequences(&stops)?;
        Ok(StopText {
            stops,
            ..Default::default()
        })
    }

    /// Takes a piece of generated text and returns what can be released now (nothing once stopped).
    pub fn push(&mut self, piece: &str) -> &str {
        if self.stopped {
            return "";
        }
        self.produced.push_str(piece);
        let upto = match find_stop(&self.produced, self.released, &self.stops) {
            Some(at) => {
                self.produced.truncate(at);
                self.stopped = true;
                at
            }
            None => releasable(&self.produced, &self.stops),
        };
        let from = self.released;
        self.released = upto.max(from);
        &self.produced[from..self.released]
    }

    /// The text held back at the end of generation (nothing more can complete a stop sequence).
    pub fn finish(&mut self) -> &str {
        let from = self.released;
        self.released = self.produced.len();
        &self.produced[from..]
    }

    /// Whether a stop sequence appeared.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The answer so far: everything before the stop sequence once one appeared.
    pub fn text(&self) -> &str {
        &self.produced
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pieces: &[&str], stops: &[&str]) -> (Vec<String>, String, bool) {
        let mut s = StopText::new(stops.iter().map(|s| s.to_string()).collect()).unwrap();
        let mut out: Vec<String> = pieces.iter().map(|p| s.push(p).to_string()).collect();
        out.push(s.finish().to_string());
        (out, s.text().to_string(), s.stopped())
    }

    #[test]
    fn text_before_a_stop_sequence_is_the_answer_even_across_pieces() {
        // "END" arrives split over three pieces; the text before it comes out, none of it after.
        let (out, text, stopped) = run(&["abc E", "N", "D tail", "more"], &["END", "zz"]);
        assert!(stopped);
        assert_eq!(text, "abc ");
        assert_eq!(out.concat(), "abc ");
        // Held back while it could begin a stop sequence: "abc" went out first, " E" only after "END" failed...
        assert_eq!(out[0], "abc");
        // ...and nothing comes out after the stop.
        assert_eq!(out[3], "");
    }

    #[test]
    fn without_a_stop_everything_comes_out_in_order() {
        let (out, text, stopped) = run(&["héllo", " wör", "ld"], &["wörld!"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "héllo wörld");
        assert_eq!(text, "héllo wörld");
        // Cuts fall on character boundaries (ö is two bytes): each released piece is valid UTF-8 by type.
        let (out, _, _) = run(&["aö", "b"], &["xyz"]);
        assert_eq!(out.concat(), "aöb");
        // No stop sequences: nothing is held back.
        let (out, _, _) = run(&["a", "b"], &[]);
        assert_eq!(out, vec!["a", "b", ""]);
    }

    #[test]
    fn releasable_keeps_back_what_could_start_a_stop_sequence() {
        assert_eq!(releasable("hello wor", &[]), 9);
        assert_eq!(releasable("hello wor", &["world".into()]), 5);
        // Never splits a character.
        assert_eq!(releasable("aé", &["xy".into()]), 1);
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_empty_ones_are_refused() {
        let (_, text, stopped) = run(&["one two three"], &["three", "two"]);
        assert!(stopped);
        assert_eq!(text, "one ");
        assert_eq!(find_stop("xxabab", 2, &["ab".into()]), Some(2));
        assert_eq!(find_stop("abab", 3, &["ab".into()]), None);
        let err = StopText::new(vec!["ok".into(), String::new()]).unwrap_err();
        assert!(
            err.to_string().contains("stop sequence must not be empty"),
            "{err}"
        );
    }
}
