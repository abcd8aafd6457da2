//! The EAGLE-3 head as a differentiable graph (candle's autograd) for training, with the training-time-test
//! unrolling of the EAGLE-3 paper: step 0 reads fc(target features), each later step reads the previous step's
//! output at the same row, one position further on, and attends to the step-0 keys up to its row plus its own
//! earlier steps' keys at that row. That is exactly what the drafter sees at inference (head.rs): the head's cache
//! holds rows computed from the target's features, and each draft step adds one row that sees them and the
//! earlier draft rows. A test runs both on the same weights and compares.

use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::error::{Error, Result};
use crate::model::config::Config;

/// Sizes of the head being trained.
#[derive(Debug, Clone)]
pub struct HeadShape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub target_hidden: usize,
    pub draft_vocab: usize,
    pub eps: f64,
    /// RoPE inverse frequencies (half the head width), as the inference path computes them.
    pub rope_inv_freqs: Vec<f32>,
}

impl HeadShape {
    /// The shape of a head whose decoder layer is `layer` (the head's config, as head.rs parses it).
    pub fn new(layer: &Config, target_hidden: usize, draft_vocab: usize) -> Self {
        HeadShape {
            hidden: layer.hidden_size,
            heads: layer.num_heads,
            kv_heads: layer.num_kv_heads,
            head_dim: layer.head_dim,
            intermediate: layer.intermediate_size,
            target_hidden,
            draft_vocab,
            eps: layer.rms_norm_eps,
            rope_inv_freqs: layer.rope_inv_freqs(None),
        }
    }

    /// Every trained tensor: its name in the published layout and its shape.
    pub fn tensors(&self) -> Vec<(&'static str, Vec<usize>)> {
        let (h, q, kv, ff) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        );
        vec![
            ("fc.weight", vec![h, 3 * self.target_hidden]),
            ("midlayer.hidden_norm.weight", vec![h]),
            ("midlayer.input_layernorm.weight", vec![h]),
            ("midlayer.self_attn.q_proj.weight", vec![q, 2 * h]),
            ("midlayer.self_attn.k_proj.weight", vec![kv, 2 * h]),
            ("midlayer.self_attn.v_proj.weight", vec![kv, 2 * h]),
            ("midlayer.self_attn.o_proj.weight", vec![h, q]),
            ("midlayer.post_attention_layernorm.weight", vec![h]),
            ("midlayer.mlp.gate_proj.weight", vec![ff, h]),
            ("midlayer.mlp.up_proj.weight", vec![ff, h]),
            ("midlayer.mlp.down_proj.weight", vec![h, ff]),
            ("norm.weight", vec![h]),
            ("lm_head.weight", vec![self.draft_vocab, h]),
        ]
    }
}

/// The head's trainable tensors, in [`HeadShape::tensors`] order.
pub struct HeadParams {
    pub shape: HeadShape,
    pub vars: Vec<(&'static str, Var)>,
}

/// One prepared training sequence of `len` tokens (the target's outputs on it).
pub struct TrainingSequence {
    pub len: usize,
    /// `[len, 3H]`: the target's hidden states at the head's layers, low ++ mid ++ high, per position.
    pub features: Tensor,
    /// `[len + steps, h]`: row i is the embedding of token i + 1 (zeros past the end).
    pub embeds: Tensor,
    /// `[len, draft_vocab]`: row r is the target's distribution of token r + 1, restricted to the draft
    /// vocabulary and renormalized.
    pub target_probs: Tensor,
    /// Per row r: the draft id of the target's most likely token r + 1, or None when that token is outside the
    /// draft vocabulary or row r is not trained on (prompt tokens); such rows carry no loss.
    pub target_ids: Vec<Option<u32>>,
}

/// Loss and accuracy of a batch of sequences, per unrolled step.
pub struct TttOutput {
    /// Sum over the batch's sequences of (sum over steps of 0.8^step x the sequence's mean loss at that step):
    /// the graph to differentiate (the training loop divides by the batch size).
    pub loss: Tensor,
    /// Mean loss over the rows counted at each step (all the batch's sequences together).
    pub step_loss: Vec<f32>,
    /// Rows whose draft argmax equals the target's argmax, and rows counted, per step.
    pub correct: Vec<usize>,
    pub counted: Vec<usize>,
}

/// Loss weight of unrolled step j (SpecForge: 0.8^j).
pub const STEP_DECAY: f64 = 0.8;

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let inv = x
        .sqr()?
        .mean_keepdim(D::Minus1)?
        .affine(1.0, eps)?
        .sqrt()?
        .recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(weight)
}

