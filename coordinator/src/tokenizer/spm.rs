//! SentencePiece-style BPE ("SPM", `tokenizer.ggml.model = "llama"`): `llm_tokenizer_spm_session`
//! in llama-vocab.cpp.
//!
//! The text (spaces already escaped to U+2581) starts as one symbol per UTF-8 character. Every
//! adjacent pair whose concatenation is a vocabulary token is a candidate; the candidate whose
//! token has the highest score is merged first, ties going to the leftmost pair. What is left
//! are tokens, except single characters that are not, which fall back to `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;

/// A symbol: the text span `[start, start + len)` and its neighbours in the linked list
/// (`llm_symbol`). `len == 0` marks a symbol merged into its left neighbour.
#[derive(Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

/// A merge candidate (`llm_bigram_spm`).
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// `llm_bigram_spm::comparator`: higher score first, then smaller `left`. Like the C++
    /// comparator, NaN scores compare equal to everything.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Tokenizes one raw-text fragment, already prefixed and whitespace-escaped, appending to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    if text.is_empty() {
        return;
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        let len = c.len_utf8();
        symbols.push(Symbol {
            prev: i.checked_sub(1),
            next: if start + len == text.len() {
                None
            } else {
                Some(i + 1)
            },
            start,
            len,
        });
    }

    let mut queue = BinaryHeap::new();
    let try_add = |queue: &mut BinaryHeap<Bigram>,
                   symbols: &[Symbol],
                   left: Option<usize>,
                   right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..r.start + r.len];
        if let Some(id) = vocab.text_to_token(piece) {
            queue.push(Bigram {
                left,
                right,
                score: vocab.scores[id as usize],
                size: piece.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(&mut queue, &symbols, Some(i - 1), Some(i));
    }

    while let Some(bigram) = queue.pop() {
        let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
        // one side already merged elsewhere: the candidate is stale
        if l.len == 0 || r.len == 0 || l.len + r.len != bigram.size {
            continue;
        }
        symbols[bigram.left].len += r.len;
        symbols[bigram.right].len = 0;
        symbols[bigram.left].next = r.next;
        if let Some(next) = r.next {
            symbols[next].prev = Some(bigram.left);
        }
        let left = symbols[bigram.left];
        try_add(&mut queue, &symbols, left.prev, Some(bigram.left));
        try_add(&mut queue, &symbols, Some(bigram.left), left.next);
    }

    // `resegment`: a merged symbol is always a token (it was only merged because it is one), so
    // llama.cpp's `rev_merge` walk is reached only by single characters that are not tokens, and
    // no merge text (two or more characters) can equal one; such a character becomes bytes.
    let mut i = Some(0);
    while let Some(idx) = i {
        let sym = symbols[idx];
        let piece = &text[sym.start..sym.start + sym.len];
        match vocab.text_to_token(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    if let Some(id) = byte_to_token(vocab, b) {
                        out.push(id);
                    }
                }
            }
        }
        i = sym.next;
    }
}

/// `llama_vocab::byte_to_token` for SPM: `<0xXX>`, else the byte as a one-byte token. Where
/// llama.cpp would throw (neither exists) we emit the unknown token if there is one.
fn byte_to_token(vocab: &Vocab, b: u8) -> Option<u32> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let name = [
        b'<',
        b'0',
        b'x',
        HEX[usize::from(b >> 4)],
        HEX[usize::from(b & 15)],
        b'>',
    ];
    let name = std::str::from_utf8(&name).expect("<0xHH> is ASCII");
    vocab
        .text_to_token(name)
        .or_else(|| {
            if b.is_ascii() {
                vocab.text_to_token(&(b as char).to_string())
            } else {
                None
            }
        })
        .or(vocab.unk)
}
