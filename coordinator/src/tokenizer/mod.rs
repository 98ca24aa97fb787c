//! Text <-> token ids, exactly as llama.cpp computes them (src/llama-vocab.cpp, src/unicode.cpp).
//!
//! [`Tokenizer::from_gguf`] reads the `tokenizer.*` metadata of a GGUF file into a
//! [`TokenizerSpec`], validates it once (hostile vocabularies are typed errors, never panics) and
//! builds the lookup tables. [`Tokenizer::encode`] then follows `llama_vocab::impl::tokenize`:
//!
//! 1. special-token partition (`tokenizer_st_partition`): CONTROL / UNKNOWN tokens written in the
//!    text become their ids when `parse_special`; USER_DEFINED ones always do;
//! 2. each remaining text fragment goes to the model's algorithm: SentencePiece BPE (`spm`,
//!    `tokenizer.ggml.model = "llama"`, e.g. Gemma 3, Llama 2) or byte-level BPE (`bpe`,
//!    `"gpt2"`, e.g. Llama 3, Qwen2) behind a pre-tokenizer (`pretokenize`);
//! 3. BOS / EOS around it per the model's `add_bos_token` / `add_eos_token`.
//!
//! The other direction is [`Tokenizer::token_to_piece`] (`llama_token_to_piece`) and
//! [`Tokenizer::detokenize`] (`llama_detokenize`). What we do differently: llama.cpp aborts or
//! throws on a few malformed vocabularies (no byte token for a byte, unknown token ids); we
//! return typed errors at load time or emit nothing, as documented on each function.

mod bpe;
mod metadata;
mod pretokenize;
mod spm;
mod unicode_tables;
mod vocab;

use ternfleet_shared::gguf::GgufFile;
use thiserror::Error;

pub use vocab::{SpecialIds, TokenizerSpec};

use vocab::{attr, Vocab, VocabType};

/// A vocabulary that cannot be used, with the key or token at fault.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// A required metadata key is absent.
    #[error("GGUF key {key} is missing: the file has no usable tokenizer (reconvert it with llama.cpp's convert_hf_to_gguf.py)")]
    MissingKey { key: &'static str },
    /// A metadata key has the wrong type (or the GGUF reader refused it).
    #[error("GGUF key {key}: {reason}")]
    BadKey { key: &'static str, reason: String },
    /// `tokenizer.ggml.model` names an algorithm we do not implement.
    #[error("tokenizer.ggml.model = {0:?} is not supported (supported: \"llama\" (SPM), \"gpt2\" (BPE))")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer we do not reproduce.
    #[error("tokenizer.ggml.pre = {0:?} is not supported (supported: default, gpt-2, llama-bpe/llama3, qwen2, qwen35, starcoder, refact, command-r, falcon, mpt, olmo, dbrx, stablelm2, ...)")]
    UnsupportedPreTokenizer(String),
    /// `tokenizer.ggml.tokens` is empty.
    #[error("tokenizer.ggml.tokens is empty")]
    EmptyVocab,
    /// More tokens than an int32 token id can address.
    #[error(
        "tokenizer.ggml.tokens has {n_tokens} entries, more than token ids (int32) can address"
    )]
    TooManyTokens { n_tokens: usize },
    /// More merges than a u32 rank can hold.
    #[error("tokenizer.ggml.merges has more than 2^32 entries")]
    TooManyMerges,
    /// A per-token array is shorter than the token list.
    #[error("{key} has {len} entries but tokenizer.ggml.tokens has {n_tokens}")]
    ArrayTooShort {
        key: &'static str,
        len: usize,
        n_tokens: usize,
    },
    /// A special token id outside the vocabulary.
    #[error("{key} = {id} is outside the vocabulary (n_vocab = {n_vocab})")]
    SpecialIdOutOfRange {
        key: &'static str,
        id: u32,
        n_vocab: u32,
    },
    /// A BYTE-type token whose text is not `<0xHH>`.
    #[error("token {id} has type BYTE but its text {text:?} is not <0xHH> with two hex digits")]
    InvalidByteToken { id: u32, text: String },
    /// The model asks for a BOS/EOS token it does not define.
    #[error("tokenizer.ggml.{flag} is true but the vocabulary has no {token} token")]
    MissingSpecial {
        flag: &'static str,
        token: &'static str,
    },
}

/// A loaded tokenizer. Cheap to share (`&Tokenizer` is all the methods need).
#[derive(Debug)]
pub struct Tokenizer {
    vocab: Vocab,
}

