//! Training data for an EAGLE-3 head: token sequences (the target's own answers to instruction prompts, and
//! chunks of a text corpus), the draft vocabulary chosen by token frequency, and each sequence's target outputs
//! (hidden states at the head's layers, distribution over the draft vocabulary).

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::model::{ForwardOptions, LoadedModel, LogitsFor, Model, SequenceCache, SequenceInput};
use crate::profile::Profiler;

use super::net::TrainingSequence;

/// One training sequence: `tokens`, of which the head learns to predict those from `loss_from` on (earlier ones
/// are a prompt it only reads).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainingText {
    pub tokens: Vec<u32>,
    pub loss_from: usize,
    /// Where it came from ("answer:ID" or "corpus:PATH#chunk").
    pub source: String,
}

/// File extensions read from a corpus directory (source code and text).
const CORPUS_EXTENSIONS: &[&str] = &[
    "py", "rs", "c", "h", "cc", "cpp", "hpp", "js", "ts", "go", "java", "md", "txt", "rst", "sh",
    "toml",
];

/// Every corpus file under `paths` (files as given, directories walked in sorted order, by extension).
pub fn corpus_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                walk(&p, out)?;
            } else if p
                .extension()
                .and_then(|x| x.to_str())
                .is_some_and(|x| CORPUS_EXTENSIONS.contains(&x))
            {
                out.push(p);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            walk(p, &mut out)?;
        } else if p.is_file() {
            out.push(p.clone());
        } else {
            return Err(Error::InvalidArgument(format!(
                "corpus path {} is neither a file nor a directory",
                p.display()
            )));
        }
    }
    Ok(out)
}

/// Chunks of `seq_len` tokens from the corpus files (each file tokenized on its own; a last piece shorter than
/// a quarter chunk is dropped), at most `max_tokens` tokens in all. Files that are not UTF-8 are skipped.
pub fn corpus_texts(
    model: &LoadedModel,
    files: &[PathBuf],
    seq_len: usize,
    max_tokens: usize,
) -> Result<Vec<TrainingText>> {
    // A sequence must fit the target's context.
    let seq_len = seq_len.min(model.model.config().context_length);
    let mut out = Vec::new();
    let mut total = 0usize;
    for file in files {
        if total >= max_tokens {
            break;
        }
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        let tokens = model.tokenizer.encode(&text)?;
        for (i, chunk) in tokens.chunks(seq_len).enumerate() {
            if chunk.len() < (seq_len / 4).max(2) || total >= max_tokens {
                continue;
            }
            total += chunk.len();
            out.push(TrainingText {
                tokens: chunk.to_vec(),
                loss_from: 1,
                source: format!("corpus:{}#{i}", file.display()),
            });
        }
    }
    Ok(out)
}

