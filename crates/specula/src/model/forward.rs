//! The forward-pass interface every backend implements (docs/architecture.md, "Backends"): a forward over a
//! batch of sequences, each with its own new tokens, KV cache, logits choice and optional tree mask; logits and
//! hidden states that stay where they were computed until read.

use std::borrow::Cow;

use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::profile::Profiler;

/// A model loaded on a device.
pub trait Model: Send + Sync {
    fn config(&self) -> &Config;

    /// Where it runs, e.g. "cpu" or "cuda:0 (NVIDIA H200)".
    fn device(&self) -> String;

    /// An empty KV cache for one sequence of up to `capacity` positions (at most the context length). A
    /// backend that preallocates (CUDA) reserves all of it now; the CPU grows on demand.
    fn new_cache(&self, capacity: usize) -> Result<Box<dyn SequenceCache>>;

    /// Bytes one position of a sequence's KV cache takes (keys and values of every layer): what a server's KV
    /// memory budget counts. Both backends keep the cache in f32.
    fn kv_bytes_per_position(&self) -> usize {
        let c = self.config();
        2 * c.num_layers * c.kv_dim() * std::mem::size_of::<f32>()
    }

    /// Runs every sequence's new tokens (at positions `cache.len()..`, or as a tree) and appends them to its
    /// cache. One output per sequence, in order.
    fn forward(
        &self,
        batch: &mut [SequenceInput<'_>],
        opts: &ForwardOptions<'_>,
        prof: &Profiler,
    ) -> Result<Vec<ForwardOutput>>;

    /// Bytes of weights one decode step reads (what bounds decode speed when memory-bound).
    fn weight_bytes(&self) -> usize;

    /// The storage types of the weights, e.g. "Q4_K x 169, Q6_K x 29".
    fn weight_types(&self) -> String;

    /// Runs the model's weight matrices through its fast kernels and a reference on the same inputs (the
    /// backend's self-test; see `specula selftest`).
    fn check_kernels(&self, tokens: &[u32]) -> Result<Vec<KernelCheck>>;

    /// The embedding rows of `tokens` as f32 on the host (an EAGLE-3 head reads the target's embedding).
    fn embed_tokens(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let _ = tokens;
        Err(crate::error::Error::InvalidArgument(format!(
            "reading token embeddings is not implemented on {} yet (EAGLE-3 heads run with a CPU target for now)",
            self.device()
        )))
    }

    /// A twin of EAGLE-3 `head` that runs on this model's device and reads its embedding there; None when the
    /// head should run on the CPU beside it (the CPU backend, or a backend without head kernels).
    fn place_eagle3_head(
        &self,
        head: &crate::draft::eagle3::Eagle3Head,
    ) -> Result<Option<Box<dyn crate::draft::eagle3::HeadCompute>>> {
        let _ = head;
        Ok(None)
    }

    /// The clock the profiler should time this model's steps with: on an asynchronous device, one that reads
    /// the device's own time; `exact` synchronizes at every phase edge instead (to cross-check). The host's
    /// monotonic clock by default.
    fn clock(&self, exact: bool) -> Box<dyn crate::profile::Clock> {
        let _ = exact;
        Box::new(crate::profile::MonotonicClock::new())
    }

    /// Prepares the steps a server is about to run, before its first request: a backend that sizes its step
    /// buffers on demand and captures each step shape's CUDA graph the first time it runs would otherwise
    /// spend a serving level's first steps doing so (on an H200, 3-5 ms a new shape against 1.5 for a step).
    /// Returns how many step shapes it prepared; nothing to do by default (the CPU).
    fn prepare_steps(&self, shapes: &StepShapes<'_>) -> Result<usize> {
        let _ = shapes;
        Ok(0)
    }

    /// `work`'s device kernels timed one by one, in launch order (a GPU: CUDA events around each launch, its
    /// graphs suspended meanwhile). None where the model runs no kernels to time (the CPU).
    fn time_kernels(
        &self,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Option<Vec<crate::profile::KernelTime>>> {
        let _ = work;
        Ok(None)
    }
}

/// The steps a server will run ([`Model::prepare_steps`]).
#[derive(Debug, Clone, Copy)]
pub struct StepShapes<'a> {
    /// The most rows of a step: a prompt chunk beside every decoding request's rows.
    pub max_rows: usize,
    /// The most sequences of a step.
    pub max_sequences: usize,
    /// The most rows of a step that need logits: every decoding request's pending token and drafts.
    pub max_logit_rows: usize,
    /// The layers every step captures (an EAGLE-3 head's), sorted.
    pub capture_layers: &'a [usize],
    /// Logits from the first `vocab_limit` ids only (a draft model's `--draft-vocab`).
    pub vocab_limit: Option<usize>,
    /// A draft model's steps: one sequence a pass wanting its last row's logits only, of any row count up to
    /// `max_rows` (a catch-up feeds whatever the drafter missed), rather than decoding and verifying steps.
    pub last_row_logits_only: bool,
}

/// Runs throwaway forward passes of the shapes in `shapes` (each sequence in a fresh cache, dropped after):
/// first the largest step (its rows, then its sequences and logit rows), so the buffers sized on demand reach
/// their final size before anything depends on them, then one pass of every row count up to
/// `min(max_logit_rows, chain_rows)` with logits for every row (a decoding or verifying step of that many
/// rows, whatever sequences they belong to), or, for a draft model's steps, of every row count up to
/// `min(max_rows, chain_rows)` with the last row's logits. Returns the passes of the second kind.
pub fn run_step_shapes(
    model: &dyn Model,
    shapes: &StepShapes<'_>,
    chain_rows: usize,
) -> Result<usize> {
    let context = model.config().context_length;
    let opts = ForwardOptions {
        capture_layers: shapes.capture_layers,
        vocab_limit: shapes.vocab_limit,
    };
    let prof = Profiler::disabled();
    let pass = |sequences: &[(usize, LogitsFor)]| -> Result<()> {
        let tokens: Vec<Vec<u32>> = sequences.iter().map(|&(n, _)| vec![0u32; n]).collect();
        let mut caches = sequences
            .iter()
            .map(|&(n, _)| model.new_cache(n))
            .collect::<Result<Vec<_>>>()?;
        let mut batch: Vec<SequenceInput<'_>> = caches
            .iter_mut()
            .zip(&tokens)
            .zip(sequences)
            .map(|((cache, tokens), &(_, logits))| SequenceInput {
                tokens,
                cache: cache.as_mut(),
                logits,
                tree: None,
            })
            .collect();
        model.forward(&mut batch, &opts, &prof).map(|_| ())
    };
    let max_rows = shapes.max_rows.clamp(1, context);
    pass(&[(max_rows, LogitsFor::Last)])?;
    let sequences = shapes.max_sequences.max(1);
    let per_sequence = shapes.max_logit_rows.div_ceil(sequences).clamp(1, context);
    pass(&vec![(per_sequence, LogitsFor::All); sequences])?;
    let (last, logits) = if shapes.last_row_logits_only {
        (max_rows, LogitsFor::Last)
    } else {
        (shapes.max_logit_rows, LogitsFor::All)
    };
    let last = last.min(chain_rows).min(context);
    for rows in 1..=last {
        pass(&[(rows, logits)])?;
    }
    Ok(last)
}

/// Times the server's decoding and verifying steps before it serves: for each `(sequences, rows)` in `shapes`, a
/// forward pass of `sequences` sequences of `rows` new rows each with logits for every row (what a step of that
/// many requests drafting `rows - 1` tokens each verifies), its top tokens read back as a server's step reads
/// them; one untimed pass first (on a GPU it captures the shape's graph), then the median of `repeats` timed
/// ones, each in caches made before the clock starts. Returns (rows of the step, seconds) per shape; shapes past
/// the context or with nothing to run are left out. The draft budget prices a step by its rows
/// ([`crate::draft::budget::DraftBudget::seed_forward`]).
pub fn time_step_shapes(
    model: &dyn Model,
    shapes: &[(usize, usize)],
    capture_layers: &[usize],
    repeats: usize,
) -> Result<Vec<(usize, f64)>> {
    let context = model.config().context_length;
    let opts = ForwardOptions {
        capture_layers,
        vocab_limit: None,
    };
    let prof = Profiler::disabled();
    let mut timed = Vec::new();
    for &(sequences, rows) in shapes {
        if sequences == 0 || rows == 0 || rows > context {
            continue;
        }
        let tokens = vec![0u32; rows];
        let mut samples = Vec::with_capacity(repeats);
        for pass in 0..=repeats.max(1) {
            let mut caches = (0..sequences)
                .map(|_| model.new_cache(rows))
                .collect::<Result<Vec<_>>>()?;
            let mut batch: Vec<SequenceInput<'_>> = caches
                .iter_mut()
                .map(|cache| SequenceInput {
                    tokens: &tokens,
                    cache: cache.as_mut(),
                    logits: LogitsFor::All,
                    tree: None,
                })
                .collect();
            let started = std::time::Instant::now();
            for out in model.forward(&mut batch, &opts, &prof)? {
                out.logits.top_tokens()?;
            }
            if pass > 0 {
                samples.push(started.elapsed().as_secs_f64());
            }
        }
        samples.sort_by(f64::total_cmp);
        timed.push((sequences * rows, samples[samples.len() / 2]));
    }
    Ok(timed)
}

impl dyn Model + '_ {
    /// A cache for a generation of `max_new_tokens` after a prompt of `prompt_tokens`, with room for a verify
    /// pass of `draft_tokens` past the last token, capped at the context length.
    pub fn new_cache_for(
        &self,
        prompt_tokens: usize,
        max_new_tokens: usize,
        draft_tokens: usize,
    ) -> Result<Box<dyn SequenceCache>> {
        let wanted = prompt_tokens
            .saturating_add(max_new_tokens)
            .saturating_add(draft_tokens)
            .saturating_add(1);
        self.new_cache(wanted.min(self.config().context_length))
    }

