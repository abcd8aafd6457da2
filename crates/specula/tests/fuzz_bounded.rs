//! A bounded fuzzing campaign in every test run: property-based (proptest) mutations of the seed corpora
//! (fuzz/seeds: real registry-model headers, tiny complete models, tokenizers, templates, prompt files, bench
//! reports) and plain random bytes, fed to the same entry points as the cargo-fuzz targets
//! (`specula::fuzz`). The property: no input makes them panic, abort or hang. A case running longer than
//! [`HANG_SECONDS`] is written to a file and the process aborts, so a hang fails the run instead of stalling it.
//!
//! `SPECULA_FUZZ_CASES` sets the cases per target (default [`DEFAULT_CASES`]); failures shrink to a minimal input.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const DEFAULT_CASES: u32 = 3000;
const HANG_SECONDS: u64 = 60;

/// One edit of a seed. Positions are taken modulo the current length.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    /// Overwrites 8 bytes (little-endian) with a value chosen to hit length and count fields.
    SetU64(usize, u64),
    SetU32(usize, u32),
    Truncate(usize),
    Delete(usize, usize),
    Insert(usize, Vec<u8>),
    /// Copies a range of the input over another place (moves structure around).
    Splice(usize, usize, usize),
}

fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(255),
        Just(256),
        Just(u16::MAX as u64),
        Just(u32::MAX as u64),
        Just(1 << 31),
        Just(1 << 32),
        Just(1 << 40),
        Just(1 << 62),
        Just(1 << 63),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        any::<u64>(),
        0u64..4096,
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Mutation::SetByte(p, v)),
        3 => (any::<usize>(), interesting_u64()).prop_map(|(p, v)| Mutation::SetU64(p, v)),
        2 => (any::<usize>(), interesting_u64()).prop_map(|(p, v)| Mutation::SetU32(p, v as u32)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), 1usize..64).prop_map(|(p, n)| Mutation::Delete(p, n)),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, b)| Mutation::Insert(p, b)),
        1 => (any::<usize>(), any::<usize>(), 1usize..64)
            .prop_map(|(a, b, n)| Mutation::Splice(a, b, n)),
    ]
}

fn apply(mut data: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let len = data.len().max(1);
        match *m {
            Mutation::FlipBit(p, b) => {
                if let Some(x) = data.get_mut(p % len) {
                    *x ^= 1 << b;
                }
            }
            Mutation::SetByte(p, v) => {
                if let Some(x) = data.get_mut(p % len) {
                    *x = v;
                }
            }
            Mutation::SetU64(p, v) => {
                let p = p % len;
                for (i, b) in v.to_le_bytes().iter().enumerate() {
                    if let Some(x) = data.get_mut(p + i) {
                        *x = *b;
                    }
                }
            }
            Mutation::SetU32(p, v) => {
                let p = p % len;
                for (i, b) in v.to_le_bytes().iter().enumerate() {
                    if let Some(x) = data.get_mut(p + i) {
                        *x = *b;
                    }
                }
            }
            Mutation::Truncate(p) => data.truncate(p % len),
            Mutation::Delete(p, n) => {
                let p = p % len;
                let end = (p + n).min(data.len());
                if p < end {
                    data.drain(p..end);
                }
            }
            Mutation::Insert(p, ref bytes) => {
                let p = (p % len).min(data.len());
                data.splice(p..p, bytes.iter().copied());
            }
            Mutation::Splice(from, to, n) => {
                let (from, to) = (from % len, to % len);
                let chunk: Vec<u8> = data.iter().skip(from).take(n).copied().collect();
                for (i, b) in chunk.into_iter().enumerate() {
                    if let Some(x) = data.get_mut(to + i) {
                        *x = b;
                    }
                }
            }
        }
    }
    data
}

/// One structural edit of a JSON document: at the `node`-th value (depth first), do `kind`.
#[derive(Debug, Clone)]
struct JsonEdit {
    node: usize,
    kind: u8,
    number: u64,
}

fn json_edit() -> impl Strategy<Value = JsonEdit> {
    (any::<usize>(), 0u8..10, interesting_u64()).prop_map(|(node, kind, number)| JsonEdit {
        node,
        kind,
        number,
    })
}

/// Applies structural edits (replace a value by a number at a size boundary, a negative or fractional number,
/// a string, null, a bool, an empty or nested container; delete it; duplicate it) and serializes the result.
/// Byte mutations of JSON almost always break its syntax; these reach the code that reads the fields.
fn apply_json(seed: &[u8], edits: &[JsonEdit]) -> Option<Vec<u8>> {
    let mut doc: serde_json::Value = serde_json::from_slice(seed).ok()?;
    for e in edits {
        let paths = specula::testing::json_pointers(&doc);
        let path = &paths[e.node % paths.len()];
        let replacement = match e.kind {
            0 => serde_json::json!(e.number),
            1 => serde_json::json!(-(e.number as i64).abs().max(1)),
            2 => serde_json::json!(e.number as f64 * 1e300),
            3 => serde_json::json!(0.5),
            4 => serde_json::json!("x".repeat((e.number % 64) as usize)),
            5 => serde_json::Value::Null,
            6 => serde_json::json!(e.number % 2 == 0),
            7 => serde_json::json!([]),
            8 => serde_json::json!({"type": "x", "a": [[]]}),
            _ => {
                // Delete: remove the key or element from its parent.
                specula::testing::remove_json_pointer(&mut doc, path);
                continue;
            }
        };
        if let Some(slot) = doc.pointer_mut(path) {
            *slot = replacement;
        }
    }
    serde_json::to_vec(&doc).ok()
}

