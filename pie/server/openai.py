"""OpenAI-compatible endpoints: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (streaming with server-sent events, or whole responses).

Every request is served by an ordinary inferlet, the built-in `openai_completion`: this
module only validates the request, launches the inferlet with the request as arguments, and
turns the JSON lines it sends into OpenAI's response shapes. Errors use OpenAI's format.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pie.server.session import authenticate

if TYPE_CHECKING:
    from pie.server.app import ServerState

INFERLET = "openai_completion"
MAX_N = 16
MAX_STOPS = 4


class ApiError(Exception):
    """A request error in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


@dataclass
class Completion:
    """A validated request, as the inferlet's arguments plus what the response needs."""

    chat: bool
    arguments: list[str]
    n: int
    stream: bool
    logprobs: int | None
    include_usage: bool


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    tokens: list[dict[str, Any]] = field(default_factory=list)  # per token, when logprobs


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            _check(state, request)
        except ApiError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [
            {"id": state.model, "object": "model", "created": 0, "owned_by": "pie"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(state, request, chat=True)


async def _serve(state: ServerState, request: Request, chat: bool):
    try:
        user = _check(state, request)
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        completion = parse(body, chat, state.model or "")
        events = _launch(state, completion, user)
        first = await anext(events)  # {"prompt_tokens": n}, or the launch's failure
    except ApiError as e:
        return e.response()
    meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
            "model": state.model}
    if completion.stream:
        return StreamingResponse(_sse(completion, meta, first["prompt_tokens"], events),
                                 media_type="text/event-stream")
    choices = [Choice() for _ in range(completion.n)]
    try:
        async for line in events:
            _apply(choices, line)
    except ApiError as e:
        return e.response()
    return JSONResponse(_whole(completion, meta, first["prompt_tokens"], choices))


def _check(state: ServerState, request: Request) -> str:
    """The caller's user (see session.authenticate), if it may be served now."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    user = authenticate(state.config.auth_tokens, given)
    if user is None:
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                       kind="authentication_error", code="invalid_api_key")
    if state.failure is not None:
        raise ApiError(503, f"the server cannot serve: {state.failure}", kind="server_error")
    if state.runtime is None:
        raise ApiError(503, "the backend is still starting; retry shortly", kind="server_error")
    return user


# --- request validation --------------------------------------------------------------------


def parse(body: dict[str, Any], chat: bool, served_model: str) -> Completion:
    """Check every field OpenAI's API defines that we support; reject what we do not."""
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "you must provide a model parameter", "model")
    if model != served_model:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served_model!r}",
                       "model", code="model_not_found")
    args: list[str] = []
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty array", "messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
                raise ApiError(400, f"messages[{i}] must be an object with a role", f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ApiError(400, "only text content parts are supported", f"messages[{i}].content")
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
            args += ["--message", m["role"], content]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs = _top_logprobs(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string (or an array of one string)", "prompt")
        if body.get("echo"):
            raise ApiError(400, "echo is not supported", "echo")
        args += ["--prompt", prompt]
        max_tokens = body.get("max_tokens", 16)
        logprobs = _number(body, "logprobs", int, 0, 5)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
        args += ["--max-tokens", str(max_tokens)]
    else:
        args += ["--max-tokens", "256"]
    temperature = _number(body, "temperature", float, 0.0, 2.0)
    top_p = _number(body, "top_p", float, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be greater than 0", "top_p")
    seed = _number(body, "seed", int, -(2**63), 2**63 - 1)
    n = _number(body, "n", int, 1, MAX_N) or 1
    args += ["--temperature", str(1.0 if temperature is None else temperature)]
    for flag, value in (("--top-p", top_p), ("--seed", None if seed is None else seed % 2**64),
                        ("--n", n), ("--logprobs", logprobs)):
        if value is not None:
            args += [flag, str(value)]
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not (isinstance(stops, list) and len(stops) <= MAX_STOPS and all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, f"stop must be a non-empty string or an array of at most {MAX_STOPS}", "stop")
    for s in stops:
        args += ["--stop", s]
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: always generate max_tokens
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be a boolean", "ignore_eos")
    if ignore_eos:
        args.append("--ignore-eos")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    return Completion(chat, args, n, stream, logprobs, include_usage)


def _number(body: dict[str, Any], name: str, kind: type, low: float, high: float) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low:g} and {high:g}, got {value!r}", name)
    return kind(value)


def _top_logprobs(body: dict[str, Any]) -> int | None:
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "logprobs must be a boolean", "logprobs")
    top = _number(body, "top_logprobs", int, 0, 20)
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs requires logprobs = true", "top_logprobs")
    return (top or 0) if wanted else None


# --- running the inferlet ------------------------------------------------------------------


async def _launch(state: ServerState, completion: Completion, user: str) -> AsyncIterator[dict[str, Any]]:
    """The inferlet's JSON lines; raises ApiError if it cannot start or fails."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def on_event(instance_id: str, kind: str, data: str, usage: dict | None = None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (kind, data))

    runtime = state.runtime
    try:
        info = await asyncio.to_thread(runtime.launch, INFERLET, completion.arguments, on_event, user)
    except LookupError:  # the runtime's UnknownProgram
        raise ApiError(503, f"the built-in inferlet {INFERLET} is unavailable (see the server log)",
                       kind="server_error") from None
    except RuntimeError as e:  # the runtime's LaunchRefused
        raise ApiError(503, f"the server is busy: {e}", kind="server_error") from None
    finished = False
    try:
        while True:
            kind, data = await queue.get()
            if kind == "terminated":
                finished = True
                if data != "finished":
                    raise ApiError(500, f"the completion failed: {data}", kind="server_error")
                return
            yield json.loads(data)
    finally:
        if not finished:  # the client went away (or we failed): stop the inferlet
            try:
                runtime.terminate(info.id, "the HTTP client disconnected")
            except LookupError:
                pass


def _apply(choices: list[Choice], line: dict[str, Any]) -> None:
    choice = choices[line["index"]]
    choice.text += line.get("text", "")
    if "finish_reason" in line:
        choice.finish_reason = line["finish_reason"]
        choice.completion_tokens = line["completion_tokens"]
    if "logprob" in line:
        choice.tokens.append(line)


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _logprobs(completion: Completion, tokens: list[dict[str, Any]], offset: int = 0) -> Any:
    if completion.logprobs is None:
        return None
    if completion.chat:
        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        return {"content": [{**entry(t["token"], t["logprob"]),
                             "top_logprobs": [entry(s, lp) for s, lp in t["top"]]} for t in tokens]}
    offsets, position = [], offset
    for t in tokens:
        offsets.append(position)
        position += len(t["token"])
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [dict(t["top"]) for t in tokens], "text_offset": offsets}


def _whole(completion: Completion, meta: dict[str, Any], prompt_tokens: int,
           choices: list[Choice]) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        body: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason,
                                "logprobs": _logprobs(completion, c.tokens)}
        if completion.chat:
            body["message"] = {"role": "assistant", "content": c.text}
        else:
            body["text"] = c.text
        out.append(body)
    return {**meta, "object": "chat.completion" if completion.chat else "text_completion",
            "choices": out, "usage": _usage(prompt_tokens, choices)}


async def _sse(completion: Completion, meta: dict[str, Any], prompt_tokens: int,
               events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, then `[DONE]`."""
    kind = "chat.completion.chunk" if completion.chat else "text_completion"
    choices = [Choice() for _ in range(completion.n)]
    positions = [0] * completion.n

    def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> str:
        body: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
        if completion.chat:
            body["delta"] = delta
        else:
            body["text"] = delta.get("content", "")
        return "data: " + json.dumps({**meta, "object": kind, "choices": [body]}) + "\n\n"

    if completion.chat:
        for i in range(completion.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
    try:
        async for line in events:
            i = line["index"]
            _apply(choices, line)
            if "finish_reason" in line:
                yield chunk(i, {}, line["finish_reason"])
            else:
                text = line.get("text", "")
                logprobs = _logprobs(completion, [line], positions[i]) if "logprob" in line else None
                positions[i] += len(text)
                yield chunk(i, {"content": text}, None, logprobs)
    except ApiError as e:
        yield "data: " + json.dumps({"error": {"message": e.message, "type": e.kind}}) + "\n\n"
        return
    finally:
        await events.aclose()  # a client that went away: its inferlet is terminated now
    if completion.include_usage:
        yield "data: " + json.dumps({**meta, "object": kind, "choices": [],
                                     "usage": _usage(prompt_tokens, choices)}) + "\n\n"
    yield "data: [DONE]\n\n"
