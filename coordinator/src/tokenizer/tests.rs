//! Unit tests: hostile metadata (TESTING.md item 11), the algorithm details on small hand-made
//! vocabularies, and a no-panic property test. Parity with llama.cpp on real vocabularies is
//! coordinator/tests/tokenizer.rs.

use proptest::prelude::*;
use ternfleet_shared::gguf::{ArrayValue, GgufFile, GgufWriter, Value};

use super::*;

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

/// An SPM vocabulary: `<unk> <s> </s>`, the 256 byte tokens, then `extra` (text, score, type).
fn spm_spec(extra: &[(&str, f32, i32)]) -> TokenizerSpec {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut scores = vec![0.0, 0.0, 0.0];
    let mut types = vec![2, CONTROL, CONTROL];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(BYTE);
    }
    for &(t, s, ty) in extra {
        tokens.push(t.to_string());
        scores.push(s);
        types.push(ty);
    }
    TokenizerSpec {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        add_space_prefix: Some(false),
        ..Default::default()
    }
}

fn id_of(t: &Tokenizer, text: &str) -> u32 {
    t.token_id(text)
        .unwrap_or_else(|| panic!("{text:?} is in the test vocabulary"))
}

#[test]
fn spm_merges_highest_score_first_and_falls_back_to_bytes() {
    let t = Tokenizer::from_spec(spm_spec(&[
        ("a", -1.0, NORMAL),
        ("b", -1.0, NORMAL),
        ("ab", -5.0, NORMAL),
        ("bb", -2.0, NORMAL),
        ("abb", -3.0, NORMAL),
    ]))
    .expect("valid vocabulary");
    // "abb": "bb" (-2) beats "ab" (-5), then "a"+"bb" = "abb"
    assert_eq!(t.encode("abb", false, false), [id_of(&t, "abb")]);
    // "é" is not a token: its two UTF-8 bytes
    assert_eq!(t.encode("é", false, false), [3 + 0xC3, 3 + 0xA9]);
    assert_eq!(t.decode(&t.encode("aé", false, false)), "aé");
}

#[test]
fn spm_equal_scores_merge_leftmost_first() {
    let t = Tokenizer::from_spec(spm_spec(&[("a", -1.0, NORMAL), ("aa", -1.0, NORMAL)]))
        .expect("valid vocabulary");
    // "aaa": the pairs (0,1) and (1,2) tie; the left one merges, leaving "aa" "a"
    let aa = id_of(&t, "aa");
    let a = id_of(&t, "a");
    assert_eq!(t.encode("aaa", false, false), [aa, a]);
}

#[test]
fn spm_space_prefix_follows_specials_and_escapes_spaces() {
    let mut spec = spm_spec(&[
        ("▁a", -1.0, NORMAL),
        ("▁", -2.0, NORMAL),
        ("a", -3.0, NORMAL),
    ]);
    spec.add_space_prefix = Some(true);
    let t = Tokenizer::from_spec(spec).expect("valid vocabulary");
    let (sa, a) = (id_of(&t, "▁a"), id_of(&t, "a"));
    // BOS, then a space prefix on the first fragment and after a parsed special token
    assert_eq!(t.encode("a", true, false), [1, sa]);
    assert_eq!(t.encode("a</s>a", false, true), [sa, 2, sa]);
    // not parsed: "</s>" is text and falls back to bytes, no second prefix
    let ids = t.encode("a</s>a", false, false);
    assert_eq!(ids.first(), Some(&sa));
    assert_eq!(ids.last(), Some(&a));
    // llama_detokenize strips the prefix space of the first piece, but not after a removed BOS
    assert_eq!(t.detokenize(&[sa, sa], false, false), b"a a");
    assert_eq!(t.detokenize(&[1, sa], true, false), b" a");
    assert_eq!(t.decode(&[1, sa]), " a");
}

