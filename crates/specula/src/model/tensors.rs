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
