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
    /// Rebuilds the tokenizer from GGUF metadata (`tokenizer.ggml.*`): byte-level BPE (`gpt2`: Llama 3, Qwen2,
    /// SmolLM2) or SentencePiece BPE (`llama`: Llama 2, Mistral, TinyLlama).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf.get_str("tokenizer.ggml.model").unwrap_or("");
        let tokens: Vec<&str> = gguf
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .ok_or_else(|| Error::Tokenizer("GGUF has no tokenizer.ggml.tokens".into()))?
            .iter()
            .map(|v| v.as_str().unwrap_or(""))
            .collect();
        if tokens.is_empty() {
            return Err(Error::Tokenizer(
                "GGUF tokenizer.ggml.tokens is empty".into(),
            ));
        }
        if tokens.len() > u32::MAX as usize {
            return Err(Error::Tokenizer(format!(
                "GGUF tokenizer.ggml.tokens has {} entries; token ids are 32-bit",
                tokens.len()
            )));
        }
        let token_types: Vec<u64> = gguf
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let mut inner = match model {
            "gpt2" => byte_level_bpe_from_gguf(gguf, &tokens)?,
            "llama" => sentencepiece_from_gguf(gguf, &tokens, &token_types)?,
            other => {
                return Err(Error::Tokenizer(format!(
                    "GGUF tokenizer model {other:?} is not supported (supported: \"gpt2\" byte-level BPE as in \
                     Llama 3, Qwen2 and SmolLM2; \"llama\" SentencePiece BPE as in Llama 2); load the Hugging Face \
                     directory with its tokenizer.json instead"
                )))
            }
        };
        // Unknown (2), control (3) and user-defined (4) tokens are matched whole in the text, like llama.cpp's
        // special parsing.
        let special: Vec<AddedToken> = tokens
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(token_types.get(*i), Some(2) | Some(3) | Some(4)))
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
        let json = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let gen_config = read_json(&dir.join("generation_config.json"))?;
        Self::from_hf_json(&json, &config, &gen_config)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// A tokenizer from the bytes of a `tokenizer.json` and the parsed `tokenizer_config.json` and
    /// `generation_config.json` (`Value::Null` when absent).
    pub fn from_hf_json(
        tokenizer_json: &[u8],
        config: &serde_json::Value,
        gen_config: &serde_json::Value,
    ) -> Result<Self> {
        // tokenizers 0.22 panics on some malformed files instead of returning an error (found by fuzzing:
        // `expect("Helper")` in its decoder deserializer on bad JSON such as an invalid \u escape, and a string
        // slice in its BPE builder when a merge does not start with `continuing_subword_prefix`). So the JSON is
        // checked first (fully: escapes included), and a panic inside the library still becomes an error.
        serde_json::from_slice::<serde_json::Value>(tokenizer_json)
            .map_err(|e| Error::Tokenizer(format!("not valid JSON: {e}")))?;
        let inner = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(tokenizer_json))
            .map_err(|_| {
                Error::Tokenizer(
                    "the tokenizers library failed on this tokenizer.json (it panicked)".into(),
                )
            })?
            .map_err(tok_err)?;
        if inner.get_vocab_size(true) == 0 {
            return Err(Error::Tokenizer("the vocabulary is empty".into()));
        }
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
        let in_vocab = |id: u64| {
            u32::try_from(id)
                .ok()
                .filter(|&i| inner.id_to_token(i).is_some())
        };
        match gen_config.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => stop_tokens.extend(n.as_u64().and_then(in_vocab)),
            Some(serde_json::Value::Array(a)) => {
                stop_tokens.extend(a.iter().filter_map(|v| v.as_u64()).filter_map(in_vocab))
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

    /// The tokenizer as Hugging Face `tokenizer.json` text (a GGUF vocabulary rebuilt as one, for instance).
    pub fn to_hf_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(tok_err)
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

    /// The bytes a token stands for on its own (OpenAI's `bytes` of a log-probability entry): a byte-level BPE
    /// token's characters mapped back to bytes (a token may hold part of a UTF-8 character), a SentencePiece
    /// token's `▁` as a space and `<0xNN>` as that byte; special tokens as their text. Empty for an id outside
    /// the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.inner.id_to_token(id) else {
            return Vec::new();
        };
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        if byte_level {
            let mut bytes = Vec::with_capacity(text.len());
            for c in text.chars() {
                match byte_of_byte_level_char(c) {
                    Some(b) => bytes.push(b),
                    // Not of the byte alphabet: an added token's own text.
                    None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            return bytes;
        }
        if let Some(hex) = text
            .strip_prefix("<0x")
            .and_then(|t| t.strip_suffix('>'))
            .filter(|h| h.len() == 2)
        {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return vec![b];
            }
        }
        text.replace('\u{2581}', " ").into_bytes()
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

    /// The special (control) tokens, sorted: matched whole in text, never part of ordinary output.
    pub fn special_tokens(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }
}

