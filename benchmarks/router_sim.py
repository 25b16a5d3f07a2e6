"""Placement at scale, simulated (issue 22 item 3): the real `pie.control.placement.Placement`
over many replicas and launches, with each replica's prefix cache modelled as an LRU of
prompt blocks.

Why a simulation: this machine runs two replicas; what a router's policy does to
prefix-cache hits and load balance shows only with many replicas and many programs. The
placement code is the one `pie serve --replicas N` runs; only the replicas are modelled:
- launches: `--launches` inferlets arriving as a Poisson process, each living an
  exponential time (mean concurrency `--live`); each carries one of `--prompts` shared
  system prompts (Zipf popularity, s = 1.1; `--prompt-bytes` long) and a user turn of its own
  (`--turn-bytes`);
- a replica's cache: `--cache-blocks` 64-byte blocks, least recently used first and a
  prefix's tail before its head (as a radix cache evicts leaves), filled by every launch
  placed on the replica (a block is a hit when a later launch placed there starts with it).
Policies: `random`, `round-robin`, `least-loaded`, and `cache-aware` at several
`control.placement_imbalance` bounds. Reported per policy: the block hit rate (share of
launched prompt blocks found in the chosen replica's cache), load imbalance (the largest
replica's live instances over the mean, averaged over launches, and its 99th percentile),
and the placement decision's mean time.

    python benchmarks/router_sim.py [--replicas 64] [--launches 10000] [--live 2000] [--quick] [--out FILE]

Results: benchmarks/results/router_sim.json and router_sim.png.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, write_results
from pie.control.placement import Placement, PrefixMemory, blocks

RESULTS = ROOT / "benchmarks" / "results"
IMBALANCES = (4, 16, 64)


@dataclass
class SimReplica:
    index: int
    live: int = 0
    serving: bool = True


def workload(launches: int, prompts: int, prompt_bytes: int, turn_bytes: int, live: int,
             seed: int) -> list[tuple[float, float, list[str]]]:
    """(arrival, departure, arguments) of each launch: Poisson arrivals at rate 1, lifetimes
    with mean `live` (so `live` instances on average), Zipf-popular system prompts."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(prompts)]
    systems = [f"system prompt {k}: " + "".join(rng.choice("abcdefghij ") for _ in range(prompt_bytes))
               for k in range(prompts)]
    out, now = [], 0.0
    for i in range(launches):
        now += rng.expovariate(1.0)
        system = rng.choices(systems, weights)[0]
        turn = f"user {i}: " + "".join(rng.choice("klmnopqrst ") for _ in range(turn_bytes))
        out.append((now, now + rng.expovariate(1 / live), ["--message", "system", system, "--message", "user", turn]))
    return out


def simulate(policy: str, imbalance: int, launches: list, replicas: int, cache_blocks: int, seed: int) -> dict:
    rng = random.Random(seed)
    nodes = [SimReplica(i) for i in range(replicas)]
    caches = [PrefixMemory(cache_blocks) for _ in range(replicas)]  # a cache that evicts leaves first
    placement = Placement(policy if policy in ("cache-aware", "least-loaded") else "least-loaded", imbalance, replicas)
    departures: list[tuple[float, int]] = []
    hit = total = 0
    ratios: list[float] = []
    decide_s = 0.0
    for i, (arrive, leave, arguments) in enumerate(launches):
        while departures and departures[0][0] <= arrive:
            nodes[heapq.heappop(departures)[1]].live -= 1
        started = time.perf_counter()
        if policy == "random":
            chosen = rng.choice(nodes)
        elif policy == "round-robin":
            chosen = nodes[i % replicas]
        else:
            chosen = placement.choose(nodes, "chat", arguments)
        decide_s += time.perf_counter() - started
        keys = blocks("chat", arguments)
        hit += caches[chosen.index].matched(keys)
        total += len(keys)
        caches[chosen.index].remember(keys)
        chosen.live += 1
        heapq.heappush(departures, (leave, chosen.index))
        mean = sum(n.live for n in nodes) / replicas
        ratios.append(max(n.live for n in nodes) / mean)
    steady = ratios[len(ratios) // 10:]  # past the ramp-up
    return {"hit_rate": hit / total, "imbalance_mean": statistics.fmean(steady),
            "imbalance_p99": sorted(steady)[int(0.99 * (len(steady) - 1))],
            "decision_us": 1e6 * decide_s / len(launches)}


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, row in data["policies"].items():
        ax.scatter(row["imbalance_mean"], row["hit_rate"], s=40)
        ax.annotate(name, (row["imbalance_mean"], row["hit_rate"]), textcoords="offset points", xytext=(5, 3),
                    fontsize=8)
    ax.set_xlabel("load imbalance: largest replica's live instances / mean")
    ax.set_ylabel("prefix-cache block hit rate")
    ax.set_title(f"{data['replicas']} replicas, {data['launches']:,} launches, ~{data['live']} live")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--launches", type=int, default=10_000)
    parser.add_argument("--live", type=int, default=2_000, help="mean live instances (all replicas)")
    parser.add_argument("--prompts", type=int, default=256, help="distinct shared system prompts")
    parser.add_argument("--prompt-bytes", type=int, default=2048)
    parser.add_argument("--turn-bytes", type=int, default=512)
    parser.add_argument("--cache-blocks", type=int, default=1024, help="a replica's prefix cache, in 64-byte blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 replicas, 400 launches (the tests' smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "router_sim.json"))
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.launches, args.live, args.prompts = 8, 400, 80, 16
    launches = workload(args.launches, args.prompts, args.prompt_bytes, args.turn_bytes, args.live, args.seed)
    policies = {"random": ("random", 0), "round-robin": ("round-robin", 0), "least-loaded": ("least-loaded", 0),
                **{f"cache-aware/{k}": ("cache-aware", k) for k in IMBALANCES}}
    data = {"replicas": args.replicas, "launches": args.launches, "live": args.live, "prompts": args.prompts,
            "prompt_bytes": args.prompt_bytes, "turn_bytes": args.turn_bytes, "cache_blocks": args.cache_blocks,
            "policies": {}}
    for name, (policy, imbalance) in policies.items():
        data["policies"][name] = row = simulate(policy, imbalance, launches, args.replicas, args.cache_blocks, args.seed)
        print(f"{name:16} hit rate {row['hit_rate']:.3f}  imbalance {row['imbalance_mean']:.2f} "
              f"(p99 {row['imbalance_p99']:.2f})  {row['decision_us']:.0f} us/launch", flush=True)
    best = data["policies"]["least-loaded"]
    data["cache_aware_default_vs_least_loaded"] = {
        "hit_rate": data["policies"]["cache-aware/4"]["hit_rate"] / max(best["hit_rate"], 1e-9),
        "imbalance": data["policies"]["cache-aware/4"]["imbalance_mean"] / best["imbalance_mean"]}
    data["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                    "quick": args.quick, "rounds": 1, "seed": args.seed, **machine_settings()}
    write_results(args.out, data)
    plot(data, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
