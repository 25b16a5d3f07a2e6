"""The limits of the OpenAI-compatible endpoints, through a real `pie serve`: requests that
outlive their client, prompts longer than one forward batch or than the model's context,
and malformed bodies (each must get an OpenAI-shaped 4xx, never a 500).

The server here runs with backend.max_batch_tokens = 256, below the SDKs' first guess
(4096), so a long prompt also exercises how the SDKs learn the host's limit and prefill in
chunks of at most that many tokens."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import pytest
import torch

from wasmtime.component import Record

from pie.control.chat_template import chat_prompt
from pie.python_build import build_python_inferlet
from pie.server import openai as api
from pie.toolchain import build_inferlet
from pie_server import ROOT, TOKEN, Server, forward_batches, run_inferlet, until
from test_rust_sdk import FakeModel

MODEL = "smollm2-135m-instruct"
CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings
MAX_BATCH_TOKENS = 256  # small: the chunked prompts below (and HF's reference for them) stay short
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    server = Server(tmp_path_factory.mktemp("pie-limits"), {"backend": {"max_batch_tokens": MAX_BATCH_TOKENS}})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://{server.address}", headers=AUTH, timeout=120) as client:
        yield client


def idle(server) -> bool:
    """No instance runs and both pools are full."""
    stats = server.get("/stats")[1]
    r = stats["resources"]
    return stats["instances"] == 0 and r["kv_pages_free"] == r["kv_pages_total"] \
        and r["embeds_free"] == r["embeds_total"]


def wait_idle(server) -> None:
    """Until no instance runs and the pools are full (the bound only catches a hang)."""
    until(lambda: idle(server), what=lambda: f"idle server (now: {server.get('/stats')[1]})", interval_s=0.1)


def counting_prompt(tokenizer, at_least: int) -> tuple[str, list[int]]:
    """'1, 2, 3, ...' up to the first length of at least `at_least` tokens: its greedy
    continuation is unambiguous, so it holds under any summation order."""
    numbers = []
    while True:
        numbers.append(str(len(numbers) + 1))
        if len(numbers) % 50 == 0 or len(numbers) > 700:
            text = ", ".join(numbers) + ","
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) >= at_least:
                return text, ids


def hf_greedy_last(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    """conftest.hf_greedy, with logits computed only where they are read (a fifth of the
    work of a long prefill is the vocabulary projection of every position)."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


# --- requests that outlive their client ------------------------------------------------------


def test_a_client_leaving_a_whole_response_stops_its_inferlet(server, http):
    """Non-streaming: the endpoint watches the connection while it collects the output."""
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": CONTEXT - 100, "ignore_eos": True,
            "temperature": 0}
    wait_idle(server)
    before = server.get("/stats")[1]["scheduler"]
    with pytest.raises(httpx.ReadTimeout):  # ~8000 tokens: minutes of work, unless terminated
        http.post("/v1/completions", json=body, timeout=1.5)
    wait_idle(server)  # however long that takes: what it ran is counted, not timed
    forwards, _ = forward_batches(before, server.get("/stats")[1]["scheduler"])
    assert forwards < CONTEXT - 100, f"{forwards} forward passes: the inferlet ran on after its client left"


# --- long prompts ------------------------------------------------------------------------------


def test_a_prompt_longer_than_max_batch_tokens_is_prefilled_in_chunks(server, http, tokenizer, hf_model):
    prompt, ids = counting_prompt(tokenizer, 4 * MAX_BATCH_TOKENS + 100)
    assert len(ids) > 4 * MAX_BATCH_TOKENS
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    expected = hf_greedy_last(hf_model, ids, 4)  # HF transformers, one pass, fp32
    assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=False)
    wait_idle(server)


class SmallBatchModel(FakeModel):
    """The Rust SDK unit test's fake host and toy model, taking at most LIMIT new tokens per
    pass and refusing more as the real one does (invalid-argument naming max_batch_tokens)."""

    LIMIT = 8

    def __init__(self, args: list[str]):
        super().__init__(args)
        self.refused, self.passes = 0, []

    def refuse(self, store, q, p):
        """The real host's refusal of a pass with too many tokens, or None."""
        n = len(getattr(p, "input-tokens"))
        if n <= self.LIMIT:
            self.passes.append(n)
            return None
        self.refused += 1
        error = Record()
        error.kind, error.message = "invalid-argument", (
            f"{n} tokens in one call exceed the backend's max_batch_tokens = {self.LIMIT}; "
            "split the call into chunks")
        return error

    def execute_pass(self, store, q, p):
        return self.refuse(store, q, p) or super().execute_pass(store, q, p)

    def run_pass(self, store, q, p, steps, streaming):
        return self.refuse(store, q, p) or super().run_pass(store, q, p, steps, streaming)


