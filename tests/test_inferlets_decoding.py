"""Decoding and attention inferlets through a real `pie serve` (fp32): beam search,
watermarking, output validation, speculative and Jacobi decoding, attention sinks, sliding
windows, hierarchical attention. Each test checks a property a fake would fail, against HF
transformers (the oracle for every "equals greedy") or the server's own usage accounting."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pie.control.chat_template import chat_prompt

from conftest import hf_greedy
from pie_server import build, run_inferlet

LONG_STORY = (
    "Continue this story. The lighthouse keeper of Gull Point had kept the lamp burning for forty "
    "years. Every evening he climbed the one hundred and twelve steps, trimmed the wick, polished the "
    "great lens and watched the ships pass far out on the grey water. In winter the storms came from "
    "the north and the waves broke over the rocks below, throwing spray as high as the gallery rail. "
    "In summer the fishing boats came close to the shore and the children of the village waved to him "
    "from their decks. He knew every boat by the shape of its sail and every captain by the sound of "
    "his horn. One night in late autumn a small boat with no lights drifted toward the rocks. The "
    "keeper saw it only when the beam of the lamp swept across its white hull. He rang the bell, he "
    "waved his lantern, and then he ran down all one hundred and twelve steps to the shore.")
REPEAT = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the old "
          "river bank, and the farmer watches it from his red wooden gate.")


@pytest.fixture(scope="module")
def server(pie_server):
    yield pie_server
    r = pie_server.resources()
    assert r["kv_pages_free"] == r["kv_pages_total"]


@pytest.fixture(scope="module")
def chat_ids(tokenizer, model_dir):
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    return lambda prompt: tokenizer.encode(chat_prompt(template, prompt), add_special_tokens=False).ids


def no_leak(server):
    r = server.resources()
    assert r["kv_pages_free"] == r["kv_pages_total"]


def run_json(server, name: str, args: list[str]):
    run = run_inferlet(server, build(name), args)
    assert run.reason == "finished", run.reason
    no_leak(server)
    return json.loads(run.messages[-1]), run.usage


def seq_logprob(hf_model, prompt_ids: list[int], tokens: list[int]) -> float:
    """log P(tokens | prompt) under HF transformers, fp32."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)
    return float(logp[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def test_speculative_decoding_equals_greedy_in_fewer_passes(server, hf_chat):
    out, usage = run_json(server, "speculative_decoding", ["--prompt", REPEAT, "--max-tokens", "40"])
    assert out["text"] == hf_chat(REPEAT, 40)
    assert out["tokens"] >= 8
    assert usage["forward_calls"] == out["steps"] < out["tokens"]
    assert out["accepted"] > 0


def test_attention_sink_keeps_a_bounded_cache(server):
    sinks, window = 4, 32
    out, usage = run_json(server, "attention_sink", ["--prompt", LONG_STORY, "--max-tokens", "32",
                                                     "--sinks", str(sinks), "--window", str(window),
                                                     "--ignore-eos"])
    assert out["tokens"] == 32
    assert usage["forward_tokens"] > 12 * 16  # the whole sequence would need > 12 pages
    assert usage["kv_pages_peak"] <= (sinks + window) // 16 + 4
    assert out["dropped_pages"] >= 8


def test_windowed_attention_bounds_the_cache_and_changes_the_output(server, hf_chat):
    out, usage = run_json(server, "windowed_attention", ["--prompt", LONG_STORY, "--max-tokens", "24",
                                                         "--window", "32", "--ignore-eos"])
    assert usage["forward_tokens"] > 12 * 16
    assert usage["kv_pages_peak"] <= 32 // 16 + 4
    prompt = "Name three colors."
    full, _ = run_json(server, "windowed_attention", ["--prompt", prompt, "--max-tokens", "16",
                                                      "--window", "1000"])
    assert full["text"] == hf_chat(prompt, 16)  # a window holding everything: plain greedy
    small, _ = run_json(server, "windowed_attention", ["--prompt", prompt, "--max-tokens", "16",
                                                       "--window", "16"])
    assert small["text"] != full["text"]


def test_beam_search_beats_greedy(server, hf_model, chat_ids):
    prompt, n = "Describe the ocean in one long sentence.", 12
    out, usage = run_json(server, "beam_search", ["--prompt", prompt, "--beams", "3", "--max-tokens", str(n)])
    assert len(out["beams"]) == 3
    best = out["beams"][0]
    ids = chat_ids(prompt)
    tokens = best["tokens"]
    hf_lp = seq_logprob(hf_model, ids, tokens)
    assert abs(best["logprob"] - hf_lp) < 1e-2
    greedy = hf_greedy(hf_model, ids, len(tokens))
    assert hf_lp >= seq_logprob(hf_model, ids, greedy) - 1e-3
    assert usage["kv_pages_peak"] >= 3  # the beams held pages of their own


def test_watermark_is_detected_only_in_watermarked_text(server, hf_chat):
    prompt = "Write a short paragraph about autumn in the forest."
    marked, _ = run_json(server, "watermarking", ["--prompt", prompt, "--max-tokens", "48", "--seed", "7"])
    assert marked["tokens"] >= 40 and marked["z"] > 4

    def detect(text: str) -> float:
        out, usage = run_json(server, "watermarking", ["--detect", text])
        assert usage["forward_calls"] == 0
        return out["z"]

    assert detect(marked["text"]) > 4  # from the text alone, re-tokenized
    assert detect(hf_chat(prompt, 48)) < 2  # the unwatermarked (greedy) answer
    assert detect("The committee will meet on Tuesday to review the budget for next year and "
                  "discuss the proposed changes to the library's opening hours.") < 2


def test_output_validation_retries_until_the_pattern_matches(server):
    pattern = r"^The capital of France is [A-Z][a-z]+\.$"
    retried = 0
    for seed in range(1, 9):  # until a run whose first answer was rejected succeeds
        out, _ = run_json(server, "output_validation", [
            "--prompt", "What is the capital of France? Answer in one sentence.", "--pattern", pattern,
            "--max-attempts", "4", "--seed", str(seed)])
        *rejected, final = out["attempts"]
        assert final == out["text"]
        assert all(not re.fullmatch(pattern, text) for text in rejected)
        assert bool(re.fullmatch(pattern, final)) == out["valid"]
        assert out["valid"] or len(out["attempts"]) == 4
        if rejected and out["valid"]:
            retried += 1
            break
    assert retried, "no run rejected an answer and then produced a valid one"


def test_jacobi_decoding_equals_greedy_in_fewer_passes(server, hf_chat):
    prompt = "Repeat the word hello ten times: hello hello hello hello hello hello hello hello hello hello"
    out, usage = run_json(server, "jacobi_decoding", ["--prompt", prompt, "--max-tokens", "32", "--window", "8"])
    assert out["text"] == hf_chat(prompt, 32)
    assert usage["forward_calls"] == out["iterations"] < out["tokens"]
    assert out["converged"] > 0


DOCS = ["Alice's favorite color is blue.", "Bob's favorite fruit is mango.", "Carol's favorite animal is the owl."]


def test_hierarchical_attention_encodes_segments_independently(server, tokenizer):
    other = "Alice's favorite color is green."  # same length as DOCS[0], different content
    assert len(tokenizer.encode(other).ids) == len(tokenizer.encode(DOCS[0]).ids)

    def run(docs: list[str], *flags: str, max_tokens: int = 1):
        args = [a for d in docs for a in ("--doc", d)] + ["--question", "What is Bob's favorite fruit?",
                                                          "--max-tokens", str(max_tokens), *flags]
        return run_json(server, "hierarchical_attention", args)[0]

    a, b = run(DOCS, max_tokens=16), run([other, *DOCS[1:]])
    # Later documents are encoded the same whatever the first one says ...
    for x, y in zip(a["segments"][1:], b["segments"][1:]):
        assert x["tokens"] == y["tokens"]
        assert max(abs(p - q) for p, q in zip(x["probs"], y["probs"])) < 1e-4
    assert "mango" in a["answer"].lower()  # ... and the question sees every document.
    # Without the segment masks, they are not.
    fa, fb = run(DOCS, "--flat"), run([other, *DOCS[1:]], "--flat")
    assert fa["segments"][0]["tokens"] == a["segments"][0]["tokens"]
    assert any(max(abs(p - q) for p, q in zip(x["probs"], y["probs"])) > 1e-3
               for x, y in zip(fa["segments"][1:], fb["segments"][1:]))
