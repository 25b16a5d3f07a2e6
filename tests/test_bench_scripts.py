"""Pie's own benchmark scripts (`make bench`, soak, drain) in their `--quick` mode, so that
they cannot rot: each runs as a subprocess against the real layers and writes its JSON to a
temporary file (never over benchmarks/results/). Figures are not checked (never wall-clock
in tests); the work done, every field, the settings recorded and the internal consistency
of the numbers are: tokens counted equal tokens asked, times are positive, ratios follow
from the figures, host calls carry real WIT function names, the rounds rotate the systems.

Every quick run but `overhead` and `backend` is marked slow (`make test-all` only): each
starts its own servers and together they took ~17 min of a 46-min suite on 2 vCPUs, while
the features they drive have their own end-to-end tests; `--help` of every script and the
RESULTS.md rendering of the committed results stay in `make test`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run_info import CPU_FLAGS, cpu_label, cpu_microarchitecture, machine_settings, rotated
from benchmarks.soak import WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # one script's quick run; ~15-60 s each here, more on a busy machine

META = {"date", "command", "quick", "rounds", "order", "dtype", "model", "cpu", "cpu_flags", "cores",
        "torch", "python", "load_average"}


def run_quick(script: str, out: Path, *extra: str) -> dict:
    done = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--quick", "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each script's quick JSON, run on first use (once per module)."""
    out, cache = tmp_path_factory.mktemp("bench-scripts"), {}

    def get(script: str) -> dict:
        if script not in cache:
            cache[script] = run_quick(script, out / f"{script}.json")
        return cache[script]
    get.out = out
    return get


def wit_function_names() -> set[str]:
    """Every host function under the name the runtime counts its calls by: `name` for a
    function, `[method]resource.name` for a resource's method."""
    names: set[str] = set()
    for path in (ROOT / "sdk" / "wit").glob("*.wit"):
        depth, resource, resource_depth = 0, None, 0
        for line in path.read_text().splitlines():
            code = line.split("//")[0].strip()
            if match := re.match(r"resource\s+([\w-]+)\s*\{", code):
                resource, resource_depth = match.group(1), depth
            elif match := re.match(r"([\w-]+)\s*:\s*func\b", code):
                names.add(f"[method]{resource}.{match.group(1)}" if resource else match.group(1))
            depth += code.count("{") - code.count("}")
            if resource and depth <= resource_depth:
                resource = None
    return names


def check_meta(meta: dict, systems: list[str] | None = None) -> None:
    """The settings every script records; with `systems`, that the rounds rotate them."""
    assert META <= set(meta), META - set(meta)
    assert meta["quick"] is True and meta["rounds"] >= 1
    assert meta["dtype"] in ("bfloat16", "float32") and meta["model"]
    assert meta["cpu"] and meta["cores"] >= 1 and meta["torch"] and meta["python"]
    assert set(meta["cpu_flags"]) == set(CPU_FLAGS) and all(isinstance(v, bool) for v in meta["cpu_flags"].values())
    assert len(meta["load_average"]) == 3
    if systems is not None:
        order = meta["order"]
        assert len(order) == meta["rounds"] >= 2
        assert all(sorted(names) == sorted(systems) for names in order), order
        assert len({names[0] for names in order}) > 1, f"the same system first in every round: {order}"


def test_wit_names_are_the_ones_the_runtime_counts():
    names = wit_function_names()
    assert {"sample", "forward", "embed-text", "wait", "[method]pollable.ready",
            "[method]future-token.get", "[method]matcher.sample"} <= names
    assert "poll" not in names and len(names) > 42


def test_rotation_and_machine_settings():
    assert [rotated(["pie", "hf"], r) for r in range(3)] == [["pie", "hf"], ["hf", "pie"], ["pie", "hf"]]
    assert [rotated(["a", "b", "c"], r)[0] for r in range(3)] == ["a", "b", "c"]
    settings = machine_settings()
    assert settings["cores"] >= 1 and set(settings["cpu_flags"]) == set(CPU_FLAGS)
    assert "cpu_microarchitecture" in settings  # None where unknown (not AMD, no /proc/cpuinfo)


