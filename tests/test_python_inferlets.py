"""Python inferlets (sdk/python, built with componentize-py) through a real `pie serve`, held
to the same properties as their Rust twins."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
import torch

from conftest import hf_greedy
from pie.control.chat_template import chat_prompt
from pie.python_build import build_python_inferlet
from pie.scaffold import new_inferlet
from pie.toolchain import build_inferlet
from pie_server import ROOT, TOKEN, build, run_inferlet

PYTHON = ROOT / "inferlets" / "python"


@pytest.fixture(scope="module")
def python_component():
    cache: dict[str, bytes] = {}

    def get(name: str) -> bytes:
        if name not in cache:
            cache[name] = build_python_inferlet(PYTHON / f"{name}.py").read_bytes()
        return cache[name]
    return get


@pytest.fixture(scope="module")
def chat_ids(tokenizer, model_dir):
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    return lambda prompt: tokenizer.encode(chat_prompt(template, prompt), add_special_tokens=False).ids


def test_text_completion_equals_the_rust_one(pie_server, python_component, hf_chat):
    args = ["--prompt", "Name three colors.", "--max-tokens", "16"]
    python = run_inferlet(pie_server, python_component("text_completion"), args)
    rust = run_inferlet(pie_server, "text_completion", args)
    assert python.reason == rust.reason == "finished"
    assert python.messages == rust.messages == [hf_chat("Name three colors.", 16)]  # HF's greedy answer
    assert python.usage["forward_tokens"] == rust.usage["forward_tokens"]  # same token sequence fed
    bad = run_inferlet(pie_server, python_component("text_completion"), ["--max-tokens", "many"])
    assert bad.reason.startswith("error: ValueError: invalid number for --max-tokens: 'many' (at text_completion.py:")
    assert bad.reason.endswith(" in parse)")  # the line that raised, in the inferlet's own code
    resources = pie_server.resources_once_pages_free()


def sequence_logprob(hf_model, prompt_ids: list[int], tokens: list[int]) -> float:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1:-1]
    return float(torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).sum())


def test_beam_search_beats_greedy(pie_server, python_component, hf_model, chat_ids):
    prompt = "Name a fruit."
    run = run_inferlet(pie_server, python_component("beam_search"),
                       ["--prompt", prompt, "--beams", "3", "--max-tokens", "8"])
    assert run.reason == "finished", run.reason
    best = json.loads(run.messages[0])
    ids = chat_ids(prompt)
    assert abs(sequence_logprob(hf_model, ids, best["tokens"]) - best["logprob"]) < 1e-2
    greedy = hf_greedy(hf_model, ids, len(best["tokens"]))
    assert best["logprob"] >= sequence_logprob(hf_model, ids, greedy) - 1e-3
    unshared = 3 * -(-(len(ids) + len(best["tokens"])) // 16)  # 3 beams holding their own pages
    assert run.usage["kv_pages_peak"] < unshared  # the beams share the prompt's pages


def test_react_agent_matches_its_rust_twin(pie_server, python_component, tool_server):
    """Same prompt, tools and greedy decoding: the Python agent makes the same tool calls
    over HTTP, reads the same observations and reaches the same context as the Rust one,
    running every token once (no re-prefill after a tool call)."""
    args = ["--tools-url", tool_server.url, "--question", "What is the capital of France? Then compute 17 * 23.",
            "--steps", "2", "--max-tokens", "12"]
    calls = lambda: json.loads(urllib.request.urlopen(f"{tool_server.url}/stats").read())["calls"]
    before = calls()
    python = run_inferlet(pie_server, python_component("react_agent"), args)
    after = calls()
    rust = run_inferlet(pie_server, build("agent_react"), args)
    assert python.reason == rust.reason == "finished", python.reason
    report = json.loads(python.messages[0])
    assert report == json.loads(rust.messages[0])
    assert sum(after.values()) - sum(before.values()) == 2  # the tool server saw both calls
    assert all(f"Observation: {s['observation']}\n" in report["context"] for s in report["steps"])
    assert "391" in report["context"]
    assert python.usage["forward_tokens"] == rust.usage["forward_tokens"]
    assert python.usage["forward_tokens"] <= report["context_tokens"] + report["discarded_tokens"] + 2


def test_hello_echoes_until_quit(pie_server, python_component):
    run = run_inferlet(pie_server, python_component("hello"), ["hi", "there"], replies=["ping", "quit"])
    assert run.reason == "finished" and run.messages == ["hi there", "ping"]


PREFIX_PROGRAM = '''
import inferlet

def main(args):
    name, prefix, question = args
    if question == "--unexport":
        inferlet.Context.unexport(name)
        return
    queue = inferlet.Model.default().create_queue()
    ctx = inferlet.Context.imported(queue, name)
    if ctx is None:
        ctx = inferlet.Context(queue)
        ctx.fill(prefix)
        ctx.forward_pending([])
        ctx.export(name, persistent=True)
    fork = ctx.fork()
    ctx.fill(question)
    fork.fill(question)
    stop = inferlet.Stop(8)
    a, b = ctx.generate(inferlet.Sampler.greedy(), stop), fork.generate(inferlet.Sampler.greedy(), stop)
    waited = inferlet.wait_any([inferlet.receive()])
    inferlet.send(a + "|" + b + "|" + str(waited))
'''


def test_python_sdk_export_import_fork_and_wait(tmp_path, pie_server, hf_model, tokenizer):
    """The Python SDK's KV export/import, fork (copy-on-write) and wait_any, end to end;
    the continuation is HF's greedy one on the same tokens."""
    source = tmp_path / "py_prefix.py"
    source.write_text(PREFIX_PROGRAM)
    program = build_python_inferlet(source).read_bytes()
    prefix = "A list of facts about the solar system. " * 3
    first = run_inferlet(pie_server, program, ["py-prefix", prefix, " The sun is"], replies=["go"])
    second = run_inferlet(pie_server, program, ["py-prefix", prefix, " The sun is"], replies=["go"])
    assert first.reason == second.reason == "finished", (first.reason, second.reason)
    a, b, waited = first.messages[0].split("|")
    assert a == b and waited == "[0]"  # the fork continues exactly like the original
    ids = tokenizer.encode(prefix, add_special_tokens=False).ids + \
        tokenizer.encode(" The sun is", add_special_tokens=False).ids  # filled apart, as the program does
    assert a == tokenizer.decode(hf_greedy(hf_model, ids, 8), skip_special_tokens=False)
    assert second.messages == first.messages
    prefix_tokens = first.usage["forward_tokens"] - second.usage["forward_tokens"]
    assert prefix_tokens >= 20  # the second launch imported the prefix instead of running it
    assert pie_server.resources()["exports"] == 1
    # The Rust SDK's Context::import reads the same export record: same continuation.
    rust = run_inferlet(pie_server, build_inferlet(_rust_importer(tmp_path)).read_bytes(), ["py-prefix"])
    assert rust.reason == "finished" and rust.messages == [a]
    assert run_inferlet(pie_server, program, ["py-prefix", "", "--unexport"]).reason == "finished"
    resources = pie_server.resources_once_pages_free()
    assert resources["exports"] == 0


