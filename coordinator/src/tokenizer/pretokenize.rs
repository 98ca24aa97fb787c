//! BPE pre-tokenizers: split a text fragment into the words that BPE merges run inside.
//!
//! llama.cpp picks a list of regexes per `tokenizer.ggml.pre` (`llm_tokenizer_bpe` in
//! llama-vocab.cpp) and applies them one after another in `unicode_regex_split` (unicode.cpp),
//! each regex re-splitting the pieces of the previous one. The common regexes are not run as
//! regexes at all but by hand-written scanners (`unicode_regex_split_custom_gpt2`, `_llama3`,
//! `_qwen2`, `_qwen35`); the rest go through `std::regex` on a "collapsed" text where every
//! non-ASCII code point is replaced by one byte naming its category. We reproduce both: the
//! scanners line by line, and the few `std::regex` patterns we need as equivalent character-class
//! splitters (`split_runs`, `split_each`, `split_ascii_digit_triples`). Reproducing them, rather
//! than running the original regexes with `fancy-regex`, is what makes the word boundaries equal
//! llama.cpp's, including its known deviations from the Hugging Face regexes (e.g. `\s+(?!\S)`
//! at the end of a fragment).

use super::unicode_tables::RANGES;

/// `\p{N}`.
const NUMBER: u8 = 1;
/// `\p{L}`.
const LETTER: u8 = 2;
/// `\p{P}`.
const PUNCT: u8 = 4;
/// `\p{M}`.
const MARK: u8 = 8;
/// `\s`: llama.cpp's `unicode_set_whitespace` (the Unicode White_Space property).
const WHITESPACE: u8 = 32;
/// Set for every code point inside the text, so that "out of range" (flags 0, like
/// `unicode_cpt_flags{}` in the scanners) is distinguishable from "no category".
const DEFINED: u8 = 64;

/// Class bits of a code point, as `unicode_cpt_flags_from_cpt` reports them.
fn class_of(cp: u32) -> u8 {
    let i = RANGES.partition_point(|&(start, _)| start <= cp);
    // RANGES[0].0 == 0, so i >= 1 for every code point.
    RANGES[i.saturating_sub(1)].1 | DEFINED
}

/// Which splitting rules a BPE vocabulary uses (llama.cpp's `llama_vocab_pre_type`, restricted to
/// the ones we reproduce).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `LLAMA_VOCAB_PRE_TYPE_DEFAULT`: punctuation runs, then GPT-2, then digit runs, then ASCII
    /// digit triples.
    Default,
    /// `LLAMA_VOCAB_PRE_TYPE_GPT2` (also MPT, OLMo, ...): the GPT-2 regex alone.
    Gpt2,
    /// `LLAMA_VOCAB_PRE_TYPE_LLAMA3` (also DBRX, Smaug, ChatGLM4): the Llama 3 regex.
    Llama3,
    /// `LLAMA_VOCAB_PRE_TYPE_QWEN2` (also StableLM2): Llama 3's regex with single digits.
    Qwen2,
    /// `LLAMA_VOCAB_PRE_TYPE_QWEN35`: Qwen2's regex with combining marks inside letter runs.
    Qwen35,
    /// `LLAMA_VOCAB_PRE_TYPE_STARCODER` (also Refact, Command-R, SmolLM, ...): single digits, then
    /// GPT-2.
    Starcoder,
    /// `LLAMA_VOCAB_PRE_TYPE_FALCON`: punctuation runs (with backtick), GPT-2, ASCII digit
    /// triples.
    Falcon,
}

