"""OpenAI-compatible endpoints: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (streaming with server-sent events, or whole responses).

Every request is served by an ordinary inferlet, the built-in `openai_completion`: this
module only validates the request, launches the inferlet with the request as arguments, and
turns the JSON lines it sends into OpenAI's response shapes. Errors use OpenAI's format.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pie.control.errors import HostError
from pie.runtime.runtime import LaunchRefused, UnknownInstance, UnknownProgram
from pie.server.openai_tools import ToolCallParser, ToolError, Tools, parse_tools, render_messages
from pie.server.session import authenticate

if TYPE_CHECKING:
    from pie.server.app import ServerState

INFERLET = "openai_completion"
MAX_N = 16
MAX_STOPS = 4
MAX_LOGIT_BIAS = 1024
# max_tokens when the request gives none (OpenAI's defaults; either is capped at what is left
# of the model's context after the prompt)
DEFAULT_MAX_TOKENS = {False: 16, True: 256}
MAX_TOKENS = 2**31 - 1  # beyond any context; keeps error messages short
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DISCONNECT_POLL_S = 0.25  # how often a whole (non-streaming) response checks for its client

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request error in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        message = message.encode("utf-8", "replace").decode()  # no lone surrogates echoed back
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


@dataclass
class Completion:
    """A validated request, as the inferlet's arguments plus what the response needs."""

    chat: bool
    arguments: list[str]  # all but --max-tokens, which `fit` adds
    n: int
    stream: bool
    logprobs: int | None
    include_usage: bool
    max_tokens: int | None = None  # None: the default, fitted to the context
    prompt: str = ""  # completions
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    grammar: tuple[str, str] | None = None  # (kind, source) the output is decoded under, checked by `fit`
    tools: Tools | None = None  # tools the model may call
    token_ids: list[tuple[str, int]] = field(default_factory=list)  # (parameter, id) for `fit` to check
    min_tokens: int = 0
    echo: bool = False  # completions: the prompt starts the text (scored too, with logprobs)


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    tokens: list[dict[str, Any]] = field(default_factory=list)  # per token, when logprobs


@dataclass
class Reply:
    """What the inferlet has sent so far: its choices, and (once it ends) how many prompt
    tokens the automatic prefix cache held (its KV copied, not computed)."""

    choices: list[Choice]
    cached_tokens: int = 0

    def apply(self, line: dict[str, Any]) -> None:
        if "usage" in line:  # the instance's usage, when it ended (see `launch`)
            self.cached_tokens = line["usage"].get("cached_tokens", 0)
            return
        choice = self.choices[line["index"]]
        choice.text += line.get("text", "")
        if "finish_reason" in line:
            choice.finish_reason = line["finish_reason"]
            choice.completion_tokens = line["completion_tokens"]
        if "logprob" in line:
            choice.tokens.append(line)

    def usage(self, prompt_tokens: int) -> dict[str, Any]:
        completion_tokens = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            check_user(state, request)
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
    async def serve():
        user, body = await read_request(state, request)
        completion = await validated(state, lambda: parse(body, chat, state.model or ""))
        events, prompt_tokens = await start(state, completion, user)
        meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": state.model}
        if completion.stream:
            return StreamingResponse(_sse(completion, meta, prompt_tokens, events), media_type="text/event-stream")
        reply = Reply([Choice() for _ in range(completion.n)])
        if not await collect(request, events, reply.apply):  # the client is gone: nobody reads this
            return ApiError(499, "the client closed the connection", kind="server_error").response()
        return JSONResponse(_whole(completion, meta, prompt_tokens, reply))

    return await answered(serve, "a /v1 request")


async def answered(serve: Callable[[], Awaitable[Response]], what: str) -> Response:
    """`serve()`'s response; an ApiError in OpenAI's error shape, any other failure as a
    logged 500 in that shape — never a plain-text error page."""
    try:
        return await serve()
    except ApiError as e:
        return e.response()
    except Exception as e:
        log.exception("serving %s failed", what)
        return ApiError(500, f"internal error ({type(e).__name__}); see the server log",
                        kind="server_error").response()


async def read_request(state: ServerState, request: Request) -> tuple[str, dict[str, Any]]:
    """The caller's user and the request's JSON object body, or ApiError."""
    user = check_user(state, request)
    body = decode_json(await read_body(request, state.config.max_request_bytes))
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return user, body