RUST_IMPORTER = """
inferlet::main!(main);

async fn main() -> Result<(), String> {
    let queue = std::rc::Rc::new(inferlet::Model::default_model()?.create_queue()?);
    let name = &inferlet::args()[0];
    let mut ctx = inferlet::Context::import(queue, name)?.ok_or("no such export")?;
    ctx.fill(" The sun is");
    let text = ctx.generate(&inferlet::Sampler::greedy(), &inferlet::Stop::new(8)).await?;
    inferlet::send(&text);
    Ok(())
}
"""


def _rust_importer(tmp_path):
    """A Rust inferlet that continues a context exported by name (here: by the Python SDK)."""
    crate = new_inferlet(tmp_path / "rust_importer")
    (crate / "src" / "lib.rs").write_text(RUST_IMPORTER)
    return crate


ECHO_PROGRAM = '''
import inferlet

def main(args):
    prompt, stop_string, n, as_json = args
    ctx = inferlet.Model.default().create_context()
    ctx.fill(prompt)
    stop = inferlet.Stop(int(n), eos=ctx.queue.eos_tokens(), strings=[stop_string] if stop_string else [])
    echo = inferlet.Echo(prefix='{"t":', suffix="}", json=True) if as_json == "json" else inferlet.Echo(prefix="+")
    inferlet.send("=" + ctx.generate(inferlet.Sampler.greedy(), stop, echo=echo))
'''


