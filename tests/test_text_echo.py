"""TextEcho (`inference.run-text`): the text a host-side run sends, on the real tokenizer.

The end-to-end path (a streamed `/v1/completions` through `pie serve`) is in
tests/test_openai.py; these pin the pieces it relies on."""

from __future__ import annotations

import json

import pytest

from pie.control.errors import HostError
from pie.control.text_echo import TextEcho


def echo_of(tokenizer, stops=(), hidden=(), as_json=False):
    sent: list[str] = []
    return TextEcho(tokenizer, sent.append, "<", ">", as_json, list(stops), list(hidden)), sent


def pieces(sent: list[str]) -> list[str]:
    assert all(m.startswith("<") and m.endswith(">") for m in sent)
    return [m[1:-1] for m in sent]


def test_the_pieces_add_up_to_the_decoded_text(tokenizer):
    text = "Héllo, wörld! 日本語のテキスト and emoji 🙂 too."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    echo, sent = echo_of(tokenizer)
    assert not any(echo.feed(t) for t in ids)
    echo.close()
    out = pieces(sent)
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=False) == text
    assert len(out) > 10 and "\ufffd" not in "".join(out)  # a piece per token, whole characters


def test_a_stop_string_across_tokens_cuts_the_text_and_ends_the_run(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False).ids
    echo, sent = echo_of(tokenizer, stops=["ee fo", "zzz"])
    ended = [echo.feed(t) for t in ids]
    assert True in ended
    last = ended.index(True)
    assert tokenizer.decode(ids[:last + 1]).find("ee fo") >= 0 > tokenizer.decode(ids[:last]).find("ee fo")
    assert echo.feed(ids[-1]) is True  # nothing more goes out after the cut
    echo.close()
    assert "".join(pieces(sent)) == "one two thr"


def test_a_possible_stop_string_start_is_held_until_it_is_not_one(tokenizer):
    ids = tokenizer.encode("a b c d", add_special_tokens=False).ids
    echo, sent = echo_of(tokenizer, stops=[" c x"])
    for t in ids[:3]:  # "a b c": " c" could begin the stop string
        echo.feed(t)
    assert "".join(pieces(sent)) == "a b"
    echo.feed(ids[3])  # " d": it was not
    echo.close()
    assert "".join(pieces(sent)) == "a b c d"


def test_hidden_tokens_json_and_an_incomplete_character_at_the_end(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode('say "hi"\n🙂', add_special_tokens=False).ids
    echo, sent = echo_of(tokenizer, hidden=[eos], as_json=True)
    for t in ids[:-1] + [eos]:  # the emoji's last byte never comes
        echo.feed(t)
    echo.close()
    text = "".join(json.loads(p) for p in pieces(sent))
    assert text == tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert text.startswith('say "hi"\n') and text.endswith("\ufffd") and "<|im_end|>" not in text


def test_an_empty_stop_string_is_refused(tokenizer):
    with pytest.raises(HostError, match="stop string is empty"):
        echo_of(tokenizer, stops=["ok", ""])
