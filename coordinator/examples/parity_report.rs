//! Diagnostic: teacher-force llama.cpp's greedy tokens through ternfleet and report, per step,
//! how far our logits are from the reference's top-5 (from `<model>.greedy.json`).
//!
//! `cargo run --release --example parity_report -- tests/data/refs/X.greedy.json MODEL.gguf`
use ternfleet_coordinator::model::{Logits, Model};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        args.len() >= 3,
        "usage: parity_report REFS.greedy.json MODEL.gguf [threads]"
    );
    let threads = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(2);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()?;
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&args[1])?)?;
    let model = Model::open(std::path::Path::new(&args[2]))?;
    for case in v["cases"].as_array().into_iter().flatten() {
        let prompt: Vec<u32> = serde_json::from_value(case["prompt_tokens"].clone())?;
        let toks: Vec<u32> = serde_json::from_value(case["tokens"].clone())?;
        let top = case["top"].as_array().cloned().unwrap_or_default();
        let mut cache = model.new_cache(prompt.len() + toks.len() + 1);
        let mut logits = model.forward(&mut cache, &prompt, Logits::Last)?;
        let mut worst = 0f32;
        let mut first_flip = None;
        for (step, t5) in top.iter().enumerate() {
            let t5 = t5.as_array().cloned().unwrap_or_default();
            let mut maxd = 0f32;
            for e in &t5 {
                let id = e[0].as_u64().unwrap_or(0) as usize;
                let l = e[1].as_f64().unwrap_or(0.0) as f32;
                maxd = maxd.max((logits[id] - l).abs());
            }
            worst = worst.max(maxd);
            if std::env::var("PARITY_VERBOSE").is_ok() {
                let ours: Vec<(usize, f32)> = t5
                    .iter()
                    .map(|e| {
                        let id = e[0].as_u64().unwrap_or(0) as usize;
                        (id, logits[id])
                    })
                    .collect();
                println!("  step {step}: ours {ours:?} ref {t5:?}");
            }
            let ours = ternfleet_coordinator::sampler::argmax(&logits);
            if step < toks.len() && ours != toks[step] && first_flip.is_none() {
                first_flip = Some(step);
            }
            if step < toks.len() {
                logits = model.forward(&mut cache, &[toks[step]], Logits::Last)?;
            }
        }
        println!(
            "{:<45} max |dlogit| over top-5: {worst:.4}  gap {:.4}  first argmax flip: {first_flip:?}",
            format!("{:?}", case["prompt"].as_str().unwrap_or("")),
            case["min_top1_top2_gap"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}
