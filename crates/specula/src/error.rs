//! The library's error type. Every message names the thing that is wrong (file, tensor, flag) and what was expected.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // The cause is part of the message and deliberately not a `source`: front ends print the chain (`{:#}`),
    // which would repeat it ("...: no such file or directory: no such file or directory").
    #[error("cannot read {path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },

    #[error("{path} is not a valid GGUF file: {reason}")]
    BadGguf { path: PathBuf, reason: String },

    #[error("{path} is not a valid safetensors file: {reason}")]
    BadSafetensors { path: PathBuf, reason: String },

    #[error("tensor {tensor} in {path} has type {dtype}, which specula does not support (supported: {supported})")]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        dtype: String,
        supported: &'static str,
    },

    #[error("unsupported model architecture {0:?}: specula runs the Llama family (llama, qwen2; e.g. Llama 2/3, Qwen2/2.5, SmolLM2)")]
    UnsupportedArchitecture(String),

    #[error("model is missing tensor {name}{hint}")]
    MissingTensor { name: String, hint: String },

    #[error("{path}: tensor {tensor}: {reason}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },

    #[error("tensor {name} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },

    #[error("invalid model config: {0}")]
    Config(String),

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    ChatTemplate(String),

    #[error("the prompt is {prompt_tokens} tokens and {max_new_tokens} new tokens were requested, but the model's context is {context_length} tokens")]
    ContextOverflow {
        prompt_tokens: usize,
        max_new_tokens: usize,
        context_length: usize,
    },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("unknown model {name:?}; known short names: {known}")]
    UnknownModel { name: String, known: String },

    #[error("fetching model {name}: {reason}")]
    Fetch { name: String, reason: String },

    #[error("hugging face hub: {0}")]
    Hub(String),

    #[error("CUDA: {0}")]
    Cuda(String),

    // Not a `source` either, for the same reason as `Io`.
    #[error("tensor backend: {0}")]
    Candle(candle_core::Error),
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            cause: source,
        }
    }
}
