//! Parity with llama.cpp on real and generated models: greedy continuations token for token and
//! perplexity within 1 %, against the fixtures in tests/data/refs/ (made by
//! scripts/make-references.sh with llama.cpp built from the llama-cpp-python 0.3.36 sdist).
//!
//! Each `<name>.greedy.json` / `<name>.ppl.json` names its model by file stem: the GGUF is
//! `tests/data/models/<name>.gguf` (committed) or `models/<name>.gguf` (fetched by
//! scripts/fetch-model.sh). A missing model is reported as skipped, never as passed.

use std::path::{Path, PathBuf};

use ternfleet_coordinator::generate::{generate, GenerateRequest};
use ternfleet_coordinator::model::Model;
use ternfleet_coordinator::sampler::{Sampler, SamplerParams};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate lives in the workspace")
        .to_path_buf()
}

fn refs(suffix: &str) -> Vec<(String, PathBuf)> {
    let dir = root().join("tests/data/refs");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir)
        .expect("tests/data/refs exists")
        .flatten()
    {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(stem) = name.strip_suffix(suffix) {
            out.push((stem.to_string(), e.path()));
        }
    }
    out.sort();
    out
}

fn model_path(stem: &str) -> Option<PathBuf> {
    [
        root()
            .join("tests/data/models")
            .join(format!("{stem}.gguf")),
        root().join("models").join(format!("{stem}.gguf")),
    ]
    .into_iter()
    .find(|p| p.exists())
}

fn set_threads() {
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global();
}

