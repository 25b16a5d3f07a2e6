"""Semantic variables (`inferlet::semvar`, issue 19): the `semantic_variables` inferlet's
chain and map-reduce through a real `pie serve` (fp32), every call held to HF transformers'
greedy output on each prompt tokenized whole, the shared static prefix prefilled once (the
model ran exactly the tokens that says); and the library's mistakes through `probe semvar`."""

from __future__ import annotations

import json
import re

import pytest
from conftest import hf_greedy

from pie_server import build, run_inferlet

CHAIN = ("Keep a running summary of a document read in parts.\n"
         "Summary so far: {{input:summary}}\nNext part: {{input:chunk}}\n"
         "Reply with the updated summary in one sentence.")
MAP = "Summarize this text in one sentence.\nText: {{input:chunk}}"
REDUCE = "Combine these summaries into one paragraph.\n- {{input:s0}}\n- {{input:s1}}"
CHUNKS = ["The river flooded the old market in the winter of that year.",
          "The council voted to build a stone bridge near the station."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(pie_server):
    return pie_server


@pytest.fixture(scope="module")
def oracle(hf_model, tokenizer, chat_template):
    """HF's greedy reply to a call of the chat template around `user` with `values` in its
    input slots, the prompt tokenized whole (as one request of that text would be); and the
    tokens the call runs through the model when it forks the static prefix's context (the
    rendered text before the first slot, prefilled once: len - 1 tokens, the last pending):
    the prompt from where its tokens and the prefix's part, then every drawn token but the
    last. (reply, tokens the call runs, tokens the prefix ran)."""
    from pie.control.chat_template import render_chat

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    eos = hf_model.config.eos_token_id

    def call(user: str, values: dict[str, str]) -> tuple[str, int, int]:
        rendered = render_chat(chat_template, [{"role": "user", "content": user}])
        prefix = encode(rendered[:rendered.index("{{")])
        ids = encode(re.sub(r"\{\{input:(\w+)\}\}", lambda m: values[m.group(1)], rendered))
        shared = 0
        while shared < min(len(prefix) - 1, len(ids) - 1) and prefix[shared] == ids[shared]:
            shared += 1
        out = hf_greedy(hf_model, ids, MAX_TOKENS, stop_at=eos)
        drawn = len(out) + (len(out) < MAX_TOKENS)  # an EOS drawn too
        return tokenizer.decode(out, skip_special_tokens=False), len(ids) - shared + drawn - 1, len(prefix) - 1

    return call


def run_app(server, app: str) -> tuple[dict, dict]:
    args = ["--app", app, "--max-tokens", str(MAX_TOKENS)]
    for chunk in CHUNKS:
        args += ["--chunk", chunk]
    run = run_inferlet(server, build("semantic_variables"), args)
    assert run.reason == "finished", (run.reason, run.messages)
    assert len(run.messages) == 1
    resources = server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"] and resources["exports"] == 0
    return json.loads(run.messages[0]), run.usage


def test_chain_summary_is_hf_greedy_call_by_call(server, oracle):
    report, usage = run_app(server, "chain")
    summary, ran = "(nothing yet)", 0
    for i, chunk in enumerate(CHUNKS):
        summary, n, prefix = oracle(CHAIN, {"summary": summary, "chunk": chunk})
        assert report["summaries"][i] == summary and summary.strip()
        ran += n
    assert report["result"] == summary and report["calls"] == 2
    # The static prefix (the chat template's system prompt and more) ran once for both calls.
    assert usage["forward_tokens"] == prefix + ran


def test_map_reduce_is_hf_greedy_and_prefills_the_map_prefix_once(server, oracle):
    report, usage = run_app(server, "map-reduce")
    summaries, ran = [], 0
    for chunk in CHUNKS:
        text, n, map_prefix = oracle(MAP, {"chunk": chunk})
        summaries.append(text)
        ran += n
    assert report["summaries"] == summaries and all(s.strip() for s in summaries)
    paragraph, n, reduce_prefix = oracle(REDUCE, {"s0": summaries[0], "s1": summaries[1]})
    assert report["result"] == paragraph and report["calls"] == 3
    assert usage["forward_tokens"] == map_prefix + reduce_prefix + ran + n


def test_mistakes_are_precise_errors_and_a_failed_call_fails_its_readers(server):
    run = run_inferlet(server, build("probe"), ["semvar"])
    assert run.reason == "finished", (run.reason, run.messages)
    parse, call, (dependent,) = run.messages[:6], run.messages[6:10], run.messages[10:]
    assert "no {{output:NAME}} slot" in parse[0]
    assert "not closed" in parse[1]
    assert "must be {{input:NAME}} or {{output:NAME}}" in parse[2]
    assert 'unknown slot kind "foo"' in parse[3]
    assert 'output "y" appears twice' in parse[4]
    assert "must be letters, digits and _" in parse[5]
    assert "reads {{input:q}}, which no binding gives" in call[0]
    assert 'binding "r" names no input slot' in call[1]
    assert "belongs to another pipeline" in call[2]
    assert 'input "q" is bound twice' in call[3]
    assert dependent.startswith('input "q" failed: ') and "temperature" in dependent
    resources = server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"]