def test_python_sdk_generate_echo_streams_from_the_host(tmp_path, pie_server, hf_model, tokenizer):
    """`generate(..., echo=Echo(...))` (`inference.run-text`): the host sends the text piece
    by piece as it is drawn, cut before a stop string, and the inferlet is woken for the
    run's end only (a take or two, not one per token); the text is HF's greedy one."""
    source = tmp_path / "py_echo.py"
    source.write_text(ECHO_PROGRAM)
    program = build_python_inferlet(source).read_bytes()
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    greedy = tokenizer.decode(hf_greedy(hf_model, ids, 16), skip_special_tokens=False)

    def calls() -> dict:
        totals: dict = {}
        for by_function in pie_server.get("/stats")[1]["host_calls"].values():
            for name, count in by_function.items():
                totals[name] = totals.get(name, 0) + count
        return totals

    before = calls()
    plain = run_inferlet(pie_server, program, [prompt, "", "16", "plain"])
    after = calls()
    assert plain.reason == "finished", plain.reason
    *pieces, final = plain.messages
    assert final == "=" + greedy and len(pieces) > 3 and all(m.startswith("+") for m in pieces)
    assert "".join(m[1:] for m in pieces) == greedy
    assert after.get("run-text", 0) - before.get("run-text", 0) == 1
    assert after.get("take", 0) - before.get("take", 0) <= 2  # not woken per token

    stop = greedy.split()[2]  # a word in the middle: the run ends at the token completing it
    cut = run_inferlet(pie_server, program, [prompt, stop, "16", "json"])
    assert cut.reason == "finished", cut.reason
    *pieces, final = cut.messages
    expected = greedy[:greedy.find(stop)]
    assert final == "=" + expected
    assert "".join(json.loads(m)["t"] for m in pieces) == expected
    resources = pie_server.resources_once_pages_free()


SCORING_PROGRAM = '''
import json
import inferlet

def main(args):
    profile, *posts = args
    queue = inferlet.Model.default().create_queue()
    queue.set_objective("latency", "scoring")
    queue.set_job_size(100)
    try:
        queue.set_objective("urgent")
        bad = "accepted"
    except inferlet.Error as e:
        bad = str(e)
    ctx = inferlet.Context(queue)
    ctx.fill(profile)
    ctx.flush()
    yes, no = queue.tokenize(" Yes")[0], queue.tokenize(" No")[0]
    scores = ctx.score_each([queue.tokenize(p) for p in posts], [yes, no])
    token, ids, probs = ctx.peek_next(inferlet.Sampler.greedy(), 3)
    inferlet.send(json.dumps({"scores": scores, "next": [token, ids, probs], "bad": bad,
                              "pending": len(ctx.pending)}))
'''


def test_python_sdk_scores_without_kv_and_sets_objectives(tmp_path, pie_server, hf_model, tokenizer):
    """The Python SDK's `score_each` and `peek_next` (passes that write no KV: the context
    keeps only its one pending token) against HF's log-probabilities, and its scheduling
    calls (an unknown objective is refused by name)."""
    source = tmp_path / "py_scoring.py"
    source.write_text(SCORING_PROGRAM)
    program = build_python_inferlet(source).read_bytes()
    profile, posts = "A reader who loves gardening and history books.", [" Post: tomato seeds.", " Post: car racing."]
    run = run_inferlet(pie_server, program, [profile, *posts])
    assert run.reason == "finished", run.reason
    out = json.loads(run.messages[0])
    assert out["pending"] == 1 and "invalid-argument" in out["bad"] and "urgent" in out["bad"]

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    candidates = [ids(" Yes")[0], ids(" No")[0]]
    with torch.inference_mode():
        for post, got in zip(posts, out["scores"]):
            logits = hf_model(torch.tensor([ids(profile) + ids(post)])).logits[0, -1].float()
            assert got == pytest.approx(torch.log_softmax(logits, -1)[candidates].tolist(), abs=2e-3)
        probs = torch.softmax(hf_model(torch.tensor([ids(profile)])).logits[0, -1].float(), -1)
    top = torch.topk(probs, 3)
    token, top_ids, top_probs = out["next"]
    assert token == top_ids[0] == int(top.indices[0]) and top_ids == top.indices.tolist()
    assert top_probs == pytest.approx(top.values.tolist(), abs=1e-3)