@pytest.mark.parametrize(("vendor", "family", "model", "arch"), [
    ("AuthenticAMD", 23, 0x01, "Zen/Zen+"),  # Naples
    ("AuthenticAMD", 23, 0x31, "Zen 2"),  # Rome
    ("AuthenticAMD", 23, 0x88, "Zen (family 17h)"),  # a family-17h model the ranges do not name
    ("AuthenticAMD", 25, 0x01, "Zen 3"),  # Milan
    ("AuthenticAMD", 25, 0x21, "Zen 3"),
    ("AuthenticAMD", 25, 0x11, "Zen 4"),  # Genoa: benchmarks/results/epyc-zen4
    ("AuthenticAMD", 25, 0x61, "Zen 4"),
    ("AuthenticAMD", 25, 0xA0, "Zen 4"),
    ("AuthenticAMD", 25, 0x30, None),
    ("AuthenticAMD", 26, 0x02, "Zen 5"),  # Turin: benchmarks/results/epyc-zen5
    ("AuthenticAMD", 26, 0x44, "Zen 5"),
    ("AuthenticAMD", 26, 0x90, None),
    ("AuthenticAMD", 21, 0x02, None),  # Bulldozer's family: not mapped
    ("GenuineIntel", 6, 0x8F, None),  # Intel is not mapped
    ("AuthenticAMD", None, None, None),
])
def test_cpu_microarchitecture(vendor, family, model, arch):
    assert cpu_microarchitecture(vendor, family, model) == arch


def test_cpu_label_names_the_microarchitecture():
    """What RESULTS.md shows for a file's CPU: derived from family/model where the file
    predates `cpu_microarchitecture`, so two "AMD EPYC" of different families differ."""
    assert cpu_label({"cpu": "AMD EPYC", "cpu_family_model": "26/2"}) == "AMD EPYC (family 26 model 2, Zen 5)"
    assert cpu_label({"cpu": "AMD EPYC", "cpu_family_model": "25/17", "cpu_microarchitecture": "Zen 4"}) \
        == "AMD EPYC (family 25 model 17, Zen 4)"
    assert cpu_label({"cpu": "Intel(R) Xeon(R) Processor", "cpu_family_model": "6/143"}) \
        == "Intel(R) Xeon(R) Processor (family 6 model 143)"
    assert cpu_label({"cpu": "AMD EPYC"}) == "AMD EPYC" and cpu_label({}) == "CPU not recorded"


def test_full_runs_take_at_least_three_rounds():
    from benchmarks import backend, frontends, overhead, prefix_cache

    assert min(backend.ROUNDS, frontends.ROUNDS, overhead.ROUNDS, prefix_cache.ROUNDS) >= 3


def test_overhead_quick(results):
    data = results("overhead")
    meta = data["meta"]
    check_meta({**meta, "order": meta["order"]["per_token"]}, ["pie", "direct"])
    check_meta({**meta, "order": meta["order"]["launch"]}, ["cold", "warm"])
    rounds = meta["rounds"]
    # Off, as the runtime reports it: the waves repeat their prompts and the direct driver has
    # no cache, so with it on "overhead" would measure Pie's cache hits.
    assert data["prefix_cache"] is None

    latency = data["api_latency_us"]
    assert latency and all(v > 0 for v in latency.values())
    assert {k for k in latency if k.startswith("inference:")} and {k for k in latency if k.startswith("control:")}
    assert all(len(data["api_latency_rounds_us"][k]) == rounds for k in latency)

    calls = data["calls_per_token"]
    # tokens from the instance's usage (`sampled_tokens`), not from `sample` calls: a
    # host-side run draws every token without one
    assert calls["tokens"] == calls["tokens_asked"] > 0
    assert calls["calls"] == sum(calls["by_function"].values()) > 0
    assert all(n > 0 for n in calls["by_function"].values())
    assert calls["calls_per_token"] == pytest.approx(calls["calls"] / calls["tokens"])
    assert calls["by_function_per_token"] == {k: round(n / calls["tokens"], 2) for k, n in calls["by_function"].items()}
    unknown = (set(calls["by_function"]) | set(calls["by_function_per_token"])) - wit_function_names()
    assert not unknown, f"host-call names that are no WIT function: {unknown}"

    levels = sorted({row["concurrency"] for row in data["launch"]})
    assert len(levels) >= 1 and len(data["launch"]) == 2 * len(levels)
    for row in data["launch"]:
        assert row["launches"] == row["concurrency"] * rounds and len(row["round_medians_ms"]) == rounds
        assert 0 < row["median_ms"] <= row["p99_ms"]

    assert [row["batch"] for row in data["per_token"]] == [1, 2]
    for row in data["per_token"]:
        asked = row["batch"] * row["tokens"]
        assert row["pie_tokens"] == row["direct_tokens"] == [asked] * rounds, row
        assert len(row["pie_round_s"]) == len(row["direct_round_s"]) == rounds
        assert row["pie_ms_per_token"] > 0 and row["direct_ms_per_token"] > 0
        assert row["overhead"] == pytest.approx(row["pie_ms_per_token"] / row["direct_ms_per_token"] - 1)
        # items per model-running batch over Pie's timed rounds, from the scheduler's counters
        assert len(row["forward_calls"]) == len(row["forward_batches"]) == rounds
        assert all(0 < b <= c for c, b in zip(row["forward_calls"], row["forward_batches"])), row
        # every instance's steps ride some batch: at least one item per token it generated
        # after its prefill, and no more batches than items
        assert all(c >= asked for c in row["forward_calls"]), row
        assert row["mean_forward_batch"] == pytest.approx(sum(row["forward_calls"]) / sum(row["forward_batches"]))
        assert 1 <= row["mean_forward_batch"] <= row["batch"], row

    for key, program in (("control_cpu", "text_completion"), ("control_cpu_streamed", "openai_completion")):
        check_control_cpu(data[key], program, rounds)

    scheduler = data["scheduler"]
    assert sum(scheduler["batches"].get(k, 0) for k in ("forward", "pass")) > 0, scheduler


