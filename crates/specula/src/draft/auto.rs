//! `--speculate`: the drafter that wins for a target without tuning, from what has been measured (docs/eagle3.md,
//! "Defaults that win"; docs/benchmarks.md has each measurement). In order of preference:
//! 1. the target's registry EAGLE-3 head, when it has been built here and measured faster than the alternatives
//!    on this kind of device (on a GPU the head runs there too, with its own measured settings);
//! 2. the target's registry draft model, when downloaded, with the settings measured best on this kind of device
//!    (on a GPU a 24-layer 0.5B step costs ~0.55 of a 1.5B step at batch 1, so it wins only with a narrowed draft
//!    vocabulary and no confidence bar: 1.17x on an H200, against prompt lookup's 1.05x at its CPU bar);
//! 3. prompt lookup, which costs nothing and stops by itself when its matches get unreliable (on a GPU by its
//!    cost-aware rule at k = 4: with no bar it gave 1.11-1.12x on an H100, session 44).
//!
//! Each drafter also sizes its drafts as it runs (the draft model's confidence bar, prompt lookup's stopping rule),
//! so the draft length here is the most it may propose.

use crate::registry;

/// A target's registry draft model and the settings measured best with it on this project's 2-core CPU.
pub struct DraftPartner {
    pub target: &'static str,
    pub draft: &'static str,
    /// `--draft-vocab`: the draft proposes only ids below this (a cheaper LM head).
    pub draft_vocab: Option<usize>,
    pub draft_tokens: usize,
    /// The settings measured best on a GPU, where the pair beats prompt lookup there; None where it does not.
    pub on_gpu: Option<GpuDraftSettings>,
}

/// A draft model's settings measured best on a GPU.
pub struct GpuDraftSettings {
    pub draft_vocab: Option<usize>,
    pub draft_tokens: usize,
    /// `--draft-confidence`: on a GPU verifying a few more rows costs almost nothing, so stopping a draft early
    /// saves only draft passes and loses the tokens they would have kept.
    pub min_confidence: f64,
}

/// Measured: qwen2.5-coder-1.5b with the 0.5B at `--draft-vocab 65536`, k = 3: 1.21-1.28x plain on unseen code
/// prompts on the CPU (docs/benchmarks.md, "The draft model stops where it is unsure"); on an H200 (session 26)
/// `--draft-vocab 65536 --draft-confidence 0` at k = 2 / 3: 1.17x / 1.17x (the CPU's settings there: 1.09x;
/// prompt lookup 1.05x).
pub static DRAFT_PARTNERS: &[DraftPartner] = &[DraftPartner {
    target: "qwen2.5-coder-1.5b",
    draft: "qwen2.5-coder-0.5b",
    draft_vocab: Some(65536),
    draft_tokens: 3,
    on_gpu: Some(GpuDraftSettings {
        draft_vocab: Some(65536),
        draft_tokens: 3,
        min_confidence: 0.0,
    }),
}];

/// What `--speculate` chose, as the explicit flags that choose it.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoDrafter {
    /// `--draft`: "eagle3", "model" or "ngram".
    pub method: &'static str,
    /// `--draft-model`: the head or draft model.
    pub draft_model: Option<String>,
    pub draft_vocab: Option<usize>,
    pub draft_tokens: usize,
    /// `--draft-confidence`, when the pick measured best with a value other than the drafter's default.
    pub min_confidence: Option<f64>,
    /// Why, for the user.
    pub reason: String,
}

/// Draft tokens prompt lookup proposes at most (it stops earlier by itself).
pub const NGRAM_DRAFT_TOKENS: usize = 8;

/// The same on a GPU, where it drafts nearly every candidate (its cost-aware rule, see
/// `ngram::GPU_PRIOR_MARGINAL`): on an H100 with the real Qwen 1.5B, drafting every candidate gave 1.11-1.12x plain
/// at k = 3-4 but 1.03x at k = 8, whose 9-row verify costs 1.24 steps against 1.05-1.09 for 2-8 rows
/// (docs/benchmarks.md, session 44).
pub const NGRAM_DRAFT_TOKENS_GPU: usize = 4;

