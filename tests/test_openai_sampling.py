"""Sampling controls on the OpenAI endpoints (issue 20, item 3): `logit_bias`,
`presence_penalty`, `frequency_penalty`, vLLM's `min_tokens` and `stop_token_ids`, applied
by the host as logit rules of the fused pass (pie/control/logit_rules.py), in a host-side
run and in the per-token path that log-probabilities take. Through a real `pie serve`
(fp32) with the official `openai` client; the oracle is HF transformers' greedy decoding
with the same adjustments applied to its logits."""

from __future__ import annotations

import math
from collections import Counter

import openai
import pytest
import torch

from pie.control.chat_template import chat_prompt
from pie.control.logit_rules import LogitRules
from pie_server import TOKEN

MODEL = "smollm2-135m-instruct"
QUESTION = "Write a sentence about cats."


@pytest.fixture(scope="module")
def client(pie_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{pie_server.address}/v1", api_key=TOKEN, max_retries=0)


@pytest.fixture(scope="module")
def hf_ruled(hf_model, tokenizer, chat_template):
    """HF greedy on the chat prompt for `question` with OpenAI's adjustments: (text,
    completion tokens, finish reason)."""
    eos = hf_model.config.eos_token_id

    def run(question: str, max_tokens: int, bias: dict[int, float] = {}, presence: float = 0.0,  # noqa: B006
            frequency: float = 0.0, min_tokens: int = 0, stop_ids: tuple[int, ...] = ()) -> tuple[str, int, str]:
        ids = tokenizer.encode(chat_prompt(chat_template, question), add_special_tokens=False).ids
        out: list[int] = []
        with torch.inference_mode():
            while len(out) < max_tokens:
                logits = hf_model(torch.tensor([ids + out])).logits[0, -1].clone()
                for token, value in bias.items():
                    logits[token] += value
                for token, count in Counter(out).items():
                    logits[token] -= presence + frequency * count
                if len(out) < min_tokens:
                    logits[[eos, *stop_ids]] = -math.inf
                token = int(logits.argmax())
                if token == eos or token in stop_ids:
                    return tokenizer.decode(out, skip_special_tokens=False), len(out), "stop"
                out.append(token)
        return tokenizer.decode(out, skip_special_tokens=False), len(out), "length"

    return run


def _chat(client, **kwargs):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
              "max_tokens": 32, **kwargs}
    extra = {k: kwargs.pop(k) for k in ("min_tokens", "stop_token_ids") if k in kwargs}
    choice = client.chat.completions.create(**kwargs, extra_body=extra or None).choices[0]
    return choice.message.content, choice.finish_reason


def test_penalties_in_a_run_and_per_token_are_hf_greedy_with_them(client, hf_ruled):
    plain, _ = _chat(client)
    text, tokens, finish = hf_ruled(QUESTION, 32, presence=0.5, frequency=1.5)
    assert text != plain  # the penalties change this answer
    assert _chat(client, presence_penalty=0.5, frequency_penalty=1.5) == (text, finish)
    # the log-probability path draws token by token, the guest passing what it has drawn
    assert _chat(client, presence_penalty=0.5, frequency_penalty=1.5, logprobs=True) == (text, finish)


def test_logit_bias_and_stop_token_ids(client, tokenizer, hf_ruled):
    plain, _ = _chat(client)
    first = tokenizer.encode(plain, add_special_tokens=False).ids[0]
    text, _, finish = hf_ruled(QUESTION, 32, bias={first: -100.0})
    assert not text.startswith(tokenizer.decode([first]))
    assert _chat(client, logit_bias={str(first): -100}) == (text, finish)
    stop = tokenizer.encode(plain, add_special_tokens=False).ids[3]
    text, _, finish = hf_ruled(QUESTION, 32, stop_ids=(stop,))
    assert finish == "stop" and _chat(client, stop_token_ids=[stop]) == (text, "stop")


def test_min_tokens_holds_off_the_end(client, hf_ruled):
    short = "Reply with one word: yes or no. Is the sky blue?"
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": short}],
                                           temperature=0, max_tokens=40)
    assert plain.usage.completion_tokens < 12 and plain.choices[0].finish_reason == "stop"
    text, tokens, finish = hf_ruled(short, 40, min_tokens=12)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": short}], temperature=0,
                                       max_tokens=40, extra_body={"min_tokens": 12})
    assert r.usage.completion_tokens == tokens >= 12
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, finish)


@pytest.mark.parametrize("extra, param, text", [
    ({"logit_bias": {"cat": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"42": 101}}, "logit_bias", "between -100 and 100"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "vocabulary size"),
    ({"frequency_penalty": -3}, "frequency_penalty", "between"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "at most max_tokens"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "token ids"),
    ({"stop_token_ids": [10**8]}, "stop_token_ids", "vocabulary size"),
])
def test_bad_sampling_controls_are_400s(client, pie_server, extra, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=extra.pop("max_tokens", 4), extra_body=extra)
    assert e.value.body["param"] == param and text in e.value.body["message"], e.value.body
    resources = pie_server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"]


def test_logit_rules_follow_a_runs_draws():
    rules = LogitRules.of([(5, 2.0)], presence=0.5, frequency=1.0, seen=[7, 7], banned=[2], banned_until=3)
    ids, values = rules.entries()
    assert dict(zip(ids, values)) == {5: 2.0, 7: -2.5, 2: -math.inf}
    rules.see(9)
    ids, values = rules.entries()
    assert dict(zip(ids, values)) == {5: 2.0, 7: -2.5, 9: -1.5}  # three seen: the ban has lifted


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(client, hf_model, tokenizer):
    prompt = "The capital of France is Paris. The capital of Italy is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = r.choices[0]
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert choice.text.startswith(prompt) and r.usage.completion_tokens == 4
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == choice.text and lp.text_offset[len(ids)] == len(prompt)
    with torch.inference_mode():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=2e-3)
    best = tokenizer.decode([int(logp[len(ids) - 2].argmax())])
    assert best in lp.top_logprobs[len(ids) - 1] and len(lp.top_logprobs[1]) == 2
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text  # echo without logprobs: the prompt, then the same completion
