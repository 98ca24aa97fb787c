//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): `llm_tokenizer_bpe_session` in
//! llama-vocab.cpp.
//!
//! A fragment is split into words by the pre-tokenizer, each word's UTF-8 bytes are mapped to
//! GPT-2's printable stand-in characters (`unicode_byte_to_utf8`), and inside each word adjacent
//! symbols are merged by merge rank, lowest rank first, ties going to the leftmost pair.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::OnceLock;

use super::vocab::Vocab;

/// GPT-2's byte -> character table (`unicode_byte_to_utf8_map` in unicode.cpp): printable
/// Latin-1 bytes stand for themselves, the other 68 bytes for U+0100.. in byte order.
fn byte_chars() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..=255u8 {
            let keep = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
            table[usize::from(b)] = if keep {
                char::from(b)
            } else {
                n += 1;
                char::from_u32(255 + n).expect("U+0100..U+0143 are chars")
            };
        }
        table
    })
}

/// The inverse table (`unicode_utf8_to_byte`): the byte a stand-in character encodes.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    static TABLE: OnceLock<[i16; 324]> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [-1i16; 324];
        for (b, &c) in byte_chars().iter().enumerate() {
            t[c as usize] = b as i16;
        }
        t
    });
    let v = *table.get(c as usize)?;
    u8::try_from(v).ok()
}

/// `unicode_byte_encoding_process`: the word's bytes as stand-in characters.
fn byte_encode(word: &str) -> String {
    let table = byte_chars();
    word.bytes().map(|b| table[usize::from(b)]).collect()
}

#[derive(Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

/// A merge candidate (`llm_bigram_bpe`).
struct Bigram {
    left: usize,
    right: usize,
    rank: u32,
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
    /// `llm_bigram_bpe::comparator` as a max-heap order: lower rank first, then smaller `left`.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Tokenizes one raw-text fragment, appending to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let mut key = String::new();
    let mut symbols: Vec<Symbol> = Vec::new();
    let mut queue = BinaryHeap::new();
    for word in vocab.pre.split(text) {
        let word = byte_encode(word);
        symbols.clear();
        queue.clear();

        if vocab.ignore_merges && vocab.text_to_token(&word).is_some() {
            symbols.push(Symbol {
                prev: None,
                next: None,
                start: 0,
                len: word.len(),
            });
        } else {
            for (i, (start, c)) in word.char_indices().enumerate() {
                let len = c.len_utf8();
                symbols.push(Symbol {
                    prev: i.checked_sub(1),
                    next: if start + len == word.len() {
                        None
                    } else {
                        Some(i + 1)
                    },
                    start,
                    len,
                });
            }
        }

        // `add_new_bigram`: the rank of (left, right) looked up as "left right"
        let mut add = |queue: &mut BinaryHeap<Bigram>,
                       symbols: &[Symbol],
                       left: Option<usize>,
                       right: Option<usize>| {
            let (Some(left), Some(right)) = (left, right) else {
                return;
            };
            let (l, r) = (symbols[left], symbols[right]);
            key.clear();
            key.push_str(&word[l.start..l.start + l.len]);
            key.push(' ');
            key.push_str(&word[r.start..r.start + r.len]);
            if let Some(&rank) = vocab.bpe_ranks.get(key.as_str()) {
                queue.push(Bigram {
                    left,
                    right,
                    rank,
                    size: l.len + r.len,
                });
            }
        };
        for i in 1..symbols.len() {
            add(&mut queue, &symbols, Some(i - 1), Some(i));
        }

        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // llama.cpp compares the texts; symbols only grow and start where they started, so
            // equal texts is equal lengths.
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
            add(&mut queue, &symbols, left.prev, Some(bigram.left));
            add(&mut queue, &symbols, Some(bigram.left), left.next);
        }

        for sym in symbols.iter().filter(|s| s.len > 0) {
            let piece = &word[sym.start..sym.start + sym.len];
            match vocab.text_to_token(piece) {
                Some(id) => out.push(id),
                None => {
                    // llama.cpp looks up each byte of the *encoded* piece as a one-byte token;
                    // only ASCII bytes can name one, the others are dropped.
                    for b in piece.bytes().filter(u8::is_ascii) {
                        if let Some(id) = vocab.text_to_token(&char::from(b).to_string()) {
                            out.push(id);
                        }
                    }
                }
            }
        }
    }
}

/// `llama_decode_text`: a BPE token's text back to bytes. A character outside the GPT-2 table
/// becomes `[UNK_BYTE_0x<its UTF-8 in hex><the whole token text>]`, as in llama.cpp.
pub(crate) fn decode_text(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[usize::from(b'A')], 'A');
        assert_eq!(t[usize::from(b' ')], 'Ġ'); // U+0120
        assert_eq!(t[usize::from(b'\n')], 'Ċ'); // U+010A
        assert_eq!(t[0], 'Ā');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[usize::from(b)]), Some(b));
        }
        assert_eq!(char_to_byte('中'), None);
    }
}
