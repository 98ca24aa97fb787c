//! Bundles: `convert` of native MoE and dense (MoEfied) models, loading them back, refusing
//! corrupt ones, resuming an interrupted conversion.

use std::path::{Path, PathBuf};

use ternfleet_coordinator::convert::{convert, ConvertOptions, ExpertType};
use ternfleet_coordinator::kv_cache::SeqOptions;
use ternfleet_coordinator::model::{LoadError, Logits, Model};
use ternfleet_shared::bundle::{BundleError, Manifest};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crate is in the workspace")
        .to_owned()
}

fn model(name: &str) -> PathBuf {
    root().join("tests/data/models").join(name)
}

fn opts(src: &str, out: &Path) -> ConvertOptions {
    ConvertOptions {
        model: model(src),
        out: out.to_owned(),
        experts: None,
        top_k: None,
        calib: None,
        calib_tokens: 2048,
        expert_type: ExpertType::Keep,
        seed: 0,
        grouping: Default::default(),
    }
}

fn quiet(_: &str, _: u64, _: u64) {}

/// Greedy tokens for a prompt (no sampler: argmax of the last logits).
fn greedy(m: &Model, prompt: &str, n: usize) -> Vec<u32> {
    greedy_k(m, None, prompt, n)
}

/// [`greedy`] with `top_experts` experts per token.
fn greedy_k(m: &Model, top_experts: Option<usize>, prompt: &str, n: usize) -> Vec<u32> {
    let toks = m.tokenizer.encode(prompt, true, true);
    let opts = SeqOptions {
        top_experts,
        ..SeqOptions::default()
    };
    let mut cache = m.new_cache_with(toks.len() + n, opts);
    let mut logits = m.forward(&mut cache, &toks, Logits::Last).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let (best, _) = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            );
        out.push(best as u32);
        logits = m.forward(&mut cache, &[best as u32], Logits::Last).unwrap();
    }
    out
}

const PROMPTS: [&str; 2] = [
    "The capital of France is",
    "This License applies to any program",
];

#[test]
fn native_moe_bundle_runs_exactly_like_its_gguf() {
    for name in ["tiny-qwen2moe-q8_0.gguf", "tiny-mixtral-q8_0.gguf"] {
        let dir = tempfile::tempdir().unwrap();
        let r = convert(&opts(name, dir.path()), &quiet).unwrap();
        assert_eq!(r.reused, 0);
        let m = &r.manifest;
        assert_eq!(m.experts.len(), m.n_layer * m.moe.n_expert);
        let a = Model::open(&model(name)).unwrap();
        let b = Model::open(dir.path()).unwrap();
        for p in PROMPTS {
            let toks = a.tokenizer.encode(p, true, true);
            let la = a
                .forward(&mut a.new_cache(toks.len()), &toks, Logits::From(0))
                .unwrap();
            let lb = b
                .forward(&mut b.new_cache(toks.len()), &toks, Logits::From(0))
                .unwrap();
            assert_eq!(la, lb, "{name}: {p:?}: logits differ");
            assert_eq!(greedy(&a, p, 12), greedy(&b, p, 12), "{name}: {p:?}");
        }
    }
}

#[test]
fn moefied_bundle_with_every_expert_is_the_dense_model() {
    // f16 weights: gathering neurons is exact, so only the order of the expert sums differs.
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts("tiny-llama-f16.gguf", dir.path());
    o.experts = Some(4);
    o.calib = Some(root().join("tests/data/text/python-reference.txt"));
    let r = convert(&o, &quiet).unwrap();
    assert_eq!(r.manifest.moe.n_expert, 4);
    assert_eq!(r.manifest.provenance.method, "moefied");
    for l in 0..r.manifest.n_layer {
        // Equal-sized experts covering every neuron once.
        let sizes: Vec<&Vec<u64>> = r
            .manifest
            .experts
            .iter()
            .filter(|e| e.layer == l)
            .map(|e| &e.tensors[0].dims)
            .collect();
        assert!(sizes.iter().all(|d| d[1] == 128), "{sizes:?}");
    }
    let dense = Model::open(&model("tiny-llama-f16.gguf")).unwrap();
    let moe = Model::open(dir.path()).unwrap();
    for p in PROMPTS {
        assert_eq!(
            greedy(&dense, p, 16),
            greedy_k(&moe, Some(4), p, 16),
            "{p:?}"
        );
    }
    // Fewer experts is a different (cheaper) model, chosen per request.
    let toks = dense.tokenizer.encode(PROMPTS[0], true, true);
    let a = dense
        .forward(&mut dense.new_cache(toks.len()), &toks, Logits::Last)
        .unwrap();
    let one = SeqOptions {
        top_experts: Some(1),
        ..SeqOptions::default()
    };
    let b = moe
        .forward(
            &mut moe.new_cache_with(toks.len(), one),
            &toks,
            Logits::Last,
        )
        .unwrap();
    assert_ne!(a, b);
}