def check_control_cpu(cpu: dict, program: str, rounds: int) -> None:
    assert cpu["program"] == program
    assert cpu["instances"] >= 2 and cpu["tokens_each"] >= 2
    assert cpu["tokens_asked"] == cpu["instances"] * cpu["tokens_each"]
    assert cpu["target_control_ms_per_token"] == 0.3 and cpu["clock_ticks_per_s"] > 0
    assert len(cpu["rounds"]) == rounds
    tick_s = 1 / cpu["clock_ticks_per_s"]
    for r in cpu["rounds"]:
        assert r["tokens"] == cpu["tokens_asked"], r
        assert r["control_cpu_s"] > 0 and r["backend_cpu_s"] > 0 and r["scheduler_cpu_s"] >= 0, r
        # the scheduler thread is part of the control process (both rounded to clock ticks)
        assert r["scheduler_cpu_s"] <= r["control_cpu_s"] + 2 * tick_s, r
        for part in ("control", "scheduler", "backend"):
            assert r[f"{part}_ms_per_token"] == pytest.approx(1e3 * r[f"{part}_cpu_s"] / r["tokens"]), (part, r)
    for part in ("control", "scheduler", "backend"):
        per_round = sorted(r[f"{part}_ms_per_token"] for r in cpu["rounds"])
        assert per_round[0] <= cpu[f"{part}_ms_per_token"] <= per_round[-1], part  # the median
    assert cpu["control_ms_per_token"] > 0 and cpu["backend_ms_per_token"] > 0


def test_backend_quick(results):
    data = results("backend")
    meta = data["meta"]
    check_meta(meta, ["pie", "hf"])
    assert meta["pie_dtype"] == meta["hf_dtype"] == meta["dtype"]
    assert meta["hf_attn_implementation"] and meta["hf_attn_implementation"] != "eager", \
        "HF is measured with its default attention (SDPA), not pinned to eager"
    rounds, steps = meta["rounds"], meta["steps_per_round"]

    prefill = data["prefill"]
    assert prefill["tokens"] > 0 and prefill["pie_tokens_per_s"] > 0 and prefill["hf_tokens_per_s"] > 0
    assert len(prefill["pie_round_s"]) == len(prefill["hf_round_s"]) == rounds
    assert prefill["pie_over_hf"] == pytest.approx(prefill["pie_tokens_per_s"] / prefill["hf_tokens_per_s"])

    assert [row["batch"] for row in data["decode"]] == [1, 2]
    for row in data["decode"]:
        assert row["steps"] == rounds * steps == len(row["pie_step_ms_all"]) == len(row["hf_step_ms_all"])
        assert row["pie_tokens"] == row["hf_tokens"] == row["batch"] * row["steps"], row
        assert row["pie_step_ms"] > 0 and row["hf_step_ms"] > 0
        assert row["pie_tokens_per_s"] == pytest.approx(1e3 * row["batch"] / row["pie_step_ms"])
        assert row["hf_over_pie_time"] == pytest.approx(row["hf_step_ms"] / row["pie_step_ms"])


