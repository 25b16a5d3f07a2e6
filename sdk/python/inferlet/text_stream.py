"""Incremental detokenization: the text of a growing list of tokens, for streaming and for
watching stop strings, without detokenizing the whole list at every token.

Detokenizing everything generated so far at each token costs O(n) per token on the host (the
list crosses the component boundary and the tokenizer decodes all of it: ~190 us of
control-process CPU per token at ~128 tokens, 8 streaming inferlets, 2 vCPUs). A `TextStream`
decodes a window of at most WINDOW recent tokens instead, as vLLM's incremental detokenizer
does: the window's text minus what of it was already emitted is the new text, so a token whose
text depends on its neighbours (a leading space, a character split over byte tokens) comes out
as the whole list would give it. Text that ends in an incomplete character (U+FFFD) is held
until the next token completes it. The Rust SDK's `TextStream` is the same.
"""

from __future__ import annotations

WINDOW = 16  # tokens the window may grow to before it moves up (one extra host call each time)
KEEP = 4  # tokens the moved window keeps before the next one, for their context


class TextStream:
    """The text of tokens pushed one or a few at a time; see the module documentation."""

    def __init__(self, queue):
        self.queue = queue
        self.tokens: list[int] = []  # every token pushed
        self.text = ""  # the text so far (complete characters)
        self._start = 0  # where the window starts in `tokens`
        self._emitted = 0  # characters of the window's own text already in `text`

    def push(self, tokens: list[int]) -> str:
        """Appends `tokens`; returns the text they add (empty while a character is incomplete)."""
        if not tokens:
            return ""
        before = len(self.text)
        self.tokens += tokens
        window = self.queue.detokenize(self.tokens[self._start:])
        if window.endswith("\ufffd"):
            return ""
        if len(window) >= self._emitted:
            self.text += window[self._emitted:]
        else:
            # The window's text shrank (a tokenizer whose decoding is not append-only): take
            # what the whole list adds.
            whole = self.queue.detokenize(self.tokens)
            if len(whole) > before and whole.startswith(self.text):
                self.text = whole
        self._emitted = len(window)
        if len(self.tokens) - self._start > WINDOW:
            self._start = len(self.tokens) - KEEP
            self._emitted = len(self.queue.detokenize(self.tokens[self._start:]))
        return self.text[before:]

    def finish(self) -> str:
        """The text with whatever is still held (an incomplete character as U+FFFD), as
        `Queue.detokenize` of every token pushed gives it."""
        window = self.queue.detokenize(self.tokens[self._start:])
        return self.text + window[self._emitted:]
