//! The JSON report of one `specula generate` run (schema in docs/profiling.md; other tools read these keys).

use serde_json::{json, Value};

use crate::decode::GenerateOutput;
use crate::model::LoadedModel;
use crate::profile::report::ProfileSummary;
use crate::sampling::SamplingParams;

pub struct RunInfo<'a> {
    pub prompt_token_ids: &'a [u32],
    pub model: &'a LoadedModel,
    pub model_sha256: String,
    pub threads: usize,
    pub sampling: SamplingParams,
    pub raw_prompt: bool,
    pub profile_detail: &'a str,
    pub clock: &'a str,
    pub load_s: f64,
    pub wall_s: f64,
    /// How drafts were made (`config.draft`): null for plain decoding, else an object with `method` and its
    /// settings (draft model and `draft_vocab`, or the n-gram lengths) and `draft_tokens`.
    pub draft: Value,
}

pub fn build(info: &RunInfo<'_>, out: &GenerateOutput, profile: &ProfileSummary) -> Value {
    let m = info.model;
    json!({
        "config": {
            "model": m.spec,
            "model_path": m.path.display().to_string(),
            "model_format": m.format,
            "model_sha256": info.model_sha256,
            "architecture": m.model.config().architecture,
            "weight_types": m.model.weight_types(),
            "device": m.model.device(),
            "threads": info.threads,
            "kernel_paths": crate::backend::cpu::kernels::active_kernel_paths(),
            "temperature": info.sampling.temperature,
            "top_k": info.sampling.top_k,
            "top_p": info.sampling.top_p,
            "min_p": info.sampling.min_p,
            "seed": info.sampling.seed,
            "raw_prompt": info.raw_prompt,
            "profile": info.profile_detail,
            "clock": info.clock,
            "specula_version": env!("CARGO_PKG_VERSION"),
            "git_rev": option_env!("SPECULA_GIT_REV").unwrap_or("unknown"),
            "draft": info.draft,
        },
        "prompt_tokens": out.prompt_tokens,
        "prompt_token_ids": info.prompt_token_ids,
        "generated_tokens": out.tokens.len(),
        "stop_reason": out.stop_reason,
        "token_ids": out.tokens,
        "text": out.text,
        "timing": {
            "load_s": info.load_s,
            "prefill_s": out.timing.prefill_s,
            "prefill_tok_s": if out.timing.prefill_s > 0.0 { out.prompt_tokens as f64 / out.timing.prefill_s } else { 0.0 },
            "decode_s": out.timing.decode_s,
            "decode_tokens": out.timing.decode_tokens,
            "decode_tok_s": out.timing.decode_tok_s(),
            "wall_s": info.wall_s,
        },
        "phases": profile.phases_json(),
        "fine": profile.fine,
        "speculation": out.speculation.as_ref().map(|s| s.to_json()).unwrap_or(Value::Null),
    })
}
