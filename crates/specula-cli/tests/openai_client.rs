//! The official `openai` Python client against `specula serve` (the client's own parsing of every response, stream
//! and error). scripts/test.sh installs the package and sets SPECULA_REQUIRE_OPENAI, so CI cannot skip this; a
//! machine without it prints a loud warning.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use specula::testing::{write_tiny_gguf, TinySpec};

#[test]
fn the_openai_client_works_against_specula_serve() {
    let available = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !available {
        eprintln!(
            "WARNING: the `openai` Python package is not importable here: the OpenAI client test did NOT run \
             (scripts/test.sh installs it and sets PYTHONPATH)"
        );
        assert!(
            std::env::var_os("SPECULA_REQUIRE_OPENAI").is_none(),
            "SPECULA_REQUIRE_OPENAI is set but `import openai` fails"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    write_tiny_gguf(
        &model,
        &TinySpec {
            untied_head: true,
            ..Default::default()
        },
    )
    .unwrap();
    let m = model.to_str().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_specula"))
        .args([
            "serve",
            "-m",
            m,
            "--port",
            "0",
            "--api-key",
            "sekret",
            "--draft",
            "ngram",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("serve printed its address").unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/openai_client.py");
    let out = Command::new("python3")
        .args([script, &format!("http://{addr}"), m, "sekret"])
        .output()
        .unwrap();
    child.kill().unwrap();
    let _ = child.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("openai client checks passed"), "{stdout}");
}
