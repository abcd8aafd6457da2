//! EAGLE-3 drafting: a one-layer head that reads three of the target's hidden states (low, middle, high layers)
//! and drafts tokens for a few percent of a target step (shared/EAGLE3.md; the head's layout and forward pass are
//! in [`head`]).
//!
//! The decode loop captures the head's target layers in every target forward (prefill and verify) and hands the
//! rows that stay in the context to [`Drafter::observe_target`]. At the next proposal the head first runs over
//! those positions (row p: the target's features at p and the embedding of token p + 1, at position p), which
//! extends its own KV cache; the last row's logits give the first draft token. Each further draft token feeds the
//! head's previous output back with the new token's embedding, one position on. Those draft-step rows leave the
//! head's cache again afterwards: once the target has verified the tokens, their rows are recomputed from the
//! target's real features (as SGLang does after verify).

pub mod check;
pub mod head;

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use crate::backend::cpu::KvCache;
use crate::draft::{Draft, Drafter};
use crate::error::{Error, Result};
use crate::model::{Model, RowMatrix};
use crate::sampling::{self, Distribution, SamplingParams};

pub use head::{Eagle3Head, HeadConfig};

pub struct Eagle3Drafter<'a> {
    head: &'a Eagle3Head,
    target: &'a dyn Model,
    /// Target layers captured for the head, low to high.
    layers: Vec<usize>,
    /// The head's KV cache: one row per target position `0..cache.len()`, each computed from the target's
    /// features.
    cache: KvCache,
    /// Target features (3H a row) of positions `cache.len()..`, not yet run through the head.
    features: Vec<f32>,
    rng: ChaCha20Rng,
}

impl<'a> Eagle3Drafter<'a> {
    /// A drafter for `target` with `head`, checked against each other (widths, vocabulary, layer ids).
    pub fn new(head: &'a Eagle3Head, target: &'a dyn Model, seed: u64) -> Result<Self> {
        let c = target.config();
        head.check_target(c)?;
        let layers = head.config.target_layers(c.num_layers)?;
        Ok(Eagle3Drafter {
            head,
            target,
            layers,
            cache: head.new_cache(c.context_length),
            features: Vec::new(),
            rng: ChaCha20Rng::seed_from_u64(seed ^ 0xea91_e3d2),
        })
    }

    /// Wires the head to other target layers than its config names (the wiring check compares them).
    pub fn with_layers(mut self, layers: Vec<usize>) -> Result<Self> {
        let n = self.target.config().num_layers;
        if layers.len() != 3 || layers.iter().any(|&l| l >= n) {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 target layers {layers:?}: three ids below the target's {n} layers"
            )));
        }
        self.layers = layers;
        Ok(self)
    }

    fn feature_width(&self) -> usize {
        3 * self.head.config.target_hidden
    }

    fn embeddings(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        match self.head.own_embedding(tokens) {
            Some(e) => Ok(e),
            None => self.target.embed_tokens(tokens),
        }
    }

    /// The draft token from the head's logits over its vocabulary (as a target id) and, when sampling, the
    /// distribution it was drawn from.
    fn choose(&mut self, logits: &[f32], sampling: &SamplingParams) -> (u32, Option<Distribution>) {
        if sampling.is_greedy() {
            return (self.head.target_id(sampling::argmax(logits) as usize), None);
        }
        let mut dist = sampling::distribution(logits, sampling);
        for id in &mut dist.ids {
            *id = self.head.target_id(*id as usize);
        }
        let token = sampling::draw(&dist, &mut self.rng);
        (token, Some(dist))
    }
}

impl Drafter for Eagle3Drafter<'_> {
    fn method(&self) -> &'static str {
        "eagle3"
    }

    fn target_layers(&self) -> &[usize] {
        &self.layers
    }

    fn observe_target(
        &mut self,
        first_position: usize,
        hidden: &[(usize, Box<dyn RowMatrix>)],
        kept: usize,
    ) -> Result<()> {
        let width = self.feature_width();
        let known = self.cache.len() + self.features.len() / width;
        if first_position > known {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 drafter: target features of position {first_position} arrived before those of {known}"
            )));
        }
        // Positions seen again (the target re-ran them) replace what the head had.
        if first_position < self.cache.len() {
            self.cache.truncate(first_position);
            self.features.clear();
        } else {
            self.features
                .truncate((first_position - self.cache.len()) * width);
        }
        let mut mats = Vec::with_capacity(3);
        for &layer in &self.layers {
            let m = hidden
                .iter()
                .find(|(l, _)| *l == layer)
                .map(|(_, m)| m.as_ref())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "EAGLE-3 drafter: the target forward did not capture layer {layer}"
                    ))
                })?;
            mats.push(m);
        }
        for r in 0..kept {
            for m in &mats {
                self.features.extend_from_slice(&m.row(r)?);
            }
        }
        Ok(())
    }

    fn propose(&mut self, context: &[u32], k: usize, sampling: &SamplingParams) -> Result<Draft> {
        if k == 0 || context.len() < 2 {
            return Ok(Draft::default());
        }
        // The pending token sits at position `base`; rows cache.len()..base still need the head.
        let base = context.len() - 1;
        let width = self.feature_width();
        let from = self.cache.len();
        let rows = self.features.len() / width;
        if from + rows != base {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 drafter: target features cover positions up to {} but the context has {base} before \
                 the pending token (was observe_target called after every target forward?)",
                from + rows
            )));
        }
        let room = self.cache.capacity().saturating_sub(base);
        let k = k.min(room);
        if rows == 0 || k == 0 {
            return Ok(Draft::default());
        }
        let x = self.head.fc(&self.features, rows);
        let embeds = self.embeddings(&context[from + 1..=base])?;
        let (mut out, mut logits) = self.head.forward(&embeds, &x, rows, &mut self.cache)?;
        self.features.clear();
        let fed = self.cache.len();
        let h = self.head.config.layer.hidden_size;
        let mut tokens = Vec::with_capacity(k);
        let mut distributions = Vec::with_capacity(k);
        for i in 0..k {
            let (token, dist) = self.choose(&logits, sampling);
            tokens.push(token);
            distributions.extend(dist);
            if i + 1 < k {
                let last = out[out.len() - h..].to_vec();
                let e = self.embeddings(&[token])?;
                (out, logits) = self.head.forward(&e, &last, 1, &mut self.cache)?;
            }
        }
        // Draft-step rows leave the head's cache: verified positions get rows from the target's features.
        self.cache.truncate(fed);
        Ok(Draft {
            tokens,
            distributions: (!sampling.is_greedy()).then_some(distributions),
        })
    }
}

#[cfg(test)]
mod tests;
