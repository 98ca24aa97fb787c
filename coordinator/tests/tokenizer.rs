//! Tokenizer parity with llama.cpp: for every reference file tests/data/tokenizer/<model>.json
//! (written by scripts/make-tokenizer-refs.py from llama.cpp's `llama-tokenize`), load the same
//! GGUF and check that `Tokenizer::encode` gives the same ids for every string of
//! tests/data/tokenizer/strings.json in every recorded flag configuration. Also: decode round
//! trips and encoding speed on the 262k-token Gemma 3 vocabulary.
//!
//! Models: Gemma 3 270M (SPM; models/, fetched by scripts/fetch-model.sh), two committed "mini"
//! byte-level BPE vocabularies (llama-bpe, qwen2), and llama.cpp's own vocab-only test files
//! (models/ggml-vocab-*.gguf of the llama-cpp-python sdist unpacked by
//! scripts/build-llama-cpp.sh). A model that is not on disk is reported as skipped.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::Value;
use ternfleet_coordinator::tokenizer::Tokenizer;
use ternfleet_shared::gguf::GgufFile;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn data(name: &str) -> PathBuf {
    root().join("tests/data/tokenizer").join(name)
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn strings() -> Vec<String> {
    read_json(&data("strings.json"))["strings"]
        .as_array()
        .expect("strings.json: \"strings\" is an array")
        .iter()
        .map(|s| s.as_str().expect("strings are strings").to_owned())
        .collect()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn load(path: &Path) -> Tokenizer {
    let f = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Compares every case of `ref_name`; panics listing the mismatches. Returns the tokenizer and
/// the model name, or `None` when the model is not on disk (reported as skipped).
fn check_reference(ref_name: &str) -> Option<(Tokenizer, String)> {
    let reference = read_json(&data(ref_name));
    let model = reference["model"].as_str().expect("model name").to_owned();
    let rel = reference["path"].as_str().expect("model path");
    let path = root().join(rel);
    if !path.exists() {
        ternfleet_shared::testing::skip(
            &format!("tokenizer {model}"),
            &format!("{rel} not present"),
        );
        return None;
    }
    let strings = strings();
    let t0 = Instant::now();
    let tok = load(&path);
    let load_time = t0.elapsed();
    let configs = reference["configs"].as_array().expect("configs");
    let cases = reference["cases"].as_array().expect("cases");
    let mut mismatches = Vec::new();
    let mut strings_ok = std::collections::BTreeMap::<usize, bool>::new();
    let mut n_pieces = 0;
    for case in cases {
        let i = case["string"].as_u64().expect("string index") as usize;
        let config_name = case["config"].as_str().expect("config name");
        let config = configs
            .iter()
            .find(|c| c["name"] == config_name)
            .unwrap_or_else(|| panic!("{ref_name}: config {config_name} not declared"));
        // llama-tokenize: common_tokenize(vocab, text, add_bos && !no_bos, parse_special)
        let add_special = tok.add_bos() && !config["no_bos"].as_bool().expect("no_bos");
        let parse_special = config["parse_special"].as_bool().expect("parse_special");
        let want: Vec<u32> = case["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| u32::try_from(v.as_u64().expect("id")).expect("id fits u32"))
            .collect();
        let got = tok.encode(&strings[i], add_special, parse_special);
        let mut ok = got == want;
        if let Some(pieces) = case.get("pieces_hex").and_then(Value::as_array) {
            // llama-tokenize prints common_token_to_piece(ctx, id), i.e. special = true
            for (&id, hex) in want.iter().zip(pieces) {
                let want_piece = hex.as_str().expect("hex piece");
                let got_piece = to_hex(&tok.token_to_piece(id, true));
                if got_piece != want_piece {
                    ok = false;
                    mismatches.push(format!(
                        "string {i}: token {id} piece: llama.cpp {want_piece}, ours {got_piece}"
                    ));
                }
            }
            n_pieces += pieces.len();
        }
        *strings_ok.entry(i).or_insert(true) &= ok;
        if !ok {
            mismatches.push(format!(
                "string {i} {:?} [{config_name}]\n  llama.cpp {want:?}\n  ours      {got:?}",
                strings[i]
            ));
        }
    }
    let n_ok = strings_ok.values().filter(|&&ok| ok).count();
    println!(
        "tokenizer: {n_ok}/{} strings match llama-tokenize ({model}; {} cases over {} flag configs, {n_pieces} token pieces; vocab {} tokens loaded in {:.0?})",
        strings_ok.len(),
        cases.len(),
        configs.len(),
        tok.n_vocab(),
        load_time,
    );
    assert!(
        mismatches.is_empty(),
        "{model}: {} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    Some((tok, model))
}

/// decode(encode(s)) == s for every string, with specials left unparsed. SPM models that add a
/// space prefix go through `detokenize`, which removes it as llama.cpp's detokenizer does.
fn check_round_trip(tok: &Tokenizer, model: &str) {
    let strings = strings();
    let space_prefix = tok.decode(&tok.encode("a", false, false)) == " a";
    let mut failures = Vec::new();
    for s in &strings {
        let ids = tok.encode(s, false, false);
        let back = if space_prefix {
            String::from_utf8_lossy(&tok.detokenize(&ids, false, false)).into_owned()
        } else {
            tok.decode(&ids)
        };
        if back != *s {
            failures.push(format!("{s:?} -> {ids:?} -> {back:?}"));
        }
    }
    println!(
        "tokenizer: decode(encode(s)) == s for {}/{} strings ({model})",
        strings.len() - failures.len(),
        strings.len()
    );
    assert!(
        failures.is_empty(),
        "{model}: round trip failed:\n{}",
        failures.join("\n")
    );
}

#[test]
fn gemma3_ids_match_llama_tokenize() {
    if let Some((tokenizer, model)) = check_reference("gemma-3-270m.json") {
        check_round_trip(&tokenizer, &model);
        // llama.cpp's EOG set for Gemma 3: <eos> and <end_of_turn>
        assert!(tokenizer.is_eog(1), "<eos>");
        assert_eq!(tokenizer.token_id("<end_of_turn>"), Some(106));
        assert!(tokenizer.is_eog(106), "<end_of_turn> ends generation");
        assert!(!tokenizer.is_eog(105), "<start_of_turn> does not");
        assert_eq!(
            (tokenizer.bos(), tokenizer.eos(), tokenizer.add_bos()),
            (Some(2), Some(1), true)
        );
    }
}

#[test]
fn llama_bpe_mini_ids_match_llama_tokenize() {
    assert!(
        data("llama-bpe-mini.gguf").exists(),
        "committed fixture llama-bpe-mini.gguf is missing"
    );
    if let Some((tokenizer, model)) = check_reference("llama-bpe-mini.json") {
        check_round_trip(&tokenizer, &model);
        let eot = tokenizer.token_id("<|eot_id|>").expect("<|eot_id|>");
        assert!(tokenizer.is_eog(eot));
    }
}

#[test]
fn qwen2_mini_ids_match_llama_tokenize() {
    assert!(
        data("qwen2-mini.gguf").exists(),
        "committed fixture qwen2-mini.gguf is missing"
    );
    if let Some((tokenizer, model)) = check_reference("qwen2-mini.json") {
        check_round_trip(&tokenizer, &model);
        let im_end = tokenizer.token_id("<|im_end|>").expect("<|im_end|>");
        assert!(tokenizer.is_eog(im_end));
    }
}

/// llama.cpp's own vocabulary test files: full-size SPM and BPE vocabularies of many families.
#[test]
fn llama_cpp_test_vocabularies_match_llama_tokenize() {
    let mut refs: Vec<String> = std::fs::read_dir(data(""))
        .expect("tests/data/tokenizer")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("ggml-vocab-") && n.ends_with(".json"))
        .collect();
    refs.sort();
    assert!(!refs.is_empty(), "no ggml-vocab-*.json reference files");
    let (mut checked, mut skipped) = (0, 0);
    for r in &refs {
        match check_reference(r) {
            Some((tokenizer, model)) => {
                checked += 1;
                check_round_trip(&tokenizer, &model);
            }
            None => skipped += 1,
        }
    }
    println!("tokenizer: {checked} llama.cpp test vocabularies checked, {skipped} skipped");
    assert!(checked > 0, "no llama.cpp test vocabulary could be checked (run scripts/build-llama-cpp.sh --source-only)");
}

/// 30 KB of mixed text through the 262k-token Gemma vocabulary round-trips (the time is
/// printed; speed is measured by benches, not asserted by tests).
#[test]
fn gemma3_encodes_30kb_and_decodes_it_back() {
    let path = root().join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        ternfleet_shared::testing::skip(
            "30 KB Gemma encode",
            "models/gemma-3-270m-q4_k_m.gguf not present",
        );
        return;
    }
    let tok = load(&path);
    let mut text = String::new();
    for s in strings().iter().cycle() {
        if text.len() >= 30_000 {
            break;
        }
        text.push_str(s);
        text.push('\n');
    }
    let t0 = Instant::now();
    let ids = tok.encode(&text, true, true);
    let elapsed = t0.elapsed();
    println!(
        "tokenizer: encoded {} bytes into {} tokens in {:.1} ms (gemma-3-270m)",
        text.len(),
        ids.len(),
        elapsed.as_secs_f64() * 1e3
    );
    assert_eq!(tok.decode(&tok.encode(&text, false, false)), text);
}
