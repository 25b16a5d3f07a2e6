"""The OpenAI-compatible endpoints through a real `pie serve`, driven by the official `openai`
client: each request is served by the built-in `openai_completion` inferlet."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
import torch

from conftest import hf_greedy
from pie_server import TOKEN, forward_batches, run_inferlet, until, until_async

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(pie_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN, max_retries=0)


def all_pages_free(server) -> bool:
    r = server.resources()
    return r["kv_pages_free"] == r["kv_pages_total"] and r["embeds_free"] == r["embeds_total"]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_each_request_is_served_by_the_openai_completion_inferlet(client, pie_server, hf_model, tokenizer):
    def calls() -> dict:
        return dict(pie_server.get("/stats")[1]["host_calls"].get("openai_completion", {}))

    before = calls()
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    expected = hf_greedy(hf_model, tokenizer.encode("Hello", add_special_tokens=False).ids, 2)
    assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=False)
    # The inferlet's host calls, counted by the runtime (before the response: the endpoint
    # answers once its instance has ended): the choice is one host-side run, no per-token
    # sample calls.
    after = calls()
    assert after.get("run", 0) - before.get("run", 0) == 1
    assert after.get("sample", 0) == before.get("sample", 0)


def test_a_response_wakes_its_inferlet_once_and_prefills_in_the_run(client, pie_server):
    """The run reports its tokens at its end (a take or two, not one per token), streamed
    or not (streamed, the host sends the text: `run-text`), and one choice needs no
    separate prefill pass (`execute`)."""
    def calls() -> dict:
        return dict(pie_server.get("/stats")[1]["host_calls"].get("openai_completion", {}))

    prompt = "The three primary colors are red, yellow and"
    before = calls()
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    after = calls()
    assert after.get("take", 0) - before.get("take", 0) <= 2
    assert after.get("execute", 0) == before.get("execute", 0)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                              stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    assert len([c for c in streamed if c.choices[0].text]) > 3  # token by token, sent by the host
    assert calls().get("take", 0) - after.get("take", 0) <= 2  # run-text: not woken per token
    assert calls().get("run-text", 0) - after.get("run-text", 0) == 1


def test_completion_equals_hf_greedy_with_logprobs(client, hf_model, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    expected = hf_greedy(hf_model, ids, 8)
    assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=False)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 8)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids + expected])).logits[0, len(ids) - 1:-1]
    hf_logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 8 and all(len(top) == 2 for top in lp.top_logprobs)
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(lp.token_logprobs, hf_logprobs.tolist()))


def test_chat_equals_text_completion_and_streams_the_same(client, pie_server, hf_chat):
    question = "What is the capital of France?"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=16, temperature=0)
    expected = [hf_chat(question, 16)]  # the oracle: HF greedy on the same chat prompt
    assert run_inferlet(pie_server, "text_completion", ["--prompt", question, "--max-tokens", "16"]).messages \
        == expected
    assert [r.choices[0].message.content] == expected
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected[0]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_strings_cut_the_output(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    assert " 7," in full  # the model counts on
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                    stop=[" 7", "zzz"]).choices[0]
    assert cut.text == full[:full.index(" 7")] and cut.finish_reason == "stop"


def test_ignore_eos_generates_exactly_max_tokens(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=48, temperature=0)
    short = client.chat.completions.create(**kwargs)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 48
    full = client.chat.completions.create(**kwargs, logprobs=True, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 48
    assert full.choices[0].message.content.startswith(short.choices[0].message.content)
    assert "<|im_end|>" not in full.choices[0].message.content  # EOS counted, not written ...
    tokens = [entry.token for entry in full.choices[0].logprobs.content]
    assert len(tokens) == 48 and "<|im_end|>" in tokens  # ... but its log-probability is


def test_n_choices_and_seeds(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, seed=11, temperature=1.0)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1
    assert first.usage.completion_tokens == 3 * 8  # no EOS within 8 tokens here


def test_bad_requests_get_openai_errors(client, pie_server):
    cases = {
        "unknown model": (dict(model="gpt-4", prompt="x"), 404, "model"),
        "negative max_tokens": (dict(model=MODEL, prompt="x", max_tokens=-1), 400, "max_tokens"),
        "temperature out of range": (dict(model=MODEL, prompt="x", temperature=7), 400, "temperature"),
        "too many stops": (dict(model=MODEL, prompt="x", stop=["a", "b", "c", "d", "e"]), 400, "stop"),
        "a penalty out of range": (dict(model=MODEL, prompt="x", presence_penalty=2.5), 400, "presence_penalty"),
        "a logit bias out of range": (dict(model=MODEL, prompt="x", logit_bias={"42": 500}), 400, "logit_bias"),
    }
    for name, (kwargs, status, param) in cases.items():
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(**kwargs)
        assert (e.value.status_code, e.value.body["param"]) == (status, param), name
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="chat parameter") as e:  # tools: tests/test_openai_tools.py
        client.completions.create(model=MODEL, prompt="x", extra_body={"tools": [tool]})
    assert e.value.body["param"] == "tools"
    neutral = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                             tools=[tool], tool_choice="none", frequency_penalty=0, logit_bias={})
    assert neutral.choices[0].finish_reason in ("stop", "length")  # the neutral values are accepted
    url = f"http://{pie_server.address}/v1/chat/completions"
    malformed = httpx.post(url, content=b"{not json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    anonymous = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert all_pages_free(pie_server)


def test_sixteen_concurrent_requests_are_all_answered(pie_server, hf_chat):
    """16 requests sent while the backend is paused (SIGSTOP): once every prefill forward
    waits in the scheduler's queues the backend goes on, so they are batched whatever the
    machine's speed. Each answer is HF's greedy one."""
    prompts = [f"Say the number {i}." for i in range(16)]

    async def run() -> list:
        # Closed here: left to the garbage collector, its connections would be closed on a
        # later test's event loop, failing that test ("Event loop is closed", seen in CI).
        async with openai.AsyncOpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN,
                                      max_retries=0) as client:
            with pie_server.backend_paused():
                submitted = pie_server.scheduler()
                answers = asyncio.gather(*(
                    client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": p}])
                    for p in prompts))
                await until_async(lambda: pie_server.model_calls_since(submitted) >= len(prompts),
                                  what="every request's prefill submitted")
            return await answers

    before = pie_server.scheduler()
    answers = asyncio.run(run())
    expected = [hf_chat(p, 8) for p in prompts]
    assert [a.choices[0].message.content for a in answers] == expected
    # The tokens generated, EOS included when it came before max_tokens (finish_reason stop).
    generated = [len(hf_chat.tokens(p, 8)) for p in prompts]
    assert [a.usage.completion_tokens for a in answers] == [n + (n < 8) for n in generated]
    assert [a.choices[0].finish_reason for a in answers] == ["stop" if n < 8 else "length" for n in generated]
    forwards, batches = forward_batches(before, pie_server.scheduler())
    assert batches < forwards, "concurrent requests were not batched"
    assert all_pages_free(pie_server)


def test_a_client_leaving_mid_stream_stops_its_inferlet(pie_server):
    """The server notices the disconnect and terminates the inferlet: it ends having run far
    fewer forward passes than the 2000 tokens it was asked for (EOS ignored), however long
    that took."""
    url = f"http://{pie_server.address}/v1/completions"
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    before = pie_server.scheduler()
    with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    until(lambda: pie_server.get("/stats")[1]["instances"] == 0 and all_pages_free(pie_server),
          what="the inferlet ended and freed its pages")
    forwards, _ = forward_batches(before, pie_server.scheduler())
    assert forwards < 2000, f"{forwards} forward passes: the inferlet ran on after its client left"
