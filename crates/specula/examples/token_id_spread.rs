//! How many tokens of some text have ids at or above a vocabulary prefix size (to size a draft vocabulary).
//! `cargo run --release --example token_id_spread -- MODEL FILE...`
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let loaded = specula::load_model(&args[1], false, &mut |_| {})?;
    let mut ids = Vec::new();
    for f in &args[2..] {
        ids.extend(loaded.tokenizer.encode(&std::fs::read_to_string(f)?)?);
    }
    for n in [8192u32, 16384, 32768, 65536] {
        let above = ids.iter().filter(|&&t| t >= n).count();
        println!(
            "prefix {n:6}: {above} of {} tokens above ({:.2}%)",
            ids.len(),
            100.0 * above as f64 / ids.len() as f64
        );
    }
    Ok(())
}
