//! Where a tokenizer's raw-text added tokens (the chat template's *markers*) stand in a text:
//! leftmost first, the longest of those starting there, as the tokenizer cuts.
//!
//! Most chat models' markers share an opening and a closing byte that stands nowhere else in
//! them (`<|eot_id|>`, `<|im_start|>`, `<tool_call>`, `<start_of_turn>`). Then a marker can
//! start only at the opening byte and ends at the first closing byte after it, so one scan for
//! the opening byte and one lookup per occurrence find them all. That reads a few cache lines
//! per marker, where an automaton over a few hundred markers walks a state per byte of each
//! (on a serving thread, whose caches hold other requests' streams, each a miss). Other
//! markers are found by an Aho-Corasick automaton.

use std::collections::HashMap;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};

/// A tokenizer's markers, ready to be found.
pub struct Markers(Finder);

enum Finder {
    /// Every marker starts with `open` and ends with `close`, which stands nowhere else in it.
    Delimited {
        open: u8,
        close: u8,
        /// The longest marker's length in bytes.
        longest: usize,
        /// Bit `n` set: a marker is `n` bytes long (bit 63: 63 or more), so that a candidate
        /// of another length is passed over without a lookup (text made of near misses).
        lengths: u64,
        ids: HashMap<Box<[u8]>, u32>,
    },
    Automaton {
        automaton: AhoCorasick,
        ids: Vec<u32>,
    },
}

/// One marker found: its bytes `start..end` in the text, and its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    pub start: usize,
    pub end: usize,
    pub id: u32,
}

impl Markers {
    /// For `markers` (text, id); None when there are none, or an automaton cannot be made.
    pub fn new(markers: &[(String, u32)]) -> Option<Self> {
        if markers.is_empty() {
            return None;
        }
        debug_assert!(
            {
                let mut texts: Vec<&str> = markers.iter().map(|(text, _)| text.as_str()).collect();
                texts.sort_unstable();
                texts.windows(2).all(|pair| pair[0] != pair[1])
            },
            "one id per marker text"
        );
        match delimiters(markers) {
            Some((open, close)) => Some(Self(Finder::Delimited {
                open,
                close,
                longest: markers.iter().map(|(text, _)| text.len()).max()?,
                lengths: markers
                    .iter()
                    .fold(0, |lengths, (text, _)| lengths | length_bit(text.len())),
                ids: markers
                    .iter()
                    .map(|(text, id)| (Box::from(text.as_bytes()), *id))
                    .collect(),
            })),
            None => Self::automaton(markers),
        }
    }

    /// Always the automaton (tests compare both ways).
    fn automaton(markers: &[(String, u32)]) -> Option<Self> {
        // A DFA: the markers are a few hundred short strings, and a prompt is scanned whole
        // on every request.
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .kind(Some(AhoCorasickKind::DFA))
            .build(markers.iter().map(|(text, _)| text.as_str()))
            .ok()?;
        Some(Self(Finder::Automaton {
            automaton,
            ids: markers.iter().map(|(_, id)| *id).collect(),
        }))
    }

    /// How many markers there are.
    pub fn len(&self) -> usize {
        match &self.0 {
            Finder::Delimited { ids, .. } => ids.len(),
            Finder::Automaton { ids, .. } => ids.len(),
        }
    }

    /// The markers in `text`, left to right, none overlapping (no allocation: this runs on
    /// every request).
    pub fn find_iter<'a>(&'a self, text: &'a str) -> FindIter<'a> {
        match &self.0 {
            Finder::Delimited {
                open,
                close,
                longest,
                lengths,
                ids,
            } => FindIter::Delimited(Delimited {
                text: text.as_bytes(),
                at: 0,
                open: *open,
                close: *close,
                longest: *longest,
                lengths: *lengths,
                ids,
                seen: None,
            }),
            Finder::Automaton { automaton, ids } => {
                FindIter::Automaton(automaton.find_iter(text), ids)
            }
        }
    }
}