/// The target's own greedy answers to `prompts` (self-distillation: the head learns what this target says, in
/// its chat format), each at most `answer_tokens` long and the whole sequence at most `seq_len`. Up to `batch`
/// prompts are answered at once, one batched forward pass a token (each sequence with its own cache); a greedy
/// answer does not depend on its batch (the backends' kernels are row-independent), so the texts equal one
/// prompt at a time through `decode::generate`, in prompt order.
pub fn self_distilled_texts(
    model: &LoadedModel,
    prompts: &[(String, String)],
    answer_tokens: usize,
    seq_len: usize,
    batch: usize,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<TrainingText>> {
    struct Answering {
        index: usize,
        tokens: Vec<u32>,
        loss_from: usize,
        max_new: usize,
        cache: Box<dyn SequenceCache>,
    }
    let target = model.model.as_ref();
    let seq_len = seq_len.min(target.config().context_length);
    let batch = batch.max(1);
    let mut answered: Vec<Option<TrainingText>> = Vec::new();
    answered.resize_with(prompts.len(), || None);
    let mut done = 0usize;
    let mut next_prompt = 0usize;
    let mut live: Vec<Answering> = Vec::new();
    let opts = ForwardOptions::default();
    let prof = Profiler::disabled();
    // Appends the greedy token; true when the answer goes on.
    let commit = |a: &mut Answering, token: u32| -> bool {
        if model.tokenizer.is_stop(token) {
            return false;
        }
        a.tokens.push(token);
        a.tokens.len() - a.loss_from < a.max_new
    };
    let finish = |a: Answering, answered: &mut [Option<TrainingText>]| {
        if a.tokens.len() > a.loss_from {
            answered[a.index] = Some(TrainingText {
                tokens: a.tokens,
                loss_from: a.loss_from,
                source: format!("answer:{}", prompts[a.index].0),
            });
        }
    };
    loop {
        // Fill free slots: each new prompt is prefilled alone, then decodes with the others.
        while live.len() < batch && next_prompt < prompts.len() {
            let index = next_prompt;
            next_prompt += 1;
            let (id, prompt) = &prompts[index];
            progress(done, prompts.len(), id);
            let text = model.format_prompt(prompt, false, None)?;
            let prompt_tokens = model.tokenizer.encode(&text)?;
            if prompt_tokens.len() + 2 > seq_len {
                done += 1;
                continue;
            }
            let max_new = answer_tokens.min(seq_len - prompt_tokens.len());
            let mut cache = target.new_cache_for(prompt_tokens.len(), max_new, 0)?;
            let out = target.forward_one(
                &prompt_tokens,
                cache.as_mut(),
                &opts,
                LogitsFor::Last,
                &prof,
            )?;
            let first = out.logits.argmax_rows()?[0];
            let mut a = Answering {
                index,
                loss_from: prompt_tokens.len(),
                tokens: prompt_tokens,
                max_new,
                cache,
            };
            if max_new > 0 && commit(&mut a, first) {
                live.push(a);
            } else {
                finish(a, &mut answered);
                done += 1;
            }
        }
        if live.is_empty() {
            break;
        }
        let last: Vec<[u32; 1]> = live
            .iter()
            .map(|a| [*a.tokens.last().unwrap_or(&0)])
            .collect();
        let mut inputs: Vec<SequenceInput<'_>> = live
            .iter_mut()
            .zip(&last)
            .map(|(a, t)| SequenceInput {
                tokens: t,
                cache: a.cache.as_mut(),
                logits: LogitsFor::Last,
                tree: None,
            })
            .collect();
        let outs = target.forward(&mut inputs, &opts, &prof)?;
        drop(inputs);
        let next: Vec<u32> = outs
            .iter()
            .map(|o| Ok(o.logits.argmax_rows()?[0]))
            .collect::<Result<_>>()?;
        let mut still = Vec::with_capacity(live.len());
        for (mut a, token) in live.drain(..).zip(next) {
            if commit(&mut a, token) {
                still.push(a);
            } else {
                finish(a, &mut answered);
                done += 1;
            }
        }
        live = still;
    }
    progress(prompts.len(), prompts.len(), "");
    Ok(answered.into_iter().flatten().collect())
}

/// The draft vocabulary: the target ids the head can propose, increasing.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftVocab {
    pub ids: Vec<u32>,
    /// Draft id of each target id, if it is in the draft vocabulary.
    pub draft_of: Vec<Option<u32>>,
}

