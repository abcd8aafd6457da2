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
pub mod compute;
pub mod head;
pub mod train;
pub mod waiting;

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use crate::draft::{BatchedPass, BatchedStart, Draft, Drafter, DrafterPrefix};
use crate::error::{Error, Result};
use crate::model::forward::SequenceCache;
use crate::model::{Model, RowMatrix};
use crate::sampling::{self, Distribution, SamplingParams};

pub use compute::{
    greedy_chain_by_passes, top_log_probs, HeadCompute, HeadInput, HeadOutput, HeadPass, HeadRows,
    HeadWant,
};
pub use head::{Eagle3Head, HeadConfig, HeadPrecision, HostWeights, TreeRow};

/// Tree drafting (SGLang's knobs): `topk` branches a node, `steps` levels, `draft_tokens` nodes kept in all (the
/// pending token not counted; SGLang's num_draft_tokens - 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeShape {
    pub topk: usize,
    pub steps: usize,
    pub draft_tokens: usize,
}

impl TreeShape {
    /// Checks the shape (rows verified at once stay within what tree masks hold).
    pub fn new(topk: usize, steps: usize, draft_tokens: usize) -> Result<Self> {
        if topk == 0 || steps == 0 || draft_tokens == 0 {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 tree: --eagle-topk {topk}, --num-steps {steps} and --num-draft-tokens {} must each be at \
                 least 1 (2 for --num-draft-tokens)",
                draft_tokens + 1
            )));
        }
        if draft_tokens + 1 > 64 {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 tree: --num-draft-tokens {} verifies more than 64 rows at once",
                draft_tokens + 1
            )));
        }
        if draft_tokens > topk + topk * topk * (steps - 1) {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 tree: --num-draft-tokens {} is more than {steps} steps of top-{topk} can propose",
                draft_tokens + 1
            )));
        }
        Ok(TreeShape {
            topk,
            steps,
            draft_tokens,
        })
    }
}

/// A node of the candidate tree during drafting.
struct Candidate {
    /// Target id.
    token: u32,
    /// Index of the parent candidate (None: a child of the last target-fed row).
    parent: Option<usize>,
    depth: usize,
    /// Sum of log-probabilities along the path.
    score: f32,
    /// Once expanded: its head cache slot and output row.
    slot: Option<usize>,
    out: Option<Vec<f32>>,
}

/// Rows of target features a drafter feeds a CPU head in one cycle when drafting beside other requests
/// ([`HeadCompute::catch_up_piece`]'s default): a longer catch-up (a prompt's features) is fed in pieces over
/// several cycles, drafting nothing until it is done, so no step stalls every request (a 4-stream CPU server
/// showed 0.6 s inter-token p99 feeding prompts whole).
pub const MAX_FEED_ROWS_IN_BATCH: usize = 8;

/// Unread target forwards a drafter's prefix-cache state reads at most (a prompt's prefill chunks fit).
const PREFIX_UNREAD_FORWARDS: usize = 8;

/// The default confidence bar of EAGLE-3 chains (`--draft-confidence` with `--draft eagle3`): on
/// shared/prompts/code.jsonl with the qwen2.5-coder-1.5b head on a 2-core CPU (docs/benchmarks.md) bars of
/// 0.2-0.5 gave 1.33-1.42x plain at k = 3-6 against 1.01-1.24x without a bar (0.6: 1.23-1.27x).
pub const DEFAULT_MIN_CONFIDENCE: f64 = 0.4;

pub struct Eagle3Drafter<'a> {
    head: &'a Eagle3Head,
    /// Where the head's passes run (the CPU, or the target's device).
    compute: &'a dyn HeadCompute,
    target: &'a dyn Model,
    /// Target layers captured for the head, low to high.
    layers: Vec<usize>,
    /// The head's KV cache: one row per target position `0..cache.len()`, each computed from the target's
    /// features.
    cache: Box<dyn SequenceCache>,
    /// Target features (3H a row) of positions `cache.len()..`, not yet run through the head.
    features: waiting::WaitingFeatures,
    rng: ChaCha20Rng,
    /// Tree drafting (greedy and sampled decoding); None drafts chains.
    tree: Option<TreeShape>,
    /// Chains stop where the head's estimate that the target accepts the whole draft (the product of its top
    /// probabilities) falls below this; 0 drafts k tokens.
    min_confidence: f64,
    scratch: Vec<f32>,
    /// The chain being drafted (between the passes of a batched draft).
    chain: Option<ChainState>,
}

