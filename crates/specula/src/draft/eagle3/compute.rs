//! Where an EAGLE-3 head's forward pass runs: on the CPU ([`Eagle3Head`] itself) or on the target's device (a
//! twin the target's backend makes, e.g. backend/cuda/head.rs), behind one interface the drafter uses.
//!
//! The interface is shaped so a device head moves little across the bus: the drafter hands it token ids (the
//! device embeds them from the target's own table), target features for the rows they feed, and for each further
//! chain step only the new token (the previous step's output stays in the head's cache object, `HeadInput::Last`).
//! Back come the draft-vocabulary logits of the rows that need them, and the rows' outputs only when asked (trees).

use crate::backend::cpu::KvCache;
use crate::error::{Error, Result};
use crate::model::forward::SequenceCache;
use crate::model::Model;

use super::head::{Eagle3Head, TreeRow};
use super::waiting::DeviceFeatureRows;

/// The hidden input (x) of the rows of a head pass.
#[derive(Debug, Clone, Copy)]
pub enum HeadInput<'a> {
    /// Target features (3H a row, low ++ mid ++ high), run through fc first.
    Features(&'a [f32]),
    /// The same rows where they lie in the head's device memory (a head whose
    /// [`HeadCompute::reads_device_features`] says it reads them).
    DeviceFeatures(&'a DeviceFeatureRows),
    /// Head outputs of earlier passes (h a row), fed back.
    Hidden(&'a [f32]),
    /// One row: the last row's output of the previous pass on the same cache.
    Last,
}

/// Where the rows of a head pass go and what they see.
#[derive(Debug, Clone, Copy)]
pub enum HeadRows<'a> {
    /// Positions `cache.len()..` in order, each seeing every slot up to its own; logits of the last row only.
    Chain,
    /// One row per `TreeRow` (written at slots `cache.len()..`); logits of every row.
    Tree(&'a [TreeRow]),
}

/// What a head pass should return besides its effect on the cache.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeadWant {
    /// Each row's output (trees feed them back).
    pub outputs: bool,
    /// Only each logits row's top draft token and its probability (a greedy chain's needs), not the row.
    pub top_only: bool,
    /// When > 0 (and not `top_only`): only each logits row's `top_k` most probable draft tokens with their
    /// log-probabilities (a tree expanding its nodes), not the row.
    pub top_k: usize,
}

/// What a head pass returns.
#[derive(Debug, Clone, Default)]
pub struct HeadOutput {
    /// Each row's output (n x h; the next pass's x), when asked for; else empty.
    pub outputs: Vec<f32>,
    /// Draft-vocabulary logits, rows x draft_vocab: the last row of a chain, every row of a tree (empty with
    /// `top_only`).
    pub logits: Vec<f32>,
    /// With `top_only`: each logits row's largest logit's draft id (the first on ties) and its softmax
    /// probability.
    pub top: Vec<(u32, f32)>,
    /// With `top_k`: each logits row's best (log-probability, draft id), best first ([`top_log_probs`]).
    pub ranked: Vec<Vec<(f32, usize)>>,
}

/// The `k` largest (log-probability, draft id) of `logits` (softmax over the draft vocabulary), best first; ties
/// by the smaller id.
pub fn top_log_probs(logits: &[f32], k: usize) -> Vec<(f32, usize)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    // One pass keeping the k best so far (k is a handful; sorting the whole vocabulary cost ~0.4 ms a row).
    let better = |a: usize, b: usize| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)).is_gt();
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for i in 0..logits.len() {
        if best.len() == k && !better(i, best[k - 1]) {
            continue;
        }
        let at = best
            .iter()
            .position(|&b| better(i, b))
            .unwrap_or(best.len());
        best.insert(at, i);
        best.truncate(k);
    }
    best.into_iter()
        .map(|i| ((logits[i] as f64 - log_z) as f32, i))
        .collect()
}

/// One sequence's chain rows in a batched head pass ([`HeadCompute::run_many`]).
pub struct HeadPass<'a> {
    pub tokens: &'a [u32],
    pub input: HeadInput<'a>,
    pub cache: &'a mut dyn SequenceCache,
    pub want: HeadWant,
}