/// [`Markers::find_iter`].
pub enum FindIter<'a> {
    Delimited(Delimited<'a>),
    Automaton(aho_corasick::FindIter<'a, 'a>, &'a [u32]),
}

impl Iterator for FindIter<'_> {
    type Item = Found;

    fn next(&mut self) -> Option<Found> {
        match self {
            FindIter::Delimited(delimited) => delimited.next(),
            FindIter::Automaton(found, ids) => found.next().map(|found| Found {
                start: found.start(),
                end: found.end(),
                id: ids[found.pattern().as_usize()],
            }),
        }
    }
}

/// The opening and closing bytes every marker has, when the closing one stands nowhere else
/// in any of them (and is not the opening one): then at most one marker starts at a position.
fn delimiters(markers: &[(String, u32)]) -> Option<(u8, u8)> {
    let (first, _) = markers.first()?;
    let (&open, &close) = (first.as_bytes().first()?, first.as_bytes().last()?);
    let fits = |text: &str| {
        let bytes = text.as_bytes();
        bytes.len() >= 2
            && bytes[0] == open
            && bytes[bytes.len() - 1] == close
            && !bytes[..bytes.len() - 1].contains(&close)
    };
    (open != close && markers.iter().all(|(text, _)| fits(text))).then_some((open, close))
}

/// [`Markers::find_iter`] for delimited markers.
pub struct Delimited<'a> {
    text: &'a [u8],
    at: usize,
    open: u8,
    close: u8,
    longest: usize,
    lengths: u64,
    ids: &'a HashMap<Box<[u8]>, u32>,
    /// The last search for a closing byte: from, to, the first found.
    seen: Option<(usize, usize, Option<usize>)>,
}

/// A length's bit in [`Finder::Delimited`]'s `lengths`.
fn length_bit(length: usize) -> u64 {
    1 << length.min(63)
}

impl Iterator for Delimited<'_> {
    type Item = Found;

    fn next(&mut self) -> Option<Found> {
        while self.at < self.text.len() {
            let start = self.at + position(&self.text[self.at..], self.open)?;
            // The only marker that can start here ends at the first closing byte after it.
            let most = (start + self.longest).min(self.text.len());
            let end = self.first_close(start + 1, most).map(|at| at + 1);
            if let Some(end) = end
                && self.lengths & length_bit(end - start) != 0
                && let Some(&id) = self.ids.get(&self.text[start..end])
            {
                self.at = end;
                return Some(Found { start, end, id });
            }
            self.at = start + 1;
        }
        None
    }
}

impl Delimited<'_> {
    /// The first closing byte in `from..to` (`from` never below an earlier call's), from what
    /// the last search saw where it can: a text of opening bytes costs one pass, not one
    /// search of up to the longest marker's length per byte.
    fn first_close(&mut self, from: usize, to: usize) -> Option<usize> {
        let search_from = match self.seen {
            // The first closing byte at or after `seen_from`, so also after `from`.
            Some((seen_from, _, Some(at))) if seen_from <= from && at >= from => {
                return (at < to).then_some(at);
            }
            // None in `seen_from..seen_to`.
            Some((seen_from, seen_to, None)) if seen_from <= from => {
                if to <= seen_to {
                    return None;
                }
                seen_to.max(from)
            }
            _ => from,
        };
        let found = position(&self.text[search_from..to], self.close).map(|at| search_from + at);
        self.seen = Some((from, to, found));
        found
    }
}