async def validated(state: ServerState, parse_body: Callable[[], Completion]) -> Completion:
    """`parse_body()`'s request, fitted to the model (`fit`). A bug in validation still
    answers in OpenAI's shape, as a 400."""
    try:
        completion = parse_body()
        await fit(state, completion)
        return completion
    except ApiError:
        raise
    except Exception as e:
        log.exception("validating a /v1 request failed")
        raise ApiError(400, f"the request could not be validated ({type(e).__name__})") from None


async def start(state: ServerState, completion: Completion, user: str) -> tuple[AsyncIterator[dict[str, Any]], int]:
    """Launches the inferlet: its lines after the first, and the prompt's token count."""
    events = launch(state, completion, user)
    try:
        first = await anext(events)  # {"prompt_tokens": n}, or the launch's failure
        return events, first["prompt_tokens"]
    except BaseException:
        await events.aclose()  # terminates the inferlet if it runs
        raise


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read in pieces up to `limit` bytes (server.max_request_bytes), never more:
    uvicorn itself sets no bound, so a client could make the server hold any amount."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body of {declared} bytes exceeds server.max_request_bytes = {limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, f"the request body exceeds server.max_request_bytes = {limit}")
    return bytes(body)


def decode_json(raw: bytes) -> Any:
    """The body as JSON, or ApiError: empty, not UTF-8, not JSON, NaN/Infinity, too deep."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of > 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {short(str(e))}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def short(value: Any, limit: int = 80) -> str:
    """`value` for an error message: repr'd, and cut to `limit` characters."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # e.g. an integer too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


async def collect(request: Request, events: AsyncIterator[dict[str, Any]],
                  apply: Callable[[dict[str, Any]], None]) -> bool:
    """Hands the inferlet's lines to `apply`; False if the client went away first (its
    inferlet is terminated then, as for a stream)."""
    async def collect() -> None:
        async for line in events:
            apply(line)

    task = asyncio.ensure_future(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()  # the inferlet's failure, if any
                return True
            if await request.is_disconnected():
                return False
    finally:
        if not task.done():
            task.cancel()  # unwinds _launch, which terminates the inferlet
            await asyncio.gather(task, return_exceptions=True)
        await events.aclose()


def check_user(state: ServerState, request: Request) -> str:
    """The caller's user (see session.authenticate), if it may be served now."""
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    user = authenticate(state.config.tokens, given)
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
        raise ApiError(404, f"the model {short(model)!r} does not exist; this server serves {served_model!r}",
                       "model", code="model_not_found")
    args: list[str] = []
    prompt, chat_messages, tools, echo = "", [], None, False
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty array", "messages")
        turns = []
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
                raise ApiError(400, f"messages[{i}] must be an object with a role", f"messages[{i}]")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                           for p in content):
                    raise ApiError(400, "only text content parts ({\"type\": \"text\", \"text\": string}) "
                                   "are supported", f"messages[{i}].content")
                content = "".join(p.get("text", "") for p in content)
            if not (isinstance(content, str) or (content is None and m.get("tool_calls") is not None)):
                raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
            turns.append({**m, "content": content})
        try:
            tools = parse_tools(body)
            chat_messages = render_messages(turns, tools)
        except ToolError as e:
            raise ApiError(400, str(e), e.param) from None
        for m in chat_messages:
            args += ["--message", m["role"], m["content"]]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs = _top_logprobs(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string (or an array of one string)", "prompt")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise ApiError(400, "echo must be a boolean", "echo")
        if echo:
            args.append("--echo")
        if body.get("tools") or body.get("tool_choice") is not None:
            raise ApiError(400, "tools are a chat parameter; /v1/completions takes none", "tools")
        args += ["--prompt", prompt]
        max_tokens = body.get("max_tokens")
        logprobs = _number(body, "logprobs", int, 0, 5)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, f"max_tokens must be a positive integer, got {short(max_tokens)}", "max_tokens")
        if max_tokens > MAX_TOKENS:
            raise ApiError(400, f"max_tokens must be at most {MAX_TOKENS}", "max_tokens")
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
    token_ids, min_tokens = _logit_rules(body, args)
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
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if not stream:
        args.append("--whole")  # the inferlet may then report its text once, at the end
    schema = response_schema(body.get("response_format"))
    grammar = None if schema is None else ("json-schema", schema)
    if tools is not None:
        if schema is not None:
            raise ApiError(400, "tools (unless tool_choice is \"none\") cannot be combined with a JSON "
                           "response_format", "response_format")
        grammar = ("lark", tools.grammar())
    if grammar is not None:
        if ignore_eos:
            raise ApiError(400, "ignore_eos cannot be combined with a JSON response_format or tools (the "
                           "grammar decides where the output ends)", "ignore_eos")
        args += ["--grammar", *grammar]
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:  # JSON's "\ud800" escapes can make them
            raise ApiError(400, "text must not contain unpaired UTF-16 surrogates") from None
    return Completion(chat, args, n, stream, logprobs, include_usage, max_tokens, prompt, chat_messages, grammar,
                      tools, token_ids, min_tokens, echo)


