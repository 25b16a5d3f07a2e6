"""Shutdown drain: what SIGTERM does to running work, measured.

Two runs against a private `pie serve` (loopback):
- `finish`: N completions running, SIGTERM, drain_timeout_s long enough — every instance
  should finish with its whole output; reports the time from the signal to the exit;
- `cut`: N long completions, SIGTERM, drain_timeout_s short — every instance should end
  with "server shutting down"; reports the time from the signal to the exit.
The signal goes once every instance is decoding (holds KV pages) and a moment more. Both
check that a launch during the drain is refused and /health says "draining", and count the
instances still running when the signal went (/stats): a drain with nothing left to drain
measures nothing. Results: benchmarks/results/drain.json (`--out` elsewhere), with
the settings (dtype, CPU model and flags, torch version).

    python benchmarks/drain.py [--instances 8] [--dtype bfloat16] [--quick] [--out FILE]

`--quick` (2 instances, 32 tokens to finish, a 1 s drain to cut) is the smoke run
tests/test_bench_scripts.py makes; it writes every field the full run does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, served_model
from pie.client import PieClient, http_url
from pie.server.local import LocalServer
from pie.server.rpc import RpcError

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Tell a long story about a dragon who learns to read."
SCENARIOS = ["finish", "cut"]


def health(ws_url: str) -> str:
    url = http_url(ws_url) + "/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["status"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read())["status"]
    except OSError:
        return "gone"


def stats(ws_url: str) -> dict:
    with urllib.request.urlopen(http_url(ws_url) + "/stats", timeout=10) as response:
        return json.loads(response.read())


async def generating(ws_url: str, instances: int, timeout_s: float = 120.0) -> None:
    """Until every instance holds KV pages (its prompt is in: it is decoding), or none is
    left, or `timeout_s`: a fixed sleep would signal before the prefill on a busy machine and
    after the end on an idle one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = await asyncio.to_thread(stats, ws_url)
        resources = now["resources"]
        if now["instances"] == 0 or resources["kv_pages_total"] - resources["kv_pages_free"] >= instances:
            return
        await asyncio.sleep(0.05)


async def scenario(instances: int, max_tokens: int, drain_timeout_s: float, dtype: str,
                   generate_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "pie.toml"
        config.write_text(f"[server]\ndrain_timeout_s = {drain_timeout_s}\n")
        server = LocalServer(["--config", str(config), "--dtype", dtype])
        async with server as url, PieClient(url) as client:
            assert server.process is not None
            model = await asyncio.to_thread(served_model, url)
            running = [await client.launch("text_completion", ["--prompt", PROMPT, "--max-tokens",
                                                               str(max_tokens)])
                       for _ in range(instances)]
            await generating(url, instances)
            await asyncio.sleep(generate_s)  # a few tokens more
            live = (await asyncio.to_thread(stats, url))["instances"]
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            status = await asyncio.to_thread(health, url)
            try:
                await client.launch("hello", ["late"])
                refused = False
            except RpcError as e:
                refused = e.code == "launch_refused"
            outputs = [[m async for m in instance] for instance in running]
            reasons = [await instance.wait() for instance in running]
            code = await server.process.wait()
            exit_s = time.monotonic() - signalled
    return {"instances": instances, "max_tokens": max_tokens, "drain_timeout_s": drain_timeout_s,
            "running_at_signal": live, "reasons": {r: reasons.count(r) for r in set(reasons)},
            "output_chars": [sum(map(len, o)) for o in outputs],
            "health_while_draining": status, "launch_refused_while_draining": refused,
            "signal_to_exit_s": round(exit_s, 2), "exit_code": code, "model": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=None, help="completions running (default 8; quick 2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 instances, short completions")
    parser.add_argument("--out", default=str(RESULTS / "drain.json"), help="where the JSON goes")
    args = parser.parse_args()
    instances = args.instances or (2 if args.quick else 8)
    # (max_tokens, drain_timeout_s): `finish` must end within its drain, `cut` cannot.
    settings = {"finish": (32, 120.0), "cut": (1024, 1.0)} if args.quick else {"finish": (64, 120.0),
                                                                               "cut": (1024, 2.0)}
    generate_s = 0.2 if args.quick else 1.0  # after every instance started decoding
    report: dict = {name: asyncio.run(scenario(instances, *settings[name], args.dtype, generate_s))
                    for name in SCENARIOS}
    model = {report[name].pop("model") for name in SCENARIOS}.pop()
    # One run of each scenario, in this order: they are not compared with each other.
    report["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "command": command_line(), "quick": args.quick, "rounds": 1, "order": [SCENARIOS],
                      "dtype": args.dtype, "model": model, "decode_s_before_signal": generate_s,
                      **machine_settings()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