/// The first `byte` in `bytes` (a short slice read directly: in a run of opening bytes each
/// search is a byte or two, and a call per byte would cost more than the automaton).
fn position(bytes: &[u8], byte: u8) -> Option<usize> {
    match bytes.get(..16) {
        None => bytes.iter().position(|&found| found == byte),
        Some(head) => match head.iter().position(|&found| found == byte) {
            Some(at) => Some(at),
            None => memchr::memchr(byte, &bytes[16..]).map(|at| at + 16),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(markers: &Markers, text: &str) -> Vec<Found> {
        markers.find_iter(text).collect()
    }

    #[test]
    fn delimited_markers_are_found_as_the_automaton_finds_them() {
        let markers: Vec<(String, u32)> = [
            "<|eot_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<||>",
            "<<|x|>",
            "<tool_call>",
            "</tool_call>",
            "<|reserved_special_token_250|>",
        ]
        .iter()
        .enumerate()
        .map(|(id, text)| ((*text).to_owned(), id as u32 + 100))
        .collect();
        let fast = Markers::new(&markers).unwrap();
        assert!(matches!(fast.0, Finder::Delimited { .. }));
        let automaton = Markers::automaton(&markers).unwrap();
        // Pseudo-random texts of marker fragments, near misses and plain text.
        let parts = [
            "<",
            "|",
            ">",
            "<|",
            "|>",
            "a",
            " ",
            "é",
            "\n",
            "<|eot_id|>",
            "<|eot_id",
            "eot_id|>",
            "<|start_header_id|>",
            "<|end_header_id|",
            "<||>",
            "<<|x|>",
            "<|x|>",
            "<tool_call>",
            "</tool_call>",
            "<tool",
            "<|reserved_special_token_250|>",
            "<|reserved_special_token_2500|>",
            "<<",
            ">>",
        ];
        let mut state = 7_u64;
        for _ in 0..20_000 {
            let mut text = String::new();
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            for _ in 0..(state >> 60) + 1 {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                text.push_str(parts[(state >> 33) as usize % parts.len()]);
            }
            assert_eq!(all(&fast, &text), all(&automaton, &text), "{text:?}");
        }
        assert_eq!(
            all(&fast, "a<|eot_id|><<|x|>"),
            vec![
                Found {
                    start: 1,
                    end: 11,
                    id: 100
                },
                Found {
                    start: 11,
                    end: 17,
                    id: 104
                }
            ]
        );
    }

    #[test]
    fn random_delimited_marker_sets_are_found_as_the_automaton_finds_them() {
        // Marker sets drawn from a small alphabet with multi-byte characters, inside and as the
        // delimiters (DeepSeek's `<｜User｜>`, an opening `「`), over texts of the same
        // alphabet, so that near misses and overlaps are common.
        let alphabet = ["a", "b", "｜", "é", "<", "「", ">"];
        let mut state = 11_u64;
        let mut next = |bound: usize| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) as usize % bound
        };
        let mut delimited = 0;
        for _ in 0..300 {
            let (open, close) = [("<", ">"), ("「", "」"), ("<｜", "｜>")][next(3)];
            let mut markers: Vec<(String, u32)> = Vec::new();
            for id in 0..next(6) + 1 {
                let inner: String = (0..next(4))
                    .map(|_| alphabet[next(alphabet.len())])
                    .collect();
                let text = format!("{open}{inner}{close}");
                if !markers.iter().any(|(known, _)| *known == text) {
                    markers.push((text, id as u32));
                }
            }
            let fast = Markers::new(&markers).unwrap();
            delimited += usize::from(matches!(fast.0, Finder::Delimited { .. }));
            let automaton = Markers::automaton(&markers).unwrap();
            for _ in 0..50 {
                let mut text = String::new();
                for _ in 0..next(24) {
                    match next(4) {
                        0 => text.push_str(&markers[next(markers.len())].0),
                        1 => text.push_str(close),
                        _ => text.push_str(alphabet[next(alphabet.len())]),
                    }
                }
                assert_eq!(
                    all(&fast, &text),
                    all(&automaton, &text),
                    "{markers:?} {text:?}"
                );
            }
        }
        // Both kinds come up (a set is not delimited when a marker holds `>` inside).
        assert!((100..300).contains(&delimited), "{delimited}");
    }

    #[test]
    fn other_markers_take_the_automaton() {
        for markers in [
            // Two opening bytes; a closing byte inside a marker; one byte.
            vec!["<s>", "[INST]"],
            vec!["<a>b>"],
            vec!["<"],
        ] {
            let markers: Vec<(String, u32)> =
                markers.iter().map(|text| ((*text).to_owned(), 1)).collect();
            let found = Markers::new(&markers).unwrap();
            assert!(matches!(found.0, Finder::Automaton { .. }), "{markers:?}");
        }
        assert!(Markers::new(&[]).is_none());
    }
}