@pytest.mark.slow
def test_frontends_quick(results):
    data = results("frontends")
    meta = data["meta"]
    check_meta({**meta, "order": meta["order"]["ms_per_token"]},
               ["native", "openai", "python", "openai-json", "openai-tools"])
    assert all(sorted(names) == ["python", "rust"] for names in meta["order"]["launch"])

    for language in ("rust", "python"):
        launch = data["launch"][language]
        assert launch["cold_ms"] > 0 and launch["warm_ms"] > 0 and launch["size_mb"] > 0
        assert launch["cold_runs"] == len(meta["order"]["launch"]) and launch["warm_runs"] >= 1
    assert all(sorted(names) == ["python", "rust"] for names in meta["order"]["rebuild"])
    for language in ("rust", "python"):
        rebuild = data["rebuild"][language]
        assert len(rebuild["edit_rebuild_rounds_s"]) == len(meta["order"]["rebuild"])
        assert rebuild["edit_rebuild_s"] > 0 and rebuild["unchanged_s"] > 0
    assert data["rebuild"]["python"]["unchanged_s"] < data["rebuild"]["python"]["edit_rebuild_s"]  # a cache hit
    assert data["rebuild_ratio_python_vs_rust"] == pytest.approx(
        data["rebuild"]["python"]["edit_rebuild_s"] / data["rebuild"]["rust"]["edit_rebuild_s"])
    assert data["python_edit_to_running_s"] == pytest.approx(
        data["rebuild"]["python"]["edit_rebuild_s"] + data["launch"]["python"]["cold_ms"] / 1000)
    assert len(data["interpret"]["edit_to_running_rounds_ms"]) == len(meta["order"]["launch"])
    assert data["edit_to_running_ratio_build_vs_interpret"] == pytest.approx(
        data["python_edit_to_running_s"] * 1000 / data["interpret"]["edit_to_running_ms"])
    for key in ("cold_ms", "warm_ms"):
        assert data["launch_ratio_python_vs_rust"][key] == pytest.approx(
            data["launch"]["python"][key] / data["launch"]["rust"][key])

    paths = ["native", "openai", "python", "openai-json", "openai-tools"]
    assert sorted(data["ms_per_token"]) == sorted(paths)
    for path in paths:
        assert data["tokens"][path] == [data["max_tokens"]] * meta["rounds"], (path, data["tokens"])
        assert len(data["ms_per_token_rounds"][path]) == meta["rounds"]
        assert data["ms_per_token"][path] > 0
        assert data["ratio_vs_native"][path] == pytest.approx(data["ms_per_token"][path] / data["ms_per_token"]["native"])
    assert data["same_output"], f"fp32 greedy: every path generates the same text: {data['outputs']}"
    assert data["json_schema_cost"] == data["ms_per_token"]["openai-json"] / data["ms_per_token"]["openai"]
    assert all(text.lstrip().startswith("{") and '"story"' in text for text in data["outputs"]["openai-json"])
    assert data["tool_call_cost"] == data["ms_per_token"]["openai-tools"] / data["ms_per_token"]["openai"]
    assert all(text.startswith('{"story": "') for text in data["outputs"]["openai-tools"])  # the call's arguments


@pytest.mark.slow
def test_soak_quick(results):
    data = results("soak")
    check_meta(data["meta"])
    assert data["instances"] == 6 and data["seconds"] > 0
    assert data["errors"] == {}, data["error_examples"]
    assert data["lost_messages"] == 0 and data["wrong_answers"] == 0
    assert data["warmup_completed"] == {w: sum(1 for i in range(data["instances"]) if i % len(WORKLOADS) == n)
                                        for n, w in enumerate(WORKLOADS)}, "the warm-up deals every workload out"
    assert set(data["completed"]) == set(WORKLOADS) and sum(data["completed"].values()) >= data["instances"]
    for workload in WORKLOADS:
        assert 0 < data["p50_ms"][workload] <= data["p99_ms"][workload]
    assert data["pools_reclaimed"]
    leaks = data["leak_check"]
    assert not leaks["leaked"] and leaks["threads_before"] > 0 and leaks["fds_before"] > 0, leaks


@pytest.mark.slow
def test_dtypes_quick(results):
    """Both dtypes measured in one run, every decode batch with its ratio; meta says what
    backend.dtype = auto picks on this CPU."""
    from pie.backend.dtype import resolve_dtype

    data = results("dtypes")
    check_meta(data["meta"], systems=["bfloat16", "float32"])
    assert data["meta"]["dtype"] == resolve_dtype("auto", "cpu") and data["meta"]["compared"] == ["bfloat16", "float32"]
    assert [row["batch"] for row in data["decode"]] == [1, 2]
    for row in data["decode"]:
        assert row["steps"] == 4 and row["fp32_over_bf16_time"] == row["float32_step_ms"] / row["bfloat16_step_ms"]
    assert data["memory_mb"]["bfloat16"] > 0 and data["memory_mb"]["float32"] > 0


