"""What Pie's programmability costs (paper §7.4), measured on the real layers in one run.

- API call latency (Fig. 10): mean round trip of control-layer calls (answered in the
  control process) vs inference-layer calls (batched to the backend), timed inside an
  inferlet (`probe calls N`); the median over rounds.
- API calls per generated token (Fig. 11): host calls `text_completion` makes per token,
  by WIT function name (the runtime counts each host function under its WIT name); the
  tokens are the instance's `sampled_tokens` (a host-side run makes no `sample` call).
- Launch latency (Fig. 9): launch → first message of `hello`, cold (the in-memory component
  forgotten, so the wave's first launch deserializes the on-disk artifact) and warm (in
  memory), 1-256 concurrent launches; cold and warm alternate round by round.
- Time per output token (Tables 3-4): `text_completion` inferlets vs the backend driven
  directly by a Python loop (pie.control.direct) at the same batch size and tokens; the two
  alternate (Pie first in even rounds, the direct driver first in odd ones), each warmed up
  once before the timed rounds; tokens are counted (the instances' `sampled_tokens`, the
  tokens the driver returned), not assumed; batch 1, 8 and 32; with the mean number of
  items per model-running backend batch (scheduler kinds `forward` and `pass`) in Pie's
  timed rounds, from the scheduler's counters. The automatic prefix cache is off for the
  whole run: the direct driver has none, and the waves repeat their prompts.
- Control-process CPU per generated token (issue 15; target 0.3 ms): 16 `text_completion`s
  decoding 64 tokens each at once, one untimed warm-up wave, then per wave the CPU time
  (user + system) of this process (time.process_time()), of its scheduler thread and of the backend
  process (/proc/<id>/stat utime + stime), read around the wave, over the tokens the
  instances report; the median over rounds. The same again with streaming: 16
  `openai_completion`s (`--ignore-eos`, not `--whole`) waking per token to detokenize and
  send the new text, as the OpenAI endpoints' streamed requests and Table 5 do.

The runtime and control layer run in this process against a real `pie backend` process
(the WebSocket server is left out: it adds one message per event, not per token).
Results: benchmarks/results/overhead.json (`--out` elsewhere), with the settings: rounds,
the order of each round, dtype, CPU model and flags, torch version.

    python benchmarks/overhead.py [--rounds 3] [--dtype auto] [--quick] [--out FILE]

`--quick` (a few tokens, batch 1 and 2, 1 and 4 launches, 4 x 8 tokens for the CPU
figure, 2 rounds) is the smoke run tests/test_bench_scripts.py makes; it writes every
field the full run does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, rotated, write_results
from pie.backend.dtype import resolve_dtype
from pie.backend.weights import resolve_model_dir
from pie.config import load_config
from pie.control.backend_link import BackendProcess
from pie.control.chat_template import chat_prompt
from pie.control.direct import DirectDriver
from pie.control.tokenizer import TextTokenizer
from pie.runtime.runtime import Runtime, start_runtime
from pie.toolchain import build_inferlet

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = ["Write a short story about a robot learning to paint.",
           "Explain how a rainbow forms, step by step.",
           "List ten fruits and describe each in one sentence.",
           "Describe the water cycle to a ten-year-old."]
TIMEOUT_S = 300.0  # for one inferlet or one wave: a run that takes longer fails loudly
ROUNDS, QUICK_ROUNDS = 3, 2  # rounds per measurement: full run, --quick
MODEL_KINDS = ("forward", "pass")  # scheduler call kinds that run the model
CONTROL_CPU_TARGET_MS = 0.3  # issue 15: control-process CPU per generated token


def run_to_end(runtime: Runtime, program: str, args: list[str], timeout: float = TIMEOUT_S,
               usage: dict | None = None) -> list[str]:
    """Launch, wait for termination, return the messages (raises if it did not finish);
    the instance's usage goes into `usage` if given."""
    done, messages, reason = threading.Event(), [], []

    def on_event(_: str, kind: str, data: str, used: dict | None) -> None:  # runtime.EventSink
        (messages if kind == "message" else reason).append(data)
        if kind == "terminated":
            if usage is not None:
                usage.update(used or {})
            done.set()

    runtime.launch(program, args, on_event)
    if not done.wait(timeout) or reason != ["finished"]:
        raise RuntimeError(f"{program} {args}: {reason or 'timed out'}")
    return messages


