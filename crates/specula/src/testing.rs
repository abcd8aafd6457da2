//! Tiny random models for tests: written as GGUF (any storage type) or as a Hugging Face directory, with a
//! byte-level tokenizer, so unit and integration tests exercise the real loaders offline in milliseconds.

use std::path::Path;

use crate::backend::cpu::weights::{GgmlType, Weight};
use crate::model::gguf::{write_gguf, Value};

/// Shape of a tiny model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub architecture: &'static str,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub context: usize,
    pub seed: u64,
    /// Storage type of the matrices (norms stay f32).
    pub weight_type: GgmlType,
    pub attention_bias: bool,
    /// Multiplies the final norm's weights, and so the logits: below 1 flattens the next-token distributions
    /// (random weights otherwise give near-certain top tokens).
    pub logit_scale: f32,
    /// Write a separate LM head (GGUF `output.weight`) instead of tying it to the embedding: a tied tiny random
    /// model mostly repeats its input token, an untied one writes varied text (tests whose checks need the
    /// context to matter use it).
    pub untied_head: bool,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            architecture: "qwen2",
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            context: 256,
            seed: 1,
            weight_type: GgmlType::F32,
            attention_bias: true,
            logit_scale: 1.0,
            untied_head: false,
        }
    }
}

/// GPT-2's byte-to-unicode table: the printable stand-in character of each byte in byte-level BPE vocabularies.
pub fn byte_level_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in printable.iter().zip(chars) {
        table[*b as usize] = char::from_u32(c).unwrap_or('?');
    }
    table
}

/// The tiny vocabulary: 256 byte tokens, two merged tokens, then the ChatML special tokens.
pub fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let chars = byte_level_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let space = chars[b' ' as usize];
    tokens.push(format!("{space}t"));
    tokens.push("he".to_string());
    let merges = vec![format!("{space} t"), "h e".to_string()];
    tokens.push("<|im_start|>".into());
    tokens.push("<|im_end|>".into());
    let mut types = vec![1i32; tokens.len()];
    let n = types.len();
    types[n - 2] = 3;
    types[n - 1] = 3;
    (tokens, merges, types)
}

