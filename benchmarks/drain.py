"""Shutdown drain: what SIGTERM does to running work, measured.

Two runs against a private `pie serve` (loopback):
- `finish`: N completions running, SIGTERM, drain_timeout_s long enough — every instance
  should finish with its whole output; reports the time from the signal to the exit;
- `cut`: N long completions, SIGTERM, drain_timeout_s short — every instance should end
  with "server shutting down"; reports the time from the signal to the exit.
Both check that a launch during the drain is refused and /health says "draining".
Results: benchmarks/results/drain.json.

    python benchmarks/drain.py [--instances 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from pie.client import PieClient, http_url
from pie.server.local import LocalServer
from pie.server.rpc import RpcError

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Tell a long story about a dragon who learns to read."


def health(ws_url: str) -> str:
    url = http_url(ws_url) + "/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["status"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read())["status"]
    except OSError:
        return "gone"


async def scenario(instances: int, max_tokens: int, drain_timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "pie.toml"
        config.write_text(f"[server]\ndrain_timeout_s = {drain_timeout_s}\n")
        server = LocalServer(["--config", str(config)])
        async with server as url, PieClient(url) as client:
            assert server.process is not None
            running = [await client.launch("text_completion", ["--prompt", PROMPT, "--max-tokens",
                                                               str(max_tokens)])
                       for _ in range(instances)]
            await asyncio.sleep(2.0)  # generating
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
            "reasons": {r: reasons.count(r) for r in set(reasons)},
            "output_chars": [sum(map(len, o)) for o in outputs],
            "health_while_draining": status, "launch_refused_while_draining": refused,
            "signal_to_exit_s": round(exit_s, 2), "exit_code": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=8)
    args = parser.parse_args()
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": f"python benchmarks/drain.py --instances {args.instances}",
        "finish": asyncio.run(scenario(args.instances, 64, 120.0)),
        "cut": asyncio.run(scenario(args.instances, 1024, 2.0)),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "drain.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
