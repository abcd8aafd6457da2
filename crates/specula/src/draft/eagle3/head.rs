//! An EAGLE-3 draft head in the layout SpecForge exports and SGLang / vLLM load, and its forward pass on the CPU.
//!
//! Checkpoint: a directory with `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`, Llama fields for the
//! one decoder layer, `draft_vocab_size`, optional `target_hidden_size` and
//! `eagle_config.eagle_aux_hidden_state_layer_ids`) and `*.safetensors` holding `fc.weight [h, 3H]`,
//! `midlayer.{hidden_norm, input_layernorm, post_attention_layernorm}.weight`,
//! `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2h inputs), `midlayer.mlp.{gate,up,down}_proj.weight`,
//! `norm.weight`, `lm_head.weight [draft_vocab, h]`, `d2t` (int64 [draft_vocab]: target id = draft id + d2t[id])
//! and usually no embedding (the target's is used).
//!
//! Forward of one row (SGLang `models/llama_eagle3.py`, vLLM `models/llama_eagle3.py`, SpecForge
//! `modeling/draft/llama3_eagle.py` agree): x is fc(low ++ mid ++ high) of the target's hidden states, or the
//! previous draft step's output;
//!   a   = [input_layernorm(embed(token)), hidden_norm(x)]        (2h wide, embedding first)
//!   r1  = x + o_proj(attention(q_proj a, k_proj a, v_proj a))    (RoPE at the row's position, the head's own KV)
//!   out = r1 + down(silu(gate(post_attention_layernorm r1)) * up(...))
//!   draft logits = lm_head(norm(out));  the next step feeds `out` (before the norm) back as x.
//! Row p reads the target's features at position p and the embedding of token p + 1, at RoPE position p.

use std::path::{Path, PathBuf};

use crate::backend::cpu::ops;
use crate::backend::cpu::weights::{GgmlType, Weight};
use crate::backend::cpu::KvCache;
use crate::error::{Error, Result};
use crate::model::config::{Config, RopeStyle};
use crate::model::safetensors::SafetensorsFiles;
use crate::model::tensors::WeightSource;

/// The architectures an EAGLE-3 head's config.json names (SpecForge / SGLang, and vLLM's alias).
pub const ARCHITECTURES: &[&str] = &["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"];

/// What a head's config.json says, checked.
#[derive(Debug, Clone)]
pub struct HeadConfig {
    /// The head's one decoder layer as a model config (hidden size h, heads, RoPE, eps), `vocab_size` = the
    /// target vocabulary it maps into.
    pub layer: Config,
    /// Width of the target's hidden states (H; fc reads 3H).
    pub target_hidden: usize,
    /// Tokens the head can propose (rows of its LM head).
    pub draft_vocab: usize,
    /// The target layers whose outputs feed fc, low to high, as the config gives them (SpecForge's "output of
    /// layer i" convention; None when the config names none).
    pub aux_layers: Option<Vec<usize>>,
    /// Held-out accuracy per unrolled step that training recorded (`specula_training.eval_accuracy_per_step`,
    /// written by `specula train-eagle3`; other exporters leave it out).
    pub trained_accuracy: Option<Vec<f64>>,
}

fn config_error(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Config(format!("{}: {reason}", path.display()))
}

