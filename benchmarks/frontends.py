"""Python vs Rust inferlets, and the OpenAI endpoint vs a native launch, in one run.

- Launch latency: launch → first message of `hello` (Rust) and `hello.py` (Python).
  Cold: a program the server has never seen (a unique custom section changes its hash), so
  the time includes upload and compilation to machine code. Warm: the same program again
  (compiled code cached by hash).
- Time per output token, greedy, same prompt and length, alternating the variants:
  `text_completion` launched natively (WebSocket RPC), the same request through
  `POST /v1/chat/completions`, and the Python `text_completion.py`.

A private `pie serve` (fp32 by default, so every variant produces the same tokens) serves
everything. Results: benchmarks/results/frontends.json.

    python benchmarks/frontends.py [--quick] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from pie.client import PieClient, http_url
from pie.python_build import build_python_inferlet
from pie.server.local import LocalServer
from pie.toolchain import build_inferlet

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "Write a short story about a robot learning to paint."


def with_custom_section(component: bytes, payload: bytes) -> bytes:
    """The component plus a custom section: same behaviour, a hash the server has not seen."""
    name = b"pie-bench"
    body = bytes([len(name)]) + name + payload
    size, leb = len(body), bytearray()
    while True:
        byte, size = size & 0x7F, size >> 7
        leb.append(byte | (0x80 if size else 0))
        if not size:
            break
    return component + b"\x00" + bytes(leb) + body


async def first_message(client: PieClient, program: str) -> float:
    start = time.perf_counter()
    instance = await client.launch(program, ["hi"])
    await instance.recv()
    elapsed = time.perf_counter() - start
    await instance.send("quit")
    assert await instance.wait() == "finished"
    return elapsed


async def launch_latency(client: PieClient, component: bytes, cold_runs: int, warm_runs: int) -> dict:
    cold = []
    for i in range(cold_runs):
        start = time.perf_counter()
        digest = await client.upload(with_custom_section(component, f"{time.time()}-{i}".encode()))
        cold.append(time.perf_counter() - start + await first_message(client, digest))
    warm = [await first_message(client, digest) for _ in range(warm_runs)]
    return {"cold_ms": 1000 * statistics.median(cold), "warm_ms": 1000 * statistics.median(warm),
            "size_mb": len(component) / 2**20}


async def native(client: PieClient, program: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    instance = await client.launch(program, ["--prompt", PROMPT, "--max-tokens", str(max_tokens)])
    [text] = [m async for m in instance]
    assert await instance.wait() == "finished"
    return time.perf_counter() - start, len(text)


async def openai_chat(http: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    response = await http.post(f"{url}/v1/chat/completions",
                               json={"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "temperature": 0,
                                     "messages": [{"role": "user", "content": PROMPT}]}, timeout=600)
    response.raise_for_status()
    body = response.json()
    assert body["usage"]["completion_tokens"] == max_tokens, body["usage"]
    return time.perf_counter() - start, len(body["choices"][0]["message"]["content"])


async def run(args: argparse.Namespace) -> dict:
    rust_hello = build_inferlet(ROOT / "inferlets" / "hello").read_bytes()
    python_hello = build_python_inferlet(ROOT / "inferlets" / "python" / "hello.py").read_bytes()
    python_tc = build_python_inferlet(ROOT / "inferlets" / "python" / "text_completion.py").read_bytes()
    cold_runs, warm_runs, rounds = (1, 3, 2) if args.quick else (3, 20, 5)
    max_tokens = 16 if args.quick else 64
    async with LocalServer(["--dtype", args.dtype]) as url:
        base = http_url(url)
        async with PieClient(url) as client, httpx.AsyncClient() as http:
            launch = {"rust": await launch_latency(client, rust_hello, cold_runs, warm_runs),
                      "python": await launch_latency(client, python_hello, cold_runs, warm_runs)}
            python_digest = await client.upload(python_tc)
            await native(client, "text_completion", 4)  # warm-up: compile, first forward
            await native(client, python_digest, 4)
            times: dict[str, list[float]] = {"native": [], "openai": [], "python": []}
            lengths: dict[str, set[int]] = {k: set() for k in times}
            for _ in range(rounds):  # alternate, so noise hits every variant alike
                for name, call in (("native", lambda: native(client, "text_completion", max_tokens)),
                                   ("openai", lambda: openai_chat(http, base, max_tokens)),
                                   ("python", lambda: native(client, python_digest, max_tokens))):
                    elapsed, chars = await call()
                    times[name].append(1000 * elapsed / max_tokens)
                    lengths[name].add(chars)
    per_token = {name: statistics.median(t) for name, t in times.items()}
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dtype": args.dtype, "max_tokens": max_tokens, "rounds": rounds,
        "launch": launch,
        "launch_ratio_python_vs_rust": {k: launch["python"][k] / launch["rust"][k] for k in ("cold_ms", "warm_ms")},
        "ms_per_token": per_token,
        "ratio_vs_native": {name: per_token[name] / per_token["native"] for name in per_token},
        "same_output_lengths": len(set().union(*lengths.values())) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (fewer, shorter rounds)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    result = asyncio.run(run(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "frontends.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
