//! Token ids to streamed text: incremental detokenization plus stop strings.
//!
//! A stop string can span tokens, and a text piece can end with the first half of one. So the
//! assembler holds back the longest tail of the pending text that is a prefix of some stop string
//! and releases it only once the next piece shows it is not a stop. When a stop matches, the text
//! before it is released and nothing after it ever is.

use tandem_model::{IncrementalDecoder, ModelError, Tokenizer};

pub struct TextAssembler {
    decoder: IncrementalDecoder,
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

/// Text to send now, and whether a stop string ended the output.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Piece {
    pub text: String,
    pub stopped: bool,
    /// The stop string that ended the output, when one did.
    pub stop: Option<String>,
}

impl TextAssembler {
    pub fn new(skip_special: bool, stops: Vec<String>) -> Self {
        Self {
            decoder: IncrementalDecoder::new(skip_special),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Adds one token.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Piece, ModelError> {
        if self.stopped {
            return Ok(Piece::default());
        }
        let piece = self.decoder.push(tok, id)?;
        self.pending.push_str(&piece);
        Ok(self.release(false))
    }

    /// The end of the output: releases what was held back.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Piece, ModelError> {
        if self.stopped {
            return Ok(Piece::default());
        }
        let piece = self.decoder.finish(tok)?;
        self.pending.push_str(&piece);
        Ok(self.release(true))
    }

    fn release(&mut self, all: bool) -> Piece {
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first_stop {
            self.stopped = true;
            let stop = Some(stop.clone());
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return Piece {
                text,
                stopped: true,
                stop,
            };
        }
        let keep = if all { 0 } else { self.held_back() };
        let text: String = self.pending.drain(..self.pending.len() - keep).collect();
        Piece {
            text,
            stopped: false,
            stop: None,
        }
    }

    /// Length of the longest tail of `pending` that is a proper prefix of a stop string.
    fn held_back(&self) -> usize {
        let p = &self.pending;
        let mut keep = 0;
        for s in &self.stops {
            let longest = s.len().saturating_sub(1).min(p.len());
            for k in (keep + 1..=longest).rev() {
                let start = p.len() - k;
                if p.is_char_boundary(start) && s.is_char_boundary(k) && s.starts_with(&p[start..])
                {
                    keep = k;
                    break;
                }
            }
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds text pieces straight into the hold-back logic (no tokenizer needed).
    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut a = TextAssembler::new(true, stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            if a.stopped {
                break;
            }
            a.pending.push_str(p);
            let r = a.release(false);
            out.push(r.text);
            if r.stopped {
                return (out, true);
            }
        }
        let r = a.release(true);
        out.push(r.text);
        (out, r.stopped)
    }

    #[test]
    fn stop_spanning_pieces_is_trimmed_and_nothing_after_it_leaks() {
        let (out, stopped) = run(&["\n\nThe"], &[" Paris", ".", "\n", "\n", "The", " answer"]);
        assert!(stopped);
        assert_eq!(out.concat(), " Paris.");
        // The newlines were held back, not sent early.
        assert_eq!(out, vec![" Paris", ".", "", "", ""]);
    }

    #[test]
    fn a_false_start_is_released_when_the_next_piece_rules_it_out() {
        let (out, stopped) = run(&["END"], &["abc E", "N", "x", "yz"]);
        assert!(!stopped);
        assert_eq!(out, vec!["abc ", "", "ENx", "yz", ""]);
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_text_is_safe() {
        let (out, stopped) = run(&["é!", "ß"], &["Straße é", "!"]);
        assert!(stopped);
        assert_eq!(out.concat(), "Stra");
        let (out, stopped) = run(&["日本"], &["中国日", "語"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "中国日語");
        assert_eq!(out[0], "中国");
    }

    #[test]
    fn without_stops_everything_flows_at_once() {
        let (out, stopped) = run(&[], &["a", "b"]);
        assert!(!stopped);
        assert_eq!(out, vec!["a", "b", ""]);
    }
}
