"""Reasoning and caching inferlets through a real `pie serve`: tree / recursion / graph /
skeleton of thought, parallel generation, prefix and modular caching. Each test checks a
property that faking the technique would break: KV pages shared between branches (peak
pages below what unshared branches would need), batching, prefill skipped through exports;
greedy outputs are held to HF transformers' (fp32)."""

from __future__ import annotations

import json
import math

import pytest

from pie.control.chat_template import chat_prompt, render_chat

from conftest import hf_greedy
from pie_server import build, forward_batches, run_inferlet, run_inferlet_batched

PAGE = 16


@pytest.fixture(scope="module")
def server(pie_server):
    yield pie_server
    r = pie_server.resources()
    assert r["kv_pages_free"] == r["kv_pages_total"], "KV pages leaked"


@pytest.fixture(scope="module")
def template(model_dir) -> str:
    return json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]


def launch(server, name: str, args: list[str]):
    run = run_inferlet(server, build(name), args)
    assert run.reason == "finished", run
    return run, json.loads(run.messages[-1])


def assert_no_leak(server):
    r = server.resources()
    assert r["kv_pages_free"] == r["kv_pages_total"]
    assert r["exports"] == 0


def stats(server) -> dict:
    return server.get("/stats")[1]["scheduler"]


def unshared_pages(lengths: list[int]) -> int:
    """Pages the branches would need if each held its whole sequence on its own."""
    return sum(math.ceil(n / PAGE) for n in lengths)


# --- parallel_generation -------------------------------------------------------------------

def test_parallel_generation(server, tokenizer, template, hf_chat):
    prompt, n_tokens = "Write a short poem about the sea.", 10
    _, greedy = launch(server, "parallel_generation", ["--prompt", prompt, "--n", "1", "--max-tokens", str(n_tokens)])
    assert greedy["completions"] == [hf_chat(prompt, n_tokens)]  # one fork, greedy: HF's answer

    prompt_len = len(tokenizer.encode(chat_prompt(template, prompt), add_special_tokens=False).ids)
    assert greedy["prompt_tokens"] == prompt_len
    before = stats(server)
    # Launched with the backend paused until the prefill (one fused pass) and the four
    # forks' first passes are submitted (all enqueued before any is awaited): that step must leave as one batch.
    run = run_inferlet_batched(server, build("parallel_generation"),
                               ["--prompt", prompt, "--n", "4", "--max-tokens", str(n_tokens), "--seed", "7"],
                               forwards=1 + 4)
    assert run.reason == "finished", run
    sampled = json.loads(run.messages[-1])
    completions = sampled["completions"]
    assert len(completions) == 4 and len(set(completions)) > 1
    # The prompt is prefilled once: 4 forks x the prompt would be 4 * prompt_len tokens.
    assert run.usage["forward_tokens"] < 4 * prompt_len
    assert run.usage["forward_tokens"] <= prompt_len + sum(sampled["tokens"]) + 4
    # The four forks' forwards of that step shared one batch: three batches fewer than calls.
    calls, batches = forward_batches(before, stats(server))
    assert calls == run.usage["forward_calls"] and batches <= calls - 3
    assert_no_leak(server)


# --- prefix_caching ------------------------------------------------------------------------

DOCUMENT = ("The Pie serving system runs inferlets: small WebAssembly programs that drive "
            "generation themselves. An inferlet allocates KV cache pages, embeds tokens, runs "
            "forward passes and samples tokens through a host API. Pages can be forked, exported "
            "under a name and imported by other inferlets, so that a long shared prefix such as "
            "this document is computed once and reused by every request that needs it. ") * 2


def hf_prefix_answer(hf_model, tokenizer, template: str, prefix: str, question: str, max_tokens: int) -> str:
    """prefix_caching's greedy answer from HF: the system turn and the rest of the prompt
    tokenized apart (as the inferlet does: the prefix's tokens are the export's), then
    greedy to EOS or max_tokens."""
    system = render_chat(template, [{"role": "system", "content": prefix}], add_generation_prompt=False)
    full = chat_prompt(template, question, prefix)
    assert full.startswith(system)
    ids = tokenizer.encode(system, add_special_tokens=False).ids + \
        tokenizer.encode(full[len(system):], add_special_tokens=False).ids
    tokens = hf_greedy(hf_model, ids, max_tokens, stop_at=hf_model.config.eos_token_id)
    return tokenizer.decode(tokens, skip_special_tokens=False)