@pytest.mark.slow
def test_quantization_quick(results):
    data = results("quantization")
    meta = data["meta"]
    check_meta(meta, ["base", "int8"])
    systems = meta["systems"]
    assert systems["int8"]["weight_dtype"] == "int8" and systems["base"]["weight_dtype"] == "model"
    assert systems["base"]["handshake_dtype"] == systems["int8"]["handshake_dtype"] == meta["dtype"]
    quality = data["quality"]
    assert set(quality) == set(systems) == set(data["startup"])
    reference = quality[meta["reference"]]
    assert reference["agreement_with_fp32"]["identical"] == 1.0  # the reference against itself
    for name, q in quality.items():
        assert q["agreement_with_fp32"]["prompts"] == meta["prompts"] == 4
        assert 0 <= q["agreement_with_fp32"]["identical"] <= q["agreement_with_fp32"]["mean_prefix_share"] <= 1
        assert q["scored_tokens"] == 128
        # int8 may cost a little perplexity, never an order of magnitude (a broken kernel does)
        assert 1 < q["perplexity"] < 2 * reference["perplexity"], (name, q)
        assert data["startup"][name]["load_s"] > 0 and data["startup"][name]["rss_mb"] > 0
    assert [row["batch"] for row in data["speed"]["decode"]] == [1, 2]
    for row in data["speed"]["decode"]:
        assert len(row["base_step_ms_all"]) == len(row["int8_step_ms_all"]) == row["steps"] == meta["rounds"] * meta["steps_per_round"]
        assert row["base_over_int8_time"] == pytest.approx(row["base_step_ms"] / row["int8_step_ms"])


@pytest.mark.slow
def test_placement_quick(results):
    data = results("placement")
    meta = data["meta"]
    check_meta(meta, ["default", "control-nice"])
    assert set(data["samples"]) == {"default", "control-nice"}
    assert all(len(s) == meta["rounds"] for s in data["samples"].values())
    assert {(row["variant"], row["batch"]) for row in data["rows"]} == {
        (v, b) for v in ("default", "control-nice") for b in (1, 2)}
    for row in data["rows"]:
        assert row["pie_ms_per_token"] > 0 and row["direct_ms_per_token"] > 0
        if row["variant"] == "default":
            assert row["pie_over_default"] == row["direct_over_default"] == 1.0
        assert 0 < row["mean_forward_batch"] <= row["batch"]


@pytest.mark.slow
def test_drain_quick(results):
    data = results("drain")
    meta = data["meta"]
    check_meta(meta)
    assert meta["order"] == [["finish", "cut"]]
    for name, reason in (("finish", "finished"), ("cut", "server shutting down")):
        run = data[name]
        n = run["instances"]
        assert run["reasons"] == {reason: n}, run
        assert len(run["output_chars"]) == n
        assert run["health_while_draining"] == "draining" and run["launch_refused_while_draining"]
        assert run["exit_code"] == 0 and run["signal_to_exit_s"] > 0
    assert data["finish"]["running_at_signal"] >= 1, "the signal came after every instance had ended"
    assert data["cut"]["running_at_signal"] == data["cut"]["instances"]
    assert all(chars > 0 for chars in data["finish"]["output_chars"]), "drained to the end: whole outputs"
    assert data["cut"]["drain_timeout_s"] < data["finish"]["drain_timeout_s"]


@pytest.mark.slow
def test_prefix_cache_quick(results):
    """The conversation on two servers, cache on and off: the "on" one copied pages."""
    data = results("prefix_cache")
    check_meta(data["meta"], ["on", "off"])
    assert data["lines"] == 3 and [run["clients"] for run in data["runs"]] == [1, 8]
    for run in data["runs"]:
        assert len(run["on_round_s"]) == len(run["off_round_s"]) == data["meta"]["rounds"]
        assert run["speedup"] == pytest.approx(run["off_s"] / run["on_s"])
    stats = data["prefix_cache_stats"]
    assert stats["hit_tokens"] > 0 and stats["lookups"] >= 3 * 9 * data["meta"]["rounds"]


@pytest.mark.slow
def test_api_serve_quick(results):
    """Every policy at every rate on its own server; the same requests for each; the
    sustained rates and their ratios follow from the rows; nothing was killed."""
    data = results("api_serve")
    check_meta(data["meta"])
    assert data["policies"] == ["discard", "preserve", "swap", "min-waste"]
    rows = {(r["policy"], r["rate"]): r for r in data["rows"]}
    assert set(rows) == {(p, rate) for p in data["policies"] for rate in data["rates"]}
    assert data["not_finished"] == 0 and all(r["not_finished"] == 0 and r["requests"] == data["requests"] for r in rows.values())
    for r in rows.values():
        assert 0 <= r["recompute_share"] < 1 and r["forward_tokens"] > 0 and r["normalized_mean_s"] > 0
        assert [q["context"] for q in r["per_request"]] == [q["context"] for q in data["rows"][0]["per_request"]]
    assert all(rows[(p, rate)]["discarded"] == 0 for p in ("preserve", "swap") for rate in data["rates"])
    assert all(rows[(p, rate)]["swapped_out"] == 0 for p in ("preserve", "discard") for rate in data["rates"])
    if data["sustained"]["discard@0"]:
        assert data["min_waste_over_discard"] == pytest.approx(data["sustained"]["min-waste@0"] / data["sustained"]["discard@0"])
    assert Path(results.out / "api_serve.png").stat().st_size > 0