def _logit_rules(body: dict[str, Any], args: list[str]) -> tuple[list[tuple[str, int]], int]:
    """OpenAI's `logit_bias` and penalties, vLLM's `min_tokens` and `stop_token_ids`, as
    the inferlet's flags (logit rules the host applies before every draw). Returns the
    token ids named, with the parameter naming each, for `fit` to check against the
    vocabulary; and min_tokens, for `fit` to check against max_tokens."""
    named: list[tuple[str, int]] = []
    for name, flag in (("presence_penalty", "--presence-penalty"), ("frequency_penalty", "--frequency-penalty")):
        value = _number(body, name, float, -2.0, 2.0)
        if value:
            args += [flag, repr(value)]
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ApiError(400, f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids to biases",
                           "logit_bias")
        for key, value in bias.items():
            if not re.fullmatch(r"[0-9]{1,9}", key):
                raise ApiError(400, f"logit_bias keys must be token ids, got {short(key)}", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias values must be numbers between -100 and 100, got {short(value)}",
                               "logit_bias")
            named.append(("logit_bias", int(key)))
            args += ["--logit-bias", str(int(key)), repr(float(value))]
    min_tokens = _number(body, "min_tokens", int, 0, MAX_TOKENS)
    if min_tokens:
        args += ["--min-tokens", str(min_tokens)]
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not (isinstance(stop_ids, list) and len(stop_ids) <= MAX_STOPS * 4
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)):
            raise ApiError(400, f"stop_token_ids must be an array of at most {MAX_STOPS * 4} token ids",
                           "stop_token_ids")
        for token in stop_ids:
            named.append(("stop_token_ids", token))
            args += ["--stop-token", str(token)]
    return named, min_tokens or 0