def run_wave(runtime: Runtime, prompts: list[str], tokens: int, program: str = "text_completion",
             extra: tuple[str, ...] = ()) -> int:
    """`program` (text_completion or openai_completion) on every prompt at once, to the end;
    the tokens they generated (from each instance's usage: tokens drawn on the host,
    whatever calls drew them)."""
    done, reasons, generated = threading.Semaphore(0), [], []

    def on_event(_: str, kind: str, data: str, usage: dict | None) -> None:  # runtime.EventSink
        if kind == "terminated":
            reasons.append(data)
            generated.append((usage or {}).get("sampled_tokens", 0))
            done.release()

    for p in prompts:
        runtime.launch(program, ["--prompt", p, "--max-tokens", str(tokens), *extra], on_event)
    for _ in prompts:
        if not done.acquire(timeout=TIMEOUT_S):
            raise RuntimeError(f"{program} x{len(prompts)}: not all ended in {TIMEOUT_S:.0f} s")
    if reasons != ["finished"] * len(prompts):
        raise RuntimeError(f"{program} x{len(prompts)}: {reasons}")
    return sum(generated)


def model_batches(stats: dict) -> tuple[int, int]:
    """(calls, batches) that ran the model — legacy forwards and fused passes — so far."""
    return (sum(stats["calls"].get(k, 0) for k in MODEL_KINDS),
            sum(stats["batches"].get(k, 0) for k in MODEL_KINDS))


def host_calls(runtime: Runtime, program: str) -> dict[str, int]:
    """Host calls of every ended instance of `program`, by WIT function name."""
    return dict(runtime.stats()["host_calls"].get(program, {}))


