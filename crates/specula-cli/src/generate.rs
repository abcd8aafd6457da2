//! `specula generate`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use specula::bench::run::DraftMethod;
use specula::decode::{self, GenerateRequest};
use specula::profile::{Detail, Profiler};
use specula::sampling::SamplingParams;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProfileLevel {
    Off,
    Phases,
    Fine,
}

impl ProfileLevel {
    pub fn detail(self) -> Detail {
        match self {
            ProfileLevel::Off => Detail::Off,
            ProfileLevel::Phases => Detail::Phases,
            ProfileLevel::Fine => Detail::Fine,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ProfileLevel::Off => "off",
            ProfileLevel::Phases => "phases",
            ProfileLevel::Fine => "fine",
        }
    }
}

#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// GGUF file, Hugging Face model directory, hf:ORG/NAME, or a registry short name (see `specula models`;
    /// fetched on first use).
    #[arg(
        long,
        short = 'm',
        visible_alias = "target",
        default_value = "smollm2-135m"
    )]
    pub model: String,
    /// Compute threads (default: the physical cores).
    #[arg(long, short = 't', allow_negative_numbers = true)]
    pub threads: Option<usize>,
    /// Where the model runs: cpu, cuda (the first GPU) or cuda:N. A draft model runs on the same device.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Instead of --model: seeded random bf16 weights of a real model's shape, made on the GPU (llama-3.1-8b,
    /// qwen2.5-1.5b, qwen2.5-0.5b, tiny), with a byte-level tokenizer. For speed work.
    #[arg(long, value_name = "SHAPE")]
    pub random_weights: Option<String>,
    /// A Jinja chat template to use instead of the model's own (vLLM's and llama.cpp's --chat-template): the
    /// file's text, as a GGUF's `tokenizer.chat_template` or tokenizer_config.json's `chat_template` holds it.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
}

impl ModelArgs {
    /// `--device`, parsed (checked before any model loads).
    pub fn device(&self) -> anyhow::Result<specula::backend::Device> {
        Ok(self.device.parse()?)
    }
}