/// Rotates `[.., T, hd]` by per-row angles (`cos`, `sin` `[T, hd/2]`), first half against second half.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let last = x.rank() - 1;
    let half = x.dim(last)? / 2;
    let x1 = x.narrow(last, 0, half)?;
    let x2 = x.narrow(last, half, half)?;
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[&a, &b], last)
}

/// `x`'s first `rows` rows, padded with zero rows up to `rows` when it has fewer.
fn rows_padded(x: &Tensor, rows: usize) -> candle_core::Result<Tensor> {
    let have = x.dim(0)?;
    if have >= rows {
        x.narrow(0, 0, rows)
    } else {
        x.pad_with_zeros(0, 0, rows - have)
    }
}

/// One tensor of each sequence (`part`), each cut or padded to `rows` rows, stacked: `[B, rows, ..]`.
fn stack_rows(
    seqs: &[&TrainingSequence],
    part: impl Fn(&TrainingSequence) -> &Tensor,
    rows: usize,
) -> candle_core::Result<Tensor> {
    let padded = seqs
        .iter()
        .map(|q| rows_padded(part(q), rows))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::stack(&padded, 0)
}

fn log_softmax(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let log_sum = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&log_sum)
}

fn softmax(x: &Tensor) -> candle_core::Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

impl HeadParams {
    /// Random initialization (Llama's: normal, std 0.02; norms at one), from `seed`. `lm_head_init`, when given,
    /// is the draft vocabulary's rows of the target's output embedding (a head starts in the target's output
    /// space and trains much faster from there).
    pub fn init(
        shape: HeadShape,
        seed: u64,
        lm_head_init: Option<Vec<f32>>,
        device: &Device,
    ) -> Result<Self> {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut vars = Vec::new();
        for (name, dims) in shape.tensors() {
            let n: usize = dims.iter().product();
            let data: Vec<f32> = if dims.len() == 1 {
                vec![1.0; n]
            } else if name == "lm_head.weight" && lm_head_init.is_some() {
                let init = lm_head_init.clone().unwrap_or_default();
                if init.len() != n {
                    return Err(Error::InvalidArgument(format!(
                        "lm_head initialization has {} values, {n} needed",
                        init.len()
                    )));
                }
                init
            } else {
                (0..n)
                    .map(|_| {
                        // Box-Muller.
                        let u1: f32 = rng.random::<f32>().max(1e-12);
                        let u2: f32 = rng.random::<f32>();
                        0.02 * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
                    })
                    .collect()
            };
            let t = Tensor::from_vec(data, dims, device)?;
            vars.push((name, Var::from_tensor(&t)?));
        }
        Ok(HeadParams { shape, vars })
    }

