//! What a model is, independent of where it runs: its configuration, checkpoint formats and tensor names, the
//! forward-pass interface backends implement, and loading a model with its tokenizer and chat template from a
//! GGUF file, a Hugging Face directory, `hf:ORG/NAME`, or a registry short name onto a device.

pub mod config;
pub mod dtype;
pub mod file_bytes;
pub mod forward;
pub mod gguf;
pub mod safetensors;
pub mod tensors;

use std::path::{Path, PathBuf};

use crate::chat::{ChatTemplate, CHATML_TEMPLATE};
use crate::error::{Error, Result};
use crate::registry;
use crate::tokenizer::Tokenizer;

pub use crate::backend::Device;
pub use config::Config;
pub use forward::{
    run_step_shapes, time_step_shapes, ForwardOptions, ForwardOutput, LogitsFor, Model, RowMatrix,
    SequenceCache, SequenceInput, StepShapes, TreeMask,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Gguf,
    Safetensors,
    /// Random weights of a known shape (`--random-weights`).
    Random,
}

/// A model ready to run: weights on a device, tokenizer, chat template and where it came from.
pub struct LoadedModel {
    pub model: Box<dyn Model>,
    pub tokenizer: std::sync::Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    /// The GGUF file or the HF directory.
    pub path: PathBuf,
    /// What the user asked for (short name, path or hf:ID).
    pub spec: String,
    pub format: Format,
    /// Known when the model came from the registry (checked at fetch time).
    pub known_sha256: Option<String>,
}

/// Where a model spec points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelLocation {
    File(PathBuf),
    Dir(PathBuf),
    Hub(String),
    Registry(&'static registry::RegistryModel),
}

/// Interprets `--model`: `hf:ORG/NAME`, an existing file or directory, or a registry short name.
pub fn locate(spec: &str) -> Result<ModelLocation> {
    if let Some(id) = spec.strip_prefix("hf:") {
        if id.split('/').count() != 2 || id.split('/').any(str::is_empty) {
            return Err(Error::InvalidArgument(format!(
                "hf:{id} is not a Hugging Face model id; expected hf:ORG/NAME"
            )));
        }
        return Ok(ModelLocation::Hub(id.to_string()));
    }
    let path = Path::new(spec);
    if path.is_file() {
        return Ok(ModelLocation::File(path.to_path_buf()));
    }
    if path.is_dir() {
        return Ok(ModelLocation::Dir(path.to_path_buf()));
    }
    if let Some(m) = registry::find(spec) {
        return Ok(ModelLocation::Registry(m));
    }
    if path.exists() {
        // A device, socket or pipe (`-m /dev/null`): there, but nothing a model could be read from.
        return Err(Error::Config(format!(
            "{spec} is neither a file nor a directory: pass a GGUF file, a Hugging Face model directory, \
             hf:ORG/NAME or a registry name"
        )));
    }
    let looks_like_path = spec.contains('/') || spec.contains('\\') || spec.ends_with(".gguf");
    if looks_like_path {
        return Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        ));
    }
    Err(Error::UnknownModel {
        name: spec.to_string(),
        known: registry::known_names(),
    })
}

/// A model of a known shape (`Config::shape`) with seeded random weights on `device`, for speed work; its
/// tokenizer is a 260-token byte-level one (prompts become byte tokens, all inside the shape's vocabulary).
pub fn load_random(shape: &str, device: Device, seed: u64) -> Result<LoadedModel> {
    let config = Config::shape(shape)?;
    let model = crate::backend::load_random(device, config, seed)?;
    let json = crate::testing::tiny_tokenizer_json().to_string();
    let null = serde_json::Value::Null;
    let tokenizer = Tokenizer::from_hf_json(json.as_bytes(), &null, &null)?;
    Ok(LoadedModel {
        model,
        tokenizer: std::sync::Arc::new(tokenizer),
        chat_template: None,
        path: PathBuf::from(format!("random:{shape}")),
        spec: format!("random:{shape}"),
        format: Format::Random,
        known_sha256: None,
    })
}