impl PreTokenizer {
    /// Splits `text` into words, in order; the words concatenate to `text`.
    pub fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let cpts: Vec<u32> = text.chars().map(u32::from).collect();
        let mut offsets = vec![cpts.len()];
        match self {
            PreTokenizer::Default => {
                offsets = split_runs(&cpts, &offsets, |c, k| {
                    k & PUNCT != 0 || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|')
                });
                offsets = split_gpt2(&cpts, &offsets);
                offsets = split_runs(&cpts, &offsets, |_, k| k & NUMBER != 0);
                offsets = split_ascii_digit_triples(&cpts, &offsets);
            }
            PreTokenizer::Gpt2 => offsets = split_gpt2(&cpts, &offsets),
            PreTokenizer::Llama3 => offsets = split_llama3(&cpts, &offsets, 3, false),
            PreTokenizer::Qwen2 => offsets = split_llama3(&cpts, &offsets, 1, false),
            PreTokenizer::Qwen35 => offsets = split_llama3(&cpts, &offsets, 1, true),
            PreTokenizer::Starcoder => {
                offsets = split_each(&cpts, &offsets, |_, k| k & NUMBER != 0);
                offsets = split_gpt2(&cpts, &offsets);
            }
            PreTokenizer::Falcon => {
                offsets = split_runs(&cpts, &offsets, |c, k| {
                    k & PUNCT != 0
                        || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|' | '`')
                });
                offsets = split_gpt2(&cpts, &offsets);
                offsets = split_ascii_digit_triples(&cpts, &offsets);
            }
        }
        // code point lengths -> byte slices
        let mut words = Vec::with_capacity(offsets.len());
        let mut chars = text
            .char_indices()
            .map(|(i, _)| i)
            .chain(std::iter::once(text.len()));
        let mut start_byte = chars.next().unwrap_or(0);
        for len in offsets {
            // `len` >= 1 for every offset the splitters emit.
            let mut end_byte = start_byte;
            for _ in 0..len {
                end_byte = chars.next().unwrap_or(text.len());
            }
            words.push(&text[start_byte..end_byte]);
            start_byte = end_byte;
        }
        words
    }
}

/// The view one scanner has of one piece `[ini, end)` of the code points: out-of-range positions
/// read as `OUT_OF_RANGE` / flags 0, like `_get_cpt` / `_get_flags` in unicode.cpp.
struct Piece<'a> {
    cpts: &'a [u32],
    ini: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<usize>,
}

const OUT_OF_RANGE: u32 = 0xFFFF_FFFF;

impl Piece<'_> {
    fn cpt(&self, pos: usize) -> u32 {
        if self.ini <= pos && pos < self.end {
            self.cpts[pos]
        } else {
            OUT_OF_RANGE
        }
    }

    fn flags(&self, pos: usize) -> u8 {
        if self.ini <= pos && pos < self.end {
            class_of(self.cpts[pos])
        } else {
            0
        }
    }

    /// `_add_token`: emits `[prev_end, end)` if non-empty, returns its length.
    fn add(&mut self, end: usize) -> usize {
        debug_assert!(self.prev_end <= end, "scanner went backwards");
        let len = end.saturating_sub(self.prev_end);
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }
}

/// Runs `scan` over every piece of `offsets`, collecting the new offsets.
fn for_each_piece(cpts: &[u32], offsets: &[usize], mut scan: impl FnMut(&mut Piece)) -> Vec<usize> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut start = 0;
    for &len in offsets {
        let mut piece = Piece {
            cpts,
            ini: start,
            end: start + len,
            prev_end: start,
            out: &mut out,
        };
        scan(&mut piece);
        start += len;
    }
    out
}

fn is_ascii_lower(cpt: u32, c: char) -> bool {
    // `unicode_tolower(cpt) == c` for the ASCII letters of the contractions: only the ASCII
    // upper-case letter maps to them in llama.cpp's `unicode_map_lowercase`.
    cpt == c as u32 || cpt == c.to_ascii_uppercase() as u32
}

/// The contraction alternative `'s|'t|'re|'ve|'m|'ll|'d` at `pos`, case-insensitively for the
/// Llama 3 family; returns the match end.
fn contraction(p: &Piece, pos: usize, ignore_case: bool) -> Option<usize> {
    if p.cpt(pos) != '\'' as u32 || pos + 1 >= p.end {
        return None;
    }
    let is = |cpt: u32, c: char| {
        if ignore_case {
            is_ascii_lower(cpt, c)
        } else {
            cpt == c as u32
        }
    };
    let next = p.cpt(pos + 1);
    if is(next, 's') || is(next, 't') || is(next, 'm') || is(next, 'd') {
        return Some(pos + 2);
    }
    if pos + 2 < p.end {
        let next2 = p.cpt(pos + 2);
        if (is(next, 'r') && is(next2, 'e'))
            || (is(next, 'v') && is(next2, 'e'))
            || (is(next, 'l') && is(next2, 'l'))
        {
            return Some(pos + 3);
        }
    }
    None
}

/// `unicode_regex_split_custom_gpt2`:
/// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
fn split_gpt2(cpts: &[u32], offsets: &[usize]) -> Vec<usize> {
    for_each_piece(cpts, offsets, |p| {
        let mut pos = p.ini;
        while pos < p.end {
            let cpt = p.cpt(pos);
            let flags = p.flags(pos);
            if let Some(end) = contraction(p, pos, false) {
                pos += p.add(end);
                continue;
            }
            let is_space = cpt == ' ' as u32;
            let mut flags2 = if is_space { p.flags(pos + 1) } else { flags };
            // <space>?\p{L}+
            if flags2 & LETTER != 0 {
                pos += usize::from(is_space);
                while flags2 & LETTER != 0 {
                    pos += 1;
                    flags2 = p.flags(pos);
                }
                p.add(pos);
                continue;
            }
            // <space>?\p{N}+
            if flags2 & NUMBER != 0 {
                pos += usize::from(is_space);
                while flags2 & NUMBER != 0 {
                    pos += 1;
                    flags2 = p.flags(pos);
                }
                p.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+
            if flags2 & (WHITESPACE | LETTER | NUMBER) == 0 && flags2 != 0 {
                pos += usize::from(is_space);
                while flags2 & (WHITESPACE | LETTER | NUMBER) == 0 && flags2 != 0 {
                    pos += 1;
                    flags2 = p.flags(pos);
                }
                p.add(pos);
                continue;
            }
            let mut num_whitespaces = 0;
            while p.flags(pos + num_whitespaces) & WHITESPACE != 0 {
                num_whitespaces += 1;
            }
            // \s+(?!\S)
            if num_whitespaces > 1 && p.cpt(pos + num_whitespaces) != OUT_OF_RANGE {
                pos += num_whitespaces - 1;
                p.add(pos);
                continue;
            }
            // \s+
            if num_whitespaces > 0 {
                pos += num_whitespaces;
                p.add(pos);
                continue;
            }
            // no match
            pos += 1;
            p.add(pos);
        }
    })
}

/// `unicode_regex_split_custom_llama3` (`max_digits` 3), `_qwen2` (`max_digits` 1) and `_qwen35`
/// (`max_digits` 1, `marks`: combining marks count as letters):
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
fn split_llama3(cpts: &[u32], offsets: &[usize], max_digits: usize, marks: bool) -> Vec<usize> {
    let letter = if marks { LETTER | MARK } else { LETTER };
    let is_crlf = |c: u32| c == '\r' as u32 || c == '\n' as u32;
    for_each_piece(cpts, offsets, |p| {
        let mut pos = p.ini;
        while pos < p.end {
            let cpt = p.cpt(pos);
            let flags = p.flags(pos);
            // (?i:'s|'t|'re|'ve|'m|'ll|'d)
            if let Some(end) = contraction(p, pos, true) {
                pos += p.add(end);
                continue;
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(is_crlf(cpt) || flags & NUMBER != 0)
                && (flags & letter != 0 || p.flags(pos + 1) & letter != 0)
            {
                pos += 1;
                while p.flags(pos) & letter != 0 {
                    pos += 1;
                }
                p.add(pos);
                continue;
            }
            // \p{N}{1,3}
            if flags & NUMBER != 0 {
                let mut ini = pos;
                while p.flags(pos) & NUMBER != 0 {
                    pos += 1;
                    if pos - ini >= max_digits {
                        p.add(pos);
                        ini = pos;
                    }
                }
                p.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let is_space = cpt == ' ' as u32;
            let mut flags2 = if is_space { p.flags(pos + 1) } else { flags };
            if flags2 & (WHITESPACE | letter | NUMBER) == 0 && flags != 0 {
                pos += usize::from(is_space);
                while flags2 & (WHITESPACE | letter | NUMBER) == 0 && flags2 != 0 {
                    pos += 1;
                    flags2 = p.flags(pos);
                }
                while is_crlf(p.cpt(pos)) {
                    pos += 1;
                }
                p.add(pos);
                continue;
            }
            let mut num_whitespaces = 0;
            let mut last_end_r_or_n = 0;
            while p.flags(pos + num_whitespaces) & WHITESPACE != 0 {
                if is_crlf(p.cpt(pos + num_whitespaces)) {
                    last_end_r_or_n = pos + num_whitespaces + 1;
                }
                num_whitespaces += 1;
            }
            // \s*[\r\n]+
            if last_end_r_or_n > 0 {
                pos = last_end_r_or_n;
                p.add(pos);
                continue;
            }
            // \s+(?!\S)
            if num_whitespaces > 1 && p.cpt(pos + num_whitespaces) != OUT_OF_RANGE {
                pos += num_whitespaces - 1;
                p.add(pos);
                continue;
            }
            // \s+
            if num_whitespaces > 0 {
                pos += num_whitespaces;
                p.add(pos);
                continue;
            }
            // no match
            pos += 1;
            p.add(pos);
        }
    })
}

/// Char-class predicate of the `std::regex` fallback: gets the code point and its class bits.
type ClassPred = fn(char, u8) -> bool;

fn matches_class(cpt: u32, pred: ClassPred) -> bool {
    let c = char::from_u32(cpt).unwrap_or(char::REPLACEMENT_CHARACTER);
    // `unicode_regex_split` keeps ASCII as is and maps other code points to a category byte;
    // whitespace wins over the category. For ASCII the class bits agree with the collapsed
    // regex's ASCII ranges (`k_ucat_map`), so one predicate serves both.
    let bits = class_of(cpt);
    let bits = if cpt >= 0x80 && bits & WHITESPACE != 0 {
        WHITESPACE
    } else {
        bits
    };
    pred(c, bits)
}

/// `unicode_regex_split_stl` for a pattern `[class]+`: maximal runs become pieces, and so do the
/// gaps between them.
fn split_runs(cpts: &[u32], offsets: &[usize], pred: ClassPred) -> Vec<usize> {
    for_each_piece(cpts, offsets, |p| {
        let mut pos = p.ini;
        while pos < p.end {
            let inside = matches_class(cpts[pos], pred);
            while pos < p.end && matches_class(cpts[pos], pred) == inside {
                pos += 1;
            }
            p.add(pos);
        }
    })
}

/// `unicode_regex_split_stl` for a pattern `[class]`: every matching code point is a piece, and
/// so is every gap between matches.
fn split_each(cpts: &[u32], offsets: &[usize], pred: ClassPred) -> Vec<usize> {
    for_each_piece(cpts, offsets, |p| {
        let mut pos = p.ini;
        while pos < p.end {
            if matches_class(cpts[pos], pred) {
                pos += 1;
            } else {
                while pos < p.end && !matches_class(cpts[pos], pred) {
                    pos += 1;
                }
            }
            p.add(pos);
        }
    })
}

/// `unicode_regex_split_stl` for `[0-9][0-9][0-9]`: leftmost non-overlapping triples of ASCII
/// digits are pieces, and so are the gaps between them.
fn split_ascii_digit_triples(cpts: &[u32], offsets: &[usize]) -> Vec<usize> {
    let digit = |c: u32| (u32::from('0')..=u32::from('9')).contains(&c);
    for_each_piece(cpts, offsets, |p| {
        let mut pos = p.ini;
        while pos < p.end {
            if pos + 3 <= p.end && cpts[pos..pos + 3].iter().all(|&c| digit(c)) {
                p.add(pos); // the gap before, if any
                pos += 3;
                p.add(pos);
            } else {
                pos += 1;
            }
        }
        p.add(p.end);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_match_llama_cpp_tables() {
        assert_eq!(class_of('a' as u32) & LETTER, LETTER);
        assert_eq!(class_of('7' as u32) & NUMBER, NUMBER);
        assert_eq!(class_of(' ' as u32) & WHITESPACE, WHITESPACE);
        assert_eq!(class_of(0x3000) & WHITESPACE, WHITESPACE); // ideographic space
        assert_eq!(class_of('!' as u32) & PUNCT, PUNCT);
        assert_eq!(class_of(0x301) & MARK, MARK); // combining acute
        assert_eq!(class_of('中' as u32) & LETTER, LETTER);
        assert_eq!(class_of('$' as u32) & (PUNCT | LETTER | NUMBER), 0);
    }

    #[test]
    fn llama3_splits_like_its_regex() {
        let w = PreTokenizer::Llama3.split("Hello world's 1234567  end\n\n x");
        assert_eq!(
            w,
            ["Hello", " world", "'s", " ", "123", "456", "7", " ", " end", "\n\n", " x"]
        );
    }

    #[test]
    fn gpt2_keeps_trailing_space_run_whole() {
        assert_eq!(PreTokenizer::Gpt2.split("a  b   "), ["a", " ", " b", "   "]);
    }

    proptest::proptest! {
        /// Every pre-tokenizer cuts the text into non-empty words that concatenate back to it.
        #[test]
        fn words_partition_the_text(text in "(\\PC|[ \t\r\n'0-9]){0,40}") {
            for pre in [
                PreTokenizer::Default,
                PreTokenizer::Gpt2,
                PreTokenizer::Llama3,
                PreTokenizer::Qwen2,
                PreTokenizer::Qwen35,
                PreTokenizer::Starcoder,
                PreTokenizer::Falcon,
            ] {
                let words = pre.split(&text);
                proptest::prop_assert!(words.iter().all(|w| !w.is_empty()), "{pre:?}: {words:?}");
                proptest::prop_assert_eq!(words.concat(), text.clone());
            }
        }
    }

    #[test]
    fn default_isolates_punctuation_and_digit_triples() {
        assert_eq!(
            PreTokenizer::Default.split("x=12345!"),
            ["x", "=", "123", "45", "!"]
        );
    }
}
