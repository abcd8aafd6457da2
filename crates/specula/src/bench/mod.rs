//! Measurement tools behind `specula bench` and `specula tune`.

pub mod prompts;
pub mod run;
pub mod tune;
pub mod verify_cost;

pub use prompts::{read_prompts, BadLines, BenchPrompt};
pub use run::{
    check_repetitions, run_bench, BenchConfig, BenchHead, BenchReport, BenchSpec, ConfigResult,
    DraftMethod, Progress,
};
pub use tune::{tune, TuneInput, TuneResult};
pub use verify_cost::{measure_forward_ms, measure_verify_cost, VerifyCost};