    /// One sequence: `tokens` at positions `cache.len()..` as a chain.
    pub fn forward_one(
        &self,
        tokens: &[u32],
        cache: &mut dyn SequenceCache,
        opts: &ForwardOptions<'_>,
        logits: LogitsFor,
        prof: &Profiler,
    ) -> Result<ForwardOutput> {
        let mut batch = [SequenceInput {
            tokens,
            cache,
            logits,
            tree: None,
        }];
        let mut out = self.forward(&mut batch, opts, prof)?;
        out.pop()
            .ok_or_else(|| Error::InvalidArgument("the backend returned no output".into()))
    }
}

/// The checks every backend makes before a forward pass: options within the model, every sequence with new
/// tokens inside the vocabulary, a tree mask of the right size, and room in the model's context.
pub fn check_batch(
    config: &Config,
    batch: &[SequenceInput<'_>],
    opts: &ForwardOptions<'_>,
) -> Result<()> {
    if batch.is_empty() {
        return Err(Error::InvalidArgument(
            "forward pass over no sequences".into(),
        ));
    }
    if let Some(limit) = opts.vocab_limit {
        if limit == 0 || limit > config.vocab_size {
            return Err(Error::InvalidArgument(format!(
                "vocabulary limit {limit} is outside 1..={} (the model's vocabulary)",
                config.vocab_size
            )));
        }
    }
    for &layer in opts.capture_layers {
        if layer >= config.num_layers {
            return Err(Error::InvalidArgument(format!(
                "cannot capture hidden states of layer {layer}: the model has {} layers (0..{})",
                config.num_layers,
                config.num_layers - 1
            )));
        }
    }
    for (s, seq) in batch.iter().enumerate() {
        let n = seq.tokens.len();
        if n == 0 {
            return Err(Error::InvalidArgument(format!(
                "sequence {s} of the batch has no new tokens"
            )));
        }
        if let Some(tree) = seq.tree {
            if tree.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "sequence {s}: a tree mask of {} rows for {n} new tokens",
                    tree.len()
                )));
            }
        }
        if let Some(&t) = seq
            .tokens
            .iter()
            .find(|&&t| t as usize >= config.vocab_size)
        {
            return Err(Error::InvalidArgument(format!(
                "token id {t} is outside the vocabulary (size {})",
                config.vocab_size
            )));
        }
        let end = seq.cache.len() + n;
        if end > config.context_length {
            return Err(Error::ContextOverflow {
                prompt_tokens: end,
                max_new_tokens: 0,
                context_length: config.context_length,
            });
        }
    }
    Ok(())
}

