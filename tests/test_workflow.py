"""The workflow compiler of the Python SDK (sdk/python/inferlet/workflow.py) on the host:
every mistake a precise error before any model call, and the optimizations' graphs. The
module imports nothing of the SDK at load, so it is loaded by path, as
benchmarks/workflows.py loads it (the package's __init__ needs the WIT bindings of a built
inferlet); the runs are in tests/test_python_inferlets.py."""

from __future__ import annotations

import re

import pytest

from benchmarks.workflows import load_compiler

wf = load_compiler()

SYSTEM = "You are a careful analyst of markets. Answer in one short sentence.\n"
SHORT = wf.Options(min_prefix_chars=32)  # this file's templates are short


def llm(template: str, max_tokens: int = 16, **bind: str) -> dict:
    return {"op": "llm", "template": template, "bind": bind, "max_tokens": max_tokens}


def debate() -> dict:
    """Two duplicated branches (same template, same input), an unused node, a shared system
    prefix across three templates."""
    return {"inputs": ["topic"],
            "nodes": {"pro": llm(SYSTEM + "Argue for {{input:t}}.", t="topic"),
                      "pro_again": llm(SYSTEM + "Argue for {{input:t}}.", t="topic"),
                      "con": llm(SYSTEM + "Argue against {{input:t}}.", t="topic"),
                      "both": {"op": "format", "text": "For: {a}\nFor (2): {b}\nAgainst: {c}",
                               "bind": {"a": "pro", "b": "pro_again", "c": "con"}},
                      "unused": llm("Say hello to {{input:t}}.", t="topic"),
                      "judge": llm(SYSTEM + "{{input:d}}\nWho wins?", 8, d="both")},
            "outputs": {"verdict": "judge", "arguments": "both"}}


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s["nodes"]["both"]["bind"].update(c="nowhere"), "'c' is bound to 'nowhere', which is neither"),
    (lambda s: s["nodes"]["pro"]["bind"].clear(), "node 'pro' reads 't', which no binding gives"),
    (lambda s: s["nodes"]["pro"]["bind"].update(x="topic"), "node 'pro': binding 'x' names no slot"),
    (lambda s: s["nodes"]["both"].update(text="{a} {b} {c} {d}"), "node 'both' reads 'd'"),
    (lambda s: s["nodes"]["pro"].update(op="tool"), "node 'pro': op must be one of llm, format, fn"),
    (lambda s: s["nodes"]["pro"].update(max_tokens=0), "max_tokens must be a positive integer"),
    (lambda s: s["nodes"]["pro"].update(template="Argue {{input: t"), "template slots are"),
    (lambda s: s["outputs"].update(extra="ghost"), "output 'extra' names 'ghost'"),
    (lambda s: s.update(outputs={}), "no outputs"),
    (lambda s: s["nodes"].update(topic=llm("x {{input:t}}", t="pro")), "'topic' is both an input and a node"),
    (lambda s: s["nodes"]["pro"]["bind"].update(t="judge"), "a cycle (each node reads the next): pro -> judge -> both -> pro"),
])
def test_mistakes_are_errors_before_any_model_call(mutate, message):
    spec = debate()
    mutate(spec)
    with pytest.raises(ValueError, match=re.escape(message)):
        wf.compile_workflow(spec)


def test_unknown_functions_are_named():
    spec = {"inputs": ["x"], "nodes": {"f": {"op": "fn", "function": "shout", "bind": {"text": "x"}}},
            "outputs": {"y": "f"}}
    with pytest.raises(ValueError, match=r"unknown function 'shout' \(given: \['upper'\]\)"):
        wf.compile_workflow(spec, functions=("upper",))
    assert list(wf.compile_workflow(spec, functions=("shout",)).nodes) == ["f"]


def test_naive_keeps_every_node_in_declaration_order():
    plan = wf.compile_workflow(debate(), wf.Options.naive())
    assert list(plan.nodes) == ["pro", "pro_again", "con", "both", "unused", "judge"]
    assert plan.anchors == [] and set(plan.priority.values()) == {0}