impl DraftVocab {
    pub fn from_ids(mut ids: Vec<u32>, target_vocab: usize) -> Result<Self> {
        ids.sort_unstable();
        ids.dedup();
        let mut draft_of = vec![None; target_vocab];
        for (d, &t) in ids.iter().enumerate() {
            let slot = draft_of.get_mut(t as usize).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "draft vocabulary token {t} is outside the target's vocabulary of {target_vocab}"
                ))
            })?;
            *slot = Some(d as u32);
        }
        Ok(DraftVocab { ids, draft_of })
    }

    /// The `size` most frequent tokens among those the head learns to predict (ties: smaller id first), padded
    /// with the smallest unused ids when the data has fewer distinct tokens.
    pub fn by_frequency(texts: &[TrainingText], target_vocab: usize, size: usize) -> Result<Self> {
        let size = size.min(target_vocab);
        let mut counts = vec![0u64; target_vocab];
        for t in texts {
            for &tok in t.tokens.iter().skip(t.loss_from) {
                if let Some(c) = counts.get_mut(tok as usize) {
                    *c += 1;
                }
            }
        }
        let mut order: Vec<u32> = (0..target_vocab as u32).collect();
        order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        order.truncate(size);
        Self::from_ids(order, target_vocab)
    }

    /// This vocabulary grown to `size` tokens with the most frequent answer tokens it lacks (ties: smaller id
    /// first; padded with the smallest unused ids when the data has too few), every token it had kept.
    pub fn grown(&self, texts: &[TrainingText], size: usize) -> Result<Self> {
        let target_vocab = self.draft_of.len();
        let size = size.min(target_vocab);
        if size <= self.len() {
            return Ok(self.clone());
        }
        let mut counts = vec![0u64; target_vocab];
        for t in texts {
            for &tok in t.tokens.iter().skip(t.loss_from) {
                if let Some(c) = counts.get_mut(tok as usize) {
                    *c += 1;
                }
            }
        }
        let mut new: Vec<u32> = (0..target_vocab as u32)
            .filter(|&t| self.draft_of[t as usize].is_none())
            .collect();
        new.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        new.truncate(size - self.len());
        new.extend_from_slice(&self.ids);
        Self::from_ids(new, target_vocab)
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// d2t as the published layout stores it: target id = draft id + d2t[draft id].
    pub fn d2t(&self) -> Vec<i64> {
        self.ids
            .iter()
            .enumerate()
            .map(|(d, &t)| i64::from(t) - d as i64)
            .collect()
    }

    /// Share of the predicted tokens of `texts` that the draft vocabulary holds.
    pub fn coverage(&self, texts: &[TrainingText]) -> f64 {
        let (mut hit, mut all) = (0u64, 0u64);
        for t in texts {
            for &tok in t.tokens.iter().skip(t.loss_from) {
                all += 1;
                hit += u64::from(self.draft_of.get(tok as usize).is_some_and(|d| d.is_some()));
            }
        }
        hit as f64 / all.max(1) as f64
    }
}

/// The target's outputs on one training sequence, kept compactly between epochs: its hidden states at the
/// head's layers in f16 and its distribution over the draft vocabulary as the `top_k` most likely draft tokens
/// (renormalized; the tail carries almost no mass and no gradient worth its memory).
pub struct TargetOutputs {
    pub len: usize,
    /// `[len, 3H]`, low ++ mid ++ high per position.
    pub features: Vec<half::f16>,
    pub top_k: usize,
    /// `len x top_k` (draft id, probability), most likely first.
    pub top: Vec<(u32, f32)>,
    /// Per row r: the draft id of the target's most likely token r + 1, or None when outside the draft
    /// vocabulary or not trained on.
    pub target_ids: Vec<Option<u32>>,
}

impl TargetOutputs {
    pub fn bytes(&self) -> usize {
        self.features.len() * 2 + self.top.len() * 8 + self.target_ids.len() * 8
    }