/// Loads a model from a resolved local path (GGUF file, or HF directory with config.json) onto the CPU.
pub fn load_path(path: &Path, spec: &str) -> Result<LoadedModel> {
    load_path_on(path, spec, Device::Cpu)
}

/// Loads a model from a resolved local path onto `device`.
pub fn load_path_on(path: &Path, spec: &str, device: Device) -> Result<LoadedModel> {
    if path.is_dir() {
        if path.join("config.json").exists() {
            return load_hf_dir_on(path, spec, device);
        }
        let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| Error::io(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        return match ggufs.as_slice() {
            [one] => load_gguf_file(gguf::GgufFile::open(one)?, spec, device),
            [] => Err(Error::Config(format!(
                "{} has neither config.json (a Hugging Face model) nor a .gguf file",
                path.display()
            ))),
            _ => Err(Error::InvalidArgument(format!(
                "{} holds several .gguf files; pass one of them",
                path.display()
            ))),
        };
    }
    load_gguf_file(gguf::GgufFile::open(path)?, spec, device)
}

/// A GGUF file's model on the CPU.
pub fn load_gguf(path: &Path, spec: &str) -> Result<LoadedModel> {
    load_gguf_file(gguf::GgufFile::open(path)?, spec, Device::Cpu)
}

/// A model from an opened GGUF file (from disk or from memory), on `device`.
pub fn load_gguf_file(file: gguf::GgufFile, spec: &str, device: Device) -> Result<LoadedModel> {
    let path = file.path.clone();
    let config = Config::from_gguf(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    check_vocab(&config, &tokenizer)?;
    let chat_template = file
        .get_str("tokenizer.chat_template")
        .map(ChatTemplate::new)
        .or_else(|| default_template(&tokenizer));
    let model = crate::backend::load(device, config, &file, &tensors::GGUF_NAMES)?;
    Ok(LoadedModel {
        model,
        tokenizer: std::sync::Arc::new(tokenizer),
        chat_template,
        path,
        spec: spec.to_string(),
        format: Format::Gguf,
        known_sha256: None,
    })
}

/// An f32 reference of a GGUF file's model on the CPU: every weight dequantized to f32 at load, so the CPU
/// computes with f32 weights and activations (the quantized kernels round activations to 8 bits). Takes 4 bytes a
/// parameter.
pub fn load_gguf_reference(path: &Path, spec: &str) -> Result<LoadedModel> {
    let file = gguf::GgufFile::open(path)?;
    let config = Config::from_gguf(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    check_vocab(&config, &tokenizer)?;
    let chat_template = file
        .get_str("tokenizer.chat_template")
        .map(ChatTemplate::new)
        .or_else(|| default_template(&tokenizer));
    let f32s = tensors::Dequantized::new(&file, &tensors::GGUF_NAMES, &config)?;
    drop(file);
    let model = crate::backend::load(Device::Cpu, config, &f32s, &tensors::GGUF_NAMES)?;
    Ok(LoadedModel {
        model,
        tokenizer: std::sync::Arc::new(tokenizer),
        chat_template,
        path: path.to_path_buf(),
        spec: format!("{spec} (f32 reference)"),
        format: Format::Gguf,
        known_sha256: None,
    })
}

/// A Hugging Face directory's model on the CPU.
pub fn load_hf_dir(dir: &Path, spec: &str) -> Result<LoadedModel> {
    load_hf_dir_on(dir, spec, Device::Cpu)
}

pub fn load_hf_dir_on(dir: &Path, spec: &str, device: Device) -> Result<LoadedModel> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let config = Config::from_hf_json(&text)?;
    let tokenizer = Tokenizer::from_hf_dir(dir)?;
    check_vocab(&config, &tokenizer)?;
    let chat_template = hf_chat_template(dir)?.or_else(|| default_template(&tokenizer));
    let files = safetensors::SafetensorsFiles::open_dir(dir)?;
    let model = crate::backend::load(device, config, &files, &tensors::HF_NAMES)?;
    Ok(LoadedModel {
        model,
        tokenizer: std::sync::Arc::new(tokenizer),
        chat_template,
        path: dir.to_path_buf(),
        spec: spec.to_string(),
        format: Format::Safetensors,
        known_sha256: None,
    })
}

/// Tokens the tokenizer can produce must have embedding rows (padding rows beyond the tokenizer are fine).
fn check_vocab(config: &Config, tokenizer: &Tokenizer) -> Result<()> {
    let tok_vocab = tokenizer.vocab_size();
    if tok_vocab > config.vocab_size {
        return Err(Error::Config(format!(
            "the tokenizer has {tok_vocab} tokens but the model's embedding has only {} rows",
            config.vocab_size
        )));
    }
    Ok(())
}

fn default_template(tokenizer: &Tokenizer) -> Option<ChatTemplate> {
    tokenizer
        .token_id("<|im_start|>")
        .map(|_| ChatTemplate::new(CHATML_TEMPLATE))
}

fn hf_chat_template(dir: &Path) -> Result<Option<ChatTemplate>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        let text = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
        return Ok(Some(ChatTemplate::new(text)));
    }
    let cfg_path = dir.join("tokenizer_config.json");
    if !cfg_path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let cfg: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", cfg_path.display())))?;
    Ok(match cfg.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(ChatTemplate::new(s.clone())),
        // A list of named templates: take "default".
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template").and_then(|s| s.as_str()))
            .map(ChatTemplate::new),
        _ => None,
    })
}

