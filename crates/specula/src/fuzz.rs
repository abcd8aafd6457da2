//! Entry points for fuzzing: each takes untrusted bytes, parses them the way the engine does, and uses what
//! parses. None of them may panic, abort or hang, whatever the bytes; errors are the expected outcome and are
//! dropped. The cargo-fuzz targets in `fuzz/` call these for long runs, and `tests/fuzz_bounded.rs` runs a
//! bounded property-based campaign over them in every test run (docs/correctness.md).

use std::path::{Path, PathBuf};

use crate::chat::{ChatMessage, ChatTemplate};
use crate::decode::{generate, GenerateRequest, Speculation};
use crate::draft::ngram::NgramDrafter;
use crate::model::gguf::GgufFile;
use crate::model::{Config, ForwardOptions, LogitsFor, Model};
use crate::profile::Profiler;
use crate::sampling::SamplingParams;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// How far an input got: the campaigns count these to show that mutated inputs reach the deep code, not only
/// the first check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reached {
    /// Refused at the first step (bad syntax, bad magic).
    Rejected,
    /// Parsed (a GGUF header, JSON, a template), then refused.
    Parsed,
    /// Built what it describes (a config and tokenizer, a template's output, a prompt list, a tune input).
    Built,
    /// Ran: a model loaded and generated, a tune was fitted.
    Ran,
}

/// A GGUF file: header, metadata, tensor directory, the config and tokenizer built from them, the chat
/// template, and (when the tensors are all there) the model itself, run for a few tokens.
pub fn gguf(bytes: &[u8]) -> Reached {
    let Ok(file) = GgufFile::parse_header(bytes.to_vec(), Path::new("fuzz.gguf")) else {
        return Reached::Rejected;
    };
    let mut reached = Reached::Parsed;
    let config = Config::from_gguf(&file);
    if let Ok(tokenizer) = Tokenizer::from_gguf(&file) {
        use_tokenizer(&tokenizer);
        if let Some(source) = file.get_str("tokenizer.chat_template") {
            render(&ChatTemplate::new(source), &tokenizer);
        }
        if config.is_ok() {
            reached = Reached::Built;
        }
    }
    if file.check_tensor_extents().is_err() {
        return reached;
    }
    match crate::model::load_gguf_file(file, "fuzz", crate::backend::Device::Cpu) {
        Ok(loaded) => {
            run_model(loaded.model.as_ref(), &loaded.tokenizer);
            Reached::Ran
        }
        Err(_) => reached,
    }
}

/// A Hugging Face checkpoint: `config.json` and one safetensors shard, framed as a little-endian u16 length
/// of the config followed by the config and then the shard. The tokenizer is a fixed valid one (it has its own
/// target), so inputs reach the weights.
pub fn hf_checkpoint(bytes: &[u8]) -> Reached {
    let Some((config, shard)) = split_u16_framed(bytes) else {
        return Reached::Rejected;
    };
    let Ok(config) = std::str::from_utf8(config) else {
        return Reached::Rejected;
    };
    let Ok(config) = Config::from_hf_json(config) else {
        return Reached::Rejected;
    };
    let Ok(files) = crate::model::safetensors::SafetensorsFiles::from_bytes(vec![(
        PathBuf::from("fuzz.safetensors"),
        shard.to_vec(),
    )]) else {
        return Reached::Parsed;
    };
    let Ok(model) =
        crate::backend::cpu::CpuModel::load(config, &files, &crate::model::tensors::HF_NAMES)
    else {
        return Reached::Built;
    };
    match fixed_tokenizer() {
        Ok(tokenizer) => {
            run_model(&model, &tokenizer);
            Reached::Ran
        }
        Err(_) => Reached::Built,
    }
}

