//! `hf:ORG/NAME` models from the Hugging Face Hub (needs network; never used by tests).

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Downloads (or finds in the HF cache) config.json, tokenizer files and safetensors shards; returns the snapshot dir.
#[cfg(feature = "hf")]
pub fn download(model_id: &str) -> Result<PathBuf> {
    let api = hf_hub::api::sync::Api::new().map_err(|e| Error::Hub(e.to_string()))?;
    let repo = api.model(model_id.to_string());
    let get = |f: &str| {
        repo.get(f)
            .map_err(|e| Error::Hub(format!("{model_id}: {f}: {e}")))
    };
    let config = get("config.json")?;
    get("tokenizer.json")?;
    for optional in ["tokenizer_config.json", "generation_config.json"] {
        let _ = repo.get(optional);
    }
    match repo.get("model.safetensors.index.json") {
        Ok(index_path) => {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let index: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Hub(format!("{model_id}: index: {e}")))?;
            let mut shards: Vec<String> = index
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| {
                    m.values()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            for s in shards {
                get(&s)?;
            }
        }
        Err(_) => {
            get("model.safetensors")?;
        }
    }
    config
        .parent()
        .map(|p| p.to_path_buf())
        .ok_or_else(|| Error::Hub(format!("{model_id}: unexpected cache layout")))
}

#[cfg(not(feature = "hf"))]
pub fn download(model_id: &str) -> Result<PathBuf> {
    Err(Error::Hub(format!(
        "cannot fetch hf:{model_id}: this build has no Hugging Face support (build with --features hf)"
    )))
}