/// The drafter `--speculate` uses for the target `target_spec` (a registry name, path, ...) on a GPU or not.
/// `draft_cached` says whether a registry model is in the cache (a draft model is never downloaded silently),
/// `built_head` where a registry head is built (`RegistryHead::built`).
pub fn choose(
    target_spec: &str,
    on_gpu: bool,
    draft_cached: &dyn Fn(&str) -> bool,
    built_head: &dyn Fn(&registry::RegistryHead) -> Option<std::path::PathBuf>,
) -> AutoDrafter {
    let head = registry::HEADS.iter().find(|h| h.target == target_spec);
    let built = head.and_then(built_head);
    // A head built by another recipe than the one measured to win records a lower accuracy: say so.
    let below_winning_build = head
        .zip(built.as_deref())
        .and_then(|(h, dir)| recorded_below_winning_build(h, dir));
    if let Some(h) = head {
        let settings = match (on_gpu, &h.on_gpu) {
            (false, _) if h.wins_on_cpu => Some((h.draft_tokens, None)),
            (true, Some(g)) => Some((g.draft_tokens, Some(g.min_confidence))),
            _ => None,
        };
        if let (Some((draft_tokens, min_confidence)), Some(dir), None) =
            (settings, &built, &below_winning_build)
        {
            return AutoDrafter {
                method: "eagle3",
                draft_model: Some(dir.display().to_string()),
                draft_vocab: None,
                draft_tokens,
                min_confidence,
                reason: format!(
                    "the registry EAGLE-3 head {} (built) at k = {draft_tokens}{}",
                    h.name,
                    if on_gpu {
                        ", measured best on a GPU"
                    } else {
                        ""
                    }
                ),
            };
        }
    }
    let mut notes = Vec::new();
    if let Some(h) = head {
        notes.push(if let Some(note) = below_winning_build {
            note
        } else if !on_gpu && !h.wins_on_cpu {
            format!(
                "its EAGLE-3 head {} does not beat prompt lookup yet (measured)",
                h.name
            )
        } else if on_gpu && h.on_gpu.is_none() {
            format!(
                "its EAGLE-3 head {} has not been measured to win on a GPU",
                h.name
            )
        } else {
            format!(
                "its EAGLE-3 head {} is not built (`{}`)",
                h.name, h.build_command
            )
        });
    }
    if let Some(p) = DRAFT_PARTNERS.iter().find(|p| p.target == target_spec) {
        let settings = match (on_gpu, &p.on_gpu) {
            (false, _) => Some((p.draft_vocab, p.draft_tokens, None)),
            (true, Some(g)) => Some((g.draft_vocab, g.draft_tokens, Some(g.min_confidence))),
            (true, None) => None,
        };
        if settings.is_none() {
            notes.push(format!(
                "its draft model {} loses on a GPU at batch 1 (each of its steps costs nearly a target step)",
                p.draft
            ));
        } else if let (Some((draft_vocab, draft_tokens, min_confidence)), true) =
            (settings, draft_cached(p.draft))
        {
            return AutoDrafter {
                method: "model",
                draft_model: Some(p.draft.to_string()),
                draft_vocab,
                draft_tokens,
                min_confidence,
                reason: format!(
                    "the draft model {}{}{} at k = {} (measured best on {}){}",
                    p.draft,
                    draft_vocab
                        .map(|v| format!(" with --draft-vocab {v}"))
                        .unwrap_or_default(),
                    min_confidence
                        .map(|c| format!(" --draft-confidence {c}"))
                        .unwrap_or_default(),
                    draft_tokens,
                    if on_gpu { "a GPU" } else { "the CPU" },
                    if notes.is_empty() {
                        String::new()
                    } else {
                        format!("; {}", notes.join("; "))
                    }
                ),
            };
        } else {
            notes.push(format!(
                "its draft model {} is not downloaded (specula fetch {})",
                p.draft, p.draft
            ));
        }
    }
    AutoDrafter {
        method: "ngram",
        draft_model: None,
        draft_vocab: None,
        draft_tokens: if on_gpu {
            NGRAM_DRAFT_TOKENS_GPU
        } else {
            NGRAM_DRAFT_TOKENS
        },
        min_confidence: None,
        reason: format!(
            "prompt lookup (free to draft){}",
            if notes.is_empty() {
                String::new()
            } else {
                format!(": {}", notes.join("; "))
            }
        ),
    }
}