impl HeadConfig {
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let mut value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| config_error(path, e))?;
        let obj = value
            .as_object_mut()
            .ok_or_else(|| config_error(path, "not a JSON object"))?;
        let arch: Vec<String> = obj
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        if !arch.iter().any(|a| ARCHITECTURES.contains(&a.as_str())) {
            return Err(config_error(
                path,
                format!(
                    "architectures {arch:?} is not an EAGLE-3 head (expected one of {ARCHITECTURES:?})"
                ),
            ));
        }
        let get_usize = |obj: &serde_json::Map<String, serde_json::Value>, key: &str| {
            obj.get(key).and_then(|v| v.as_u64()).map(|v| v as usize)
        };
        let layers = get_usize(obj, "num_hidden_layers").unwrap_or(1);
        if layers != 1 {
            return Err(config_error(
                path,
                format!("num_hidden_layers is {layers}; an EAGLE-3 head has one decoder layer"),
            ));
        }
        let hidden =
            get_usize(obj, "hidden_size").ok_or_else(|| config_error(path, "no hidden_size"))?;
        let target_hidden = get_usize(obj, "target_hidden_size").unwrap_or(hidden);
        let vocab =
            get_usize(obj, "vocab_size").ok_or_else(|| config_error(path, "no vocab_size"))?;
        let draft_vocab = get_usize(obj, "draft_vocab_size").unwrap_or(vocab);
        if draft_vocab == 0 || draft_vocab > vocab {
            return Err(config_error(
                path,
                format!("draft_vocab_size {draft_vocab} must be between 1 and vocab_size {vocab}"),
            ));
        }
        let ids_value = obj
            .get("eagle_config")
            .and_then(|e| e.get("eagle_aux_hidden_state_layer_ids"))
            .or_else(|| obj.get("eagle_aux_hidden_state_layer_ids"))
            .cloned();
        let aux_layers = match ids_value {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let ids: Vec<usize> = serde_json::from_value(v).map_err(|e| {
                    config_error(path, format!("eagle_aux_hidden_state_layer_ids: {e}"))
                })?;
                if ids.len() != 3 {
                    return Err(config_error(
                        path,
                        format!(
                            "eagle_aux_hidden_state_layer_ids has {} ids; EAGLE-3 reads 3",
                            ids.len()
                        ),
                    ));
                }
                Some(ids)
            }
        };
        let trained_accuracy = obj
            .get("specula_training")
            .and_then(|t| t.get("eval_accuracy_per_step"))
            .and_then(|v| serde_json::from_value::<Vec<f64>>(v.clone()).ok())
            .filter(|v| !v.is_empty() && v.iter().all(|a| (0.0..=1.0).contains(a)));
        // The decoder layer is a Llama layer: reuse the model config parser (sizes, RoPE scaling, limits). RoPE
        // comes from the head's own config (default theta 10000, as SGLang and vLLM read it).
        obj.insert("model_type".into(), "llama".into());
        obj.insert("num_hidden_layers".into(), 1.into());
        obj.entry("rope_theta").or_insert(10_000.0.into());
        obj.insert("attention_bias".into(), false.into());
        let mut layer =
            Config::from_hf_json(&value.to_string()).map_err(|e| config_error(path, e))?;
        layer.rope_style = RopeStyle::Halves;
        Ok(HeadConfig {
            layer,
            target_hidden,
            draft_vocab,
            aux_layers,
            trained_accuracy,
        })
    }

    /// The target layers to capture: the configured ids, or the engines' default for an `n`-layer target
    /// ([1, n/2 - 1, n - 4] as outputs of layers = inputs of layers [2, n/2, n - 3], SGLang's and vLLM's
    /// default), each checked against the target.
    pub fn target_layers(&self, n: usize) -> Result<Vec<usize>> {
        let ids = match &self.aux_layers {
            Some(ids) => ids.clone(),
            None => {
                if n < 5 {
                    return Err(Error::InvalidArgument(format!(
                        "the EAGLE-3 head names no eagle_aux_hidden_state_layer_ids and the target has {n} layers, \
                         too few for the default [1, n/2 - 1, n - 4]"
                    )));
                }
                vec![1, n / 2 - 1, n - 4]
            }
        };
        if let Some(&bad) = ids.iter().find(|&&i| i >= n) {
            return Err(Error::InvalidArgument(format!(
                "the EAGLE-3 head reads target layer {bad} (eagle_aux_hidden_state_layer_ids {ids:?}), but the \
                 target has {n} layers (0..{})",
                n - 1
            )));
        }
        Ok(ids)
    }
}