def response_schema(fmt: Any) -> str | None:
    """`response_format` as the JSON schema the output is decoded under (text), or None for
    free text. `json_object` is any JSON object; `json_schema` is its `schema`, enforced
    whether `strict` is set or not (decoding under the grammar cannot stray from it).

    Unless the schema says otherwise (llguidance's `x-guidance` key), the JSON is laid out
    on one line with `, ` and `: ` between items: llguidance allows any whitespace by
    default, and a small model under a mask can then emit newlines until max_tokens."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError(400, "response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object", "x-guidance": COMPACT_JSON})
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type must be text, json_object or json_schema, got {short(kind)}",
                       "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object with a name and a schema",
                       "response_format.json_schema")
    name = spec.get("name")
    if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)):
        raise ApiError(400, "response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                       "response_format.json_schema.name")
    if not isinstance(spec.get("strict", False), bool):
        raise ApiError(400, "response_format.json_schema.strict must be a boolean",
                       "response_format.json_schema.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                       "response_format.json_schema.schema")
    return json.dumps(schema if "x-guidance" in schema else {**schema, "x-guidance": COMPACT_JSON})


async def fit(state: ServerState, completion: Completion) -> None:
    """Counts the prompt's tokens as the inferlet will (the chat template applied), checks
    that prompt + max_tokens fits the model's context and the whole KV pool, and adds
    `--max-tokens` (the default, capped at the rest of the context, when none was given).
    Errors: 400 context_length_exceeded."""
    controller = state.runtime.controller
    hs, tokenizer = controller.hs, controller.tokenizer
    context = hs.context_length or 2**62  # 0: the backend did not say
    what = "messages" if completion.chat else "prompt"
    reduce = f"Please reduce the length of the {what} or completion."
    too_long = (f"This model's maximum context length is {context} tokens. However, ")

    def count() -> int:
        if completion.chat:
            try:
                text = tokenizer.apply_chat_template(completion.messages, True)
            except Exception as e:  # the template's own checks (roles, order) are the caller's input
                raise ApiError(400, f"the chat template rejected the messages: {short(str(e), 200)}",
                               "messages") from None
        else:
            text = completion.prompt
        size = len(text.encode("utf-8"))
        if size > 4 * context * tokenizer.max_token_bytes:  # surely too long: spare the tokenizer
            raise ApiError(400, too_long + f"your {what} {'are' if completion.chat else 'is'} {size} bytes "
                           f"long, far more than that many tokens. {reduce}", what, code="context_length_exceeded")
        return len(tokenizer.encode(text))

    prompt_tokens = await asyncio.to_thread(count)
    max_tokens = completion.max_tokens
    if max_tokens is None:
        if prompt_tokens >= context:
            raise ApiError(400, too_long + f"your {what} resulted in {prompt_tokens} tokens, leaving no room "
                           f"for the completion. Please reduce the length of the {what}.", what,
                           code="context_length_exceeded")
        max_tokens = min(DEFAULT_MAX_TOKENS[completion.chat], context - prompt_tokens)
    elif prompt_tokens + max_tokens > context:
        raise ApiError(400, too_long + f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in "
                       f"the {what}, {max_tokens} in the completion). {reduce}", what,
                       code="context_length_exceeded")
    pages = kv_pages_needed(prompt_tokens, max_tokens, completion.n, hs.page_size)
    if pages > hs.num_kv_pages:
        raise ApiError(400, f"This request needs {pages} KV-cache pages ({prompt_tokens} tokens in the {what}, "
                       f"{max_tokens} in each of {completion.n} completion(s), {hs.page_size} tokens a page), "
                       f"more than the server's whole KV pool (backend.num_kv_pages = {hs.num_kv_pages}). "
                       f"Please reduce max_tokens, n or the length of the {what}.", "max_tokens",
                       code="context_length_exceeded")
    if completion.echo and completion.logprobs is not None and prompt_tokens > hs.max_batch_tokens:
        raise ApiError(400, f"echo with logprobs scores the prompt in one pass: at most {hs.max_batch_tokens} "
                       f"tokens (backend.max_batch_tokens), the prompt has {prompt_tokens}", "echo")
    for param, token in completion.token_ids:
        if token >= hs.vocab_size:
            raise ApiError(400, f"{param}: token id {token} is not below the vocabulary size {hs.vocab_size}", param)
    if completion.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({completion.min_tokens}) must be at most max_tokens ({max_tokens})",
                       "min_tokens")
    completion.max_tokens = max_tokens
    completion.arguments += ["--max-tokens", str(max_tokens)]
    if completion.grammar is not None:  # the grammar engine's verdict now, not the inferlet's failure later
        await asyncio.to_thread(_check_grammar, controller.grammars, completion)


def _check_grammar(grammars: Any, completion: Completion) -> None:
    """A grammar llguidance refuses is a 400 naming what made it: the response format's
    schema, or the tool whose parameters it cannot enforce."""
    kind, source = completion.grammar
    try:
        grammars.compile(kind, source)
        return
    except HostError as e:
        reason = e.message.removeprefix(f"{kind} grammar: ")
    if completion.tools is None:
        raise ApiError(400, f"response_format: the JSON schema cannot be enforced: {short(reason, 400)}",
                       "response_format.json_schema.schema")
    for i, name in enumerate(completion.tools.functions):
        try:
            grammars.compile("json-schema", completion.tools.schema_of(name))
        except HostError as e:
            raise ApiError(400, f"tools[{i}] ({name}): its parameters cannot be enforced: "
                           f"{short(e.message.removeprefix('json-schema grammar: '), 400)}",
                           f"tools[{i}].function.parameters") from None
    raise ApiError(400, f"the tools cannot be enforced together: {short(reason, 400)}", "tools")


def kv_pages_needed(prompt_tokens: int, max_tokens: int, n: int, page_size: int) -> int:
    """The KV pages openai_completion holds at most: the prompt's pages (all but its last
    token are prefilled), shared by the n choices, plus each choice's own pages (its copy of
    the shared partial last page, then its tokens; the last sampled token is never run)."""
    prefilled, total = prompt_tokens - 1, prompt_tokens + max_tokens - 1
    if n == 1:
        return math.ceil(total / page_size)
    own = math.ceil(total / page_size) - prefilled // page_size
    return math.ceil(prefilled / page_size) + n * own


def _number(body: dict[str, Any], name: str, kind: type, low: float, high: float) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {short(value)}",
                       name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low:g} and {high:g}, got {short(value)}", name)
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


async def launch(state: ServerState, completion: Completion, user: str) -> AsyncIterator[dict[str, Any]]:
    """The inferlet's JSON lines; raises ApiError if it cannot start or fails."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, str, dict | None]] = asyncio.Queue()

    def on_event(instance_id: str, kind: str, data: str, usage: dict | None = None) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (kind, data, usage))

    runtime = state.runtime
    try:
        info = runtime.launch(INFERLET, completion.arguments, on_event, user)
    except UnknownProgram:
        raise ApiError(503, f"the built-in inferlet {INFERLET} is unavailable (see the server log)",
                       kind="server_error") from None
    except LaunchRefused as e:
        raise ApiError(503, f"the server is busy: {e}", kind="server_error") from None
    finished = False
    try:
        while True:
            kind, data, usage = await queue.get()
            if kind == "terminated":
                finished = True
                if data != "finished":
                    raise ApiError(500, f"the completion failed: {data}", kind="server_error")
                yield {"usage": usage or {}}  # what the instance consumed (Reply.apply)
                return
            yield json.loads(data)
    finally:
        if not finished:  # the client went away (or we failed): stop the inferlet
            try:
                runtime.terminate(info.id, "the HTTP client disconnected")
            except UnknownInstance:
                pass


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
            "top_logprobs": [None if t["top"] is None else dict(t["top"]) for t in tokens], "text_offset": offsets}


