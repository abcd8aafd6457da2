//! Training EAGLE-3 heads (`specula train-eagle3`): the target produces the data (its hidden states and
//! distributions on its own answers and on a corpus), the head learns them with the training-time-test unrolling,
//! AdamW with warmup and cosine decay, gradient clipping; checkpoints resume; the result is written in the
//! published layout (config.json + model.safetensors with d2t) that specula, SGLang and vLLM load.
//!
//! Autograd: candle-core's (already a dependency for its quantized block types), on the CPU or, in a build with
//! the `train-cuda` feature, on the GPU. docs/eagle3.md says why it over the alternatives.

pub mod data;
pub mod net;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use crate::error::{Error, Result};
use crate::model::config::Config;
use crate::model::{LoadedModel, Model};

pub use data::{DraftVocab, TargetOutputs, TrainingText};
pub use net::{HeadParams, HeadShape, TrainingSequence};

use super::head::HeadConfig;

/// What to train and how.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Where the head (config.json, model.safetensors), its checkpoint and its data go.
    pub out: PathBuf,
    pub draft_vocab: usize,
    /// Unrolled training-time-test steps (SpecForge: 7).
    pub ttt_steps: usize,
    pub epochs: usize,
    /// Sequences per optimizer step.
    pub batch: usize,
    /// Sequences per forward and backward graph; smaller saves memory, the gradients are the same. None: one
    /// on the CPU, the whole batch on a GPU ([`TrainOptions::graph_sequences`]).
    pub micro_batch: Option<usize>,
    pub lr: f64,
    /// Share of the optimizer steps spent warming the learning rate up.
    pub warmup: f64,
    pub grad_clip: f64,
    pub weight_decay: f64,
    pub seed: u64,
    /// Target layers to read ("output of layer i"); None: SGLang's default [1, n/2 - 1, n - 4].
    pub aux_layers: Option<Vec<usize>>,
    /// The head's MLP width; None: the target's.
    pub intermediate_size: Option<usize>,
    /// Every n-th sequence is held out to measure accuracy (the training record).
    pub eval_every: usize,
    /// Optimizer steps between checkpoints.
    pub checkpoint_every: usize,
    /// Stop (with a checkpoint and an exported head) after this long.
    pub max_time: Option<Duration>,
    /// Continue from the checkpoint in `out`.
    pub resume: bool,
    /// Start from this head's weights and draft vocabulary (a directory in the published layout, e.g. one
    /// trained on other data) instead of random ones.
    pub init_head: Option<PathBuf>,
    /// Draft tokens of the target's distribution kept per position (renormalized).
    pub top_k: usize,
    /// Memory for the target's outputs kept between epochs (beyond it they are recomputed).
    pub cache_bytes: usize,
    /// Training sequences whose target passes run ahead on a second thread while the head trains (0: each
    /// pass runs when its sequence comes up). On a GPU the target's passes and the host work around them were
    /// 47% of a training run (session 20); ahead of time they overlap the head's own work.
    pub prefetch: usize,
    /// Where the head trains (candle's device; the target runs wherever it was loaded).
    pub device: Device,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            out: PathBuf::from("eagle3-head"),
            draft_vocab: 8192,
            ttt_steps: 4,
            epochs: 2,
            batch: 4,
            micro_batch: None,
            lr: 5e-4,
            warmup: 0.03,
            grad_clip: 0.5,
            weight_decay: 0.0,
            seed: 0,
            aux_layers: None,
            intermediate_size: None,
            eval_every: 20,
            checkpoint_every: 50,
            max_time: None,
            resume: false,
            init_head: None,
            top_k: 32,
            cache_bytes: 4 << 30,
            prefetch: 0,
            device: Device::Cpu,
        }
    }
}

impl TrainOptions {
    /// Sequences per forward/backward graph. A GPU runs one sequence's graph launch-bound (by count about 1400
    /// small operations a step), so it takes the whole batch in one graph (not yet measured on a GPU). The CPU
    /// takes one at a time: four 384-token sequences in one graph measured 2x slower a step (smollm2-135m's
    /// head, 2 cores), the kernel zeroing fresh pages for logits tensors above glibc's 32 MB mmap threshold.
    pub fn graph_sequences(&self) -> usize {
        match self.micro_batch {
            Some(n) => n.max(1),
            None if self.device.is_cpu() => 1,
            None => self.batch.max(1),
        }
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::InvalidArgument(what.to_string()));
        if self.draft_vocab == 0 {
            return bad("--draft-vocab must be at least 1");
        }
        if self.ttt_steps == 0 || self.ttt_steps > 16 {
            return bad("--ttt-steps must be between 1 and 16");
        }
        if self.epochs == 0 || self.batch == 0 {
            return bad("--epochs and --batch must be at least 1");
        }
        if self.micro_batch == Some(0) {
            return bad("--micro-batch must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr < 1.0) {
            return bad("--lr must be between 0 and 1");
        }
        if !(0.0..1.0).contains(&self.warmup) {
            return bad("--warmup must be a share in [0, 1)");
        }
        if self.top_k == 0 {
            return bad("--top-k must be at least 1");
        }
        if self.eval_every < 2 {
            return bad("--eval-every must be at least 2");
        }
        if self.prefetch > 64 {
            return bad("--prefetch must be at most 64 sequences");
        }
        Ok(())
    }
}