/// One sequence's part of a batched forward pass.
pub struct SequenceInput<'a> {
    /// The new tokens (at least one).
    pub tokens: &'a [u32],
    pub cache: &'a mut dyn SequenceCache,
    /// Which of the new rows need logits.
    pub logits: LogitsFor,
    /// How the new rows attend to each other; None is a chain (row i sees rows 0..=i).
    pub tree: Option<&'a TreeMask>,
}

/// Which rows of a sequence's forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Every new row (verification of drafts).
    All,
    /// Only the last new row (prefill, plain decoding).
    Last,
    /// None (warming a cache).
    None,
}

#[derive(Debug, Clone, Default)]
pub struct ForwardOptions<'a> {
    /// Layers whose output hidden states (the residual stream after the block) to return, 0-based.
    pub capture_layers: &'a [usize],
    /// Compute logits only for token ids `0..limit` (the first rows of the LM head), e.g. a draft model's reduced
    /// vocabulary; the logits then have `limit` columns. None: the whole vocabulary.
    pub vocab_limit: Option<usize>,
}

/// The new rows of one sequence as a tree (EAGLE-3 tree verify): row i's parent is an earlier new row, or None
/// for a row that follows the cached context directly. A row attends to the whole cache, its ancestors among
/// the new rows and itself; its position is the cache length plus its depth. A chain (`parents[i] = i - 1`) is
/// exactly the default causal forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeMask {
    parents: Vec<Option<usize>>,
    depths: Vec<usize>,
}

