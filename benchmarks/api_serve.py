"""APIServe's experiment on Pie (issue 17): requests that pause for external calls, a KV pool
that holds only 3-4 of their contexts, and what `control.kv_pressure` does with the paused
ones — discard (the SDK's context computes its tokens again), preserve (keep them; newcomers
wait), swap (to host memory and back) or min-waste (APIServe's per-request choice).

Each request is one `api_agent` inferlet: a synthetic context of 700-2,200 tokens, then 16
greedy tokens, then its API calls, each followed by the answer and 16 more tokens. The six
API types of the seed notes, with their durations; those over a second are scaled down
2.8x and the environment's 28 calls to 6 (so one run takes minutes, not an hour; the order
of magnitude between types is kept; `--quick` divides every duration by 10 more):

| type | calls | each |
|---|---|---|
| math (calculator) | 1 | 0.1 ms |
| qa | 1 | 700 ms |
| ve (virtual environment) | 6 (28) | 100 ms |
| chat (a human) | 1 | 10 s (28 s) |
| image | 1 | 7 s (20 s) |
| tts | 1 | 7 s (20 s) |

The long calls are scaled by 1/2.8, to the tool server's 10 s cap on `slow`, not further:
scaled by 1/10 (2.8 s, 2 s) a paused context held its pages too briefly for memory to
bind before compute did, and every policy but discard sustained the same rate.

Requests arrive as a Poisson process at each `--rates` value (the same seeded sequence of
requests for every policy). Per policy and rate: normalized latency (a request's time from
arrival to end over the tokens it generated; mean and p90), completed requests per second
(requests over the time from the first arrival to the last end), the share of forwarded
tokens that were recomputation (forwarded beyond the context's own length), pages moved,
and instances that did not finish (must be 0). The sustained rate of a policy is the
highest rate whose mean normalized latency stays under `--slo` times the lowest one any
policy reached at the lowest rate (interpolated between measured rates).

A swap here is a copy within RAM; on a GPU it crosses PCIe, where a page costs far more
relative to recomputing it. `--swap-gbps` emulates such a link (`backend.swap_gbps`: a
swap's reply is held until the link would have carried it, other batches running
meanwhile); the paper's ratio (GPT-J-6B KV, 458 KB a token, over PCIe 4 at
~25 GB/s: ~18 us a token one way, against ~120 us to recompute it on an A100: 0.15) is
reached here at ~0.15 GB/s (370 KB pages, ~1 ms a token to prefill). The default run
measures both.

    python benchmarks/api_serve.py [--policies discard,preserve,swap,min-waste] [--rates 0.1,0.2,0.3,0.45,0.6]
        [--requests 16] [--pages 352] [--swap-gbps 0,0.15] [--keep-from FILE] [--quick] [--out FILE]

Results: benchmarks/results/api_serve.json and api_serve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.policy_runs import serving, sustained
from benchmarks.run_info import command_line, machine_settings, write_results
from pie.backend.dtype import resolve_dtype
from pie.backend.weights import DEFAULT_MODEL_NAME
from pie.client import PieClient
from pie.toolchain import build_inferlet

RESULTS = Path(__file__).parent / "results"
API_TYPES = {"math": (1, 0.1), "qa": (1, 700.0), "ve": (6, 100.0), "chat": (1, 10000.0),
             "image": (1, 7000.0), "tts": (1, 7000.0)}  # calls, milliseconds each
GEN = 16  # tokens decoded after the context and after each call
POLICIES = ("discard", "preserve", "swap", "min-waste")


def requests(n: int, rate: float, seed: int, quick: bool) -> list[dict]:
    """The same seeded requests at every policy: arrival time, context length, API calls."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        kind = rng.choice(sorted(API_TYPES))
        calls, ms = API_TYPES[kind]
        context = rng.randint(120, 300) if quick else rng.randint(700, 2200)
        out.append({"id": i, "at": at, "type": kind, "context": context, "calls": [ms / 10 if quick else ms] * calls})
    return out


async def one(client: PieClient, program: str, tools: str, request: dict, start: float) -> dict:
    await asyncio.sleep(max(0.0, start + request["at"] - time.monotonic()))
    arrived = time.monotonic()
    instance = await client.launch(program, [
        "--tools-url", tools, "--context", str(request["context"]), "--gen", str(GEN),
        "--seed", str(1000 + request["id"]), "--calls", ",".join(f"{ms:g}" for ms in request["calls"])])
    messages = [m async for m in instance]
    reason = await instance.wait()
    ended = time.monotonic()
    generated = GEN * (1 + len(request["calls"]))
    report = json.loads(messages[-1]) if reason == "finished" and messages else {}
    # Every token of the final context but the last (still pending) is forwarded once;
    # what was forwarded beyond that was recomputation of dropped pages.
    needed = max(0, report.get("tokens", 0) - 1)
    return {**request, "reason": reason, "arrived": arrived - start, "latency_s": ended - arrived,
            "normalized_s": (ended - arrived) / generated, "needed_tokens": needed,
            "forward_tokens": instance.usage.get("forward_tokens", 0), "ended": ended - start}