#[test]
fn user_defined_tokens_split_even_without_parse_special() {
    let t = Tokenizer::from_spec(spm_spec(&[
        ("\n\n", 0.0, USER_DEFINED),
        ("x", -1.0, NORMAL),
        ("<ctl>", 0.0, CONTROL),
    ]))
    .expect("valid vocabulary");
    let (nn, x, ctl) = (id_of(&t, "\n\n"), id_of(&t, "x"), id_of(&t, "<ctl>"));
    assert_eq!(t.encode("x\n\nx", false, false), [x, nn, x]);
    assert_eq!(t.encode("x<ctl>", false, true), [x, ctl]);
    assert_ne!(t.encode("x<ctl>", false, false), [x, ctl]);
    assert_eq!(t.token_to_piece(ctl, false), b"");
    assert_eq!(t.token_to_piece(ctl, true), b"<ctl>");
    assert_eq!(t.token_to_piece(nn, false), b"\n\n");
}

#[test]
fn phi3_special_tokens_eat_following_whitespace() {
    let mut spec = spm_spec(&[("<|end|>", 0.0, CONTROL), ("x", -1.0, NORMAL)]);
    spec.name = Some("Phi3".into());
    let t = Tokenizer::from_spec(spec).expect("valid vocabulary");
    let (end, x) = (id_of(&t, "<|end|>"), id_of(&t, "x"));
    // RSTRIP (llama-vocab.cpp, model name "phi-3"/"phi3"): the spaces and newline vanish
    assert_eq!(t.encode("x<|end|> \n x", false, true), [x, end, x]);
    assert!(t.is_eog(end));
}

#[test]
fn eog_set_includes_end_of_turn_like_llama_cpp() {
    let mut spec = spm_spec(&[
        ("<start_of_turn>", 0.0, CONTROL),
        ("<end_of_turn>", 0.0, CONTROL),
        ("<|im_end|>", 0.0, NORMAL),
    ]);
    spec.ids.eos = Some(2);
    let t = Tokenizer::from_spec(spec).expect("valid vocabulary");
    let eot = id_of(&t, "<end_of_turn>");
    let im_end = id_of(&t, "<|im_end|>");
    assert!(t.is_eog(2));
    assert!(t.is_eog(eot));
    assert!(t.is_eog(im_end));
    assert!(!t.is_eog(id_of(&t, "<start_of_turn>")));
    assert_eq!(t.eot(), Some(eot));
    // a control-looking NORMAL token becomes CONTROL, so it is parsed as special
    assert!(t.is_control(im_end));
    assert_eq!(t.eog_ids().collect::<Vec<_>>(), [2, eot, im_end]);
}

#[test]
fn clean_up_spaces_follows_llama_detokenize() {
    let mut v = b"Hello , world ! It 's a ' quoted ' thing . I 've".to_vec();
    clean_up_spaces(&mut v);
    assert_eq!(
        String::from_utf8_lossy(&v),
        "Hello, world! It's a'quoted'thing. I've"
    );
    // the NUL-overwrite quirk: the space dropped after a lone "'" no longer precedes the next
    let mut v = b"a ' ' b".to_vec();
    clean_up_spaces(&mut v);
    assert_eq!(String::from_utf8_lossy(&v), "a'' b");
}

// --- hostile metadata -------------------------------------------------------------------------

fn expect_err(spec: TokenizerSpec) -> TokenizerError {
    match Tokenizer::from_spec(spec) {
        Ok(_) => panic!("hostile vocabulary was accepted"),
        Err(e) => e,
    }
}

#[test]
fn eos_equal_to_n_vocab_is_rejected() {
    let mut spec = spm_spec(&[]);
    let n = spec.tokens.len() as u32;
    spec.ids.eos = Some(n);
    let e = expect_err(spec);
    assert!(
        matches!(e, TokenizerError::SpecialIdOutOfRange { id, n_vocab, .. } if id == n && n_vocab == n),
        "{e}"
    );
    let mut spec = spm_spec(&[]);
    spec.ids.bos = Some(u32::MAX);
    assert!(matches!(
        expect_err(spec),
        TokenizerError::SpecialIdOutOfRange { .. }
    ));
}