SEMVAR_MISTAKES = '''
import json

import inferlet
from inferlet.semvar import Pipeline, Template


def main(args):
    out = []
    for source in ["no slots", "{{input:x}", "{{inputx}}{{output:y}}", "{{foo:x}}{{output:y}}",
                   "{{output:y}}{{output:y}}", "{{input:a b}}{{output:y}}"]:
        try:
            Template.parse(source)
            out.append("parsed")
        except ValueError as e:
            out.append(str(e))
    pipeline, other = Pipeline(inferlet.Model.default()), Pipeline(inferlet.Model.default())
    template = Template.parse("Q: {{input:q}} A:{{output:a}}")
    q = pipeline.input("q", "2+2?")
    for bindings in [{}, {"q": q, "r": q}, {"q": other.input("q", "3+3?")}]:
        try:
            pipeline.call(template, bindings)
            out.append("called")
        except ValueError as e:
            out.append(str(e))
    (a,) = pipeline.call(template, {"q": q}, 4, inferlet.Sampler(temperature=-1.0))
    (b,) = pipeline.call(Template.parse("Then: {{input:q}} B:{{output:b}}"), {"q": a}, 4)
    try:
        out.append(pipeline.get(b, "throughput"))
    except inferlet.Error as e:
        out.append(e.message)
    inferlet.send(json.dumps(out))
'''


def test_semantic_variables_equal_the_rust_twin(tmp_path, pie_server, python_component):
    """`inferlet.semvar` (Python) runs Parrot's chain and map-reduce to the Rust library's
    outputs, call by call (same templates, same prefix split, greedy fp32; the Rust side is
    held to HF's greedy output in tests/test_semantic_variables.py); its mistakes are
    errors before any model call, and a refused call fails the call that reads it."""
    chunks = ["The river flooded the old market in the winter of that year.",
              "The council voted to build a stone bridge near the station."]
    for app in ("chain", "map-reduce"):
        args = ["--app", app, "--max-tokens", "12"] + [a for c in chunks for a in ("--chunk", c)]
        rust = run_inferlet(pie_server, build("semantic_variables"), args)
        python = run_inferlet(pie_server, python_component("semantic_variables"), args)
        assert python.reason == rust.reason == "finished", (python.reason, rust.reason)
        assert json.loads(python.messages[0]) == json.loads(rust.messages[0]), app
    source = tmp_path / "py_semvar_mistakes.py"
    source.write_text(SEMVAR_MISTAKES)
    run = run_inferlet(pie_server, build_python_inferlet(source).read_bytes(), [])
    assert run.reason == "finished", run.reason
    out = json.loads(run.messages[0])
    assert "no {{output:NAME}} slot" in out[0] and "not closed" in out[1]
    assert "must be {{input:NAME}} or {{output:NAME}}" in out[2] and "unknown slot kind 'foo'" in out[3]
    assert "'y' appears twice" in out[4] and "must be letters, digits and _" in out[5]
    assert "reads {{input:q}}, which no binding gives" in out[6]
    assert "binding 'r' names no input slot" in out[7] and "belongs to another pipeline" in out[8]
    assert out[9].startswith("input 'q' failed: ") and "temperature" in out[9]
    resources = pie_server.resources_once_pages_free()


SYSTEM = ("Notes on programming style, written for beginners by a senior engineer. These notes cover "
          "how to name things, how to lay out a file, how to format code so that others can read it, "
          "and which arguments about style are worth having in a team at all. Each note states one "
          "question, the common answers, and the reasons people give for each of them, briefly and "
          "without taking sides where the answer is only a matter of habit.\n")  # > 400 characters