impl TreeMask {
    pub fn new(parents: Vec<Option<usize>>) -> Result<Self> {
        let mut depths = Vec::with_capacity(parents.len());
        for (i, parent) in parents.iter().enumerate() {
            let depth = match *parent {
                None => 0,
                Some(p) if p < i => depths[p] + 1,
                Some(p) => {
                    return Err(Error::InvalidArgument(format!(
                        "tree mask: row {i}'s parent {p} is not an earlier row"
                    )))
                }
            };
            depths.push(depth);
        }
        Ok(TreeMask { parents, depths })
    }

    /// A chain of `n` rows (each row's parent is the row before).
    pub fn chain(n: usize) -> Self {
        TreeMask {
            parents: (0..n).map(|i| i.checked_sub(1)).collect(),
            depths: (0..n).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.parents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }

    pub fn parent(&self, row: usize) -> Option<usize> {
        self.parents[row]
    }

    /// Row `row`'s distance from the cached context (its position is `cache.len() + depth`).
    pub fn depth(&self, row: usize) -> usize {
        self.depths[row]
    }

    /// Whether new row `row` attends to new row `other` (an ancestor, or itself).
    pub fn sees(&self, row: usize, other: usize) -> bool {
        let mut at = Some(row);
        while let Some(r) = at {
            if r == other {
                return true;
            }
            if r < other {
                return false;
            }
            at = self.parents[r];
        }
        false
    }
}

/// Checks a `keep_new_rows` request against a cache of `len` positions: `rows` increasing, each one of the
/// new rows after `base`.
pub fn check_keep_rows(len: usize, base: usize, rows: &[usize]) -> Result<()> {
    let new = len.saturating_sub(base);
    if base > len || rows.iter().any(|&r| r >= new) || rows.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::InvalidArgument(format!(
            "keep_new_rows: rows {rows:?} are not increasing new rows of the {new} after position {base}"
        )));
    }
    Ok(())
}

/// One sequence's key/value cache on some backend. Truncation is O(1): later rows are overwritten.
pub trait SequenceCache: Send {
    /// Positions held.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most positions it can hold.
    fn capacity(&self) -> usize;

    /// Forgets every position at or after `len`.
    fn truncate(&mut self, len: usize);

    /// After a tree forward from cache length `base`: keeps the new rows `rows` (in order, e.g. the accepted
    /// path) at `base..base + rows.len()` and forgets the rest.
    fn keep_new_rows(&mut self, base: usize, rows: &[usize]) -> Result<()>;

    /// Replaces its contents with the first `n` positions of `src`, a cache of the same model and backend (a
    /// prefix cache hands a new request the keys and values of a prompt start it has seen). Fails, changing
    /// nothing, when `src` holds fewer positions, `n` exceeds this cache's capacity, or the two differ in kind or
    /// shape.
    fn copy_prefix_from(&mut self, src: &dyn SequenceCache, n: usize) -> Result<()> {
        let _ = (src, n);
        Err(Error::InvalidArgument(
            "this KV cache cannot take positions from another".into(),
        ))
    }