/// Each sequence's greedy chain: the top (draft id, probability) of every pass ([`HeadCompute::run_greedy_chains`]).
pub type Chains = Vec<Vec<(u32, f32)>>;

/// A head's forward pass on some device.
pub trait HeadCompute: Send + Sync {
    /// Where it runs, e.g. "cpu" or "cuda:0 (NVIDIA H200)".
    fn device(&self) -> String;

    /// An empty cache of up to `capacity` positions (the head's keys and values, and its last output).
    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>>;

    /// Runs `tokens.len()` rows (row i: the embedding of `tokens[i]` and the i-th row of `input`) through the
    /// head's decoder layer, appending them to `cache`. `target` is the model the head drafts for (a CPU head
    /// reads its embedding through it).
    fn run(
        &self,
        target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &mut dyn SequenceCache,
        want: HeadWant,
    ) -> Result<HeadOutput>;

    /// How its matrices are held where it runs, when that differs from the head's own weight types (a GPU twin
    /// holds f32 and f16 matrices as bf16 tiles, quantized ones as its native GEMV formats), e.g. "bf16" or
    /// "nibble/scaled int8". None: as the head holds them.
    fn held_as(&self) -> Option<String> {
        None
    }

    /// Captures, before serving, the passes a server's greedy rounds may run (on a GPU, a CUDA graph for each
    /// padded pass shape), so a load's first steps do not pay for captures; returns how many it captured. 0 by
    /// default (nothing to prepare).
    fn prepare_passes(&self) -> Result<usize> {
        Ok(0)
    }

    /// Passes captured as CUDA graphs (or the like) so far while running, not those [`Self::prepare_passes`]
    /// captured. A capture costs several passes' time, so a step that
    /// made one says nothing about what passes cost: the server's draft budget leaves such steps out.
    fn graphs_captured(&self) -> u64 {
        0
    }

    /// Rows of target features a drafter feeds this head in one cycle beside other requests (a longer catch-up,
    /// a prompt's features, goes in pieces over several cycles drafting nothing, so no step stalls every
    /// request). On a CPU a row costs about a target row's 1/30 (a 4-stream CPU server showed 0.6 s inter-token
    /// p99 feeding prompts whole): 8. A GPU pass is flat in its rows up to a chunk (CUDA head: 64).
    fn catch_up_piece(&self) -> usize {
        super::MAX_FEED_ROWS_IN_BATCH
    }

    /// The longest catch-up (tokens) its drafter resumes with beside other requests: a few pieces
    /// ([`Self::catch_up_piece`]), a new request's prompt, not a long cut's backlog fed for tens of steps while
    /// drafting nothing.
    fn catch_up_reach(&self) -> usize {
        reach_override().unwrap_or(8 * self.catch_up_piece())
    }

    /// Whether passes may feed target features where they lie in the device's memory
    /// ([`HeadInput::DeviceFeatures`]); a CPU head reads host rows only.
    fn reads_device_features(&self) -> bool {
        false
    }