def test_pruning_merging_and_the_critical_path():
    plan = wf.compile_workflow(debate(), SHORT)
    assert list(plan.nodes) == ["pro", "con", "both", "judge"]  # unused pruned, pro_again merged
    assert plan.nodes["both"].bind == {"a": "pro", "b": "pro", "c": "con"}
    assert plan.outputs == {"verdict": "judge", "arguments": "both"}
    assert plan.stats == {"declared": 6, "kept": 4}
    # tokens to generate on the longest path to the end: pro (16) -> both -> judge (8)
    assert plan.priority == {"pro": 24, "con": 24, "both": 8, "judge": 8}


def test_merging_follows_merged_inputs_down_a_chain():
    """Two identical chains of three calls collapse to one, call by call."""
    nodes = {}
    for side in ("a", "b"):
        nodes[f"{side}1"] = llm("Step one on {{input:x}}.", x="doc")
        nodes[f"{side}2"] = llm("Step two on {{input:x}}.", x=f"{side}1")
        nodes[f"{side}3"] = {"op": "format", "text": "[{v}]", "bind": {"v": f"{side}2"}}
    plan = wf.compile_workflow({"inputs": ["doc"], "nodes": nodes, "outputs": {"a": "a3", "b": "b3"}})
    assert list(plan.nodes) == ["a1", "a2", "a3"] and plan.outputs == {"a": "a3", "b": "a3"}


def test_shared_template_prefixes_form_a_radix_tree():
    assert wf.compile_workflow(debate()).anchors == []  # shorter than the default 400 characters
    plan = wf.compile_workflow(debate(), SHORT)
    # the system text all three kept templates begin with, and the longer one two share
    assert plan.anchors == [SYSTEM + "Argue ", SYSTEM]
    node = plan.nodes["judge"]
    assert wf.static_prefix(node) == SYSTEM
    assert next(a for a in plan.anchors if wf.static_prefix(node).startswith(a)) == SYSTEM
    short = wf.compile_workflow({"inputs": ["x"], "nodes": {"p": llm("Hi {{input:v}}", v="x"), "q": llm("Hi {{input:v}}!", v="x")},
                                 "outputs": {"p": "p", "q": "q"}}, SHORT)
    assert short.anchors == []  # "Hi " is shorter than 32 characters


def test_cache_keys_cover_model_limit_and_prompt():
    keys = {wf.cache_key(m, p, n) for m in ("a", "b") for p in ("x", "y") for n in (1, 2)}
    assert len(keys) == 8 and all(k.startswith("workflow.llm.") for k in keys)


def test_slots_are_filled_in_one_pass_as_the_checks_read_them():
    """A slot written with spaces is filled (the checks accept it), and a value that reads
    like a slot stays text."""
    assert wf.fill("A {{ input : a }} B {{input:b}}", {"a": "{{input:b}}", "b": "x"}) == "A {{input:b}} B x"


def test_helium_workflows_compile_at_their_scale():
    """benchmarks/workflows.py's six graphs: ~30 LLM calls each over several roles, their data
    the inputs they declare, the question read by few calls (what a second question repeats is
    what Helium's result cache saves), and trading's dead code and duplicates optimized away."""
    import random

    from benchmarks.helium_workflows import WORKFLOWS

    assert list(WORKFLOWS) == ["trading", "mapreduce", "debate", "reflect", "iterative", "parallel"]
    for w in WORKFLOWS.values():
        spec = w.build(16)
        plan = wf.compile_workflow(spec)
        calls = [n for n in spec["nodes"].values() if n["op"] == "llm"]
        roles = {n["template"].split("\n")[0] for n in calls}
        assert 25 <= len(calls) <= 32 and len(roles) >= 4, (w.name, len(calls), len(roles))
        assert set(spec["inputs"]) == {"question", *w.data(random.Random(0))}
        assert all(n.max_tokens == 16 for n in plan.nodes.values() if n.op == "llm")
    trading = wf.compile_workflow(WORKFLOWS["trading"].build(16))
    assert trading.stats == {"declared": 36, "kept": 31}  # 3 compliance notes pruned, 2 macro calls merged