async def run_policy(policy: str, rates: list[float], args: argparse.Namespace, program_path: Path,
                     tools: str, dtype: str, gbps: float, tmp: Path) -> list[dict]:
    toml = (f"[backend]\nnum_kv_pages = {args.pages}\nnum_host_kv_pages = 4096\nswap_gbps = {gbps}\n"
            f"[control]\nkv_pressure = \"{policy}\"\nalloc_wait_ms = 120000.0\n")
    rows = []
    async with serving(tmp, f"{policy}-{gbps:g}", toml, dtype, program_path) as (client, program, resources):
        for rate in rates:
            batch = requests(args.requests, rate, args.seed, args.quick)
            before = (await resources())["reclaim"]
            start = time.monotonic()
            done = await asyncio.gather(*(one(client, program, tools, r, start) for r in batch))
            rows.append(summarize(policy, rate, gbps, done, before, (await resources())["reclaim"]))
            row = rows[-1]
            print(f"{policy:9} {gbps:g} GB/s, {rate:.2f} req/s: normalized {row['normalized_mean_s']:.3f} s/token "
                  f"(p90 {row['normalized_p90_s']:.3f}), {row['completed_per_s']:.3f} req/s done, "
                  f"recompute {row['recompute_share']:.0%}, not finished {row['not_finished']}", flush=True)
    return rows


