//! The CPU kernels' instruction-set paths give bitwise the same logits on the real models (`specula selftest`'s
//! digest of every logit of a forward pass), and each agrees with the reference kernel: the AVX-512 (VNNI, BW)
//! paths this CPU picks by default against the AVX2 paths forced with `SPECULA_NO_VNNI=1 SPECULA_NO_AVX512=1`
//! (what a machine without AVX-512 runs). The registry models cover different kernels: smollm2 Q4_1 + Q8_0, the
//! Qwen 0.5B Q5_0 + Q8_0 + Q4_K + Q6_K, the Qwen 1.5B Q4_K + Q6_K.
//!
//! Checked to fail (2026-12-01): with the VNNI Q8_0 kernel's weight offset off by one bit (xor 0x81 instead of
//! 0x80), selftest finds smollm2's Q8_0 LM head off the reference and the run fails; the greedy tokens of a
//! 32-token generation, which this test compared at first, did not change.

use std::process::Command;

fn selftest(model: &str, force_avx2: bool) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r.json");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_specula"));
    cmd.args([
        "selftest",
        "-m",
        model,
        "-t",
        "2",
        "--json",
        report.to_str().unwrap(),
    ]);
    if force_avx2 {
        cmd.env("SPECULA_NO_VNNI", "1")
            .env("SPECULA_NO_AVX512", "1");
    } else {
        cmd.env_remove("SPECULA_NO_VNNI")
            .env_remove("SPECULA_NO_AVX512");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{model}: {}{} (run `specula fetch {model}` first?)",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap()
}

#[test]
fn avx512_and_avx2_kernel_paths_give_the_same_logits_on_real_models() {
    let default_paths = selftest("smollm2-135m", false)["kernel_paths"].clone();
    let has_vnni = default_paths
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p == "avx512-vnni");
    if !has_vnni {
        eprintln!(
            "WARNING: this CPU runs kernel paths {default_paths}: without AVX-512 VNNI this test compares AVX2 \
             with AVX2 and checks nothing about the VNNI kernels"
        );
        assert!(
            std::env::var_os("SPECULA_REQUIRE_VNNI").is_none(),
            "SPECULA_REQUIRE_VNNI is set but this CPU cannot run the VNNI kernels"
        );
    }
    for model in ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"] {
        let default = selftest(model, false);
        let avx2 = selftest(model, true);
        assert_eq!(
            avx2["kernel_paths"],
            serde_json::json!(["avx2"]),
            "the environment variables did not force the AVX2 kernels"
        );
        assert!(default["kernel_checks"].as_array().unwrap().len() >= 3);
        assert_eq!(
            default["logits_sha256"], avx2["logits_sha256"],
            "{model}: kernel paths {} and avx2 give different logits",
            default["kernel_paths"]
        );
    }
}