/// One sequence's rows in a layer pass over several sequences ([`Eagle3Head::layer_groups`]).
pub(crate) struct LayerGroup<'c> {
    pub cache: &'c mut KvCache,
    pub n: usize,
    /// Each row's RoPE position.
    pub positions: Vec<usize>,
    /// Each row's visible slots (trees); None: causal.
    pub visible: Option<Vec<Vec<usize>>>,
}

impl<'c> LayerGroup<'c> {
    /// `n` chain rows at positions `cache.len()..`.
    pub fn chain(cache: &'c mut KvCache, n: usize) -> Self {
        let start = cache.len();
        LayerGroup {
            cache,
            n,
            positions: (start..start + n).collect(),
            visible: None,
        }
    }
}

/// A tree row of [`Eagle3Head::forward_tree`].
#[derive(Debug, Clone)]
pub struct TreeRow {
    pub position: usize,
    /// It sees cache slots `0..prefix` (the rows computed from the target's features).
    pub prefix: usize,
    /// And these slots (its ancestors among earlier tree rows), increasing.
    pub ancestors: Vec<usize>,
}

/// An EAGLE-3 head's weights on the CPU.
pub struct Eagle3Head {
    pub config: HeadConfig,
    pub path: PathBuf,
    fc: Weight,
    hidden_norm: Vec<f32>,
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    final_norm: Vec<f32>,
    lm_head: Weight,
    /// Target id of each draft id (d2t applied).
    draft_to_target: Vec<u32>,
    /// The head's own embedding, when the checkpoint carries one (else the target's is used).
    embed: Option<Weight>,
    rope_inv_freqs: Vec<f32>,
    /// The head's twin on the target's device (`place_on`); None runs it on the CPU.
    device: Option<Box<dyn super::compute::HeadCompute>>,
}

/// A head's matrices as it holds them (`Eagle3Head::matrices`).
#[cfg(feature = "cuda")]
pub(crate) struct HeadMatrices<'a> {
    pub fc: &'a Weight,
    pub wq: &'a Weight,
    pub wk: &'a Weight,
    pub wv: &'a Weight,
    pub wo: &'a Weight,
    pub w_gate: &'a Weight,
    pub w_up: &'a Weight,
    pub w_down: &'a Weight,
    pub lm_head: &'a Weight,
}

/// A head's weights as f32 on the host, row-major (what a device twin uploads).
pub struct HostWeights {
    pub fc: Vec<f32>,
    pub hidden_norm: Vec<f32>,
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub wo: Vec<f32>,
    pub w_gate: Vec<f32>,
    pub w_up: Vec<f32>,
    pub w_down: Vec<f32>,
    pub final_norm: Vec<f32>,
    pub lm_head: Vec<f32>,
    pub embed: Option<Vec<f32>>,
}

/// The tensor `name`, or `model.` + name (some exports prefix the head's tensors).
fn find(src: &SafetensorsFiles, name: &str) -> Option<String> {
    [name.to_string(), format!("model.{name}")]
        .into_iter()
        .find(|n| src.has(n))
}

/// How a head's matrices are held on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadPrecision {
    /// As the checkpoint stores them (bf16 for published heads).
    #[default]
    Stored,
    /// Requantized to Q8_0 at load: half the bytes of bf16 and the CPU's 8-bit kernels, so each draft step costs
    /// less; acceptance is measured to stay the same (docs/eagle3.md).
    Q8_0,
    /// Requantized to Q6_K at load (a matrix whose width is not a multiple of 256 goes to Q8_0).
    Q6K,
    /// Requantized to Q4_K at load (a matrix whose width is not a multiple of 256 goes to Q8_0): the CPU's default
    /// since session 38, a draft step 40% cheaper than Q8_0's with the same acceptance on the 1.5B's head
    /// (docs/benchmarks.md).
    Q4K,
}