/// Where training stands, after each optimizer step.
#[derive(Debug, Clone)]
pub struct TrainProgress {
    pub step: usize,
    pub total_steps: usize,
    pub epoch: usize,
    /// Weighted loss of the last step's batch.
    pub loss: f32,
    /// Accuracy per unrolled step over the recent batches (draft argmax = target argmax).
    pub step_accuracy: Vec<f64>,
    pub tokens_per_s: f64,
    pub lr: f64,
    /// Seconds spent so far in this run on: the target's outputs and the sequence's tensors, the head's forward,
    /// its backward, the optimizer (on a GPU each part ends with a synchronization, so these are device times).
    pub phase_s: [f64; 4],
}

/// What training produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainReport {
    pub out: PathBuf,
    pub steps: usize,
    pub total_steps: usize,
    /// Training stopped at --max-time before the last step.
    pub stopped_early: bool,
    pub train_sequences: usize,
    pub eval_sequences: usize,
    pub tokens_trained: usize,
    pub wall_s: f64,
    pub parameters: usize,
    pub target_layers: Vec<usize>,
    pub draft_vocab: usize,
    /// Share of the answer tokens the draft vocabulary holds.
    pub coverage: f64,
    /// Held-out accuracy per unrolled step (draft argmax = target argmax), and loss per step.
    pub eval_accuracy: Vec<f64>,
    pub eval_loss: Vec<f32>,
    /// Held-out accuracy and loss of the untrained head (the same measurement before the first step).
    pub initial_eval_accuracy: Vec<f64>,
    pub initial_eval_loss: Vec<f32>,
    pub head_bytes: u64,
    pub head_sha256: String,
    /// Where this run's target passes spent their time.
    pub target_passes: data::TargetPassTimes,
}

/// The head's config.json (published layout: SpecForge's export, which SGLang and vLLM load).
pub fn head_config_json(
    target: &Config,
    layers: &[usize],
    draft_vocab: usize,
    intermediate: usize,
) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "max_position_embeddings": target.context_length,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target.hidden_size,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": layers,
            "use_aux_hidden_state": true,
        },
    })
}

/// The target layers a head trained with `aux` reads (checked against the target; None: SGLang's default).
pub fn target_layers(target: &Config, aux: Option<&[usize]>) -> Result<Vec<usize>> {
    let json = head_config_json(target, &[0, 0, 0], 1, target.intermediate_size);
    let mut hc = HeadConfig::from_json(&json.to_string(), Path::new("config.json"))?;
    hc.aux_layers = aux.map(|a| a.to_vec());
    hc.target_layers(target.num_layers)
}

/// candle's device for training on `device`. The GPU needs a build with the `train-cuda` feature (candle's CUDA
/// kernels are compiled with nvcc at build time: scripts/build-train-cuda.sh); there matrix products run in TF32
/// (SpecForge trains in bf16; the head's weights and Adam's moments stay f32).
pub fn training_device(device: crate::backend::Device) -> Result<Device> {
    match device {
        crate::backend::Device::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "train-cuda")]
        crate::backend::Device::Cuda(index) => {
            let dev = Device::new_cuda(index)
                .map_err(|e| Error::InvalidArgument(format!("training on cuda:{index}: {e}")))?;
            candle_core::cuda::set_gemm_reduced_precision_f32(true);
            Ok(dev)
        }
        #[cfg(not(feature = "train-cuda"))]
        crate::backend::Device::Cuda(index) => Err(Error::InvalidArgument(format!(
            "training on cuda:{index} needs a specula built with the train-cuda feature \
             (scripts/build-train-cuda.sh); --train-device cpu trains the head on the CPU"
        ))),
    }
}

/// Adam moments of one parameter.
struct Moments {
    m: Tensor,
    v: Tensor,
}

