"""Tool calling on `/v1/chat/completions`: `tools`, `tool_choice`, `parallel_tool_calls`,
and the `tool_calls` / `role: "tool"` messages of a conversation that used them.

The model writes a call in the Hermes format that open models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the endpoint turns it into OpenAI's `tool_calls`. Nothing is left to the model's good
will: the output is decoded under a Lark grammar (llguidance, on the host) in which each
tool's `arguments` is JSON valid against that tool's `parameters`, laid out compactly, so
every call parses and names a tool that exists. With `tool_choice` `"auto"` the grammar
allows free text *or* calls (text must not begin with `<tool_call>`); `"required"` allows
only calls, a named function exactly one call to it; `parallel_tool_calls: false` allows one.

The tools reach the model as text in the system turn (the default model's chat template
knows nothing of tools); earlier calls as the Hermes block in the assistant's turn, their
results as `<tool_response>` blocks in a user turn, as Qwen2.5's and Hermes' templates do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>\n"
HEADER = re.compile(r'<tool_call>\n\{"name": "([A-Za-z0-9_-]+)", "arguments": ')
CLOSE = "}\n</tool_call>"  # the `}` closes the call object, after the arguments' own
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, return a JSON object with its name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


class ToolError(ValueError):
    """A bad `tools`, `tool_choice` or tool message: the message and the parameter it names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    """The request's tools, as the grammar and the prompt need them."""

    functions: dict[str, dict[str, Any]]  # name -> the OpenAI `function` object
    choice: str  # "auto", "required", or a function's name
    parallel: bool = True

    def grammar(self) -> str:
        """The Lark grammar every draw is masked by (llguidance's dialect: `%json` embeds a
        JSON schema, `&`/`~` intersect and negate lexemes)."""
        names = list(self.functions) if self.choice in ("auto", "required") else [self.choice]
        rules = []
        for i, name in enumerate(names):
            schema = parameters(self.functions[name])
            if "x-guidance" not in schema:
                schema = {**schema, "x-guidance": COMPACT_JSON}
            rules.append(f'call_{i}: "<tool_call>\\n{{\\"name\\": \\"{name}\\", \\"arguments\\": " args_{i} '
                         f'"}}\\n</tool_call>"\nargs_{i}: %json {json.dumps(schema)}')
        calls = 'call ("\\n" call)*' if self.parallel and self.choice in ("auto", "required") else "call"
        start = "start: calls | TEXT" if self.choice == "auto" else "start: calls"
        return "\n".join([start, f"calls: {calls}", "call: " + " | ".join(f"call_{i}" for i in range(len(names))),
                          r"TEXT: /(.|\n)*/ & ~/<tool_call>(.|\n)*/", *rules]) + "\n"

    def description(self) -> str:
        """The system-turn text that tells the model its tools."""
        listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in self.functions.values())
        return INSTRUCTIONS.format(tools=listed)

    def schema_of(self, name: str) -> str:
        return json.dumps(parameters(self.functions[name]))


def parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters`; none means it takes no arguments (OpenAI's reading)."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` checked; None when no call may be
    made (no tools, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ToolError("tools must be an array of function tools", "tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f'{where} must be {{"type": "function", "function": {{...}}}} (only function '
                            "tools are supported)", where)
        function = tool["function"]
        name = function.get("name")
        if not (isinstance(name, str) and NAME.fullmatch(name)):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ or -", f"{where}.function.name")
        if name in functions:
            raise ToolError(f"tools has two functions named {name!r}; names must be unique", f"{where}.function.name")
        if not isinstance(function.get("description", ""), str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object",
                            f"{where}.function.parameters")
        if not isinstance(function.get("strict", False), bool):
            raise ToolError(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
        functions[name] = {k: function[k] for k in ("name", "description", "parameters") if k in function}
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        if not (isinstance(named, dict) and isinstance(named.get("name"), str)):
            raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', "tool_choice")
        if named["name"] not in functions:
            raise ToolError(f"tool_choice names the function {named['name'][:80]!r}, which is not in tools",
                            "tool_choice")
        choice = named["name"]
    elif choice not in ("none", "auto", "required"):
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                        '"function": {"name": ...}}', "tool_choice")
    elif choice != "none" and not functions:
        raise ToolError(f'tool_choice "{choice}" needs tools', "tool_choice")
    return None if choice == "none" else Tools(functions, choice, parallel)


def render_messages(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, str]]:
    """The conversation as role/content turns for the model's chat template: the tools in
    the system turn, an assistant's `tool_calls` as Hermes blocks, `tool` results as
    `<tool_response>` blocks in a user turn (consecutive results share one). Each `tool`
    message must answer a call made earlier and not yet answered."""
    turns: list[dict[str, str]] = []
    pending: set[str] = set()  # call ids made and not yet answered
    results = False  # whether the last turn holds tool results
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise ToolError(f"messages[{i}].tool_calls must be an array", f"messages[{i}].tool_calls")
            blocks = []
            for j, call in enumerate(calls):
                call_id, name, arguments = _call(call, f"messages[{i}].tool_calls[{j}]")
                pending.add(call_id)
                blocks.append(call_text(name, arguments))
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in pending:
                raise ToolError(f"messages[{i}] is a tool result for {str(call_id)[:80]!r}, which no earlier "
                                "assistant message's tool_calls made (or which was already answered)",
                                f"messages[{i}].tool_call_id")
            pending.discard(call_id)
            if content is None:
                raise ToolError(f"messages[{i}].content must be a string", f"messages[{i}].content")
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block})
            results = True
            continue
        elif content is None:
            raise ToolError(f"messages[{i}].content must be a string", f"messages[{i}].content")
        turns.append({"role": role, "content": content})
        results = False
    if tools is not None:
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] += "\n\n" + tools.description()
        else:
            turns.insert(0, {"role": "system", "content": tools.description()})
    return turns