def test_the_rust_sdk_prefills_in_chunks_of_a_fake_hosts_limit():
    """A unit test against a fake host (no server): on a host that takes 8 tokens a call,
    a 66-token prompt is prefilled in chunks by the SDK's Context, which learns the limit
    from the first refusal; positions and pages stay continuous."""
    host = SmallBatchModel(["--prompt", "Capital of France?", "--max-tokens", "32", "--system", "Be brief."])
    assert host.run(build_inferlet(ROOT / "inferlets" / "text_completion")) is None
    assert host.sent == ["Paris."]  # the toy's forward checked every position and page
    assert host.refused == 1 and max(host.passes) == SmallBatchModel.LIMIT
    assert sum(host.passes) == len(host.prompt)  # every prompt token once: the run feeds the rest
    assert host.kv == {} and host.embeds == {} and host.objects == {}, "the guest leaked"


def test_both_sdks_prefill_a_long_prompt_in_chunks(server, tokenizer, hf_chat):
    """The Python SDK's Context chunks like the Rust SDK's: same output (HF's greedy one),
    same tokens fed."""
    prompt, ids = counting_prompt(tokenizer, MAX_BATCH_TOKENS + 50)
    args = ["--prompt", prompt, "--max-tokens", "3"]
    rust = run_inferlet(server, "text_completion", args)
    python = run_inferlet(server, build_python_inferlet(ROOT / "inferlets" / "python" / "text_completion.py")
                          .read_bytes(), args)
    assert rust.reason == python.reason == "finished", (rust.reason, python.reason)
    assert python.messages == rust.messages == [hf_chat(prompt, 3)]
    assert python.usage["forward_tokens"] == rust.usage["forward_tokens"] > len(ids)
    wait_idle(server)