/// A piece of the text during special-token partitioning: raw text or an already-found token.
#[derive(Clone, Copy, Debug)]
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// C `isspace` in the "C" locale, which `tokenizer_st_partition` uses for lstrip/rstrip.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

impl Tokenizer {
    /// Reads the tokenizer from a GGUF file's metadata (`llama_vocab::impl::load`).
    ///
    /// Every missing required key, key of the wrong type, array shorter than the token list,
    /// special id outside the vocabulary or malformed `<0xHH>` byte token is an error.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_spec(metadata::spec_from_gguf(f)?)
    }

    /// Builds a tokenizer from already-read metadata, validating it.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        Ok(Tokenizer {
            vocab: Vocab::from_spec(spec)?,
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.vocab.len()
    }

    /// The BOS token, if the vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    /// The EOS token, if the vocabulary has one.
    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// The end-of-turn token (`tokenizer.ggml.eot_token_id`, or found by text like `<end_of_turn>`).
    pub fn eot(&self) -> Option<u32> {
        self.vocab.eot
    }

    /// The end-of-message token (`tokenizer.ggml.eom_token_id`, or `<|eom_id|>`).
    pub fn eom(&self) -> Option<u32> {
        self.vocab.eom
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.vocab.add_eos
    }

    /// Whether `id` ends generation: EOS, EOT, EOM and every token llama.cpp puts in
    /// `special_eog_ids` (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`, `<|endoftext|>`, FIM
    /// pad/repo/sep, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.contains(&id)
    }

    /// The end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.vocab.eog.iter().copied()
    }

    /// Whether `id` is a CONTROL token (rendered only with `special = true`).
    pub fn is_control(&self, id: u32) -> bool {
        self.attr(id) & attr::CONTROL != 0
    }

    /// The token's vocabulary text (`llama_vocab_get_text`), `None` for an unknown id.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(|t| &**t)
    }

    /// The id of a token by its exact vocabulary text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.text_to_token(text)
    }

    fn attr(&self, id: u32) -> u16 {
        self.vocab.attrs.get(id as usize).copied().unwrap_or(0)
    }

    /// Tokenizes `text` like `llama_tokenize(vocab, text, add_special, parse_special)`.
    ///
    /// `add_special` adds BOS (and EOS) where the model's `add_bos_token` (`add_eos_token`) asks
    /// for it; `parse_special` turns CONTROL tokens written in the text (`<start_of_turn>`,
    /// `<bos>`) into their ids. USER_DEFINED tokens are always split out, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let v = &self.vocab;
        let fragments = if text.is_empty() {
            Vec::new()
        } else {
            self.partition_special(text, parse_special)
        };
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && v.add_bos {
            out.extend(v.bos); // from_spec guarantees Some when add_bos
        }
        match v.kind {
            VocabType::Spm => {
                // prefix with a space if the fragment follows BOS, a special token or nothing
                let mut is_prev_special = true;
                let mut buf = String::new();
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => {
                            buf.clear();
                            if v.add_space_prefix && is_prev_special {
                                buf.push('\u{2581}');
                            }
                            // llama_escape_whitespace
                            for c in t.chars() {
                                buf.push(if c == ' ' { '\u{2581}' } else { c });
                            }
                            spm::tokenize(v, &buf, &mut out);
                            is_prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            is_prev_special = true;
                        }
                    }
                }
            }
            VocabType::Bpe => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(t) => bpe::tokenize(v, t, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && v.add_eos {
            out.extend(v.eos);
        }
        out
    }

    /// `tokenizer_st_partition`: for each special token, longest text first, split every raw
    /// fragment at its non-overlapping occurrences (leftmost first). LSTRIP / RSTRIP tokens eat
    /// the C-whitespace before / after them.
    fn partition_special<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let v = &self.vocab;
        let mut fragments = vec![Fragment::Text(text)];
        let mut next = Vec::new();
        for &id in &v.special_cache {
            let a = v.attrs[id as usize];
            if !parse_special && a & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let pat: &str = &v.texts[id as usize];
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(pat)))
            {
                continue;
            }
            next.clear();
            for &fragment in &fragments {
                let Fragment::Text(mut rest) = fragment else {
                    next.push(fragment);
                    continue;
                };
                while let Some(pos) = rest.find(pat) {
                    let mut left = &rest[..pos];
                    if a & attr::LSTRIP != 0 {
                        left = left.trim_end_matches(|c: char| c.is_ascii() && is_c_space(c as u8));
                    }
                    if !left.is_empty() {
                        next.push(Fragment::Text(left));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[pos + pat.len()..];
                    if a & attr::RSTRIP != 0 {
                        rest =
                            rest.trim_start_matches(|c: char| c.is_ascii() && is_c_space(c as u8));
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            std::mem::swap(&mut fragments, &mut next);
        }
        fragments
    }

    /// The bytes of one token, like `llama_token_to_piece(vocab, id, buf, len, 0, special)`:
    /// byte-fallback tokens give their byte, SPM's `▁` becomes a space, byte-level BPE text is
    /// mapped back to bytes. CONTROL and UNKNOWN tokens give nothing unless `special`; so do
    /// unused/undefined tokens and ids outside the vocabulary.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        self.append_piece(id, special, &mut out);
        out
    }

    fn append_piece(&self, id: u32, special: bool, out: &mut Vec<u8>) {
        let v = &self.vocab;
        let Some(text) = v.texts.get(id as usize) else {
            return;
        };
        let a = v.attrs[id as usize];
        let attr_special = attr::UNKNOWN | attr::CONTROL;
        if !special && a & attr_special != 0 {
            return;
        }
        if a & (attr_special | attr::USER_DEFINED) != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if a & attr::NORMAL != 0 {
            match v.kind {
                // llama_unescape_whitespace
                VocabType::Spm => out.extend_from_slice(text.replace('\u{2581}', " ").as_bytes()),
                VocabType::Bpe => bpe::decode_text(text, out),
            }
        } else if a & attr::BYTE != 0 {
            // validated at load
            out.extend(vocab::parse_byte_token(text));
        }
    }

    /// The concatenated pieces of `ids` (`special = false`: control tokens vanish), as lossy
    /// UTF-8. Use this for the final text of a whole sequence; for streaming, collect
    /// [`Tokenizer::token_to_piece`] bytes and cut at UTF-8 boundaries.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = Vec::new();
        for &id in ids {
            self.append_piece(id, false, &mut out);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// `llama_detokenize(vocab, ids, .., remove_special, unparse_special)`: pieces, with the
    /// leading space of an SPM `add_space_prefix` model removed, BOS/EOS dropped when
    /// `remove_special`, and the `clean_up_tokenization_spaces` passes of BPE models applied.
    pub fn detokenize(&self, ids: &[u32], remove_special: bool, unparse_special: bool) -> Vec<u8> {
        let v = &self.vocab;
        let mut ids = ids;
        let mut remove_space = v.add_space_prefix;
        if remove_special && v.add_bos && !ids.is_empty() && Some(ids[0]) == v.bos {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && v.add_eos && ids.last().is_some_and(|&id| Some(id) == v.eos) {
            ids = &ids[..ids.len() - 1];
        }
        let mut text = Vec::new();
        for &id in ids {
            let start = text.len();
            self.append_piece(id, unparse_special, &mut text);
            if remove_space && text.get(start) == Some(&b' ') {
                text.remove(start);
            }
            remove_space = false;
        }
        if v.clean_spaces {
            clean_up_spaces(&mut text);
        }
        text
    }
}

#[cfg(test)]
mod tests;

/// The three `clean_spaces` passes of `llama_vocab::impl::detokenize`: drop the space before
/// `? ! . ,`, around a lone `'`, and before `'s 'm 're 've`.
fn clean_up_spaces(text: &mut Vec<u8>) {
    // first pass: " ?", " !", " .", " ,"
    let mut out: Vec<u8> = Vec::with_capacity(text.len());
    for (i, &x) in text.iter().enumerate() {
        if i > 0 && text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(x);
    }
    // second pass: " ' " -> "'"; llama.cpp overwrites the dropped space with NUL in place, so
    // it no longer counts as the space before a following "'"
    let mut t = std::mem::take(&mut out);
    let mut i = 0;
    while i < t.len() {
        let x = t[i];
        if i > 0 && x == b'\'' && i + 1 < t.len() && t[i - 1] == b' ' && t[i + 1] == b' ' {
            out.pop();
            out.push(x);
            t[i + 1] = 0;
            i += 2;
            continue;
        }
        out.push(x);
        i += 1;
    }
    // third pass: " 's", " 'm", " 're", " 've"
    let t = std::mem::take(&mut out);
    for (i, &x) in t.iter().enumerate() {
        if i > 0 && t[i - 1] == b' ' && x == b'\'' && i + 1 < t.len() {
            let x1 = t[i + 1];
            let x2 = t.get(i + 2).copied();
            if matches!(x1, b's' | b'm')
                || (i + 2 < t.len() && matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e'))))
            {
                out.pop();
            }
        }
        out.push(x);
    }
    *text = out;
}