def raw_call(template: str, max_tokens: int, **bind: str) -> dict:
    return {"op": "llm", "template": template, "bind": bind, "max_tokens": max_tokens, "raw": True}


WORKFLOW = {"inputs": ["topic"],
            "nodes": {"pro": raw_call(SYSTEM + "The best argument for {{input:t}} is that", 10, t="topic"),
                      "pro_again": raw_call(SYSTEM + "The best argument for {{input:t}} is that", 10, t="topic"),
                      "con": raw_call(SYSTEM + "The worst problem with {{input:t}} is that", 10, t="topic"),
                      "unused": raw_call("Say hi to {{input:t}}.", 4, t="topic"),
                      "both": {"op": "fn", "function": "join", "bind": {"a": "pro", "b": "pro_again", "c": "con"}},
                      "judge": raw_call(SYSTEM + "Arguments:\n{{input:d}}\nThe winner is", 8, d="both")},
            "outputs": {"verdict": "judge", "arguments": "both", "pro": "pro", "pro_again": "pro_again", "con": "con"}}


def test_workflow_optimized_equals_naive_and_reuses_work(pie_server, python_component, hf_model, tokenizer):
    """Helium's optimizer as an inferlet: the optimized plan (pruned, merged, shared prefixes
    prefilled once, results cached) gives the naive plan's greedy outputs exactly, with
    fewer model calls; run again, every call is a cache hit; pinned prefixes are imported
    by the next run and removed by --unpin; mistakes are errors before any model call."""
    component = python_component("workflow")

    def run(*extra: str, spec: dict = WORKFLOW, topic: str | None = "tabs or spaces"):
        args = ["--spec", json.dumps(spec), *(["--input", f"topic={topic}"] if topic else []), *extra]
        done = run_inferlet(pie_server, component, args)
        return done.reason, (json.loads(done.messages[0]) if done.messages else None)

    reason, naive = run("--naive")
    assert reason == "finished", reason
    out = naive["outputs"]
    assert out["pro"] == out["pro_again"] != out["con"]  # greedy: the duplicate agrees; the other differs
    prompt = WORKFLOW["nodes"]["con"]["template"].replace("{{input:t}}", "tabs or spaces")
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    eos = tokenizer.token_to_id("<|im_end|>")
    assert out["con"] == tokenizer.decode(hf_greedy(hf_model, ids, 10, stop_at=eos))
    assert naive["stats"]["llm_calls"] == 5 and naive["stats"]["prefixes_prefilled"] == 0
    reason, optimized = run("--no", "order")
    assert reason == "finished", reason
    assert optimized["outputs"] == naive["outputs"]
    assert optimized["stats"] == {"declared": 6, "kept": 4, "llm_calls": 3, "cache_hits": 0,
                                  "prefixes_prefilled": 2, "prefixes_imported": 0}
    _, again = run()
    assert again["outputs"] == naive["outputs"] and again["stats"]["llm_calls"] == 0
    assert again["stats"]["cache_hits"] == 3
    for expected in ({"prefilled": 2, "imported": 0}, {"prefilled": 0, "imported": 2}):
        _, pinned = run("--no", "cache", "--pin")
        assert pinned["outputs"] == naive["outputs"]
        assert {k: pinned["stats"][f"prefixes_{k}"] for k in expected} == expected
    _, unpinned = run("--unpin")
    assert unpinned == {"unpinned": 2}
    reason, _ = run(topic=None)
    assert "workflow input 'topic' is missing" in reason
    cyclic = json.loads(json.dumps(WORKFLOW))
    cyclic["nodes"]["pro"]["bind"]["t"] = "judge"
    reason, _ = run(spec=cyclic)
    assert "a cycle (each node reads the next): pro -> judge -> both -> pro" in reason
    resources = pie_server.resources_once_pages_free()