/// A `tokenizer.json` (with no tokenizer_config.json or generation_config.json).
pub fn tokenizer_json(bytes: &[u8]) -> Reached {
    let null = serde_json::Value::Null;
    match Tokenizer::from_hf_json(bytes, &null, &null) {
        Ok(tokenizer) => {
            use_tokenizer(&tokenizer);
            Reached::Ran
        }
        Err(_) if serde_json::from_slice::<serde_json::Value>(bytes).is_ok() => Reached::Parsed,
        Err(_) => Reached::Rejected,
    }
}

/// A chat template's source, rendered with a fixed conversation.
pub fn chat_template(bytes: &[u8]) -> Reached {
    let source = String::from_utf8_lossy(bytes);
    let template = ChatTemplate::new(source.as_ref());
    let messages = [
        ChatMessage::system("You are terse."),
        ChatMessage::user("Hi <|im_start|> {{ x }}"),
    ];
    match template.render(&messages, true, "<s>", "</s>") {
        Ok(_) => Reached::Ran,
        Err(crate::Error::ChatTemplate(m)) if m.contains("does not parse") => Reached::Rejected,
        Err(_) => Reached::Parsed,
    }
}

/// A bench prompts file (JSON Lines), in both bad-line modes.
pub fn prompts_jsonl(bytes: &[u8]) -> Reached {
    let text = String::from_utf8_lossy(bytes);
    let mut reached = Reached::Rejected;
    for (mode, level) in [
        (crate::bench::BadLines::Skip, Reached::Parsed),
        (crate::bench::BadLines::Stop, Reached::Ran),
    ] {
        if crate::bench::prompts::parse_prompts(&text, "fuzz.jsonl", mode).is_ok() {
            reached = level;
        }
    }
    reached
}

/// A `specula bench --json` report as `tune --from-bench` reads it, tuned when it parses.
pub fn bench_json(bytes: &[u8]) -> Reached {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return Reached::Rejected;
    };
    match crate::bench::TuneInput::from_bench_json(&value) {
        Ok(input) => {
            let result = crate::bench::tune(&input);
            let _ = result.table();
            let _ = result.plot_svg();
            Reached::Ran
        }
        Err(_) => Reached::Parsed,
    }
}

/// Text a client sends (a prompt, a message, a stop string), taken as UTF-8 with bad bytes replaced: each of
/// `tokenizers` must give its bytes back exactly (the tokens' bytes, decoding at once, and streaming token by token
/// through a [`StreamDecoder`]), except for bytes its vocabulary has no token for, which it drops as Hugging
/// Face's tokenizers do (SmolLM2-135M's vocabulary has none for the control bytes 4, 6, 19, 20, 22 and 29); each
/// template must render it as a user message without panicking.
pub fn client_text(tokenizers: &[Tokenizer], templates: &[ChatTemplate], bytes: &[u8]) -> Reached {
    let text = String::from_utf8_lossy(bytes);
    let mut reached = Reached::Parsed;
    for tokenizer in tokenizers {
        let Ok(ids) = tokenizer.encode(&text) else {
            continue;
        };
        // The bytes a token of one byte stands for: what this vocabulary can write at all.
        let mut covered = [false; 256];
        for id in 0..tokenizer.vocab_size() as u32 {
            if let [b] = tokenizer.token_bytes(id)[..] {
                covered[b as usize] = true;
            }
        }
        let expected: Vec<u8> = text.bytes().filter(|&b| covered[b as usize]).collect();
        let written: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tokenizer.token_bytes(id))
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&written),
            String::from_utf8_lossy(&expected),
            "{text:?}: its tokens {ids:?} write other bytes"
        );
        let expected = String::from_utf8_lossy(&expected).into_owned();
        let decoded = tokenizer
            .decode(&ids)
            .unwrap_or_else(|e| panic!("{text:?} encoded to {ids:?}, which does not decode: {e}"));
        assert_eq!(decoded, expected, "{text:?} decoded changed from {ids:?}");
        let mut stream = StreamDecoder::new();
        let mut streamed = String::new();
        for &id in &ids {
            if let Some(piece) = stream.push(tokenizer, id).expect("its own ids stream") {
                streamed.push_str(&piece);
            }
        }
        if let Some(rest) = stream.flush(tokenizer).expect("its own ids stream") {
            streamed.push_str(&rest);
        }
        assert_eq!(
            streamed, expected,
            "{text:?} streamed back changed from {ids:?}"
        );
        reached = Reached::Ran;
    }
    for template in templates {
        let _ = template.render(&[ChatMessage::user(text.as_ref())], true, "<s>", "</s>");
    }
    reached
}