fn checkpoint_dir(out: &Path) -> PathBuf {
    out.join("checkpoint")
}

/// The checkpoint's bookkeeping (tensors are in state.safetensors beside it).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct CheckpointState {
    step: usize,
    epoch: usize,
    /// Sequences of this epoch's order already trained on.
    position: usize,
    target_layers: Vec<usize>,
    draft_vocab: usize,
    intermediate: usize,
    ttt_steps: usize,
    seed: u64,
    tokens_trained: usize,
    initial_eval_accuracy: Vec<f64>,
    #[serde(default)]
    initial_eval_loss: Vec<f32>,
}

fn save_checkpoint(
    out: &Path,
    params: &HeadParams,
    moments: &[Moments],
    vocab: &DraftVocab,
    state: &CheckpointState,
) -> Result<()> {
    let dir = checkpoint_dir(out);
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for ((name, var), m) in params.vars.iter().zip(moments) {
        let host = |t: &Tensor| t.to_device(&Device::Cpu);
        tensors.insert(format!("param.{name}"), host(var.as_tensor())?);
        tensors.insert(format!("adam_m.{name}"), host(&m.m)?);
        tensors.insert(format!("adam_v.{name}"), host(&m.v)?);
    }
    let ids: Vec<i64> = vocab.ids.iter().map(|&i| i64::from(i)).collect();
    tensors.insert(
        "draft_ids".into(),
        Tensor::from_vec(ids, vocab.len(), &Device::Cpu)?,
    );
    // Write beside, then rename: a crash mid-write leaves the previous checkpoint intact.
    let tmp = dir.join("state.safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp)?;
    let final_path = dir.join("state.safetensors");
    std::fs::rename(&tmp, &final_path).map_err(|e| Error::io(&final_path, e))?;
    let json = dir.join("state.json");
    let text =
        serde_json::to_string_pretty(state).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    std::fs::write(&json, text).map_err(|e| Error::io(&json, e))
}

fn load_checkpoint(
    out: &Path,
    target: &Config,
    shape_of: &dyn Fn(&CheckpointState) -> Result<HeadShape>,
    device: &Device,
) -> Result<(HeadParams, Vec<Moments>, DraftVocab, CheckpointState)> {
    let dir = checkpoint_dir(out);
    let json = dir.join("state.json");
    let text = std::fs::read_to_string(&json).map_err(|e| Error::io(&json, e))?;
    let state: CheckpointState = serde_json::from_str(&text)
        .map_err(|e| Error::InvalidArgument(format!("{}: {e}", json.display())))?;
    let path = dir.join("state.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let mut take = |name: String| {
        tensors.remove(&name).ok_or_else(|| Error::MissingTensor {
            name,
            hint: format!(" in the checkpoint {}", path.display()),
        })
    };
    let ids = take("draft_ids".into())?.to_vec1::<i64>()?;
    let ids: Vec<u32> = ids
        .into_iter()
        .map(|i| u32::try_from(i).map_err(|_| Error::InvalidArgument(format!("bad draft id {i}"))))
        .collect::<Result<_>>()?;
    let vocab = DraftVocab::from_ids(ids, target.vocab_size)?;
    let shape = shape_of(&state)?;
    let params =
        HeadParams::from_tensors(shape.clone(), device, |name| take(format!("param.{name}")))?;
    let mut moments = Vec::new();
    for (name, _) in shape.tensors() {
        moments.push(Moments {
            m: take(format!("adam_m.{name}"))?.to_device(device)?,
            v: take(format!("adam_v.{name}"))?.to_device(device)?,
        });
    }
    Ok((params, moments, vocab, state))
}

/// A head's shape from its target layers, draft vocabulary size and MLP width.
type ShapeOf<'a> = dyn Fn(&[usize], usize, usize) -> Result<HeadShape> + 'a;

/// The weights and draft vocabulary of a head to start training from (`--init-head`), checked against the run's
/// target layers and MLP width.
/// Where a head grown to a larger draft vocabulary starts the LM head rows of its new tokens: the target's
/// embedding rows of those tokens when it ties them to its output layer (as a fresh head starts), else zeros.
type NewRows<'a> = dyn Fn(&[u32]) -> Result<Option<Vec<f32>>> + 'a;

#[allow(clippy::too_many_arguments)]
fn initial_head(
    dir: &Path,
    target: &Config,
    layers: &[usize],
    intermediate: usize,
    shape_of: &ShapeOf<'_>,
    device: &Device,
    grow_to: usize,
    texts: &[TrainingText],
    new_rows: &NewRows<'_>,
) -> Result<(HeadParams, DraftVocab)> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let hc = HeadConfig::from_json(&text, &config_path)?;
    let head_layers = hc.target_layers(target.num_layers)?;
    if head_layers != layers || hc.layer.intermediate_size != intermediate {
        return Err(Error::InvalidArgument(format!(
            "--init-head {}: the head reads target layers {head_layers:?} with an MLP of {}; this run trains \
             layers {layers:?} with {intermediate} (--aux-layers, --intermediate-size)",
            dir.display(),
            hc.layer.intermediate_size
        )));
    }
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let mut take = |name: &str| {
        tensors.remove(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            hint: format!(" in the head {}", path.display()),
        })
    };
    let d2t = take("d2t")?.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    // d2t holds target id - draft id; the trainer keeps draft ids in target-id order.
    let ids: Vec<u32> = d2t
        .iter()
        .enumerate()
        .map(|(d, &off)| {
            u32::try_from(d as i64 + off).map_err(|_| {
                Error::InvalidArgument(format!(
                    "{}: d2t[{d}] = {off} is no target id",
                    path.display()
                ))
            })
        })
        .collect::<Result<_>>()?;
    if ids.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::InvalidArgument(format!(
            "{}: the draft vocabulary is not in target-id order (a head trained elsewhere; --init-head takes \
             specula's)",
            path.display()
        )));
    }
    let had = DraftVocab::from_ids(ids, target.vocab_size)?;
    // --draft-vocab above the head's grows it by the data's most frequent tokens it lacks (its rows kept).
    let vocab = had.grown(texts, grow_to)?;
    if vocab.len() > had.len() {
        let old = take("lm_head.weight")?;
        let dtype = old.dtype();
        let h = old.dim(1)?;
        let old = old.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let added: Vec<u32> = vocab
            .ids
            .iter()
            .copied()
            .filter(|&t| had.draft_of[t as usize].is_none())
            .collect();
        let init = new_rows(&added)?;
        if init.as_ref().is_some_and(|v| v.len() != added.len() * h) {
            return Err(Error::InvalidArgument(format!(
                "growing the draft vocabulary: {} new rows of {h} expected",
                added.len()
            )));
        }
        let mut rows = Vec::with_capacity(vocab.len() * h);
        let mut next_new = 0;
        for &t in &vocab.ids {
            match had.draft_of[t as usize] {
                Some(d) => rows.extend_from_slice(&old[d as usize * h..(d as usize + 1) * h]),
                None => {
                    match &init {
                        Some(v) => rows.extend_from_slice(&v[next_new * h..(next_new + 1) * h]),
                        None => rows.extend(std::iter::repeat_n(0.0, h)),
                    }
                    next_new += 1;
                }
            }
        }
        let grown =
            candle_core::Tensor::from_vec(rows, (vocab.len(), h), &Device::Cpu)?.to_dtype(dtype)?;
        tensors.insert("lm_head.weight".to_string(), grown);
    }
    let mut take = |name: &str| {
        tensors.remove(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            hint: format!(" in the head {}", path.display()),
        })
    };
    let shape = shape_of(layers, vocab.len(), intermediate)?;
    let params = HeadParams::from_tensors(shape, device, &mut take)?;
    Ok((params, vocab))
}

