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

/// Loss and accuracy of one sequence, per unrolled step.
pub struct TttOutput {
    /// Sum over steps of 0.8^step x mean loss (the graph to differentiate).
    pub loss: Tensor,
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

/// Rotates `[n, T, hd]` by per-row angles (`cos`, `sin` `[T, hd/2]`), first half against second half.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(2)? / 2;
    let x1 = x.narrow(2, 0, half)?;
    let x2 = x.narrow(2, half, half)?;
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[&a, &b], 2)
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
        let s = &self.shape;
        let t = seq.len;
        if t < 2 || steps == 0 {
            return Err(Error::InvalidArgument(format!(
                "a training sequence needs at least 2 tokens and 1 step (got {t} tokens, {steps} steps)"
            )));
        }
        let (nh, nkv, hd) = (s.heads, s.kv_heads, s.head_dim);
        let group = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();
        let [fc, hidden_norm, input_norm, wq, wk, wv, wo, post_norm, w_gate, w_up, w_down, final_norm, lm_head] =
            std::array::from_fn(|i| self.get(i));
        let dev = seq.features.device().clone();
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
        let expand_kv = |x: &Tensor| -> candle_core::Result<Tensor> {
            if group == 1 {
                return Ok(x.clone());
            }
            x.unsqueeze(1)?
                .broadcast_as((nkv, group, t, hd))?
                .reshape((nh, t, hd))
        };

        let mut x = seq.features.matmul(&fc.t()?)?;
        let mut keys: Vec<Tensor> = Vec::new();
        let mut values: Vec<Tensor> = Vec::new();
        let mut outs = Vec::new();
        for step in 0..steps.min(t - 1) {
            let e = seq.embeds.narrow(0, step, t)?;
            let a = Tensor::cat(
                &[
                    &rms_norm(&e, input_norm, s.eps)?,
                    &rms_norm(&x, hidden_norm, s.eps)?,
                ],
                1,
            )?;
            let (cos, sin) = rope_table(step)?;
            let heads_of = |w: &Tensor, n: usize| -> candle_core::Result<Tensor> {
                a.matmul(&w.t()?)?
                    .reshape((t, n, hd))?
                    .transpose(0, 1)?
                    .contiguous()
            };
            let q = rope(&heads_of(wq, nh)?, &cos, &sin)?;
            keys.push(expand_kv(&rope(&heads_of(wk, nkv)?, &cos, &sin)?)?);
            values.push(expand_kv(&heads_of(wv, nkv)?)?);
            // Scores against the step-0 keys (causal) and against each later step's key of the same row.
            let mut scores = vec![(q.matmul(&keys[0].t()?)? * scale)?.broadcast_add(&mask)?];
            for key in &keys[1..] {
                scores.push(((&q * key)?.sum_keepdim(2)? * scale)?);
            }
            let probs = softmax(&Tensor::cat(&scores, 2)?)?;
            let mut attn = probs.narrow(2, 0, t)?.contiguous()?.matmul(&values[0])?;
            for (i, value) in values.iter().enumerate().skip(1) {
                attn = (attn + probs.narrow(2, t + i - 1, 1)?.broadcast_mul(value)?)?;
            }
            let attn = attn.transpose(0, 1)?.reshape((t, nh * hd))?;
            let r1 = (&x + attn.matmul(&wo.t()?)?)?;
            let m = rms_norm(&r1, post_norm, s.eps)?;
            let gated = (m.matmul(&w_gate.t()?)?.silu()? * m.matmul(&w_up.t()?)?)?;
            let y = (&r1 + gated.matmul(&w_down.t()?)?)?;
            // Row r (< t - 1 - step) predicts token r + step + 2: the target's row r + step + 1.
            let rows = t - 1 - step;
            let logits =
                rms_norm(&y.narrow(0, 0, rows)?, final_norm, s.eps)?.matmul(&lm_head.t()?)?;
            outs.push((y.clone(), logits));
            x = y;
        }
        Ok(outs)
    }

    /// Runs `steps` unrolled steps over one sequence and returns the weighted loss with per-step statistics: at
    /// step j, soft cross-entropy against the target's distribution, over the rows with a target.
    pub fn forward_ttt(&self, seq: &TrainingSequence, steps: usize) -> Result<TttOutput> {
        let t = seq.len;
        let dev = seq.features.device().clone();
        let mut total: Option<Tensor> = None;
        let mut out = TttOutput {
            loss: Tensor::zeros((), DType::F32, &dev)?,
            step_loss: Vec::new(),
            correct: Vec::new(),
            counted: Vec::new(),
        };
        for (step, (_, logits)) in self.unroll(seq, steps)?.into_iter().enumerate() {
            let rows = t - 1 - step;
            let ids = &seq.target_ids[step + 1..t];
            let weights: Vec<f32> = ids
                .iter()
                .map(|id| if id.is_some() { 1.0 } else { 0.0 })
                .collect();
            let counted = ids.iter().filter(|id| id.is_some()).count();
            let weights = Tensor::from_vec(weights, rows, &dev)?;
            let target = seq.target_probs.narrow(0, step + 1, rows)?;
            let per_row = (target * log_softmax(&logits)?)?.sum(1)?;
            let step_loss = ((per_row * weights)?.sum_all()? * (-1.0 / counted.max(1) as f64))?;
            out.step_loss.push(step_loss.to_scalar::<f32>()?);
            let weighted = (&step_loss * STEP_DECAY.powi(step as i32))?;
            total = Some(match total {
                None => weighted,
                Some(acc) => (acc + weighted)?,
            });
            let best = logits.argmax_keepdim(1)?.flatten_all()?.to_vec1::<u32>()?;
            let correct = best
                .iter()
                .zip(ids)
                .filter(|(b, id)| Some(**b) == **id)
                .count();
            out.correct.push(correct);
            out.counted.push(counted);
        }
        if let Some(total) = total {
            out.loss = total;
        }
        Ok(out)
    }
}