impl HeadPrecision {
    /// The storage type a `rows` x `cols` matrix gets: the chosen one where its blocks fit the width, else Q8_0
    /// where its 32-wide blocks do, else the stored type (None).
    pub fn storage_for(self, cols: usize) -> Option<GgmlType> {
        let chosen = match self {
            HeadPrecision::Stored => return None,
            HeadPrecision::Q8_0 => GgmlType::Q8_0,
            HeadPrecision::Q6K => GgmlType::Q6K,
            HeadPrecision::Q4K => GgmlType::Q4K,
        };
        [chosen, GgmlType::Q8_0]
            .into_iter()
            .find(|ty| cols.is_multiple_of(ty.block_size()))
    }
}

fn requantize(w: Weight, precision: HeadPrecision) -> Result<Weight> {
    match precision.storage_for(w.cols) {
        None => Ok(w),
        Some(ty) => {
            Weight::quantize(&w.to_f32(), w.rows, w.cols, ty).map_err(Error::InvalidArgument)
        }
    }
}

fn weight(src: &SafetensorsFiles, name: &str, rows: usize, cols: usize) -> Result<Weight> {
    let actual = find(src, name).ok_or_else(|| Error::MissingTensor {
        name: name.to_string(),
        hint: " in the EAGLE-3 head".into(),
    })?;
    let t = src.tensor(&actual, rows, cols)?;
    Weight::from_raw(t.dtype, t.bytes, rows, cols).map_err(|reason| Error::BadTensor {
        path: t.file.to_path_buf(),
        tensor: actual.clone(),
        reason,
    })
}

fn vector(src: &SafetensorsFiles, name: &str, len: usize) -> Result<Vec<f32>> {
    Ok(weight(src, name, 1, len)?.to_f32())
}

