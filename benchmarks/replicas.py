"""Data-parallel backend replicas (issue 22): one replica vs two, each pinned to one core,
and a replica killed mid-run.

Throughput: `--instances` `text_completion`s launched at once (distinct prompts, greedy,
`--tokens` each, each prompt's tokens counted from the end events' usage); tokens / wall
time from the first launch to the last end, after one untimed warm-up wave. Sides: `1x1`
(`backend.replicas = 1`, `replica_cores = 1`: core 0) and `2x1` (two replicas on cores 0
and 1). The control process is not pinned: on a 2-core machine it shares the cores with the
backends, as it would in production. Each round starts both sides' servers in rotated
order. Scaling efficiency = 2x1 / (2 × 1x1).

Failure: on a `2x1` server, a wave of `--instances`; once both replicas decode, replica 1's
backend is killed (SIGKILL). Reported: how the instances ended (those on the killed
replica with the reason, the others finished, their text equal to the same prompt's text
from an undisturbed run), the seconds until /health is "ok" again, and a wave after it.

    python benchmarks/replicas.py [--rounds 3] [--instances 16] [--tokens 64] [--quick] [--out FILE]

The same two replicas as Ray actors of a local Ray cluster (`backend.ray = "local"`, one
CPU each, attached over tcp with a secret: pie/server/ray_replicas.py) are the side
`2x1-ray` (`--no-ray` leaves it out). `--quick` (1 round, 4 instances, 32 tokens, no Ray:
tests/test_replicas.py runs Ray end to end) is the smoke run tests/test_bench_scripts.py
makes. Results: benchmarks/results/replicas.json
and replicas.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, rotated, write_results
from pie.client import PieClient, http_url
from pie.server.local import LocalServer

RESULTS = ROOT / "benchmarks" / "results"
# name -> (replicas, Ray address): one core each (pinned, or a Ray actor of one CPU)
SIDES = {"1x1": (1, ""), "2x1": (2, ""), "2x1-ray": (2, "local")}
# fp32: greedy text is then the same whatever a sequence's batch, so the survivors of the
# kill can be held to an undisturbed run's text (the ratio is what this script measures).
DTYPE = "float32"
TOPICS = ["dragons", "the sea", "a clockmaker", "winter", "a lost key", "the moon", "bees", "a lighthouse",
          "trains", "a library", "volcanoes", "a fox", "glass", "rivers", "a violin", "the desert"]


def prompts(n: int, wave: int) -> list[str]:
    """n distinct prompts; another wave's differ (no prefix-cache hits across waves)."""
    return [f"Story {wave}.{i}: write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def get(url: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(http_url(url) + path, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def wave(client: PieClient, texts: list[str], tokens: int) -> dict:
    """Launch one text_completion per prompt at once; tokens/s and each one's end."""
    started = time.perf_counter()
    instances = [await client.launch("text_completion", ["--prompt", p, "--max-tokens", str(tokens)])
                 for p in texts]

    async def collect(instance) -> tuple[str, str, int]:
        messages = [m async for m in instance]
        reason = await instance.wait()
        return "".join(messages), reason, instance.usage.get("sampled_tokens", 0)

    ends = await asyncio.gather(*(collect(i) for i in instances))
    seconds = time.perf_counter() - started
    generated = sum(n for _, _, n in ends)
    return {"seconds": seconds, "tokens": generated, "tokens_per_s": generated / seconds,
            "texts": [t for t, _, _ in ends], "reasons": [r for _, r, _ in ends]}


def config_toml(replicas: int, ray: str = "") -> str:
    return f"[backend]\nreplicas = {replicas}\nreplica_cores = 1\nray = \"{ray}\"\n"


async def throughput(tmp: Path, side: str, round_: int, instances: int, tokens: int) -> dict:
    config = tmp / f"{side}.toml"
    config.write_text(config_toml(*SIDES[side]))
    with (tmp / f"{side}.log").open("ab") as log:
        async with LocalServer(["--config", str(config), "--dtype", DTYPE], stderr=log) as url, \
                PieClient(url) as client:
            await wave(client, prompts(instances, 1000 + round_), tokens)  # warm-up
            measured = await wave(client, prompts(instances, round_), tokens)
            replicas = get(url, "/stats")[1]["replicas"]
            model = get(url, "/health")[1]["model"]
    assert all(r == "finished" for r in measured["reasons"]), measured["reasons"]
    return {**measured, "launched": [r["launched"] for r in replicas], "model": model}


def backend_pid(server_pid: int, endpoint: str) -> int:
    pids = subprocess.run(["pgrep", "-P", str(server_pid), "-f", "pie.cli backend"],
                          capture_output=True, text=True).stdout.split()
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if endpoint.encode() in f.read():
                return int(pid)
    raise RuntimeError(f"no backend process serves {endpoint}")


async def failure(tmp: Path, instances: int, tokens: int, undisturbed: dict[str, str]) -> dict:
    """Kill replica 1's backend while a wave decodes on both replicas."""
    config = tmp / "failure.toml"
    config.write_text(config_toml(2))
    texts = list(undisturbed)
    with (tmp / "failure.log").open("ab") as log:
        server = LocalServer(["--config", str(config), "--dtype", DTYPE], stderr=log)
        async with server as url, PieClient(url) as client:
            before = get(url, "/stats")[1]["replicas"]
            run = asyncio.ensure_future(wave(client, texts, tokens))
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:  # both replicas decoding: passes beyond the prefills
                now = get(url, "/stats")[1]["replicas"]
                if all(r["scheduler"]["calls"].get("pass", 0) - b["scheduler"]["calls"].get("pass", 0) >= 3
                       for r, b in zip(now, before)) or run.done():
                    break
                await asyncio.sleep(0.02)
            placed_on_victim = now[1]["instances"]
            os.kill(backend_pid(server.process.pid, now[1]["endpoint"]), signal.SIGKILL)
            killed_at = time.monotonic()
            ended = await run
            while get(url, "/health")[1].get("status") != "ok":
                await asyncio.sleep(0.1)
            recovery_s = time.monotonic() - killed_at
            after = await wave(client, prompts(instances, 2000), tokens)
            replicas = get(url, "/stats")[1]["replicas"]
    lost = [r for r in ended["reasons"] if r != "finished"]
    finished = [(p, t) for p, t, r in zip(texts, ended["texts"], ended["reasons"]) if r == "finished"]
    return {
        "instances": instances, "on_killed_replica_at_kill": placed_on_victim,
        "ended_with_error": len(lost), "error_reasons": sorted(set(lost)),
        "finished": len(finished), "finished_same_text": all(undisturbed[p] == t for p, t in finished),
        "recovery_s": recovery_s,
        "after": {"finished": sum(r == "finished" for r in after["reasons"]), "tokens_per_s": after["tokens_per_s"]},
        "replicas_after": [{"status": r["status"], "launched": r["launched"]} for r in replicas],
    }


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    sides = list(data["tokens_per_s"])
    for i, side in enumerate(sides):
        rounds = data["tokens_per_s_rounds"][side]
        ax.scatter([i] * len(rounds), rounds, color="grey", zorder=3)
        ax.bar(i, data["tokens_per_s"][side], color=["tab:blue", "tab:orange", "tab:green"][i])
    ax.set_xticks(range(len(sides)), [f"{SIDES[s][0]} replica(s){' on Ray' if SIDES[s][1] else ''}" for s in sides])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{data['instances']} text_completions x {data['tokens']} tokens: "
                 f"scaling efficiency {data['scaling_efficiency']:.2f}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


async def run(rounds: int, instances: int, tokens: int, sides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="pie-replicas-") as tmp:
        per_side: dict[str, list[dict]] = {side: [] for side in sides}
        for round_ in range(rounds):
            for side in rotated(sides, round_):
                result = await throughput(Path(tmp), side, round_, instances, tokens)
                per_side[side].append(result)
                print(f"round {round_} {side}: {result['tokens_per_s']:.1f} tok/s", flush=True)
        first = per_side["1x1"][0]
        undisturbed = dict(zip(prompts(instances, 0), first["texts"]))
        killed = await failure(Path(tmp), instances, tokens, undisturbed)
    rates = {side: [r["tokens_per_s"] for r in results] for side, results in per_side.items()}
    median = {side: statistics.median(r) for side, r in rates.items()}
    return {
        "instances": instances, "tokens": tokens,
        "tokens_per_s": median, "tokens_per_s_rounds": rates,
        "speedup": median["2x1"] / median["1x1"],
        "scaling_efficiency": median["2x1"] / (2 * median["1x1"]),
        **({"ray_speedup": median["2x1-ray"] / median["1x1"],
            "ray_scaling_efficiency": median["2x1-ray"] / (2 * median["1x1"])} if "2x1-ray" in median else {}),
        "launched_per_replica": {side: results[-1]["launched"] for side, results in per_side.items()},
        "failure": killed,
        "model": per_side["1x1"][0]["model"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 round, 4 instances, 32 tokens (the tests' smoke run)")
    parser.add_argument("--no-ray", action="store_true", help="leave out the side on a local Ray cluster")
    parser.add_argument("--out", default=str(RESULTS / "replicas.json"))
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("benchmarks/replicas.py needs 2 cores (one per replica)")
    rounds, instances, tokens = (1, 4, 32) if args.quick else (args.rounds, args.instances, args.tokens)
    sides = [s for s in SIDES if not (args.no_ray or args.quick) or not SIDES[s][1]]
    data = asyncio.run(run(rounds, instances, tokens, sides))
    data["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command_line(),
                    "quick": args.quick, "rounds": rounds, "order": "rotated per round", "dtype": DTYPE,
                    "model": data.pop("model"),
                    **machine_settings()}
    write_results(args.out, data)
    plot(data, Path(args.out).with_suffix(".png"))
    print(f"1x1 {data['tokens_per_s']['1x1']:.1f} tok/s, 2x1 {data['tokens_per_s']['2x1']:.1f} tok/s: "
          f"{data['speedup']:.2f}x, efficiency {data['scaling_efficiency']:.2f}; killed replica: "
          f"{data['failure']['ended_with_error']} ended, {data['failure']['finished']} finished, back in "
          f"{data['failure']['recovery_s']:.1f} s")


if __name__ == "__main__":
    main()