/// GGUF `gpt2` tokenizers: byte-level BPE from the vocabulary and merge list, with the family's pre-tokenizer.
fn byte_level_bpe_from_gguf(gguf: &GgufFile, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
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
    Ok(inner)
}

/// Longest SentencePiece piece (in bytes) that is split into merges.
const MAX_SPM_PIECE_BYTES: usize = 256;

/// GGML token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_NORMAL: u64 = 1;
const TOKEN_TYPE_UNKNOWN: u64 = 2;

/// GGUF `llama` tokenizers: SentencePiece BPE. SentencePiece merges, at each step, the adjacent pair whose
/// concatenation is the highest-scoring vocabulary piece; a BPE whose merge ranks follow those scores (highest
/// first) makes the same choices, so the vocabulary and scores are rebuilt as merges. Spaces become U+2581
/// ("\u{2581}") with one prepended (`tokenizer.ggml.add_space_prefix`, default on), characters outside the
/// vocabulary fall back to `<0xXX>` byte tokens, and decoding reverses both.
fn sentencepiece_from_gguf(
    gguf: &GgufFile,
    tokens: &[&str],
    token_types: &[u64],
) -> Result<tokenizers::Tokenizer> {
    use std::collections::HashMap;
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence as DecoderSequence;
    use tokenizers::decoders::strip::Strip;
    use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};

    let scores: Vec<f32> = gguf
        .get("tokenizer.ggml.scores")
        .and_then(|v| v.as_array())
        .ok_or_else(|| {
            Error::Tokenizer("SentencePiece GGUF tokenizer has no tokenizer.ggml.scores".into())
        })?
        .iter()
        .map(|v| v.as_f64().unwrap_or(0.0) as f32)
        .collect();
    if scores.len() != tokens.len() {
        return Err(Error::Tokenizer(format!(
            "tokenizer.ggml.scores has {} entries for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let is_normal =
        |i: usize| token_types.get(i).copied().unwrap_or(TOKEN_TYPE_NORMAL) == TOKEN_TYPE_NORMAL;
    let ids: HashMap<&str, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (*t, i as u32))
        .collect();
    // Every split of a normal piece into two normal pieces is a merge, ranked by the piece's score.
    let mut ranked: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        // Splitting costs the square of a piece's length; SentencePiece pieces are at most 16 characters by
        // default, so longer ones (a corrupt vocabulary) keep their id but get no merges.
        if !is_normal(id) || piece.len() > MAX_SPM_PIECE_BYTES {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                if is_normal(l as usize) && is_normal(r as usize) {
                    ranked.push((scores[id], id as u32, l, r));
                }
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> = ranked
        .iter()
        .map(|&(_, _, l, r)| {
            (
                tokens[l as usize].to_string(),
                tokens[r as usize].to_string(),
            )
        })
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let unk = token_types
        .iter()
        .position(|&t| t == TOKEN_TYPE_UNKNOWN)
        .or_else(|| {
            gguf.get_u64("tokenizer.ggml.unknown_token_id")
                .map(|v| v as usize)
        })
        .and_then(|i| tokens.get(i))
        .map(|t| t.to_string());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let add_space_prefix = gguf
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.as_bool())
        .unwrap_or(true);
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new("\u{2581}".into()).into());
    }
    normalizers.push(Replace::new(" ", "\u{2581}").map_err(tok_err)?.into());
    inner.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    let mut decoders = vec![
        Replace::new("\u{2581}", " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    if !path.exists() {
        return Ok(serde_json::Value::Null);
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
}

/// The byte a character of the byte-level BPE alphabet (GPT-2's) stands for: printable bytes are their own
/// character, the other 68 (controls, space, DEL, NBSP, soft hyphen ...) are U+0100 onwards in byte order.
fn byte_of_byte_level_char(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let code = c as u32;
    if printable(code) {
        return Some(code as u8);
    }
    let index = code.checked_sub(256)?;
    (0u32..=255)
        .filter(|&b| !printable(b))
        .nth(index as usize)
        .map(|b| b as u8)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::{write_gguf, Value};
    use std::collections::HashMap;

    /// A tiny SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, then scored pieces.
    fn spm_vocab() -> Vec<(String, f32, u64)> {
        let mut v: Vec<(String, f32, u64)> = vec![
            ("<unk>".into(), 0.0, 2),
            ("<s>".into(), 0.0, 3),
            ("</s>".into(), 0.0, 3),
        ];
        for b in 0..=255u8 {
            v.push((format!("<0x{b:02X}>"), 0.0, 6));
        }
        for (piece, score) in [
            ("\u{2581}", -10.0),
            ("t", -11.0),
            ("h", -12.0),
            ("e", -13.0),
            ("a", -14.0),
            ("c", -15.0),
            ("s", -16.0),
            ("o", -17.0),
            ("w", -18.0),
            ("th", -1.0),
            ("he", -2.0),
            ("\u{2581}the", -0.5),
            ("\u{2581}th", -3.0),
            ("the", -4.0),
            ("\u{2581}c", -5.0),
            ("at", -6.0),
            ("\u{2581}cat", -0.7),
            ("ca", -7.0),
            ("cat", -8.0),
            ("\u{2581}a", -8.5),
            ("\u{2581}\u{2581}", -9.0),
            ("wo", -9.5),
            ("\u{2581}two", -0.9),
            ("\u{2581}t", -9.7),
        ] {
            v.push((piece.to_string(), score, 1));
        }
        v
    }

    fn spm_tokenizer(dir: &std::path::Path) -> Tokenizer {
        let vocab = spm_vocab();
        let path = dir.join("spm.gguf");
        let strings =
            |f: &dyn Fn(&(String, f32, u64)) -> Value| vocab.iter().map(f).collect::<Vec<_>>();
        write_gguf(
            &path,
            &[
                ("general.architecture", Value::String("llama".into())),
                ("tokenizer.ggml.model", Value::String("llama".into())),
                (
                    "tokenizer.ggml.tokens",
                    Value::Array(strings(&|t| Value::String(t.0.clone()))),
                ),
                (
                    "tokenizer.ggml.scores",
                    Value::Array(strings(&|t| Value::F32(t.1))),
                ),
                (
                    "tokenizer.ggml.token_type",
                    Value::Array(strings(&|t| Value::I32(t.2 as i32))),
                ),
                ("tokenizer.ggml.bos_token_id", Value::U32(1)),
                ("tokenizer.ggml.eos_token_id", Value::U32(2)),
                ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
            ],
            &[],
        )
        .unwrap();
        Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
    }

    /// SentencePiece BPE as its paper and llama.cpp describe it, written plainly: repeatedly merge the adjacent
    /// pair whose concatenation is the highest-scoring piece (leftmost on ties), then map unknown pieces to
    /// UTF-8 byte tokens.
    fn spm_reference(text: &str) -> Vec<u32> {
        let vocab = spm_vocab();
        let lookup: HashMap<&str, (u32, f32, u64)> = vocab
            .iter()
            .enumerate()
            .map(|(i, (p, s, t))| (p.as_str(), (i as u32, *s, *t)))
            .collect();
        let normalized = format!("\u{2581}{}", text.replace(' ', "\u{2581}"));
        let mut symbols: Vec<String> = normalized.chars().map(String::from).collect();
        loop {
            let mut best: Option<(usize, f32)> = None;
            for i in 0..symbols.len().saturating_sub(1) {
                let merged = format!("{}{}", symbols[i], symbols[i + 1]);
                if let Some(&(_, score, 1)) = lookup.get(merged.as_str()) {
                    if best.is_none_or(|(_, s)| score > s) {
                        best = Some((i, score));
                    }
                }
            }
            let Some((i, _)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        let mut ids = vec![1]; // BOS
        for sym in symbols {
            match lookup.get(sym.as_str()) {
                Some(&(id, _, _)) => ids.push(id),
                None => ids.extend(sym.bytes().map(|b| 3 + b as u32)),
            }
        }
        ids
    }

    /// A token's bytes: a byte-level token's characters back to the bytes they stand for (every one of the 256),
    /// merged tokens and special tokens whole; SentencePiece's `▁` and byte tokens; the bytes of a text's tokens
    /// concatenate to the text.
    #[test]
    fn token_bytes_are_what_each_token_stands_for() {
        let from_json = Tokenizer::from_hf_json(
            crate::testing::tiny_tokenizer_json().to_string().as_bytes(),
            &serde_json::Value::Null,
            &serde_json::Value::Null,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let gguf_path = dir.path().join("tiny.gguf");
        crate::testing::write_tiny_gguf(&gguf_path, &crate::testing::TinySpec::default()).unwrap();
        let from_gguf = Tokenizer::from_gguf(&GgufFile::open(&gguf_path).unwrap()).unwrap();
        for tok in [&from_json, &from_gguf] {
            for b in 0..=255u8 {
                assert_eq!(tok.token_bytes(b as u32), vec![b], "byte {b}");
            }
            assert_eq!(tok.token_bytes(256), b" t".to_vec());
            assert_eq!(tok.token_bytes(257), b"he".to_vec());
            assert_eq!(tok.token_bytes(259), b"<|im_end|>".to_vec());
            assert!(tok.token_bytes(100_000).is_empty());
            let text = "the caf\u{e9} \u{2713} \u{65e5}\u{672c} tea\n";
            let ids = tok.encode(text).unwrap();
            let joined: Vec<u8> = ids.iter().flat_map(|&i| tok.token_bytes(i)).collect();
            assert_eq!(joined, text.as_bytes());
        }
        let spm = spm_tokenizer(dir.path());
        let ids = spm.encode("the cat \u{e9}").unwrap();
        assert_eq!(spm.token_bytes(ids[0]), b"<s>".to_vec());
        let joined: Vec<u8> = ids[1..].iter().flat_map(|&i| spm.token_bytes(i)).collect();
        assert_eq!(joined, " the cat \u{e9}".as_bytes());
    }

    #[test]
    fn sentencepiece_gguf_tokenizer_matches_the_reference_algorithm() {
        let dir = tempfile::tempdir().unwrap();
        let tok = spm_tokenizer(dir.path());
        for text in [
            "the cat sat",
            "thethe cat",
            "a cat at the cathe",
            "  two  spaces",
            "th\u{e9}\u{e2}tre \u{1f375} two",
            "hello world",
            "c",
        ] {
            let ids = tok.encode(text).unwrap();
            assert_eq!(ids, spm_reference(text), "{text:?}");
            assert_eq!(tok.decode(&ids[1..]).unwrap(), text, "round trip {text:?}");
        }
        // Hand-checked: "▁the" and "▁cat" win over "th"/"at"-first splits; "sat" falls back to pieces.
        let piece = |p: &str| tok.token_id(p).unwrap();
        assert_eq!(
            tok.encode("the cat sat").unwrap(),
            vec![
                1,
                piece("\u{2581}the"),
                piece("\u{2581}cat"),
                piece("\u{2581}"),
                piece("s"),
                piece("at")
            ]
        );
        // Special tokens written in the text are matched whole.
        let ids = tok.encode("<s>the</s>").unwrap();
        assert_eq!(ids.first(), Some(&1));
        assert!(ids.contains(&2), "{ids:?}");
        assert!(tok.is_stop(2));
    }

    #[test]
    fn unsupported_gguf_tokenizer_model_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        write_gguf(
            &path,
            &[
                ("tokenizer.ggml.model", Value::String("bert".into())),
                (
                    "tokenizer.ggml.tokens",
                    Value::Array(vec![Value::String("a".into())]),
                ),
            ],
            &[],
        )
        .unwrap();
        let err = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("\"bert\" is not supported"), "{err}");
    }
}