/// `n` deterministic pseudo-random values in [-1, 1) (xorshift), for kernel and layout tests and benchmarks.
pub fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A deterministic stream of pseudo-random u64 (xorshift64) from a nonzero `seed`, for tests that need raw bits.
pub fn xorshift64(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

/// All tensors of a tiny model as (GGUF name, HF name, rows, cols, f32 data); rows == 1 for vectors.
pub fn tiny_tensors(
    spec: &TinySpec,
    vocab: usize,
) -> Vec<(String, String, usize, usize, Vec<f32>)> {
    let mut rng = Rng(spec.seed);
    let head_dim = spec.hidden / spec.heads;
    let (h, q, kv, ff) = (
        spec.hidden,
        spec.hidden,
        spec.kv_heads * head_dim,
        spec.intermediate,
    );
    let mut out = Vec::new();
    let mut push =
        |g: String, hf: String, r: usize, c: usize, data: Vec<f32>| out.push((g, hf, r, c, data));
    push(
        "token_embd.weight".into(),
        "model.embed_tokens.weight".into(),
        vocab,
        h,
        rng.vec(vocab * h, 1.0),
    );
    let norm = |rng: &mut Rng, n: usize| {
        rng.vec(n, 0.2)
            .into_iter()
            .map(|v| 1.0 + v)
            .collect::<Vec<_>>()
    };
    for i in 0..spec.layers {
        let g = |s: &str| format!("blk.{i}.{s}");
        let hf = |s: &str| format!("model.layers.{i}.{s}");
        let ws = 1.0 / (h as f32).sqrt();
        push(
            g("attn_norm.weight"),
            hf("input_layernorm.weight"),
            1,
            h,
            norm(&mut rng, h),
        );
        push(
            g("attn_q.weight"),
            hf("self_attn.q_proj.weight"),
            q,
            h,
            rng.vec(q * h, ws),
        );
        push(
            g("attn_k.weight"),
            hf("self_attn.k_proj.weight"),
            kv,
            h,
            rng.vec(kv * h, ws),
        );
        push(
            g("attn_v.weight"),
            hf("self_attn.v_proj.weight"),
            kv,
            h,
            rng.vec(kv * h, ws),
        );
        if spec.attention_bias {
            push(
                g("attn_q.bias"),
                hf("self_attn.q_proj.bias"),
                1,
                q,
                rng.vec(q, 0.1),
            );
            push(
                g("attn_k.bias"),
                hf("self_attn.k_proj.bias"),
                1,
                kv,
                rng.vec(kv, 0.1),
            );
            push(
                g("attn_v.bias"),
                hf("self_attn.v_proj.bias"),
                1,
                kv,
                rng.vec(kv, 0.1),
            );
        }
        push(
            g("attn_output.weight"),
            hf("self_attn.o_proj.weight"),
            h,
            q,
            rng.vec(h * q, ws),
        );
        push(
            g("ffn_norm.weight"),
            hf("post_attention_layernorm.weight"),
            1,
            h,
            norm(&mut rng, h),
        );
        push(
            g("ffn_gate.weight"),
            hf("mlp.gate_proj.weight"),
            ff,
            h,
            rng.vec(ff * h, ws),
        );
        push(
            g("ffn_up.weight"),
            hf("mlp.up_proj.weight"),
            ff,
            h,
            rng.vec(ff * h, ws),
        );
        push(
            g("ffn_down.weight"),
            hf("mlp.down_proj.weight"),
            h,
            ff,
            rng.vec(h * ff, 1.0 / (ff as f32).sqrt()),
        );
    }
    push(
        "output_norm.weight".into(),
        "model.norm.weight".into(),
        1,
        h,
        norm(&mut rng, h)
            .into_iter()
            .map(|v| v * spec.logit_scale)
            .collect(),
    );
    if spec.untied_head {
        push(
            "output.weight".into(),
            "lm_head.weight".into(),
            vocab,
            h,
            rng.vec(vocab * h, 1.0),
        );
    }
    out
}

/// Writes a tiny model as GGUF (tied embeddings, ChatML template, byte-level tokenizer).
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) -> std::io::Result<()> {
    let (tokens, merges, types) = tiny_vocab();
    let arch = spec.architecture;
    let k = |s: &str| format!("{arch}.{s}");
    let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (k("block_count"), Value::U32(spec.layers as u32)),
        (k("context_length"), Value::U32(spec.context as u32)),
        (k("embedding_length"), Value::U32(spec.hidden as u32)),
        (
            k("feed_forward_length"),
            Value::U32(spec.intermediate as u32),
        ),
        (k("attention.head_count"), Value::U32(spec.heads as u32)),
        (
            k("attention.head_count_kv"),
            Value::U32(spec.kv_heads as u32),
        ),
        (k("rope.freq_base"), Value::F32(10000.0)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strings(&tokens)),
        ("tokenizer.ggml.merges".into(), strings(&merges)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32(tokens.len() as u32 - 1),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(crate::chat::CHATML_TEMPLATE.into()),
        ),
    ];
    let mut tensors = Vec::new();
    for (name, _, rows, cols, data) in tiny_tensors(spec, tokens.len()) {
        let is_matrix = rows > 1 && name != "token_embd.weight";
        let ty = if is_matrix {
            spec.weight_type
        } else {
            GgmlType::F32
        };
        let weight = Weight::quantize(&data, rows, cols, ty)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let bytes = weight_bytes(&weight, &data, ty);
        let dims = if rows == 1 {
            vec![cols]
        } else {
            vec![cols, rows]
        };
        tensors.push((name, dims, ty.id(), bytes));
    }
    let md: Vec<(&str, Value)> = metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let ts: Vec<(&str, Vec<usize>, u32, Vec<u8>)> = tensors
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.clone(), *t, b.clone()))
        .collect();
    write_gguf(path, &md, &ts)
}

