//! The model cache trusts a file only after checking its SHA-256 once: a file of the right size but the wrong
//! bytes (truncated and padded, corrupted, replaced) is caught, deleted and reported.

use std::path::Path;
use std::process::{Command, Output};

fn specula(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(args)
        .env("SPECULA_CACHE", cache)
        // Any download attempt fails at once (no network needed, nothing fetched).
        .env("SPECULA_PYTHON", "/nonexistent/python")
        .output()
        .expect("run specula")
}

fn models_line(cache: &Path) -> String {
    let out = specula(cache, &["models"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with("smollm2-135m"))
        .unwrap_or_default()
        .to_string()
}

/// Right size, wrong bytes: `models` says unchecked, and loading it checks the hash, deletes the file and says
/// why (without the check this file would have been loaded as smollm2).
#[test]
fn corrupt_file_of_the_right_size_is_caught() {
    let cache = tempfile::tempdir().unwrap();
    let model = specula::registry::find("smollm2-135m").unwrap();
    let path = cache.path().join("smollm2-135m.gguf");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(model.bytes).unwrap(); // all zeros, as a truncated-and-padded download would end
    drop(file);
    assert!(models_line(cache.path()).contains("unchecked"));

    let out = specula(
        cache.path(),
        &["generate", "-m", "smollm2-135m", "-p", "hi"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for expected in [
        "checking the SHA-256",
        "was corrupt",
        model.sha256,
        "deleted",
    ] {
        assert!(stderr.contains(expected), "lacks {expected:?}: {stderr}");
    }
    assert!(!path.exists(), "the corrupt file was not deleted");
    assert!(models_line(cache.path()).contains(" no "));
}

/// A good file (the real one, hard-linked into a fresh cache) is hashed once, recorded, and trusted after.
#[test]
fn good_file_is_checked_once_and_recorded() {
    let real = specula::registry::find("smollm2-135m")
        .unwrap()
        .cached_path();
    assert!(
        real.exists(),
        "{} missing: run `specula fetch smollm2-135m`",
        real.display()
    );
    let cache = tempfile::tempdir().unwrap();
    let path = cache.path().join("smollm2-135m.gguf");
    if std::fs::hard_link(&real, &path).is_err() {
        std::fs::copy(&real, &path).unwrap();
    }
    assert!(models_line(cache.path()).contains("unchecked"));
    let args = [
        "generate",
        "-m",
        "smollm2-135m",
        "-p",
        "hi",
        "-n",
        "2",
        "--quiet",
    ];
    let first = specula(cache.path(), &args);
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert!(first.status.success(), "{stderr}");
    assert!(stderr.contains("checking the SHA-256"), "{stderr}");
    assert!(models_line(cache.path()).contains("yes"));
    let second = specula(cache.path(), &args);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{stderr}");
    assert!(
        !stderr.contains("checking the SHA-256"),
        "hashed twice: {stderr}"
    );
}