/// A request's output constraint as a client sends it (`{"schema": ...}`, `{"regex": "..."}` or `{"choices":
/// [...]}`: the server's `json_schema`, `guided_regex` and `guided_choice`; other bytes are taken whole as a
/// regex), compiled and then walked over a small
/// vocabulary (JSON punctuation, words, split UTF-8) for up to [`CONSTRAINT_WALK`] tokens. At every step each
/// token's bit in the cached mask must agree with advancing the state by that token (the fast mask against the
/// plain walk: a token the mask allows but the walk refuses would stall a request), and output that stops must be
/// what the constraint asked for: a full match of the regex, one of the choices, a JSON value for a schema. The
/// next token is chosen among the allowed ones by the input's hash (stopping, when allowed, one time in four),
/// every other step the one that closes most, so that schemas' outputs get finished too.
pub fn output_constraint(bytes: &[u8]) -> Reached {
    use crate::json_mode::{JsonConstraint, JsonGrammar, JsonState};
    // Input that is not JSON is taken whole as a regex (the most hostile of the three: any text a client sends).
    let request = serde_json::from_slice::<serde_json::Value>(bytes).unwrap_or_else(
        |_| serde_json::json!({ "regex": String::from_utf8_lossy(bytes), "raw": true }),
    );
    let raw = request.get("raw").is_some();
    let (grammar, asked) = if let Some(schema) = request.get("schema") {
        (JsonGrammar::from_schema(schema), Asked::Schema)
    } else if let Some(regex) = request.get("regex").and_then(|r| r.as_str()) {
        (
            JsonGrammar::from_regex(regex),
            Asked::Regex(regex.to_string()),
        )
    } else if let Some(list) = request.get("choices").and_then(|c| c.as_array()) {
        let Some(choices) = list
            .iter()
            .map(|c| c.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
        else {
            return Reached::Parsed;
        };
        (JsonGrammar::from_choices(&choices), Asked::Choices(choices))
    } else {
        return Reached::Parsed;
    };
    let Ok(grammar) = grammar else {
        return if raw {
            Reached::Rejected
        } else {
            Reached::Parsed
        };
    };
    let (vocab, tokens) = constraint_vocabulary();
    let stop = vocab.len() as u32 - 1;
    let constraint = JsonConstraint::new(grammar, vocab.clone());
    let mut state = JsonState::default();
    let mut text: Vec<u8> = Vec::new();
    let mut pick = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    for _ in 0..CONSTRAINT_WALK {
        let mask = constraint.mask(state);
        let mut allowed = Vec::new();
        for t in 0..vocab.len() as u32 {
            let in_mask = mask[t as usize / 64] >> (t % 64) & 1 == 1;
            let next = constraint.advance(state, t);
            assert_eq!(
                in_mask,
                next.is_some(),
                "token {t} ({:?}) after {:?}: the mask says {in_mask}, advancing says {:?}",
                String::from_utf8_lossy(&tokens[t as usize]),
                String::from_utf8_lossy(&text),
                next.is_some()
            );
            if let Some(next) = next {
                allowed.push((t, next));
            }
        }
        if allowed.is_empty() {
            break;
        }
        pick = pick
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let stops = allowed.iter().any(|&(t, _)| t == stop);
        if stops && (pick >> 60) % 4 == 0 {
            check_constrained_output(&asked, &text);
            break;
        }
        // Half the steps take the allowed token that closes most (so schemas' outputs get finished too), the
        // others any allowed token.
        let (t, next) = if (pick >> 59) & 1 == 0 {
            *allowed
                .iter()
                .max_by_key(|&&(t, _)| (closing_weight(&tokens[t as usize]), std::cmp::Reverse(t)))
                .expect("allowed is not empty")
        } else {
            allowed[(pick >> 33) as usize % allowed.len()]
        };
        if t == stop {
            check_constrained_output(&asked, &text);
            break;
        }
        text.extend_from_slice(&tokens[t as usize]);
        state = next;
    }
    Reached::Ran
}

/// Tokens [`output_constraint`] walks at most.
pub const CONSTRAINT_WALK: usize = 48;

/// The walk's vocabulary besides single bytes: JSON punctuation, literals, words, escapes, whole and split UTF-8.
const CONSTRAINT_TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    " ",
    "\n",
    "  ",
    "{\"",
    "\":",
    "\": ",
    ", \"",
    "\"}",
    "\"]",
    "[]",
    "{}",
    "true",
    "false",
    "null",
    "tr",
    "ue",
    "0",
    "1",
    "12",
    "-1",
    "0.5",
    "1e9",
    "e+",
    "-",
    ".",
    "\\",
    "\\n",
    "\\\"",
    "\\u00",
    "e9",
    "a",
    "ab",
    "abc",
    "name",
    "\"name\"",
    "age",
    "Tom",
    "yes",
    "no",
    "@",
    "x.com",
    "2024-01-31",
    "T12:00:00Z",
    "\u{e9}",
    "\u{65e5}",
    "(",
    ")",
    "+",
    "_",
    "#",
    "/",
    "a b",
    "\t",
];

