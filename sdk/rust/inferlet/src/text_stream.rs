//! Incremental detokenization: the text of a growing list of tokens, for streaming and for
//! watching stop strings, without detokenizing the whole list at every token.
//!
//! Detokenizing everything generated so far at each token costs O(n) per token on the host
//! (the list crosses the component boundary and the tokenizer decodes all of it: ~190 us of
//! control-process CPU per token at ~128 tokens, 8 streaming inferlets, 2 vCPUs). A
//! `TextStream` decodes a window of at most `WINDOW` recent tokens instead, as vLLM's
//! incremental detokenizer does: the window's text minus what of it was already emitted is
//! the new text, so a token whose text depends on its neighbours (a leading space, a
//! character split over byte tokens) comes out as the whole list would give it. Text that
//! ends in an incomplete character (U+FFFD) is held until the next token completes it.

use std::rc::Rc;

use crate::bindings::types::Error;
use crate::Queue;

/// Tokens the window may grow to before it moves up (one extra host call each time).
const WINDOW: usize = 16;
/// Tokens the moved window keeps before the next one, for their context.
const KEEP: usize = 4;

/// The text of tokens pushed one or a few at a time; see the module documentation.
pub struct TextStream {
    queue: Rc<Queue>,
    tokens: Vec<u32>,
    text: String,
    /// Where the window starts in `tokens`.
    start: usize,
    /// Bytes of the window's own text already in `text`.
    emitted: usize,
}

impl TextStream {
    /// An empty stream detokenizing with `queue`'s model.
    pub fn new(queue: &Rc<Queue>) -> Self {
        TextStream { queue: queue.clone(), tokens: Vec::new(), text: String::new(), start: 0, emitted: 0 }
    }

    /// Appends `tokens`; returns the text they add (empty while a character is incomplete).
    pub fn push(&mut self, tokens: &[u32]) -> Result<&str, Error> {
        let before = self.text.len();
        if tokens.is_empty() {
            return Ok("");
        }
        self.tokens.extend_from_slice(tokens);
        let window = self.queue.detokenize(&self.tokens[self.start..])?;
        if window.ends_with('\u{FFFD}') {
            return Ok("");
        }
        if window.len() >= self.emitted && window.is_char_boundary(self.emitted) {
            self.text.push_str(&window[self.emitted..]);
        } else {
            // The window's text no longer begins with what was emitted from it (a tokenizer
            // whose decoding is not append-only): take what the whole list adds.
            let whole = self.queue.detokenize(&self.tokens)?;
            if whole.len() > self.text.len() && whole.starts_with(self.text.as_str()) {
                self.text.push_str(&whole[before..]);
            }
        }
        self.emitted = window.len();
        if self.tokens.len() - self.start > WINDOW {
            self.start = self.tokens.len() - KEEP;
            self.emitted = self.queue.detokenize(&self.tokens[self.start..])?.len();
        }
        Ok(&self.text[before..])
    }

    /// The text so far (complete characters).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every token pushed.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The text with whatever is still held (an incomplete character as U+FFFD), as
    /// `Queue::detokenize` of every token pushed gives it.
    pub fn finish(mut self) -> Result<String, Error> {
        let window = self.queue.detokenize(&self.tokens[self.start..])?;
        if window.len() > self.emitted && window.is_char_boundary(self.emitted) {
            self.text.push_str(&window[self.emitted..]);
        }
        Ok(self.text)
    }
}