    /// The training sequence: features, next-token embeddings (room for `steps` unrolled steps) and dense
    /// target distributions.
    pub fn sequence(
        &self,
        target: &dyn Model,
        text: &TrainingText,
        steps: usize,
        draft_vocab: usize,
        dev: &Device,
    ) -> Result<TrainingSequence> {
        let t = self.len;
        let h = target.config().hidden_size;
        let mut embeds = target.embed_tokens(&text.tokens[1..t])?;
        embeds.resize((t + steps) * h, 0.0);
        // The dense targets and the f32 features are made where training runs: a GPU gets the top k (t x k) and
        // f16 features instead of t x draft_vocab and t x 3H f32 values (a 384-token sequence: 1.6 MB instead
        // of 20 MB through pageable memory). Same values as building them on the host.
        let ids: Vec<u32> = self.top.iter().map(|&(d, _)| d).collect();
        let top_probs: Vec<f32> = self.top.iter().map(|&(_, p)| p).collect();
        let ids = Tensor::from_vec(ids, (t, self.top_k), dev)?;
        let top_probs = Tensor::from_vec(top_probs, (t, self.top_k), dev)?;
        let target_probs = Tensor::zeros((t, draft_vocab), candle_core::DType::F32, dev)?
            .scatter(&ids, &top_probs, 1)?;
        let features = Tensor::from_slice(&self.features, (t, 3 * h), dev)?
            .to_dtype(candle_core::DType::F32)?;
        Ok(TrainingSequence {
            len: t,
            features,
            embeds: Tensor::from_vec(embeds, (t + steps, h), dev)?,
            target_probs,
            target_ids: self.target_ids.clone(),
        })
    }
}

/// Where a target pass's time goes (seconds, summed over passes): what to speed up when the target's passes
/// dominate training.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct TargetPassTimes {
    pub passes: usize,
    /// The forward pass and the copy of the captured layers to the host (on a GPU the copy waits for the pass).
    pub forward_s: f64,
    /// The draft vocabulary's logits and the whole vocabulary's argmax, read back.
    pub logits_s: f64,
    /// Host work: features to f16, the top k of each row.
    pub host_s: f64,
    /// Building the training tensors (dense targets, embeddings) and moving them to the training device; counted
    /// for cached outputs too.
    pub tensors_s: f64,
}

impl TargetPassTimes {
    pub fn add(&mut self, other: &TargetPassTimes) {
        self.passes += other.passes;
        self.forward_s += other.forward_s;
        self.logits_s += other.logits_s;
        self.host_s += other.host_s;
        self.tensors_s += other.tensors_s;
    }
}

/// Runs the target over `text`: its hidden states at `layers` and, per row, the `top_k` most likely draft
/// tokens with their probabilities (softmax over the draft vocabulary, renormalized over the top k).
pub fn target_outputs(
    target: &dyn Model,
    layers: &[usize],
    vocab: &DraftVocab,
    text: &TrainingText,
    top_k: usize,
) -> Result<TargetOutputs> {
    target_outputs_timed(
        target,
        layers,
        vocab,
        text,
        top_k,
        &mut TargetPassTimes::default(),
    )
}