impl<'a> Eagle3Drafter<'a> {
    /// A drafter for `target` with `head`, checked against each other (widths, vocabulary, layer ids); its head
    /// cache spans the target's context.
    pub fn new(head: &'a Eagle3Head, target: &'a dyn Model, seed: u64) -> Result<Self> {
        Self::with_capacity(head, target, seed, target.config().context_length)
    }

    /// Head cache rows a request of at most `positions` positions (prompt and answer) needs: its positions and
    /// one draft's rows (a chain's up to MAX_DRAFT_TOKENS, a tree's levels of `topk` rows).
    pub fn cache_rows_for(positions: usize, tree: Option<TreeShape>) -> usize {
        let draft_rows = match tree {
            Some(shape) => shape.topk.saturating_mul(shape.steps),
            None => crate::decode::MAX_DRAFT_TOKENS,
        };
        positions.saturating_add(draft_rows).saturating_add(1)
    }

    /// [`Self::new`] with a head cache of `capacity` rows (at most the target's context): a server sizes it to the
    /// request ([`Self::cache_rows_for`]), not the context (64 MB a request on a GPU for the qwen2.5-coder-1.5b
    /// head at its 32k context, beyond the server's KV budget).
    pub fn with_capacity(
        head: &'a Eagle3Head,
        target: &'a dyn Model,
        seed: u64,
        capacity: usize,
    ) -> Result<Self> {
        let c = target.config();
        head.check_target(c)?;
        let layers = head.config.target_layers(c.num_layers)?;
        let compute = head.compute();
        Ok(Eagle3Drafter {
            head,
            compute,
            target,
            layers,
            cache: compute.new_cache(capacity.clamp(1, c.context_length))?,
            features: waiting::WaitingFeatures::new(3 * head.config.target_hidden),
            rng: ChaCha20Rng::seed_from_u64(seed ^ 0xea91_e3d2),
            tree: None,
            min_confidence: 0.0,
            scratch: Vec::new(),
            chain: None,
        })
    }

    /// Chains stop early where the head is unsure, as the draft model's `--draft-confidence` (lossless for any
    /// value: the decision is made before a token is drawn). 0 always drafts k tokens. Trees keep only nodes
    /// whose path probability under the head is at least `c` (and expand no level where none is): a dynamic tree
    /// that verifies fewer rows where the head is unsure, the first nodes of the unpruned tree's order.
    pub fn with_min_confidence(mut self, c: f64) -> Result<Self> {
        crate::draft::model::check_min_confidence(c)?;
        self.min_confidence = c;
        Ok(self)
    }

    /// Drafts trees of `shape` (verified greedily, or by lossless tree sampling: `verify::accept_tree_sampled`).
    pub fn with_tree(mut self, shape: TreeShape) -> Self {
        self.tree = Some(shape);
        self
    }

