//! One configuration for the Llama family (Llama 2/3, Qwen2/2.5, SmolLM2), read from GGUF metadata or an HF
//! config.json.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::model::gguf::GgufFile;

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum RopeStyle {
    /// Pairs (i, i + d/2): HF checkpoints and GGUF qwen2.
    Halves,
    /// Pairs (2i, 2i + 1): GGUF llama, whose converter permuted the Q/K rows for it.
    Interleaved,
}

/// Llama 3.1-style frequency scaling for long context.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Config {
    /// "llama" or "qwen2" (the family member; drives defaults such as QKV bias).
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub context_length: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub rope_style: RopeStyle,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
}

/// Where a configuration was read from, so that an error names the field as that file spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigSource<'a> {
    /// GGUF metadata of an architecture (`{arch}.block_count`, ...).
    Gguf { arch: &'a str },
    /// A Hugging Face `config.json` (`num_hidden_layers`, ...).
    HfJson,
    /// Built in code (tests, tools): the struct's own field names.
    Code,
}

/// The configuration fields that size things, with the largest value specula accepts for each. The limits sit
/// far above every released Llama-family model (the largest have 126 layers, hidden size 16384, a 256k
/// vocabulary, head dimension 256) and far below what would overflow a product of two of them, so a corrupt or
/// hostile file is refused with the field named before anything is sized by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Layers,
    Hidden,
    Intermediate,
    Vocab,
    Heads,
    KvHeads,
    HeadDim,
    Context,
}

impl Field {
    fn limit(self) -> usize {
        match self {
            Field::Layers => 1024,
            Field::Hidden => 1 << 16,
            Field::Intermediate => 1 << 18,
            Field::Vocab => 1 << 22,
            Field::Heads | Field::KvHeads => 1024,
            Field::HeadDim => 1024,
            Field::Context => 1 << 24,
        }
    }

    fn name(self, source: ConfigSource<'_>) -> String {
        let (gguf, hf, code) = match self {
            Field::Layers => ("block_count", "num_hidden_layers", "num_layers"),
            Field::Hidden => ("embedding_length", "hidden_size", "hidden_size"),
            Field::Intermediate => (
                "feed_forward_length",
                "intermediate_size",
                "intermediate_size",
            ),
            Field::Vocab => ("vocab_size", "vocab_size", "vocab_size"),
            Field::Heads => ("attention.head_count", "num_attention_heads", "num_heads"),
            Field::KvHeads => (
                "attention.head_count_kv",
                "num_key_value_heads",
                "num_kv_heads",
            ),
            Field::HeadDim => ("attention.key_length", "head_dim", "head_dim"),
            Field::Context => (
                "context_length",
                "max_position_embeddings",
                "context_length",
            ),
        };
        match source {
            ConfigSource::Gguf { arch } => format!("GGUF metadata {arch}.{gguf}"),
            ConfigSource::HfJson => format!("config.json {hf}"),
            ConfigSource::Code => code.to_string(),
        }
    }
}

impl Config {
    /// Checks every field against the limits above and the relations between fields.
    pub fn validate(&self) -> Result<()> {
        self.validate_from(ConfigSource::Code)
    }