# --- prompt + max_tokens against the model's context and the KV pool ----------------------------


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_requests_past_the_context_length_get_400(server, http, tokenizer):
    long_prompt = "hello " * (CONTEXT + 10)
    cases = [
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": long_prompt}, "prompt"),  # no max_tokens: nothing fits
        ("/v1/completions", {"prompt": "Hello there", "max_tokens": CONTEXT}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": CONTEXT}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]}, "messages"),
    ]
    for path, fields, param in cases:
        error = error_of(http.post(path, json={"model": MODEL, **fields}))
        assert (error["type"], error["code"], error["param"]) == \
            ("invalid_request_error", "context_length_exceeded", param), (path, error)
        assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    prompt_tokens = len(tokenizer.encode("Hello there", add_special_tokens=False).ids)
    error = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": CONTEXT}))
    assert f"you requested {prompt_tokens + CONTEXT} tokens ({prompt_tokens} in the prompt, {CONTEXT} in the " \
           "completion)" in error["message"]
    assert idle(server)


def test_a_megabyte_prompt_gets_400_not_500(server, http, tokenizer, chat_template):
    """A prompt of a megabyte is counted and refused as too long for the context, with the
    exact counts in the message."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 23000  # ~1 MB
    assert len(prompt) > 10**6
    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
    chat_tokens = len(tokenizer.encode(chat_prompt(chat_template, prompt), add_special_tokens=False).ids)
    for path, fields, said in (
            ("/v1/completions", {"prompt": prompt, "max_tokens": 4},
             f"you requested {prompt_tokens + 4} tokens ({prompt_tokens} in the prompt, 4 in the completion)"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]},
             f"your messages resulted in {chat_tokens} tokens, leaving no room for the completion")):
        error = error_of(http.post(path, json={"model": MODEL, **fields}))
        assert error["code"] == "context_length_exceeded"
        assert f"maximum context length is {CONTEXT} tokens. However, {said}" in error["message"], error["message"]
    # Four times that is more bytes than 4 x the context x the longest token: refused from its
    # size alone, without running the tokenizer over it.
    huge = prompt * 4
    for path, fields, said in (
            ("/v1/completions", {"prompt": huge, "max_tokens": 4}, f"your prompt is {len(huge.encode())}"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]},
             f"your messages are {len(chat_prompt(chat_template, huge).encode())}")):
        error = error_of(http.post(path, json={"model": MODEL, **fields}))
        assert error["code"] == "context_length_exceeded"
        assert f"However, {said} bytes long, far more than that many tokens." in error["message"], error["message"]
    assert idle(server)


def test_a_body_over_max_request_bytes_gets_413_without_being_read_whole(server, http):
    limit = 8 * 2**20  # server.max_request_bytes (default)
    body = b'{"model": "m", "prompt": "' + b"x" * limit + b'"}'
    error = error_of(http.post("/v1/completions", content=body), 413)
    assert f"server.max_request_bytes = {limit}" in error["message"]

    def chunks():  # no Content-Length: the server must count what it reads
        yield b'{"model": "m", "prompt": "'
        for _ in range(limit // 2**20 + 1):
            yield b"x" * 2**20
    error = error_of(http.post("/v1/completions", content=chunks()), 413)
    assert "exceeds server.max_request_bytes" in error["message"]
    assert idle(server)


def test_a_request_larger_than_the_whole_kv_pool_gets_400(server, http):
    # 16 choices of 2000 tokens: within the context, but 16 x 126 pages > the pool's 1024
    error = error_of(http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "n": 16,
                                                        "max_tokens": 2000}))
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "backend.num_kv_pages = 1024" in error["message"]
    assert idle(server)


def fake_state(prompt_tokens: int, context: int = 100, pages: int = 1000):
    tokenizer = SimpleNamespace(encode=lambda text: [0] * prompt_tokens, vocabs=[b"abcd"], max_token_bytes=4,
                                apply_chat_template=lambda messages, generation: "x")
    hs = SimpleNamespace(context_length=context, page_size=16, num_kv_pages=pages)
    return SimpleNamespace(runtime=SimpleNamespace(controller=SimpleNamespace(hs=hs, tokenizer=tokenizer)))


def test_default_max_tokens_is_capped_at_the_rest_of_the_context():
    def fitted(chat: bool, prompt_tokens: int, max_tokens: int | None = None) -> str:
        body = {"model": "m", "max_tokens": max_tokens,
                **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
        completion = api.parse(body, chat, "m")
        asyncio.run(api.fit(fake_state(prompt_tokens), completion))
        return completion.arguments[-1]

    assert fitted(False, 10) == "16" and fitted(True, 10) == "90"  # chat: 256, capped at 100 - 10
    assert fitted(True, 99) == "1" and fitted(False, 50, 50) == "50"
    with pytest.raises(api.ApiError) as e:
        fitted(True, 100)
    assert e.value.code == "context_length_exceeded" and "leaving no room" in e.value.message
    # the KV pages one request may hold: the prompt's, shared, plus each choice's own
    assert api.kv_pages_needed(16, 16, 1, 16) == 2 and api.kv_pages_needed(17, 16, 1, 16) == 2
    assert api.kv_pages_needed(33, 16, 3, 16) == 2 + 3 * 1  # the prompt fills its pages: no copies
    assert api.kv_pages_needed(20, 16, 3, 16) == 2 + 3 * 2  # each copies the partial page (one needs not)


# --- malformed bodies --------------------------------------------------------------------------


def check_error(response: httpx.Response) -> None:
    """An OpenAI-shaped 400/404 (or a 200 for a body that happened to be valid)."""
    assert response.status_code in (200, 400, 404), (response.status_code, response.text[:300])
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)


NAMED_BODIES = {
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "deep nesting in a field": b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "NaN": b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(),
    "Infinity": b'{"model": "%s", "prompt": "x", "top_p": -Infinity}' % MODEL.encode(),
    "huge float": b'{"model": "%s", "prompt": "x", "temperature": 1e999}' % MODEL.encode(),
    "huge integer": b'{"model": "%s", "prompt": "x", "max_tokens": 1%s}' % (MODEL.encode(), b"0" * 5000),
    "big integer": b'{"model": "%s", "prompt": "x", "max_tokens": 1%s}' % (MODEL.encode(), b"0" * 4000),
    "non-UTF-8": b'{"model": "%s", "prompt": "\xff\xfe"}' % MODEL.encode(),
    "lone surrogate": b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 1}' % MODEL.encode(),
    "lone surrogate in the model": b'{"model": "\\udfff", "prompt": "x"}',
    "empty": b"",
    "whitespace": b"  \n",
    "null": b"null",
    "array": b"[]",
    "string": b'"hello"',
    "truncated": b'{"model": "%s", "prompt": "x"' % MODEL.encode(),
}

NAMED_CHAT_BODIES = {
    "non-dict messages": {"messages": [1, "two", None]},
    "non-string text part": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "dict text part": {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
    "role not a string": {"messages": [{"role": ["user"], "content": "x"}]},
    "content an object": {"messages": [{"role": "user", "content": {"text": "x"}}]},
    "messages an object": {"messages": {"role": "user", "content": "x"}},
    "n a float": {"messages": [{"role": "user", "content": "x"}], "n": 1e308},
    "seed too big": {"messages": [{"role": "user", "content": "x"}], "seed": 2**70},
    "stop of numbers": {"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]},
    "max_tokens a string": {"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"},
    "max_tokens enormous": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**300},
    "logprobs a string": {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"},
    "model a list": {"model": [MODEL], "messages": [{"role": "user", "content": "x"}]},
}


def test_malformed_bodies_get_openai_400s(server, http):
    for name, raw in NAMED_BODIES.items():
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == (404 if "model" in name else 400), (name, path, r.status_code, r.text[:200])
            check_error(r)
    for name, fields in NAMED_CHAT_BODIES.items():
        r = http.post("/v1/chat/completions", json={"model": MODEL, **fields})
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
        check_error(r)
    # a valid body under a wrong content type is still served (curl -d sends form encoding)
    r = http.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
                  headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    wait_idle(server)


DEEP = "<deep>"  # stands for a value nested 2,000 to 100,000 deep (json.dumps cannot write it)
NASTY = [None, True, False, 0, -1, 1, 2**64, -(2**63) - 1, 1.5, -0.0, 1e308, "", "x", "\u0000", "a" * 5000,
         [], {}, [1, 2], ["a"], [None], [{}], {"a": 1}, [[[[[]]]]], {"role": "user"}, "NaN", "\U0001F600",
         "\ud800", "a\udfffb", [{"type": "text", "text": 5}], [{"type": "text", "text": ["x"]}],
         [{"type": "image_url"}], {"include_usage": "yes"}, DEEP]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "n", "stop", "stream", "stream_options", "ignore_eos", "logprobs", "top_logprobs", "echo", "user"]
CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded", None,
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1"]


def serialize(body: dict, rng: random.Random) -> bytes:
    """`body` as JSON, each DEEP value written as a list or object nested thousands deep."""
    raw = json.dumps(body).encode()
    while (at := raw.find(json.dumps(DEEP).encode())) >= 0:
        depth = rng.choice([2_000, 20_000, 100_000])
        deep = b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth
        raw = raw[:at] + deep + raw[at + len(json.dumps(DEEP)):]
    return raw


def fuzz_bodies(rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """`count` (path, body) pairs: valid requests with fields swapped for nasty values,
    removed or added, nested, and byte-mutated serializations that are no longer JSON."""
    bases = [("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                       "max_tokens": 1, "temperature": 0})]
    out = []
    while len(out) < count:
        path, base = rng.choice(bases)
        body = json.loads(json.dumps(base))
        kind = rng.random()
        if kind < 0.6:  # swap, drop or add fields
            for _ in range(rng.randint(1, 3)):
                name = rng.choice(FIELDS)
                if name in ("max_tokens", "max_completion_tokens"):  # never a large valid one
                    body[name] = rng.choice([0, -5, 10**30, 2**31, "1", 2.0, [1], True, 1])
                elif rng.random() < 0.15:
                    body.pop(name, None)
                else:
                    body[name] = rng.choice(NASTY)
            raw = serialize(body, rng)
        elif kind < 0.65:  # a value nested deeper than any parser's recursion limit
            raw = serialize({**body, rng.choice(FIELDS): DEEP}, rng)
        elif kind < 0.75:  # messages entries of every shape
            path = "/v1/chat/completions"
            body = {"model": MODEL, "max_tokens": 1,
                    "messages": [rng.choice(NASTY) if rng.random() < 0.5 else
                                 {"role": rng.choice(NASTY + ["user"]), "content": rng.choice(NASTY)}
                                 for _ in range(rng.randint(1, 3))]}
            raw = serialize(body, rng)
        else:  # byte mutations of a serialization, kept only while they are not JSON objects
            raw = bytearray(json.dumps(body).encode())
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(raw) + 1)
                op = rng.random()
                if op < 0.4 and i < len(raw):
                    raw[i] = rng.randrange(256)
                elif op < 0.7:
                    raw[i:i] = bytes([rng.choice(b'{}[]",:\\0123456789eE+-.ntfu \xff\x00')])
                elif i < len(raw):
                    del raw[i]
            raw = bytes(raw)
            try:
                if isinstance(json.loads(raw), dict):
                    continue
            except (ValueError, RecursionError):
                pass
        out.append((path, raw))
    return out


def test_fuzzed_bodies_never_get_a_500(server, http, hf_chat):
    rng = random.Random(20260523)
    statuses: dict[int, int] = {}
    for path, raw in fuzz_bodies(rng, 300):
        content_type = rng.choice(CONTENT_TYPES)
        r = http.post(path, content=raw, headers={"Content-Type": content_type} if content_type else {})
        check_error(r)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert statuses.get(400, 0) > 200, statuses
    # the server still serves
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == hf_chat("Hi", 2)
    wait_idle(server)