/// How much a token closes: quotes, brackets and braces, and short complete values.
fn closing_weight(token: &[u8]) -> usize {
    token
        .iter()
        .map(|&b| match b {
            b'}' | b']' => 3,
            b'"' => 2,
            b'0'..=b'9' => 1,
            _ => 0,
        })
        .sum()
}

/// What a walk's request asked for.
enum Asked {
    Schema,
    Regex(String),
    Choices(Vec<String>),
}

/// The walk's vocabulary (the last token stops) and each token's bytes.
fn constraint_vocabulary() -> &'static (
    std::sync::Arc<crate::json_mode::JsonVocabulary>,
    Vec<Vec<u8>>,
) {
    use std::sync::OnceLock;
    static VOCAB: OnceLock<(
        std::sync::Arc<crate::json_mode::JsonVocabulary>,
        Vec<Vec<u8>>,
    )> = OnceLock::new();
    VOCAB.get_or_init(|| {
        let mut tokens: Vec<Vec<u8>> = CONSTRAINT_TOKENS
            .iter()
            .map(|t| t.as_bytes().to_vec())
            .collect();
        // Lone bytes of UTF-8 sequences (a token may end inside a character), then the stop token.
        tokens.extend([0xc3u8, 0xa9, 0xe6, 0x97, 0xa5, 0xff].map(|b| vec![b]));
        tokens.push(b"<stop>".to_vec());
        let stop = tokens.len() as u32 - 1;
        let vocab = crate::json_mode::JsonVocabulary::from_tokens(
            tokens
                .iter()
                .map(|t| Some(t.clone().into_boxed_slice()))
                .collect(),
            vec![stop],
        );
        (vocab, tokens)
    })
}

/// Output a walk stopped on must be what its request asked for.
fn check_constrained_output(asked: &Asked, text: &[u8]) {
    match asked {
        Asked::Schema => {
            assert!(
                serde_json::from_slice::<serde_json::Value>(text).is_ok(),
                "a schema's output stopped on {:?}, which is not JSON",
                String::from_utf8_lossy(text)
            );
        }
        Asked::Regex(regex) => {
            // The constraint's own automaton accepted it; the regex crate must agree (a full match).
            if let Ok(re) = regex_automata::meta::Regex::new(&format!("^(?:{regex})$")) {
                assert!(
                    re.is_match(text),
                    "the regex {regex:?}'s output stopped on {:?}, which it does not match",
                    String::from_utf8_lossy(text)
                );
            }
        }
        Asked::Choices(choices) => {
            assert!(
                choices.iter().any(|c| c.as_bytes() == text),
                "choices {choices:?}: the output stopped on {:?}",
                String::from_utf8_lossy(text)
            );
        }
    }
}