@pytest.mark.slow
def test_prefill_only_quick(results):
    """Every policy at every rate on its own server, the same requests for each, every
    request scored; the sustained rates follow from the rows."""
    data = results("prefill_only")
    check_meta(data["meta"])
    assert data["policies"] == ["fcfs", "srjf", "srjf-credit"]
    rows = {(r["policy"], r["rate"]): r for r in data["rows"]}
    assert set(rows) == {(p, rate) for p in data["policies"] for rate in data["rates"]}
    assert data["not_finished"] == 0
    for r in rows.values():
        assert r["requests"] == data["requests"] and r["mean_s"] > 0 and r["p99_s"] >= r["mean_s"] * 0.5
        assert all(q["tokens"] > 0 for q in r["per_request"])
        assert [q["user"] for q in r["per_request"]] == [q["user"] for q in data["rows"][0]["per_request"]]
    if data["sustained_mean"]["fcfs"]:
        assert data["srjf_over_fcfs_mean"] == pytest.approx(data["sustained_mean"]["srjf"] / data["sustained_mean"]["fcfs"])
    assert Path(results.out / "prefill_only.png").stat().st_size > 0


@pytest.mark.slow
def test_max_input_quick(results):
    """Both modes at both lengths, the need = tensor peak + scratch, the longest inputs follow
    from the rows and the budget, and whether the log-probabilities were equal is recorded
    as found."""
    data = results("max_input")
    check_meta(data["meta"])
    one_shot, chunked = data["modes"].values()
    assert [r["tokens"] for r in one_shot] == [r["tokens"] for r in chunked] == [300, 600]
    for r in one_shot + chunked:
        assert r["need_bytes"] == r["peak_bytes"] + r["scratch_bytes"] and r["peak_bytes"] > 0
        assert len(r["logprobs"]) == 3 and all(v < 0 for v in r["logprobs"])
    assert data["budget_bytes"] == one_shot[0]["need_bytes"] and data["longest"]["one-shot"] >= 300
    assert data["longest_ratio"] == data["longest"]["chunked"] / data["longest"]["one-shot"]
    # One layer's K/V instead of every layer's: the chunked scratch stops growing with T.
    assert chunked[1]["scratch_bytes"] < one_shot[1]["scratch_bytes"]
    assert data["identical_logprobs"] == all(a["logprobs"] == b["logprobs"] for a, b in zip(one_shot, chunked))
    assert Path(results.out / "max_input.png").stat().st_size > 0


@pytest.mark.slow
def test_objectives_quick(results):
    """Both systems every round, in rotated order; every chat turn answered; the medians and
    ratios follow from the runs."""
    data = results("objectives")
    check_meta(data["meta"], ["blind", "objectives"])
    w = data["workload"]
    assert len(data["runs"]) == 2 * data["meta"]["rounds"]
    for run in data["runs"]:
        assert len(run["turns"]) == w["sessions"] * w["turns"] and run["map_reduce_s"] > 0
        assert all(t["tokens"] >= 1 and t["normalized_s"] == t["latency_s"] / t["tokens"] for t in run["turns"])
    median = data["median"]
    assert data["chat_speedup"] == median["blind"]["chat_normalized_mean_s"] / median["objectives"]["chat_normalized_mean_s"]
    assert data["map_reduce_ratio"] == median["objectives"]["map_reduce_s"] / median["blind"]["map_reduce_s"]
    assert Path(results.out / "objectives.png").stat().st_size > 0


@pytest.mark.slow
def test_semantic_variables_quick(results):
    """Both of Pie's sides ran every application each round, in rotated order, each run
    produced text; the medians and ratios follow from the runs."""
    data = results("semantic_variables")
    check_meta(data["meta"], ["inferlet", "client"])
    runs = data["runs"]
    assert len(runs) == 2 * 2 * data["meta"]["rounds"] and all(r["result_chars"] > 0 for r in runs)
    for app in ("chain", "map-reduce"):
        median = data["median"][app]
        assert data["speedup"][app]["pie_client"] == median["pie_client"] / median["pie_inferlet"]
    assert Path(results.out / "semantic_variables.png").stat().st_size > 0


