"""One `/v1/responses` response's output items, built from the inferlet's text as it
grows, and the Responses streaming events each step makes."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pie.server.openai import ApiError, Choice, Completion, Reply
from pie.server.openai_tools import ToolCallParser
from pie.server.response_store import ResponseStore, Stored

if TYPE_CHECKING:
    from pie.server.openai_responses import ResponseRequest


@dataclass
class ResponseOutput:
    """One response's output items, built from the inferlet's text as it grows; each step
    also yields the Responses streaming events it makes."""

    spec: ResponseRequest
    completion: Completion
    prompt_tokens: int
    model: str | None
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    items: list[dict[str, Any]] = field(default_factory=list)
    parser: ToolCallParser | None = None
    response: dict[str, Any] = field(default_factory=dict)  # the whole response, once `finish`ed

    def __post_init__(self) -> None:
        if self.completion.tools is not None:
            self.parser = ToolCallParser(self.completion.tools)

    def object(self, status: str) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.items, "error": None, "incomplete_details": None,
                "usage": None, "user": None, **self.spec.echo}

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas = self.parser.feed(text) if self.parser else ([{"content": text}] if text else [])
        return [event for delta in deltas for event in self._delta(delta)]

    def _delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if "content" in delta:
            item = self.items[-1] if self.items and self.items[-1]["type"] == "message" else None
            if item is None:
                events += self._close()
                item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "in_progress",
                        "role": "assistant", "content": []}
                self.items.append(item)
                part = {"type": "output_text", "text": "", "annotations": []}
                events += [self._event("response.output_item.added", item=dict(item, content=[])),
                           self._event("response.content_part.added", item_id=item["id"], content_index=0,
                                       part=dict(part))]
                item["content"].append(part)
            item["content"][0]["text"] += delta["content"]
            events.append(self._event("response.output_text.delta", item_id=item["id"], content_index=0,
                                      delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                events += self._close()
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                self.items.append(item)
                events.append(self._event("response.output_item.added", item=dict(item)))
            elif call["function"]["arguments"]:
                item = self.items[-1]
                item["arguments"] += call["function"]["arguments"]
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          delta=call["function"]["arguments"]))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The done events of the last item, if it is still open."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item = self.items[-1]
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], content_index=0,
                                  text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"], content_index=0, part=part)]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", item=item)]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        index = {} if kind.startswith("response.") and kind.count(".") == 1 else {"output_index": len(self.items) - 1}
        return {"type": kind, **index, **fields}

    def finish(self, reply: Reply) -> list[dict[str, Any]]:
        """Completes `response` (or marks it incomplete at max_output_tokens); the events
        that close the last item."""
        choice = reply.choices[0]
        events = [event for delta in (self.parser.finish() if self.parser else []) for event in self._delta(delta)]
        events += self._close()
        complete = choice.finish_reason != "length"
        self.response = self.object("completed" if complete else "incomplete")
        if not complete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = {
            "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": reply.cached_tokens},
            "output_tokens": choice.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + choice.completion_tokens}
        return events

    def save(self, store: ResponseStore, user: str) -> None:
        """Stores the response and the conversation it ends (if `store`)."""
        if not self.spec.store:
            return
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        said = ({"role": "assistant", "content": text or None, "tool_calls": calls} if calls
                else {"role": "assistant", "content": text})
        store.put(user, self.id, Stored(json.loads(json.dumps(self.response)), self.spec.conversation + [said]))


async def stream_events(output: ResponseOutput, events: AsyncIterator[dict[str, Any]], store: ResponseStore,
                        user: str) -> AsyncIterator[str]:
    """Responses' server-sent events: created, in_progress, the items' events, completed."""
    sequence = 0

    def sse(event: dict[str, Any]) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': sequence - 1})}\n\n"

    yield sse({"type": "response.created", "response": output.object("in_progress")})
    yield sse({"type": "response.in_progress", "response": output.object("in_progress")})
    reply = Reply([Choice()])
    try:
        async for line in events:
            reply.apply(line)
            if "text" in line:
                for event in output.feed(line["text"]):
                    yield sse(event)
    except ApiError as e:
        failed = output.object("failed")
        failed["error"] = {"code": "server_error", "message": e.message}
        yield sse({"type": "response.failed", "response": failed})
        return
    finally:
        await events.aclose()
    for event in output.finish(reply):
        yield sse(event)
    output.save(store, user)
    response = output.response
    yield sse({"type": "response.completed" if response["status"] == "completed" else "response.incomplete",
               "response": response})
