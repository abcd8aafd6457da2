//! Benchmark prompt files: JSON Lines, one object per line with a `prompt` string (and an optional `id`).

use std::path::Path;

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BenchPrompt {
    pub id: String,
    pub prompt: String,
}

/// What to do with a line that is not a JSON object with a string `prompt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadLines {
    /// Stop with an error naming the file and line (the default: a benchmark over silently fewer prompts
    /// would mislead).
    Stop,
    /// Skip the line and report it in the returned warnings.
    Skip,
}

/// Reads a prompts file. Blank lines are ignored. Returns the prompts and one warning per skipped line.
pub fn read_prompts(path: &Path, bad_lines: BadLines) -> Result<(Vec<BenchPrompt>, Vec<String>)> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::InvalidArgument(format!("cannot read prompts file {}: {e}", path.display()))
    })?;
    parse_prompts(&text, &path.display().to_string(), bad_lines)
}

pub fn parse_prompts(
    text: &str,
    source: &str,
    bad_lines: BadLines,
) -> Result<(Vec<BenchPrompt>, Vec<String>)> {
    let mut prompts = Vec::new();
    let mut warnings = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(line) {
            Ok((id, prompt)) => prompts.push(BenchPrompt {
                id: id.unwrap_or_else(|| format!("line{line_no}")),
                prompt,
            }),
            Err(why) => {
                let msg = format!("{source}:{line_no}: {why}");
                match bad_lines {
                    BadLines::Stop => {
                        return Err(Error::InvalidArgument(format!(
                            "{msg} (fix the line, or pass --skip-bad-lines to skip it)"
                        )))
                    }
                    BadLines::Skip => warnings.push(format!("skipped {msg}")),
                }
            }
        }
    }
    if prompts.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{source}: no prompts (expected JSON Lines like {{\"prompt\": \"...\"}})"
        )));
    }
    Ok((prompts, warnings))
}

fn parse_line(line: &str) -> std::result::Result<(Option<String>, String), String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not valid JSON ({e})"))?;
    let obj = value
        .as_object()
        .ok_or_else(|| "expected a JSON object with a \"prompt\" string".to_string())?;
    let prompt = match obj.get("prompt") {
        Some(serde_json::Value::String(s)) if !s.trim().is_empty() => s.clone(),
        Some(serde_json::Value::String(_)) => return Err("\"prompt\" is empty".into()),
        Some(_) => return Err("\"prompt\" is not a string".into()),
        None => return Err("no \"prompt\" key".into()),
    };
    let id = match obj.get("id") {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
    };
    Ok((id, prompt))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_prompts_and_reports_bad_lines_by_number() {
        let text = "{\"id\": \"a\", \"prompt\": \"hello\"}\n\n{\"prompt\": \"world\"}\n{\"prompt\": 3}\nnot json\n";
        let err = parse_prompts(text, "p.jsonl", BadLines::Stop).unwrap_err();
        assert!(err.to_string().contains("p.jsonl:4:"), "{err}");
        assert!(err.to_string().contains("not a string"), "{err}");
        let (prompts, warnings) = parse_prompts(text, "p.jsonl", BadLines::Skip).unwrap();
        assert_eq!(
            prompts,
            vec![
                BenchPrompt {
                    id: "a".into(),
                    prompt: "hello".into()
                },
                BenchPrompt {
                    id: "line3".into(),
                    prompt: "world".into()
                }
            ]
        );
        assert_eq!(warnings.len(), 2);
        assert!(
            warnings[1].contains("p.jsonl:5: not valid JSON"),
            "{warnings:?}"
        );
        let err = parse_prompts("\n\n", "e.jsonl", BadLines::Skip).unwrap_err();
        assert!(err.to_string().contains("no prompts"), "{err}");
        let err = parse_prompts("[1, 2]", "x.jsonl", BadLines::Stop).unwrap_err();
        assert!(
            err.to_string()
                .contains("x.jsonl:1: expected a JSON object"),
            "{err}"
        );
    }
}