impl Eagle3Head {
    /// Loads a head from its directory (config.json + *.safetensors), matrices as stored.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_as(dir, HeadPrecision::Stored)
    }

    /// Loads a head, holding its matrices at `precision`.
    pub fn load_as(dir: &Path, precision: HeadPrecision) -> Result<Self> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let config = HeadConfig::from_json(&text, &config_path)?;
        if dir.join("pytorch_model.bin").exists()
            && !std::fs::read_dir(dir)
                .map_err(|e| Error::io(dir, e))?
                .filter_map(|e| e.ok())
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        {
            return Err(Error::InvalidArgument(format!(
                "{}: the head is a PyTorch pickle (pytorch_model.bin); specula reads safetensors (convert it with \
                 `safetensors.torch.save_file(torch.load(...), 'model.safetensors')`)",
                dir.display()
            )));
        }
        let src = SafetensorsFiles::open_dir(dir)?;
        let c = &config.layer;
        let (h, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let draft_vocab = config.draft_vocab;
        let d2t_name = find(&src, "d2t");
        let draft_to_target = match d2t_name {
            Some(name) => {
                let offsets = src.integers(&name, draft_vocab)?;
                offsets
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| {
                        let t = i as i64 + d;
                        if t < 0 || t >= c.vocab_size as i64 {
                            Err(Error::InvalidArgument(format!(
                                "{}: d2t[{i}] = {d} maps draft token {i} to target token {t}, outside the \
                                 vocabulary of {} (d2t holds offsets: target = draft + d2t)",
                                dir.display(),
                                c.vocab_size
                            )))
                        } else {
                            Ok(t as u32)
                        }
                    })
                    .collect::<Result<Vec<u32>>>()?
            }
            None if draft_vocab == c.vocab_size => (0..draft_vocab as u32).collect(),
            None => {
                return Err(Error::MissingTensor {
                    name: "d2t".into(),
                    hint: format!(
                        " in the EAGLE-3 head (its draft vocabulary of {draft_vocab} differs from the target's {})",
                        c.vocab_size
                    ),
                })
            }
        };
        let embed = match find(&src, "embed_tokens.weight") {
            Some(_) => Some(weight(&src, "embed_tokens.weight", c.vocab_size, h)?),
            None => None,
        };
        let rope_inv_freqs = c.rope_inv_freqs(None);
        Ok(Eagle3Head {
            fc: requantize(
                weight(&src, "fc.weight", h, 3 * config.target_hidden)?,
                precision,
            )?,
            hidden_norm: vector(&src, "midlayer.hidden_norm.weight", h)?,
            input_norm: vector(&src, "midlayer.input_layernorm.weight", h)?,
            post_attention_norm: vector(&src, "midlayer.post_attention_layernorm.weight", h)?,
            wq: requantize(
                weight(&src, "midlayer.self_attn.q_proj.weight", q_dim, 2 * h)?,
                precision,
            )?,
            wk: requantize(
                weight(&src, "midlayer.self_attn.k_proj.weight", kv_dim, 2 * h)?,
                precision,
            )?,
            wv: requantize(
                weight(&src, "midlayer.self_attn.v_proj.weight", kv_dim, 2 * h)?,
                precision,
            )?,
            wo: requantize(
                weight(&src, "midlayer.self_attn.o_proj.weight", h, q_dim)?,
                precision,
            )?,
            w_gate: requantize(
                weight(&src, "midlayer.mlp.gate_proj.weight", ff, h)?,
                precision,
            )?,
            w_up: requantize(
                weight(&src, "midlayer.mlp.up_proj.weight", ff, h)?,
                precision,
            )?,
            w_down: requantize(
                weight(&src, "midlayer.mlp.down_proj.weight", h, ff)?,
                precision,
            )?,
            final_norm: vector(&src, "norm.weight", h)?,
            lm_head: requantize(weight(&src, "lm_head.weight", draft_vocab, h)?, precision)?,
            draft_to_target,
            embed,
            rope_inv_freqs,
            config,
            path: dir.to_path_buf(),
            device: None,
        })
    }

    /// Runs the head where `target` runs when its backend can (the CUDA backend uploads the head next to the
    /// target's weights); on the CPU otherwise. Returns where it runs.
    pub fn place_on(&mut self, target: &dyn crate::model::Model) -> Result<String> {
        self.check_target(target.config())?;
        self.device = target.place_eagle3_head(self)?;
        Ok(self.compute().device())
    }

    /// Where the head's passes run: its device twin, or the CPU.
    pub fn compute(&self) -> &dyn super::compute::HeadCompute {
        match &self.device {
            Some(d) => d.as_ref(),
            None => self,
        }
    }

    /// The matrices as held (as stored, or requantized at load): a device twin keeps quantized ones quantized.
    #[cfg(feature = "cuda")]
    pub(crate) fn matrices(&self) -> HeadMatrices<'_> {
        HeadMatrices {
            fc: &self.fc,
            wq: &self.wq,
            wk: &self.wk,
            wv: &self.wv,
            wo: &self.wo,
            w_gate: &self.w_gate,
            w_up: &self.w_up,
            w_down: &self.w_down,
            lm_head: &self.lm_head,
        }
    }

    /// The same head with every matrix held as f32 values of what it holds (a quantized head's dequantized
    /// values): the reference a device twin of the quantized head is checked against.
    pub fn dequantized(mut self) -> Self {
        let f32_of = |w: &Weight| Weight::from_f32(w.to_f32(), w.rows, w.cols);
        for w in [
            &mut self.fc,
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.w_gate,
            &mut self.w_up,
            &mut self.w_down,
            &mut self.lm_head,
        ] {
            *w = f32_of(w);
        }
        self
    }

    /// The weights as f32 (dequantized when held as Q8_0: load with `HeadPrecision::Stored` before placing a head
    /// on a device, so it gets the checkpoint's values).
    pub fn host_weights(&self) -> HostWeights {
        HostWeights {
            fc: self.fc.to_f32(),
            hidden_norm: self.hidden_norm.clone(),
            input_norm: self.input_norm.clone(),
            post_attention_norm: self.post_attention_norm.clone(),
            wq: self.wq.to_f32(),
            wk: self.wk.to_f32(),
            wv: self.wv.to_f32(),
            wo: self.wo.to_f32(),
            w_gate: self.w_gate.to_f32(),
            w_up: self.w_up.to_f32(),
            w_down: self.w_down.to_f32(),
            final_norm: self.final_norm.clone(),
            lm_head: self.lm_head.to_f32(),
            embed: self.embed.as_ref().map(|e| e.to_f32()),
        }
    }

    /// The draft-to-target id map.
    pub fn draft_to_target(&self) -> &[u32] {
        &self.draft_to_target
    }

    /// Refuses, naming the mismatch, a head made for another target.
    pub fn check_target(&self, target: &Config) -> Result<()> {
        let c = &self.config;
        let who = self.path.display();
        if c.target_hidden != target.hidden_size {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 head {who} reads target hidden states of width {} (target_hidden_size / hidden_size), but \
                 the target's hidden size is {}",
                c.target_hidden, target.hidden_size
            )));
        }
        if c.layer.vocab_size != target.vocab_size {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 head {who} maps into a vocabulary of {} tokens (vocab_size), but the target has {}",
                c.layer.vocab_size, target.vocab_size
            )));
        }
        if self.embed.is_none() && c.layer.hidden_size != target.hidden_size {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 head {who} has no embed_tokens and its hidden size {} differs from the target's {}, so \
                 it cannot use the target's embedding",
                c.layer.hidden_size, target.hidden_size
            )));
        }
        c.target_layers(target.num_layers)?;
        Ok(())
    }

    /// The head's own embedding rows, if it has one.
    pub fn own_embedding(&self, tokens: &[u32]) -> Option<Vec<f32>> {
        let e = self.embed.as_ref()?;
        let h = self.config.layer.hidden_size;
        let mut out = vec![0f32; tokens.len() * h];
        for (row, &t) in out.chunks_exact_mut(h).zip(tokens) {
            e.row_to_f32(t as usize, row);
        }
        Some(out)
    }

    /// The target id of draft id `i`.
    pub fn target_id(&self, draft_id: usize) -> u32 {
        self.draft_to_target[draft_id]
    }

    pub fn draft_vocab(&self) -> usize {
        self.config.draft_vocab
    }

    /// The storage types of its matrices on the host (fc, Q, K, V, O, gate, up, down, LM head), distinct, in that
    /// order: what a requantized load chose ([`HeadPrecision::storage_for`]).
    pub fn weight_types(&self) -> Vec<GgmlType> {
        let mut types: Vec<GgmlType> = Vec::new();
        for w in [
            &self.fc,
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
            &self.lm_head,
        ] {
            if !types.contains(&w.dtype()) {
                types.push(w.dtype());
            }
        }
        types
    }

    /// An empty KV cache for the head's layer.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(&self.config.layer, capacity)
    }

    /// fc over `n` rows of concatenated target features (3H each): the head's input for target-fed rows.
    pub fn fc(&self, features: &[f32], n: usize) -> Vec<f32> {
        let mut x = vec![0f32; n * self.config.layer.hidden_size];
        self.fc.matmul(features, n, &mut x);
        x
    }

    /// Tree rows: row i is written at cache slot `cache.len() + i`, rotated at `rows[i].position`, and attends to
    /// the slots `0..rows[i].prefix`, the slots `rows[i].ancestors` and itself. Returns each row's output (the
    /// next step's x) and each row's draft-vocabulary logits.
    pub fn forward_tree(
        &self,
        embeds: &[f32],
        x: &[f32],
        rows: &[TreeRow],
        cache: &mut KvCache,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let n = rows.len();
        let start = cache.len();
        let visible: Vec<Vec<usize>> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let mut v: Vec<usize> = (0..r.prefix).collect();
                v.extend(&r.ancestors);
                v.push(start + i);
                v
            })
            .collect();
        let positions: Vec<usize> = rows.iter().map(|r| r.position).collect();
        let out = self.layer(embeds, x, n, cache, &positions, Some(&visible))?;
        let h = self.config.layer.hidden_size;
        let logits = out.chunks_exact(h).map(|row| self.logits(row)).collect();
        Ok((out, logits))
    }

    /// Draft-vocabulary logits of `n` output rows, one matrix product for all.
    pub(crate) fn logits_of_rows(&self, rows: &[f32], n: usize) -> Vec<f32> {
        let h = self.config.layer.hidden_size;
        let mut normed = vec![0f32; n * h];
        for (o, r) in normed.chunks_exact_mut(h).zip(rows.chunks_exact(h)) {
            ops::rms_norm(
                r,
                &self.final_norm,
                self.config.layer.rms_norm_eps as f32,
                o,
            );
        }
        let mut logits = vec![0f32; n * self.config.draft_vocab];
        self.lm_head.matmul(&normed, n, &mut logits);
        logits
    }

    /// Draft-vocabulary logits of one output row.
    fn logits(&self, out_row: &[f32]) -> Vec<f32> {
        let h = self.config.layer.hidden_size;
        let mut normed = vec![0f32; h];
        ops::rms_norm(
            out_row,
            &self.final_norm,
            self.config.layer.rms_norm_eps as f32,
            &mut normed,
        );
        let mut logits = vec![0f32; self.config.draft_vocab];
        self.lm_head.matmul(&normed, 1, &mut logits);
        logits
    }

    /// Runs `n` rows through the decoder layer at positions `cache.len()..` (a chain), appending their keys and
    /// values to `cache`: `embeds` are the next tokens' embeddings, `x` the hidden inputs (fc output or the
    /// previous step's output), both `n x h`. Returns each row's output (before the final norm: the next step's
    /// x) and the draft-vocabulary logits of the last row.
    pub fn forward(
        &self,
        embeds: &[f32],
        x: &[f32],
        n: usize,
        cache: &mut KvCache,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let start = cache.len();
        let positions: Vec<usize> = (start..start + n).collect();
        let out = self.layer(embeds, x, n, cache, &positions, None)?;
        let h = self.config.layer.hidden_size;
        let logits = self.logits(&out[(n - 1) * h..n * h]);
        Ok((out, logits))
    }

    /// The decoder layer over `n` new rows written at slots `cache.len()..`, rotated at `positions`; a row
    /// attends to every slot up to its own (`visible` None) or to the slots `visible[i]` (in increasing order).
    fn layer(
        &self,
        embeds: &[f32],
        x: &[f32],
        n: usize,
        cache: &mut KvCache,
        positions: &[usize],
        visible: Option<&[Vec<usize>]>,
    ) -> Result<Vec<f32>> {
        let mut group = [LayerGroup {
            cache,
            n,
            positions: positions.to_vec(),
            visible: visible.map(|v| v.to_vec()),
        }];
        self.layer_groups(embeds, x, &mut group)
    }

    /// The decoder layer over the rows of several sequences at once (`groups` in row order, each with its own
    /// cache): the matrix products run over every row, attention over each row's own cache.
    pub(crate) fn layer_groups(
        &self,
        embeds: &[f32],
        x: &[f32],
        groups: &mut [LayerGroup<'_>],
    ) -> Result<Vec<f32>> {
        let c = &self.config.layer;
        let (h, q_dim, kv_dim, hd, ff) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim,
            c.intermediate_size,
        );
        let eps = c.rms_norm_eps as f32;
        let n: usize = groups.iter().map(|g| g.n).sum();
        for g in groups.iter_mut() {
            let start = g.cache.len();
            if start + g.n > g.cache.capacity() {
                return Err(Error::InvalidArgument(format!(
                    "the EAGLE-3 head's KV cache holds {} positions; {} needed",
                    g.cache.capacity(),
                    start + g.n
                )));
            }
            g.cache.reserve(start + g.n);
        }
        // a = [input_layernorm(embed), hidden_norm(x)] per row.
        let mut normed_e = vec![0f32; n * h];
        let mut normed_x = vec![0f32; n * h];
        ops::rms_norm(embeds, &self.input_norm, eps, &mut normed_e);
        ops::rms_norm(x, &self.hidden_norm, eps, &mut normed_x);
        let mut a = Vec::with_capacity(n * 2 * h);
        for r in 0..n {
            a.extend_from_slice(&normed_e[r * h..(r + 1) * h]);
            a.extend_from_slice(&normed_x[r * h..(r + 1) * h]);
        }
        let (mut q, mut k, mut v) = (
            vec![0f32; n * q_dim],
            vec![0f32; n * kv_dim],
            vec![0f32; n * kv_dim],
        );
        Weight::matmul_many(
            &[&self.wq, &self.wk, &self.wv],
            &a,
            n,
            &mut [&mut q, &mut k, &mut v],
        );
        let half = (hd / 2).min(self.rope_inv_freqs.len());
        let mut angles = Vec::with_capacity(half);
        let group_heads = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut attn = vec![0f32; n * q_dim];
        let mut scores = Vec::new();
        let mut row0 = 0;
        for g in groups.iter_mut() {
            let start = g.cache.len();
            for i in 0..g.n {
                let r = row0 + i;
                angles.clear();
                ops::rope_angles(g.positions[i], &self.rope_inv_freqs[..half], &mut angles);
                for head in q[r * q_dim..(r + 1) * q_dim].chunks_exact_mut(hd) {
                    ops::rope_apply(head, &angles, true);
                }
                for head in k[r * kv_dim..(r + 1) * kv_dim].chunks_exact_mut(hd) {
                    ops::rope_apply(head, &angles, true);
                }
                g.cache.write(
                    0,
                    start + i,
                    &k[r * kv_dim..(r + 1) * kv_dim],
                    &v[r * kv_dim..(r + 1) * kv_dim],
                );
            }
            // Causal attention over this sequence's cache (GQA).
            for i in 0..g.n {
                let r = row0 + i;
                let slot = start + i;
                for head in 0..c.num_heads {
                    let (keys, values) = g.cache.head(0, head / group_heads, slot + 1);
                    let qh = &q[r * q_dim + head * hd..r * q_dim + (head + 1) * hd];
                    let out = &mut attn[r * q_dim + head * hd..r * q_dim + (head + 1) * hd];
                    scores.clear();
                    match &g.visible {
                        None => {
                            scores
                                .extend(keys.chunks_exact(hd).map(|key| ops::dot(qh, key) * scale));
                            ops::softmax(&mut scores);
                            for (&w, value) in scores.iter().zip(values.chunks_exact(hd)) {
                                ops::axpy(out, w, value);
                            }
                        }
                        Some(v) => {
                            let slots = &v[i];
                            scores.extend(
                                slots
                                    .iter()
                                    .map(|&s| ops::dot(qh, &keys[s * hd..(s + 1) * hd]) * scale),
                            );
                            ops::softmax(&mut scores);
                            for (&w, &s) in scores.iter().zip(slots) {
                                ops::axpy(out, w, &values[s * hd..(s + 1) * hd]);
                            }
                        }
                    }
                }
            }
            g.cache.set_len(start + g.n);
            row0 += g.n;
        }
        let mut r1 = vec![0f32; n * h];
        self.wo.matmul(&attn, n, &mut r1);
        for (o, &xi) in r1.iter_mut().zip(x) {
            *o += xi;
        }
        let mut normed = vec![0f32; n * h];
        ops::rms_norm(&r1, &self.post_attention_norm, eps, &mut normed);
        let (mut gate, mut up) = (vec![0f32; n * ff], vec![0f32; n * ff]);
        Weight::matmul_many(
            &[&self.w_gate, &self.w_up],
            &normed,
            n,
            &mut [&mut gate, &mut up],
        );
        ops::swiglu_in_place(&mut gate, &up);
        let mut out = vec![0f32; n * h];
        self.w_down.matmul(&gate, n, &mut out);
        for (o, &ri) in out.iter_mut().zip(&r1) {
            *o += ri;
        }
        Ok(out)
    }
}