    /// SGLang-style tree drafting from the last target-fed row (`out_last`, its best tokens `roots`): those form
    /// level 1; at each further level every kept node is expanded by its top-k and the k best candidates by
    /// path probability are kept for the next level; finally the `nodes` best candidates of all levels, by
    /// path probability, form the tree (parents always kept before children).
    fn draft_tree(
        &mut self,
        shape: TreeShape,
        nodes: usize,
        out_last: &[f32],
        roots: &[(f32, usize)],
        base: usize,
    ) -> Result<Draft> {
        let fed = self.cache.len();
        let mut cands: Vec<Candidate> = roots
            .iter()
            .map(|&(lp, id)| Candidate {
                token: self.head.target_id(id),
                parent: None,
                depth: 1,
                score: lp,
                slot: None,
                out: None,
            })
            .collect();
        // Nodes less likely than the bar (a path log-probability below ln(bar)) are neither expanded nor kept:
        // their children score no higher, so what remains is the unpruned tree's best nodes above the bar.
        let bar = if self.min_confidence > 0.0 {
            (self.min_confidence as f32).ln()
        } else {
            f32::NEG_INFINITY
        };
        let mut beams: Vec<usize> = (0..cands.len())
            .filter(|&i| cands[i].score >= bar)
            .collect();
        let mut passes = 1;
        for _level in 1..shape.steps {
            if beams.is_empty() {
                break;
            }
            passes += 1;
            // Expand the beams: each runs through the head at its depth's position, seeing the target-fed rows
            // and its own ancestors.
            let mut rows = Vec::with_capacity(beams.len());
            let mut xs = Vec::new();
            let mut tokens = Vec::with_capacity(beams.len());
            for &b in &beams {
                let c = &cands[b];
                let mut ancestors = Vec::new();
                let mut p = c.parent;
                while let Some(i) = p {
                    ancestors.push(cands[i].slot.expect("ancestors are expanded first"));
                    p = cands[i].parent;
                }
                ancestors.reverse();
                rows.push(TreeRow {
                    position: base - 1 + c.depth,
                    prefix: fed,
                    ancestors,
                });
                match c.parent {
                    Some(i) => {
                        xs.extend_from_slice(cands[i].out.as_ref().expect("expanded parent"))
                    }
                    None => xs.extend_from_slice(out_last),
                }
                tokens.push(c.token);
            }
            let first_slot = self.cache.len();
            let pass = self.compute.run(
                self.target,
                &tokens,
                HeadInput::Hidden(&xs),
                HeadRows::Tree(&rows),
                &mut *self.cache,
                HeadWant {
                    outputs: true,
                    top_only: false,
                    top_k: shape.topk,
                },
            )?;
            let outs = pass.outputs;
            let h = self.head.config.layer.hidden_size;
            let mut children = Vec::new();
            for (j, &b) in beams.iter().enumerate() {
                cands[b].slot = Some(first_slot + j);
                cands[b].out = Some(outs[j * h..(j + 1) * h].to_vec());
                for &(lp, id) in &pass.ranked[j] {
                    children.push(Candidate {
                        token: self.head.target_id(id),
                        parent: Some(b),
                        depth: cands[b].depth + 1,
                        score: cands[b].score + lp,
                        slot: None,
                        out: None,
                    });
                }
            }
            let first_child = cands.len();
            cands.extend(children);
            let mut next: Vec<usize> = (first_child..cands.len()).collect();
            next.sort_by(|&a, &b| cands[b].score.total_cmp(&cands[a].score).then(a.cmp(&b)));
            next.truncate(shape.topk);
            next.retain(|&i| cands[i].score >= bar);
            beams = next;
        }
        self.cache.truncate(fed);
        // The best `nodes` candidates; a node whose parent was not kept is skipped (a child never scores above
        // its parent, so this only matters on ties).
        let mut order: Vec<usize> = (0..cands.len()).collect();
        order.sort_by(|&a, &b| {
            cands[b]
                .score
                .total_cmp(&cands[a].score)
                .then(cands[a].depth.cmp(&cands[b].depth))
                .then(a.cmp(&b))
        });
        let mut index_of = vec![None; cands.len()];
        let mut kept: Vec<usize> = Vec::new();
        for i in order {
            if kept.len() == nodes || cands[i].score < bar {
                break;
            }
            if cands[i].parent.is_none_or(|p| index_of[p].is_some()) {
                index_of[i] = Some(kept.len());
                kept.push(i);
            }
        }
        if kept.is_empty() {
            // Nothing above the bar: no draft this cycle (the head's passes were still paid).
            return Ok(Draft {
                passes,
                ..Draft::default()
            });
        }
        Ok(Draft {
            tokens: kept.iter().map(|&i| cands[i].token).collect(),
            distributions: None,
            parents: Some(
                kept.iter()
                    .map(|&i| {
                        cands[i]
                            .parent
                            .map(|p| index_of[p].expect("parents kept first"))
                    })
                    .collect(),
            ),
            // The first head pass (in propose) and one per expanded level.
            passes,
            catching_up: false,
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

    /// The next draft token from a head pass: the greedy token (as a target id), or the distribution (over
    /// target ids) to draw it from; and the head's probability of its most likely token (computed only when
    /// `confidence` asks; 1 otherwise). Nothing is drawn here: the caller decides whether to stop first, so
    /// stopping cannot depend on the draw.
    fn candidate(
        &mut self,
        pass: &HeadOutput,
        sampling: &SamplingParams,
        confidence: bool,
    ) -> (NextDraft, f32) {
        if let Some(&(best, p)) = pass.top.first() {
            // The pass returned only its top token (greedy chains).
            return (NextDraft::Greedy(self.head.target_id(best as usize)), p);
        }
        let logits = &pass.logits;
        if sampling.is_greedy() {
            let (best, p) = if confidence {
                sampling::top_probability(logits, &mut self.scratch)
            } else {
                (sampling::argmax(logits), 1.0)
            };
            return (NextDraft::Greedy(self.head.target_id(best as usize)), p);
        }
        let mut dist = sampling::distribution(logits, sampling);
        for id in &mut dist.ids {
            *id = self.head.target_id(*id as usize);
        }
        let p = dist.probs.iter().copied().fold(0.0f32, f32::max);
        (NextDraft::Sampled(dist), p)
    }
}

/// A chain between head passes (batched drafting keeps it across the passes of a round).
struct ChainState {
    /// The most tokens it drafts (lowered to what it has when the confidence bar stops it).
    k: usize,
    /// The head cache's length after the first pass (the target-fed rows).
    fed: Option<usize>,
    top_only: bool,
    greedy: bool,
    tokens: Vec<u32>,
    distributions: Vec<Distribution>,
    passes: usize,
    all_accepted: f64,
    /// The first pass feeds only part of the waiting rows: this cycle catches up and drafts nothing.
    catching_up: bool,
}

impl Eagle3Drafter<'_> {
    /// Starts a chain: its first pass feeds the target's rows waiting for the head; with `feed_limit`, at most
    /// that many (more wait: the pass then feeds only and drafts nothing this cycle).
    fn begin_chain(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
        feed_limit: Option<usize>,
    ) -> Result<BatchedStart> {
        if self.tree.is_some() {
            return Ok(BatchedStart::Alone);
        }
        self.abandon_chain();
        let Some((from, rows, k)) = self.waiting_rows(context, k)? else {
            return Ok(BatchedStart::Nothing);
        };
        // Greedy chains need only each pass's top token and its probability (a device head sends back 8 bytes
        // instead of the draft vocabulary's logits).
        let top_only = sampling.is_greedy();
        // Too many rows waiting: feed the oldest `limit` of them and draft nothing this cycle.
        let mut feed = match feed_limit {
            Some(limit) if rows > limit => limit,
            _ => rows,
        };
        // Beside others, a device head feeds rows already on the host (an adopted prefix's, or rows read past the
        // unread cap) by themselves: taken together with rows still on the device, every unread forward they
        // spanned was read back, three synchronous copies each (a 64-row catch-up after undrafted steps: ~190
        // readbacks in one step, every request waiting). The device rows follow in the next pass. Alone, it
        // drafts now instead.
        let host_rows = self.features.host_rows();
        if feed_limit.is_some() && self.compute.reads_device_features() && host_rows > 0 {
            feed = feed.min(host_rows);
        }
        self.chain = Some(ChainState {
            k: if feed < rows { 0 } else { k },
            fed: None,
            top_only,
            greedy: sampling.is_greedy(),
            tokens: Vec::with_capacity(k),
            distributions: Vec::new(),
            passes: 1,
            all_accepted: 1.0,
            catching_up: feed < rows,
        });
        // A device head reads rows still in the target's outputs where they lie; else they come to the host.
        let device_features = if self.compute.reads_device_features() {
            self.features.take_device_rows(feed)?
        } else {
            None
        };
        let features = match device_features {
            Some(_) => None,
            None => Some(self.features.take_rows(feed)?),
        };
        Ok(BatchedStart::Pass(BatchedPass {
            tokens: context[from + 1..=from + feed].to_vec(),
            features,
            device_features,
            want: HeadWant {
                outputs: false,
                top_only,
                top_k: 0,
            },
        }))
    }

    /// Where a draft for `context` starts: the head's cache length, the target-fed rows waiting for the head
    /// (positions `from..base`, the pending token at `base`) and the draft length that fits; None when there is
    /// nothing to draft.
    fn waiting_rows(&self, context: &[u32], k: usize) -> Result<Option<(usize, usize, usize)>> {
        if k == 0 || context.len() < 2 {
            return Ok(None);
        }
        let base = context.len() - 1;
        let from = self.cache.len();
        let rows = self.features.rows();
        if from + rows != base {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 drafter: target features cover positions up to {} but the context has {base} before \
                 the pending token (was observe_target called after every target forward?)",
                from + rows
            )));
        }
        let k = k.min(self.cache.capacity().saturating_sub(base));
        Ok((rows > 0 && k > 0).then_some((from, rows, k)))
    }

    /// A greedy chain whose passes all run on the head's device, with no host round trip between them
    /// ([`HeadCompute::run_greedy_chain`]); None when the head drafts a pass at a time, or the chain does not
    /// draft (a catch-up) or drafts one token. A confidence bar is applied to the returned tops afterwards: the
    /// draft is the one pass-by-pass drafting would stop at, the passes past it wasted (a few µs each on a GPU).
    fn chain_at_once(
        &mut self,
        pass: &BatchedPass,
        sampling: &SamplingParams,
    ) -> Result<Option<Draft>> {
        let Some(st) = self.chain.as_mut() else {
            return Ok(None);
        };
        if !st.top_only || st.k < 2 || st.catching_up {
            return Ok(None);
        }
        let more = st.k - 1;
        // The cache's length once the first pass fed its rows: the draft rows after it leave at the end.
        st.fed = Some(self.cache.len() + pass.tokens.len());
        let input = match (&pass.features, &pass.device_features) {
            (Some(f), _) => HeadInput::Features(f),
            (None, Some(d)) => HeadInput::DeviceFeatures(d),
            (None, None) => HeadInput::Last,
        };
        let ran =
            self.compute
                .run_greedy_chain(self.target, &pass.tokens, input, &mut *self.cache, more);
        let tops = match ran {
            Ok(Some(tops)) => tops,
            Ok(None) => return Ok(None),
            Err(e) => {
                self.abandon_chain();
                return Err(e);
            }
        };
        self.finish_chain(&tops, sampling).map(Some)
    }

    /// A chain's draft from its passes' tops (at least the chain's length of them; later ones, from a batched
    /// chain longer than this one, are not read): the same bookkeeping as pass by pass.
    fn finish_chain(&mut self, tops: &[(u32, f32)], sampling: &SamplingParams) -> Result<Draft> {
        let k = self.chain.as_ref().map_or(0, |st| st.k);
        if tops.len() < k {
            self.abandon_chain();
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 head: a chain of {k} passes returned {} top tokens",
                tops.len()
            )));
        }
        let tops = &tops[..k];
        let draft_vocab = self.head.draft_vocab();
        for &(id, p) in tops {
            if id as usize >= draft_vocab {
                self.abandon_chain();
                return Err(Error::InvalidArgument(format!(
                    "an EAGLE-3 head pass's top token {id} is outside its draft vocabulary of {draft_vocab} \
                     (non-finite logits?)"
                )));
            }
            let output = HeadOutput {
                top: vec![(id, p)],
                ..Default::default()
            };
            // The same bookkeeping as pass by pass; it asks for the next pass while the chain goes on.
            if self.batched_after(output, sampling)?.is_none() {
                break;
            }
        }
        if let Some(st) = self.chain.as_mut() {
            st.passes = tops.len();
        }
        self.batched_finish()
    }

    /// Drops a chain left unfinished (a failed pass): its draft rows leave the head's cache.
    fn abandon_chain(&mut self) {
        if let Some(fed) = self.chain.take().and_then(|st| st.fed) {
            self.cache.truncate(fed);
        }
    }

    /// A tree draft: the first pass feeds the target's rows and keeps its outputs for the tree's roots.
    fn propose_tree(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        let Some(shape) = self.tree else {
            return Err(Error::InvalidArgument(
                "EAGLE-3 drafter: no tree shape".into(),
            ));
        };
        let Some((from, _, k)) = self.waiting_rows(context, k)? else {
            return Ok(Draft::default());
        };
        let base = context.len() - 1;
        let features = self.features.read_all()?;
        let pass = self.compute.run(
            self.target,
            &context[from + 1..=base],
            HeadInput::Features(features),
            HeadRows::Chain,
            &mut *self.cache,
            HeadWant {
                outputs: true,
                top_only: false,
                top_k: shape.topk,
            },
        )?;
        self.features.clear();
        let h = self.head.config.layer.hidden_size;
        let last = pass.outputs[pass.outputs.len() - h..].to_vec();
        self.draft_tree(
            shape,
            k.min(shape.draft_tokens),
            &last,
            &pass.ranked[0],
            base,
        )
    }
}

