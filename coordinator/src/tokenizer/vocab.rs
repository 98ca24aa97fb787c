//! The vocabulary: token texts, scores and attributes, the special ids and flags, validated once
//! from a [`TokenizerSpec`] the way `llama_vocab::impl::load` (llama-vocab.cpp) derives them.

use std::collections::{BTreeSet, HashMap};

use super::pretokenize::PreTokenizer;
use super::TokenizerError;

/// Token attribute bits (`llama_token_attr`, llama.h).
pub(crate) mod attr {
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    pub const LSTRIP: u16 = 1 << 7;
    pub const RSTRIP: u16 = 1 << 8;
}

/// `tokenizer.ggml.token_type` values (`llama_token_type`, llama.h).
mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Everything the tokenizer reads from a GGUF's `tokenizer.*` (and `general.name`) metadata, as
/// plain values. [`super::Tokenizer::from_gguf`] fills it; tests build it by hand.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"llama"` (SentencePiece BPE, "SPM") or `"gpt2"` (byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: the BPE pre-tokenizer name (`"llama-bpe"`, `"qwen2"`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (F32, or I32 converted): SPM merge priorities.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"`, highest priority first.
    pub merges: Option<Vec<String>>,
    /// The `tokenizer.ggml.*_token_id` keys present in the file.
    pub ids: SpecialIds,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`.
    pub add_space_prefix: Option<bool>,
    /// `general.name`: llama.cpp sets per-token strip attributes by model name (Phi-3).
    pub name: Option<String>,
}

/// Special token ids as stored in the file (`None`: key absent).
#[derive(Clone, Debug, Default)]
pub struct SpecialIds {
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`.
    pub eot: Option<u32>,
    /// `tokenizer.ggml.eom_token_id`.
    pub eom: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.seperator_token_id` (sic).
    pub sep: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// `tokenizer.ggml.mask_token_id`.
    pub mask: Option<u32>,
    /// `tokenizer.ggml.fim_pre_token_id` (or the deprecated `prefix_token_id`).
    pub fim_pre: Option<u32>,
    /// `tokenizer.ggml.fim_suf_token_id` (or the deprecated `suffix_token_id`).
    pub fim_suf: Option<u32>,
    /// `tokenizer.ggml.fim_mid_token_id` (or the deprecated `middle_token_id`).
    pub fim_mid: Option<u32>,
    /// `tokenizer.ggml.fim_pad_token_id`.
    pub fim_pad: Option<u32>,
    /// `tokenizer.ggml.fim_rep_token_id`.
    pub fim_rep: Option<u32>,
    /// `tokenizer.ggml.fim_sep_token_id`.
    pub fim_sep: Option<u32>,
}

/// The two tokenizer algorithms we implement (`llama_vocab_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VocabType {
    /// `LLAMA_VOCAB_TYPE_SPM`.
    Spm,
    /// `LLAMA_VOCAB_TYPE_BPE` with GPT-2 byte encoding.
    Bpe,
}

/// Validated vocabulary. Every id stored here is `< texts.len()`.
#[derive(Debug)]
pub(crate) struct Vocab {
    pub kind: VocabType,
    pub pre: PreTokenizer,
    pub texts: Vec<Box<str>>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u16>,
    /// Text -> id; for duplicate texts the last id wins (`token_to_id[word] = i`).
    pub token_to_id: HashMap<Box<str>, u32>,
    /// Ids of CONTROL / USER_DEFINED / UNKNOWN tokens, longest text first, ties by id.
    pub special_cache: Vec<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub eog: BTreeSet<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    pub clean_spaces: bool,
    pub ignore_merges: bool,
    /// Merge ranks keyed by `"left right"` (neither side contains a space in a byte-level vocab).
    pub bpe_ranks: HashMap<Box<str>, u32>,
}

/// Flags a BPE pre-tokenizer name implies (the `tokenizer_pre == ...` chain in
/// `llama_vocab::impl::load`); `None` for names we do not reproduce.
struct PreFlags {
    pre: PreTokenizer,
    ignore_merges: bool,
    clean_spaces: bool,
    add_bos: bool,
}