#[derive(clap::Args, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub top_k: usize,
    /// Leave out tokens less likely than this share of the most likely one (0 = off; vLLM's and llama.cpp's
    /// min-p).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampling parameters, validated.
    pub fn params(&self) -> anyhow::Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        };
        p.validate()?;
        Ok(p)
    }
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, short = 'p')]
    pub prompt: Option<String>,
    /// Read the prompt from a file (`-`: standard input).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Feed the prompt as-is instead of applying the model's chat template.
    #[arg(long)]
    pub raw: bool,
    /// System message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum number of new tokens.
    #[arg(
        long,
        short = 'n',
        default_value_t = 128,
        allow_negative_numbers = true
    )]
    pub max_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Keep generating past end-of-turn tokens (fixed-length runs for benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop when this text appears in the output, which ends before it (repeat the flag for several; the
    /// server's `stop`). Text that could begin one is printed once it cannot.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// JSON mode: the output is one JSON object (the server's `response_format` `json_object`).
    #[arg(long, conflicts_with_all = ["json_schema", "regex", "choice"])]
    pub json_object: bool,
    /// The output is one JSON object matching the JSON Schema in FILE (the server's `response_format`
    /// `json_schema`; the subset docs/serving.md lists).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "choice"])]
    pub json_schema: Option<std::path::PathBuf>,
    /// The output matches this regex whole (Rust regex syntax; the server's `guided_regex` / `regex`).
    #[arg(long, value_name = "REGEX", conflicts_with = "choice")]
    pub regex: Option<String>,
    /// The output is exactly one of these texts (repeat the flag; the server's `guided_choice`).
    #[arg(long, value_name = "TEXT")]
    pub choice: Vec<String>,
    /// Profiling detail: off, phases (default), or fine (adds per-layer attention/MLP spans).
    #[arg(long, value_enum, default_value_t = ProfileLevel::Phases)]
    pub profile: ProfileLevel,
    /// Time phases by synchronizing the device at every phase edge (a cross-check of the default device clock,
    /// and a measure of what naive timing costs; no effect on the CPU).
    #[arg(long)]
    pub exact_timing: bool,
    /// Write the JSON report here.
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    /// Write a Chrome trace-event JSON here (open in ui.perfetto.dev).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Do not print the generated text (only the summary).
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// Which drafter: shared by generate, bench and tune.
#[derive(clap::Args, Clone)]
pub struct DrafterArgs {
    /// Speculative decoding with a separate draft model sharing the target's tokenizer (path, hf:ID, short name,
    /// or random:SHAPE for random weights of a --random-weights shape on the GPU).
    #[arg(long)]
    pub draft_model: Option<String>,
    /// Drafting method: `model` (needs --draft-model), `ngram` (prompt lookup, no model) or `eagle3` (an EAGLE-3
    /// head given by --draft-model HEAD_DIR, fed by the target's hidden states).
    #[arg(long)]
    pub draft: Option<String>,
    /// Shortest n-gram prompt lookup matches (single-token matches are kept only while the lookup is
    /// confident enough, see --ngram-confidence).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub ngram_min: usize,
    /// Longest n-gram prompt lookup tries first (at most 8).
    #[arg(long, default_value_t = 4, allow_negative_numbers = true)]
    pub ngram_max: usize,
    /// Prompt lookup drafts while the estimated chance that the whole draft is accepted stays at least this
    /// (0 = draft k tokens whenever a match exists; default 0.5). `auto` weighs that chance against what one
    /// more verified token has cost in this generation's own verify passes instead (see docs/benchmarks.md).
    /// bench takes a comma-separated list to compare.
    #[arg(
        long,
        value_name = "C|auto",
        value_delimiter = ',',
        allow_negative_numbers = true
    )]
    pub ngram_confidence: Vec<String>,
    /// Draft model only: propose only token ids below N, so the draft's LM head reads only its first N rows
    /// (cheaper draft steps for large vocabularies; lossless, the target verifies every token). `full` (the
    /// default) drafts from the whole vocabulary. bench takes a comma-separated list to compare. See
    /// docs/benchmarks.md for the measured trade-off.
    #[arg(
        long,
        value_name = "N|full",
        value_delimiter = ',',
        allow_negative_numbers = true
    )]
    pub draft_vocab: Vec<String>,
    /// Draft model and EAGLE-3 chains: stop drafting when the drafter's own estimate that the target accepts
    /// its whole draft (the product of its top-token probabilities) falls below C (default 0.6 for a draft
    /// model, EAGLE-3's measured default for a head; 0 always drafts --draft-tokens). EAGLE-3 trees: keep only
    /// nodes whose path probability under the head is at least C (default 0: fixed-size trees). Lossless for any
    /// C. bench takes a comma-separated list to compare; see docs/benchmarks.md for measurements.
    #[arg(
        long,
        value_name = "C",
        value_delimiter = ',',
        allow_negative_numbers = true
    )]
    pub draft_confidence: Vec<String>,
    /// Speed work: accept each draft token with probability P instead of verifying it (the verify pass still
    /// runs and is timed; the output is not the model's). Measures speedup against acceptance on random-weight
    /// models, as SGLang's SGLANG_SIMULATE_ACC_LEN does. Pair it with --draft-confidence 0 so a draft model
    /// always drafts --draft-tokens.
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    pub simulate_acceptance: Option<f64>,
    /// Speculate with the drafter that wins for this target without tuning: its registry EAGLE-3 head if built,
    /// else (on the CPU) its registry draft model if downloaded, with the settings measured best, else prompt
    /// lookup. Says which and why. Replaces --draft / --draft-model.
    #[arg(long)]
    pub speculate: bool,
    /// EAGLE-3 tree drafting (SGLang's --speculative-eagle-topk): branches kept per node (default 4 once any tree
    /// flag is given). Trees are verified in one pass with a tree mask, greedily or, when sampling, by lossless
    /// tree acceptance (each child tried with the target's probability of it; the output keeps the target's
    /// distribution). bench takes comma-separated lists of the three tree flags and runs every shape they
    /// combine to (beside chains at --draft-tokens when that is given too).
    #[arg(long, value_name = "K", value_delimiter = ',')]
    pub eagle_topk: Vec<usize>,
    /// EAGLE-3 tree drafting: levels (SGLang's --speculative-num-steps; default 5).
    #[arg(long, value_name = "N", value_delimiter = ',')]
    pub num_steps: Vec<usize>,
    /// EAGLE-3 tree drafting: tokens per verify pass, the pending one included (SGLang's
    /// --speculative-num-draft-tokens; default 8).
    #[arg(long, value_name = "N", value_delimiter = ',')]
    pub num_draft_tokens: Vec<usize>,
}

/// Parses a comma-separated flag's values; no values means the single `default`.
fn parse_values<T>(
    values: &[String],
    flag: &str,
    expected: &str,
    default: Option<T>,
    parse: impl Fn(&str) -> Option<Option<T>>,
) -> anyhow::Result<Vec<Option<T>>> {
    if values.is_empty() {
        return Ok(vec![default]);
    }
    values
        .iter()
        .map(|v| {
            parse(v.trim()).ok_or_else(|| anyhow::anyhow!("{flag} takes {expected}, got {v:?}"))
        })
        .collect()
}

/// The one value generate accepts for a flag that bench takes as a list.
fn single<T: Copy>(values: &[Option<T>], flag: &str) -> anyhow::Result<Option<T>> {
    match values {
        [v] => Ok(*v),
        _ => anyhow::bail!("{flag} takes one value here (lists are for bench and tune)"),
    }
}