/// What a chain's next draft position holds before any draw: the greedy token, or the distribution to draw from.
enum NextDraft {
    Greedy(u32),
    Sampled(Distribution),
}

impl Drafter for Eagle3Drafter<'_> {
    fn method(&self) -> &'static str {
        "eagle3"
    }

    fn target_layers(&self) -> &[usize] {
        &self.layers
    }

    fn cheap_catch_up(&self) -> bool {
        // Its catch-up is one head pass over the waiting features (batched with other requests' passes).
        true
    }

    fn catch_up_reach(&self) -> usize {
        self.compute.catch_up_reach()
    }

    fn lag(&self, _context: &[u32]) -> usize {
        // Target features of accepted positions waiting to enter the head's cache.
        self.features.rows()
    }

    fn prefix_state(&self) -> Option<DrafterPrefix> {
        if self.chain.is_some() {
            return None;
        }
        // A cache of just its rows (the drafter's own spans the context length: 64 MB a request on a GPU for the
        // qwen2.5-coder-1.5b head).
        let rows = self.cache.len();
        let mut kept = self.compute.new_cache(rows).ok()?;
        kept.copy_prefix_from(&*self.cache, rows).ok()?;
        Some(DrafterPrefix {
            cache: kept,
            // The rows of at most a few unread forwards, shared where they lie (nothing read): a request ending
            // after many undrafted steps would otherwise hold every step's outputs (the state then reaches less
            // far).
            features: self
                .features
                .first_rows(self.features.rows_of_forwards(PREFIX_UNREAD_FORWARDS))
                .ok()?,
            width: self.feature_width(),
        })
    }

    fn prefix_reach(&self, prefix: &DrafterPrefix, common: usize) -> usize {
        if prefix.width != self.feature_width() {
            return 0;
        }
        // Head row i read token i + 1: rows hold while the contexts agree on tokens 0..=i + 1. Waiting features
        // (position i read tokens 0..=i) extend the reach only where every row is kept.
        let rows_valid = common.saturating_sub(1);
        let rows = prefix.cache.len();
        if rows > rows_valid {
            rows_valid
        } else {
            prefix.positions().min(common)
        }
    }

    fn adopt_prefix(&mut self, prefix: &DrafterPrefix, n: usize) -> Result<()> {
        self.chain = None;
        self.features.clear();
        self.cache.truncate(0);
        let width = self.feature_width();
        if prefix.width != width || n > prefix.positions() {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 drafter: cannot start from {n} positions of a prefix covering {} (feature width {} \
                 against {width})",
                prefix.positions(),
                prefix.width
            )));
        }
        let rows = n.min(prefix.cache.len());
        if let Err(e) = self.cache.copy_prefix_from(&*prefix.cache, rows) {
            self.cache.truncate(0);
            return Err(e);
        }
        self.features = prefix.features.first_rows(n - rows)?;
        Ok(())
    }

    fn observe_target(
        &mut self,
        first_position: usize,
        hidden: &[(usize, Box<dyn RowMatrix>)],
        kept: &[usize],
    ) -> Result<()> {
        let known = self.cache.len() + self.features.rows();
        if first_position > known {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 drafter: target features of position {first_position} arrived before those of {known}"
            )));
        }
        let mut layers: Vec<&dyn RowMatrix> = Vec::with_capacity(self.layers.len());
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
            layers.push(m);
        }
        // Positions seen again (the target re-ran them) replace what the head had.
        if first_position < self.cache.len() {
            self.cache.truncate(first_position);
            self.features.clear();
        } else {
            self.features.truncate(first_position - self.cache.len())?;
        }
        // Kept where they are until the head needs them (a device's outputs: no readback on steps that draft
        // nothing).
        self.features.push(&layers, kept)
    }

    fn propose(&mut self, context: &[u32], k: usize, sampling: &SamplingParams) -> Result<Draft> {
        if self.tree.is_some() {
            return self.propose_tree(context, k);
        }
        // A chain alone: the batched protocol with a batch of one, so both give the same drafts.
        let mut pass = match self.begin_chain(context, k, sampling, None)? {
            BatchedStart::Pass(p) => p,
            BatchedStart::Nothing | BatchedStart::Alone => return Ok(Draft::default()),
        };
        if let Some(draft) = self.chain_at_once(&pass, sampling)? {
            return Ok(draft);
        }
        loop {
            let input = match (&pass.features, &pass.device_features) {
                (Some(f), _) => HeadInput::Features(f),
                (None, Some(d)) => HeadInput::DeviceFeatures(d),
                (None, None) => HeadInput::Last,
            };
            let ran = self.compute.run(
                self.target,
                &pass.tokens,
                input,
                HeadRows::Chain,
                &mut *self.cache,
                pass.want,
            );
            let output = match ran {
                Ok(o) => o,
                Err(e) => {
                    self.abandon_chain();
                    return Err(e);
                }
            };
            match self.batched_after(output, sampling)? {
                Some(next) => pass = next,
                None => return self.batched_finish(),
            }
        }
    }

    fn batched_begin(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
        beside_others: bool,
    ) -> Result<BatchedStart> {
        // Beside other requests a long catch-up (a prompt's features) is fed a few rows a step, so no step
        // stalls every request through it; alone it is fed whole.
        let limit = beside_others.then(|| self.compute.catch_up_piece());
        self.begin_chain(context, k, sampling, limit)
    }

    fn batched_cache(&mut self) -> Option<&mut dyn SequenceCache> {
        Some(&mut *self.cache)
    }

    fn batched_after(
        &mut self,
        output: HeadOutput,
        sampling: &SamplingParams,
    ) -> Result<Option<BatchedPass>> {
        let mut st = self.chain.take().ok_or_else(|| {
            Error::InvalidArgument("EAGLE-3 drafter: a head pass arrived outside a draft".into())
        })?;
        // The first pass fed the target's rows: draft rows after them leave the cache when the draft is done.
        st.fed.get_or_insert(self.cache.len());
        if st.k == 0 {
            // A pass that only fed waiting rows (a catch-up in pieces): no draft this cycle.
            self.chain = Some(st);
            return Ok(None);
        }
        let (candidate, p) = self.candidate(&output, sampling, self.min_confidence > 0.0);
        st.all_accepted *= p as f64;
        let mut next = None;
        if st.all_accepted >= self.min_confidence {
            let token = match candidate {
                NextDraft::Greedy(token) => token,
                NextDraft::Sampled(dist) => {
                    let token = sampling::draw(&dist, &mut self.rng);
                    st.distributions.push(dist);
                    token
                }
            };
            st.tokens.push(token);
            if st.tokens.len() < st.k {
                st.passes += 1;
                next = Some(BatchedPass {
                    tokens: vec![token],
                    features: None,
                    device_features: None,
                    want: HeadWant {
                        outputs: false,
                        top_only: st.top_only,
                        top_k: 0,
                    },
                });
            }
        } else {
            // Stopped by the confidence bar before any draw: nothing more this draft.
            st.k = st.tokens.len();
        }
        self.chain = Some(st);
        Ok(next)
    }

    fn batched_alone(
        &mut self,
        pass: &BatchedPass,
        sampling: &SamplingParams,
    ) -> Result<Option<Draft>> {
        self.chain_at_once(pass, sampling)
    }

    fn batched_chain_more(&self) -> Option<usize> {
        let st = self.chain.as_ref()?;
        (st.top_only && st.k >= 2 && !st.catching_up).then(|| st.k - 1)
    }

    fn batched_chain_finish(
        &mut self,
        fed: usize,
        tops: &[(u32, f32)],
        sampling: &SamplingParams,
    ) -> Result<Draft> {
        let Some(st) = self.chain.as_mut() else {
            return Err(Error::InvalidArgument(
                "EAGLE-3 drafter: a batched chain finished with no draft begun".into(),
            ));
        };
        // The chain's rows after the first pass's leave the head's cache at the end, as for a chain alone.
        st.fed = Some(fed);
        self.finish_chain(tops, sampling)
    }

    fn batched_finish(&mut self) -> Result<Draft> {
        let st = self
            .chain
            .take()
            .ok_or_else(|| Error::InvalidArgument("EAGLE-3 drafter: no draft to finish".into()))?;
        // Draft-step rows leave the head's cache: verified positions get rows from the target's features.
        if let Some(fed) = st.fed {
            self.cache.truncate(fed);
        }
        Ok(Draft {
            tokens: st.tokens,
            distributions: (!st.greedy).then_some(st.distributions),
            parents: None,
            passes: st.passes,
            catching_up: st.catching_up,
        })
    }
}

#[cfg(test)]
mod tests;
