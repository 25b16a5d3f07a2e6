"""The tool server: each tool's answers and refusals, the listing, and loopback-only binding."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from pie.tools import ToolConfig, ToolConfigError, create_tool_app

CONFIG = ToolConfig(slow_default_latency_ms=10, slow_max_latency_ms=1000,
                    execute_timeout_s=4.0, execute_cpu_s=1, execute_memory_mb=256,
                    execute_max_output_bytes=1000)


@pytest.fixture(scope="module")
def client():
    with TestClient(create_tool_app(CONFIG)) as client:
        yield client


def call(client: TestClient, tool: str, **arguments) -> httpx.Response:
    return client.post(f"/tools/{tool}", json=arguments)


def test_listing_names_every_tool_with_description_and_schema(client):
    listing = client.get("/tools").json()
    assert [t["name"] for t in listing] == ["calculator", "search", "slow", "execute"]
    for tool in listing:
        assert tool["description"] and "\n" not in tool["description"]
        assert tool["input_schema"]["type"] == "object"
    calculator = listing[0]["input_schema"]
    assert calculator["required"] == ["expression"]


@pytest.mark.parametrize("expression, result", [
    ("1 + 2 * 3", 7), ("-(3 - 5) // 2", 1), ("7 % 3", 1), ("2 ** 10", 1024),
    ("1 / 4", 0.25), ("sqrt(16) + log(e) + cos(0)", 6.0), ("log(8, 2)", 3.0),
])
def test_calculator(client, expression, result):
    response = call(client, "calculator", expression=expression)
    assert response.status_code == 200
    assert response.json() == {"result": result}


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "unknown function"),
    ("(1).__class__", "not allowed"),
    ("x + 1", "not allowed"),
    ("'a' * 3", "only numbers"),
    ("1 +", "not a valid expression"),
    ("1 / 0", "division by zero"),
    ("9 ** 9 ** 9", "too large"),
    ("(10 ** 1000) * (10 ** 1000) * (10 ** 1000)", "too large"),
    ("2.0 ** 100000", "cannot evaluate"),
    ("(-8) ** 0.5", "not a real number"),
    ("1" * 2000, "longer than"),
])
def test_calculator_refusals_are_400_with_a_reason(client, expression, message):
    response = call(client, "calculator", expression=expression)
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_bad_requests_are_400_and_unknown_tools_404(client):
    assert call(client, "calculator").status_code == 400  # missing argument
    typo = call(client, "calculator", expresion="1")
    assert typo.status_code == 400 and "expresion" in typo.json()["error"]
    not_json = client.post("/tools/search", content=b"{oops")
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
    unknown = call(client, "teleport")
    assert unknown.status_code == 404 and "calculator" in unknown.json()["error"]


def test_stats_count_requests_per_tool():
    with TestClient(create_tool_app(CONFIG)) as fresh:
        assert fresh.get("/stats").json() == {"calls": {"calculator": 0, "search": 0, "slow": 0,
                                                        "execute": 0}}
        call(fresh, "calculator", expression="1 + 1")
        call(fresh, "calculator", expression="1 +")  # refused, still a request
        call(fresh, "search", query="gold")
        call(fresh, "teleport")  # unknown: not counted
        assert fresh.get("/stats").json()["calls"] == {"calculator": 2, "search": 1, "slow": 0,
                                                       "execute": 0}


def test_search_ranks_by_overlap_and_is_deterministic(client):
    response = call(client, "search", query="What is the capital of France?", k=3)
    results = response.json()["results"]
    assert results[0]["id"] == "capital-france"
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    # Equal scores are ordered by id, so repeated calls give identical answers.
    tied = [r for r in results if r["score"] == results[1]["score"]]
    assert [r["id"] for r in tied] == sorted(r["id"] for r in tied)
    assert call(client, "search", query="What is the capital of France?", k=3).json() == \
        response.json()
    assert call(client, "search", query="atomic number of gold").json()["results"][0]["id"] == \
        "element-gold"
    assert call(client, "search", query="zzyzx").json() == {"results": []}
    assert call(client, "search", query="capital", k=0).status_code == 400


def test_slow_echoes_after_the_latency_and_caps_it(client):
    response = call(client, "slow", input={"a": [1, 2]}, latency_ms=50)
    assert response.json() == {"output": {"a": [1, 2]}, "latency_ms": 50}
    assert response.elapsed.total_seconds() >= 0.05
    assert call(client, "slow", input="x").json()["latency_ms"] == CONFIG.slow_default_latency_ms
    assert call(client, "slow", latency_ms=5000).status_code == 400


def test_any_tool_takes_a_simulated_latency(client):
    response = client.post("/tools/calculator?latency_ms=60", json={"expression": "6 * 7"})
    assert response.json() == {"result": 42} and response.elapsed.total_seconds() >= 0.06
    for bad in ("-1", "abc", str(CONFIG.slow_max_latency_ms + 1)):
        refused = client.post(f"/tools/calculator?latency_ms={bad}", json={"expression": "1"})
        assert refused.status_code == 400 and "latency_ms" in refused.json()["error"]


def test_execute_returns_output_and_exit_code(client):
    result = call(client, "execute", code="import os, sys\nprint(6 * 7)\nprint(dict(os.environ))"
                                          "\nprint('oops', file=sys.stderr)\nsys.exit(3)").json()
    lines = result["stdout"].splitlines()
    assert lines[0] == "42"
    assert "PATH" not in lines[1] and "HOME" not in lines[1]  # empty environment
    assert result["stderr"] == "oops\n"
    assert result["exit_code"] == 3 and not result["timed_out"]


def test_execute_limits(client):
    sleeper = call(client, "execute", code="import time\nprint('started', flush=True)\n"
                                           "time.sleep(30)").json()
    assert sleeper["timed_out"] and sleeper["exit_code"] < 0
    assert sleeper["stdout"] == "started\n"  # output before the kill is kept

    hog = call(client, "execute", code="x = bytearray(2 * 1024**3)").json()
    assert hog["exit_code"] == 1 and "MemoryError" in hog["stderr"]

    flood = call(client, "execute", code="print('x' * 100_000)").json()
    assert flood["stdout_truncated"] and len(flood["stdout"]) == CONFIG.execute_max_output_bytes
    assert flood["exit_code"] == 0

    too_long = call(client, "execute", code="#" * (CONFIG.max_code_bytes + 1))
    assert too_long.status_code == 400


def test_execute_cpu_limit():
    """A spinning snippet is killed by its CPU limit (SIGXCPU). The wall-clock limit is set
    far above it here, so however little CPU a loaded machine gives the snippet, the CPU
    limit is what ends it (with the 4 s of CONFIG, 1 s of CPU needs a quarter of a core)."""
    config = dataclasses.replace(CONFIG, execute_timeout_s=600.0)
    with TestClient(create_tool_app(config)) as client:
        spinner = call(client, "execute", code="while True: pass").json()
    assert spinner["exit_code"] == -24 and not spinner["timed_out"]  # SIGXCPU


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "example.com"])
def test_non_loopback_hosts_are_refused(host):
    """ToolConfig is the one check: serve_tools and `python -m pie.tools` build one."""
    with pytest.raises(ToolConfigError, match="loopback only"):
        ToolConfig(host=host)


def test_module_entry_point_serves_over_real_http():
    process = subprocess.Popen([sys.executable, "-m", "pie.tools", "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("Pie tools serving on http://127.0.0.1:")
        url = line.split()[-1]
        response = httpx.post(f"{url}/tools/calculator", json={"expression": "6 * 7"}, timeout=10)
        assert response.json() == {"result": 42}
    finally:
        process.terminate()
        process.wait(timeout=10)
    refused = subprocess.run([sys.executable, "-m", "pie.tools", "--host", "0.0.0.0"],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "loopback only" in refused.stderr