/// Writes the head in the published layout: config.json and model.safetensors (weights in `dtype`, bf16 for
/// use; int64 d2t).
pub fn export_head(
    out: &Path,
    params: &HeadParams,
    vocab: &DraftVocab,
    config: &serde_json::Value,
    dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, var) in &params.vars {
        tensors.insert(
            name.to_string(),
            var.as_tensor().to_dtype(dtype)?.to_device(&Device::Cpu)?,
        );
    }
    tensors.insert(
        "d2t".into(),
        Tensor::from_vec(vocab.d2t(), vocab.len(), &Device::Cpu)?,
    );
    let path = out.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path)?;
    let config_path = out.join("config.json");
    let text =
        serde_json::to_string_pretty(config).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    std::fs::write(&config_path, text).map_err(|e| Error::io(&config_path, e))
}

/// The target's outputs per training text, computed once and kept within a memory budget.
struct TargetCache<'a> {
    target: &'a dyn Model,
    device: Device,
    layers: Vec<usize>,
    top_k: usize,
    entries: Vec<Option<TargetOutputs>>,
    bytes: usize,
    budget: usize,
    times: data::TargetPassTimes,
}

impl TargetCache<'_> {
    fn sequence(
        &mut self,
        texts: &[TrainingText],
        i: usize,
        vocab: &DraftVocab,
        steps: usize,
    ) -> Result<TrainingSequence> {
        let text = &texts[i];
        if let Some(outputs) = &self.entries[i] {
            let started = Instant::now();
            let seq = outputs.sequence(self.target, text, steps, vocab.len(), &self.device);
            self.times.tensors_s += started.elapsed().as_secs_f64();
            return seq;
        }
        let outputs = data::target_outputs_timed(
            self.target,
            &self.layers,
            vocab,
            text,
            self.top_k,
            &mut self.times,
        )?;
        let started = Instant::now();
        let seq = outputs.sequence(self.target, text, steps, vocab.len(), &self.device)?;
        self.times.tensors_s += started.elapsed().as_secs_f64();
        self.keep(i, outputs);
        Ok(seq)
    }

    /// Keeps text `i`'s outputs for later epochs when they fit the budget.
    fn keep(&mut self, i: usize, outputs: TargetOutputs) {
        if self.bytes + outputs.bytes() <= self.budget {
            self.bytes += outputs.bytes();
            self.entries[i] = Some(outputs);
        }
    }
}

