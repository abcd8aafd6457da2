//! Where a reference continuation diverges from specula's greedy choice, how close was the call?
//! Feeds prompt + reference text through the model once and prints, for the first position where specula's
//! argmax differs from the reference token, the logit margin between the two.
//!
//!     cargo run --release --example tie_margins -- tests/fixtures/llama_cpp_greedy.json

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: tie_margins FIXTURE.json")?;
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let mut loaded: Option<specula::model::LoadedModel> = None;
    for case in fixture["cases"].as_array().ok_or("no cases")? {
        let name = case["model"].as_str().unwrap_or_default();
        if loaded.as_ref().map(|m| m.spec.as_str()) != Some(name) {
            loaded = Some(specula::load_model(name, false, &mut |_| {})?);
        }
        let m = loaded.as_ref().ok_or("model")?;
        let prompt = case["prompt"].as_str().unwrap_or_default();
        let reference = case["text"].as_str().unwrap_or_default();
        let prompt_ids = m.tokenizer.encode(prompt)?;
        let all_ids = m.tokenizer.encode(&format!("{prompt}{reference}"))?;
        if all_ids[..prompt_ids.len()] != prompt_ids[..] {
            println!(
                "{name} {prompt:?}: prompt tokenization differs inside the full text; skipped"
            );
            continue;
        }
        let model = m.model.as_ref();
        let mut cache = specula::testing::full_cache(model);
        let out = specula::testing::forward_host(
            model,
            &all_ids,
            cache.as_mut(),
            specula::model::LogitsFor::All,
        );
        let mut verdict = "reference path is specula's greedy path".to_string();
        for (pos, &theirs) in all_ids.iter().enumerate().skip(prompt_ids.len()) {
            let row = out.row(pos - 1);
            let ours = specula::sampling::argmax(row);
            if ours != theirs {
                verdict = format!(
                    "diverges at generated token {}: specula {:?} ({:.4}) vs reference {:?} ({:.4}), margin {:.4}",
                    pos - prompt_ids.len(),
                    m.tokenizer.decode(&[ours])?,
                    row[ours as usize],
                    m.tokenizer.decode(&[theirs])?,
                    row[theirs as usize],
                    row[ours as usize] - row[theirs as usize]
                );
                break;
            }
        }
        println!("{name} {prompt:?}: {verdict}");
    }
    Ok(())
}
