//! A prefix cache: finished generations' KV caches, kept so that a later request whose prompt starts the same way
//! (a chat's next turn, requests sharing a system prompt or a few-shot preamble, the same prompt again) copies
//! those positions' keys and values instead of computing them (vLLM's automatic prefix caching, SGLang's radix
//! cache, llama.cpp's prompt cache).
//!
//! Entries are whole caches, least recently used first out, within a byte budget the owner sets (a server's KV
//! memory, shared with its running requests). A request takes a copy of the rows it needs, so one entry serves
//! any number of requests and stays valid. The rows copied are exactly the ones the request would have computed
//! (same tokens at the same positions, row-independent kernels), so outputs do not change.

use super::generation::{CachedPrefix, Generation};
use crate::error::Result;

struct Entry {
    prefix: CachedPrefix,
    bytes: usize,
    last_used: u64,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    bytes: usize,
    clock: u64,
}

impl Default for PrefixCache {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixCache {
    /// Fewest positions worth reusing: shorter matches (a chat template's first tokens) save less prefill than
    /// the copy and the lookup cost.
    pub const MIN_POSITIONS: usize = 16;
    /// Entries kept at most (each lookup compares the prompt with every entry).
    pub const MAX_ENTRIES: usize = 256;

    pub fn new() -> Self {
        PrefixCache {
            entries: Vec::new(),
            bytes: 0,
            clock: 0,
        }
    }

    /// Memory its entries hold, as counted by [`Self::insert`].
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keeps `prefix`, which holds `bytes` of memory. An entry it answers for (positions it extends, as an
    /// earlier turn of the same conversation, with the drafter state that entry had, if any) leaves: the new one
    /// serves every request that one would. A prefix that an entry already answers for is not kept. A prefix
    /// without drafter state (its request had none, or let it go under load) never replaces one with it:
    /// requests with an EAGLE-3 head can only start from positions whose features their head has seen (on this
    /// CPU, a head server whose drafters were let go at 8 streams found no usable prefix at 1 stream: 0% of
    /// prompt tokens cached, time to first token 32 -> 398 ms).
    pub fn insert(&mut self, prefix: CachedPrefix, bytes: usize) {
        if prefix.tokens.len() < Self::MIN_POSITIONS {
            return;
        }
        self.clock += 1;
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| answers(&e.prefix, &prefix))
        {
            e.last_used = self.clock;
            return;
        }
        let mut freed = 0;
        self.entries.retain(|e| {
            let superseded = answers(&prefix, &e.prefix);
            if superseded {
                freed += e.bytes;
            }
            !superseded
        });
        self.bytes -= freed;
        self.bytes += bytes;
        self.entries.push(Entry {
            prefix,
            bytes,
            last_used: self.clock,
        });
        while self.entries.len() > Self::MAX_ENTRIES {
            self.evict_one();
        }
    }

    /// Whether an entry already holds `tokens` (at its start), with drafter state when `with_drafter`: keeping
    /// them again would add nothing.
    pub fn covers(&self, tokens: &[u32], with_drafter: bool) -> bool {
        self.entries.iter().any(|e| {
            starts_with(&e.prefix.tokens, tokens) && (e.prefix.drafter.is_some() || !with_drafter)
        })
    }

    /// The most positions of one entry `generation` could reuse as it is, and without its drafter
    /// ([`Generation::prefix_reach_without_drafter`]).
    pub fn reaches(&self, generation: &Generation<'_>) -> (usize, usize) {
        let usable = |n: usize| if n >= Self::MIN_POSITIONS { n } else { 0 };
        self.entries.iter().fold((0, 0), |(with, without), e| {
            (
                with.max(usable(generation.prefix_reach(&e.prefix))),
                without.max(usable(generation.prefix_reach_without_drafter(&e.prefix))),
            )
        })
    }

    /// Starts `generation` from the entry it can reuse the most positions of, when that is at least
    /// [`Self::MIN_POSITIONS`]; returns the positions reused (0: none).
    pub fn adopt_into(&mut self, generation: &mut Generation<'_>) -> Result<usize> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, generation.prefix_reach(&e.prefix)))
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)));
        let Some((i, n)) = best.filter(|&(_, n)| n >= Self::MIN_POSITIONS) else {
            return Ok(0);
        };
        generation.adopt_prefix(&self.entries[i].prefix, n)?;
        self.clock += 1;
        self.entries[i].last_used = self.clock;
        Ok(n)
    }

    /// Drops least recently used entries until it holds at most `max_bytes`; returns the bytes freed.
    pub fn shrink_to(&mut self, max_bytes: usize) -> usize {
        let before = self.bytes;
        while self.bytes > max_bytes && !self.entries.is_empty() {
            self.evict_one();
        }
        before - self.bytes
    }

    fn evict_one(&mut self) {
        if let Some(i) = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| e.last_used)
            .map(|(i, _)| i)
        {
            let e = self.entries.swap_remove(i);
            self.bytes -= e.bytes;
        }
    }
}

fn starts_with(longer: &[u32], shorter: &[u32]) -> bool {
    longer.len() >= shorter.len() && longer[..shorter.len()] == *shorter
}

/// Whether `a` serves every request `b` would: it holds `b`'s positions, and drafter state where `b` has some.
fn answers(a: &CachedPrefix, b: &CachedPrefix) -> bool {
    starts_with(&a.tokens, &b.tokens) && (a.drafter.is_some() || b.drafter.is_none())
}
