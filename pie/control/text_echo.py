"""A host-side run's text, sent to the client as it is drawn (`inference.run-text`).

Why: a streamed answer through `run` wakes its inferlet once per token to take the token,
detokenize it and send the text — three host calls and a thread switch, ~0.35 ms of the
control process's CPU per token on a Zen 5 (16 streams x 64 tokens: 0.55 ms per token
woken every token, 0.18 woken every 16th; `control.stream_interval`, 2026-12-03). Here
the scheduler thread does what the inferlet did, at the step's settle: one incremental
detokenization (the tokenizers library's `DecodeStream`) and one message per token.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pie.control.errors import ErrorKind, HostError


class TextEcho:
    """Detokenizes a run's tokens and sends the text they add as `prefix + text + suffix`,
    holding back incomplete characters and anything that could begin a stop string."""

    def __init__(self, tokenizer: Tokenizer, send: Callable[[str], object], prefix: str, suffix: str,
                 as_json: bool, stop_strings: list[str], hidden: list[int]):
        if any(not s for s in stop_strings):
            raise HostError(ErrorKind.INVALID_ARGUMENT, "echo.stop-strings: a stop string is empty")
        self.tokenizer, self.send = tokenizer, send
        self.prefix, self.suffix, self.as_json = prefix, suffix, as_json
        self.stops, self.hidden = list(stop_strings), frozenset(hidden)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.stream = DecodeStream(skip_special_tokens=False)
        self.tokens: list[int] = []  # the visible tokens fed so far
        self.text = ""  # their text, complete characters only
        self.sent = 0  # characters of `text` sent
        self.cut = False  # a stop string ended the text
        self.closed = False

    def feed(self, token: int) -> bool:
        """Send what `token` adds to the text; True if it completes a stop string (the run
        ends with it)."""
        if self.cut or self.closed or token in self.hidden:
            return self.cut
        self.tokens.append(token)
        piece = self.stream.step(self.tokenizer, token)
        if not piece:
            return False  # an incomplete character (or nothing): held until it completes
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        cut = min((i for s in self.stops if (i := self.text.find(s, start)) >= 0), default=-1)
        if cut >= 0:
            self.cut = True
            self._send(cut)
            return True
        self._send(self._safe_end())
        return False

    def close(self) -> None:
        """The run has ended: send what was held (an incomplete character as U+FFFD, as
        detokenizing every token gives it), unless a stop string ended the text."""
        if self.closed:
            return
        self.closed = True
        if not self.cut:
            whole = self.tokenizer.decode(self.tokens, skip_special_tokens=False)
            if whole.startswith(self.text):
                self.text = whole
            self._send(len(self.text))

    def _safe_end(self) -> int:
        """Where the text may be sent up to: before the longest tail that begins a stop string."""
        end = len(self.text)
        for stop in self.stops:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if self.text.endswith(stop[:k]):
                    end = min(end, len(self.text) - k)
                    break
        return end

    def _send(self, end: int) -> None:
        if end <= self.sent:
            return
        piece = self.text[self.sent:end]
        self.sent = end
        self.send(self.prefix + (json.dumps(piece, ensure_ascii=False) if self.as_json else piece) + self.suffix)