    fn as_any(&self) -> &dyn std::any::Any;
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

/// The checks every [`SequenceCache::copy_prefix_from`] makes: `src` holds `n` positions and `n` fits.
pub fn check_prefix_copy(src_len: usize, n: usize, capacity: usize) -> Result<()> {
    if n > src_len {
        return Err(Error::InvalidArgument(format!(
            "cannot copy {n} positions from a cache holding {src_len}"
        )));
    }
    if n > capacity {
        return Err(Error::InvalidArgument(format!(
            "cannot copy {n} positions into a cache of capacity {capacity}"
        )));
    }
    Ok(())
}

/// A `rows x cols` matrix of f32 that lives where it was computed (host memory, or a device's).
pub trait RowMatrix: Send {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Each row's largest element's column (the first on ties), computed where the matrix lives.
    fn argmax_rows(&self) -> Result<Vec<u32>>;
    /// Each row's largest element's column (the first on ties) with its softmax probability at temperature 1,
    /// computed where the matrix lives: what a greedy drafter's confidence bar needs of a row (8 bytes instead of
    /// a vocabulary of logits when the matrix is on a GPU).
    fn top_tokens(&self) -> Result<Vec<(u32, f32)>> {
        let mut scratch = Vec::new();
        (0..self.rows())
            .map(|i| {
                Ok(crate::sampling::top_probability(
                    &self.row(i)?,
                    &mut scratch,
                ))
            })
            .collect()
    }
    /// Row `i` in host memory (borrowed when it already is).
    fn row(&self, i: usize) -> Result<Cow<'_, [f32]>>;
    /// The whole matrix in host memory, row-major.
    fn to_host(&self) -> Result<Cow<'_, [f32]>>;
    /// A second handle on the same rows when that copies nothing (a device step's outputs, held by reference), so
    /// a reader can keep rows without reading them now; None where keeping them means copying them.
    fn share(&self) -> Option<Box<dyn RowMatrix>> {
        None
    }
    /// The device address of element (0, 0) when the rows live in a device's memory (row-major, `cols` f32 a
    /// row), so a consumer on that device can read them where they are; None in host memory.
    fn device_address(&self) -> Option<u64> {
        None
    }
    /// Columns `cols` of every row in host memory, row-major (`rows x cols.len()`), gathered where the matrix
    /// lives: a caller that needs a few columns of a wide matrix (EAGLE-3 training reads the draft vocabulary's
    /// logits, 8k of 152k columns) copies only those.
    fn gather_columns(&self, cols: &[u32]) -> Result<Vec<f32>> {
        check_columns(self.cols(), cols)?;
        let all = self.to_host()?;
        let width = self.cols();
        Ok((0..self.rows())
            .flat_map(|r| cols.iter().map(move |&c| (r, c)))
            .map(|(r, c)| all[r * width + c as usize])
            .collect())
    }
}

/// Every column index within a matrix `width` wide.
pub fn check_columns(width: usize, cols: &[u32]) -> Result<()> {
    match cols.iter().find(|&&c| c as usize >= width) {
        Some(c) => Err(Error::InvalidArgument(format!(
            "column {c} of a matrix {width} columns wide"
        ))),
        None => Ok(()),
    }
}

/// A matrix in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostRows {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl HostRows {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

impl RowMatrix for HostRows {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn argmax_rows(&self) -> Result<Vec<u32>> {
        Ok((0..self.rows)
            .map(|i| crate::sampling::argmax(HostRows::row(self, i)))
            .collect())
    }
    fn row(&self, i: usize) -> Result<Cow<'_, [f32]>> {
        if i >= self.rows {
            return Err(Error::InvalidArgument(format!(
                "row {i} of a {}-row matrix",
                self.rows
            )));
        }
        Ok(Cow::Borrowed(HostRows::row(self, i)))
    }
    fn to_host(&self) -> Result<Cow<'_, [f32]>> {
        Ok(Cow::Borrowed(&self.data))
    }
}

/// One sequence's results.
pub struct ForwardOutput {
    /// One row per new row that `LogitsFor` asked for.
    pub logits: Box<dyn RowMatrix>,
    /// `(layer, new rows x hidden)` for each requested layer, in request order.
    pub hidden: Vec<(usize, Box<dyn RowMatrix>)>,
}

impl ForwardOutput {
    pub fn rows(&self) -> usize {
        self.logits.rows()
    }