fn weight_bytes(weight: &Weight, data: &[f32], ty: GgmlType) -> Vec<u8> {
    match ty {
        GgmlType::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => weight.raw_bytes(),
    }
}

/// The tiny vocabulary as a Hugging Face `tokenizer.json` (byte-level BPE, ChatML special tokens).
pub fn tiny_tokenizer_json() -> serde_json::Value {
    let (tokens, merges, _) = tiny_vocab();
    let vocab: serde_json::Map<String, serde_json::Value> = tokens[..tokens.len() - 2]
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    let n = tokens.len();
    serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": n - 2, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": n - 1, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": merges}
    })
}

/// Writes a tiny model as a Hugging Face directory: config.json, model.safetensors (f32), tokenizer.json.
pub fn write_tiny_hf_dir(dir: &Path, spec: &TinySpec) -> crate::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| crate::Error::io(dir, e))?;
    let (tokens, _, _) = tiny_vocab();
    let config = serde_json::json!({
        "model_type": spec.architecture,
        "vocab_size": tokens.len(),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": spec.context,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": !spec.untied_head,
        "attention_bias": spec.attention_bias,
    });
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| crate::Error::io(&p, e))
    };
    write("config.json", config.to_string())?;
    let tokenizer = tiny_tokenizer_json();
    write("tokenizer.json", tokenizer.to_string())?;
    write(
        "tokenizer_config.json",
        serde_json::json!({"eos_token": "<|im_end|>", "chat_template": crate::chat::CHATML_TEMPLATE}).to_string(),
    )?;
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = tiny_tensors(spec, tokens.len())
        .into_iter()
        .map(|(_, hf, rows, cols, data)| {
            (
                hf,
                if rows == 1 {
                    vec![cols]
                } else {
                    vec![rows, cols]
                },
                data,
            )
        })
        .collect();
    crate::model::safetensors::write_f32_safetensors(&dir.join("model.safetensors"), &tensors)
}

/// Metadata and tensors of a GGUF file as `write_gguf` takes them (tensor: name, dims, type id, bytes).
pub type GgufParts = (
    Vec<(String, Value)>,
    Vec<(String, Vec<usize>, u32, Vec<u8>)>,
);

/// Reads a GGUF file into parts that a test can edit and write back with [`write_gguf_parts`].
pub fn read_gguf_parts(path: &Path) -> crate::Result<GgufParts> {
    let g = crate::model::gguf::GgufFile::open(path)?;
    let mut metadata: Vec<(String, Value)> = g
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    let tensors = g
        .tensors
        .iter()
        .map(|t| {
            Ok((
                t.name.clone(),
                t.dims.clone(),
                t.type_id,
                g.raw_tensor_bytes(&t.name)?.to_vec(),
            ))
        })
        .collect::<crate::Result<_>>()?;
    Ok((metadata, tensors))
}

pub fn write_gguf_parts(path: &Path, parts: &GgufParts) -> std::io::Result<()> {
    let md: Vec<(&str, Value)> = parts
        .0
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let ts: Vec<(&str, Vec<usize>, u32, Vec<u8>)> = parts
        .1
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.clone(), *t, b.clone()))
        .collect();
    write_gguf(path, &md, &ts)
}

/// Sets (or adds) one metadata entry of a GGUF's parts.
pub fn set_metadata(parts: &mut GgufParts, key: &str, value: Value) {
    match parts.0.iter_mut().find(|(k, _)| k == key) {
        Some(entry) => entry.1 = value,
        None => parts.0.push((key.to_string(), value)),
    }
}

/// A cache for the whole context (tests).
pub fn full_cache(model: &dyn crate::model::Model) -> Box<dyn crate::model::SequenceCache> {
    model
        .new_cache(model.config().context_length)
        .expect("a cache")
}