fn split_u16_framed(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = u16::from_le_bytes([*bytes.first()?, *bytes.get(1)?]) as usize;
    let rest = &bytes[2..];
    (len <= rest.len()).then(|| rest.split_at(len))
}

/// Frames a config and a shard the way [`hf_checkpoint`] reads them (for seeds).
pub fn frame_hf_checkpoint(config_json: &[u8], shard: &[u8]) -> Option<Vec<u8>> {
    let len = u16::try_from(config_json.len()).ok()?;
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(config_json);
    out.extend_from_slice(shard);
    Some(out)
}

/// The tiny byte-level tokenizer of [`crate::testing`].
fn fixed_tokenizer() -> crate::Result<Tokenizer> {
    let json = crate::testing::tiny_tokenizer_json().to_string();
    let null = serde_json::Value::Null;
    Tokenizer::from_hf_json(json.as_bytes(), &null, &null)
}

fn use_tokenizer(tokenizer: &Tokenizer) {
    for text in [
        "Hello, world! 123 <|im_start|>user\n\u{e9}\u{1f375}",
        "",
        "  \t\n",
    ] {
        if let Ok(ids) = tokenizer.encode(text) {
            let _ = tokenizer.decode(&ids);
        }
    }
    let vocab = tokenizer.vocab_size().min(512) as u32;
    let ids: Vec<u32> = (0..vocab).collect();
    let _ = tokenizer.decode(&ids);
    let mut stream = StreamDecoder::new();
    for &id in ids.iter().take(64) {
        let _ = stream.push(tokenizer, id);
    }
    let _ = stream.flush(tokenizer);
    for id in [0, vocab.saturating_sub(1), u32::MAX] {
        let _ = tokenizer.token_text(id);
        let _ = tokenizer.is_stop(id);
    }
}

fn render(template: &ChatTemplate, tokenizer: &Tokenizer) {
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
    let _ = template.render(
        &[ChatMessage::user("hi")],
        true,
        &text(tokenizer.bos_token),
        &text(tokenizer.eos_token),
    );
}

/// A forward pass with hidden-state capture, then a short greedy generation with prompt lookup (a verify pass
/// over several rows, a rollback), on whatever model parsed.
fn run_model(model: &dyn Model, tokenizer: &Tokenizer) {
    let c = model.config();
    let vocab = c.vocab_size.min(u32::MAX as usize) as u32;
    let prompt: Vec<u32> = [1u32, 2, 1, 2, 1]
        .iter()
        .map(|&t| t % vocab.max(1))
        .collect();
    if let Ok(mut cache) = model.new_cache(64) {
        let opts = ForwardOptions {
            capture_layers: &[0, c.num_layers - 1],
            vocab_limit: None,
        };
        let _ = model.forward_one(
            &prompt,
            cache.as_mut(),
            &opts,
            LogitsFor::All,
            &Profiler::disabled(),
        );
    }
    let req = GenerateRequest {
        prompt_tokens: prompt,
        max_new_tokens: 4,
        sampling: SamplingParams::default(),
        stop_at_eos: true,
        cancel: None,
        logprobs: None,
        logit_adjustments: None,
        stop_token_ids: Vec::new(),
    };
    if let Ok(mut ngram) = NgramDrafter::new(1, 2) {
        let speculation = Speculation {
            drafter: &mut ngram,
            draft_tokens: 3,
            simulate_acceptance: None,
        };
        let _ = generate(
            model,
            tokenizer,
            &req,
            Some(speculation),
            &Profiler::disabled(),
            &mut |_| {},
        );
    }
}
