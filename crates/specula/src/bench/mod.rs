//! Measurement tools behind `specula bench` and `specula tune`.

pub mod verify_cost;

pub use verify_cost::{measure_verify_cost, VerifyCost};
