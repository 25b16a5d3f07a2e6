"""The agent inferlets (ReAct, CodeAct, swarm, the Fig. 7 optimized agent) through a real
`pie serve` and the real tool server: tool calls are counted on the tool server's side
(GET /stats), KV reuse is read from the server's usage report, pages from /stats."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request

import pytest

from pie.client import PieClient

from pie_server import TOKEN, build, run_inferlet


@pytest.fixture(scope="module")
def server(pie_server):
    return pie_server


def tool_calls(tool_server) -> dict[str, int]:
    with urllib.request.urlopen(f"{tool_server.url}/stats", timeout=10) as response:
        return json.loads(response.read())["calls"]


def call_tool(tool_server, tool: str, **arguments) -> dict:
    request = urllib.request.Request(f"{tool_server.url}/tools/{tool}", json.dumps(arguments).encode(),
                                      {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {tool: after[tool] - before[tool] for tool in after if after[tool] != before[tool]}


def assert_no_leak(server) -> None:
    resources = server.resources()
    assert resources["kv_pages_free"] == resources["kv_pages_total"]
    assert resources["exports"] == 0


def run_json(server, name: str, args: list[str]) -> tuple[dict, dict]:
    run = run_inferlet(server, build(name), args)
    assert run.reason == "finished", run.reason
    assert len(run.messages) == 1, run.messages
    return json.loads(run.messages[0]), run.usage


def test_react_calls_tools_over_http_and_keeps_the_kv_cache(server, tool_server):
    steps, max_tokens = 2, 12
    before = tool_calls(tool_server)
    report, usage = run_json(server, "agent_react", [
        "--tools-url", tool_server.url, "--question",
        "What is the capital of France? Then compute 17 * 23.",
        "--steps", str(steps), "--max-tokens", str(max_tokens)])
    # The tool server itself received one call per step, of the tools the steps name.
    made = delta(tool_calls(tool_server), before)
    assert sum(made.values()) == steps
    assert made == {t: sum(s["tool"] == t for s in report["steps"]) for t in made}
    assert report["model_chosen"] + report["scripted"] == steps
    # Each observation is what the tool server answers to that call, and it is in the context.
    for step in report["steps"]:
        if step["tool"] == "calculator":
            expected = str(call_tool(tool_server, "calculator", expression=step["input"])["result"])
        else:
            expected = call_tool(tool_server, "search", query=step["input"], k=1)["results"][0]["text"]
        assert step["observation"] == expected
        assert f"Observation: {expected}\n" in report["context"]
    assert "391" in report["context"]  # 17 * 23, whoever chose the calculator call
    # One growing context: every token was run once (plus rejected action lines), never
    # re-prefilled after an observation (that alone would add the ~150-token prompt again).
    assert report["discarded_tokens"] <= steps * max_tokens
    assert usage["forward_tokens"] <= report["context_tokens"] + report["discarded_tokens"] + 2
    assert usage["forward_tokens"] >= report["context_tokens"] - 1
    assert_no_leak(server)


def run_codeact(server, tool_server, steps: int, *extra: str) -> tuple[dict, dict, dict]:
    before = tool_calls(tool_server)
    report, usage = run_json(server, "agent_codeact", [
        "--tools-url", tool_server.url, "--steps", str(steps), *extra])
    return report, usage, delta(tool_calls(tool_server), before)


def test_codeact_runs_model_code_in_the_sandbox_and_feeds_stdout_back(server, tool_server):
    steps = 2
    report, usage, made = run_codeact(server, tool_server, steps, "--max-tokens", "20", "--task",
                                      "First run print(sum(range(10))), then print 2 to the power 10.")
    assert made == {"execute": steps}  # counted by the tool server
    for step in report["steps"]:
        # The output in the context is what the sandbox prints for that very code.
        ran = call_tool(tool_server, "execute", code=step["code"])
        assert step["output"] == ran["stdout"].rstrip() and step["exit_code"] == ran["exit_code"] == 0
        assert f"Code: {step['code']}\nOutput: {step['output']}\n" in report["context"]
    # No re-prefill between calls: each token runs once (the final Output line is still pending).
    assert report["discarded_tokens"] <= steps * 20
    assert report["context_tokens"] - 16 <= usage["forward_tokens"]
    assert usage["forward_tokens"] <= report["context_tokens"] + report["discarded_tokens"] + 2
    assert_no_leak(server)


def test_codeact_scripted_snippet_when_the_model_line_is_unusable(server, tool_server):
    # One token per line can never be a complete `print(...)`: the scripted snippet runs.
    report, usage, made = run_codeact(server, tool_server, 1, "--max-tokens", "1",
                                      "--task", "Print the sum of 0..9.")
    assert made == {"execute": 1}
    assert report["scripted"] == 1 and report["steps"][0]["code"] == "print(sum(range(10)))"
    assert report["steps"][0]["output"] == "45"
    assert "Code: print(sum(range(10)))\nOutput: 45\n" in report["context"]
    assert usage["forward_tokens"] <= report["context_tokens"] + 2
    assert_no_leak(server)


def test_swarm_workers_answer_the_coordinator_over_broadcast(server, hf_chat):
    program = build("agent_swarm")
    questions = {"w0": "What is the capital of France?", "w1": "Name three colors.",
                 "w2": "What is 2 + 2?"}

    async def run():
        async with PieClient(server.ws, TOKEN) as client:
            digest = await client.upload(program)
            workers = {}
            for worker in questions:
                workers[worker] = await client.launch(digest, ["--role", "worker", "--id", worker,
                                                               "--topic", "t-swarm", "--max-tokens", "12"])
            for instance in workers.values():  # every worker listens before any task is sent
                assert (await instance.recv()).text == "subscribed"
            tasks = [arg for worker, q in questions.items() for arg in ("--task", f"{worker}={q}")]
            coordinator = await client.launch(digest, ["--role", "coordinator", "--topic", "t-swarm", *tasks])

            async def collect(instance):
                return [m async for m in instance], await instance.wait()

            return await asyncio.gather(collect(coordinator), *(collect(i) for i in workers.values()))

    (coord_messages, coord_reason), *worker_runs = asyncio.run(run())
    assert coord_reason == "finished" and [r for _, r in worker_runs] == ["finished"] * len(questions)
    own = {}
    for messages, _ in worker_runs:
        [report] = [json.loads(m) for m in messages]
        own[report["id"]] = report
        # A worker answers its task greedily in the chat template: HF's answer.
        assert report["task"] == questions[report["id"]] and report["answer"] == hf_chat(report["task"], 12)
    [summary] = [json.loads(m) for m in coord_messages]
    # Every worker's answer reached the coordinator, attributed to that worker.
    assert {r["worker"]: (r["task"], r["answer"]) for r in summary["results"]} == \
           {w: (r["task"], r["answer"]) for w, r in own.items()}
    assert summary["messages"] == len(questions)
    assert "Paris" in own["w0"]["answer"]
    assert_no_leak(server)


OPT_TASK = "Find the atomic number of carbon, then multiply it by 7."


@pytest.fixture(scope="module")
def optimized(server, tool_server):
    """agent_optimized without optimizations, with --opt-export twice (the first launch
    exports the docs, the second imports them; it also calls early, against APIs answering
    after 50 ms), and with --opt-mask:
    (report, usage, tool calls the tool server saw, server resources after) of each."""
    name = f"agents-test.docs.{os.getpid()}"
    args = ["--tools-url", tool_server.url, "--task", OPT_TASK, "--calls", "2", "--max-tokens", "8",
            "--export-name", name]
    runs = {}
    try:
        for key, flags in [("plain", []), ("export_first", ["--opt-export"]),
                           ("export_again", ["--opt-export", "--opt-early-call", "--api-latency-ms", "50"]),
                           ("mask", ["--opt-mask"])]:
            before = tool_calls(tool_server)
            report, usage = run_json(server, "agent_optimized", args + flags)
            runs[key] = (report, usage, delta(tool_calls(tool_server), before), server.resources())
    finally:
        run_inferlet(server, build("agent_optimized"), ["--unexport", "--export-name", name])
    return runs


def test_optimized_export_retains_the_api_docs_across_launches(server, optimized):
    plain, plain_usage, _, _ = optimized["plain"]
    first, first_usage, _, after_first = optimized["export_first"]
    again, again_usage, _, _ = optimized["export_again"]
    docs = plain["docs_tokens"]
    assert docs >= 200 and first["docs_exported"] and again["docs_imported"]
    # The first launch pays the full prefill and leaves the docs' pages in a persistent export.
    assert first_usage["forward_tokens"] == plain_usage["forward_tokens"]
    assert after_first["exports"] == 1
    assert after_first["kv_pages_total"] - after_first["kv_pages_free"] == -(-docs // 16)
    # The next launch imports them: the server ran at least the docs' length fewer tokens ...
    assert again_usage["forward_tokens"] <= plain_usage["forward_tokens"] - docs
    # ... and the agent did exactly the same (the imported KV is the prefilled one).
    assert again["context"] == plain["context"] and again["answer"] == plain["answer"]
    assert_no_leak(server)  # the export was removed


def test_optimized_early_call_issues_the_request_mid_generation(server, optimized):
    plain, _, plain_calls, _ = optimized["plain"]
    early, _, early_calls, _ = optimized["export_again"]
    # The tool server saw every call in both runs.
    assert plain_calls == early_calls == {"search": 1, "calculator": 1}
    for call in plain["calls"]:  # without the switch: after the whole line
        assert call["issued_at"] == call["line_tokens"]
    model_calls = [c for c in early["calls"] if c["source"] == "model"]
    assert model_calls  # the model closed at least one call itself
    for call in model_calls:  # with it: as soon as `)` was decoded, while the line went on
        assert call["issued_at"] < call["line_tokens"]
        assert f"{call['args']})" in early["context"]
    assert [c["observation"] for c in early["calls"]] == [c["observation"] for c in plain["calls"]]
    assert "atomic number 6" in early["calls"][0]["observation"]


def test_optimized_mask_drops_the_single_use_spec(server, optimized):
    plain, plain_usage, _, _ = optimized["plain"]
    masked, mask_usage, calls, _ = optimized["mask"]
    assert plain["masked_tokens"] == plain["dropped_pages"] == 0
    assert masked["masked_tokens"] > 0 and masked["dropped_pages"] > 0
    assert calls == {"search": 1, "calculator": 1}
    # The pages the spec filled were released: the instance held fewer pages at its peak.
    assert mask_usage["kv_pages_peak"] <= plain_usage["kv_pages_peak"] - masked["dropped_pages"]
    assert mask_usage["forward_tokens"] <= plain_usage["forward_tokens"] + 8
    assert_no_leak(server)
