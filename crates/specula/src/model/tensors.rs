//! Where a backend's loader finds weights: a checkpoint (GGUF or safetensors) hands out each tensor checked
//! (present, the expected shape, a storage type specula computes with, its bytes inside the file) as raw bytes;
//! each backend turns those into its own storage. Tensor names are the checkpoint's own.

use std::path::Path;

use crate::error::Result;
use crate::model::dtype::GgmlType;

/// A tensor's stored bytes with their type and shape: `rows x cols` (rows == 1 for a vector), GGML block order.
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
    /// The file it is read from, for error messages.
    pub file: &'a Path,
}

/// A checkpoint's tensors.
pub trait WeightSource {
    /// Tensor `name` as a `rows x cols` matrix (a vector when `rows == 1`), or an error naming what is wrong.
    fn tensor(&self, name: &str, rows: usize, cols: usize) -> Result<RawTensor<'_>>;
    fn has(&self, name: &str) -> bool;
}

/// Tensor names of one checkpoint format.
pub struct TensorNames {
    pub embed: &'static str,
    pub final_norm: &'static str,
    pub lm_head: &'static str,
    pub rope_freqs: Option<&'static str>,
    pub layer: fn(usize, LayerTensor) -> String,
}

#[derive(Debug, Clone, Copy)]
pub enum LayerTensor {
    AttnNorm,
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    O,
    FfnNorm,
    Gate,
    Up,
    Down,
}

pub const GGUF_NAMES: TensorNames = TensorNames {
    embed: "token_embd.weight",
    final_norm: "output_norm.weight",
    lm_head: "output.weight",
    rope_freqs: Some("rope_freqs.weight"),
    layer: |i, t| {
        let suffix = match t {
            LayerTensor::AttnNorm => "attn_norm.weight",
            LayerTensor::Q => "attn_q.weight",
            LayerTensor::K => "attn_k.weight",
            LayerTensor::V => "attn_v.weight",
            LayerTensor::QBias => "attn_q.bias",
            LayerTensor::KBias => "attn_k.bias",
            LayerTensor::VBias => "attn_v.bias",
            LayerTensor::O => "attn_output.weight",
            LayerTensor::FfnNorm => "ffn_norm.weight",
            LayerTensor::Gate => "ffn_gate.weight",
            LayerTensor::Up => "ffn_up.weight",
            LayerTensor::Down => "ffn_down.weight",
        };
        format!("blk.{i}.{suffix}")
    },
};

pub const HF_NAMES: TensorNames = TensorNames {
    embed: "model.embed_tokens.weight",
    final_norm: "model.norm.weight",
    lm_head: "lm_head.weight",
    rope_freqs: None,
    layer: |i, t| {
        let suffix = match t {
            LayerTensor::AttnNorm => "input_layernorm.weight",
            LayerTensor::Q => "self_attn.q_proj.weight",
            LayerTensor::K => "self_attn.k_proj.weight",
            LayerTensor::V => "self_attn.v_proj.weight",
            LayerTensor::QBias => "self_attn.q_proj.bias",
            LayerTensor::KBias => "self_attn.k_proj.bias",
            LayerTensor::VBias => "self_attn.v_proj.bias",
            LayerTensor::O => "self_attn.o_proj.weight",
            LayerTensor::FfnNorm => "post_attention_layernorm.weight",
            LayerTensor::Gate => "mlp.gate_proj.weight",
            LayerTensor::Up => "mlp.up_proj.weight",
            LayerTensor::Down => "mlp.down_proj.weight",
        };
        format!("model.layers.{i}.{suffix}")
    },
};

/// Every tensor a loader reads, dequantized to f32 up front: an f32 reference of a quantized checkpoint (the
/// same values the quantized kernels stand for, computed without rounding activations). `specula selftest
/// --device cuda` compares the GPU's logits against a CPU model loaded from it.
pub struct Dequantized {
    tensors: std::collections::HashMap<String, (usize, usize, Vec<u8>)>,
    file: std::path::PathBuf,
}