#[test]
fn default_special_ids_out_of_range_are_disabled() {
    // a 1-token SPM vocabulary: default BOS 1 / EOS 2 do not exist, and add_bos needs BOS
    let spec = TokenizerSpec {
        model: "llama".into(),
        tokens: vec!["a".into()],
        ..Default::default()
    };
    assert!(matches!(
        expect_err(spec),
        TokenizerError::MissingSpecial { token: "bos", .. }
    ));
    let spec = TokenizerSpec {
        model: "llama".into(),
        tokens: vec!["a".into()],
        add_bos: Some(false),
        ..Default::default()
    };
    let t = Tokenizer::from_spec(spec).expect("valid without BOS");
    assert_eq!((t.bos(), t.eos()), (None, None));
    // the default space prefix "▁" has no token and no byte tokens: each of its 3 bytes becomes
    // <unk> (id 0, the SPM default), where llama.cpp would throw
    assert_eq!(t.encode("a", true, true), [0, 0, 0, 0]);
}

#[test]
fn short_per_token_arrays_are_rejected() {
    let mut spec = spm_spec(&[]);
    spec.token_types.as_mut().expect("set").pop();
    assert!(matches!(
        expect_err(spec),
        TokenizerError::ArrayTooShort {
            key: "tokenizer.ggml.token_type",
            ..
        }
    ));
    let mut spec = spm_spec(&[]);
    spec.scores = Some(vec![0.0]);
    assert!(matches!(
        expect_err(spec),
        TokenizerError::ArrayTooShort {
            key: "tokenizer.ggml.scores",
            ..
        }
    ));
}

#[test]
fn malformed_byte_tokens_are_rejected() {
    for bad in [
        "<0x-1>", "<0xZZ>", "<0x1>", "<0x123>", "0x41", "<0x4G>", "<0x41",
    ] {
        let mut spec = spm_spec(&[]);
        spec.tokens[3 + 0x41] = bad.to_string();
        let e = expect_err(spec);
        assert!(
            matches!(&e, TokenizerError::InvalidByteToken { id: 68, text } if text == bad),
            "{bad}: {e}"
        );
    }
}

#[test]
fn unsupported_or_incomplete_vocabularies_are_rejected() {
    assert!(matches!(
        expect_err(TokenizerSpec::default()),
        TokenizerError::EmptyVocab
    ));
    let mut spec = spm_spec(&[]);
    spec.model = "t5".into();
    assert!(matches!(expect_err(spec), TokenizerError::UnsupportedModel(m) if m == "t5"));
    let bpe = |pre: &str, merges: Option<Vec<String>>| TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens: vec!["a".into(), "b".into(), "ab".into()],
        merges,
        ..Default::default()
    };
    assert!(matches!(
        expect_err(bpe("no-such-pre", Some(vec![]))),
        TokenizerError::UnsupportedPreTokenizer(p) if p == "no-such-pre"
    ));
    assert!(matches!(
        expect_err(bpe("qwen2", None)),
        TokenizerError::MissingKey {
            key: "tokenizer.ggml.merges"
        }
    ));
    // merges naming nothing in the vocabulary, or without a space, are harmless
    let t = Tokenizer::from_spec(bpe(
        "qwen2",
        Some(vec!["a b".into(), "nospace".into(), "x y".into()]),
    ))
    .expect("valid");
    assert_eq!(t.encode("ab", false, false), [2]);
    assert_eq!(t.encode("abc", false, false), [2]); // "c" has no token: dropped, as llama.cpp
}

/// A GGUF holding `kvs` only.
fn gguf_with(kvs: Vec<(&str, Value)>) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in kvs {
        w.add_kv(k, v).expect("valid test key");
    }
    GgufFile::from_bytes(w.to_bytes()).expect("valid test file")
}

fn base_kvs() -> Vec<(&'static str, Value)> {
    vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(false)),
        (
            "tokenizer.ggml.tokens",
            Value::Array(ArrayValue::String(vec![
                "<unk>".into(),
                "<s>".into(),
                "</s>".into(),
                "a".into(),
            ])),
        ),
    ]
}