fn pre_flags(name: &str) -> Option<PreFlags> {
    use PreTokenizer as P;
    let f = |pre, ignore_merges, clean_spaces, add_bos| PreFlags {
        pre,
        ignore_merges,
        clean_spaces,
        add_bos,
    };
    Some(match name {
        "" | "default" => f(P::Default, false, true, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => f(P::Llama3, true, true, true),
        "dbrx" | "smaug-bpe" => f(P::Llama3, false, true, false),
        "falcon" => f(P::Falcon, false, true, false),
        "mpt" | "olmo" | "exaone4" | "jais" => f(P::Gpt2, false, true, false),
        // ("jina-v2-es"/"jina-v2-de" also map to GPT-2 but get an LSTRIP <mask>: not supported)
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "a.x-4.0" | "mellum"
        | "modern-bert" => f(P::Gpt2, false, true, false),
        "trillion" | "granite-docling" => f(P::Gpt2, false, false, false),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            f(P::Starcoder, false, true, false)
        }
        "command-r" | "smollm" => f(P::Starcoder, false, false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "hunyuan"
        | "solar-open" => f(P::Qwen2, false, false, false),
        "stablelm2" => f(P::Qwen2, false, true, false),
        "qwen35" => f(P::Qwen35, false, false, false),
        _ => return None,
    })
}

/// Parses a byte-fallback token `<0xHH>` (`llama_vocab::impl::token_to_byte`). llama.cpp uses
/// `strtol(text.substr(3, 2), 16)`, which turns `<0x-1>` into 0xFF and `<0xZZ>` into 0; we only
/// accept exactly two hex digits.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Texts llama.cpp recognises as end-of-generation tokens (`special_eog_ids`, llama-vocab.cpp).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

impl Vocab {
    /// Validates `spec` and derives ids, flags and attributes as `llama_vocab::impl::load` does.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Vocab, TokenizerError> {
        let n_tokens = spec.tokens.len();
        if n_tokens == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        // token ids are int32 in llama.cpp
        let n_vocab = u32::try_from(n_tokens)
            .ok()
            .filter(|&n| n <= i32::MAX as u32)
            .ok_or(TokenizerError::TooManyTokens { n_tokens })?;

        // determine vocab type and its defaults
        let (kind, mut bos, mut eos, mut unk): (VocabType, Option<u32>, Option<u32>, Option<u32>);
        let mut pre = PreTokenizer::Default;
        let (mut add_space_prefix, mut add_bos, mut add_eos, clean_spaces, ignore_merges);
        match spec.model.as_str() {
            "llama" => {
                kind = VocabType::Spm;
                (bos, eos, unk) = (Some(1), Some(2), Some(0));
                (
                    add_space_prefix,
                    add_bos,
                    add_eos,
                    clean_spaces,
                    ignore_merges,
                ) = (true, true, false, false, false);
            }
            "gpt2" => {
                kind = VocabType::Bpe;
                (bos, eos, unk) = (Some(11), Some(11), None);
                let name = spec.pre.as_deref().unwrap_or("");
                let flags = pre_flags(name)
                    .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer(name.to_string()))?;
                pre = flags.pre;
                (
                    add_space_prefix,
                    add_bos,
                    add_eos,
                    clean_spaces,
                    ignore_merges,
                ) = (
                    false,
                    flags.add_bos,
                    false,
                    flags.clean_spaces,
                    flags.ignore_merges,
                );
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        }
        if let Some(v) = spec.add_space_prefix {
            add_space_prefix = v;
        }

        // merges: `bpe_ranks.emplace(make_pair(first, second), i)` keeps the first rank of a
        // duplicate; a merge without a space at index >= 1 becomes the pair ("", "").
        let mut bpe_ranks = HashMap::new();
        if kind == VocabType::Bpe {
            let merges = spec.merges.as_ref().ok_or(TokenizerError::MissingKey {
                key: "tokenizer.ggml.merges",
            })?;
            bpe_ranks.reserve(merges.len());
            for (rank, merge) in merges.iter().enumerate() {
                let rank = u32::try_from(rank).map_err(|_| TokenizerError::TooManyMerges)?;
                // `first + " " + second` is the merge text itself when it has a space at >= 1.
                let key: Box<str> = match merge.bytes().skip(1).position(|b| b == b' ') {
                    Some(_) => merge.as_str().into(),
                    None => " ".into(),
                };
                bpe_ranks.entry(key).or_insert(rank);
            }
        }

        let scores = match spec.scores {
            Some(s) if s.len() < n_tokens => {
                return Err(TokenizerError::ArrayTooShort {
                    key: "tokenizer.ggml.scores",
                    len: s.len(),
                    n_tokens,
                })
            }
            Some(mut s) => {
                s.truncate(n_tokens);
                s
            }
            None => vec![0.0; n_tokens],
        };
        let types = match spec.token_types {
            Some(t) if t.len() < n_tokens => {
                return Err(TokenizerError::ArrayTooShort {
                    key: "tokenizer.ggml.token_type",
                    len: t.len(),
                    n_tokens,
                })
            }
            t => t,
        };

        let mut texts = Vec::with_capacity(n_tokens);
        let mut attrs = Vec::with_capacity(n_tokens);
        let mut token_to_id = HashMap::with_capacity(n_tokens);
        for (i, word) in spec.tokens.into_iter().enumerate() {
            let id = i as u32; // i < n_vocab <= i32::MAX
            let word: Box<str> = if word.is_empty() {
                format!("[EMPTY_{i}]").into()
            } else {
                word.into()
            };
            let a = match types.as_ref().map(|t| t[i]) {
                None | Some(token_type::NORMAL) => attr::NORMAL,
                Some(token_type::UNKNOWN) => attr::UNKNOWN,
                Some(token_type::CONTROL) => attr::CONTROL,
                Some(token_type::USER_DEFINED) => attr::USER_DEFINED,
                Some(token_type::UNUSED) => attr::UNUSED,
                Some(token_type::BYTE) => attr::BYTE,
                Some(_) => 0, // LLAMA_TOKEN_ATTR_UNDEFINED
            };
            if a == attr::BYTE && parse_byte_token(&word).is_none() {
                return Err(TokenizerError::InvalidByteToken {
                    id,
                    text: word.to_string(),
                });
            }
            token_to_id.insert(word.clone(), id);
            texts.push(word);
            attrs.push(a);
        }

        // special ids: a default outside the vocabulary is disabled (as llama.cpp does); an id
        // read from the file outside it is an error (llama.cpp warns and keeps the default).
        let check = |key: &'static str, v: Option<u32>| -> Result<Option<u32>, TokenizerError> {
            match v {
                Some(id) if id >= n_vocab => {
                    Err(TokenizerError::SpecialIdOutOfRange { key, id, n_vocab })
                }
                v => Ok(v),
            }
        };
        let default = |v: Option<u32>| v.filter(|&id| id < n_vocab);
        let ids = &spec.ids;
        bos = check("tokenizer.ggml.bos_token_id", ids.bos)?.or(default(bos));
        eos = check("tokenizer.ggml.eos_token_id", ids.eos)?.or(default(eos));
        unk = check("tokenizer.ggml.unknown_token_id", ids.unk)?.or(default(unk));
        let mut eot = check("tokenizer.ggml.eot_token_id", ids.eot)?;
        let mut eom = check("tokenizer.ggml.eom_token_id", ids.eom)?;
        check("tokenizer.ggml.seperator_token_id", ids.sep)?;
        check("tokenizer.ggml.padding_token_id", ids.pad)?;
        check("tokenizer.ggml.mask_token_id", ids.mask)?;
        let mut fim_pre = check("tokenizer.ggml.fim_pre_token_id", ids.fim_pre)?;
        let mut fim_suf = check("tokenizer.ggml.fim_suf_token_id", ids.fim_suf)?;
        let mut fim_mid = check("tokenizer.ggml.fim_mid_token_id", ids.fim_mid)?;
        let mut fim_pad = check("tokenizer.ggml.fim_pad_token_id", ids.fim_pad)?;
        let mut fim_rep = check("tokenizer.ggml.fim_rep_token_id", ids.fim_rep)?;
        let mut fim_sep = check("tokenizer.ggml.fim_sep_token_id", ids.fim_sep)?;

        if let Some(v) = spec.add_bos {
            add_bos = v;
        }
        if let Some(v) = spec.add_eos {
            add_eos = v;
        }
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "add_bos_token",
                token: "bos",
            });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecial {
                flag: "add_eos_token",
                token: "eos",
            });
        }

        // Auto-detect EOT/EOM/FIM tokens by text. llama.cpp walks its unordered_map, so with
        // several candidates the pick is unspecified; we take the lowest id.
        fn make_control(id: u32, attrs: &mut [u16]) {
            attrs[id as usize] |= attr::CONTROL;
        }
        for (slot, candidates) in [
            (&mut eot, EOT_TEXTS),
            (&mut eom, EOM_TEXTS),
            (&mut fim_pre, FIM_PRE_TEXTS),
            (&mut fim_suf, FIM_SUF_TEXTS),
            (&mut fim_mid, FIM_MID_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_some() {
                continue;
            }
            let found = candidates
                .iter()
                .filter_map(|t| token_to_id.get(*t).copied())
                .min();
            if let Some(id) = found {
                *slot = Some(id);
                make_control(id, &mut attrs);
            }
        }
        let _ = (fim_pre, fim_suf, fim_mid);

        // control tokens whose text says "unused"
        for (a, text) in attrs.iter_mut().zip(&texts) {
            if *a & attr::CONTROL != 0 && text.contains("unused") {
                *a |= attr::UNUSED;
            }
        }

        // end-of-generation set
        let mut eog = BTreeSet::new();
        eog.extend(fim_pad);
        eog.extend(fim_rep);
        eog.extend(fim_sep);
        for text in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                eog.insert(id);
                make_control(id, &mut attrs);
            }
        }
        // gpt-oss: always render these
        for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = token_to_id.get(text) {
                attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        eog.extend(eos);
        eog.extend(eot);
        eog.extend(eom);
        // o200k_harmony / solar-open: "<|end|>" is not EOG when "<|return|>" + "<|call|>" (or
        // "<|calls|>" + "<|flush|>") are.
        {
            let has = |t: &str| eog.iter().any(|&id| &*texts[id as usize] == t);
            let end = eog
                .iter()
                .copied()
                .find(|&id| &*texts[id as usize] == "<|end|>");
            let call = has("<|call|>") || has("<|calls|>");
            if let Some(end) = end {
                if call && (has("<|return|>") || has("<|flush|>")) {
                    eog.remove(&end);
                    attrs[end as usize] = attr::USER_DEFINED;
                }
            }
        }
        // gemma4 / plamo: "</s>" is a normal token there
        {
            let marker = eog
                .iter()
                .any(|&id| matches!(&*texts[id as usize], "<|tool_response>" | "<|plamo:eos|>"));
            let s = eog
                .iter()
                .copied()
                .find(|&id| &*texts[id as usize] == "</s>");
            if let (true, Some(s)) = (marker, s) {
                eog.remove(&s);
                attrs[s as usize] = attr::NORMAL;
            }
        }

        // special tokens cache: llama.cpp std::sort()s by text length only (unstable); we break
        // ties by id.
        let mut special_cache: Vec<u32> = (0..n_vocab)
            .filter(|&id| {
                attrs[id as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        special_cache.sort_by_key(|&id| std::cmp::Reverse(texts[id as usize].len()));

        // per-token attributes by model name
        let name = spec.name.as_deref().unwrap_or("").to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for &id in &special_cache {
                attrs[id as usize] |= attr::RSTRIP;
            }
            if let Some(&id) = token_to_id.get("</s>") {
                attrs[id as usize] |= attr::RSTRIP;
            }
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(&id) = token_to_id.get(t) {
                    attrs[id as usize] &= !attr::RSTRIP;
                }
            }
        } else if name.contains("modern-bert") {
            if let Some(&id) = token_to_id.get("[MASK]") {
                attrs[id as usize] |= attr::LSTRIP;
            }
        }

        Ok(Vocab {
            kind,
            pre,
            texts,
            scores,
            attrs,
            token_to_id,
            special_cache,
            bos,
            eos,
            eot,
            eom,
            unk,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            ignore_merges,
            bpe_ranks,
        })
    }

    /// `llama_vocab::text_to_token`.
    pub fn text_to_token(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.texts.len()
    }
}