/// How a target's inputs are laid out, for the structure-aware mutations.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    Binary,
    Json,
    /// `specula::fuzz::hf_checkpoint`'s framing: a u16 length, config.json, then the safetensors shard.
    FramedJson,
}

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (seeds: cargo run --example fuzz_seeds)",
                dir.display()
            )
        })
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().to_string(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no seeds in {}", dir.display());
    out
}

/// Aborts the process, after saving the input, if one case runs longer than HANG_SECONDS.
struct Watchdog {
    started_ms: Arc<AtomicU64>,
    input: Arc<Mutex<(String, Vec<u8>)>>,
    epoch: Instant,
}

impl Watchdog {
    fn start(target: &'static str) -> Watchdog {
        let started_ms = Arc::new(AtomicU64::new(u64::MAX));
        let input = Arc::new(Mutex::new((String::new(), Vec::new())));
        let epoch = Instant::now();
        let (s, i) = (started_ms.clone(), input.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            let start = s.load(Ordering::Relaxed);
            if start == u64::MAX {
                continue;
            }
            let now = epoch.elapsed().as_millis() as u64;
            if now.saturating_sub(start) > HANG_SECONDS * 1000 {
                let (seed, bytes) = i.lock().map(|g| g.clone()).unwrap_or_default();
                let path = std::env::temp_dir().join(format!("specula-fuzz-hang-{target}.bin"));
                let _ = std::fs::write(&path, &bytes);
                eprintln!(
                    "fuzz target {target}: one case (from seed {seed}) ran over {HANG_SECONDS}s; input saved to {}",
                    path.display()
                );
                std::process::abort();
            }
        });
        Watchdog {
            started_ms,
            input,
            epoch,
        }
    }

    fn begin(&self, seed: &str, bytes: &[u8]) {
        if let Ok(mut g) = self.input.lock() {
            *g = (seed.to_string(), bytes.to_vec());
        }
        self.started_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn end(&self) {
        self.started_ms.store(u64::MAX, Ordering::Relaxed);
    }
}