def _whole(completion: Completion, meta: dict[str, Any], prompt_tokens: int, reply: Reply) -> dict[str, Any]:
    out = []
    for i, c in enumerate(reply.choices):
        body: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason,
                                "logprobs": _logprobs(completion, c.tokens)}
        if completion.tools is not None:
            parser = ToolCallParser(completion.tools)
            parser.feed(c.text)
            parser.finish()
            body["message"], body["finish_reason"] = parser.message(), parser.finish_reason(c.finish_reason)
        elif completion.chat:
            body["message"] = {"role": "assistant", "content": c.text}
        else:
            body["text"] = c.text
        out.append(body)
    return {**meta, "object": "chat.completion" if completion.chat else "text_completion",
            "choices": out, "usage": reply.usage(prompt_tokens)}


async def _sse(completion: Completion, meta: dict[str, Any], prompt_tokens: int,
               events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, then `[DONE]`."""
    kind = "chat.completion.chunk" if completion.chat else "text_completion"
    reply = Reply([Choice() for _ in range(completion.n)])
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
    parsers = [ToolCallParser(completion.tools) for _ in range(completion.n)] if completion.tools else None
    try:
        async for line in events:
            reply.apply(line)
            if "usage" in line:
                continue
            i = line["index"]
            if "finish_reason" in line:
                finish = line["finish_reason"]
                if parsers:
                    for delta in parsers[i].finish():
                        yield chunk(i, delta, None)
                    finish = parsers[i].finish_reason(finish)
                yield chunk(i, {}, finish)
                continue
            text = line.get("text", "")
            logprobs = _logprobs(completion, [line], positions[i]) if "logprob" in line else None
            positions[i] += len(text)
            if parsers is None:
                yield chunk(i, {"content": text}, None, logprobs)
                continue
            deltas = parsers[i].feed(text) or ([{}] if logprobs else [])
            for k, delta in enumerate(deltas):  # the token's log-probabilities go with its first delta
                yield chunk(i, delta, None, logprobs if k == 0 else None)
    except ApiError as e:
        yield "data: " + json.dumps({"error": {"message": e.message, "type": e.kind}}) + "\n\n"
        return
    finally:
        await events.aclose()  # a client that went away: its inferlet is terminated now
    if completion.include_usage:
        yield "data: " + json.dumps({**meta, "object": kind, "choices": [],
                                     "usage": reply.usage(prompt_tokens)}) + "\n\n"
    yield "data: [DONE]\n\n"
