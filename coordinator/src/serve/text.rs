//! Streaming text out of generated tokens: pieces cut at UTF-8 boundaries, and stop strings
//! matched across token boundaries so that no part of a stop string is ever streamed.
//!
//! Every token's bytes go in ([`TextStream::push`]); what comes out is text that is safe to
//! send: whole UTF-8 characters, minus any tail that might still grow into a stop string. On a
//! match the text before it is released and the stream ends; at the end of generation
//! [`TextStream::finish`] releases what was held back.

/// What one push produced.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Text released by this push (may be empty).
    pub text: String,
    /// A stop string matched: generation must end here (its text is not in `text`).
    pub stopped: bool,
}

/// Incremental decoder and stop-string matcher for one generated sequence.
#[derive(Debug, Default)]
pub struct TextStream {
    stops: Vec<String>,
    /// Bytes of an incomplete UTF-8 character at the end of the last piece.
    partial: Vec<u8>,
    /// Decoded text not yet released (a possible start of a stop string).
    held: String,
    stopped: bool,
}

impl TextStream {
    /// A stream that ends at the first occurrence of any of `stops` (empty strings ignored).
    pub fn new(stops: &[String]) -> TextStream {
        TextStream {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..TextStream::default()
        }
    }

    /// Adds one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Pushed {
        if self.stopped {
            return Pushed {
                text: String::new(),
                stopped: true,
            };
        }
        self.partial.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.partial) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // An invalid sequence (not just an incomplete one) can never complete: replace it.
            Err(_) => {
                let s = String::from_utf8_lossy(&self.partial).into_owned();
                self.partial.clear();
                return self.add_text(&s);
            }
        };
        let rest = self.partial.split_off(valid);
        let text = String::from_utf8(std::mem::replace(&mut self.partial, rest))
            .expect("the first valid_up_to bytes are UTF-8");
        self.add_text(&text)
    }

    fn add_text(&mut self, text: &str) -> Pushed {
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return Pushed {
                text: out,
                stopped: true,
            };
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        Pushed {
            text: out,
            stopped: false,
        }
    }

    /// Ends the stream (length or end-of-generation): the text held back, with an incomplete
    /// trailing character replaced by U+FFFD.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.held);
        if !self.partial.is_empty() {
            out.push_str(&String::from_utf8_lossy(&self.partial));
            self.partial.clear();
        }
        self.stopped = true;
        out
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, on character
/// boundaries of `text`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = text.len().min(stop.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&n| {
            let start = text.len() - n;
            text.is_char_boundary(start) && stop.as_bytes().starts_with(&text.as_bytes()[start..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut t = TextStream::new(&stops);
        let mut out = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let r = t.push(p);
            out.push(r.text);
            if r.stopped {
                stopped = true;
                break;
            }
        }
        let tail = t.finish();
        (out, stopped, tail)
    }

    #[test]
    fn a_stop_string_split_over_tokens_is_never_streamed() {
        let (out, stopped, tail) = run(&["###"], &[b"Hello #", b"#", b"# world"]);
        assert_eq!(out, ["Hello ", "", ""]);
        assert!(stopped);
        assert_eq!(tail, "");
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let (out, stopped, tail) = run(&["###"], &[b"a #", b"#b", b"c"]);
        assert_eq!(out.concat(), "a ##bc");
        assert_eq!(out[0], "a ");
        assert!(!stopped);
        assert_eq!(tail, "");
    }

    #[test]
    fn text_before_the_earliest_of_several_stops_is_kept() {
        let (out, stopped, _) = run(&["END", "\n\n"], &[b"one\n\ntwo END"]);
        assert_eq!(out, ["one"]);
        assert!(stopped);
    }

    #[test]
    fn multibyte_characters_are_cut_only_at_boundaries() {
        let e = "é".as_bytes(); // 0xC3 0xA9
        let (out, _, tail) = run(&[], &[&[b'x', e[0]], &[e[1], b'y'], &[0xE2, 0x82]]);
        assert_eq!(out, ["x", "éy", ""]);
        assert_eq!(tail, "\u{FFFD}");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let (out, _, _) = run(&[], &[&[0xFF, b'a']]);
        assert_eq!(out, ["\u{FFFD}a"]);
    }

    #[test]
    fn a_held_prefix_is_flushed_at_the_end() {
        let (out, stopped, tail) = run(&["</s>"], &[b"done </"]);
        assert_eq!(out, ["done "]);
        assert!(!stopped);
        assert_eq!(tail, "</");
    }
}