    /// [`Config::validate`], naming fields as `source` spells them.
    pub fn validate_from(&self, source: ConfigSource<'_>) -> Result<()> {
        let fail = |m: String| Err(Error::Config(m));
        for (field, value) in [
            (Field::Layers, self.num_layers),
            (Field::Hidden, self.hidden_size),
            (Field::Intermediate, self.intermediate_size),
            (Field::Vocab, self.vocab_size),
            (Field::Heads, self.num_heads),
            (Field::KvHeads, self.num_kv_heads),
            (Field::HeadDim, self.head_dim),
            (Field::Context, self.context_length),
        ] {
            if value == 0 || value > field.limit() {
                return fail(format!(
                    "{} is {value}; it must be between 1 and {}",
                    field.name(source),
                    field.limit()
                ));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return fail(format!(
                "{} attention heads ({}) cannot share {} KV heads ({}) evenly",
                self.num_heads,
                Field::Heads.name(source),
                self.num_kv_heads,
                Field::KvHeads.name(source)
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "{} is {}; rotary embeddings need an even head dimension",
                Field::HeadDim.name(source),
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return fail(format!(
                "rope theta is {}; it must be a positive finite number",
                self.rope_theta
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0 && self.rms_norm_eps < 1.0) {
            return fail(format!(
                "RMSNorm epsilon is {}; it must be in (0, 1)",
                self.rms_norm_eps
            ));
        }
        if let Some(s) = &self.rope_scaling {
            let positive = |v: f64| v.is_finite() && v > 0.0;
            if !(positive(s.factor)
                && positive(s.low_freq_factor)
                && positive(s.high_freq_factor)
                && s.high_freq_factor != s.low_freq_factor
                && s.original_max_position_embeddings > 0)
            {
                return fail(format!(
                    "llama3 rope scaling needs positive finite factors with high_freq_factor != low_freq_factor \
                     and original_max_position_embeddings > 0; got {s:?}"
                ));
            }
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch = gguf
            .get_str("general.architecture")
            .ok_or_else(|| Error::Config("GGUF has no general.architecture".into()))?
            .to_string();
        if arch != "llama" && arch != "qwen2" {
            return Err(Error::UnsupportedArchitecture(arch));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let req = |k: &str| -> Result<usize> {
            gguf.get_u64(&key(k))
                .map(|v| v as usize)
                .ok_or_else(|| Error::Config(format!("GGUF metadata lacks {}", key(k))))
        };
        let hidden_size = req("embedding_length")?;
        let num_heads = req("attention.head_count")?;
        let num_kv_heads = gguf
            .get_u64(&key("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(num_heads);
        let head_dim = gguf
            .get_u64(&key("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden_size.checked_div(num_heads).unwrap_or(0));
        let vocab_size = match gguf.get_u64(&key("vocab_size")) {
            Some(v) => v as usize,
            None => match gguf.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
                Some([]) => {
                    return Err(Error::Config(
                        "GGUF has no vocab size and tokenizer.ggml.tokens is empty".into(),
                    ))
                }
                Some(tokens) => tokens.len(),
                None => {
                    return Err(Error::Config(
                        "GGUF has neither a vocab size nor a token list".into(),
                    ))
                }
            },
        };
        let tie_word_embeddings = gguf.tensor_info("output.weight").is_none();
        let attention_bias = gguf.tensor_info("blk.0.attn_q.bias").is_some();
        let rope_scaling = match gguf.get_str(&key("rope.scaling.type")) {
            Some("none") | None => None,
            Some(other) if gguf.tensor_info("rope_freqs.weight").is_none() => {
                return Err(Error::Config(format!(
                    "rope scaling type {other:?} is not supported (supported: none, llama3 via rope_freqs)"
                )))
            }
            Some(_) => None,
        };
        let config = Config {
            rope_style: if arch == "llama" {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Halves
            },
            architecture: arch.clone(),
            vocab_size,
            hidden_size,
            intermediate_size: req("feed_forward_length")?,
            num_layers: req("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            context_length: req("context_length")?,
            rope_theta: gguf.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rms_norm_eps: gguf
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
            rope_scaling,
            attention_bias,
            tie_word_embeddings,
        };
        config.validate_from(ConfigSource::Gguf { arch: &arch })?;
        Ok(config)
    }

    pub fn from_hf_json(text: &str) -> Result<Self> {
        // The path of the offending field goes into the error (serde alone says only "expected usize").
        let hf: HfConfig =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
                .map_err(|e| match e.path().to_string().as_str() {
                    "." => Error::Config(format!("config.json: {}", e.inner())),
                    path => Error::Config(format!("config.json {path}: {}", e.inner())),
                })?;
        let arch = match hf.model_type.as_deref() {
            Some("llama") | Some("mistral") => "llama",
            Some("qwen2") => "qwen2",
            Some(other) => return Err(Error::UnsupportedArchitecture(other.to_string())),
            None => match hf.architectures.first().map(String::as_str) {
                Some("LlamaForCausalLM") => "llama",
                Some("Qwen2ForCausalLM") => "qwen2",
                Some(other) => return Err(Error::UnsupportedArchitecture(other.to_string())),
                None => return Err(Error::Config("config.json has no model_type".into())),
            },
        };
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
        let rope_scaling = match &hf.rope_scaling {
            None => None,
            Some(rs) => match rs.rope_type.as_deref().or(rs.kind.as_deref()) {
                Some("llama3") => Some(Llama3RopeScaling {
                    factor: rs.factor.unwrap_or(1.0),
                    low_freq_factor: rs.low_freq_factor.unwrap_or(1.0),
                    high_freq_factor: rs.high_freq_factor.unwrap_or(4.0),
                    original_max_position_embeddings: rs
                        .original_max_position_embeddings
                        .unwrap_or(8192),
                }),
                Some("default") | None => None,
                Some(other) => {
                    return Err(Error::Config(format!(
                        "rope_scaling type {other:?} is not supported (supported: llama3)"
                    )))
                }
            },
        };
        let config = Config {
            architecture: arch.to_string(),
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads,
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            context_length: hf.max_position_embeddings.unwrap_or(4096),
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_style: RopeStyle::Halves,
            rope_scaling,
            attention_bias: hf.attention_bias.unwrap_or(arch == "qwen2"),
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        };
        config.validate_from(ConfigSource::HfJson)?;
        Ok(config)
    }

    /// The shapes `--random-weights` offers (real models' configs, for speed work without their weights).
    pub const RANDOM_SHAPES: &'static [&'static str] = &[
        "llama-3.1-8b",
        "llama-3.2-1b",
        "qwen2.5-1.5b",
        "qwen2.5-0.5b",
        "tiny",
    ];

    /// The configuration of a known model shape (see [`Config::RANDOM_SHAPES`]).
    pub fn shape(name: &str) -> Result<Self> {
        let base = Config {
            architecture: "qwen2".into(),
            vocab_size: 151_936,
            hidden_size: 1536,
            intermediate_size: 8960,
            num_layers: 28,
            num_heads: 12,
            num_kv_heads: 2,
            head_dim: 128,
            context_length: 32_768,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            rope_style: RopeStyle::Halves,
            rope_scaling: None,
            attention_bias: true,
            tie_word_embeddings: true,
        };
        let config = match name {
            "qwen2.5-1.5b" => base,
            "qwen2.5-0.5b" => Config {
                hidden_size: 896,
                intermediate_size: 4864,
                num_layers: 24,
                num_heads: 14,
                num_kv_heads: 2,
                head_dim: 64,
                ..base
            },
            "llama-3.1-8b" => Config {
                architecture: "llama".into(),
                vocab_size: 128_256,
                hidden_size: 4096,
                intermediate_size: 14_336,
                num_layers: 32,
                num_heads: 32,
                num_kv_heads: 8,
                head_dim: 128,
                context_length: 131_072,
                rope_theta: 500_000.0,
                rms_norm_eps: 1e-5,
                rope_scaling: Some(Llama3RopeScaling {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }),
                attention_bias: false,
                tie_word_embeddings: false,
                ..base
            },
            // Llama 3.2 1B: the natural draft model for llama-3.1-8b (same vocabulary).
            "llama-3.2-1b" => Config {
                architecture: "llama".into(),
                vocab_size: 128_256,
                hidden_size: 2048,
                intermediate_size: 8192,
                num_layers: 16,
                num_heads: 32,
                num_kv_heads: 8,
                head_dim: 64,
                context_length: 131_072,
                rope_theta: 500_000.0,
                rms_norm_eps: 1e-5,
                rope_scaling: Some(Llama3RopeScaling {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }),
                attention_bias: false,
                tie_word_embeddings: true,
                ..base
            },
            "tiny" => Config {
                vocab_size: 260,
                hidden_size: 64,
                intermediate_size: 128,
                num_layers: 2,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
                context_length: 256,
                ..base
            },
            other => {
                return Err(Error::InvalidArgument(format!(
                    "--random-weights {other:?} is not a known shape; use one of {}",
                    Self::RANDOM_SHAPES.join(", ")
                )))
            }
        };
        config.validate()?;
        Ok(config)
    }

    /// Inverse frequencies of the rotary embedding, one per dimension pair, with Llama 3 scaling applied.
    pub fn rope_inv_freqs(&self, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let half = self.head_dim / 2;
        (0..half)
            .map(|i| {
                let mut freq = 1.0 / self.rope_theta.powf(2.0 * i as f64 / self.head_dim as f64);
                if let Some(f) = freq_factors {
                    freq /= f[i] as f64;
                } else if let Some(s) = &self.rope_scaling {
                    let low_wavelen = s.original_max_position_embeddings as f64 / s.low_freq_factor;
                    let high_wavelen =
                        s.original_max_position_embeddings as f64 / s.high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen > low_wavelen {
                        freq /= s.factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (s.original_max_position_embeddings as f64 / wavelen
                            - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        freq = (1.0 - smooth) * freq / s.factor + smooth * freq;
                    }
                }
                freq as f32
            })
            .collect()
    }
}

#[derive(Debug, Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    max_position_embeddings: Option<usize>,
    rope_theta: Option<f64>,
    rms_norm_eps: Option<f64>,
    rope_scaling: Option<HfRopeScaling>,
    attention_bias: Option<bool>,
    tie_word_embeddings: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(scaling: Option<Llama3RopeScaling>) -> Config {
        Config {
            architecture: "llama".into(),
            vocab_size: 100,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 1,
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: 128,
            context_length: 128,
            rope_theta: 500_000.0,
            rms_norm_eps: 1e-5,
            rope_style: RopeStyle::Interleaved,
            rope_scaling: scaling,
            attention_bias: false,
            tie_word_embeddings: true,
        }
    }

    /// Inverse frequencies are theta^(-2i/d); Llama 3.1's scaling divides the low frequencies (wavelength above
    /// original_max / low_freq_factor) by the factor, keeps the high ones, and blends in between. Values for
    /// Llama 3.1's settings from Hugging Face's `_compute_llama3_parameters`, evaluated in Python at
    /// i = 0, 20 (kept), 31 (blended), 40, 63 (divided).
    #[test]
    fn random_weight_shapes_are_valid_configs() {
        for name in Config::RANDOM_SHAPES {
            let c = Config::shape(name).unwrap();
            assert!(c.validate().is_ok(), "{name}");
        }
        let c = Config::shape("llama-3.1-8b").unwrap();
        // 8.03B parameters: the published size.
        let params = c.vocab_size * c.hidden_size * 2
            + c.num_layers
                * (c.hidden_size * (c.q_dim() + 2 * c.kv_dim())
                    + c.q_dim() * c.hidden_size
                    + 3 * c.hidden_size * c.intermediate_size);
        assert!((params as f64 / 1e9 - 8.03).abs() < 0.01, "{params}");
        assert!(Config::shape("gpt-5")
            .unwrap_err()
            .to_string()
            .contains("llama-3.1-8b"));
    }

    #[test]
    fn rope_inverse_frequencies_match_the_published_formulas() {
        let plain = llama(None).rope_inv_freqs(None);
        for (i, f) in plain.iter().enumerate() {
            let expected = 500_000f64.powf(-2.0 * i as f64 / 128.0);
            assert!(((*f as f64) - expected).abs() <= 1e-6 * expected, "i={i}");
        }
        let scaled = llama(Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }))
        .rope_inv_freqs(None);
        for (i, expected) in [
            (0, 1.0),
            (20, 0.016_560_440_080_994_446),
            (31, 8.567_514_129_196_321e-4),
            (40, 3.428_102_195_952_591e-5),
            (63, 3.068_925_988_914_511e-7),
        ] {
            let got = scaled[i] as f64;
            assert!(
                (got - expected).abs() <= 1e-5 * expected,
                "i={i}: {got} vs {expected}"
            );
        }
        // rope_freqs factors (GGUF) divide each frequency.
        let factors: Vec<f32> = (0..64).map(|i| 1.0 + i as f32).collect();
        let with_factors = llama(None).rope_inv_freqs(Some(&factors));
        assert!((with_factors[3] - plain[3] / 4.0).abs() <= 1e-6 * plain[3]);
    }
}