    /// Parameters from saved tensors (a checkpoint), each checked against the shape.
    pub fn from_tensors(
        shape: HeadShape,
        device: &Device,
        mut get: impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let mut vars = Vec::new();
        for (name, dims) in shape.tensors() {
            let t = get(name)?;
            if t.dims() != dims.as_slice() {
                return Err(Error::InvalidArgument(format!(
                    "checkpoint tensor {name} has shape {:?}, the head needs {dims:?}",
                    t.dims()
                )));
            }
            vars.push((
                name,
                Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(device)?)?,
            ));
        }
        Ok(HeadParams { shape, vars })
    }

    fn get(&self, i: usize) -> &Tensor {
        self.vars[i].1.as_tensor()
    }

    pub fn parameter_count(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// Runs `steps` unrolled steps over one sequence: each step's output rows (before the final norm, `[len, h]`)
    /// and logits of the rows that have a target (`[len - 1 - step, draft_vocab]`).
    pub fn unroll(&self, seq: &TrainingSequence, steps: usize) -> Result<Vec<(Tensor, Tensor)>> {
        self.unroll_batch(&[seq], steps)?
            .into_iter()
            .map(|(y, logits)| Ok((y.squeeze(0)?, logits.squeeze(0)?)))
            .collect()
    }

    /// Runs `steps` unrolled steps over a batch of sequences in one graph: one sequence's graph is about 1400
    /// small operations a step (forward and backward), which a GPU runs launch-bound (the 1.5B's head trained
    /// at ~6000 tokens/s on an H100, a few percent of its arithmetic rate), so a batch launches them once.
    /// The sequences are padded with zero rows to the longest one, `T` rows; each step returns the outputs
    /// (`[B, T, h]`) and the logits of rows 0..T - 1 - step (`[B, T - 1 - step, draft_vocab]`). A sequence's
    /// rows never see its padding: attention is causal over the step-0 keys and later steps read their own row,
    /// so every real row computes what it computes alone (a test holds the two to each other).
    pub fn unroll_batch(
        &self,
        seqs: &[&TrainingSequence],
        steps: usize,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let s = &self.shape;
        let Some(t) = seqs.iter().map(|q| q.len).max() else {
            return Err(Error::InvalidArgument(
                "a training batch needs a sequence".into(),
            ));
        };
        if let Some(short) = seqs.iter().find(|q| q.len < 2) {
            return Err(Error::InvalidArgument(format!(
                "a training sequence needs at least 2 tokens (got {})",
                short.len
            )));
        }
        if steps == 0 {
            return Err(Error::InvalidArgument(
                "training needs at least 1 unrolled step".into(),
            ));
        }
        let b = seqs.len();
        let n = b * t;
        let (nh, nkv, hd) = (s.heads, s.kv_heads, s.head_dim);
        let group = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();
        let [fc, hidden_norm, input_norm, wq, wk, wv, wo, post_norm, w_gate, w_up, w_down, final_norm, lm_head] =
            std::array::from_fn(|i| self.get(i));
        let dev = seqs[0].features.device().clone();
        let steps = steps.min(t - 1);
        let features = stack_rows(seqs, |q| &q.features, t)?.reshape((n, 3 * s.target_hidden))?;
        let embeds = stack_rows(seqs, |q| &q.embeds, t + steps)?;
        // Causal mask for the step-0 keys: row t sees keys 0..=t.
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t <= i / t {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &dev)?;
        let half = hd / 2;
        let rope_table = |offset: usize| -> candle_core::Result<(Tensor, Tensor)> {
            let mut cos = Vec::with_capacity(t * half);
            let mut sin = Vec::with_capacity(t * half);
            for p in 0..t {
                for i in 0..half {
                    let freq = s.rope_inv_freqs.get(i).copied().unwrap_or(0.0);
                    let (sn, cs) = (((p + offset) as f64) * freq as f64).sin_cos();
                    cos.push(cs as f32);
                    sin.push(sn as f32);
                }
            }
            Ok((
                Tensor::from_vec(cos, (t, half), &dev)?,
                Tensor::from_vec(sin, (t, half), &dev)?,
            ))
        };
        // `[B, nkv, T, hd]` -> `[B, nh, T, hd]`: each KV head serves `group` query heads.
        let expand_kv = |x: &Tensor| -> candle_core::Result<Tensor> {
            if group == 1 {
                return Ok(x.clone());
            }
            x.unsqueeze(2)?
                .broadcast_as((b, nkv, group, t, hd))?
                .reshape((b, nh, t, hd))
        };

        // Rows are (sequence, position) pairs, `[B x T, ..]`, except inside attention.
        let mut x = features.matmul(&fc.t()?)?;
        let mut keys: Vec<Tensor> = Vec::new();
        let mut values: Vec<Tensor> = Vec::new();
        let mut outs = Vec::new();
        for step in 0..steps {
            let e = embeds.narrow(1, step, t)?.reshape((n, s.hidden))?;
            let a = Tensor::cat(
                &[
                    &rms_norm(&e, input_norm, s.eps)?,
                    &rms_norm(&x, hidden_norm, s.eps)?,
                ],
                1,
            )?;
            let (cos, sin) = rope_table(step)?;
            let heads_of = |w: &Tensor, heads: usize| -> candle_core::Result<Tensor> {
                a.matmul(&w.t()?)?
                    .reshape((b, t, heads, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let q = rope(&heads_of(wq, nh)?, &cos, &sin)?;
            keys.push(expand_kv(&rope(&heads_of(wk, nkv)?, &cos, &sin)?)?);
            values.push(expand_kv(&heads_of(wv, nkv)?)?);
            // Scores against the step-0 keys (causal) and against each later step's key of the same row.
            let mut scores = vec![(q.matmul(&keys[0].t()?)? * scale)?.broadcast_add(&mask)?];
            for key in &keys[1..] {
                scores.push(((&q * key)?.sum_keepdim(3)? * scale)?);
            }
            let probs = softmax(&Tensor::cat(&scores, 3)?)?;
            let mut attn = probs.narrow(3, 0, t)?.contiguous()?.matmul(&values[0])?;
            for (i, value) in values.iter().enumerate().skip(1) {
                attn = (attn + probs.narrow(3, t + i - 1, 1)?.broadcast_mul(value)?)?;
            }
            let attn = attn.transpose(1, 2)?.reshape((n, nh * hd))?;
            let r1 = (&x + attn.matmul(&wo.t()?)?)?;
            let m = rms_norm(&r1, post_norm, s.eps)?;
            let gated = (m.matmul(&w_gate.t()?)?.silu()? * m.matmul(&w_up.t()?)?)?;
            let y = (&r1 + gated.matmul(&w_down.t()?)?)?;
            // Row r (< T - 1 - step) predicts token r + step + 2: the target's row r + step + 1.
            let rows = t - 1 - step;
            let kept = y
                .reshape((b, t, s.hidden))?
                .narrow(1, 0, rows)?
                .reshape((b * rows, s.hidden))?;
            let logits = rms_norm(&kept, final_norm, s.eps)?
                .matmul(&lm_head.t()?)?
                .reshape((b, rows, s.draft_vocab))?;
            outs.push((y.reshape((b, t, s.hidden))?, logits));
            x = y;
        }
        Ok(outs)
    }

    /// Runs `steps` unrolled steps over one sequence and returns the weighted loss with per-step statistics: at
    /// step j, soft cross-entropy against the target's distribution, over the rows with a target.
    pub fn forward_ttt(&self, seq: &TrainingSequence, steps: usize) -> Result<TttOutput> {
        self.forward_ttt_batch(&[seq], steps)
    }

    /// [`Self::forward_ttt`] over a batch in one graph: the loss is the sum of each sequence's own loss (each
    /// sequence's steps are means over its own rows, as alone), and the statistics are read back once.
    pub fn forward_ttt_batch(&self, seqs: &[&TrainingSequence], steps: usize) -> Result<TttOutput> {
        let unrolled = self.unroll_batch(seqs, steps)?;
        let t = seqs.iter().map(|q| q.len).max().unwrap_or(0);
        let b = seqs.len();
        let v = self.shape.draft_vocab;
        let dev = seqs[0].features.device().clone();
        let target_probs = stack_rows(seqs, |q| &q.target_probs, t)?;
        let mut total: Option<Tensor> = None;
        let (mut row_ids, mut counted, mut ce_sums, mut argmaxes) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (step, (_, logits)) in unrolled.iter().enumerate() {
            let rows = t - 1 - step;
            // Per batch row: its target draft id, weighted 1 / (the sequence's counted rows at this step).
            let mut ids: Vec<Option<u32>> = Vec::with_capacity(b * rows);
            let mut weights: Vec<f32> = Vec::with_capacity(b * rows);
            let mut present: Vec<f32> = Vec::with_capacity(b * rows);
            let mut step_counted = 0;
            for q in seqs {
                let own = q.target_ids.get(step + 1..q.len).unwrap_or(&[]);
                let n = own.iter().filter(|id| id.is_some()).count();
                step_counted += n;
                let w = 1.0 / n.max(1) as f32;
                for r in 0..rows {
                    let id = own.get(r).copied().flatten();
                    ids.push(id);
                    present.push(if id.is_some() { 1.0 } else { 0.0 });
                    weights.push(if id.is_some() { w } else { 0.0 });
                }
            }
            let logits = logits.reshape((b * rows, v))?;
            let target = target_probs
                .narrow(1, step + 1, rows)?
                .reshape((b * rows, v))?;
            let ce = (target * log_softmax(&logits)?)?.sum(1)?.neg()?;
            let weights = Tensor::from_vec(weights, b * rows, &dev)?;
            let present = Tensor::from_vec(present, b * rows, &dev)?;
            let step_loss = (&ce * weights)?.sum_all()?;
            ce_sums.push((ce * present)?.sum_all()?);
            let weighted = (step_loss * STEP_DECAY.powi(step as i32))?;
            total = Some(match total {
                None => weighted,
                Some(acc) => (acc + weighted)?,
            });
            argmaxes.push(logits.argmax(1)?);
            row_ids.push(ids);
            counted.push(step_counted);
        }
        // One readback for the whole batch: a synchronization per step would serialize host and device.
        let ce_sums = Tensor::stack(&ce_sums, 0)?.to_vec1::<f32>()?;
        let best = Tensor::cat(&argmaxes, 0)?.to_vec1::<u32>()?;
        let mut best = best.into_iter();
        let correct = row_ids
            .iter()
            .map(|ids| {
                ids.iter()
                    .zip(best.by_ref())
                    .filter(|(id, b)| **id == Some(*b))
                    .count()
            })
            .collect();
        Ok(TttOutput {
            loss: match total {
                Some(total) => total,
                None => Tensor::zeros((), DType::F32, &dev)?,
            },
            step_loss: ce_sums
                .iter()
                .zip(&counted)
                .map(|(&sum, &n)| sum / n.max(1) as f32)
                .collect(),
            correct,
            counted,
        })
    }
}