def test_prefix_caching(server, hf_model, tokenizer, template):
    question = "What does an inferlet allocate?"
    common = ["--prefix", DOCUMENT, "--max-tokens", "8"]
    plain, plain_out = launch(server, "prefix_caching", common + ["--question", question, "--no-cache"])
    prefix_len = plain_out["prefix_tokens"]
    assert prefix_len > 64 and not plain_out["cached"] and not plain_out["exported"]
    assert plain.usage["forward_tokens"] >= prefix_len
    assert server.resources()["exports"] == 0

    first, first_out = launch(server, "prefix_caching", common + ["--question", question])
    assert first_out["exported"] and not first_out["cached"]
    assert first.usage["forward_tokens"] >= prefix_len
    assert server.resources()["exports"] == 1  # persistent: outlives the first launch

    second, second_out = launch(server, "prefix_caching", common + ["--question", question])
    assert second_out["cached"] and not second_out["exported"]
    assert second.usage["forward_tokens"] < prefix_len  # the prefix prefill was skipped
    assert first_out["answer"] == second_out["answer"] == plain_out["answer"]
    assert plain_out["answer"] == hf_prefix_answer(hf_model, tokenizer, template, DOCUMENT, question, 8)

    _, cleared = launch(server, "prefix_caching", ["--prefix", DOCUMENT, "--clear"])
    assert cleared["cleared"] and cleared["export"] == first_out["export"]
    assert_no_leak(server)


# --- skeleton_of_thought -------------------------------------------------------------------

def test_skeleton_of_thought(server):
    before = stats(server)
    run, out = launch(server, "skeleton_of_thought", ["--prompt", "How can I sleep better?",
                                                      "--points", "3", "--point-tokens", "8"])
    after = stats(server)
    assert len(out["points"]) > 1
    assert len(out["expansions"]) == len(out["points"])
    assert all(e.strip() for e in out["expansions"]) and all(n > 0 for n in out["expansion_tokens"])
    # The expansions share the question + skeleton pages instead of each holding a copy.
    assert run.usage["kv_pages_peak"] < unshared_pages(out["lengths"])
    # The prefix was prefilled once, not once per point.
    assert run.usage["forward_tokens"] < sum(out["lengths"])
    # The point expansions are decoded in lockstep by the SDK's generate_branches: each
    # step's forwards are enqueued before any is awaited. Whether the scheduler sends a step
    # as one batch is a race under the adaptive policy (the first forward may leave alone);
    # test_parallel_generation checks the same code with that race removed. Here: the
    # forward calls this run made are all the scheduler saw (nothing else ran).
    assert forward_batches(before, after)[0] == run.usage["forward_calls"]
    assert_no_leak(server)


# --- tree_of_thought -----------------------------------------------------------------------

def test_tree_of_thought(server):
    run, out = launch(server, "tree_of_thought", ["--prompt", "A farmer has 3 fields with 12 cows each. "
                                                  "How many cows are there in total?",
                                                  "--breadth", "3", "--depth", "2", "--thought-tokens", "8"])
    assert len(out["best_path"]) == 2 and all(t.strip() for t in out["best_path"])
    assert [len(level) for level in out["thoughts"]] == [3, 3]
    assert [len(level) for level in out["scores"]] == [3, 3]
    for level, scores in zip(out["thoughts"], out["scores"]):
        assert all(0 <= s <= 1 for s in scores)
    # Each chosen thought is the best-scored child of its level.
    for chosen, thoughts, scores in zip(out["best_path"], out["thoughts"], out["scores"]):
        assert chosen == thoughts[scores.index(max(scores))]
    lengths = out["branch_lengths"]
    assert len(lengths) == 6 and min(lengths) > out["prompt_tokens"]
    assert lengths[3] > lengths[0]  # depth-2 branches continue their parent thought
    assert run.usage["kv_pages_peak"] < unshared_pages(lengths)
    assert_no_leak(server)