def _call(call: Any, where: str) -> tuple[str, str, Any]:
    """An earlier assistant message's tool call: (id, name, arguments as JSON)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(call, dict) and isinstance(call.get("id"), str) and isinstance(function, dict)
            and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str)):
        raise ToolError(f'{where} must be {{"id": string, "type": "function", "function": {{"name": string, '
                        '"arguments": string}}}}', where)
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        raise ToolError(f"{where}.function.arguments must be a JSON string", f"{where}.function.arguments") from None
    return call["id"], function["name"], arguments


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (and as the grammar lays it out)."""
    return f'{OPEN}{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}{CLOSE}'


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallParser:
    """One choice's output, read as it grows: OpenAI deltas (text, or tool-call headers and
    argument pieces), holding back only what could still turn out to be a call's framing.
    Each piece of text is scanned once: calls follow one another, so the scan resumes where
    the open call's arguments (or the next header) begin."""

    tools: Tools
    text: str = ""
    mode: str = "undecided"  # "text" or "calls" once the output shows which
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool calls so far
    arguments_at: int | None = None  # where the open call's arguments begin in `text`
    next_at: int = 0  # where the next call's header may begin

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas `piece` completes (chat-completion `delta` objects)."""
        self.text += piece
        if self.mode == "undecided":
            if self.tools.choice == "auto" and not self.text.startswith(OPEN) and not OPEN.startswith(self.text):
                self.mode = "text"
                return [{"content": self.text}]  # what was held back, and this piece
            if not (self.text.startswith(OPEN) or self.tools.choice != "auto"):
                return []
            self.mode = "calls"
        if self.mode == "text":
            return [{"content": piece}] if piece else []
        return self._call_deltas()

    def _call_deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.arguments_at is None:
                header = HEADER.search(self.text, self.next_at)
                if header is None:
                    return out
                call = {"id": new_call_id(), "type": "function", "function": {"name": header.group(1), "arguments": ""}}
                self.calls.append(call)
                out.append({"tool_calls": [{"index": len(self.calls) - 1, **call,
                                            "function": {"name": header.group(1), "arguments": ""}}]})
                self.arguments_at = header.end()
            function = self.calls[-1]["function"]
            end = self.text.find(CLOSE, self.arguments_at)
            arguments = self.text[self.arguments_at:] if end < 0 else self.text[self.arguments_at:end]
            ready = len(arguments) if end >= 0 else len(arguments) - _held(arguments)
            if ready > len(function["arguments"]):
                piece = arguments[len(function["arguments"]):ready]
                function["arguments"] += piece
                out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
            if end < 0:
                return out
            self.arguments_at, self.next_at = None, end + len(CLOSE)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left once the output is complete: a short answer that only looked
        like the start of a call is text after all."""
        if self.mode == "undecided":
            self.mode = "text" if self.tools.choice == "auto" else "calls"
            return ([{"content": self.text}] if self.text else []) if self.mode == "text" else self._call_deltas()
        return []

    def message(self) -> dict[str, Any]:
        """The whole choice's assistant message (after `finish`)."""
        if self.mode != "calls":
            return {"role": "assistant", "content": self.text}
        return {"role": "assistant", "content": None, "tool_calls": self.calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the output ended after its calls."""
        return "tool_calls" if self.calls and reason == "stop" else reason


def _held(arguments: str) -> int:
    """How many trailing characters could be the start of CLOSE (not arguments after all)."""
    for k in range(min(len(CLOSE), len(arguments)), 0, -1):
        if arguments.endswith(CLOSE[:k]):
            return k
    return 0