@pytest.mark.slow
def test_shared_prompt_quick(results):
    """Every side ran each round in rotated order (noshare at full length only); requests/s
    and the ratios follow from the medians."""
    data = results("shared_prompt")
    check_meta(data["meta"], ["shared", "shared_nokernel", "noshare", "v1"])
    runs, users, tokens = data["runs"], data["workload"]["users"], data["workload"]["max_tokens"]
    assert len(runs) == 7 * data["meta"]["rounds"] and all(r["seconds"] > 0 for r in runs)
    assert {r["max_tokens"] for r in runs if r["side"] == "noshare"} == {tokens}
    for side, rps in data["requests_per_s"].items():
        assert rps == users / data["makespan_s"][side]
    s = data["speedup"]
    assert s["sharing"] == data["requests_per_s"]["shared"] / data["requests_per_s"]["noshare"]
    assert s["kernel_per_token"] == data["per_token_ms"]["shared_nokernel"] / data["per_token_ms"]["shared"]
    assert Path(results.out / "shared_prompt.png").stat().st_size > 0


@pytest.mark.slow
def test_shared_prefix_attention_quick(results):
    """Both sides timed every round, in rotated order; speedups follow from the medians; the
    shared path's outputs equal the plain path's."""
    data = results("shared_prefix_attention")
    check_meta(data["meta"], ["on", "off"])
    assert [(r["prefix"], r["users"]) for r in data["rows"]] == [(64, 2), (64, 4)]
    for row in data["rows"]:
        assert len(row["samples"]["on"]) == len(row["samples"]["off"]) == data["meta"]["rounds"]
        assert row["speedup"] == row["off_ms"] / row["on_ms"] and row["max_abs_diff"] < 1e-2


@pytest.mark.slow
def test_workflows_quick(results):
    """Every side ran each round in rotated order; the ratios follow from the medians;
    helium ran fewer calls than it declared. (Its outputs equal the naive plan's in fp32:
    tests/test_python_inferlets.py; this run is bf16, where batching moves roundings.)"""
    data = results("workflows")
    sides = ["helium", "parrot", "concurrent", "client", "client-waves", "client-serial"]
    check_meta({**data["meta"], "order": data["meta"]["order"]["trading"]}, sides)
    block = data["workflows"]["trading"]
    assert isinstance(block["outputs_equal_naive"], bool) and block["llm_calls_optimized"] < block["llm_calls"]
    assert len(data["runs"]) == len(sides) * data["meta"]["rounds"] and all(r["seconds"] > 0 for r in data["runs"])
    median = block["median_s"]
    assert block["speedup_vs_best"] == median[block["best_baseline"]] / median["helium"]
    helium = [r["stats"] for r in data["runs"] if r["side"] == "helium"]
    assert all(s["kept"] < s["declared"] and s["llm_calls"] + s["cache_hits"] <= s["kept"] for s in helium)
    assert Path(results.out / "workflows.png").stat().st_size > 0


def test_every_script_takes_quick_and_out():
    """Each script offers `--quick` and `--out` (without `--out` a test would write over the
    committed benchmarks/results/)."""
    for script in ("overhead", "backend", "quantization", "placement", "frontends", "prefix_cache", "api_serve",
                   "prefill_only", "max_input", "objectives", "semantic_variables", "shared_prompt",
                   "shared_prefix_attention", "workflows", "soak", "drain", "replicas", "router_sim"):
        done = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0 and "--out" in done.stdout and "--quick" in done.stdout, script


@pytest.mark.slow
def test_replicas_quick(results):
    """One replica vs two, each on a core of its own, and one of two killed mid-wave."""
    data = results("replicas")
    check_meta(data["meta"])
    rates = data["tokens_per_s"]
    assert set(rates) == {"1x1", "2x1"} and all(r > 0 for r in rates.values())
    assert data["speedup"] == pytest.approx(rates["2x1"] / rates["1x1"])
    assert data["launched_per_replica"]["1x1"] == [2 * data["instances"]]  # warm-up and measured waves
    assert len(data["launched_per_replica"]["2x1"]) == 2 and min(data["launched_per_replica"]["2x1"]) >= 1
    f = data["failure"]
    assert f["on_killed_replica_at_kill"] >= 1 and f["ended_with_error"] == f["on_killed_replica_at_kill"]
    assert f["finished"] == f["instances"] - f["ended_with_error"] and f["finished_same_text"]
    assert all("backend replica 1 process exited" in r for r in f["error_reasons"])
    assert f["after"]["finished"] == f["instances"] and [r["status"] for r in f["replicas_after"]] == ["ok", "ok"]
    assert (results.out / "replicas.png").stat().st_size > 0