#[test]
fn corrupt_bundles_are_refused_with_the_file_named() {
    let dir = tempfile::tempdir().unwrap();
    let r = convert(&opts("tiny-qwen3moe-q8_0.gguf", dir.path()), &quiet).unwrap();
    let blob = dir.path().join(&r.manifest.experts[3].part.file);
    let good = std::fs::read(&blob).unwrap();

    // One flipped byte in an expert's weights.
    let mut bad = good.clone();
    let at = bad.len() - 100;
    bad[at] ^= 0x40;
    std::fs::write(&blob, &bad).unwrap();
    let e = Model::open(dir.path())
        .err()
        .expect("corrupt blob accepted");
    assert!(
        matches!(e, LoadError::Bundle(BundleError::ChecksumMismatch { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("expert.3.gguf"), "{e}");

    // A missing blob.
    std::fs::remove_file(&blob).unwrap();
    let e = Model::open(dir.path())
        .err()
        .expect("missing blob accepted");
    assert!(
        matches!(e, LoadError::Bundle(BundleError::MissingPart { .. })),
        "{e}"
    );
    std::fs::write(&blob, &good).unwrap();
    Model::open(dir.path()).expect("restored bundle loads");

    // A manifest that does not describe the parts: blobs 3 and 4 swapped in the manifest
    // (checksums follow the files, so only the blob's own layer/expert keys can tell).
    let mut m = Manifest::read(dir.path()).unwrap();
    let (p3, p4) = (m.experts[3].part.clone(), m.experts[4].part.clone());
    m.experts[3].part = p4;
    m.experts[4].part = p3;
    m.write(dir.path()).unwrap();
    let e = Model::open(dir.path())
        .err()
        .expect("swapped blobs accepted");
    assert!(
        matches!(e, LoadError::Bundle(BundleError::Mismatch { .. })),
        "{e}"
    );

    // A manifest with another tensor type than the blob holds.
    let mut m = r.manifest.clone();
    m.experts[0].tensors[0].ty = "q4_0".into();
    m.write(dir.path()).unwrap();
    let e = Model::open(dir.path())
        .err()
        .expect("type mismatch accepted");
    assert!(e.to_string().contains("q4_0"), "{e}");

    // Another layer count than the coordinator part has.
    let mut m = r.manifest.clone();
    m.n_layer = 1;
    m.experts.truncate(m.moe.n_expert);
    m.write(dir.path()).unwrap();
    let e = Model::open(dir.path())
        .err()
        .expect("layer mismatch accepted");
    assert!(e.to_string().contains("layers"), "{e}");

    // No manifest: an unfinished conversion.
    std::fs::remove_file(dir.path().join("manifest.json")).unwrap();
    let e = Model::open(dir.path())
        .err()
        .expect("bundle without manifest accepted");
    assert!(e.to_string().contains("convert"), "{e}");
}

#[test]
fn an_interrupted_conversion_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts("tiny-qwen3moe-q8_0.gguf", dir.path());
    let first = convert(&o, &quiet).unwrap();
    let total = first.written;
    // Simulate a crash after most parts: the manifest and two blobs are gone.
    std::fs::remove_file(dir.path().join("manifest.json")).unwrap();
    for e in &first.manifest.experts[5..7] {
        std::fs::remove_file(dir.path().join(&e.part.file)).unwrap();
    }
    let again = convert(&o, &quiet).unwrap();
    assert_eq!(again.written, 2);
    assert_eq!(again.reused, total - 2);
    assert_eq!(again.manifest, first.manifest);
    Model::open(dir.path()).unwrap();
}

#[test]
fn ternary_experts_convert_where_the_blocks_fit() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts("tiny-qwen3moe-q8_0.gguf", dir.path());
    o.expert_type = ExpertType::parse("tq2_0").unwrap();
    let r = convert(&o, &quiet).unwrap();
    let e0 = &r.manifest.experts[0];
    // gate/up rows are 256 wide (TQ2_0 blocks), down rows 64 wide (kept, with a note).
    assert_eq!(e0.tensors[0].ty, "tq2_0");
    assert_eq!(e0.tensors[1].ty, "tq2_0");
    assert_eq!(e0.tensors[2].ty, "q8_0");
    assert!(r
        .manifest
        .provenance
        .notes
        .iter()
        .any(|n| n.contains("kept as q8_0")));
    let m = Model::open(dir.path()).unwrap();
    assert_eq!(greedy(&m, PROMPTS[0], 4).len(), 4);
    assert!(ExpertType::parse("tq3").is_err());
}

#[test]
fn moefied_gemma_with_every_expert_is_the_dense_model() {
    // Gemma 3 270M dequantized to f16 (scripts/test.sh makes it with
    // scripts/dequantize-model.py): a float model, so its experts add up to the dense FFN to
    // the last rounding of the sum, and greedy decoding must not part from the dense model's.
    let src = root().join("models/gemma-3-270m-f16.gguf");
    if !src.exists() {
        ternfleet_shared::testing::skip(
            "MoEfied f16 Gemma",
            &format!("{} not present (run scripts/test.sh)", src.display()),
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let o = ConvertOptions {
        model: src.clone(),
        experts: Some(8),
        calib: Some(root().join("tests/data/text/python-reference.txt")),
        ..opts("unused", dir.path())
    };
    let r = convert(&o, &quiet).unwrap();
    assert_eq!(r.manifest.experts.len(), 18 * 8);
    let dense = Model::open(&src).unwrap();
    let moe = Model::open(dir.path()).unwrap();
    for p in [
        "The capital of France is",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village,",
        "Explain photosynthesis in simple terms:",
        "1, 1, 2, 3, 5, 8,",
        "Le café de la gare était",
    ] {
        assert_eq!(
            greedy(&dense, p, 32),
            greedy_k(&moe, Some(8), p, 32),
            "{p:?}"
        );
    }
}

/// gguf-py (an independent implementation of ggml's formats, whose TQ quantizers equal ggml's
/// reference ones byte for byte) reads a ternfleet expert blob, and quantizing the source
/// expert's weights itself gives the very bytes ternfleet wrote: ternfleet's TQ2_0/TQ1_0
/// tensors are what llama.cpp would write and read.
#[test]
fn ternary_blobs_are_the_bytes_ggml_would_write() {
    let ok = std::process::Command::new("timeout")
        .args(["30", "python3", "-c", "import gguf, numpy"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        ternfleet_shared::testing::skip(
            "ternary blobs vs gguf-py",
            "python3 with gguf/numpy not available",
        );
        return;
    }
    for ty in ["tq2_0", "tq1_0"] {
        let dir = tempfile::tempdir().unwrap();
        let mut o = opts("tiny-qwen3moe-q8_0.gguf", dir.path());
        o.expert_type = ExpertType::parse(ty).unwrap();
        let r = convert(&o, &quiet).unwrap();
        let e = &r.manifest.experts[5]; // layer 0, expert 5
        let blob = dir.path().join(&e.part.file);
        let script = format!(
            r#"
import sys, numpy as np, gguf
from gguf.quants import quantize, dequantize
T = gguf.GGMLQuantizationType.{up}
src = gguf.GGUFReader(sys.argv[1])
blob = gguf.GGUFReader(sys.argv[2])
for name, stacked in [("ffn_gate.weight", "blk.0.ffn_gate_exps.weight"), ("ffn_up.weight", "blk.0.ffn_up_exps.weight")]:
    t = next(t for t in blob.tensors if t.name == name)
    assert t.tensor_type == T, (name, t.tensor_type)
    s = next(t for t in src.tensors if t.name == stacked)
    w = dequantize(s.data, s.tensor_type)[5]          # expert 5, rows x cols f32
    want = quantize(w.astype(np.float32), T)
    got = np.asarray(t.data).reshape(want.shape)
    assert (got == want).all(), f"{{name}}: bytes differ from gguf-py's quantization"
    back = dequantize(got, T)
    assert back.shape == w.shape
print("ok")
"#,
            up = ty.to_uppercase()
        );
        let out = std::process::Command::new("timeout")
            .args(["120", "python3", "-c", &script])
            .arg(model("tiny-qwen3moe-q8_0.gguf"))
            .arg(&blob)
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
            "{ty}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