impl Dequantized {
    /// Reads from `src` every tensor a model of `config` named by `names` has.
    pub fn new(
        src: &dyn WeightSource,
        names: &TensorNames,
        config: &crate::model::config::Config,
    ) -> Result<Self> {
        let c = config;
        let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let mut wanted: Vec<(String, usize, usize)> = vec![
            (names.embed.into(), c.vocab_size, h),
            (names.lm_head.into(), c.vocab_size, h),
            (names.final_norm.into(), 1, h),
        ];
        if let Some(r) = names.rope_freqs {
            wanted.push((r.into(), 1, c.head_dim / 2));
        }
        for i in 0..c.num_layers {
            use LayerTensor::*;
            for (t, rows, cols) in [
                (AttnNorm, 1, h),
                (Q, q, h),
                (K, kv, h),
                (V, kv, h),
                (QBias, 1, q),
                (KBias, 1, kv),
                (VBias, 1, kv),
                (O, h, q),
                (FfnNorm, 1, h),
                (Gate, ff, h),
                (Up, ff, h),
                (Down, h, ff),
            ] {
                wanted.push(((names.layer)(i, t), rows, cols));
            }
        }
        let mut tensors = std::collections::HashMap::new();
        let mut file = std::path::PathBuf::new();
        for (name, rows, cols) in wanted {
            if !src.has(&name) {
                continue;
            }
            let t = src.tensor(&name, rows, cols)?;
            file = t.file.to_path_buf();
            let values =
                crate::backend::cpu::weights::Weight::from_raw(t.dtype, t.bytes, rows, cols)
                    .map_err(|reason| crate::error::Error::BadTensor {
                        path: t.file.to_path_buf(),
                        tensor: name.clone(),
                        reason,
                    })?
                    .to_f32();
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.insert(name, (rows, cols, bytes));
        }
        Ok(Dequantized { tensors, file })
    }
}

impl WeightSource for Dequantized {
    fn tensor(&self, name: &str, rows: usize, cols: usize) -> Result<RawTensor<'_>> {
        let (r, c, bytes) =
            self.tensors
                .get(name)
                .ok_or_else(|| crate::error::Error::MissingTensor {
                    name: name.to_string(),
                    hint: " (not read into the f32 reference)".into(),
                })?;
        if (*r, *c) != (rows, cols) {
            return Err(crate::error::Error::InvalidArgument(format!(
                "{name}: the f32 reference holds it as {r} x {c}, asked for {rows} x {cols}"
            )));
        }
        Ok(RawTensor {
            dtype: GgmlType::F32,
            rows,
            cols,
            bytes,
            file: &self.file,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use crate::model::dtype::GgmlType;
    use crate::model::{ForwardOptions, LogitsFor};
    use crate::profile::Profiler;
    use crate::testing::{write_tiny_gguf, TinySpec};

    /// The f32 reference holds every matrix in f32 with the quantized matrix's own values, and its logits are
    /// close to the quantized kernels' (which round activations to 8 bits) but not equal to them.
    #[test]
    fn the_f32_reference_dequantizes_every_weight() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q8.gguf");
        write_tiny_gguf(
            &path,
            &TinySpec {
                weight_type: GgmlType::Q8_0,
                ..Default::default()
            },
        )
        .unwrap();
        let quantized = crate::model::load_gguf(&path, "q8").unwrap();
        let reference = crate::model::load_gguf_reference(&path, "q8").unwrap();
        assert!(quantized.model.weight_types().contains("Q8_0"));
        assert!(
            reference
                .model
                .weight_types()
                .split(", ")
                .all(|t| t.starts_with("F32")),
            "{}",
            reference.model.weight_types()
        );
        let tokens = [1u32, 5, 9, 14, 3, 7];
        let logits = |m: &crate::model::LoadedModel| {
            let mut cache = m.model.new_cache(16).unwrap();
            m.model
                .forward_one(
                    &tokens,
                    cache.as_mut(),
                    &ForwardOptions::default(),
                    LogitsFor::All,
                    &Profiler::disabled(),
                )
                .unwrap()
                .to_host()
                .unwrap()
                .logits
                .data
        };
        let (q, r) = (logits(&quantized), logits(&reference));
        let scale = r.iter().fold(0f32, |a, v| a.max(v.abs()));
        let worst = q
            .iter()
            .zip(&r)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst > 0.0, "8-bit activations must round somewhere");
        assert!(worst < 0.05 * scale, "worst {worst} of {scale}");
        // The embedding rows are the quantized table's values exactly.
        let (a, b) = (
            quantized.model.embed_tokens(&tokens).unwrap(),
            reference.model.embed_tokens(&tokens).unwrap(),
        );
        assert_eq!(a, b);
    }
}
