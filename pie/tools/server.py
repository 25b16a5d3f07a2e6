"""The tool server: deterministic tools for agent inferlets and benchmarks, over HTTP.

Every tool is `POST /tools/<name>` with a JSON object in and a JSON object out; `GET /tools`
lists them with a one-line description and the JSON schema of their input; `GET /stats`
counts the requests each tool received; `GET /bytes?n=N` streams N bytes (tests of
response size limits). A request the
tool refuses (bad expression, limit exceeded, malformed body) answers 400 with
{"error": "<why>"}; an unknown tool answers 404 the same way, so an agent always finds a
message it can show the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pie.tools.calculator import CalculatorError, evaluate
from pie.tools.config import ToolConfig
from pie.tools.execute import ExecuteLimits, execute_python
from pie.tools.search import BUNDLED_CORPUS, Corpus


MAX_BYTES_BODY = 512 * 2**20  # largest body `GET /bytes` streams
BYTES_CHUNK = 64 * 2**10


class ToolError(Exception):
    """A request a tool refuses; answered with 400 and this message."""


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt argument is an error, not ignored


class CalculatorInput(_Input):
    expression: str = Field(description="arithmetic, e.g. '2 * (3 + 4) ** 2 / sqrt(7)'")


class SearchInput(_Input):
    query: str
    k: int = Field(default=3, ge=1, le=20, description="how many entries to return at most")


class SlowInput(_Input):
    input: Any = Field(default=None, description="any JSON value, echoed back")
    latency_ms: float | None = Field(default=None, ge=0, description="default from config")


class ExecuteInput(_Input):
    code: str = Field(description="a Python script; its stdout and stderr are returned")


@dataclass(frozen=True)
class Tool:
    description: str
    input_model: type[_Input]
    run: Callable[[Any], Awaitable[dict[str, Any]]]


def create_tool_app(config: ToolConfig) -> FastAPI:
    """The FastAPI app serving every tool with the limits in `config`."""
    tools = _tools(config)
    calls = dict.fromkeys(tools, 0)  # requests per known tool, refused ones included
    app = FastAPI(title="Pie tool server")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {"calls": dict(calls)}

    @app.get("/bytes")
    async def stream_bytes(n: str = "0") -> Response:
        """`n` bytes of "x", streamed in 64 KiB chunks without a Content-Length (a client
        learns the size only by reading): for tests of response size limits."""
        if not n.isdigit() or int(n) > MAX_BYTES_BODY:
            return _error(400, f"n must be an integer from 0 to {MAX_BYTES_BODY}, got {n!r}")
        size = int(n)

        async def body():
            chunk = b"x" * BYTES_CHUNK
            for start in range(0, size, BYTES_CHUNK):
                yield chunk[:min(BYTES_CHUNK, size - start)]

        return StreamingResponse(body(), media_type="text/plain")

    @app.get("/tools")
    async def list_tools() -> list[dict[str, Any]]:
        return [
            {"name": name, "description": tool.description,
             "input_schema": tool.input_model.model_json_schema()}
            for name, tool in tools.items()
        ]

    @app.post("/tools/{name}")
    async def call_tool(name: str, request: Request) -> JSONResponse:
        tool = tools.get(name)
        if tool is None:
            return _error(404, f"unknown tool {name!r} (known: {', '.join(tools)})")
        calls[name] += 1
        try:
            arguments = tool.input_model.model_validate(json.loads(await request.body()))
            await _simulated_latency(request, config)
            return JSONResponse(await tool.run(arguments))
        except json.JSONDecodeError as e:
            return _error(400, f"request body is not JSON: {e}")
        except ValidationError as e:
            return _error(400, "invalid arguments: " + "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()
            ))
        except ToolError as e:
            return _error(400, str(e))

    return app


async def _simulated_latency(request: Request, config: ToolConfig) -> None:
    """`?latency_ms=N` on any tool: answer after N ms, as a remote API would (benchmarks)."""
    raw = request.query_params.get("latency_ms")
    if raw is None:
        return
    try:
        latency = float(raw)
    except ValueError:
        raise ToolError(f"latency_ms must be a number, got {raw!r}") from None
    if not 0 <= latency <= config.slow_max_latency_ms:
        raise ToolError(f"latency_ms must be between 0 and {config.slow_max_latency_ms}, got {raw}")
    await asyncio.sleep(latency / 1000)


def _tools(config: ToolConfig) -> dict[str, Tool]:
    """The tools, each closed over the part of `config` it needs."""
    corpus = Corpus.load(Path(config.corpus_path) if config.corpus_path else BUNDLED_CORPUS)
    limits = ExecuteLimits(
        timeout_s=config.execute_timeout_s, cpu_s=config.execute_cpu_s,
        memory_mb=config.execute_memory_mb, file_mb=config.execute_file_mb,
        max_output_bytes=config.execute_max_output_bytes,
    )

    async def calculator(args: CalculatorInput) -> dict[str, Any]:
        try:
            return {"result": evaluate(args.expression)}
        except CalculatorError as e:
            raise ToolError(str(e)) from None

    async def search(args: SearchInput) -> dict[str, Any]:
        return {"results": [
            {"id": entry.id, "title": entry.title, "text": entry.text, "score": score}
            for entry, score in corpus.search(args.query, args.k)
        ]}

    async def slow(args: SlowInput) -> dict[str, Any]:
        latency = config.slow_default_latency_ms if args.latency_ms is None else args.latency_ms
        if latency > config.slow_max_latency_ms:
            raise ToolError(f"latency_ms {latency} exceeds the cap {config.slow_max_latency_ms}")
        await asyncio.sleep(latency / 1000)  # a sleep, not a busy wait: calls overlap
        return {"output": args.input, "latency_ms": latency}

    async def execute(args: ExecuteInput) -> dict[str, Any]:
        if len(args.code.encode("utf-8")) > config.max_code_bytes:
            raise ToolError(f"code longer than {config.max_code_bytes} bytes")
        return dataclasses.asdict(await execute_python(args.code, limits))

    return {
        "calculator": Tool("Evaluate an arithmetic expression (+ - * / // % **, sqrt, sin, "
                           "cos, tan, log, log10, exp, abs, floor, ceil, pi, e).",
                           CalculatorInput, calculator),
        "search": Tool("Keyword search over a small corpus of facts; returns the top-k "
                       "entries by score.", SearchInput, search),
        "slow": Tool("Echo `input` after `latency_ms` milliseconds (for I/O-overlap "
                     "benchmarks).", SlowInput, slow),
        "execute": Tool("Run a Python snippet in a resource-limited subprocess; returns "
                        "stdout, stderr, exit code and whether it timed out.",
                        ExecuteInput, execute),
    }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def serve_tools(config: ToolConfig | None = None, on_ready: Callable[[str], None] = print) -> None:
    """Serve until interrupted. The socket is bound before serving so `on_ready` gets the
    real URL even for port 0. ToolConfig has already refused a non-loopback host."""
    config = config or ToolConfig()
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen()  # connections made right after on_ready wait in the backlog
    host, port = sock.getsockname()[:2]
    on_ready(f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}")
    server = uvicorn.Server(uvicorn.Config(create_tool_app(config), log_level="warning"))
    server.run(sockets=[sock])
