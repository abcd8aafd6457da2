//! specula: a speculative-decoding LLM inference engine that measures its own critical path.
//!
//! Data flows one way: front ends (CLI, server) -> [`decode`] -> model / drafters -> kernels. The
//! [`profile::Profiler`] is passed down explicitly and times every phase of every step.

pub mod backend;
pub mod bench;
pub mod chat;
pub mod decode;
pub mod draft;
pub mod error;
pub mod fuzz;
pub mod hub;
pub mod json_mode;
pub mod model;
pub mod parallel;
pub mod profile;
pub mod registry;
pub mod run_report;
pub mod sampling;
pub mod testing;
pub mod tokenizer;
pub mod verify;

pub use error::{Error, Result};

use std::path::PathBuf;

/// Resolves a `--model` value to local weights, fetching registry models and `hf:` models when `fetch` allows.
pub fn resolve_model(
    spec: &str,
    fetch: bool,
    log: &mut dyn FnMut(&str),
) -> Result<(PathBuf, Option<String>)> {
    match model::locate(spec)? {
        model::ModelLocation::File(p) | model::ModelLocation::Dir(p) => Ok((p, None)),
        model::ModelLocation::Hub(id) => Ok((hub::download(&id)?, None)),
        model::ModelLocation::Registry(m) => {
            let path = match fetch {
                true => registry::fetch(m, log)?,
                false => match registry::check_cached(m, log)? {
                    Some(p) => p,
                    None => {
                        return Err(Error::Fetch {
                            name: m.name.to_string(),
                            reason: format!(
                                "not in the cache ({}); run `specula fetch {}`",
                                m.cached_path().display(),
                                m.name
                            ),
                        })
                    }
                },
            };
            Ok((path, Some(m.sha256.to_string())))
        }
    }
}

/// Resolves and loads a model onto the CPU (see [`resolve_model`]).
pub fn load_model(
    spec: &str,
    fetch: bool,
    log: &mut dyn FnMut(&str),
) -> Result<model::LoadedModel> {
    load_model_on(spec, backend::Device::Cpu, fetch, log)
}

/// Resolves and loads a model onto `device`.
pub fn load_model_on(
    spec: &str,
    device: backend::Device,
    fetch: bool,
    log: &mut dyn FnMut(&str),
) -> Result<model::LoadedModel> {
    if let Some(shape) = spec.strip_prefix("random:") {
        // Random weights of a real shape (speed work, e.g. a draft for a random-weights target); seed 1, so a
        // draft of the target's own shape is not the target.
        return model::load_random(shape, device, 1);
    }
    let (path, sha) = resolve_model(spec, fetch, log)?;
    let mut loaded = model::load_path_on(&path, spec, device)?;
    loaded.known_sha256 = sha;
    Ok(loaded)
}