    /// Chain passes of several sequences (each with its own cache) at once: what a server's requests drafting
    /// with one head share. Each output is what `run` would return for that pass alone. By default one pass
    /// after the other.
    fn run_many(&self, target: &dyn Model, passes: &mut [HeadPass<'_>]) -> Result<Vec<HeadOutput>> {
        run_one_by_one(self, target, passes)
    }

    /// A whole greedy chain at once: the chain pass `run` would make for `tokens` and `input` (its top token is
    /// the first draft), then `more` one-row passes, each fed the previous pass's top token (as a target id)
    /// and its output, with nothing coming back to the host in between. Returns the top (draft id, probability)
    /// of every pass, `more + 1` of them, and leaves the cache as that many `run` calls would. `None`: this
    /// head drafts a pass at a time, and the caller loops `run` (a CPU head: its passes cost more than a round
    /// trip, and a confidence bar may stop the chain early).
    fn run_greedy_chain(
        &self,
        _target: &dyn Model,
        _tokens: &[u32],
        _input: HeadInput<'_>,
        _cache: &mut dyn SequenceCache,
        _more: usize,
    ) -> Result<Option<Vec<(u32, f32)>>> {
        Ok(None)
    }

    /// Greedy chains of several sequences at once: the first passes `run_many` would make (greedy: each pass's
    /// top token is its sequence's first draft), then `more` rounds of one-row passes, each sequence's fed its
    /// previous top token (as a target id) and output, with nothing coming back to the host in between. Returns
    /// each sequence's tops, `more + 1` of them, and leaves each cache as that many `run` calls would. `None`:
    /// this head runs rounds one at a time (the caller loops `run_many`: a CPU head, or passes it cannot chain).
    fn run_greedy_chains(
        &self,
        _target: &dyn Model,
        _passes: &mut [HeadPass<'_>],
        _more: usize,
    ) -> Result<Option<Chains>> {
        Ok(None)
    }

    /// `work`'s device kernels timed one by one, in launch order ([`crate::model::Model::time_kernels`]); None
    /// where the head runs no kernels to time (the CPU).
    fn time_kernels(
        &self,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Vec<crate::profile::KernelTime>>> {
        let _ = work;
        Ok(None)
    }
}

/// [`HeadCompute::run_greedy_chain`] as `run` calls one after the other, each fed the previous top token: the
/// reference a device's chain must equal, token for token.
pub fn greedy_chain_by_passes<H: HeadCompute + ?Sized>(
    head: &H,
    target: &dyn Model,
    draft_to_target: &[u32],
    tokens: &[u32],
    input: HeadInput<'_>,
    cache: &mut dyn SequenceCache,
    more: usize,
) -> Result<Vec<(u32, f32)>> {
    let want = HeadWant {
        outputs: false,
        top_only: true,
        top_k: 0,
    };
    let mut tops = Vec::with_capacity(more + 1);
    let mut out = head.run(target, tokens, input, HeadRows::Chain, cache, want)?;
    for step in 0..=more {
        let top = top_of(&out, draft_to_target.len())?;
        tops.push(top);
        if step < more {
            let next = [draft_to_target[top.0 as usize]];
            out = head.run(target, &next, HeadInput::Last, HeadRows::Chain, cache, want)?;
        }
    }
    Ok(tops)
}

/// What [`HeadCompute::run_greedy_chains`] returns, by rounds of [`HeadCompute::run_many`]: the passes, then
/// `more` rounds each feeding every sequence its previous top token (as a target id) from its last output. The
/// reference a head's chains are checked against.
pub fn greedy_chains_by_rounds<H: HeadCompute + ?Sized>(
    head: &H,
    target: &dyn Model,
    draft_to_target: &[u32],
    passes: &mut [HeadPass<'_>],
    more: usize,
) -> Result<Chains> {
    let want = HeadWant {
        outputs: false,
        top_only: true,
        top_k: 0,
    };
    let mut chains: Chains = vec![Vec::with_capacity(more + 1); passes.len()];
    let mut outs = head.run_many(target, passes)?;
    for step in 0..=more {
        for (chain, out) in chains.iter_mut().zip(&outs) {
            chain.push(top_of(out, draft_to_target.len())?);
        }
        if step == more {
            break;
        }
        let next: Vec<[u32; 1]> = chains
            .iter()
            .map(|c| [draft_to_target[c[step].0 as usize]])
            .collect();
        let mut round: Vec<HeadPass<'_>> = passes
            .iter_mut()
            .zip(&next)
            .map(|(p, token)| HeadPass {
                tokens: token,
                input: HeadInput::Last,
                cache: &mut *p.cache,
                want,
            })
            .collect();
        outs = head.run_many(target, &mut round)?;
    }
    Ok(chains)
}

/// The top token of a `top_only` chain pass, checked to be a draft id.
fn top_of(out: &HeadOutput, draft_vocab: usize) -> Result<(u32, f32)> {
    match out.top.first() {
        Some(&(id, p)) if (id as usize) < draft_vocab => Ok((id, p)),
        Some(&(id, _)) => Err(Error::InvalidArgument(format!(
            "an EAGLE-3 head pass's top token {id} is outside its draft vocabulary of {draft_vocab} (non-finite \
             logits?)"
        ))),
        None => Err(Error::InvalidArgument(
            "an EAGLE-3 head pass returned no top token".into(),
        )),
    }
}

/// `SPECULA_HEAD_CATCH_UP_REACH=N`: every head's catch-up reach ([`HeadCompute::catch_up_reach`]), to compare.
pub fn reach_override() -> Option<usize> {
    static REACH: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *REACH.get_or_init(|| {
        std::env::var("SPECULA_HEAD_CATCH_UP_REACH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    })
}

fn device_features_on_cpu() -> Error {
    Error::InvalidArgument(
        "an EAGLE-3 head on the CPU was handed target features in a device's memory".into(),
    )
}

/// Consecutive runs of passes that one batched pass of at most `max_rows` rows can take: each pass's rows
/// (`rows[i]`) and input kind (`kinds[i]`: passes of different kinds never share a pass). A pass longer than
/// `max_rows` is a group of its own (it runs alone, in pieces). Packing in order keeps each sequence's output
/// where the caller expects it; splitting a round this way instead of running the whole round pass by pass
/// keeps a server's 16 requests fed a few rows each at two or three passes rather than sixteen.
pub fn pass_groups(rows: &[usize], kinds: &[u8], max_rows: usize) -> Vec<std::ops::Range<usize>> {
    debug_assert_eq!(rows.len(), kinds.len());
    let mut groups = Vec::new();
    let mut start = 0;
    let mut total = 0;
    for i in 0..rows.len() {
        let fits = i > start && kinds[i] == kinds[start] && total + rows[i] <= max_rows;
        if i > start && !fits {
            groups.push(start..i);
            start = i;
            total = 0;
        }
        total += rows[i];
    }
    if start < rows.len() {
        groups.push(start..rows.len());
    }
    groups
}

/// Chain passes of several sequences, one `run` after the other (the default `run_many`, and a device's when a
/// batch does not fit its batched pass).
pub fn run_one_by_one<H: HeadCompute + ?Sized>(
    head: &H,
    target: &dyn Model,
    passes: &mut [HeadPass<'_>],
) -> Result<Vec<HeadOutput>> {
    passes
        .iter_mut()
        .map(|p| {
            head.run(
                target,
                p.tokens,
                p.input,
                HeadRows::Chain,
                &mut *p.cache,
                p.want,
            )
        })
        .collect()
}

/// Checks a pass's inputs against each other (shared by every implementation).
pub fn check_pass(
    tokens: &[u32],
    input: HeadInput<'_>,
    rows: HeadRows<'_>,
    target_hidden: usize,
    hidden: usize,
) -> Result<()> {
    let n = tokens.len();
    if n == 0 {
        return Err(Error::InvalidArgument(
            "an EAGLE-3 head pass over no rows".into(),
        ));
    }
    let (have, width, what) = match input {
        HeadInput::Features(f) => (f.len(), 3 * target_hidden, "target features"),
        HeadInput::DeviceFeatures(d) => {
            if let Some(bad) = d
                .rows
                .iter()
                .find(|r| r.iter().map(|p| p.1).sum::<usize>() != 3 * target_hidden)
            {
                return Err(Error::InvalidArgument(format!(
                    "EAGLE-3 head pass: a device feature row {} wide, the head reads {}",
                    bad.iter().map(|p| p.1).sum::<usize>(),
                    3 * target_hidden
                )));
            }
            (
                d.rows.len() * 3 * target_hidden,
                3 * target_hidden,
                "target features on the device",
            )
        }
        HeadInput::Hidden(x) => (x.len(), hidden, "hidden inputs"),
        HeadInput::Last => (n, 1, "rows fed from the last output"),
    };
    if have != n * width || (matches!(input, HeadInput::Last) && n != 1) {
        return Err(Error::InvalidArgument(format!(
            "EAGLE-3 head pass: {n} tokens but {have} values of {what} ({width} a row{})",
            if matches!(input, HeadInput::Last) {
                "; the last output feeds one row"
            } else {
                ""
            }
        )));
    }
    if let HeadRows::Tree(tree) = rows {
        if tree.len() != n {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 head pass: {n} tokens but {} tree rows",
                tree.len()
            )));
        }
    }
    Ok(())
}

/// The CPU head's cache: its KV cache and the last output row.
pub struct CpuHeadCache {
    pub kv: KvCache,
    last: Vec<f32>,
}

impl SequenceCache for CpuHeadCache {
    fn len(&self) -> usize {
        self.kv.len()
    }

    fn capacity(&self) -> usize {
        SequenceCache::capacity(&self.kv)
    }

    fn truncate(&mut self, len: usize) {
        self.kv.truncate(len);
    }

    fn keep_new_rows(&mut self, base: usize, rows: &[usize]) -> Result<()> {
        self.kv.keep_new_rows(base, rows)
    }

    fn copy_prefix_from(&mut self, src: &dyn SequenceCache, n: usize) -> Result<()> {
        let src = src.as_any().downcast_ref::<CpuHeadCache>().ok_or_else(|| {
            Error::InvalidArgument(
                "a CPU head cache can take positions only from another CPU head cache".into(),
            )
        })?;
        self.kv.copy_prefix(&src.kv, n)?;
        // The next pass feeds target features (no chain continues from an earlier output).
        self.last.clear();
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl Eagle3Head {
    /// What a pass returns from its rows' outputs and its logits rows.
    fn pass_output(&self, outputs: Vec<f32>, logits: Vec<f32>, want: HeadWant) -> HeadOutput {
        let mut out = HeadOutput {
            outputs: if want.outputs { outputs } else { Vec::new() },
            ..Default::default()
        };
        if want.top_only {
            let mut scratch = Vec::new();
            out.top = logits
                .chunks_exact(self.config.draft_vocab)
                .map(|row| crate::sampling::top_probability(row, &mut scratch))
                .collect();
        } else if want.top_k > 0 {
            out.ranked = logits
                .chunks_exact(self.config.draft_vocab)
                .map(|row| top_log_probs(row, want.top_k))
                .collect();
        } else {
            out.logits = logits;
        }
        out
    }
}

impl HeadCompute for Eagle3Head {
    fn device(&self) -> String {
        "cpu".into()
    }

    /// One layer pass over every sequence's rows: the matrix products read the head's weights once for all
    /// (each row's result is bitwise what it would be alone: the CPU kernels are row-independent).
    fn run_many(&self, target: &dyn Model, passes: &mut [HeadPass<'_>]) -> Result<Vec<HeadOutput>> {
        if passes.len() == 1 {
            let p = &mut passes[0];
            return Ok(vec![self.run(
                target,
                p.tokens,
                p.input,
                HeadRows::Chain,
                &mut *p.cache,
                p.want,
            )?]);
        }
        let h = self.config.layer.hidden_size;
        let meta: Vec<(usize, HeadWant)> =
            passes.iter().map(|p| (p.tokens.len(), p.want)).collect();
        let mut tokens = Vec::new();
        let mut x = Vec::new();
        let mut caches = Vec::with_capacity(passes.len());
        for p in passes.iter_mut() {
            check_pass(
                p.tokens,
                p.input,
                HeadRows::Chain,
                self.config.target_hidden,
                h,
            )?;
            let n = p.tokens.len();
            tokens.extend_from_slice(p.tokens);
            let cache = p
                .cache
                .as_any_mut()
                .downcast_mut::<CpuHeadCache>()
                .ok_or_else(|| {
                    Error::InvalidArgument(
                        "the EAGLE-3 head's cache belongs to another device".into(),
                    )
                })?;
            match p.input {
                HeadInput::Features(f) => x.extend(self.fc(f, n)),
                HeadInput::DeviceFeatures(_) => return Err(device_features_on_cpu()),
                HeadInput::Hidden(rows) => x.extend_from_slice(rows),
                HeadInput::Last => {
                    if cache.last.len() != h {
                        return Err(Error::InvalidArgument(
                            "EAGLE-3 head pass fed from the last output before any pass".into(),
                        ));
                    }
                    x.extend_from_slice(&cache.last);
                }
            }
            caches.push((cache, n));
        }
        let embeds = match self.own_embedding(&tokens) {
            Some(e) => e,
            None => target.embed_tokens(&tokens)?,
        };
        let mut groups: Vec<super::head::LayerGroup<'_>> = caches
            .iter_mut()
            .map(|(c, n)| super::head::LayerGroup::chain(&mut c.kv, *n))
            .collect();
        let outputs = self.layer_groups(&embeds, &x, &mut groups)?;
        drop(groups);
        let mut lasts = Vec::with_capacity(meta.len() * h);
        let mut row0 = 0;
        for (cache, n) in caches.iter_mut() {
            let last = &outputs[(row0 + *n - 1) * h..(row0 + *n) * h];
            cache.last.clear();
            cache.last.extend_from_slice(last);
            lasts.extend_from_slice(last);
            row0 += *n;
        }
        let logits = self.logits_of_rows(&lasts, meta.len());
        let dv = self.config.draft_vocab;
        let mut row0 = 0;
        Ok(meta
            .iter()
            .enumerate()
            .map(|(i, &(n, want))| {
                let out = self.pass_output(
                    outputs[row0 * h..(row0 + n) * h].to_vec(),
                    logits[i * dv..(i + 1) * dv].to_vec(),
                    want,
                );
                row0 += n;
                out
            })
            .collect())
    }

    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>> {
        Ok(Box::new(CpuHeadCache {
            kv: Eagle3Head::new_cache(self, capacity),
            last: Vec::new(),
        }))
    }

    fn run(
        &self,
        target: &dyn Model,
        tokens: &[u32],
        input: HeadInput<'_>,
        rows: HeadRows<'_>,
        cache: &mut dyn SequenceCache,
        want: HeadWant,
    ) -> Result<HeadOutput> {
        let h = self.config.layer.hidden_size;
        check_pass(tokens, input, rows, self.config.target_hidden, h)?;
        let cache = cache
            .as_any_mut()
            .downcast_mut::<CpuHeadCache>()
            .ok_or_else(|| {
                Error::InvalidArgument("the EAGLE-3 head's cache belongs to another device".into())
            })?;
        let n = tokens.len();
        let fed;
        let x: &[f32] = match input {
            HeadInput::Features(f) => {
                fed = self.fc(f, n);
                &fed
            }
            HeadInput::DeviceFeatures(_) => return Err(device_features_on_cpu()),
            HeadInput::Hidden(x) => x,
            HeadInput::Last => {
                if cache.last.len() != h {
                    return Err(Error::InvalidArgument(
                        "EAGLE-3 head pass fed from the last output before any pass".into(),
                    ));
                }
                fed = cache.last.clone();
                &fed
            }
        };
        let embeds = match self.own_embedding(tokens) {
            Some(e) => e,
            None => target.embed_tokens(tokens)?,
        };
        let (outputs, logits) = match rows {
            HeadRows::Chain => self.forward(&embeds, x, n, &mut cache.kv)?,
            HeadRows::Tree(tree) => {
                let (out, logits) = self.forward_tree(&embeds, x, tree, &mut cache.kv)?;
                (out, logits.concat())
            }
        };
        cache.last.clear();
        cache.last.extend_from_slice(&outputs[(n - 1) * h..]);
        Ok(self.pass_output(outputs, logits, want))
    }
}

#[cfg(test)]
mod tests {
    use super::pass_groups;

    #[test]
    fn passes_pack_in_order_within_a_chunk_and_their_kind() {
        // Sixteen requests fed 7 rows each: 9 to a 64-row pass, then the other 7 (was: sixteen passes).
        let rows = vec![7; 16];
        let kinds = vec![0; 16];
        assert_eq!(pass_groups(&rows, &kinds, 64), vec![0..9, 9..16]);
        // Exactly full, then a pass longer than a chunk alone, then a change of kind.
        let rows = [32, 32, 70, 1, 1, 1];
        let kinds = [0, 0, 0, 0, 2, 2];
        assert_eq!(pass_groups(&rows, &kinds, 64), vec![0..2, 2..3, 3..4, 4..6]);
        assert!(pass_groups(&[], &[], 64).is_empty());
        // Every pass is in exactly one group, in order, and a group over the limit is a single pass.
        let rows: Vec<usize> = (0..40).map(|i| (i * 37) % 23 + 1).collect();
        let kinds: Vec<u8> = (0..40).map(|i| (i / 13) as u8).collect();
        let groups = pass_groups(&rows, &kinds, 30);
        let covered: Vec<usize> = groups.iter().flat_map(|g| g.clone()).collect();
        assert_eq!(covered, (0..40).collect::<Vec<_>>());
        for g in &groups {
            let total: usize = rows[g.clone()].iter().sum();
            assert!(total <= 30 || g.len() == 1, "{g:?} holds {total} rows");
            assert!(kinds[g.clone()].iter().all(|&k| k == kinds[g.start]));
        }
    }
}