/// One training sequence prepared ahead: text `text`'s target outputs, its training tensors, and the time they
/// took.
struct Prepared {
    text: usize,
    outputs: TargetOutputs,
    seq: TrainingSequence,
    times: data::TargetPassTimes,
}

/// Runs the target over `texts` (in order) on the calling thread, sending each prepared sequence down `tx`;
/// stops at the first error (sent too) or when the receiver is gone.
#[allow(clippy::too_many_arguments)]
fn prepare_ahead(
    target: &dyn Model,
    layers: &[usize],
    top_k: usize,
    vocab: &DraftVocab,
    all: &[TrainingText],
    texts: &[usize],
    steps: usize,
    device: &Device,
    tx: std::sync::mpsc::SyncSender<Result<Prepared>>,
) {
    for &text in texts {
        let mut times = data::TargetPassTimes::default();
        let prepared =
            data::target_outputs_timed(target, layers, vocab, &all[text], top_k, &mut times)
                .and_then(|outputs| {
                    let started = Instant::now();
                    let seq = outputs.sequence(target, &all[text], steps, vocab.len(), device)?;
                    times.tensors_s += started.elapsed().as_secs_f64();
                    Ok(Prepared {
                        text,
                        outputs,
                        seq,
                        times,
                    })
                });
        let failed = prepared.is_err();
        if tx.send(prepared).is_err() || failed {
            return;
        }
    }
}

/// Held-out loss and accuracy per unrolled step, as many sequences a graph as training takes.
fn evaluate(
    cache: &mut TargetCache<'_>,
    texts: &[TrainingText],
    eval: &[usize],
    params: &HeadParams,
    vocab: &DraftVocab,
    opts: &TrainOptions,
) -> Result<(Vec<f64>, Vec<f32>)> {
    let steps = opts.ttt_steps;
    let mut correct = vec![0usize; steps];
    let mut counted = vec![0usize; steps];
    let mut loss = vec![0f64; steps];
    for chunk in eval.chunks(opts.graph_sequences()) {
        let seqs = chunk
            .iter()
            .map(|&i| cache.sequence(texts, i, vocab, steps))
            .collect::<Result<Vec<_>>>()?;
        let seqs: Vec<&TrainingSequence> = seqs.iter().collect();
        let out = params.forward_ttt_batch(&seqs, steps)?;
        for j in 0..out.correct.len() {
            correct[j] += out.correct[j];
            counted[j] += out.counted[j];
            loss[j] += out.step_loss[j] as f64 * out.counted[j] as f64;
        }
    }
    Ok((
        (0..steps)
            .map(|j| correct[j] as f64 / counted[j].max(1) as f64)
            .collect(),
        (0..steps)
            .map(|j| (loss[j] / counted[j].max(1) as f64) as f32)
            .collect(),
    ))
}

fn learning_rate(opts: &TrainOptions, step: usize, total: usize) -> f64 {
    let warm = ((total as f64 * opts.warmup).ceil() as usize).max(1);
    if step < warm {
        return opts.lr * (step + 1) as f64 / warm as f64;
    }
    let progress = (step - warm) as f64 / (total - warm).max(1) as f64;
    opts.lr * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
}