#[derive(clap::Args, Clone)]
pub struct DraftArgs {
    #[command(flatten)]
    pub drafter: DrafterArgs,
    /// Most tokens the drafter proposes per cycle (k). Default: 3 for a draft model; 8 for prompt lookup,
    /// which stops earlier by itself when its matches get unreliable.
    #[arg(long, allow_negative_numbers = true)]
    pub draft_tokens: Option<usize>,
}

impl DraftArgs {
    /// `--draft-tokens`, or the default for the chosen method.
    pub fn draft_tokens(&self, choice: &DraftChoice) -> usize {
        self.draft_tokens.unwrap_or(match choice {
            DraftChoice::Ngram { .. } => 8,
            _ => 3,
        })
    }
}

/// The drafting method the flags ask for (for bench, the vocabulary and confidence lists stay in
/// [`DrafterArgs`]).
pub enum DraftChoice {
    None,
    Model(String),
    /// An EAGLE-3 head directory.
    Eagle3(String),
    Ngram {
        min_n: usize,
        max_n: usize,
        /// None: cost-aware stopping.
        min_confidence: Option<f64>,
    },
}

impl DrafterArgs {
    /// Turns `--speculate` into the explicit flags of the drafter it picks for `model`, then fills in the
    /// device's defaults for what was not given; returns the draft length to use where `--draft-tokens` is not
    /// given (what measured best with the pick, or the device's default). On a GPU prompt lookup stops by its
    /// cost-aware rule (`--ngram-confidence auto`, with the GPU's verify-cost prior) instead of the CPU's bar of
    /// 0.5, which left drafts that verify almost free undrafted (1.05x against 1.11x plain with no bar on the
    /// real 1.5B, H100), and proposes at most 4 tokens: a 9-row verify costs 1.24 steps against 1.05-1.09 for
    /// 2-8 rows (docs/benchmarks.md, session 44).
    pub fn resolve_defaults(&mut self, model: &ModelArgs) -> anyhow::Result<Option<usize>> {
        let mut k = self.resolve_speculate(model)?;
        let on_gpu = model.device()? != specula::backend::Device::Cpu;
        if on_gpu && self.draft.as_deref() == Some("ngram") {
            if self.ngram_confidence.is_empty() {
                self.ngram_confidence = vec!["auto".into()];
            }
            k = k.or(Some(specula::draft::auto::NGRAM_DRAFT_TOKENS_GPU));
        }
        Ok(k)
    }

    fn resolve_speculate(&mut self, model: &ModelArgs) -> anyhow::Result<Option<usize>> {
        if !self.speculate {
            return Ok(None);
        }
        if self.draft.is_some() || self.draft_model.is_some() {
            anyhow::bail!(
                "--speculate picks the drafter itself; drop --draft / --draft-model (or drop --speculate)"
            );
        }
        let on_gpu = model.device()? != specula::backend::Device::Cpu;
        let pick = specula::draft::auto::choose(
            &model.model,
            on_gpu,
            &|name| specula::registry::find(name).is_some_and(|m| m.cached_path().is_file()),
            &|h| h.built(),
        );
        eprintln!("--speculate: {}", pick.reason);
        self.draft = Some(pick.method.to_string());
        self.draft_model = pick.draft_model;
        if let Some(v) = pick.draft_vocab {
            if self.draft_vocab.is_empty() {
                self.draft_vocab = vec![v.to_string()];
            }
        }
        if let Some(c) = pick.min_confidence {
            if self.draft_confidence.is_empty() {
                self.draft_confidence = vec![c.to_string()];
            }
        }
        Ok(Some(pick.draft_tokens))
    }

    /// The drafting method `--draft` and `--draft-model` ask for.
    /// The ngram choice carries the first `--ngram-confidence` value.
    pub fn choice(&self) -> anyhow::Result<DraftChoice> {
        let confidences = self.ngram_confidences()?;
        let choice = parse_draft_choice(
            self.draft.as_deref(),
            &self.draft_model,
            self.ngram_min,
            self.ngram_max,
            confidences[0],
        )?;
        self.draft_vocabs()?;
        if !self.draft_vocab.is_empty() && !matches!(choice, DraftChoice::Model(_)) {
            anyhow::bail!("--draft-vocab applies to a draft model; add --draft-model PATH|NAME");
        }
        self.draft_confidences()?;
        if !self.draft_confidence.is_empty()
            && !matches!(choice, DraftChoice::Model(_) | DraftChoice::Eagle3(_))
        {
            anyhow::bail!(
                "--draft-confidence applies to a draft model or an EAGLE-3 head; add --draft-model PATH|NAME \
                 (prompt lookup has --ngram-confidence)"
            );
        }
        if !self.ngram_confidence.is_empty() && !matches!(choice, DraftChoice::Ngram { .. }) {
            anyhow::bail!("--ngram-confidence applies to prompt lookup; add --draft ngram");
        }
        self.eagle_trees()?;
        if self.has_tree_flags() && !matches!(choice, DraftChoice::Eagle3(_)) {
            anyhow::bail!(
                "--eagle-topk / --num-steps / --num-draft-tokens shape EAGLE-3 trees; add --draft eagle3 --draft-model HEAD_DIR"
            );
        }
        if let Some(p) = self.simulate_acceptance {
            specula::verify::check_simulated_acceptance(p)?;
            if matches!(choice, DraftChoice::None) {
                anyhow::bail!(
                    "--simulate-acceptance needs a drafter: add --draft-model PATH|NAME|random:SHAPE or --draft ngram"
                );
            }
        }
        Ok(choice)
    }