#[test]
fn gguf_metadata_of_the_wrong_type_is_rejected() {
    let t = Tokenizer::from_gguf(&gguf_with(base_kvs())).expect("minimal SPM vocabulary loads");
    assert_eq!(t.n_vocab(), 4);
    assert_eq!(t.encode("a", true, false), [1, 3]);

    let cases: Vec<(&str, Value)> = vec![
        (
            "tokenizer.ggml.scores",
            Value::Array(ArrayValue::String(vec!["1".into(); 4])),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array(ArrayValue::U8(vec![0; 4])),
        ),
        ("tokenizer.ggml.scores", Value::F32(0.0)),
        (
            "tokenizer.ggml.token_type",
            Value::Array(ArrayValue::U32(vec![1; 4])),
        ),
        ("tokenizer.ggml.eos_token_id", Value::String("2".into())),
        ("tokenizer.ggml.eos_token_id", Value::I32(-1)),
        ("tokenizer.ggml.add_bos_token", Value::U8(1)),
        ("tokenizer.ggml.pre", Value::U32(0)),
        ("general.name", Value::Array(ArrayValue::U8(vec![]))),
    ];
    for (key, value) in cases {
        let mut kvs = base_kvs();
        kvs.push((key, value.clone()));
        match Tokenizer::from_gguf(&gguf_with(kvs)) {
            Err(TokenizerError::BadKey { key: k, .. }) => assert_eq!(k, key),
            other => panic!("{key} = {value:?}: expected BadKey, got {other:?}"),
        }
    }
    let no_model = gguf_with(base_kvs().split_off(1)); // tokens only
    assert!(matches!(
        Tokenizer::from_gguf(&no_model),
        Err(TokenizerError::MissingKey {
            key: "tokenizer.ggml.model"
        })
    ));
    let tokens_not_strings = gguf_with(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(ArrayValue::I32(vec![1, 2, 3])),
        ),
    ]);
    assert!(matches!(
        Tokenizer::from_gguf(&tokens_not_strings),
        Err(TokenizerError::BadKey {
            key: "tokenizer.ggml.tokens",
            ..
        })
    ));
    let mut kvs = base_kvs();
    kvs.push(("tokenizer.ggml.eos_token_id", Value::U32(4)));
    assert!(matches!(
        Tokenizer::from_gguf(&gguf_with(kvs)),
        Err(TokenizerError::SpecialIdOutOfRange {
            id: 4,
            n_vocab: 4,
            ..
        })
    ));
}

proptest! {
    /// Any vocabulary that loads tokenizes any text without panicking, and only emits ids
    /// inside the vocabulary.
    #[test]
    fn encode_never_panics_and_stays_in_vocab(
        words in proptest::collection::vec("[ab<>▁ \n]{1,4}", 1..12),
        types in proptest::collection::vec(0i32..8, 12),
        text in "[ab<>▁ \né]{0,24}",
        spm in any::<bool>(),
    ) {
        let n = words.len();
        let spec = if spm {
            TokenizerSpec {
                model: "llama".into(),
                tokens: words.clone(),
                scores: Some((0..n).map(|i| -(i as f32)).collect()),
                token_types: Some(types[..n].to_vec()),
                add_bos: Some(false),
                ..Default::default()
            }
        } else {
            let merges = words.iter().flat_map(|a| words.iter().map(move |b| format!("{a} {b}"))).collect();
            TokenizerSpec {
                model: "gpt2".into(),
                pre: Some("llama-bpe".into()),
                tokens: words.clone(),
                token_types: Some(types[..n].iter().map(|&t| if t == BYTE { NORMAL } else { t }).collect()),
                merges: Some(merges),
                add_bos: Some(false),
                ..Default::default()
            }
        };
        if let Ok(t) = Tokenizer::from_spec(spec) {
            for (add, parse) in [(false, false), (true, true)] {
                let ids = t.encode(&text, add, parse);
                prop_assert!(ids.iter().all(|&id| (id as usize) < t.n_vocab()));
                let _ = t.decode(&ids);
                let _ = t.detokenize(&ids, true, true);
            }
            let _ = t.token_to_piece(u32::MAX, true);
        }
    }
}