/// Why a built head is not the build measured to win, if it is not: its config.json records less held-out
/// first-token accuracy than the registry's `min_recorded_accuracy` (or none).
fn recorded_below_winning_build(
    h: &registry::RegistryHead,
    dir: &std::path::Path,
) -> Option<String> {
    let min = h.min_recorded_accuracy?;
    let recorded = registry::recorded_first_token_accuracy(dir);
    if recorded.is_some_and(|a| a >= min) {
        return None;
    }
    Some(format!(
        "its EAGLE-3 head in {} records {} held-out first-token accuracy, below the {:.0}% of the build measured \
         to win (another recipe: build that one with `{}`)",
        dir.display(),
        recorded.map_or("no".to_string(), |a| format!("{:.1}%", a * 100.0)),
        min * 100.0,
        h.build_command
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn prefers_a_built_head_then_a_cached_draft_model_on_the_cpu_then_prompt_lookup() {
        let none = |_: &registry::RegistryHead| None;
        // Qwen on the CPU with its draft model cached: the draft model, with the measured settings.
        let q = choose(
            "qwen2.5-coder-1.5b",
            false,
            &|n| n == "qwen2.5-coder-0.5b",
            &none,
        );
        assert_eq!(q.method, "model");
        assert_eq!(q.draft_model.as_deref(), Some("qwen2.5-coder-0.5b"));
        assert_eq!((q.draft_vocab, q.draft_tokens), (Some(65536), 3));
        // Not cached, or on a GPU: prompt lookup, saying why.
        let q = choose("qwen2.5-coder-1.5b", false, &|_| false, &none);
        assert_eq!(q.method, "ngram");
        assert!(
            q.reason.contains("specula fetch qwen2.5-coder-0.5b"),
            "{}",
            q.reason
        );
        // On a GPU the draft model wins with its GPU settings (a narrowed vocabulary, no confidence bar).
        let q = choose("qwen2.5-coder-1.5b", true, &|_| true, &none);
        assert_eq!(q.method, "model");
        assert_eq!((q.draft_vocab, q.draft_tokens), (Some(65536), 3));
        assert_eq!(q.min_confidence, Some(0.0));
        assert!(q.reason.contains("GPU"), "{}", q.reason);
        let q = choose("qwen2.5-coder-1.5b", true, &|_| false, &none);
        assert_eq!(q.method, "ngram");
        // SmolLM2's five-stage head beats prompt lookup on the CPU: picked when built by that recipe (its
        // config.json records the held-out accuracy that recipe reaches); a head of the same name from the CPU
        // recipe records less and is left alone, saying why; one recording nothing too.
        let dirs = tempfile::tempdir().unwrap();
        let head_recording = |accuracy: Option<f64>| {
            let dir = dirs.path().join(format!("{accuracy:?}"));
            std::fs::create_dir_all(&dir).unwrap();
            let training = accuracy.map_or(
                serde_json::json!({}),
                |a| serde_json::json!({"eval_accuracy_per_step": [a, a - 0.05]}),
            );
            std::fs::write(
                dir.join("config.json"),
                serde_json::json!({"specula_training": training}).to_string(),
            )
            .unwrap();
            dir
        };
        let (gpu_recipe, cpu_recipe, unrecorded) = (
            head_recording(Some(0.847)),
            head_recording(Some(0.41)),
            head_recording(None),
        );
        let s = choose("smollm2-135m", false, &|_| true, &|_| {
            Some(gpu_recipe.clone())
        });
        assert_eq!(s.method, "eagle3");
        assert_eq!(s.draft_model.as_deref(), gpu_recipe.to_str());
        assert_eq!((s.draft_tokens, s.min_confidence), (3, None));
        let s = choose("smollm2-135m", false, &|_| true, &|_| {
            Some(cpu_recipe.clone())
        });
        assert_eq!(s.method, "ngram");
        assert!(
            s.reason.contains("records 41.0% held-out first-token accuracy, below the 75%")
                && s.reason.contains("DEVICE=cuda SPECULA_BIN=dist/specula-train-cuda scripts/train-head.sh smollm2-135m-eagle3"),
            "{}",
            s.reason
        );
        let s = choose("smollm2-135m", false, &|_| true, &|_| {
            Some(unrecorded.clone())
        });
        assert_eq!(s.method, "ngram");
        assert!(s.reason.contains("records no held-out"), "{}", s.reason);
        let built = |h: &registry::RegistryHead| Some(PathBuf::from(format!("/heads/{}", h.name)));
        // Qwen's head measured faster than its draft model and prompt lookup on the CPU and on a GPU: picked when
        // built, with each device's measured settings.
        let q = choose("qwen2.5-coder-1.5b", false, &|_| true, &built);
        assert_eq!(q.method, "eagle3");
        assert_eq!(
            q.draft_model.as_deref(),
            Some("/heads/qwen2.5-coder-1.5b-eagle3")
        );
        assert_eq!((q.draft_tokens, q.min_confidence), (4, None));
        let q = choose("qwen2.5-coder-1.5b", true, &|_| true, &built);
        assert_eq!(q.method, "eagle3");
        assert_eq!((q.draft_tokens, q.min_confidence), (5, Some(0.0)));
        assert!(q.reason.contains("GPU"), "{}", q.reason);
        // SmolLM2's head has no GPU measurement: prompt lookup there, saying so.
        let s = choose("smollm2-135m", true, &|_| true, &|_| {
            Some(gpu_recipe.clone())
        });
        assert_eq!(s.method, "ngram");
        assert_eq!(s.draft_tokens, NGRAM_DRAFT_TOKENS_GPU);
        assert!(s.reason.contains("on a GPU"), "{}", s.reason);
        // Anything else: prompt lookup.
        assert_eq!(
            choose("/some/model.gguf", false, &|_| true, &built).method,
            "ngram"
        );
    }
}