def api_latency(runtime: Runtime, n: int, rounds: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median over `rounds` runs of `probe calls n` (after one untimed warm-up run), and
    every round's figures."""
    run_to_end(runtime, "probe", ["calls", str(max(1, n // 10))])  # warm-up
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, us in json.loads(run_to_end(runtime, "probe", ["calls", str(n)])[0]).items():
            samples.setdefault(name, []).append(us)
    return {name: round(statistics.median(v), 2) for name, v in samples.items()}, samples


def calls_per_token(runtime: Runtime, tokens: int) -> dict:
    """Every host call of one `text_completion` (per-request ones included) over the
    tokens it generated (its usage's `sampled_tokens`)."""
    before = host_calls(runtime, "text_completion")
    usage: dict = {}
    run_to_end(runtime, "text_completion", ["--prompt", PROMPTS[0], "--max-tokens", str(tokens)],
               usage=usage)
    after = host_calls(runtime, "text_completion")
    delta = {name: after[name] - before.get(name, 0) for name in after if after[name] > before.get(name, 0)}
    generated = usage.get("sampled_tokens", 0)
    if not generated:
        raise RuntimeError(f"text_completion generated nothing: usage {usage}, calls {delta}")
    return {"tokens_asked": tokens, "tokens": generated, "calls": sum(delta.values()),
            "calls_per_token": sum(delta.values()) / generated,
            "by_function": dict(sorted(delta.items())),
            "by_function_per_token": {k: round(v / generated, 2) for k, v in sorted(delta.items())}}


def launch_latency(runtime: Runtime, concurrency: int, cold: bool) -> list[float]:
    """Launch → first message of `concurrency` concurrent `hello`s, in seconds."""
    digest = runtime.programs.builtins["hello"]
    if cold:  # forget the in-memory component: the launch deserializes the cached artifact
        with runtime.programs.lock:
            runtime.programs.loaded.pop(digest, None)
    latencies: list[float] = []
    reasons: list[str] = []
    lock, done = threading.Lock(), threading.Semaphore(0)
    started: dict[str, float] = {}

    def on_event(instance_id: str, kind: str, data: str, usage: dict | None) -> None:  # runtime.EventSink
        if kind == "message":
            with lock:
                latencies.append(time.perf_counter() - started[instance_id])
            runtime.send(instance_id, "quit")
        elif kind == "terminated":
            reasons.append(data)
            done.release()

    for _ in range(concurrency):
        t0 = time.perf_counter()
        with lock:
            info = runtime.launch("hello", ["hi"], on_event)
            started[info.id] = t0
    for _ in range(concurrency):
        if not done.acquire(timeout=TIMEOUT_S):
            raise RuntimeError(f"{concurrency} launches of hello: not all ended in {TIMEOUT_S:.0f} s")
    if len(latencies) != concurrency or set(reasons) != {"finished"}:
        raise RuntimeError(f"{concurrency} launches of hello: {len(latencies)} first messages, ends {reasons}")
    return latencies


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    return sorted(values)[max(0, math.ceil(0.99 * len(values)) - 1)]


def launches(runtime: Runtime, levels: list[int], rounds: int) -> list[dict]:
    rows = []
    for concurrency in levels:
        launch_latency(runtime, concurrency, cold=False)  # warm-up: threads, pools at this level
        samples: dict[bool, list[list[float]]] = {True: [], False: []}
        for r in range(rounds):
            for cold in rotated([True, False], r):
                samples[cold].append(launch_latency(runtime, concurrency, cold))
        for cold in (True, False):
            every = [x for one in samples[cold] for x in one]
            row = {"concurrency": concurrency, "cold": cold, "launches": len(every),
                   "median_ms": 1e3 * statistics.median(every), "p99_ms": 1e3 * p99(every),
                   "round_medians_ms": [round(1e3 * statistics.median(one), 3) for one in samples[cold]]}
            rows.append(row)
            print(f"launch {'cold' if cold else 'warm'} x{concurrency}: "
                  f"median {row['median_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms", flush=True)
    return rows


def per_token(runtime: Runtime, driver: DirectDriver, tokenizer: TextTokenizer, template: str,
              batch: int, tokens: int, rounds: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    ids = [tokenizer.encode(chat_prompt(template, p)) for p in prompts]
    eos = tuple(tokenizer.eos_token_ids)

    batches: list[tuple[int, int]] = []  # per Pie round: (model-running calls, batches)

    def pie() -> tuple[float, int]:
        """`batch` text_completion inferlets at once: seconds, and tokens generated."""
        calls0, batches0 = model_batches(runtime.stats()["scheduler"])
        t0 = time.perf_counter()
        generated = run_wave(runtime, prompts, tokens)
        elapsed = time.perf_counter() - t0
        calls1, batches1 = model_batches(runtime.stats()["scheduler"])
        batches.append((calls1 - calls0, batches1 - batches0))
        return elapsed, generated

    def direct() -> tuple[float, int]:
        t0 = time.perf_counter()
        outputs = driver.generate(ids, tokens, stop_token_ids=eos)
        return time.perf_counter() - t0, sum(map(len, outputs))

    paths = {"pie": pie, "direct": direct}
    for run in paths.values():  # warm-up: first forwards at this batch size, caches, threads
        run()
    batches.clear()
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    generated: dict[str, list[int]] = {name: [] for name in paths}
    for r in range(rounds):
        for name in rotated(list(paths), r):
            elapsed, count = paths[name]()
            seconds[name].append(elapsed)
            generated[name].append(count)
    # Per token of one sequence: the round's time over the steps it took (tokens / batch);
    # equal to time / `tokens` when no sequence stopped early at EOS.
    ms = {name: statistics.median(1e3 * s * batch / max(1, n) for s, n in zip(seconds[name], generated[name]))
          for name in paths}
    return {"batch": batch, "tokens": tokens, "pie_ms_per_token": ms["pie"],
            "direct_ms_per_token": ms["direct"], "overhead": ms["pie"] / ms["direct"] - 1,
            "pie_tokens": generated["pie"], "direct_tokens": generated["direct"],
            # items per model-running batch (kinds `forward` and `pass`, prefills included)
            # over Pie's timed rounds: = batch when every decoder rides every forward
            "mean_forward_batch": sum(c for c, _ in batches) / max(1, sum(b for _, b in batches)),
            "forward_calls": [c for c, _ in batches], "forward_batches": [b for _, b in batches],
            "pie_round_s": [round(s, 4) for s in seconds["pie"]],
            "direct_round_s": [round(s, 4) for s in seconds["direct"]]}


def cpu_s(pid: int | str, task: int | None = None) -> float:
    """utime + stime of a process (or one of its threads) from /proc, in seconds."""
    path = f"/proc/{pid}/task/{task}/stat" if task is not None else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """User + system CPU time of this process (every thread), in seconds. The process's
    CPU clock, not os.times(): that counts in 10 ms ticks, and a smoke run's 4 x 8 tokens
    at ~0.1 ms of control CPU a token read as 0 (seen in the test suite, 2026-12-04)."""
    return time.process_time()


CPU_PARTS = ("control", "scheduler", "backend")


STREAMED = ("openai_completion", ("--ignore-eos",))  # a text delta sent per token


def control_cpu(runtime: Runtime, backend_pid: int, instances: int, tokens: int, rounds: int,
                program: str = "text_completion", extra: tuple[str, ...] = ()) -> dict:
    """CPU time per generated token while `instances` of `program` decode `tokens` each at
    once: this process (the control process: runtime, control layer, inferlets;
    own_cpu_s), its scheduler thread alone and the backend process (/proc utime + stime),
    read around each wave, after one untimed warm-up wave; the median over rounds."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(instances)]
    scheduler = runtime.controller.replicas[0].scheduler.channel.thread.native_id

    def read() -> tuple[float, float, float]:
        return own_cpu_s(), cpu_s(os.getpid(), scheduler), cpu_s(backend_pid)

    run_wave(runtime, prompts, tokens, program, extra)  # warm-up
    per_round = []
    for _ in range(rounds):
        before = read()
        generated = run_wave(runtime, prompts, tokens, program, extra)
        after = read()
        if not generated:
            raise RuntimeError(f"{program} x{instances}: no tokens generated")
        spent = {f"{part}_cpu_s": round(a - b, 4) for part, a, b in zip(CPU_PARTS, after, before)}
        per_round.append({"tokens": generated, **spent, **{
            f"{part}_ms_per_token": 1e3 * spent[f"{part}_cpu_s"] / generated for part in CPU_PARTS}})
    out = {"program": program, "instances": instances, "tokens_each": tokens, "tokens_asked": instances * tokens,
           "clock_ticks_per_s": os.sysconf("SC_CLK_TCK"), "rounds": per_round,
           "target_control_ms_per_token": CONTROL_CPU_TARGET_MS}
    for part in CPU_PARTS:
        out[f"{part}_ms_per_token"] = statistics.median(r[f"{part}_ms_per_token"] for r in per_round)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 2 rounds, for a smoke run")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds per measurement (default {ROUNDS}; quick {QUICK_ROUNDS})")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="default auto: Pie's choice for this CPU (pie/backend/dtype.py)")
    parser.add_argument("--out", default=str(RESULTS / "overhead.json"), help="where the JSON goes")
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype, "cpu")  # one concrete dtype for every side
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)

    config = load_config()
    config.runtime.max_instances = 512
    # The automatic prefix cache off: the waves repeat the same four prompts, so with it on
    # Pie's prefills hit the pages of earlier rounds while the direct driver recomputes every
    # prompt, and "Pie against its backend driven directly" measured caching, not overhead
    # (-9 % / -30 % at batch 8 / 32 on a Zen 4 with it on, 2026-12-01).
    config.control.prefix_cache = False
    config.backend.dtype = args.dtype
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    builtins = {name: build_inferlet(ROOT / "inferlets" / name)
                for name in ("hello", "text_completion", "openai_completion", "probe")}
    backend = BackendProcess(model_dir, extra_args=["--dtype", args.dtype])
    try:
        link, hs = backend.connect()
        runtime = start_runtime(config, [backend.endpoint], hs, builtins)
        driver = DirectDriver(link, hs)
        tokenizer = TextTokenizer(hs)
        results: dict = {}

        results["api_latency_us"], results["api_latency_rounds_us"] = api_latency(
            runtime, 10 if args.quick else 200, rounds)
        print("API call latency (µs):", results["api_latency_us"], flush=True)
        results["calls_per_token"] = calls_per_token(runtime, 4 if args.quick else 32)
        print("host calls per token:", results["calls_per_token"], flush=True)

        results["launch"] = launches(runtime, [1, 4] if args.quick else [1, 4, 16, 64, 256], rounds)

        for key, (program, extra) in (("control_cpu", ("text_completion", ())), ("control_cpu_streamed", STREAMED)):
            cpu = results[key] = control_cpu(runtime, backend.process.pid, 4 if args.quick else 16,
                                             8 if args.quick else 64, rounds, program, extra)
            print(f"CPU per generated token, {cpu['instances']} {program} x {cpu['tokens_each']} tokens at "
                  f"once: control process {cpu['control_ms_per_token']:.3f} ms (target "
                  f"{CONTROL_CPU_TARGET_MS} ms), its scheduler thread {cpu['scheduler_ms_per_token']:.3f} ms, "
                  f"backend {cpu['backend_ms_per_token']:.3f} ms", flush=True)

        results["per_token"] = []
        for batch in ([1, 2] if args.quick else [1, 8, 32]):
            row = per_token(runtime, driver, tokenizer, hs.chat_template, batch,
                            4 if args.quick else 32, rounds)
            results["per_token"].append(row)
            print(f"per token, batch {batch}: pie {row['pie_ms_per_token']:.1f} ms, direct "
                  f"{row['direct_ms_per_token']:.1f} ms, overhead {100 * row['overhead']:+.1f}%, "
                  f"mean forward batch {row['mean_forward_batch']:.1f}", flush=True)
        stats = runtime.stats()
        results["scheduler"] = stats["scheduler"]
        results["prefix_cache"] = stats["resources"]["prefix_cache"]  # the cache's counters; None: off
        runtime.shutdown()
        link.close()
    finally:
        backend.stop()
    results["meta"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(), "quick": args.quick, "rounds": rounds,
        # The same rotation for every level of a measurement (the API latency has one path).
        "order": {"api_latency": [["probe"] for _ in range(rounds)],
                  "launch": [["cold" if cold else "warm" for cold in rotated([True, False], r)]
                             for r in range(rounds)],
                  "per_token": [rotated(["pie", "direct"], r) for r in range(rounds)]},
        "warmup": "one untimed run of every path (and launch level) before its timed rounds",
        "prefix_cache": "off (the direct driver has none; the waves repeat their prompts)",
        "model": model_dir.name, "dtype": hs.dtype, **machine_settings()}
    write_results(args.out, results)


if __name__ == "__main__":
    main()