def summarize(policy: str, rate: float, gbps: float, done: list[dict], before: dict, after: dict) -> dict:
    finished = [r for r in done if r["reason"] == "finished"]
    normalized = sorted(r["normalized_s"] for r in finished) or [float("nan")]
    span = max(r["ended"] for r in done) - min(r["arrived"] for r in done)
    needed = sum(r["needed_tokens"] for r in finished)
    forwarded = sum(r["forward_tokens"] for r in finished)
    moved = {k: after[k] - before[k] for k in ("swapped_out", "swapped_in", "discarded")}
    return {"policy": policy, "rate": rate, "swap_gbps": gbps, "requests": len(done),
            "normalized_mean_s": statistics.fmean(normalized),
            "normalized_p90_s": normalized[min(len(normalized) - 1, int(0.9 * len(normalized)))],
            "latency_mean_s": statistics.fmean(r["latency_s"] for r in finished) if finished else float("nan"),
            "completed_per_s": len(finished) / span, "forward_tokens": forwarded,
            "recompute_share": max(0.0, forwarded - needed) / max(1, forwarded),
            "not_finished": len(done) - len(finished),
            "reasons": sorted({r["reason"] for r in done if r["reason"] != "finished"}), **moved,
            "per_request": [{k: r[k] for k in ("id", "type", "context", "arrived", "latency_s",
                                                "normalized_s", "forward_tokens", "reason")} for r in done]}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["swap_gbps"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.5), squeeze=False)
    for ax, gbps in zip(axes[0], links):
        for policy in data["policies"]:
            rows = sorted((r for r in data["rows"] if r["policy"] == policy and r["swap_gbps"] == gbps),
                          key=lambda r: r["rate"])
            style = {}
            if not rows:  # discard and preserve move nothing over the link: their RAM-speed run
                rows = sorted((r for r in data["rows"] if r["policy"] == policy and r["swap_gbps"] == 0),
                              key=lambda r: r["rate"])
                style = {"linestyle": "--", "alpha": 0.6}
            if rows:
                ax.plot([r["rate"] for r in rows], [r["normalized_mean_s"] for r in rows], marker="o",
                        label=policy, color=f"C{data['policies'].index(policy)}", **style)
        ax.axhline(data["slo_s"], color="grey", linestyle=":", label="SLO")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("mean normalized latency (s/token)")
        ax.set_title("swap at RAM speed" if not gbps else f"swap limited to {gbps:g} GB/s")
        ax.legend()
    fig.suptitle(f"api_serve: {data['requests']} requests per rate, KV pool {data['pages']} pages")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run(args: argparse.Namespace) -> dict:
    dtype = resolve_dtype(args.dtype, "cpu")
    policies = args.policies.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    links = [float(g) for g in args.swap_gbps.split(",")]
    program_path = build_inferlet(ROOT / "inferlets" / "api_agent")
    from benchmarks.__main__ import ToolServer

    tools = ToolServer()
    tmp = Path(tempfile.mkdtemp(prefix="pie-api-serve-"))
    rows: list[dict] = []
    try:
        for gbps in links:
            for policy in policies:
                if gbps and policy in ("discard", "preserve"):
                    continue  # nothing is swapped: the link does not matter
                rows += await run_policy(policy, rates, args, program_path, tools.url, dtype, gbps, tmp)
    finally:
        tools.stop()
    kept = {}
    if args.keep_from:  # the other policies' rows of an earlier run with the same requests
        earlier = json.loads(Path(args.keep_from).read_text())
        same = ("rates", "requests", "pages")
        if any(earlier[k] != v for k, v in zip(same, (rates, args.requests, args.pages))) \
                or earlier["meta"]["seed"] != args.seed:
            raise SystemExit(f"{args.keep_from} was run with other {', '.join(same)} or seed")
        ran = {(r["policy"], r["swap_gbps"]) for r in rows}
        old = [r for r in earlier["rows"] if (r["policy"], r["swap_gbps"]) not in ran]
        rows = sorted(rows + old, key=lambda r: (r["swap_gbps"], POLICIES.index(r["policy"]), r["rate"]))
        policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
        links = sorted({r["swap_gbps"] for r in rows})
        kept = {"kept_from": {"date": earlier["meta"]["date"], "rows": sorted({f"{p}@{g:g}" for p, g in
                                                                               {(r["policy"], r["swap_gbps"]) for r in old}})}}
    lowest = min(rates)
    slo = args.slo * min(r["normalized_mean_s"] for r in rows if r["rate"] == lowest)
    sustained_rates = {f"{p}@{g:g}": sustained([(r["rate"], r["normalized_mean_s"]) for r in rows
                                                if r["policy"] == p and r["swap_gbps"] == g], slo)
                       for g in links for p in policies
                       if any(r["policy"] == p and r["swap_gbps"] == g for r in rows)}
    for key, value in sustained_rates.items():
        print(f"sustained at {slo:.3f} s/token: {key} {value:.3f} req/s")

    def ratio(a: str, b: str) -> float | None:
        return sustained_rates[a] / sustained_rates[b] if sustained_rates.get(a) and sustained_rates.get(b) else None

    return {
        "policies": policies, "rates": rates, "requests": args.requests, "pages": args.pages, "gen": GEN,
        "api_types": {k: {"calls": c, "ms": ms} for k, (c, ms) in API_TYPES.items()},
        "slo_s": slo, "slo_factor": args.slo, "sustained": sustained_rates,
        "min_waste_over_discard": ratio("min-waste@0", "discard@0"),
        "min_waste_over_preserve": ratio("min-waste@0", "preserve@0"),
        "min_waste_over_discard_limited": ratio(f"min-waste@{max(links):g}", "discard@0") if max(links) else None,
        # Pie ends no instance under any policy; a request that did not finish ended on an
        # error of its own (preserve: an allocation that waited control.alloc_wait_ms in vain).
        "not_finished": sum(r["not_finished"] for r in rows), "rows": rows,
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                 "quick": args.quick, "rounds": 1, "order": [policies], "dtype": dtype, "model": DEFAULT_MODEL_NAME,
                 "seed": args.seed, **kept, **machine_settings(),
                 "method": "one pie serve per policy and swap link; the same seeded Poisson requests at "
                           "each rate; normalized latency = (end - arrival) / generated tokens"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--rates", default=None, help="arrival rates, requests/s (default 0.1,0.2,0.3,0.45,0.6; quick 0.5)")
    parser.add_argument("--requests", type=int, default=None, help="requests per rate (default 16; quick 4)")
    parser.add_argument("--pages", type=int, default=None, help="KV pool pages (default 352: 3-4 contexts; quick 48)")
    parser.add_argument("--swap-gbps", default=None, help="swap links, GB/s, 0 = RAM speed (default 0,0.15; quick 0)")
    parser.add_argument("--slo", type=float, default=2.0, help="SLO: this many times the lowest normalized latency")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="a smoke run (tiny contexts, 4 requests)")
    parser.add_argument("--out", default=str(RESULTS / "api_serve.json"), help="where the JSON goes")
    parser.add_argument("--keep-from", default=None, metavar="FILE",
                        help="take the rows of policies not run now from FILE (an earlier run, same requests)")
    args = parser.parse_args()
    args.rates = args.rates or ("0.5" if args.quick else "0.1,0.2,0.3,0.45,0.6")
    args.requests = args.requests or (4 if args.quick else 16)
    args.pages = args.pages or (48 if args.quick else 352)
    args.swap_gbps = args.swap_gbps or ("0" if args.quick else "0,0.15")
    data = asyncio.run(run(args))
    write_results(args.out, data)
    plot(data, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
