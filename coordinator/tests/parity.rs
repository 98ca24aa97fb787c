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
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("crate lives in the workspace").to_path_buf()
}

fn refs(suffix: &str) -> Vec<(String, PathBuf)> {
    let dir = root().join("tests/data/refs");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).expect("tests/data/refs exists").flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(stem) = name.strip_suffix(suffix) {
            out.push((stem.to_string(), e.path()));
        }
    }
    out.sort();
    out
}

fn model_path(stem: &str) -> Option<PathBuf> {
    [root().join("tests/data/models").join(format!("{stem}.gguf")), root().join("models").join(format!("{stem}.gguf"))]
        .into_iter()
        .find(|p| p.exists())
}

fn set_threads() {
    let _ = rayon::ThreadPoolBuilder::new().num_threads(2).build_global();
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
            println!("skipped: {stem}: model not present (run scripts/fetch-model.sh)");
            continue;
        };
        let model = Model::open(&mp).unwrap_or_else(|e| panic!("{stem}: {e}"));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let items = v.get("cases").or(Some(&v)).and_then(|c| c.as_array()).expect("a list of cases");
        let (mut ok, mut total) = (0, 0);
        for item in items {
            let prompt = item["prompt"].as_str().expect("prompt");
            let want_prompt: Vec<u32> = serde_json::from_value(item["prompt_tokens"].clone()).expect("prompt_tokens");
            let want: Vec<u32> = serde_json::from_value(item["tokens"].clone()).expect("tokens");
            let n = item["n"].as_u64().map_or(want.len(), |n| n as usize);
            let got_prompt = model.tokenizer.encode(prompt, true, true);
            assert_eq!(got_prompt, want_prompt, "{stem}: prompt {prompt:?} tokenizes differently");
            let mut cache = model.new_cache(got_prompt.len() + n);
            let mut sampler = Sampler::new(SamplerParams { temperature: 0.0, ..Default::default() }).unwrap();
            let req = GenerateRequest { prompt_tokens: got_prompt, max_tokens: n, batch: 512, stop_at_eog: true };
            let g = generate(&model, &mut cache, &mut sampler, &req, |_| {}).unwrap();
            total += 1;
            if g.tokens == want {
                ok += 1;
            } else {
                let first = g.tokens.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(g.tokens.len().min(want.len()));
                failures.push(format!("{stem}: {prompt:?}: first difference at token {first}: got {:?} want {:?}", g.tokens, want));
            }
        }
        println!("greedy parity: {stem}: {ok}/{total} continuations identical to llama.cpp");
        checked += 1;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked > 0, "no model was present to check");
}

#[test]
fn perplexity_within_one_percent_of_llama_cpp() {
    set_threads();
    let mut checked = 0;
    for (stem, path) in refs(".ppl.json") {
        let Some(mp) = model_path(&stem) else {
            println!("skipped: {stem}: model not present (run scripts/fetch-model.sh)");
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let ctx = v["ctx"].as_u64().expect("ctx") as usize;
        let want = v["ppl"].as_f64().expect("ppl");
        let text_file = v["text"].as_str().unwrap_or("tests/data/text/gpl-3.txt");
        let text = std::fs::read_to_string(root().join(text_file)).expect("text file");
        let model = Model::open(&mp).unwrap();
        let r = ternfleet_coordinator::perplexity::perplexity(&model, &text, ctx, 512, None, |_, _| {}).unwrap();
        if let Some(chunks) = v["chunks"].as_u64() {
            assert_eq!(r.chunks as u64, chunks, "{stem}: chunk count differs from llama-perplexity");
        }
        let rel = (r.ppl - want).abs() / want;
        println!("perplexity: {stem}: ctx {ctx}: ternfleet {:.4} vs llama.cpp {want:.4} ({:+.3} %)", r.ppl, 100.0 * (r.ppl - want) / want);
        assert!(rel < 0.01, "{stem}: perplexity {} differs from llama.cpp's {want} by {:.2} %", r.ppl, rel * 100.0);
        checked += 1;
    }
    assert!(checked > 0, "no model was present to check");
}
