"""Python vs Rust inferlets, and the OpenAI endpoint vs a native launch, in one run.

- Rebuild after a one-line edit: `pie build` of a Rust crate (the `pie new` template; cargo
  rebuilds the crate, the SDK stays compiled) and of a Python inferlet (`hello.py`; a
  componentize-py build snapshots the whole interpreter again, there is no incremental
  mode), each round appending one line of code to both, languages alternating; and a build
  of the unchanged source (the content-keyed cache). And the same edit run with
  `pie run --interpret` instead: the source bundled (`python_bundle`) and sent to the
  prebuilt interpreter inferlet (compiled once, untimed), timed from the edit to the first
  message (`interpret`), against a rebuild plus a cold launch (`python_edit_to_running_s`).
- Launch latency: launch → first message of `hello` (Rust) and `hello.py` (Python).
  Cold: a program the server has never seen (a unique custom section changes its hash), so
  the time includes upload and compilation to machine code. Warm: the same program again
  (compiled code cached by hash). Rust and Python alternate round by round.
- Time per output token, greedy, same prompt and length: `text_completion` launched
  natively (WebSocket RPC), the same request through `POST /v1/chat/completions`, and the
  Python `text_completion.py`. Each path runs once untimed first (warm-up), then the rounds
  rotate which path goes first; the tokens each run generated are counted (the instance's
  `sampled_tokens` usage; the endpoint's `usage.completion_tokens`), not assumed, and the text of
  every run is kept: `same_output` says whether every path, in every run, generated the
  same text and the same number of tokens (fp32 greedy: it must).
- Constrained decoding's cost: the same chat request with a JSON-schema `response_format`
  (`openai-json`; a story string of at least 2,000 characters, so it runs to `max_tokens`
  like the others), per token against the unconstrained `openai` path (`json_schema_cost`);
  and a forced tool call (`openai-tools`: `tool_choice` naming one of two tools whose
  `story` argument has the same 2,000-character minimum, the Lark grammar with an embedded
  JSON schema that tool calling decodes under), against the same (`tool_call_cost`).

A private `pie serve` (fp32 by default, so every variant produces the same tokens) serves
everything. Results: benchmarks/results/frontends.json (`--out` elsewhere), with the
settings: rounds, the order of each round, dtype, CPU model and flags, torch version.

    python benchmarks/frontends.py [--quick] [--rounds 5] [--dtype bfloat16] [--out FILE]

`--quick` (24 tokens, 2 rounds, one cold launch per language) is the smoke run
tests/test_bench_scripts.py makes; it writes every field the full run does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the `benchmarks` package is in the repository root

from benchmarks.run_info import command_line, machine_settings, rotated
from pie.client import PieClient, http_url
from pie.config import load_config
from pie.python_build import INTERPRETER, build_python_inferlet, python_bundle
from pie.scaffold import new_inferlet
from pie.server.local import LocalServer
from pie.server.openai import INFERLET as OPENAI_INFERLET
from pie.toolchain import build_inferlet

RESULTS = ROOT / "benchmarks" / "results"
PROMPT = "Write a short story about a robot learning to paint."
LANGUAGES = ["rust", "python"]
PATHS = ["native", "openai", "python", "openai-json", "openai-tools"]
CONSTRAINED = ("openai-json", "openai-tools")
# The constrained path: a string of at least 2,000 characters, so the grammar never lets the
# output end before max_tokens and both /v1 paths generate exactly as many tokens.
STORY_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
                "required": ["story"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "tell_story", "description": "Tell a story",
                                           "parameters": STORY_SCHEMA}},
         {"type": "function", "function": {"name": "paint", "description": "Paint a picture",
                                           "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}}}}]
ROUNDS, QUICK_ROUNDS = 5, 2  # rounds of the time per token: full run, --quick


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


def forget(digests: list[str]) -> None:
    """Delete the compiled artifacts of the one-off programs the cold launches made (35 MB
    each for Python): no one will launch them again. The server loads the default config,
    so its program cache is ours."""
    programs = load_config().paths.cache / "programs"
    for digest in digests:
        (programs / f"{digest}.cwasm").unlink(missing_ok=True)


def rebuild_times(rounds: int, work: Path) -> tuple[dict, list[list[str]]]:
    """Seconds to rebuild after a one-line edit, and to build the unchanged source, per
    language (medians over `rounds`, alternating which language goes first)."""
    crate = new_inferlet(work / "edit_me", "bench_edit_me")
    script = work / "edit_me.py"
    script.write_text((ROOT / "inferlets" / "python" / "hello.py").read_text())
    cache = work / "cache"
    build = {"rust": lambda: build_inferlet(crate, release=True),
             "python": lambda: build_python_inferlet(script, cache=cache)}
    edit = {"rust": lambda r: _append(crate / "src" / "lib.rs", f"pub const EDIT_{r}: u32 = {r};"),
            "python": lambda r: _append(script, f"EDIT_{r} = {r}")}
    for language in LANGUAGES if rounds > 1 else ():  # (a one-round smoke run times a first build)
        build[language]()  # the first build: dependencies, the SDK, the interpreter
    edited: dict[str, list[float]] = {k: [] for k in LANGUAGES}
    unchanged: dict[str, list[float]] = {k: [] for k in LANGUAGES}
    order = []
    for r in range(rounds):
        order.append(rotated(LANGUAGES, r))
        for language in order[-1]:
            edit[language](r)
            for times in (edited, unchanged):
                start = time.perf_counter()
                build[language]()
                times[language].append(time.perf_counter() - start)
    return ({k: {"edit_rebuild_s": statistics.median(edited[k]), "unchanged_s": statistics.median(unchanged[k]),
                 "edit_rebuild_rounds_s": edited[k]} for k in LANGUAGES}, order)


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


async def first_message(client: PieClient, program: str, before: list[str] = ()) -> float:  # type: ignore[assignment]
    start = time.perf_counter()
    instance = await client.launch(program, [*before, "hi"])
    await instance.recv()
    elapsed = time.perf_counter() - start
    await instance.send("quit")
    assert await instance.wait() == "finished"
    return elapsed


async def launch_latency(client: PieClient, components: dict[str, bytes], rounds: int,
                         warm_per_round: int, made: list[str]) -> tuple[dict, list[list[str]]]:
    """Per round and language (alternating which goes first): one cold launch of a program
    never seen, then `warm_per_round` launches of it again. The hashes of the programs made
    for it are appended to `made`."""
    cold: dict[str, list[float]] = {name: [] for name in components}
    warm: dict[str, list[float]] = {name: [] for name in components}
    order = []
    for r in range(rounds):
        order.append(rotated(list(components), r))
        for name in order[-1]:
            start = time.perf_counter()
            digest = await client.upload(with_custom_section(components[name], f"{time.time()}-{r}".encode()))
            made.append(digest)
            cold[name].append(time.perf_counter() - start + await first_message(client, digest))
            warm[name] += [await first_message(client, digest) for _ in range(warm_per_round)]
    return {name: {"cold_ms": 1000 * statistics.median(cold[name]), "warm_ms": 1000 * statistics.median(warm[name]),
                   "cold_runs": len(cold[name]), "warm_runs": len(warm[name]),
                   "size_mb": len(components[name]) / 2**20} for name in components}, order


async def interpret_latency(client: PieClient, interpreter: str, script: Path, rounds: int) -> list[float]:
    """Seconds from a one-line edit of `script` (hello.py) to its first message through the
    interpreter, per round (its first launch, the server's compile, untimed)."""
    await first_message(client, interpreter, [python_bundle(script)])
    times = []
    for r in range(rounds):
        _append(script, f"EDIT_INTERPRET_{r} = {r}")
        start = time.perf_counter()
        times.append(time.perf_counter() - start + await first_message(client, interpreter, [python_bundle(script)]))
    return times


class Paths:
    """The three ways to run the same completion; each call returns (seconds, the text,
    tokens generated), the tokens as the instance (or the endpoint) reports them."""

    def __init__(self, client: PieClient, http: httpx.AsyncClient, base: str, model: str,
                 python_digest: str, max_tokens: int):
        self.client, self.http, self.base, self.model = client, http, base, model
        self.programs = {"native": "text_completion", "openai": OPENAI_INFERLET, "python": python_digest}
        self.max_tokens = max_tokens

    async def run(self, path: str) -> tuple[float, str, int]:
        endpoint = {"openai": self.openai, "openai-json": lambda: self.openai(STORY_SCHEMA),
                    "openai-tools": lambda: self.openai(tools=True)}
        call: Callable[[], Awaitable[tuple[str, int]]] = endpoint.get(path) or (lambda: self.native(self.programs[path]))
        start = time.perf_counter()
        text, generated = await call()
        return time.perf_counter() - start, text, generated

    async def native(self, program: str) -> tuple[str, int]:
        instance = await self.client.launch(program, ["--prompt", PROMPT, "--max-tokens", str(self.max_tokens)])
        [text] = [m async for m in instance]
        assert await instance.wait() == "finished"
        return text, instance.usage["sampled_tokens"]

    async def openai(self, schema: dict | None = None, tools: bool = False) -> tuple[str, int]:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPT}]}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": schema}}
        if tools:
            body |= {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "tell_story"}}}
        response = await self.http.post(f"{self.base}/v1/chat/completions", timeout=600, json=body)
        response.raise_for_status()
        reply = response.json()
        message = reply["choices"][0]["message"]
        text = message["content"] if not tools else "".join(c["function"]["arguments"] for c in message["tool_calls"])
        return text, reply["usage"]["completion_tokens"]


