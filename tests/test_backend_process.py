"""A real `pie backend` process over real ZeroMQ: correctness against HF, and bad input."""

from __future__ import annotations

import itertools
from array import array
from dataclasses import replace

import msgpack
import pytest
from conftest import HF_PROMPTS, hf_greedy

from pie import protocol as P
from pie.control.backend_link import BackendError, BackendLink, BackendProcess
from pie.control.chat_template import chat_prompt
from pie.control.direct import DirectDriver, SamplingParams
from pie.control.passes import Output, Pass, encode

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def backend(model_dir):
    process = BackendProcess(model_dir, extra_args=["--dtype", "float32"])
    link, handshake = process.connect()
    yield link, handshake
    link.close()
    process.stop()


def test_handshake_describes_model_and_pools(backend):
    _, hs = backend
    assert hs.model_name == "smollm2-135m-instruct"
    assert hs.vocab_size == 49152 and hs.hidden_size == 576
    assert hs.page_size == 16 and hs.num_kv_pages > 0 and hs.num_embeds > 0
    assert hs.eos_token_ids == [2] and hs.bos_token_id == 1
    assert "<|im_start|>" in hs.chat_template and '"model"' in hs.tokenizer_json
    assert {"forward", "input-text", "output-text"} <= set(hs.traits)
    assert hs.dtype == "float32"
    assert hs.context_length == 8192  # config.json's max_position_embeddings


def test_greedy_equals_hf_transformers_fp32(backend, hf_model, tokenizer):
    """Four prompts plus one chat prompt, decoded together in one batch, token for token."""
    link, hs = backend
    texts = HF_PROMPTS + [chat_prompt(hs.chat_template, "What is the capital of France?")]
    prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    ours = DirectDriver(link, hs).generate(prompts, NEW_TOKENS)
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf_model, prompt, NEW_TOKENS)
    assert "Paris" in tokenizer.decode(ours[-1])


def test_sampling_controls(backend, tokenizer):
    link, hs = backend
    driver = DirectDriver(link, hs)
    prompt = [tokenizer.encode("My favourite animal is the").ids]
    greedy = driver.generate(prompt, 8)
    assert driver.generate(prompt, 8, SamplingParams(temperature=1.0, top_k=1)) == greedy
    seeded = [driver.generate(prompt, 8, SamplingParams(temperature=1.5, seed=7)) for _ in range(2)]
    assert seeded[0] == seeded[1]
    draws = {tuple(driver.generate(prompt, 8, SamplingParams(temperature=1.5, seed=s))[0])
             for s in range(6)}
    assert len(draws) > 1


def test_next_dist_is_sorted_topk_consistent_with_greedy(backend, tokenizer):
    """The fused pass draws the greedy token and keeps the hidden state; next_dist on it
    (the paper's get-next-dist) agrees with the draw and with the pass's own top-k."""
    link, hs = backend
    ids = tokenizer.encode("The capital of France is").ids
    out = hs.num_embeds - 1
    reply = link.call(encode([Pass(None, 0, hs.page_size, ids, list(range(len(ids))), [], [], 0,  # type: ignore[arg-type]
                                   [0], 0, None, [Output(len(ids) - 1, sample=True, dist_k=5, keep=out)])]))
    assert reply.errors == {}
    greedy = array("i", reply.tokens)[0]
    dist = link.call(P.NextDist([out, out], [5, 1]))
    assert dist.errors == {}
    assert dist.token_ids[0][0] == greedy and dist.token_ids[1] == [greedy]
    assert dist.token_ids[0] == list(array("i", reply.dist_ids))
    assert dist.probs[0] == sorted(dist.probs[0], reverse=True)
    assert 0 < sum(dist.probs[0]) <= 1.0 + 1e-6


def _forward(pages, last, embeds, out_pages, offset, out, idx, mask=None):
    return P.Forward(pages, [0, len(pages)], [last], embeds, [0, len(embeds)], out_pages,
                     [0, len(out_pages)], [offset], out, idx, [0, len(out)], [mask])