# --- recursion_of_thought ------------------------------------------------------------------

def test_recursion_of_thought(server):
    prompt = "A farmer has 3 fields with 12 cows each. How many cows are there in total?"
    run, out = launch(server, "recursion_of_thought", ["--prompt", prompt, "--depth", "3", "--step-tokens", "6"])
    assert out["depth"] == 3 and len(out["levels"]) == 4
    assert out["levels"][0]["question"] == prompt
    for parent, child in zip(out["levels"], out["levels"][1:]):
        assert parent["subquestion"] and child["question"] == parent["subquestion"]
    assert out["levels"][-1]["subquestion"] == ""  # the leaf answers directly
    assert out["answer"] == out["levels"][0]["answer"]
    # Every level's context is a fork of its parent's: the ancestry's pages are shared.
    assert run.usage["kv_pages_peak"] < unshared_pages(out["branch_lengths"])

    refused = run_inferlet(server, build("recursion_of_thought"), ["--prompt", prompt, "--depth", "6"])
    assert refused.reason.startswith("error") and "at most 5" in refused.reason
    assert_no_leak(server)


# --- graph_of_thought ----------------------------------------------------------------------

def test_graph_of_thought(server):
    run, out = launch(server, "graph_of_thought", ["--prompt", "How can a city reduce traffic?",
                                                   "--thoughts", "3", "--thought-tokens", "8"])
    thoughts = out["thoughts"]
    assert len(thoughts) == 3 and all(t.strip() for t in thoughts)
    # The aggregation node's context holds every thought.
    for t in thoughts:
        assert t.strip() in out["aggregation_context"]
    assert out["aggregated"].strip() and out["refined"].strip()
    assert run.usage["kv_pages_peak"] < unshared_pages(out["branch_lengths"])
    assert_no_leak(server)


# --- modular_caching -----------------------------------------------------------------------

MODULES = {
    "system": "You are a concise assistant. Answer in one short sentence, using only the documents.",
    "doc-a": "Alice owns a red bicycle and a small brown dog named Pepper. She lives in Lisbon, "
             "works as a baker, and every Sunday she bakes bread for her neighbours.",
    "doc-b": "Bob owns a blue car and a grey cat named Smoke. He lives in Oslo, works as a pilot, "
             "and spends his free days fishing on the fjord near his house.",
}


def test_modular_caching(server):
    layout = [arg for name, text in MODULES.items() for arg in ("--module", f"{name}={text}")]
    try:
        check_modular_caching(server, layout)
    finally:
        _, cleared = launch(server, "modular_caching", layout + ["--clear"])
    assert sorted(cleared["cleared"]) == sorted(MODULES)
    assert_no_leak(server)


def check_modular_caching(server, layout):
    ask = layout + ["--use", "system,doc-a", "--question", "Where does Alice live?", "--max-tokens", "10"]
    first, first_out = launch(server, "modular_caching", ask)
    assert first_out["prefilled"] == ["system", "doc-a"]
    used_tokens = first_out["module_tokens"]["system"] + first_out["module_tokens"]["doc-a"]
    assert first.usage["forward_tokens"] >= used_tokens
    assert server.resources()["exports"] == 2
    assert "Lisbon" in first_out["answer"]  # the spliced-in module is really attended to

    second, second_out = launch(server, "modular_caching", ask)
    assert second_out["prefilled"] == []
    assert second.usage["forward_tokens"] < used_tokens  # the modules' prefill was skipped
    assert second_out["answer"] == first_out["answer"]  # deterministic across launches

    # Another composition reuses "system" (prefilled at its fixed offset) and adds doc-b.
    _, third_out = launch(server, "modular_caching", layout + ["--use", "system,doc-b", "--question",
                                                               "Where does Bob live?", "--max-tokens", "10"])
    assert third_out["prefilled"] == ["doc-b"]
    assert "Oslo" in third_out["answer"]
    assert server.resources()["exports"] == 3