#[test]
fn greedy_continuations_match_llama_cpp_token_for_token() {
    set_threads();
    let cases = refs(".greedy.json");
    assert!(!cases.is_empty(), "no greedy reference fixtures found");
    let mut checked = 0;
    let mut failures = Vec::new();
    for (stem, path) in cases {
        let Some(mp) = model_path(&stem) else {
            ternfleet_shared::testing::skip(
                stem.as_str(),
                "model not present (run scripts/fetch-model.sh)",
            );
            continue;
        };
        let model = Model::open(&mp).unwrap_or_else(|e| panic!("{stem}: {e}"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let items = v
            .get("cases")
            .or(Some(&v))
            .and_then(|c| c.as_array())
            .expect("a list of cases");
        let (mut ok, mut total, mut near_ties) = (0, 0, 0);
        for item in items {
            let prompt = item["prompt"].as_str().expect("prompt");
            let want_prompt: Vec<u32> =
                serde_json::from_value(item["prompt_tokens"].clone()).expect("prompt_tokens");
            let want: Vec<u32> = serde_json::from_value(item["tokens"].clone()).expect("tokens");
            let n = item["n"].as_u64().map_or(want.len(), |n| n as usize);
            let got_prompt = model.tokenizer.encode(prompt, true, true);
            assert_eq!(
                got_prompt, want_prompt,
                "{stem}: prompt {prompt:?} tokenizes differently"
            );
            let mut cache = model.new_cache(got_prompt.len() + n);
            let mut sampler = Sampler::new(SamplerParams {
                temperature: 0.0,
                ..Default::default()
            })
            .unwrap();
            let req = GenerateRequest {
                prompt_tokens: got_prompt,
                max_tokens: n,
                batch: 512,
                stop_at_eog: true,
                digest: false,
            };
            let g = generate(&model, &mut cache, &mut sampler, &req, |_| {}).unwrap();
            total += 1;
            if g.tokens == want {
                ok += 1;
                continue;
            }
            let first = g
                .tokens
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(g.tokens.len().min(want.len()));
            let top = &item["top"][first];
            let top1 = top[0][1].as_f64().unwrap_or(f64::MAX);
            let gap = top1 - top[1][1].as_f64().unwrap_or(0.0);
            // A near-tie within this model's documented logit tolerance (the f16 weight path
            // sums in our own order, ~5e-4 relative: docs/parity.md) may break either way;
            // on quantized models the tolerance is 1e-8, so only exact ties pass.
            if gap < 2.0 * logit_tol(&stem) * top1.abs().max(1.0) {
                near_ties += 1;
                println!("{stem}: {prompt:?}: near-tie at token {first} (llama.cpp top-2 gap {gap:.4} within the f16 tolerance): got {:?} want {want:?}", g.tokens);
                continue;
            }
            failures.push(format!(
                "{stem}: {prompt:?}: first difference at token {first} (llama.cpp top-2 gap {gap:.4}): got {:?} want {:?}",
                g.tokens, want
            ));
        }
        // Teacher-force llama.cpp's tokens and compare logits step by step too: the quantized
        // matmuls, RoPE, GELU and attention round like llama.cpp's x86 CPU backend, so on
        // quantized models the logits are equal, not just close (docs/parity.md).
        let worst = teacher_forced_logit_error(&model, items, &stem, &mut failures);
        println!("greedy parity: {stem}: {ok}/{total} continuations identical to llama.cpp ({near_ties} near-ties within tolerance); teacher-forced max |logit - llama.cpp| over top-5 = {worst:.2e}");
        checked += 1;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked > 0, "no model was present to check");
}

/// Largest tolerated |logit - llama.cpp| for the ids of llama.cpp's top-5 at any step, relative
/// to max(1, |logit|). The fixtures print logits to 9 significant digits (up to 5e-9 relative).
/// Quantized models' logits are llama.cpp's to the bit (their matmuls, RoPE, GELU and attention
/// round like llama.cpp's x86 CPU backend, on every ISA), so 1e-8 only admits the fixtures'
/// rounding: one f32 ulp (6e-8 to 1.2e-7 relative) fails, as the last layer's FFN run on
/// every prompt row instead of the rows that want logits did (up to 3.7e-7 on IQ2_XS).
/// f16-weight models agree to ~5e-4, because our f16 matmuls keep their own summation order
/// (llama.cpp's tinyBLAS one is not reproduced yet).
fn logit_tol(stem: &str) -> f64 {
    if stem.contains("f16") {
        2e-3
    } else {
        1e-8
    }
}
/// Where llama.cpp's top-1 leads its top-2 by more than this, our top-1 must agree.
const CONFIDENT_GAP: f64 = 1.0;

fn teacher_forced_logit_error(
    model: &Model,
    items: &[serde_json::Value],
    stem: &str,
    failures: &mut Vec<String>,
) -> f64 {
    use ternfleet_coordinator::model::Logits;
    let mut worst = 0f64;
    for item in items {
        let prompt: Vec<u32> = serde_json::from_value(item["prompt_tokens"].clone()).unwrap();
        let toks: Vec<u32> = serde_json::from_value(item["tokens"].clone()).unwrap();
        let top = item["top"].as_array().expect("top logits per step");
        let mut cache = model.new_cache(prompt.len() + toks.len() + 1);
        let mut logits = model.forward(&mut cache, &prompt, Logits::Last).unwrap();
        for (step, t5) in top.iter().enumerate().take(toks.len()) {
            let t5 = t5.as_array().unwrap();
            for e in t5 {
                let (id, l) = (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap());
                worst = worst.max((logits[id] as f64 - l).abs() / l.abs().max(1.0));
            }
            let gap = t5[0][1].as_f64().unwrap() - t5[1][1].as_f64().unwrap();
            let ours = ternfleet_coordinator::sampler::argmax(&logits);
            if gap > CONFIDENT_GAP && ours != toks[step] {
                failures.push(format!("{stem}: step {step}: llama.cpp is confident (gap {gap:.3}) in {} but we pick {ours}", toks[step]));
            }
            logits = model
                .forward(&mut cache, &[toks[step]], Logits::Last)
                .unwrap();
        }
    }
    if worst > logit_tol(stem) {
        failures.push(format!(
            "{stem}: logits differ from llama.cpp's by up to {worst:.3e} (> {:.0e}, relative)",
            logit_tol(stem)
        ));
    }
    worst
}

#[test]
fn perplexity_within_one_percent_of_llama_cpp() {
    set_threads();
    let mut checked = 0;
    for (stem, path) in refs(".ppl.json") {
        let Some(mp) = model_path(&stem) else {
            ternfleet_shared::testing::skip(
                stem.as_str(),
                "model not present (run scripts/fetch-model.sh)",
            );
            continue;
        };
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let ctx = v["ctx"].as_u64().expect("ctx") as usize;
        let want = v["ppl"].as_f64().expect("ppl");
        let text_file = v["text"].as_str().unwrap_or("tests/data/text/gpl-3.txt");
        let text = std::fs::read_to_string(root().join(text_file)).expect("text file");
        let model = Model::open(&mp).unwrap();
        let r = ternfleet_coordinator::perplexity::perplexity(
            &model,
            Default::default(),
            &text,
            ctx,
            512,
            None,
            |_, _, _| {},
        )
        .unwrap();
        if let Some(chunks) = v["chunks"].as_u64() {
            assert_eq!(
                r.chunks as u64, chunks,
                "{stem}: chunk count differs from llama-perplexity"
            );
        }
        let rel = (r.ppl - want).abs() / want;
        println!(
            "perplexity: {stem}: ctx {ctx}: ternfleet {:.4} vs llama.cpp {want:.4} ({:+.3} %)",
            r.ppl,
            100.0 * (r.ppl - want) / want
        );
        assert!(
            rel < 0.01,
            "{stem}: perplexity {} differs from llama.cpp's {want} by {:.2} %",
            r.ppl,
            rel * 100.0
        );
        if EXACT_PPL.contains(&stem.as_str()) {
            // llama-perplexity prints each running value to 4 decimals: ours must round to it.
            let want_chunks: Vec<f64> =
                serde_json::from_value(v["ppl_chunks"].clone()).expect("ppl_chunks");
            assert_eq!(want_chunks.len(), r.ppl_chunks.len(), "{stem}: chunk count");
            // Relative 1e-9 on top: the tiny models' perplexities are ~5e5, where 4 decimals
            // are 1e-10 of the value and one f32 ulp in one logit moves the 4th decimal.
            let off: Vec<String> = r
                .ppl_chunks
                .iter()
                .zip(&want_chunks)
                .enumerate()
                .filter(|(_, (got, want))| (*got - *want).abs() > 0.5e-4 + 1e-9 * want.abs())
                .map(|(i, (got, want))| format!("chunk {i}: {got:.6} vs {want:.4}"))
                .collect();
            assert!(
                off.is_empty(),
                "{stem}: running perplexity differs from llama.cpp's in {} of {} chunks: {}",
                off.len(),
                want_chunks.len(),
                off.join(", ")
            );
        }
        checked += 1;
    }
    assert!(checked > 0, "no model was present to check");
}

/// Models whose perplexity must equal llama-perplexity's to the digits it prints, chunk by
/// chunk (every quantized model; the f16 ones sum their matmuls in our own order).
const EXACT_PPL: &[&str] = &[
    "gemma-3-270m-q4_k_m",
    "tiny-llama-q8_0",
    "tiny-llama-q4_0",
    "tiny-llama-q4_k",
    "tiny-llama-q4_1",
    "tiny-llama-q5_1",
    "tiny-llama-q2_k",
    "tiny-llama-q3_k",
    "tiny-llama-iq4_nl",
    "tiny-llama-iq4_xs",
    "tiny-llama-iq3_xxs",
    "tiny-llama-iq2_xs",
    "tiny-llama-iq2_s",
    "tiny-llama-iq3_s",
    "tiny-llama-iq1_s",
    "tiny-llama-iq1_m",
    // Not tiny-llama-iq2_xxs: llama-perplexity's own results move with its batch size on the
    // IQ grid models (q2_K and q4_K do not move). Ours equal its default run in 128 of 129
    // chunks and overall, chunk 0 to 1.4e-9 relative (docs/quant-types.md); greedy tokens and
    // logits are exact.
    "tiny-mixtral-q8_0",
    "tiny-qwen3moe-q8_0",
    "tiny-qwen2moe-q8_0",
    "tiny-qwen3moe-tq2_0",
];