/// Trains a head for `target` on `texts` and writes it to `opts.out`.
pub fn train(
    target: &LoadedModel,
    texts: &[TrainingText],
    opts: &TrainOptions,
    progress: &mut dyn FnMut(&TrainProgress),
) -> Result<TrainReport> {
    opts.validate()?;
    let started = Instant::now();
    let model = target.model.as_ref();
    let tc = model.config().clone();
    if texts.is_empty() {
        return Err(Error::InvalidArgument(
            "no training data: give instruction prompts (--prompts) or a corpus (--corpus)".into(),
        ));
    }
    let eval: Vec<usize> = (0..texts.len()).step_by(opts.eval_every).collect();
    let train_set: Vec<usize> = (0..texts.len())
        .filter(|i| i % opts.eval_every != 0)
        .collect();
    if train_set.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "only {} training sequence(s): at least 2 needed (one is held out to measure accuracy)",
            texts.len()
        )));
    }
    let intermediate = opts.intermediate_size.unwrap_or(tc.intermediate_size);
    // The head's config goes through the same parser that loads heads, so training and inference agree on it.
    let shape_of =
        |layers: &[usize], draft_vocab: usize, intermediate: usize| -> Result<HeadShape> {
            let json = head_config_json(&tc, layers, draft_vocab, intermediate);
            let hc = HeadConfig::from_json(&json.to_string(), &opts.out.join("config.json"))?;
            Ok(HeadShape::new(&hc.layer, tc.hidden_size, draft_vocab))
        };
    let layers = target_layers(&tc, opts.aux_layers.as_deref())?;
    let mut cache = TargetCache {
        target: model,
        device: opts.device.clone(),
        layers: layers.clone(),
        top_k: opts.top_k,
        entries: Vec::new(),
        bytes: 0,
        budget: opts.cache_bytes,
        times: Default::default(),
    };
    cache.entries.resize_with(texts.len(), || None);
    let ckpt_exists = checkpoint_dir(&opts.out).join("state.json").exists();
    if ckpt_exists && !opts.resume {
        return Err(Error::InvalidArgument(format!(
            "{} holds a checkpoint: pass --resume to continue it, or choose another --out",
            opts.out.display()
        )));
    }
    let (params, mut moments, vocab, mut state) = if opts.resume && ckpt_exists {
        let (params, moments, vocab, state) = load_checkpoint(
            &opts.out,
            &tc,
            &|s| shape_of(&s.target_layers, s.draft_vocab, s.intermediate),
            &opts.device,
        )?;
        if state.target_layers != layers || state.ttt_steps != opts.ttt_steps {
            return Err(Error::InvalidArgument(format!(
                "the checkpoint in {} was trained with target layers {:?} and {} unrolled steps; this run asks \
                 for {:?} and {}",
                opts.out.display(),
                state.target_layers,
                state.ttt_steps,
                layers,
                opts.ttt_steps
            )));
        }
        (params, moments, vocab, state)
    } else {
        let (params, vocab) = match &opts.init_head {
            Some(dir) => {
                let new_rows = |ids: &[u32]| -> Result<Option<Vec<f32>>> {
                    if tc.tie_word_embeddings {
                        model.embed_tokens(ids).map(Some)
                    } else {
                        Ok(None)
                    }
                };
                initial_head(
                    dir,
                    &tc,
                    &layers,
                    intermediate,
                    &shape_of,
                    &opts.device,
                    opts.draft_vocab,
                    texts,
                    &new_rows,
                )?
            }
            None => {
                let vocab = DraftVocab::by_frequency(texts, tc.vocab_size, opts.draft_vocab)?;
                let shape = shape_of(&layers, vocab.len(), intermediate)?;
                // Tied targets: their embedding is their output layer, a good start for the head's.
                let lm_init = if tc.tie_word_embeddings {
                    Some(model.embed_tokens(&vocab.ids)?)
                } else {
                    None
                };
                (
                    HeadParams::init(shape, opts.seed, lm_init, &opts.device)?,
                    vocab,
                )
            }
        };
        let moments = params
            .vars
            .iter()
            .map(|(_, v)| {
                Ok(Moments {
                    m: v.as_tensor().zeros_like()?,
                    v: v.as_tensor().zeros_like()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (initial, initial_loss) = evaluate(&mut cache, texts, &eval, &params, &vocab, opts)?;
        let state = CheckpointState {
            step: 0,
            epoch: 0,
            position: 0,
            target_layers: layers.clone(),
            draft_vocab: vocab.len(),
            intermediate,
            ttt_steps: opts.ttt_steps,
            seed: opts.seed,
            tokens_trained: 0,
            initial_eval_accuracy: initial,
            initial_eval_loss: initial_loss,
        };
        (params, moments, vocab, state)
    };
    let steps_per_epoch = train_set.len().div_ceil(opts.batch);
    let total_steps = steps_per_epoch * opts.epochs;
    let coverage = vocab.coverage(texts);
    let (beta1, beta2, adam_eps) = (0.9f64, 0.999f64, 1e-8f64);
    let mut recent: Vec<(usize, usize)> = vec![(0, 0); opts.ttt_steps];
    let mut stopped_early = false;
    let mut window_tokens = 0usize;
    let mut window_start = Instant::now();
    let mut phase_s = [0f64; 4];
    // Closes phase `i`: waits for the device (a GPU runs asynchronously) and adds the time since `lap`.
    let mark = |i: usize, lap: &mut Instant, phase_s: &mut [f64; 4]| -> Result<()> {
        opts.device.synchronize()?;
        phase_s[i] += lap.elapsed().as_secs_f64();
        *lap = Instant::now();
        Ok(())
    };
    let (target_model, target_layers, top_k) = (cache.target, cache.layers.clone(), cache.top_k);
    while state.epoch < opts.epochs {
        let mut order: Vec<usize> = (0..train_set.len()).collect();
        order.shuffle(&mut ChaCha20Rng::seed_from_u64(
            opts.seed ^ (state.epoch as u64).wrapping_mul(0x9E37_79B9),
        ));
        // True when training stopped at the time limit.
        let stopped = std::thread::scope(|scope| -> Result<bool> {
            // The sequences of this epoch (from where it stands) whose outputs are not kept from an earlier epoch,
            // prepared in order on a second thread.
            let ahead = (opts.prefetch > 0).then(|| {
                let pending: Vec<usize> = order[state.position..]
                    .iter()
                    .map(|&i| train_set[i])
                    .filter(|&text| cache.entries[text].is_none())
                    .collect();
                let (tx, rx) = std::sync::mpsc::sync_channel(opts.prefetch);
                let (vocab, layers, device) = (&vocab, &target_layers, &opts.device);
                scope.spawn(move || {
                    prepare_ahead(
                        target_model,
                        layers,
                        top_k,
                        vocab,
                        texts,
                        &pending,
                        opts.ttt_steps,
                        device,
                        tx,
                    )
                });
                rx
            });
            while state.position < order.len() {
                if opts.max_time.is_some_and(|t| started.elapsed() >= t) {
                    return Ok(true);
                }
                let batch = &order[state.position..(state.position + opts.batch).min(order.len())];
                let mut grads: Vec<Option<Tensor>> = vec![None; params.vars.len()];
                let mut batch_loss = 0f32;
                let mut lap = Instant::now();
                // The batch in graphs of `graph_sequences()` sequences each (one graph of several sequences
                // launches a step's small operations once for all of them); only one graph's sequences are
                // held at a time.
                for part in batch.chunks(opts.graph_sequences()) {
                    let mut seqs = Vec::with_capacity(part.len());
                    for &i in part {
                        let text = train_set[i];
                        let seq = match &ahead {
                            Some(rx) if cache.entries[text].is_none() => {
                                let prepared = rx.recv().map_err(|_| {
                                    Error::InvalidArgument(
                                        "the thread running the target's passes stopped".into(),
                                    )
                                })??;
                                if prepared.text != text {
                                    return Err(Error::InvalidArgument(format!(
                                        "training sequence {} arrived where {text} was due",
                                        prepared.text
                                    )));
                                }
                                cache.times.add(&prepared.times);
                                cache.keep(text, prepared.outputs);
                                prepared.seq
                            }
                            _ => cache.sequence(texts, text, &vocab, opts.ttt_steps)?,
                        };
                        seqs.push(seq);
                    }
                    mark(0, &mut lap, &mut phase_s)?;
                    let group: Vec<&TrainingSequence> = seqs.iter().collect();
                    let out = params.forward_ttt_batch(&group, opts.ttt_steps)?;
                    batch_loss += out.loss.to_scalar::<f32>()?;
                    mark(1, &mut lap, &mut phase_s)?;
                    for (r, (&c, &n)) in recent.iter_mut().zip(out.correct.iter().zip(&out.counted))
                    {
                        r.0 += c;
                        r.1 += n;
                    }
                    let store = out.loss.backward()?;
                    for (slot, (_, var)) in grads.iter_mut().zip(&params.vars) {
                        if let Some(g) = store.get(var.as_tensor()) {
                            *slot = Some(match slot.take() {
                                None => g.clone(),
                                Some(acc) => (acc + g)?,
                            });
                        }
                    }
                    let tokens: usize = group.iter().map(|q| q.len).sum();
                    state.tokens_trained += tokens;
                    window_tokens += tokens;
                    mark(2, &mut lap, &mut phase_s)?;
                }
                // Mean over the batch, clipped by global norm.
                let scale = 1.0 / batch.len() as f64;
                // The squared norms summed on the device: one readback, not one per tensor.
                let mut norm_sq: Option<Tensor> = None;
                for g in grads.iter().flatten() {
                    let sq = g.sqr()?.sum_all()?;
                    norm_sq = Some(match norm_sq {
                        None => sq,
                        Some(acc) => (acc + sq)?,
                    });
                }
                let norm_sq = match norm_sq {
                    Some(sq) => sq.to_scalar::<f32>()? as f64 * scale * scale,
                    None => 0.0,
                };
                let norm = norm_sq.sqrt();
                let clip = if norm > opts.grad_clip {
                    opts.grad_clip / norm
                } else {
                    1.0
                };
                let lr = learning_rate(opts, state.step, total_steps);
                let t = (state.step + 1) as i32;
                let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
                for ((g, (_, var)), mom) in grads.iter().zip(&params.vars).zip(moments.iter_mut()) {
                    let Some(g) = g else { continue };
                    let g = (g * (scale * clip))?;
                    mom.m = ((&mom.m * beta1)? + (&g * (1.0 - beta1))?)?;
                    mom.v = ((&mom.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                    let update = (&mom.m * (1.0 / bc1))?
                        .div(&((&mom.v * (1.0 / bc2))?.sqrt()? + adam_eps)?)?;
                    let p = var.as_tensor();
                    let decayed = (p * (1.0 - lr * opts.weight_decay))?;
                    var.set(&(decayed - (update * lr)?)?)?;
                }
                mark(3, &mut lap, &mut phase_s)?;
                state.position += batch.len();
                state.step += 1;
                let elapsed = window_start.elapsed().as_secs_f64();
                progress(&TrainProgress {
                    step: state.step,
                    total_steps,
                    epoch: state.epoch,
                    loss: batch_loss / batch.len() as f32,
                    step_accuracy: recent
                        .iter()
                        .map(|&(c, n)| c as f64 / n.max(1) as f64)
                        .collect(),
                    tokens_per_s: window_tokens as f64 / elapsed.max(1e-9),
                    lr,
                    phase_s,
                });
                if elapsed > 30.0 {
                    window_tokens = 0;
                    window_start = Instant::now();
                    recent.iter_mut().for_each(|r| *r = (0, 0));
                }
                if state.step % opts.checkpoint_every == 0 {
                    save_checkpoint(&opts.out, &params, &moments, &vocab, &state)?;
                }
            }
            Ok(false)
        })?;
        if stopped {
            stopped_early = true;
            break;
        }
        state.epoch += 1;
        state.position = 0;
    }
    save_checkpoint(&opts.out, &params, &moments, &vocab, &state)?;
    let (eval_accuracy, eval_loss) = evaluate(&mut cache, texts, &eval, &params, &vocab, opts)?;
    let mut config = head_config_json(&tc, &layers, vocab.len(), state.intermediate);
    config["specula_training"] = serde_json::json!({
        "target": target.spec,
        "steps": state.step,
        "tokens_trained": state.tokens_trained,
        "ttt_steps": opts.ttt_steps,
        "eval_accuracy_per_step": eval_accuracy,
        "draft_vocab_coverage": coverage,
    });
    export_head(&opts.out, &params, &vocab, &config, DType::BF16)?;
    // The export must load as a head for this target.
    let head = super::head::Eagle3Head::load(&opts.out)?;
    head.check_target(&tc)?;
    let weights = opts.out.join("model.safetensors");
    let bytes = std::fs::read(&weights).map_err(|e| Error::io(&weights, e))?;
    use sha2::Digest;
    let sha = format!("{:x}", sha2::Sha256::digest(&bytes));
    Ok(TrainReport {
        out: opts.out.clone(),
        steps: state.step,
        total_steps,
        stopped_early,
        train_sequences: train_set.len(),
        eval_sequences: eval.len(),
        tokens_trained: state.tokens_trained,
        wall_s: started.elapsed().as_secs_f64(),
        parameters: params.parameter_count(),
        target_layers: layers,
        draft_vocab: vocab.len(),
        coverage,
        eval_accuracy,
        eval_loss,
        initial_eval_accuracy: state.initial_eval_accuracy.clone(),
        initial_eval_loss: state.initial_eval_loss.clone(),
        head_bytes: bytes.len() as u64,
        head_sha256: sha,
        target_passes: cache.times,
    })
}
