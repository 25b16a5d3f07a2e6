"""The Python SDK's TextStream (sdk/python/inferlet/text_stream.py) against the real
tokenizer, with a queue whose `detokenize` is that tokenizer (a fake inside one layer; the
Rust twin runs end to end in test_e2e's textstream probe): every push adds exactly what the
whole list's text gains, characters split over byte tokens are held until whole, and the
window moves with one extra call per WINDOW - KEEP tokens or fewer. The module imports nothing of the
SDK, so it is loaded by path (the package's __init__ needs a built inferlet's WIT bindings)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "text_stream", Path(__file__).resolve().parents[1] / "sdk" / "python" / "inferlet" / "text_stream.py")
text_stream = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(text_stream)
KEEP, WINDOW, TextStream = text_stream.KEEP, text_stream.WINDOW, text_stream.TextStream


class Queue:
    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def detokenize(self, tokens: list[int]) -> str:
        self.calls.append(len(tokens))
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


@pytest.mark.parametrize("chunk", [1, 3])
def test_pushes_add_up_to_the_whole_text(tokenizer, chunk):
    text = "Naïve café owners — 😀 say 你好, 世界! " * 4
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    queue = Queue(tokenizer)
    stream, streamed, held = TextStream(queue), "", 0
    for at in range(0, len(ids), chunk):
        streamed += stream.push(ids[at:at + chunk])
        whole = tokenizer.decode(ids[:at + chunk], skip_special_tokens=False)
        assert streamed == stream.text
        if whole.endswith("\ufffd"):
            held += 1
            assert whole.startswith(streamed)
        else:
            assert streamed == whole
    assert held > 0 and stream.finish() == text and stream.tokens == ids
    assert max(queue.calls) <= WINDOW + chunk + 3  # never the whole list (+3: a held 4-byte character)
    pushes = len(range(0, len(ids), chunk))
    assert len(queue.calls) <= pushes + len(ids) / (WINDOW - KEEP) + 1  # a move per WINDOW - KEEP tokens


def test_random_tokens_and_an_unfinished_character(tokenizer):
    rng = random.Random(7)
    ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(80)]
    stream = TextStream(Queue(tokenizer))
    for token in ids:
        stream.push([token])
    assert stream.finish() == tokenizer.decode(ids, skip_special_tokens=False)
    lead = tokenizer.encode("😀", add_special_tokens=False).ids
    assert len(lead) > 1
    stream = TextStream(Queue(tokenizer))
    assert stream.push(lead[:1]) == "" and stream.text == ""
    assert stream.finish() == tokenizer.decode(lead[:1], skip_special_tokens=False)
    assert stream.push([]) == ""