def test_router_sim_quick(results):
    """The real placement code over simulated replicas: cache-aware placement finds more
    cached prefix than load-only policies, and its load bound keeps imbalance near theirs."""
    data = results("router_sim")
    rows = data["policies"]
    assert set(rows) == {"random", "round-robin", "least-loaded", "cache-aware/4", "cache-aware/16", "cache-aware/64"}
    assert rows["cache-aware/4"]["hit_rate"] > rows["least-loaded"]["hit_rate"]
    assert rows["least-loaded"]["imbalance_mean"] <= rows["random"]["imbalance_mean"]
    assert rows["cache-aware/4"]["imbalance_mean"] <= rows["cache-aware/64"]["imbalance_mean"]
    assert all(0 <= r["hit_rate"] <= 1 and r["imbalance_mean"] >= 1 for r in rows.values())


@pytest.mark.parametrize("source", ["committed", pytest.param("quick", marks=pytest.mark.slow)])
def test_results_md_has_a_section_per_script(source, results, tmp_path):
    """RESULTS.md renders every script's JSON next to the engine comparisons: its title, the
    command that made it, and the figure it exists for, taken from the file. From the
    committed results (fast), and from every script's quick run of this commit (slow: it
    runs them all)."""
    from benchmarks import report
    from benchmarks.__main__ import SCRIPTS, WORKLOADS
    from benchmarks.script_tables import _f as report_f

    committed = ROOT / "benchmarks" / "results"
    if source == "quick":
        data, folder = {script: results(script) for script in SCRIPTS}, results.out
    else:
        data, folder = {script: json.loads((committed / f"{script}.json").read_text()) for script in SCRIPTS}, tmp_path
        for script in SCRIPTS:
            shutil.copy(committed / f"{script}.json", folder)
    # The GPU run's file, as benchmarks/cuda_check.sh wrote it (no GPU here to make one).
    shutil.copy(committed / "backend-cuda.json", folder)
    text = report.render(folder, folder / "RESULTS.md", WORKLOADS)
    for script, (title, _) in [*report.SCRIPTS.items(), ("backend-cuda", report.GPU_FILES["backend-cuda"])]:
        assert f"## {title}" in text and f"`{script}.json`" in text, script
    assert "both on one NVIDIA H200; Pie's attention flashinfer with CUDA graphs for decode; random weights" in text
    assert f"Host calls per generated token: {data['overhead']['calls_per_token']['calls_per_token']:.2f}" in text
    for row in data["overhead"]["per_token"]:
        assert f"| {row['batch']} | " in text and f"{100 * row['overhead']:+.0f} % | {row['mean_forward_batch']:.2f} |" in text
    cpu = data["overhead"]["control_cpu"]
    assert f"| control process | {report_f(cpu['control_ms_per_token'])} | ≤ 0.3 " in text
    assert f"| backend | {report_f(cpu['backend_ms_per_token'])} |" in text
    assert f"{data['backend']['prefill']['pie_over_hf']:.2f}×" in text
    assert f"{data['soak']['lost_messages']} lost messages" in text
    assert f"requests that did not finish: {data['api_serve']['not_finished']} " in text
    # Plots are linked from where RESULTS.md is: here beside them (benchmarks/RESULTS.md: results/).
    assert "![api_serve](./api_serve.png)" in text and "](results/" not in text
    for path, ratio in data["frontends"]["ratio_vs_native"].items():
        assert f"| {path} | " in text and f"{ratio:.3f}×" in text


def test_ratio_cells_show_the_rounds_pairs_range():
    """A ratio cell adds the least and greatest ratio of one round's pair where both rows
    kept their rounds, in Pie's favour (lower-is-better metrics inverted); none otherwise."""
    from benchmarks import report
    from benchmarks.workloads import Metric, Result, Row

    ttft = Metric("ttft_mean_ms", "ms", False)
    rows = [Row("concurrency 8", "pie", {"ttft_mean_ms": 120.0}, {"ttft_mean_ms_rounds": [100.0, 120.0, 300.0]}),
            Row("concurrency 8", "vllm", {"ttft_mean_ms": 110.0}, {"ttft_mean_ms_rounds": [90.0, 110.0, 150.0]}),
            Row("concurrency 32", "pie", {"ttft_mean_ms": 600.0}),
            Row("concurrency 32", "vllm", {"ttft_mean_ms": 660.0})]
    lines = report.table(Result("serving", "t", [ttft], rows), ttft)
    assert lines[2] == "| concurrency 8 | 120 | 110 | 0.92× (0.50–0.92) |"
    assert lines[3] == "| concurrency 32 | 600 | 660 | 1.10× |"