/// One forward pass of `tokens` with default options, copied to host memory (tests and tools; panics on error).
pub fn forward_host(
    model: &dyn crate::model::Model,
    tokens: &[u32],
    cache: &mut dyn crate::model::SequenceCache,
    logits: crate::model::LogitsFor,
) -> crate::model::forward::HostOutput {
    model
        .forward_one(
            tokens,
            cache,
            &crate::model::ForwardOptions::default(),
            logits,
            &crate::profile::Profiler::disabled(),
        )
        .and_then(|o| o.to_host())
        .expect("a forward pass")
}

/// A tiny EAGLE-3 head for tests, written in the published layout (SpecForge's export: config.json with
/// `LlamaForCausalLMEagle3` and `eagle_config`, safetensors with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`).
pub struct TinyHeadSpec {
    pub seed: u64,
    /// Draft vocabulary: every `stride`-th target token from `first` (d2t then holds non-trivial offsets).
    pub draft_vocab: usize,
    pub first: usize,
    pub stride: usize,
    /// `eagle_config.eagle_aux_hidden_state_layer_ids` (None: left out of config.json).
    pub aux_layers: Option<Vec<usize>>,
    /// Width of the target hidden states fc reads (None: the target's; Some(w) writes `target_hidden_size`).
    pub target_hidden: Option<usize>,
    /// Width of the head's MLP (None: twice the hidden size).
    pub intermediate: Option<usize>,
    /// Overrides of config.json fields (to write wrong heads).
    pub config_overrides: serde_json::Value,
}

impl Default for TinyHeadSpec {
    fn default() -> Self {
        TinyHeadSpec {
            seed: 7,
            draft_vocab: 100,
            first: 3,
            stride: 2,
            aux_layers: Some(vec![0, 1, 2]),
            target_hidden: None,
            intermediate: None,
            config_overrides: serde_json::json!({}),
        }
    }
}

