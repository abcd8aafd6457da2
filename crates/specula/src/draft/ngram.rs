//! Prompt lookup (n-gram) drafting: find the most recent earlier occurrence of the context's last n tokens and
//! propose what followed it. No model; costs microseconds; strong on code and on answers that quote the prompt.

use crate::draft::{Draft, Drafter};
use crate::error::{Error, Result};
use crate::sampling::SamplingParams;

pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
}

impl NgramDrafter {
    pub fn new(min_n: usize, max_n: usize) -> Result<Self> {
        if min_n == 0 || max_n < min_n {
            return Err(Error::InvalidArgument(format!(
                "n-gram lengths must satisfy 1 <= --ngram-min <= --ngram-max (got {min_n} and {max_n})"
            )));
        }
        Ok(NgramDrafter { min_n, max_n })
    }
}

impl Drafter for NgramDrafter {
    fn method(&self) -> &'static str {
        "ngram"
    }

    fn propose(&mut self, context: &[u32], k: usize, _sampling: &SamplingParams) -> Result<Draft> {
        let len = context.len();
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let pattern = &context[len - n..];
            // Most recent earlier match: scan backwards, excluding the suffix itself.
            for start in (0..len - n).rev() {
                if &context[start..start + n] == pattern {
                    let follow = start + n;
                    let end = (follow + k).min(len);
                    if follow < end {
                        return Ok(Draft {
                            tokens: context[follow..end].to_vec(),
                            distributions: None,
                        });
                    }
                }
            }
        }
        Ok(Draft::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_the_continuation_of_the_latest_match() {
        let mut d = NgramDrafter::new(1, 3).unwrap();
        let ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3];
        // Longest suffix [1,2,3] last occurred at 5..8, followed by 5, 6.
        let draft = d.propose(&ctx, 3, &SamplingParams::default()).unwrap();
        assert_eq!(draft.tokens, vec![5, 6, 1]);
        assert_eq!(
            d.propose(&[7, 8, 9], 3, &SamplingParams::default())
                .unwrap()
                .tokens,
            Vec::<u32>::new()
        );
        assert!(NgramDrafter::new(0, 2).is_err());
        assert!(NgramDrafter::new(3, 2).is_err());
    }
}