/// [`target_outputs`], adding its time to `times`.
pub fn target_outputs_timed(
    target: &dyn Model,
    layers: &[usize],
    vocab: &DraftVocab,
    text: &TrainingText,
    top_k: usize,
    times: &mut TargetPassTimes,
) -> Result<TargetOutputs> {
    let started = std::time::Instant::now();
    let tokens = &text.tokens;
    let t = tokens.len();
    if t < 2 {
        return Err(Error::InvalidArgument(format!(
            "training sequence {} has {t} tokens; at least 2 needed",
            text.source
        )));
    }
    let c = target.config();
    let mut cache = target.new_cache(t)?;
    let opts = ForwardOptions {
        capture_layers: layers,
        vocab_limit: None,
    };
    let out = target.forward_one(
        tokens,
        cache.as_mut(),
        &opts,
        LogitsFor::All,
        &Profiler::disabled(),
    )?;
    let big_h = c.hidden_size;
    let mut features = vec![half::f16::ZERO; t * 3 * big_h];
    let mut host_s = 0.0;
    for (k, (_, rows)) in out.hidden.iter().enumerate() {
        let rows = rows.to_host()?;
        let converting = std::time::Instant::now();
        for r in 0..t {
            let dst = &mut features[r * 3 * big_h + k * big_h..r * 3 * big_h + (k + 1) * big_h];
            for (d, &v) in dst.iter_mut().zip(&rows[r * big_h..(r + 1) * big_h]) {
                *d = half::f16::from_f32(v);
            }
        }
        host_s += converting.elapsed().as_secs_f64();
    }
    let forwarded = std::time::Instant::now();
    let dv = vocab.len();
    let top_k = top_k.clamp(1, dv);
    // Only the draft vocabulary's logits leave the device (a GPU's whole-vocabulary logits of a 384-token
    // sequence are 233 MB, whose copy cost 4x the forward pass), and the argmax is taken where they live.
    let draft_logits = out.logits.gather_columns(&vocab.ids)?;
    let best = out.logits.argmax_rows()?;
    let logits_read = std::time::Instant::now();
    // Per row: the top k draft tokens with their renormalized probabilities. Rows are independent, so they
    // split across the thread pool.
    let mut top = vec![(0u32, 0f32); t * top_k];
    let rows_per_chunk = 8;
    crate::parallel::for_each_chunk_mut(&mut top, rows_per_chunk * top_k, |start, top| {
        let first = start / top_k;
        let mut scratch: Vec<(u32, f32)> = Vec::with_capacity(dv);
        for (i, out_row) in top.chunks_mut(top_k).enumerate() {
            let row = &draft_logits[(first + i) * dv..(first + i + 1) * dv];
            scratch.clear();
            scratch.extend(row.iter().enumerate().map(|(d, &v)| (d as u32, v)));
            let max = scratch
                .iter()
                .map(|x| x.1)
                .fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = scratch.iter().map(|x| ((x.1 - max) as f64).exp()).sum();
            scratch
                .select_nth_unstable_by(top_k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let kept = &mut scratch[..top_k];
            kept.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let probs: Vec<f64> = kept
                .iter()
                .map(|x| ((x.1 - max) as f64).exp() / sum)
                .collect();
            let kept_mass: f64 = probs.iter().sum();
            for (slot, (x, &p)) in out_row.iter_mut().zip(kept.iter().zip(&probs)) {
                *slot = (x.0, (p / kept_mass) as f32);
            }
        }
    });
    // A row is trained on when it predicts an answer token and the target's choice is draftable.
    let target_ids: Vec<Option<u32>> = best
        .iter()
        .enumerate()
        .map(|(r, &b)| {
            if r + 1 >= text.loss_from {
                vocab.draft_of.get(b as usize).copied().flatten()
            } else {
                None
            }
        })
        .collect();
    times.passes += 1;
    times.forward_s += (forwarded - started).as_secs_f64() - host_s;
    times.logits_s += (logits_read - forwarded).as_secs_f64();
    times.host_s += host_s + logits_read.elapsed().as_secs_f64();
    Ok(TargetOutputs {
        len: t,
        features,
        top_k,
        top,
        target_ids,
    })
}

/// [`target_outputs`] and [`TargetOutputs::sequence`] in one (tests and one-off use).
pub fn prepare(
    target: &dyn Model,
    layers: &[usize],
    vocab: &DraftVocab,
    text: &TrainingText,
    steps: usize,
    top_k: usize,
) -> Result<TrainingSequence> {
    target_outputs(target, layers, vocab, text, top_k)?.sequence(
        target,
        text,
        steps,
        vocab.len(),
        &Device::Cpu,
    )
}

/// Reads training texts written by [`write_texts`].
pub fn read_texts(path: &Path) -> Result<Vec<TrainingText>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                Error::InvalidArgument(format!("{} line {}: {e}", path.display(), i + 1))
            })
        })
        .collect()
}

/// Writes training texts as JSON Lines.
pub fn write_texts(path: &Path, texts: &[TrainingText]) -> Result<()> {
    let mut s = String::new();
    for t in texts {
        s.push_str(&serde_json::to_string(t).map_err(|e| Error::InvalidArgument(e.to_string()))?);
        s.push('\n');
    }
    std::fs::write(path, s).map_err(|e| Error::io(path, e))
}