/// Writes a random EAGLE-3 head for `target` (its width, heads and vocabulary) into `dir`; returns the draft
/// vocabulary's target ids.
pub fn write_tiny_eagle3_head(
    dir: &Path,
    target: &crate::model::Config,
    spec: &TinyHeadSpec,
) -> crate::Result<Vec<u32>> {
    use crate::model::safetensors::{write_safetensors, Dtype};
    std::fs::create_dir_all(dir).map_err(|e| crate::Error::io(dir, e))?;
    let (h, heads, kv_heads, hd) = (
        target.hidden_size,
        target.num_heads,
        target.num_kv_heads,
        target.head_dim,
    );
    let ff = spec.intermediate.unwrap_or(2 * h);
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": ff,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "max_position_embeddings": target.context_length,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": spec.draft_vocab,
        "tie_word_embeddings": false,
    });
    let big_h = spec.target_hidden.unwrap_or(h);
    if spec.target_hidden.is_some() {
        config["target_hidden_size"] = big_h.into();
    }
    if let Some(ids) = &spec.aux_layers {
        config["eagle_config"] = serde_json::json!({"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": true});
    }
    if let Some(o) = spec.config_overrides.as_object() {
        for (k, v) in o {
            config[k] = v.clone();
        }
    }
    let p = dir.join("config.json");
    std::fs::write(&p, config.to_string()).map_err(|e| crate::Error::io(&p, e))?;
    let mut state = spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut random = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    };
    let f32_tensor = |name: &str, shape: Vec<usize>, data: Vec<f32>| {
        (
            name.to_string(),
            Dtype::F32,
            shape,
            data.iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    };
    let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
    let scaled = |cols: usize| 1.0 / (cols as f32).sqrt();
    let norm = |random: &mut dyn FnMut(usize, f32) -> Vec<f32>| {
        random(h, 0.2)
            .into_iter()
            .map(|v| 1.0 + v)
            .collect::<Vec<f32>>()
    };
    let used: Vec<u32> = (0..spec.draft_vocab)
        .map(|i| (spec.first + i * spec.stride) as u32)
        .collect();
    let d2t: Vec<u8> = used
        .iter()
        .enumerate()
        .flat_map(|(i, &t)| (i64::from(t) - i as i64).to_le_bytes())
        .collect();
    let tensors = vec![
        f32_tensor(
            "fc.weight",
            vec![h, 3 * big_h],
            random(3 * big_h * h, scaled(3 * big_h)),
        ),
        f32_tensor("midlayer.hidden_norm.weight", vec![h], norm(&mut random)),
        f32_tensor(
            "midlayer.input_layernorm.weight",
            vec![h],
            norm(&mut random),
        ),
        f32_tensor(
            "midlayer.post_attention_layernorm.weight",
            vec![h],
            norm(&mut random),
        ),
        f32_tensor(
            "midlayer.self_attn.q_proj.weight",
            vec![q_dim, 2 * h],
            random(q_dim * 2 * h, scaled(2 * h)),
        ),
        f32_tensor(
            "midlayer.self_attn.k_proj.weight",
            vec![kv_dim, 2 * h],
            random(kv_dim * 2 * h, scaled(2 * h)),
        ),
        f32_tensor(
            "midlayer.self_attn.v_proj.weight",
            vec![kv_dim, 2 * h],
            random(kv_dim * 2 * h, scaled(2 * h)),
        ),
        f32_tensor(
            "midlayer.self_attn.o_proj.weight",
            vec![h, q_dim],
            random(h * q_dim, scaled(q_dim)),
        ),
        f32_tensor(
            "midlayer.mlp.gate_proj.weight",
            vec![ff, h],
            random(ff * h, scaled(h)),
        ),
        f32_tensor(
            "midlayer.mlp.up_proj.weight",
            vec![ff, h],
            random(ff * h, scaled(h)),
        ),
        f32_tensor(
            "midlayer.mlp.down_proj.weight",
            vec![h, ff],
            random(h * ff, scaled(ff)),
        ),
        f32_tensor("norm.weight", vec![h], norm(&mut random)),
        f32_tensor(
            "lm_head.weight",
            vec![spec.draft_vocab, h],
            random(spec.draft_vocab * h, 3.0 * scaled(h)),
        ),
        ("d2t".to_string(), Dtype::I64, vec![spec.draft_vocab], d2t),
    ];
    write_safetensors(&dir.join("model.safetensors"), &tensors)?;
    Ok(used)
}

/// One step of `g` alone (greedy tests of the step machine; errors panic).
pub fn step_alone(model: &crate::model::LoadedModel, g: &mut crate::decode::Generation<'_>) {
    step_together(
        model,
        std::slice::from_mut(g),
        crate::decode::StepLimits::default(),
    );
}

