//! Every architecture in the registry (`Arch::ALL`) through the real loader and one forward
//! pass, on a model file of that architecture: the registry cannot claim an architecture the
//! loader or the graph does not run.

use std::path::{Path, PathBuf};

use ternfleet_coordinator::model::{Arch, Logits, Model};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate lives in the workspace")
        .to_path_buf()
}

/// The test model of each architecture.
fn model_of(a: Arch) -> PathBuf {
    let rel = match a {
        Arch::Llama => "tests/data/models/tiny-mixtral-q8_0.gguf",
        Arch::Qwen2 => "tests/data/models/tiny-qwen2-f16.gguf",
        Arch::Qwen3 => "tests/data/models/tiny-qwen3-f16.gguf",
        Arch::Gemma3 => "models/gemma-3-270m-q4_k_m.gguf",
        Arch::Qwen2Moe => "tests/data/models/tiny-qwen2moe-q8_0.gguf",
        Arch::Qwen3Moe => "tests/data/models/tiny-qwen3moe-q8_0.gguf",
    };
    root().join(rel)
}

#[test]
fn every_registered_architecture_loads_and_runs() {
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global();
    let mut ran = 0;
    for a in Arch::ALL {
        let path = model_of(a);
        if !path.exists() {
            ternfleet_shared::testing::skip(a.name(), &format!("{} not present", path.display()));
            continue;
        }
        let m = Model::open(&path).unwrap_or_else(|e| panic!("{a:?}: {e}"));
        assert_eq!(m.cfg.arch, a, "{}", path.display());
        let toks = m.tokenizer.encode("The capital of France is", true, true);
        let mut cache = m.new_cache(toks.len());
        let logits = m
            .forward(&mut cache, &toks, Logits::Last)
            .unwrap_or_else(|e| panic!("{a:?}: {e}"));
        assert_eq!(logits.len(), m.cfg.n_vocab, "{a:?}");
        assert!(
            logits.iter().all(|l| l.is_finite()),
            "{a:?}: non-finite logits"
        );
        let spread = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            - logits.iter().copied().fold(f32::INFINITY, f32::min);
        assert!(spread > 0.0, "{a:?}: constant logits");
        ran += 1;
    }
    println!("architectures: {ran} of {} loaded and ran", Arch::ALL.len());
}