    /// Whether any tree flag was given (the EAGLE-3 drafter then drafts trees).
    pub fn has_tree_flags(&self) -> bool {
        !(self.eagle_topk.is_empty()
            && self.num_steps.is_empty()
            && self.num_draft_tokens.is_empty())
    }

    /// The one EAGLE-3 tree shape the tree flags ask for (None: chains), for generate and serve.
    pub fn eagle_tree(&self) -> anyhow::Result<Option<specula::draft::eagle3::TreeShape>> {
        for (values, flag) in [
            (&self.eagle_topk, "--eagle-topk"),
            (&self.num_steps, "--num-steps"),
            (&self.num_draft_tokens, "--num-draft-tokens"),
        ] {
            if values.len() > 1 {
                anyhow::bail!("{flag} takes one value here (lists are for bench)");
            }
        }
        Ok(self.eagle_trees()?.shapes.into_iter().next())
    }

    /// Every EAGLE-3 tree shape the tree flags combine to (bench: each list's values against the others'),
    /// in the order given; combinations no tree of that shape can fill (more nodes than `--num-steps` levels of
    /// top-`--eagle-topk` propose) are left out and named. Empty without tree flags; an error when every
    /// combination is impossible or a value is out of range.
    pub fn eagle_trees(&self) -> anyhow::Result<TreeShapes> {
        let mut out = TreeShapes::default();
        if !self.has_tree_flags() {
            return Ok(out);
        }
        let or_default = |values: &[usize], default: usize| {
            if values.is_empty() {
                vec![default]
            } else {
                values.to_vec()
            }
        };
        let topks = or_default(&self.eagle_topk, 4);
        let steps = or_default(&self.num_steps, 5);
        let nodes = or_default(&self.num_draft_tokens, 8);
        for &n in &nodes {
            if n < 2 {
                anyhow::bail!(
                    "--num-draft-tokens must be at least 2 (the pending token and one draft), got {n}"
                );
            }
        }
        let mut impossible = Vec::new();
        for &topk in &topks {
            for &step in &steps {
                for &n in &nodes {
                    let shape = match specula::draft::eagle3::TreeShape::new(topk, step, n - 1) {
                        Ok(shape) => shape,
                        Err(specula::Error::InvalidArgument(why)) => {
                            impossible.push(why);
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    };
                    if !out.shapes.contains(&shape) {
                        out.shapes.push(shape);
                    }
                }
            }
        }
        if out.shapes.is_empty() {
            anyhow::bail!(
                "no EAGLE-3 tree shape is possible: {}",
                impossible.join("; ")
            );
        }
        out.skipped = impossible;
        Ok(out)
    }

    /// generate's drafter: like [`Self::choice`], refusing lists.
    pub fn single_choice(&self) -> anyhow::Result<DraftChoice> {
        let choice = self.choice()?;
        single(&self.draft_vocabs()?, "--draft-vocab")?;
        single(&self.ngram_confidences()?, "--ngram-confidence")?;
        single(&self.draft_confidences()?, "--draft-confidence")?;
        Ok(choice)
    }

    /// `--draft-vocab` values: None is the full vocabulary.
    pub fn draft_vocabs(&self) -> anyhow::Result<Vec<Option<usize>>> {
        parse_values(
            &self.draft_vocab,
            "--draft-vocab",
            "token counts or `full`",
            None,
            |s| match s {
                "full" => Some(None),
                _ => s.parse().ok().map(Some),
            },
        )
    }

    /// `--draft-confidence` values (default [`specula::draft::model::DEFAULT_MIN_CONFIDENCE`]).
    pub fn draft_confidences(&self) -> anyhow::Result<Vec<Option<f64>>> {
        let values = parse_values(
            &self.draft_confidence,
            "--draft-confidence",
            "numbers between 0 and 1",
            Some(specula::draft::model::DEFAULT_MIN_CONFIDENCE),
            |s| s.parse().ok().map(Some),
        )?;
        for c in values.iter().flatten() {
            specula::draft::model::check_min_confidence(*c)?;
        }
        Ok(values)
    }

    /// `--draft-confidence` values for an EAGLE-3 head's chains (default
    /// [`specula::draft::eagle3::DEFAULT_MIN_CONFIDENCE`]) or trees (the least path probability a node keeps;
    /// default 0, SGLang's fixed-size trees).
    pub fn eagle3_confidences(&self, tree: bool) -> anyhow::Result<Vec<f64>> {
        if self.draft_confidence.is_empty() {
            return Ok(vec![if tree {
                0.0
            } else {
                specula::draft::eagle3::DEFAULT_MIN_CONFIDENCE
            }]);
        }
        Ok(self
            .draft_confidences()?
            .into_iter()
            .map(|c| c.unwrap_or(specula::draft::eagle3::DEFAULT_MIN_CONFIDENCE))
            .collect())
    }

    /// `--ngram-confidence` values: None is cost-aware stopping (`auto`).
    pub fn ngram_confidences(&self) -> anyhow::Result<Vec<Option<f64>>> {
        parse_values(
            &self.ngram_confidence,
            "--ngram-confidence",
            "numbers between 0 and 1 or `auto`",
            Some(specula::draft::ngram::DEFAULT_MIN_CONFIDENCE),
            |s| match s {
                "auto" => Some(None),
                _ => s.parse().ok().map(Some),
            },
        )
    }
}

/// The EAGLE-3 tree shapes of the tree flags ([`DrafterArgs::eagle_trees`]).
#[derive(Debug, Default)]
pub struct TreeShapes {
    pub shapes: Vec<specula::draft::eagle3::TreeShape>,
    /// Why each impossible combination of the flags' values was left out.
    pub skipped: Vec<String>,
}

/// `--draft` and `--draft-model` together (shared by generate, bench and tune).
fn parse_draft_choice(
    draft: Option<&str>,
    draft_model: &Option<String>,
    ngram_min: usize,
    ngram_max: usize,
    min_confidence: Option<f64>,
) -> anyhow::Result<DraftChoice> {
    match (draft, draft_model) {
        (None, None) => Ok(DraftChoice::None),
        (Some("ngram"), Some(_)) => {
            anyhow::bail!("--draft ngram needs no model; drop --draft-model (or use --draft model)")
        }
        (Some("ngram"), None) => Ok(DraftChoice::Ngram {
            min_n: ngram_min,
            max_n: ngram_max,
            min_confidence,
        }),
        (Some("model") | None, Some(m)) => Ok(DraftChoice::Model(m.clone())),
        (Some("model"), None) => anyhow::bail!("--draft model needs --draft-model PATH|NAME"),
        (Some("eagle3"), Some(m)) => Ok(DraftChoice::Eagle3(m.clone())),
        (Some("eagle3"), None) => anyhow::bail!(
            "--draft eagle3 needs --draft-model HEAD_DIR (an EAGLE-3 head: config.json and *.safetensors)"
        ),
        (Some(other), _) => {
            anyhow::bail!("unknown --draft method {other:?} (use model, ngram or eagle3)")
        }
    }
}

/// How a head's matrices are held (`SPECULA_EAGLE3_WEIGHTS`): requantized to Q4_K by default, on the CPU (cheaper
/// steps, same acceptance: Q8_0 until session 38) and beside a GPU target, where q4_k, q6_k and q8_0 stay quantized
/// on the device (the GEMV's native formats: fewer bytes a draft step; the real 1.5B head at Q4_K decoded
/// 1.8-3.6% faster than as stored on an H100, session 56). `stored` keeps the checkpoint's precision.
pub fn eagle3_precision() -> anyhow::Result<specula::draft::eagle3::HeadPrecision> {
    use specula::draft::eagle3::HeadPrecision;
    Ok(match std::env::var("SPECULA_EAGLE3_WEIGHTS").as_deref() {
        Ok("stored") => HeadPrecision::Stored,
        Ok("q8_0") => HeadPrecision::Q8_0,
        Ok("q6_k") => HeadPrecision::Q6K,
        Ok("q4_k") | Err(_) => HeadPrecision::Q4K,
        Ok(other) => anyhow::bail!(
            "SPECULA_EAGLE3_WEIGHTS={other:?}: use q4_k (the default), q6_k, q8_0 or stored"
        ),
    })
}

/// Loads an EAGLE-3 head directory and checks it against the target (widths, vocabulary, layer ids).
pub fn load_eagle3(
    dir: &str,
    target: &specula::model::LoadedModel,
) -> anyhow::Result<specula::draft::eagle3::Eagle3Head> {
    let path = specula::registry::locate_head(dir)?;
    // A head runs where its target runs (SPECULA_EAGLE3_DEVICE=cpu keeps it on the CPU beside a GPU target, to
    // compare), its matrices held as `eagle3_precision` says.
    let on_device = target.model.device() != "cpu"
        && match std::env::var("SPECULA_EAGLE3_DEVICE").as_deref() {
            Ok("cpu") => false,
            Ok("target") | Err(_) => true,
            Ok(other) => {
                anyhow::bail!("SPECULA_EAGLE3_DEVICE={other:?}: use target (default) or cpu")
            }
        };
    let precision = eagle3_precision()?;
    let mut head = specula::draft::eagle3::Eagle3Head::load_as(&path, precision)
        .with_context(|| format!("loading EAGLE-3 head {dir}"))?;
    head.check_target(target.model.config())?;
    let types: Vec<&str> = head.weight_types().iter().map(|t| t.name()).collect();
    let runs_on = if on_device {
        let device = head
            .place_on(target.model.as_ref())
            .with_context(|| format!("placing EAGLE-3 head {dir} on {}", target.model.device()))?;
        match head.compute().held_as() {
            Some(held) => format!("{device} as {} (held there as {held})", types.join("/")),
            None => format!("{device} as {}", types.join("/")),
        }
    } else {
        format!("cpu as {}", types.join("/"))
    };
    let layers = head
        .config
        .target_layers(target.model.config().num_layers)?;
    eprintln!(
        "eagle3 head {dir}: draft vocabulary {}, runs on {runs_on}, reads target layers {layers:?} ({})",
        head.draft_vocab(),
        if head.config.aux_layers.is_some() {
            "from its config"
        } else {
            "the default [1, n/2 - 1, n - 4]"
        }
    );
    Ok(head)
}

/// Applies `--threads` and loads the model, reporting load time.
pub fn load(args: &ModelArgs) -> anyhow::Result<(specula::model::LoadedModel, usize, f64)> {
    if let Some(t) = args.threads {
        specula::parallel::set_threads(t).map_err(|e| anyhow::anyhow!(e))?;
    }
    let threads = specula::parallel::threads();
    let device = args.device()?;
    // The template is read and tried on a one-message conversation before the model loads (seconds).
    let chat_template = match &args.chat_template {
        Some(path) => {
            let source = std::fs::read_to_string(path)
                .with_context(|| format!("reading --chat-template {}", path.display()))?;
            let template = specula::chat::ChatTemplate::new(source);
            template
                .render(&[specula::chat::ChatMessage::user("hi")], true, "", "")
                .with_context(|| format!("the chat template in {}", path.display()))?;
            Some(template)
        }
        None => None,
    };
    let t0 = Instant::now();
    let mut loaded = match &args.random_weights {
        Some(shape) => specula::model::load_random(shape, device, 0)
            .with_context(|| format!("making random weights of shape {shape}"))?,
        None => specula::load_model_on(&args.model, device, true, &mut |line| eprintln!("{line}"))
            .with_context(|| format!("loading model {}", args.model))?,
    };
    if chat_template.is_some() {
        loaded.chat_template = chat_template;
    }
    Ok((loaded, threads, t0.elapsed().as_secs_f64()))
}

pub fn run(mut args: GenerateArgs) -> anyhow::Result<()> {
    let wall = Instant::now();
    if let Some(k) = args.draft.drafter.resolve_defaults(&args.model)? {
        args.draft.draft_tokens.get_or_insert(k);
    }
    let prompt = crate::read_prompt(&args.prompt, &args.prompt_file)?;
    let sampling = args.sampling.params()?;
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    if args.trace.is_some() && args.profile == ProfileLevel::Off {
        anyhow::bail!("--trace needs profiling on (--profile phases or fine)");
    }
    // Every flag is checked before a model is loaded (loading takes seconds).
    args.model.device()?;
    let choice = args.draft.drafter.single_choice()?;
    let draft_vocab = single(&args.draft.drafter.draft_vocabs()?, "--draft-vocab")?;
    let draft_confidence = single(
        &args.draft.drafter.draft_confidences()?,
        "--draft-confidence",
    )?
    .unwrap_or(0.0);
    let eagle3_confidence = match args
        .draft
        .drafter
        .eagle3_confidences(args.draft.drafter.has_tree_flags())?
        .as_slice()
    {
        [c] => *c,
        _ => {
            anyhow::bail!("--draft-confidence takes one value here (lists are for bench and tune)")
        }
    };
    if matches!(choice, DraftChoice::None) && args.draft.draft_tokens.is_some() {
        anyhow::bail!(
            "--draft-tokens needs a drafter: add --draft-model PATH|NAME or --draft ngram"
        );
    }
    let tree = args.draft.drafter.eagle_tree()?;
    if tree.is_some() && args.draft.draft_tokens.is_some() {
        anyhow::bail!("--draft-tokens and the tree flags both size the draft: give --num-draft-tokens for a tree");
    }
    let draft_tokens = match tree {
        Some(shape) => shape.draft_tokens,
        None => args.draft.draft_tokens(&choice),
    };
    if !matches!(choice, DraftChoice::None) {
        specula::decode::check_draft_tokens(draft_tokens)?;
    }
    let (loaded, threads, load_s) = load(&args.model)?;
    let text = loaded.format_prompt(&prompt, args.raw, args.system.as_deref())?;
    let prompt_tokens = loaded.tokenizer.encode(&text)?;
    note_context_cap(loaded.model.as_ref(), prompt_tokens.len(), args.max_tokens);
    let json_grammar = match (&args.json_schema, args.json_object) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the JSON schema {}", path.display()))?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            Some(
                specula::json_mode::JsonGrammar::from_schema(&schema)
                    .with_context(|| format!("the JSON schema in {}", path.display()))?,
            )
        }
        (None, true) => Some(specula::json_mode::JsonGrammar::any_object()),
        (None, false) => match (&args.regex, args.choice.is_empty()) {
            (Some(regex), _) => Some(specula::json_mode::JsonGrammar::from_regex(regex)?),
            (None, false) => Some(specula::json_mode::JsonGrammar::from_choices(&args.choice)?),
            (None, true) => None,
        },
    };
    let mut stop_text = decode::stop_text::StopText::new(args.stop.clone())?;
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let req = GenerateRequest {
        prompt_tokens,
        max_new_tokens: args.max_tokens,
        sampling,
        stop_at_eos: !args.ignore_eos,
        cancel: (!args.stop.is_empty()).then(|| cancel.clone()),
        logprobs: None,
        logit_adjustments: json_grammar.map(|grammar| specula::sampling::LogitAdjustments {
            json: Some(specula::json_mode::JsonConstraint::new(
                grammar,
                specula::json_mode::JsonVocabulary::new(&loaded.tokenizer),
            )),
            ..Default::default()
        }),
        stop_token_ids: Vec::new(),
    };
    let prof = Profiler::with_clock(args.profile.detail(), loaded.model.clock(args.exact_timing));
    let eagle3_head = match &choice {
        DraftChoice::Eagle3(dir) => Some(load_eagle3(dir, &loaded)?),
        _ => None,
    };
    let draft_loaded = match &choice {
        DraftChoice::Model(spec) => {
            let d = specula::load_model_on(spec, args.model.device()?, true, &mut |line| {
                eprintln!("{line}")
            })
            .with_context(|| format!("loading draft model {spec}"))?;
            specula::draft::model::check_compatible(&loaded, &d)?;
            Some(d)
        }
        _ => None,
    };
    let mut drafter: Option<Box<dyn specula::draft::Drafter + '_>> = match &choice {
        DraftChoice::None => None,
        DraftChoice::Model(_) => match draft_loaded.as_ref() {
            Some(d) => Some(Box::new(
                specula::draft::model::ModelDrafter::new(d.model.as_ref(), sampling.seed)?
                    .with_vocab_limit(draft_vocab)?
                    .with_min_confidence(draft_confidence)?,
            ) as Box<dyn specula::draft::Drafter>),
            None => None,
        },
        DraftChoice::Ngram {
            min_n,
            max_n,
            min_confidence,
        } => Some(Box::new(specula::draft::ngram::NgramDrafter::for_device(
            *min_n,
            *max_n,
            *min_confidence,
            &loaded.model.device(),
        )?)),
        DraftChoice::Eagle3(_) => match eagle3_head.as_ref() {
            Some(head) => {
                let d = specula::draft::eagle3::Eagle3Drafter::new(
                    head,
                    loaded.model.as_ref(),
                    sampling.seed,
                )?;
                let d = d.with_min_confidence(eagle3_confidence)?;
                Some(Box::new(match tree {
                    Some(shape) => d.with_tree(shape),
                    None => d,
                }) as Box<dyn specula::draft::Drafter>)
            }
            None => None,
        },
    };
    let simulate_acceptance = args.draft.drafter.simulate_acceptance;
    if let Some(p) = simulate_acceptance {
        eprintln!(
            "note: --simulate-acceptance {p}: each draft token is accepted with probability {p} instead of \
             being verified; the speed is real, the text is not the model's"
        );
    }
    let speculation = drafter.as_mut().map(|d| decode::Speculation {
        drafter: d.as_mut(),
        draft_tokens,
        simulate_acceptance,
    });
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let quiet = args.quiet;
    let mut write = |text: &str| {
        // A token whose character is not whole yet comes with no text: nothing to write or flush.
        if !quiet && !text.is_empty() {
            let _ = out.write_all(text.as_bytes());
            let _ = out.flush();
        }
    };
    let mut output = decode::generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        &req,
        speculation,
        &prof,
        &mut |piece| {
            write(stop_text.push(piece));
            if stop_text.stopped() {
                cancel.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        },
    )?;
    write(stop_text.finish());
    if stop_text.stopped() {
        // The tokens stay what was generated (the last step's may run past the stop); the text is the answer.
        output.stop_reason = decode::StopReason::StopSequence;
        output.text = stop_text.text().to_string();
    }
    if !quiet {
        let _ = writeln!(out);
    }
    drop(out);
    let summary = prof.summary();
    let wall_s = wall.elapsed().as_secs_f64();

    let c = loaded.model.config();
    eprintln!();
    eprintln!(
        "model {} ({}, {} layers, {}; {:.0} MB of weights per step), {} threads",
        loaded.spec,
        c.architecture,
        c.num_layers,
        loaded.model.weight_types(),
        loaded.model.weight_bytes() as f64 / 1e6,
        threads
    );
    eprintln!(
        "prompt {} tokens, generated {} ({:?}); load {:.2}s, prefill {:.1} ms ({:.1} tok/s), decode {:.2}s ({:.2} tok/s)",
        output.prompt_tokens,
        output.tokens.len(),
        output.stop_reason,
        load_s,
        output.timing.prefill_s * 1e3,
        output.prompt_tokens as f64 / output.timing.prefill_s.max(1e-9),
        output.timing.decode_s,
        output.timing.decode_tok_s()
    );
    if prof.enabled() {
        eprintln!("profile ({} clock):", prof.clock_name());
        eprint!("{}", summary.table());
    }
    if let Some(stats) = &output.speculation {
        eprint!("{}", stats.table());
        if let Some(w) = eagle3_head
            .as_ref()
            .and_then(|h| specula::draft::eagle3::check::acceptance_warning(h, stats))
        {
            eprintln!("warning: {w}");
        }
    }
    if let Some(path) = &args.report_json {
        let info = specula::run_report::RunInfo {
            model: &loaded,
            prompt_token_ids: &req.prompt_tokens,
            model_sha256: loaded.sha256()?,
            threads,
            sampling,
            raw_prompt: args.raw,
            profile_detail: args.profile.name(),
            clock: prof.clock_name(),
            load_s,
            wall_s,
            // The same settings object as a bench config's `drafter`, plus the draft length (and model).
            draft: match &choice {
                DraftChoice::None => serde_json::Value::Null,
                DraftChoice::Model(spec) => {
                    let mut d = DraftMethod::Model {
                        vocab_limit: draft_vocab,
                        min_confidence: draft_confidence,
                    }
                    .settings_json();
                    d["draft_model"] = draft_loaded
                        .as_ref()
                        .map_or_else(|| spec.clone(), |d| d.spec.clone())
                        .into();
                    d["draft_tokens"] = draft_tokens.into();
                    d
                }
                DraftChoice::Ngram {
                    min_n,
                    max_n,
                    min_confidence,
                } => {
                    let mut d = DraftMethod::Ngram {
                        min_n: *min_n,
                        max_n: *max_n,
                        min_confidence: *min_confidence,
                    }
                    .settings_json();
                    d["draft_tokens"] = draft_tokens.into();
                    d
                }
                DraftChoice::Eagle3(dir) => {
                    let mut d = DraftMethod::Eagle3 {
                        head: 0,
                        tree,
                        min_confidence: eagle3_confidence,
                    }
                    .settings_json();
                    d["draft_model"] = dir.clone().into();
                    d["draft_tokens"] = draft_tokens.into();
                    if let Some(h) = eagle3_head.as_ref() {
                        d["target_layers"] = serde_json::json!(h
                            .config
                            .target_layers(loaded.model.config().num_layers)?);
                    }
                    d
                }
            },
        };
        let report = specula::run_report::build(&info, &output, &summary);
        write_json(path, &report)?;
        eprintln!("report: {}", path.display());
    }
    if let Some(path) = &args.trace {
        write_json(path, &prof.chrome_trace())?;
        eprintln!("trace: {} (open in ui.perfetto.dev)", path.display());
    }
    Ok(())
}

/// `--max-tokens` beyond what the context leaves is capped, not refused: generation simply ends when the context
/// is full (stop reason `context_full`), as llama.cpp's `-n` does, and the prompt's length (which decides the
/// room) is known only after the model's tokenizer has run. The note says so before any time is spent.
pub fn note_context_cap(
    model: &dyn specula::model::Model,
    prompt_tokens: usize,
    max_tokens: usize,
) {
    let room = specula::decode::context_room(model, prompt_tokens);
    if max_tokens > room {
        eprintln!(
            "note: --max-tokens {max_tokens} is more than the context leaves ({} tokens of context, {prompt_tokens} \
             in the prompt): at most {room} tokens will be generated",
            model.config().context_length
        );
    }
}

pub fn write_json(path: &std::path::Path, value: &serde_json::Value) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
