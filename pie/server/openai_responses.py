"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is a chat completion in other clothes, so it is served the same way:
translated into a chat-completions body (`to_chat`), checked by the same `parse` and `fit`,
run by the same built-in `openai_completion` inferlet, its output read by the same
tool-call parser — and shaped as Responses' output items and streaming events (`response_output.py`).

`previous_response_id` continues a stored conversation: the server keeps each stored
response's conversation (its input, earlier turns and its output, in chat form) per user,
and a request naming it gets that conversation before its own input. The model's KV is not
kept by this module: the re-sent conversation starts with the same tokens as the earlier
prompt and output, so the automatic prefix cache (`control.prefix_cache`) copies their KV
pages instead of prefilling them again (`usage.input_tokens_details.cached_tokens` says how
many tokens it supplied). As in OpenAI's API, `instructions` are not carried over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pie.server.openai import (ApiError, Choice, Reply, answered, check_user, collect, parse, read_request, short,
                               start, validated)
from pie.server.response_output import ResponseOutput, stream_events
from pie.server.response_store import ResponseStore

# Parameters of Responses we do not serve: a 400 naming them unless neutral.
UNSUPPORTED = {"background": (None, False), "reasoning": (None,), "include": (None, []),
               "truncation": (None, "disabled"), "conversation": (None,), "prompt": (None,)}
# A chat-completions parameter in an error, as the Responses request names it.
PARAMS = [("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
          ("max_tokens", "max_output_tokens"), ("messages", "input"), (".function.", ".")]


@dataclass
class ResponseRequest:
    """A Responses request: the chat-completions body that serves it, the conversation to
    store, and what the response object echoes."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    echo: dict[str, Any]
    store: bool
    stream: bool


def add_responses_routes(app: FastAPI, state: Any) -> None:
    @app.post("/v1/responses")
    async def create(request: Request):
        return await _serve(state, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        async def serve():
            stored = state.responses.get(check_user(state, request), response_id)
            if stored is None:
                raise _not_found(response_id)
            return JSONResponse(stored.response)

        return await answered(serve, "GET /v1/responses")

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        async def serve():
            if not state.responses.delete(check_user(state, request), response_id):
                raise _not_found(response_id)
            return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

        return await answered(serve, "DELETE /v1/responses")


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {short(response_id)!r} not found.", code="response_not_found")


async def _serve(state: Any, request: Request):
    async def serve():
        user, body = await read_request(state, request)
        spec = to_chat(body, state.responses, user)
        try:
            completion = await validated(state, lambda: parse(spec.chat, True, state.model or ""))
        except ApiError as e:
            raise _renamed(e) from None
        events, prompt_tokens = await start(state, completion, user)
        output = ResponseOutput(spec, completion, prompt_tokens, state.model)
        if spec.stream:
            return StreamingResponse(stream_events(output, events, state.responses, user), media_type="text/event-stream")
        reply = Reply([Choice()])
        if not await collect(request, events, reply.apply):
            return ApiError(499, "the client closed the connection", kind="server_error").response()
        output.feed(reply.choices[0].text)
        output.finish(reply)
        output.save(state.responses, user)
        return JSONResponse(output.response)

    return await answered(serve, "/v1/responses")


def _renamed(e: ApiError) -> ApiError:
    """A chat-completions error with its parameter named as the Responses request names it."""
    param = e.param
    for old, new in PARAMS:
        param = param.replace(old, new) if param else param
    e.param = param
    return e


def to_chat(body: dict[str, Any], store: ResponseStore, user: str) -> ResponseRequest:
    """The Responses request as a chat-completions body (checked later by `parse`)."""
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in neutral:
            raise ApiError(400, f"{name} is not supported", name)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(user, previous) if isinstance(previous, str) else None
        if stored is None:
            raise ApiError(400, f"Previous response with id {short(previous)!r} not found.", "previous_response_id")
        history = [dict(m) for m in stored.conversation]
    conversation = history + _input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", "instructions")
    chat: dict[str, Any] = {"model": body.get("model"),
                            "messages": ([{"role": "system", "content": instructions}] if instructions else [])
                            + conversation}
    for name in ("temperature", "top_p", "parallel_tool_calls", "stream"):
        if name in body:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(fmt, dict):
            raise ApiError(400, 'text must be {"format": {"type": ...}}', "text")
        if fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        chat["response_format"] = fmt
    store_it = body.get("store", True)
    metadata = body.get("metadata") or {}
    if not isinstance(store_it, bool):
        raise ApiError(400, "store must be a boolean", "store")
    if not (isinstance(metadata, dict) and len(metadata) <= 16
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ApiError(400, "metadata must be an object of at most 16 string values", "metadata")
    echo = {"instructions": instructions, "metadata": metadata, "previous_response_id": previous,
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": text or {"format": {"type": "text"}}, "store": store_it}
    return ResponseRequest(chat, conversation, echo, store_it, body.get("stream") is True)


def _input_messages(items: Any) -> list[dict[str, Any]]:
    """`input` (a string, or message, function_call and function_call_output items) as
    chat messages; consecutive function calls become one assistant message's tool_calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "input must be a string or a non-empty array of input items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"input[{i}].role must be user, assistant, system or developer", f"input[{i}].role")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ApiError(400, f"input[{i}] must have string call_id, name and arguments", f"input[{i}]")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not (isinstance(item.get("call_id"), str) and isinstance(item.get("output"), str)):
                raise ApiError(400, f"input[{i}] must have a string call_id and output", f"input[{i}]")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            raise ApiError(400, f"input[{i}].type must be message, function_call or function_call_output",
                           f"input[{i}].type")
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"input[{i}].content must be a string or input_text / output_text parts",
                   f"input[{i}].content")


def _tools(tools: Any) -> Any:
    """Responses' flat function tools as chat's nested ones (checked by parse_tools)."""
    if not isinstance(tools, list):
        return tools
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type") == "function"):
            raise ApiError(400, f"tools[{i}]: only function tools are supported", f"tools[{i}].type")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out