async def run(args: argparse.Namespace) -> dict:
    components = {"rust": build_inferlet(ROOT / "inferlets" / "hello").read_bytes(),
                  "python": build_python_inferlet(ROOT / "inferlets" / "python" / "hello.py").read_bytes()}
    python_tc = build_python_inferlet(ROOT / "inferlets" / "python" / "text_completion.py").read_bytes()
    interpreter_component = build_python_inferlet(INTERPRETER).read_bytes()
    with tempfile.TemporaryDirectory() as scratch:
        return await measure(args, components, python_tc, interpreter_component, Path(scratch))


async def measure(args: argparse.Namespace, components: dict[str, bytes], python_tc: bytes,
                  interpreter_component: bytes, work: Path) -> dict:
    """Every measurement, with `work` for the programs the rebuild and interpret rounds edit."""
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    launch_rounds, warm_per_round = (1, 2) if args.quick else (3, 7)
    max_tokens = 24 if args.quick else 64  # quick: enough for a forced tool call to reach its arguments
    made: list[str] = []
    rebuild, rebuild_order = rebuild_times(1 if args.quick else 3, work)  # before the server: nothing else on the CPUs
    async with LocalServer(["--dtype", args.dtype]) as url:
        base = http_url(url)
        async with PieClient(url) as client, httpx.AsyncClient() as http:
            model = (await http.get(f"{base}/health", timeout=60)).json()["model"]
            await first_message(client, "hello")  # warm-up: the server's first launch
            try:
                launch, launch_order = await launch_latency(client, components, launch_rounds, warm_per_round, made)
            finally:
                forget(made)
            interpreter = await client.upload(interpreter_component)
            interpret = await interpret_latency(client, interpreter, work / "edit_me.py", launch_rounds)
            paths = Paths(client, http, base, model, await client.upload(python_tc), max_tokens)
            # Every run's (text, tokens), warm-up included: all must be the same.
            outputs: dict[str, list[tuple[str, int]]] = {k: [] for k in PATHS}
            for path in PATHS:  # warm-up: compile, first forwards at this length, the HTTP path
                _, text, generated = await paths.run(path)
                outputs[path].append((text, generated))
            times: dict[str, list[float]] = {k: [] for k in PATHS}
            tokens: dict[str, list[int]] = {k: [] for k in PATHS}
            order = []
            for r in range(rounds):  # rotate, so noise and warm caches favour no path
                order.append(rotated(PATHS, r))
                for path in order[-1]:
                    elapsed, text, generated = await paths.run(path)
                    times[path].append(1000 * elapsed / max(1, generated))
                    tokens[path].append(generated)
                    outputs[path].append((text, generated))
    per_token = {name: statistics.median(t) for name, t in times.items()}
    return {
        "max_tokens": max_tokens,
        "rebuild": rebuild,
        "rebuild_ratio_python_vs_rust": rebuild["python"]["edit_rebuild_s"] / rebuild["rust"]["edit_rebuild_s"],
        # From a one-line edit of a Python inferlet to its first message on a server that has
        # never seen it: the rebuild, then the cold launch (upload, compile, run).
        "python_edit_to_running_s": rebuild["python"]["edit_rebuild_s"] + launch["python"]["cold_ms"] / 1000,
        # The same with `pie run --interpret`: bundle the source, launch the interpreter.
        "interpret": {"edit_to_running_ms": 1000 * statistics.median(interpret),
                      "edit_to_running_rounds_ms": [1000 * t for t in interpret]},
        "edit_to_running_ratio_build_vs_interpret": (
            (rebuild["python"]["edit_rebuild_s"] + launch["python"]["cold_ms"] / 1000) / statistics.median(interpret)),
        "launch": launch,
        "launch_ratio_python_vs_rust": {k: launch["python"][k] / launch["rust"][k] for k in ("cold_ms", "warm_ms")},
        "ms_per_token": per_token,
        "ms_per_token_rounds": times,
        "tokens": tokens,
        "ratio_vs_native": {name: per_token[name] / per_token["native"] for name in per_token},
        # The distinct texts each path generated (one each, and the same one, when all agree).
        "outputs": {path: sorted({text for text, _ in runs}) for path, runs in outputs.items()},
        "same_output": len({run for path, runs in outputs.items() if path not in CONSTRAINED for run in runs}) == 1,
        # Constrained decoding's cost: the same request under a JSON schema, or as a forced
        # tool call, per token.
        "json_schema_cost": per_token["openai-json"] / per_token["openai"],
        "tool_call_cost": per_token["openai-tools"] / per_token["openai"],
        "meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "command": command_line(), "quick": args.quick, "rounds": rounds,
                 "order": {"rebuild": rebuild_order, "launch": launch_order, "ms_per_token": order},
                 "warmup": "a first launch of hello; one untimed run of every path before the timed rounds",
                 "dtype": args.dtype, "model": model, **machine_settings()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (fewer, shorter rounds)")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds of the time per token (default {ROUNDS}; quick {QUICK_ROUNDS})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=str(RESULTS / "frontends.json"), help="where the JSON goes")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