BAD_ITEMS = [
    (P.EmbedText([1, 10**6], [0, 0], [0, 1]), {1: "token id 1000000 out of range"}),
    (P.EmbedText([1, 1], [0, -3], [0, 1]), {1: "position -3 is negative"}),
    (P.EmbedText([1, 1], [0, 0], [0, 10**7]), {1: "embed id 10000000 out of range"}),
    (_forward([10**6], 1, [0], [], 0, [], []), {0: "input page id 1000000 out of range"}),
    (_forward([0], 17, [0], [], 0, [], []), {0: "kv_last_page_len 17 must be in"}),
    (_forward([], 0, [-1], [], 0, [], []), {0: "input embed id -1 out of range"}),
    (_forward([], 0, [], [], 0, [], []), {0: "no new tokens"}),
    (_forward([], 0, [0, 1], [5], 15, [], []), {0: "output pages hold 1 slots"}),
    (_forward([], 0, [0], [5, 5], 0, [], []), {0: "output pages repeat a page"}),
    (_forward([5], 4, [0], [5], 2, [], []), {0: "output slots overlap the input context"}),
    (_forward([], 0, [0], [], 0, [9], [3]), {0: "out_token_index 3 out of range"}),
    (_forward([], 0, [0], [], 0, [], [], b"\x00\x00"), {0: "attention mask must be 1 packed bytes"}),
    (_forward([], 0, [0], [], 0, [], [], b"\x00"), {0: "nothing to attend to"}),
    (P.NextDist([0, 10**7], [3, 3]), {1: "embed id 10000000 out of range"}),
    (P.NextDist([0], [0]), {0: "k 0 out of range"}),
    (P.Sample([0] * 4, [-1.0, 1.0, 1.0, 1.0], [0, -2, 0, 0], [1.0, 1.0, 0.0, 1.0], [0, 0, 0, -5]),
     {0: "temperature -1.0", 1: "top_k -2", 2: "top_p 0.0", 3: "seed -5"}),
    (P.CopyKvPage([0, 10**6], [1, 1], [0, 0], [0, 0], [1, 1]), {1: "page id out of range"}),
    (P.CopyKvPage([0], [1], [10], [0], [8]), {0: "does not fit in a page of 16"}),
    (P.MaskKvPage([0, 0], [[True] * 3, [1] * 16]), {0: "list of 16 booleans", 1: "list of 16 booleans"}),
    (P.MaskKvPage([-1], [[False] * 16]), {0: "page id -1 out of range"}),
]


@pytest.mark.parametrize("message, expected", BAD_ITEMS, ids=lambda v: getattr(v, "kind", ""))
def test_bad_items_get_precise_errors(backend, message, expected):
    link, _ = backend
    reply = link.call(message)
    assert set(reply.errors) == set(expected)
    for index, text in expected.items():
        assert text in reply.errors[index]


def test_bad_item_does_not_spoil_its_batch(backend):
    link, _ = backend
    reply = link.call(P.EmbedText([1, -1, 2], [0, 0, 0], [40, 41, 42]))
    assert list(reply.errors) == [1]
    reply = link.call(P.NextDist([40, 42], [1, 1]))  # the good items were carried out
    assert reply.errors == {}


WHOLE_REQUEST_ERRORS = [
    (b"\x92\xc1", "not valid msgpack"),
    (b"not msgpack at all \xff\xfe", "not valid msgpack"),
    (msgpack.packb([7, "fly", {}]), "unknown message kind"),
    (msgpack.packb([7, "sample", {"embed_ids": [1]}]), "missing fields"),
    (msgpack.packb([7, "embed_text", {"token_ids": [1, 2], "positions": [0], "embed_ids": [0, 1]}]),
     "fields differ in length"),
    (msgpack.packb([7, "embed_text", {"token_ids": [1.5], "positions": [0], "embed_ids": [0]}]),
     "token_ids must be a flat list of integers"),
    (msgpack.packb([7, "embed_text", {"token_ids": ["a"], "positions": [0], "embed_ids": [0]}]),
     "token_ids must be a flat list of integers"),
    (P.encode(7, P.Forward([], [0, 0], [0], [0], [0, 2], [], [0, 0], [0], [], [], [0, 0], [None])),
     "embed_indptr must rise from 0 to 1"),
    (P.encode(7, P.HandshakeRequest(protocol_version=99)), "protocol version 99 is not supported"),
]


@pytest.mark.parametrize("frame, message", WHOLE_REQUEST_ERRORS)
def test_malformed_requests_get_error_replies_and_backend_keeps_serving(backend, frame, message):
    link, _ = backend
    link.send_raw(frame)
    with pytest.raises(BackendError, match=message):
        link.wait(-1 if b"msgpack" in frame or frame.startswith(b"\x92") else 7)
    assert link.call(P.StatsRequest()).counters["embed_text.batches"] >= 1


def test_idle_signal_follows_each_batch(backend):
    link, _ = backend
    before = link.idle_signals
    link.call(P.StatsRequest())
    link.call(P.StatsRequest())
    link.call(P.StatsRequest())  # the idle signal of a batch arrives after its reply
    assert link.idle_signals >= before + 2


def test_second_peer_is_served_independently(backend):
    link, _ = backend
    other = BackendLink(link.endpoint)
    try:
        assert other.call(P.StatsRequest()).counters
    finally:
        other.close()


# --- steps the backend takes on its own (Passes.ahead, pie/backend/ahead.py) -------------------