    /// Logits of row `i`, in host memory.
    pub fn row(&self, i: usize) -> Result<Cow<'_, [f32]>> {
        self.logits.row(i)
    }

    /// Logits of the last row, in host memory.
    pub fn last(&self) -> Result<Cow<'_, [f32]>> {
        match self.logits.rows() {
            0 => Err(Error::InvalidArgument("no logits were computed".into())),
            n => self.logits.row(n - 1),
        }
    }
}

impl ForwardOutput {
    /// Logits and hidden states copied to host memory (tests and tools).
    pub fn to_host(&self) -> Result<HostOutput> {
        let host = |m: &dyn RowMatrix| -> Result<HostRows> {
            Ok(HostRows {
                rows: m.rows(),
                cols: m.cols(),
                data: m.to_host()?.into_owned(),
            })
        };
        Ok(HostOutput {
            logits: host(self.logits.as_ref())?,
            hidden: self
                .hidden
                .iter()
                .map(|(layer, m)| Ok((*layer, host(m.as_ref())?)))
                .collect::<Result<_>>()?,
        })
    }
}

/// A [`ForwardOutput`] in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostOutput {
    pub logits: HostRows,
    pub hidden: Vec<(usize, HostRows)>,
}

impl HostOutput {
    pub fn row(&self, i: usize) -> &[f32] {
        self.logits.row(i)
    }

    pub fn last(&self) -> &[f32] {
        self.logits.row(self.logits.rows - 1)
    }
}

/// One weight matrix's fast kernel against the reference kernel ([`Model::check_kernels`]).
#[derive(Debug, Clone)]
pub struct KernelCheck {
    pub name: String,
    pub dtype: &'static str,
    /// max |fast - reference| / max |reference| over the outputs.
    pub max_relative_error: f64,
    pub tolerance: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Timed step shapes: one entry per runnable shape, at its step's rows, each a positive time; shapes past the
    /// context or empty are left out.
    #[test]
    fn step_shapes_are_timed_at_their_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        crate::testing::write_tiny_gguf(&path, &crate::testing::TinySpec::default()).unwrap();
        let loaded = crate::model::load_gguf(&path, "t").unwrap();
        let model = loaded.model.as_ref();
        let context = model.config().context_length;
        let timed =
            time_step_shapes(model, &[(1, 1), (4, 3), (0, 2), (2, context + 1)], &[], 2).unwrap();
        assert_eq!(timed.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 12]);
        assert!(
            timed.iter().all(|t| t.1 > 0.0 && t.1.is_finite()),
            "{timed:?}"
        );
    }

    /// The default `top_tokens` is the host's argmax and softmax probability of each row.
    #[test]
    fn top_tokens_are_each_rows_argmax_and_its_probability() {
        let m = HostRows {
            rows: 3,
            cols: 4,
            data: vec![
                0.0, 2.0, 1.0, 2.0, // a tie: the first column wins
                -1.0, -1.0, -1.0, -1.0, // flat: a quarter each
                5.0, 0.0, 0.0, 0.0,
            ],
        };
        let top = m.top_tokens().unwrap();
        assert_eq!(
            top.iter().map(|t| t.0).collect::<Vec<_>>(),
            m.argmax_rows().unwrap()
        );
        assert_eq!(top[0].0, 1);
        assert!((top[1].1 - 0.25).abs() < 1e-6);
        let exact = 5f32.exp() / (5f32.exp() + 3.0);
        assert!((top[2].1 - exact).abs() < 1e-6, "{} vs {exact}", top[2].1);
    }

    #[test]
    fn tree_masks_know_ancestors_and_depths() {
        // 0 -> 1 -> 3, 0 -> 2, 4 alone.
        let t = TreeMask::new(vec![None, Some(0), Some(0), Some(1), None]).unwrap();
        assert_eq!(
            (0..5).map(|i| t.depth(i)).collect::<Vec<_>>(),
            [0, 1, 1, 2, 0]
        );
        assert!(t.sees(3, 1) && t.sees(3, 0) && t.sees(3, 3));
        assert!(!t.sees(3, 2) && !t.sees(2, 1) && !t.sees(4, 0) && !t.sees(0, 1));
        let chain = TreeMask::chain(4);
        assert!((0..4).all(|i| (0..4).all(|j| chain.sees(i, j) == (j <= i))));
        assert!(TreeMask::new(vec![Some(0)]).is_err());
        assert!(TreeMask::new(vec![None, Some(5)]).is_err());
    }
}
