//! Tokenizers: an HF `tokenizer.json`, or the byte-level BPE vocabulary embedded in GGUF metadata (rebuilt as an
//! HF tokenizer with the pre-tokenizer the model family uses), plus the special tokens generation needs.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Error, Result};
use crate::model::gguf::GgufFile;

// Pre-tokenizer regexes of the byte-level BPE families (the HF tokenizer.json originals).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts that end a turn in the families we run; generation stops at any that the vocabulary has.
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
];

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_token: Option<u32>,
    pub eos_token: Option<u32>,
    /// Prepend BOS when encoding a prompt (from the checkpoint's settings).
    pub add_bos: bool,
    stop_tokens: Vec<u32>,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Rebuilds the tokenizer from GGUF metadata (`tokenizer.ggml.*`).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf.get_str("tokenizer.ggml.model").unwrap_or("");
        if model != "gpt2" {
            return Err(Error::Tokenizer(format!(
                "GGUF tokenizer model {model:?} is not supported yet (supported: \"gpt2\" byte-level BPE, as in \
                 Llama 3, Qwen2 and SmolLM2); load the Hugging Face directory with its tokenizer.json instead"
            )));
        }
        let tokens: Vec<&str> = gguf
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .ok_or_else(|| Error::Tokenizer("GGUF has no tokenizer.ggml.tokens".into()))?
            .iter()
            .map(|v| v.as_str().unwrap_or(""))
            .collect();
        let token_types: Vec<u64> = gguf
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let merges: Vec<(String, String)> = gguf
            .get("tokenizer.ggml.merges")
            .and_then(|v| v.as_array())
            .ok_or_else(|| Error::Tokenizer("GGUF has no tokenizer.ggml.merges".into()))?
            .iter()
            .filter_map(|v| v.as_str())
            .filter_map(|m| m.split_once(' '))
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre = gguf.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let byte_level_no_regex: PreTokenizerWrapper = ByteLevel::new(false, false, false).into();
        let split = |re: &str| -> Result<PreTokenizerWrapper> {
            Ok(Split::new(
                SplitPattern::Regex(re.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tok_err)?
            .into())
        };
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "qwen2" => Sequence::new(vec![split(QWEN2_REGEX)?, byte_level_no_regex]).into(),
            "llama-bpe" | "llama3" => Sequence::new(vec![split(LLAMA3_REGEX)?, byte_level_no_regex]).into(),
            // StarCoder-style: digits split one by one, then the GPT-2 regex.
            "smollm" | "starcoder" | "refact" | "codeshell" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, false, true).into(),
            ])
            .into(),
            "gpt-2" | "gpt2" | "default" => ByteLevel::new(false, false, true).into(),
            other => {
                return Err(Error::Tokenizer(format!(
                    "GGUF pre-tokenizer {other:?} is not supported (supported: qwen2, llama-bpe, smollm, gpt-2)"
                )))
            }
        };
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        // Control (3) and user-defined (4) tokens are matched whole in the text, like llama.cpp's special parsing.
        let special: Vec<AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(token_types.get(*i), Some(3) | Some(4)))
            .map(|(_, t)| AddedToken::from(t.to_string(), true))
            .collect();
        inner.add_special_tokens(&special);

        let id = |key: &str| {
            gguf.get_u64(key)
                .map(|v| v as u32)
                .filter(|&v| (v as usize) < tokens.len())
        };
        let bos_token = id("tokenizer.ggml.bos_token_id");
        let eos_token = id("tokenizer.ggml.eos_token_id");
        let add_bos = gguf
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let mut stop_tokens: Vec<u32> = [eos_token, id("tokenizer.ggml.eot_token_id")]
            .into_iter()
            .flatten()
            .collect();
        for t in END_OF_TURN_TOKENS {
            if let Some(&i) = tokens.iter().position(|x| x == t).as_ref() {
                stop_tokens.push(i as u32);
            }
        }
        stop_tokens.sort_unstable();
        stop_tokens.dedup();
        Ok(Tokenizer {
            inner,
            bos_token,
            eos_token,
            add_bos,
            stop_tokens,
        })
    }

    /// Loads `tokenizer.json` from an HF model directory, with BOS/EOS from `tokenizer_config.json` and
    /// `generation_config.json` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::Tokenizer(format!(
                "{} does not exist",
                path.display()
            )));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let gen_config = read_json(&dir.join("generation_config.json"))?;
        let token_id = |v: Option<&serde_json::Value>| -> Option<u32> {
            let v = v?;
            let text = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(text)
        };
        let bos_token = token_id(config.get("bos_token"));
        let eos_token = token_id(config.get("eos_token"));
        // Without an explicit setting, the tokenizer's own post-processor says whether BOS is added (Llama 3).
        let add_bos = match config.get("add_bos_token").and_then(|v| v.as_bool()) {
            Some(v) => v,
            None => inner
                .encode_fast("", true)
                .ok()
                .and_then(|e| e.get_ids().first().copied())
                .is_some_and(|first| Some(first) == bos_token),
        };
        let mut stop_tokens: Vec<u32> = eos_token.into_iter().collect();
        match gen_config.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => stop_tokens.extend(n.as_u64().map(|v| v as u32)),
            Some(serde_json::Value::Array(a)) => {
                stop_tokens.extend(a.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
            }
            _ => {}
        }
        for t in END_OF_TURN_TOKENS {
            stop_tokens.extend(inner.token_to_id(t));
        }
        stop_tokens.sort_unstable();
        stop_tokens.dedup();
        Ok(Tokenizer {
            inner,
            bos_token,
            eos_token,
            add_bos,
            stop_tokens,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Tokenizes `text`, matching special tokens written in it, and prepends BOS when the model wants one and the
    /// text does not already start with it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        if self.add_bos {
            if let Some(bos) = self.bos_token {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tok_err)
    }

    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_tokens.binary_search(&id).is_ok()
    }

    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    if !path.exists() {
        return Ok(serde_json::Value::Null);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
}

/// Incremental detokenizer: emits text only once it is complete UTF-8 and stable under the next tokens
/// (byte-level BPE splits multi-byte characters across tokens).
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token; returns the new text it completes, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }

    /// Whatever is left undecoded at the end (an incomplete character is shown as U+FFFD).
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>> {
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            Ok(Some(full[prefix.len()..].to_string()))
        } else {
            Ok(None)
        }
    }
}