FIRST_PROGRAM = """\
import argparse
import sys

import inferlet


def divide(n):
    return 1 / n


def main(args):
    parser = argparse.ArgumentParser(description="What a new user writes first.")
    parser.add_argument("mode", choices=["print", "raise", "host", "exit", "import"])
    o = parser.parse_args()
    if o.mode == "print":
        print("to stdout", 42)
        print("to stderr", file=sys.stderr)
        print("unfinished", end="")
    elif o.mode == "raise":
        divide(0)
    elif o.mode == "host":
        inferlet.Model.default().create_queue().detokenize([10**9])
    elif o.mode == "exit":
        sys.exit("nothing to do")
    elif o.mode == "import":
        import xml.dom.minidom  # noqa: F401
    inferlet.send("done " + o.mode)
"""


def test_print_argparse_and_failures_explain_themselves(pie_server, tmp_path):
    """What used to trap with a bare `unreachable` (print, argparse) works; print() and
    stderr reach the client that asked for logs; failures name the line."""
    source = tmp_path / "first.py"
    source.write_text(FIRST_PROGRAM)
    program = build_python_inferlet(source, cache=tmp_path).read_bytes()
    run = {mode: run_inferlet(pie_server, program, mode.split(), logs=True)
           for mode in ("print", "raise", "host", "exit", "import", "bogus", "-h", "")}
    assert (run["print"].messages, run["print"].reason) == (["done print"], "finished")
    assert run["print"].logs == [("info", "to stdout 42"), ("warn", "to stderr"), ("info", "unfinished")]
    assert run["raise"].reason == "error: ZeroDivisionError: division by zero (at first.py:8 in divide)"
    assert run["raise"].logs == [("error", "Traceback (most recent call last):"),
                                 ("error", f'  File "{run["raise"].logs[1][1].split(chr(34))[1]}", line 20, in main'),
                                 ("error", run["raise"].logs[2][1]), ("error", "ZeroDivisionError: division by zero")]
    assert run["raise"].logs[2][1].endswith('first.py", line 8, in divide')
    assert run["host"].reason.startswith("error: invalid-argument: ") and \
        run["host"].reason.endswith("(at first.py:22 in main)"), run["host"].reason
    assert run["exit"].reason == "error: exit status 1: nothing to do"
    assert run["import"].reason == (
        "error: ImportError: module 'xml' was not imported when the inferlet was built, and a component "
        "cannot load modules at run time (it has no file system): import it at the top of your module "
        "(at first.py:26 in main)")
    assert run["bogus"].reason.startswith(
        "error: exit status 2: first.py: error: argument mode: invalid choice: 'bogus'"), run["bogus"].reason
    assert run[""].reason == "error: exit status 2: first.py: error: the following arguments are required: mode"
    assert run["-h"].reason == "finished" and run["-h"].messages == []
    assert run["-h"].logs[0] == ("info", "usage: first.py [-h] {print,raise,host,exit,import}")
    assert ("info", "What a new user writes first.") in run["-h"].logs
    resources = pie_server.resources_once_pages_free()


