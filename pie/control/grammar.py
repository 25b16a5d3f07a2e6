"""Grammar-constrained decoding on the control side, backed by llguidance.

A `GrammarCompiler` turns a JSON schema, regex, Lark or EBNF/GBNF grammar into a
`Matcher` for the model's tokenizer. The matcher tracks the tokens generated so far and
gives the bitmask of tokens allowed next, which rides along with a sample command to the
backend. Building llguidance's tokenizer takes ~0.4 s, so it happens once, on first use.
"""

from __future__ import annotations

import threading
from enum import StrEnum

import llguidance
import numpy as np

from pie import protocol as P
from pie.control.errors import ErrorKind, HostError

MAX_GRAMMAR_BYTES = 1 << 20  # sources above this are refused before compiling


class GrammarKind(StrEnum):
    """The `grammar-kind` enum of sdk/wit/grammar.wit, by its WIT case names."""

    JSON_SCHEMA = "json-schema"
    REGEX = "regex"
    LARK = "lark"
    EBNF = "ebnf"


_FORMATS = {GrammarKind.JSON_SCHEMA: "json_schema", GrammarKind.REGEX: "regex",
            GrammarKind.LARK: "lark", GrammarKind.EBNF: "ebnf"}


class Matcher:
    """One grammar's parse state over the tokens accepted so far."""

    def __init__(self, matcher: llguidance.LLMatcher, mask_bytes: int):
        self.matcher = matcher
        self.mask_bytes = mask_bytes
        self.id = 0  # set by the instance session that compiled it (fused passes name it so)

    def allowed_mask(self) -> bytes:
        """The bitmask of tokens that may come next (the protocol's `Sample.allowed`)."""
        return self.matcher.compute_bitmask()[: self.mask_bytes]

    def allowed_tokens(self) -> list[int]:
        bits = np.unpackbits(np.frombuffer(self.allowed_mask(), dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits).tolist()

    def accept(self, tokens: list[int]) -> None:
        """Advance over `tokens`; a token the grammar forbids changes nothing and fails."""
        valid = self.matcher.validate_tokens(tokens)
        if valid < len(tokens):
            raise HostError(ErrorKind.INVALID_ARGUMENT,
                            f"token {tokens[valid]} (at index {valid}) is not allowed by the grammar here")
        if not self.matcher.consume_tokens(tokens):
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"grammar: {self.matcher.get_error()}")

    def rollback(self, count: int) -> None:
        if not self.matcher.rollback(count):
            raise HostError(ErrorKind.INVALID_ARGUMENT,
                            f"cannot roll back {count} tokens: {self.matcher.get_error()}")

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (fast-forward)."""
        return list(self.matcher.compute_ff_tokens())


class GrammarCompiler:
    """Compiles grammars for one model's tokenizer."""

    def __init__(self, handshake: P.HandshakeReply):
        self.handshake = handshake
        self.mask_bytes = (handshake.vocab_size + 31) // 32 * 4
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def compile(self, kind: str, source: str) -> Matcher:
        if len(source.encode()) > MAX_GRAMMAR_BYTES:
            raise HostError(ErrorKind.INVALID_ARGUMENT,
                            f"grammar source is over {MAX_GRAMMAR_BYTES} bytes")
        try:
            grammar = llguidance.grammar_from(_FORMATS[GrammarKind(kind)], source)
        except (ValueError, KeyError) as e:
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"{kind} grammar: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar)
        if matcher.is_error():
            raise HostError(ErrorKind.INVALID_ARGUMENT, f"{kind} grammar: {matcher.get_error()}")
        return Matcher(matcher, self.mask_bytes)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                hs = self.handshake
                self._tokenizer = llguidance.LLTokenizer(
                    hs.tokenizer_json, n_vocab=hs.vocab_size, eos_token=list(hs.eos_token_ids))
            return self._tokenizer