/// One batched step of every generation in `gens` (tests; errors panic).
pub fn step_together(
    model: &crate::model::LoadedModel,
    gens: &mut [crate::decode::Generation<'_>],
    limits: crate::decode::StepLimits<'_>,
) -> crate::decode::StepReport {
    let mut refs: Vec<&mut crate::decode::Generation<'_>> = gens.iter_mut().collect();
    let (results, report) = crate::decode::step(
        model.model.as_ref(),
        &model.tokenizer,
        &mut refs,
        limits,
        &crate::profile::Profiler::disabled(),
        &mut |_, _| {},
    );
    results.into_iter().for_each(|r| r.unwrap());
    report
}

/// Runs `g` alone to its end and returns its output with what it leaves for a prefix cache.
pub fn run_alone_to_end(
    model: &crate::model::LoadedModel,
    mut g: crate::decode::Generation<'_>,
) -> (
    crate::decode::GenerateOutput,
    Option<crate::decode::CachedPrefix>,
) {
    for _ in 0..10_000 {
        if g.is_done() {
            break;
        }
        step_alone(model, &mut g);
    }
    g.finish_keeping_prefix(&model.tokenizer, &mut |_| {})
        .unwrap()
}

/// The greedy output under penalties and a bias by a plain reference loop (tests and `specula selftest`): one
/// forward pass a token, the rules applied to the last row by their definitions (bias, then the repetition
/// penalty over prompt and output, then presence and frequency over the output; a per-token reading, not the
/// library's `LogitAdjustments::apply`), the argmax taken.
pub fn adjusted_greedy_reference(
    model: &dyn crate::model::Model,
    prompt: &[u32],
    n: usize,
    rules: &crate::sampling::LogitAdjustments,
) -> crate::Result<Vec<u32>> {
    let mut cache = model.new_cache(prompt.len() + n + 1)?;
    let mut out: Vec<u32> = Vec::new();
    let mut feed = prompt.to_vec();
    for _ in 0..n {
        let h = model
            .forward_one(
                &feed,
                cache.as_mut(),
                &crate::model::ForwardOptions::default(),
                crate::model::LogitsFor::Last,
                &crate::profile::Profiler::disabled(),
            )?
            .to_host()?;
        let mut row = h.last().to_vec();
        for (t, l) in row.iter_mut().enumerate() {
            let t = t as u32;
            *l += rules
                .logit_bias
                .iter()
                .filter(|(b, _)| *b == t)
                .map(|(_, v)| v)
                .sum::<f32>();
            let count = out.iter().filter(|&&o| o == t).count();
            if prompt.contains(&t) || count > 0 {
                *l = if *l > 0.0 {
                    *l / rules.repetition_penalty
                } else {
                    *l * rules.repetition_penalty
                };
            }
            if count > 0 {
                *l -= rules.frequency_penalty * count as f32 + rules.presence_penalty;
            }
        }
        let next = crate::sampling::argmax(&row);
        out.push(next);
        feed = vec![next];
    }
    Ok(out)
}

/// A text `grammar` takes, written one byte at a time: each byte drawn (by `next`, any source of random numbers)
/// from those of `alphabet` the state takes, closing brackets and quotes likelier as the walk goes on so most
/// walks finish. Ok(Some(text)) once the value is complete, Ok(None) where `steps` bytes did not complete it, and
/// Err naming the prefix where no byte of `alphabet` continues it (a dead end the grammar must never have).
pub fn random_json_walk(
    grammar: &crate::json_mode::JsonGrammar,
    next: &mut impl FnMut() -> usize,
    steps: usize,
    alphabet: &[u8],
) -> Result<Option<Vec<u8>>, String> {
    use crate::json_mode::JsonState;
    let mut state = JsonState::default();
    let mut text = Vec::new();
    for step in 0..steps {
        if state.is_done() {
            break;
        }
        let options: Vec<(u8, JsonState)> = alphabet
            .iter()
            .filter_map(|&b| grammar.after(state, &[b]).map(|s| (b, s)))
            .collect();
        if options.is_empty() {
            return Err(format!(
                "dead end after {:?}",
                String::from_utf8_lossy(&text)
            ));
        }
        let closing = options
            .iter()
            .position(|&(b, _)| matches!(b, b'}' | b']' | b'"') && next() % steps < step + 8);
        let (b, after) = options[closing.unwrap_or_else(|| next() % options.len())];
        text.push(b);
        state = after;
    }
    Ok(state.is_done().then_some(text))
}

/// JSON pointers (RFC 6901) of every value in `v`, depth first, the root ("") first: for tests that edit JSON
/// documents at random (the fuzz campaign, the server's mutated requests).
pub fn json_pointers(v: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match v {
            serde_json::Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(item, format!("{at}/{i}"), out);
                }
            }
            serde_json::Value::Object(map) => {
                for (k, item) in map {
                    walk(
                        item,
                        format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                        out,
                    );
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out
}

/// Removes the value at `pointer` from its parent object or array (nothing for the root or a path not there).
pub fn remove_json_pointer(doc: &mut serde_json::Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    match doc.pointer_mut(parent) {
        Some(serde_json::Value::Object(map)) => {
            map.remove(&last.replace("~1", "/").replace("~0", "~"));
        }
        Some(serde_json::Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>() {
                if i < items.len() {
                    items.remove(i);
                }
            }
        }
        _ => {}
    }
}