def choice_logprobs(hf_model, before: list[int], tokens: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([before + tokens])).logits[0, len(before) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("sdk", ["python", "rust"])
def test_sglang_primitives_match_hf(sdk, pie_server, python_component, hf_model, tokenizer, chat_ids):
    """In both SDKs: select's per-token log-probabilities are HF's (after the prompt, and
    after a fresh start for "unconditional"), each normalisation picks its own argmax, the
    forks continue each choice as HF's greedy decoding does, and gen/regex/JSON-schema
    output parses."""
    question, choices = "What color is the sky on a clear day?", ["red", "blue", "green grass"]
    prompt = f"{question}\nAnswer with one of: {', '.join(choices)}."
    ids = chat_ids(prompt)
    tokens = [tokenizer.encode(c, add_special_tokens=False).ids for c in choices]
    conditional = [choice_logprobs(hf_model, ids, t) for t in tokens]
    fresh = [choice_logprobs(hf_model, [hf_model.generation_config.eos_token_id], t) for t in tokens]
    expected = {"sum": [sum(c) for c in conditional], "mean": [sum(c) / len(c) for c in conditional],
                "unconditional": [sum(a - b for a, b in zip(c, f)) / len(c) for c, f in zip(conditional, fresh)]}
    program = python_component("sglang_primitives") if sdk == "python" else build("sglang_primitives")
    # Rust: the normalisation that takes the most passes (suite time); Python: each of them.
    for normalize, scores in expected.items() if sdk == "python" else [("unconditional", expected["unconditional"])]:
        run = run_inferlet(pie_server, program, ["--question", question, *sum((["--choice", c] for c in choices), []),
                                                 "--normalize", normalize, "--max-tokens", "12"])
        assert run.reason == "finished", run.reason
        got = json.loads(run.messages[0])
        assert all(abs(a - b) < 2e-3 for g, c in zip(got["logprobs"], conditional) for a, b in zip(g, c))
        assert all(abs(a - b) < 2e-3 for a, b in zip(got["scores"], scores)), (normalize, got["scores"], scores)
        assert got["answer"] == choices[max(range(3), key=lambda i: scores[i])]
        assert 0 <= got["confidence"] <= 100 and "\n" not in got["reason"]
        assert isinstance(got["verdict"], dict) and set(got["verdict"]) == {"sure"} and \
            isinstance(got["verdict"]["sure"], bool)
    for choice, t in zip(choices, tokens):  # the forks: HF's greedy continuation of prompt + choice
        greedy = hf_greedy(hf_model, ids + t, 12)
        eos = hf_model.generation_config.eos_token_id
        text = tokenizer.decode(greedy[:greedy.index(eos)] if eos in greedy else greedy)
        assert got["continuations"][choice] == text.split("\n")[0], (choice, got["continuations"][choice], text)
    resources = pie_server.resources_once_pages_free()


INTERPRETED = """\
import argparse

import inferlet
from helper import shout


def main(args):
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--fail", action="store_true")
    o = parser.parse_args()
    print("prompt is", o.prompt)
    if o.fail:
        return shout(None)
    ctx = inferlet.Model.default().create_context()
    ctx.fill_chat([inferlet.chat("user", o.prompt)])
    inferlet.send(shout(ctx.generate(inferlet.Sampler.greedy(), inferlet.Stop(8, eos=ctx.queue.eos_tokens()))))
"""


def test_pie_run_interpret_runs_the_source_without_a_build(pie_server, hf_chat, tmp_path):
    """`pie run --interpret FILE.py`: the prebuilt interpreter runs the file and its sibling
    module from source, with the same output, log and end reasons as a built program."""
    (tmp_path / "app.py").write_text(INTERPRETED)
    (tmp_path / "helper.py").write_text("def shout(text):\n    return text.upper() + '!'\n")
    pie_run = lambda *args: subprocess.run(
        [sys.executable, "-m", "pie.cli", "run", str(tmp_path / "app.py"), "--interpret", "--server",
         f"http://{pie_server.address}", "--token", TOKEN, "--", *args], capture_output=True, text=True, timeout=300)
    ok, failed = pie_run("--prompt", "Say hi"), pie_run("--prompt", "x", "--fail")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == hf_chat("Say hi", 8).upper() + "!\n" and "prompt is Say hi" in ok.stderr
    assert failed.returncode == 1
    assert "AttributeError: 'NoneType' object has no attribute 'upper' (at helper.py:2 in shout)" in \
        " ".join(failed.stderr.split()), failed.stderr
    assert not list(tmp_path.glob("*.wasm"))  # nothing was built from the program


def test_speculative_decoding_equals_its_rust_twin_and_greedy(pie_server, python_component, hf_chat):
    """The SDKs' speculative decoding (inferlet.speculative / inferlet::speculative) verify the
    same prompt-lookup drafts in the same passes and produce HF's greedy text."""
    prompt = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the old "
              "river bank, and the farmer watches it from his red wooden gate.")
    args = ["--prompt", prompt, "--max-tokens", "24"]
    python = run_inferlet(pie_server, python_component("speculative_decoding"), args)
    rust = run_inferlet(pie_server, build("speculative_decoding"), args)
    assert python.reason == rust.reason == "finished", (python.reason, rust.reason)
    assert json.loads(python.messages[0]) == json.loads(rust.messages[0])
    out = json.loads(python.messages[0])
    assert out["text"] == hf_chat(prompt, 24) and out["accepted"] > 0
    assert python.usage["forward_calls"] == rust.usage["forward_calls"] == out["steps"] < out["tokens"]
