"""What Pie's programmability costs (paper §7.4), measured on the real layers in one run.

- API call latency (Fig. 10): mean round trip of control-layer calls (answered in the
  control process) vs inference-layer calls (batched to the backend), timed inside an
  inferlet (`probe calls N`).
- API calls per generated token (Fig. 11): host calls `text_completion` makes per token.
- Launch latency (Fig. 9): launch → first message of `hello`, cold (component deserialized
  from the on-disk cache) and warm (in memory), 1-256 concurrent launches.
- Time per output token (Tables 3-4): `text_completion` inferlets vs the backend driven
  directly by a Python loop (pie.control.direct) at the same batch size and tokens.

The runtime and control layer run in this process against a real `pie backend` process
(the WebSocket server is left out: it adds one message per event, not per token).
Results: benchmarks/results/overhead.json.

    python benchmarks/overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from pie.backend.weights import resolve_model_dir
from pie.config import load_config
from pie.control.backend_link import BackendProcess
from pie.control.chat_template import chat_prompt
from pie.control.direct import DirectDriver
from pie.control.tokenizer import TextTokenizer
from pie.runtime.runtime import Runtime, start_runtime
from pie.toolchain import build_inferlet

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = ["Write a short story about a robot learning to paint.",
           "Explain how a rainbow forms, step by step.",
           "List ten fruits and describe each in one sentence.",
           "Describe the water cycle to a ten-year-old."]


def run_to_end(runtime: Runtime, program: str, args: list[str], timeout: float = 300) -> list[str]:
    """Launch, wait for termination, return the messages (raises if it did not finish)."""
    done, messages, reason = threading.Event(), [], []

    def on_event(_: str, kind: str, data: str, usage: dict | None = None) -> None:
        (messages if kind == "message" else reason).append(data)
        if kind == "terminated":
            done.set()

    runtime.launch(program, args, on_event)
    if not done.wait(timeout) or reason != ["finished"]:
        raise RuntimeError(f"{program} {args}: {reason or 'timed out'}")
    return messages


def api_latency(runtime: Runtime, n: int) -> dict[str, float]:
    return json.loads(run_to_end(runtime, "probe", ["calls", str(n)])[0])


def calls_per_token(runtime: Runtime, tokens: int) -> dict[str, float]:
    before = dict(runtime.stats()["host_calls"].get("text_completion", {}))
    run_to_end(runtime, "text_completion", ["--prompt", PROMPTS[0], "--max-tokens", str(tokens)])
    after = runtime.stats()["host_calls"]["text_completion"]
    delta = {name: after[name] - before.get(name, 0) for name in after}
    generated = delta.get("sample", 1)
    return {"tokens": generated, "calls": sum(delta.values()),
            "calls_per_token": sum(delta.values()) / generated,
            "by_function_per_token": {k: round(v / generated, 2) for k, v in sorted(delta.items())}}


def launch_latency(runtime: Runtime, concurrency: int, cold: bool) -> list[float]:
    digest = runtime.programs.builtins["hello"]
    if cold:  # forget the in-memory component: the launch deserializes the cached artifact
        with runtime.programs.lock:
            runtime.programs.loaded.pop(digest, None)
    latencies: list[float] = []
    lock, done = threading.Lock(), threading.Semaphore(0)
    started: dict[str, float] = {}

    def on_event(instance_id: str, kind: str, _: str, usage: dict | None = None) -> None:
        if kind == "message":
            with lock:
                latencies.append(time.perf_counter() - started[instance_id])
            runtime.send(instance_id, "quit")
        elif kind == "terminated":
            done.release()

    for _ in range(concurrency):
        t0 = time.perf_counter()
        with lock:
            info = runtime.launch("hello", ["hi"], on_event)
            started[info.id] = t0
    for _ in range(concurrency):
        done.acquire(timeout=120)
    return latencies


def per_token(runtime: Runtime, driver: DirectDriver, tokenizer: TextTokenizer, template: str,
              batch: int, tokens: int, rounds: int) -> dict[str, float]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    ids = [tokenizer.encode(chat_prompt(template, p)) for p in prompts]
    pie_s, direct_s = [], []
    for _ in range(rounds):
        done = threading.Semaphore(0)
        t0 = time.perf_counter()
        for p in prompts:
            runtime.launch("text_completion", ["--prompt", p, "--max-tokens", str(tokens)],
                           lambda _i, kind, _d: kind == "terminated" and done.release())
        for _ in prompts:
            done.acquire(timeout=600)
        pie_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        driver.generate(ids, tokens, stop_token_ids=tuple(tokenizer.eos_token_ids))
        direct_s.append(time.perf_counter() - t0)
    pie_ms = 1e3 * statistics.median(pie_s) / tokens
    direct_ms = 1e3 * statistics.median(direct_s) / tokens
    return {"batch": batch, "tokens": tokens, "pie_ms_per_token": pie_ms,
            "direct_ms_per_token": direct_ms, "overhead": pie_ms / direct_ms - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = parser.parse_args()

    config = load_config()
    config.runtime.max_instances = 512
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    builtins = {name: build_inferlet(ROOT / "inferlets" / name)
                for name in ("hello", "text_completion", "probe")}
    backend = BackendProcess(model_dir)
    try:
        link, hs = backend.connect()
        runtime = start_runtime(config, backend.endpoint, hs, builtins)
        driver = DirectDriver(link, hs)
        tokenizer = TextTokenizer(hs)
        results: dict = {}

        results["api_latency_us"] = api_latency(runtime, 20 if args.quick else 200)
        print("API call latency (µs):", results["api_latency_us"], flush=True)
        results["calls_per_token"] = calls_per_token(runtime, 8 if args.quick else 32)
        print("host calls per token:", results["calls_per_token"], flush=True)

        launches = []
        for concurrency in ([1, 8] if args.quick else [1, 4, 16, 64, 256]):
            for cold in (True, False):
                lat = launch_latency(runtime, concurrency, cold)
                row = {"concurrency": concurrency, "cold": cold,
                       "median_ms": 1e3 * statistics.median(lat),
                       "p99_ms": 1e3 * sorted(lat)[max(0, int(len(lat) * 0.99) - 1)]}
                launches.append(row)
                print(f"launch {'cold' if cold else 'warm'} x{concurrency}: "
                      f"median {row['median_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms", flush=True)
        results["launch"] = launches

        results["per_token"] = []
        for batch in ([1] if args.quick else [1, 8]):
            row = per_token(runtime, driver, tokenizer, hs.chat_template, batch,
                            8 if args.quick else 32, 1 if args.quick else 3)
            results["per_token"].append(row)
            print(f"per token, batch {batch}: pie {row['pie_ms_per_token']:.1f} ms, direct "
                  f"{row['direct_ms_per_token']:.1f} ms, overhead {100 * row['overhead']:+.1f}%",
                  flush=True)
        results["scheduler"] = runtime.stats()["scheduler"]
        runtime.shutdown()
        link.close()
    finally:
        backend.stop()
    results["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "model": model_dir.name, "dtype": config.backend.dtype,
                       "quick": args.quick}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