fn cases() -> u32 {
    std::env::var("SPECULA_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Runs `cases()` mutated seeds and `cases() / 4` random inputs through `entry`; reports counts, time, and how
/// far the inputs got, and requires that the mutated seeds exercised the deepest stage.
fn campaign(target: &'static str, layout: Layout, entry: fn(&[u8]) -> specula::fuzz::Reached) {
    campaign_scaled(target, layout, entry, 1);
}

/// [`campaign`] with `scale` times the cases (for targets whose cases take microseconds).
fn campaign_scaled(
    target: &'static str,
    layout: Layout,
    entry: fn(&[u8]) -> specula::fuzz::Reached,
    scale: u32,
) {
    use specula::fuzz::Reached;
    let seeds = seeds(target);
    let watchdog = Watchdog::start(target);
    let started = Instant::now();
    let slowest = Mutex::new((Duration::ZERO, String::new()));
    let reached = Mutex::new(std::collections::BTreeMap::<Reached, u32>::new());
    let run_one = |seed: &str, bytes: &[u8]| {
        watchdog.begin(seed, bytes);
        let t = Instant::now();
        let r = entry(bytes);
        let took = t.elapsed();
        watchdog.end();
        *reached.lock().unwrap().entry(r).or_default() += 1;
        let mut s = slowest.lock().unwrap();
        if took > s.0 {
            *s = (took, seed.to_string());
        }
        r
    };
    // Every seed as it is: valid input must get all the way through (or the seeds are stale).
    for (name, bytes) in &seeds {
        let r = run_one(name, bytes);
        let header_only = name.ends_with("-header.gguf");
        let expected = if header_only {
            Reached::Built
        } else {
            Reached::Ran
        };
        assert_eq!(r, expected, "{target} seed {name}");
    }
    let n = cases() * scale;
    let mut runner = TestRunner::new(Config {
        cases: n,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        0..seeds.len(),
        any::<bool>(),
        proptest::collection::vec(mutation(), 1..8),
        proptest::collection::vec(json_edit(), 1..4),
    );
    runner
        .run(&strategy, |(which, structural, mutations, edits)| {
            let (name, seed) = &seeds[which];
            let input = match (layout, structural) {
                (Layout::Json, true) => apply_json(seed, &edits),
                (Layout::FramedJson, true) => {
                    let len = u16::from_le_bytes([seed[0], seed[1]]) as usize;
                    let (config, shard) = seed[2..].split_at(len);
                    apply_json(config, &edits)
                        .and_then(|c| specula::fuzz::frame_hf_checkpoint(&c, shard))
                }
                _ => None,
            }
            .unwrap_or_else(|| apply(seed.clone(), &mutations));
            run_one(name, &input);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("fuzz target {target}: {e}"));
    let mutated = reached.lock().unwrap().clone();
    let mut random = TestRunner::new(Config {
        cases: n / 4,
        failure_persistence: None,
        ..Config::default()
    });
    random
        .run(&proptest::collection::vec(any::<u8>(), 0..512), |bytes| {
            run_one("random", &bytes);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("fuzz target {target} (random bytes): {e}"));
    let (slow, slow_seed) = slowest.lock().unwrap().clone();
    // Shown with --nocapture; docs/correctness.md records a run.
    eprintln!(
        "fuzz {target}: {} seeds, {n} mutated + {} random cases in {:.1}s (slowest case {:.0} ms, from {slow_seed}); \
         stages reached by seeds and mutated cases: {mutated:?}",
        seeds.len(),
        n / 4,
        started.elapsed().as_secs_f64(),
        slow.as_secs_f64() * 1e3
    );
    // A campaign whose inputs all die at the first check tests nothing past it.
    let deep = mutated.get(&Reached::Ran).copied().unwrap_or(0);
    assert!(
        deep >= seeds.len() as u32 + n / 200,
        "{target}: only {deep} inputs ran all the way: {mutated:?}"
    );
}

#[test]
fn gguf_reader_and_model_loader() {
    campaign("gguf", Layout::Binary, specula::fuzz::gguf);
}

#[test]
fn safetensors_and_config_json_loader() {
    campaign(
        "hf_checkpoint",
        Layout::FramedJson,
        specula::fuzz::hf_checkpoint,
    );
}

#[test]
fn tokenizer_json_builder() {
    campaign(
        "tokenizer_json",
        Layout::Json,
        specula::fuzz::tokenizer_json,
    );
}

#[test]
fn chat_template_rendering() {
    campaign(
        "chat_template",
        Layout::Binary,
        specula::fuzz::chat_template,
    );
}

#[test]
fn prompts_jsonl_reader() {
    campaign(
        "prompts_jsonl",
        Layout::Binary,
        specula::fuzz::prompts_jsonl,
    );
}

#[test]
fn bench_json_reader_and_tune() {
    campaign("bench_json", Layout::Json, specula::fuzz::bench_json);
}

/// The registry models' tokenizers and chat templates from the seed corpus, for [`client_text`].
fn registry_text_tools() -> &'static (
    Vec<specula::tokenizer::Tokenizer>,
    Vec<specula::chat::ChatTemplate>,
) {
    static TOOLS: std::sync::OnceLock<(
        Vec<specula::tokenizer::Tokenizer>,
        Vec<specula::chat::ChatTemplate>,
    )> = std::sync::OnceLock::new();
    TOOLS.get_or_init(|| {
        let null = serde_json::Value::Null;
        let tokenizers = seeds("tokenizer_json")
            .iter()
            .map(|(name, bytes)| {
                specula::tokenizer::Tokenizer::from_hf_json(bytes, &null, &null)
                    .unwrap_or_else(|e| panic!("seed tokenizer {name}: {e}"))
            })
            .collect();
        let templates = seeds("chat_template")
            .iter()
            .map(|(_, bytes)| {
                specula::chat::ChatTemplate::new(String::from_utf8_lossy(bytes).into_owned())
            })
            .collect();
        (tokenizers, templates)
    })
}

fn client_text(bytes: &[u8]) -> specula::fuzz::Reached {
    let (tokenizers, templates) = registry_text_tools();
    specula::fuzz::client_text(tokenizers, templates, bytes)
}

#[test]
fn client_text_round_trips_through_the_tokenizers() {
    campaign("client_text", Layout::Binary, client_text);
}

/// A case takes well under a millisecond (the walk's vocabulary is ~130 tokens), so ten times the cases.
#[test]
fn output_constraints_from_requests() {
    campaign_scaled(
        "output_constraint",
        Layout::Json,
        specula::fuzz::output_constraint,
        10,
    );
}

/// The mutator itself: edits stay in bounds and do change the input (a mutator that returned its seed would make
/// the campaign above test nothing).
#[test]
fn mutations_change_the_input() {
    let seed: Vec<u8> = (0..100).collect();
    let mut runner = TestRunner::new(Config {
        cases: 200,
        failure_persistence: None,
        ..Config::default()
    });
    let changed = std::sync::atomic::AtomicUsize::new(0);
    runner
        .run(&proptest::collection::vec(mutation(), 1..8), |m| {
            let out = apply(seed.clone(), &m);
            if out != seed {
                changed.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
        .unwrap();
    assert!(changed.load(Ordering::Relaxed) > 150);
}
