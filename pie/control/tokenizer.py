"""Tokenization on the control side, fed by the backend's handshake (the `tokenizers`
library), so tokenize/detokenize never cross the IPC boundary."""

from __future__ import annotations

from functools import cached_property

from tokenizers import Tokenizer

from pie import protocol as P
from pie.control.chat_template import render_chat


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TextTokenizer:
    def __init__(self, handshake: P.HandshakeReply):
        self.tokenizer = Tokenizer.from_str(handshake.tokenizer_json)
        self.chat_template = handshake.chat_template
        self.eos_token_ids = list(handshake.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    @cached_property
    def vocabs(self) -> list[bytes]:
        """Each token id's bytes (byte-level BPE undone), for grammar engines and stop checks."""
        table = _byte_decoder()
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        out = [b""] * (max(vocab.values()) + 1)
        byte_level = "ByteLevel" in self.tokenizer.to_str()[:100000]
        for token, index in vocab.items():
            if byte_level and all(ch in table for ch in token):
                out[index] = bytes(table[ch] for ch in token)
            else:
                out[index] = token.encode()
        return out

    @cached_property
    def max_token_bytes(self) -> int:
        """The longest token in bytes: a text of n bytes has at least n / this many tokens."""
        return max(map(len, self.vocabs), default=1) or 1

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return render_chat(self.chat_template, messages, add_generation_prompt)