/// A conversation through `template` (a model's chat template), ready for the assistant's turn; without a
/// template, the messages' contents joined by newlines. What [`LoadedModel::format_chat`] does, for callers that
/// hold the template and tokenizer without the model (the server's HTTP side).
pub fn format_chat(
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    messages: &[crate::chat::ChatMessage],
) -> Result<String> {
    format_chat_with_tools(template, tokenizer, messages, None)
}

/// As `format_chat`, with tool definitions (OpenAI's `tools` list) for a template that reads them.
pub fn format_chat_with_tools(
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    messages: &[crate::chat::ChatMessage],
    tools: Option<&serde_json::Value>,
) -> Result<String> {
    let Some(template) = template else {
        return Ok(messages
            .iter()
            .map(|m| m.content.as_str())
            .collect::<Vec<_>>()
            .join("\n"));
    };
    let text_of = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
    template.render_with_tools(
        messages,
        tools,
        true,
        &text_of(tokenizer.bos_token),
        &text_of(tokenizer.eos_token),
    )
}

impl LoadedModel {
    /// The prompt as the model should see it: chat-templated (default for models with a template) or raw.
    pub fn format_prompt(
        &self,
        user_prompt: &str,
        raw: bool,
        system: Option<&str>,
    ) -> Result<String> {
        if raw || self.chat_template.is_none() {
            return Ok(user_prompt.to_string());
        }
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(crate::chat::ChatMessage::system(s));
        }
        messages.push(crate::chat::ChatMessage::user(user_prompt));
        self.format_chat(&messages)
    }

    /// A conversation through the chat template, ready for the assistant's turn (without a template, the
    /// messages' contents joined by newlines).
    pub fn format_chat(&self, messages: &[crate::chat::ChatMessage]) -> Result<String> {
        format_chat(self.chat_template.as_ref(), &self.tokenizer, messages)
    }

    /// SHA-256 of the weights file (registry models: the checked value; otherwise hashed now).
    pub fn sha256(&self) -> Result<String> {
        if let Some(s) = &self.known_sha256 {
            return Ok(s.clone());
        }
        if self.path.is_file() {
            return registry::sha256_file(&self.path);
        }
        Ok(String::new())
    }
}