def _ahead_request(hs, prompts, ahead, out_pages, stops=None, **output):
    """One pass per prompt, drawing greedily at its last token, granted `ahead` steps."""
    passes = [Pass(None, i, hs.page_size, ids, list(range(len(ids))), [], [], 0, pages, 0, None,  # type: ignore[arg-type]
                   [Output(len(ids) - 1, sample=True, **output)]) for i, (ids, pages) in enumerate(zip(prompts, out_pages))]
    stops = stops or [[] for _ in prompts]
    return replace(encode(passes), ahead=array("i", ahead).tobytes(),
                   stop_ids=array("i", [t for s in stops for t in s]).tobytes(),
                   stop_indptr=array("i", [0, *itertools.accumulate(map(len, stops))]).tobytes())


def _collect(link, request_id):
    """The reply and every step after it: (tokens per item, the reply, the steps)."""
    reply = link.wait(request_id)
    tokens = [[t] if t >= 0 else [] for t in array("i", reply.tokens)]
    steps = []
    while reply.more and not (steps and steps[-1].final):
        step = link.wait(request_id)
        assert isinstance(step, P.PassesStep)
        steps.append(step)
        for i, t in enumerate(array("i", step.tokens)):
            if t >= 0:
                tokens[i].append(t)
    return tokens, reply, steps


def test_steps_ahead_equal_hf_greedy_and_stop_at_a_stop_token(backend, hf_model, tokenizer):
    """Two passes granted steps ahead: each step feeds an item its own draw, so the tokens
    are HF's greedy continuation; the second stops at its stop token (drawn, not fed), the
    first at its grant."""
    link, hs = backend
    prompts = [tokenizer.encode(t, add_special_tokens=False).ids for t in HF_PROMPTS[:2]]
    expected = [hf_greedy(hf_model, ids, 12) for ids in prompts]
    stop = expected[1][4]
    first_stop = expected[1].index(stop)
    request = _ahead_request(hs, prompts, [11, 11], [[200, 201], [210, 211]], stops=[[], [stop]])
    tokens, reply, steps = _collect(link, link.send(request))
    assert reply.more and steps[-1].final
    assert tokens[0] == expected[0]
    assert tokens[1] == expected[1][:first_stop + 1]
    assert link.call(P.StatsRequest()).counters["pass.ahead.batches"] >= 11


def test_steps_ahead_are_bounded_by_the_pages_and_skip_what_they_cannot_repeat(backend, hf_model, tokenizer):
    """A grant beyond the item's pages stops where they end; an item that asks for more
    than a draw (here its entropy) does not go on, and a grant of the wrong length fails
    the request."""
    link, hs = backend
    ids = tokenizer.encode(HF_PROMPTS[0], add_special_tokens=False).ids
    assert len(ids) < hs.page_size
    room = hs.page_size - len(ids)
    tokens, reply, steps = _collect(link, link.send(_ahead_request(hs, [ids], [10**6], [[220]])))
    assert tokens[0] == hf_greedy(hf_model, ids, room + 1) and len(steps) == room
    _, reply, steps = _collect(link, link.send(_ahead_request(hs, [ids], [5], [[221]], entropy=True)))
    assert not reply.more and steps == []
    request = replace(_ahead_request(hs, [ids], [5], [[222]]), ahead=array("i", [5, 5]).tobytes())
    with pytest.raises(BackendError, match="pass.ahead must have 1 entries or none"):
        link.call(request)


def test_a_waiting_frame_ends_the_steps_ahead(backend, hf_model, tokenizer):
    """An Interrupt sent right behind a request with a long grant: the backend ends its
    steps at a step boundary (final), then answers the Interrupt; what it drew is HF's."""
    link, hs = backend
    ids = tokenizer.encode(HF_PROMPTS[2], add_special_tokens=False).ids
    request_id = link.send(_ahead_request(hs, [ids], [40], [[230, 231, 232, 233]]))
    interrupt = link.send(P.Interrupt())
    tokens, reply, steps = _collect(link, request_id)
    assert reply.more and steps[-1].final and len(steps) < 40
    assert tokens[0] == hf_greedy(hf_model, ids, len(tokens[0]))
    assert isinstance(link.wait(interrupt), P.Interrupt)


def test_a_backend_ends_when_its_control_process_is_killed(model_dir):
    """`BackendProcess` starts the backend with `--exit-with` its own pid: when the control
    process dies without stopping it (SIGKILL, the OOM killer), the backend exits at its
    next idle poll instead of holding its memory and socket for good (seen: five such
    backends of ~2 GB each, left by scripts that ended without `stop`)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def running(pid: int) -> bool:  # neither gone nor a zombie its new parent has yet to reap
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    script = ("import sys, time\n"
              "from pathlib import Path\n"
              "from pie.control.backend_link import BackendProcess\n"
              "p = BackendProcess(Path(sys.argv[1]))\n"
              "p.connect()\n"
              "print(p.process.pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script, str(model_dir)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert running(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30  # a hang bound only: it exits within ~0.2 s
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child)
    finally:
        parent.kill()
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)
