"""Semantic variables (Parrot): an application's LLM calls as prompt templates with named
slots, run inside one inferlet. The Rust SDK's `inferlet::semvar`, in Python.

```python
pipeline = Pipeline(Model.default())
chain = Template.parse("Summary: {{input:summary}} Next: {{input:chunk}} New summary:{{output:summary}}")
summary = pipeline.input("summary", "")
for chunk in chunks:
    (summary,) = pipeline.call(chain, {"summary": summary, "chunk": pipeline.input("chunk", chunk)})
print(pipeline.get(summary, "latency"))
```

`call` only declares; `get` runs what its variable needs, in waves: every call whose inputs
have values starts its generation (each on its own queue, so their steps batch), then the
wave's results are collected. `get(var, objective)` first marks every call `var` still
waits on with the objective. Calls of templates with the same static prefix (the text
before the first slot) fork one context that holds it, prefilled once; a call's prompt is
still tokenized whole, so its output is what one request of the same text gives. A malformed
template or a binding missing, extra or of another pipeline raises `ValueError` before any
model call; a call that fails fails its outputs with the cause, and the calls reading them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from inferlet.context import Context
from inferlet.errors import Error
from inferlet.model import Model, Queue
from inferlet.sampling import Sampler, Stop

_SLOT = re.compile(r"\{\{(.*?)\}\}", re.S)
_NAME = re.compile(r"\w+", re.A)


@dataclass(frozen=True)
class Template:
    """Text parts and slots: ("text", str), ("input", name) or ("output", name)."""

    parts: tuple[tuple[str, str], ...]

    @staticmethod
    def parse(source: str) -> Template:
        """A template from text with `{{input:name}}` and `{{output:name}}` slots."""
        parts: list[tuple[str, str]] = []
        outputs: set[str] = set()
        at = 0
        for match in _SLOT.finditer(source):
            if match.start() > at:
                parts.append(("text", source[at:match.start()]))
            kind, colon, name = match.group(1).partition(":")
            name = name.strip()
            where = f"at byte {match.start()}"
            if not colon:
                raise ValueError(f"template: slot {match.group(0)} {where} must be {{{{input:NAME}}}} or {{{{output:NAME}}}}")
            if not _NAME.fullmatch(name):
                raise ValueError(f"template: slot name {name!r} {where} must be letters, digits and _")
            kind = kind.strip()
            if kind not in ("input", "output"):
                raise ValueError(f"template: unknown slot kind {kind!r} {where} (input or output)")
            if kind == "output":
                if name in outputs:
                    raise ValueError(f"template: output {name!r} appears twice")
                outputs.add(name)
            parts.append((kind, name))
            at = match.end()
        if "{{" in source[at:]:
            raise ValueError(f'template: the slot at byte {source.index("{{", at)} is not closed with "}}}}"')
        if at < len(source):
            parts.append(("text", source[at:]))
        if not outputs:
            raise ValueError("template: no {{output:NAME}} slot, so a call would generate nothing")
        return Template(tuple(parts))

    @staticmethod
    def chat(queue: Queue, user: str, output: str) -> Template:
        """`user` (slots allowed) as the user's turn of the model's chat format, the reply
        generated into output `output`; the format's opening is shared static prefix."""
        from inferlet.io import chat

        rendered = queue.apply_chat_template([chat("user", user)], True)
        return Template.parse(rendered + "{{output:" + output + "}}")

    def inputs(self) -> list[str]:
        """The names of its input slots, in order."""
        return list(dict.fromkeys(name for kind, name in self.parts if kind == "input"))

    def outputs(self) -> list[str]:
        """The names of its output slots, in order."""
        return [name for kind, name in self.parts if kind == "output"]

    def static_prefix(self) -> str:
        """The text before its first slot (the same for every call: prefilled once)."""
        return self.parts[0][1] if self.parts and self.parts[0][0] == "text" else ""


@dataclass(eq=False)
class Var:
    """A semantic variable: `value` once produced (None before), or `error` if it never will."""

    name: str
    pipeline: Pipeline
    value: str | None = None
    error: str | None = None
    producer: _Call | None = None


@dataclass(eq=False)
class _Call:
    template: Template
    inputs: dict[str, Var]
    outputs: list[Var]
    max_tokens: int
    sampler: Sampler
    queue: Queue | None  # let go when the call finishes
    started: bool = False
    generation: object = None
    context: Context | None = None
    rest: list[tuple[str, str]] = field(default_factory=list)


class Pipeline:
    """An application's LLM calls as templates over semantic variables, run in waves."""
    def __init__(self, model: Model):
        self.model = model
        self._prefixes: dict[str, Context] = {}
        self._calls: list[_Call] = []

    def input(self, name: str, value: str) -> Var:
        """A variable with a value now."""
        return Var(name, self, value=value)

    def call(self, template: Template, bindings: dict[str, Var], max_tokens: int = 32,
             sampler: Sampler = Sampler()) -> list[Var]:
        """Declares a call of `template` with its inputs bound; its outputs, in
        `template.outputs()` order (they get values when `get` runs the call)."""
        for name, var in bindings.items():
            if var.pipeline is not self:
                raise ValueError(f"binding {name!r}: variable {var.name!r} belongs to another pipeline")
            if name not in template.inputs():
                raise ValueError(f"binding {name!r} names no input slot of the template (inputs: {template.inputs()})")
        missing = [n for n in template.inputs() if n not in bindings]
        if missing:
            raise ValueError(f"the template reads {{{{input:{missing[0]}}}}}, which no binding gives")
        call = _Call(template, dict(bindings), [], max_tokens, sampler, self.model.create_queue())
        call.outputs = [Var(name, self, producer=call) for name in template.outputs()]
        self._calls.append(call)
        return list(call.outputs)

    def get(self, var: Var, objective: str = "latency") -> str:
        """`var`'s value, running every call it waits on (marked with `objective` first);
        raises `Error` with the cause if it cannot be produced."""
        needed = self._needed(var)
        for call in needed:
            call.queue.set_objective(objective)  # (not started yet: its queue is open)
        while var.value is None and var.error is None:
            wave = [c for c in needed if not c.started and all(
                v.value is not None or v.error is not None for v in c.inputs.values())]
            if not wave:
                raise Error("invalid-argument", f"variable {var.name!r} can never be produced")
            for call in wave:
                self._start(call)
            for call in wave:
                self._finish(call)
        if var.error is not None:
            raise Error("inference-failed", var.error)
        return var.value

    def _needed(self, var: Var) -> list[_Call]:
        """The calls `var` waits on, not yet run, in declaration order."""
        seen: set[int] = set()
        stack = [var]
        while stack:
            v = stack.pop()
            call = v.producer
            if call is not None and id(call) not in seen and not call.started:
                seen.add(id(call))
                stack.extend(call.inputs.values())
        return [c for c in self._calls if id(c) in seen]

    def _prefix(self, text: str) -> Context:
        if text not in self._prefixes:
            ctx = self.model.create_context()
            ctx.fill(text)
            ctx.flush()
            ctx.queue.synchronize()  # forks run on other queues: the prefix must be written
            self._prefixes[text] = ctx
        return self._prefixes[text]

    def _start(self, call: _Call) -> None:
        """Fill the call's prompt up to its first output and start generating it."""
        call.started = True
        failed = next((f'input {n!r} failed: {v.error}' for n, v in call.inputs.items() if v.error), None)
        if failed:
            self._fail(call, failed)
            return
        try:
            prefix = call.template.static_prefix()
            call.context = self._prefix(prefix).fork(call.queue) if prefix else Context(call.queue)
            call.rest = list(call.template.parts)
            self._advance(call, first=True)
        except Error as e:
            self._fail(call, e.message)

    def _advance(self, call: _Call, first: bool = False) -> None:
        """Fill text and inputs up to the next output and start its generation. The first
        time, the prompt so far is tokenized whole, as one request of the same text would
        be, and the context keeps the longest run of the prefix's tokens that begins it."""
        text = []
        while call.rest:
            kind, name = call.rest.pop(0)
            if kind == "output":
                if first:
                    tokens = call.queue.tokenize("".join(text))
                    held, keep = call.context.tokens, 0
                    while keep < min(len(held), len(tokens) - 1) and held[keep] == tokens[keep]:
                        keep += 1
                    call.context.truncate(keep)
                    call.context.fill_tokens(tokens[keep:])
                else:
                    call.context.fill("".join(text))
                stop = Stop(call.max_tokens, eos=call.queue.eos_tokens())
                call.generation = (name, call.context.start_generate(call.sampler, stop))
                return
            text.append(call.inputs[name].value if kind == "input" else name)
        call.generation = None

    def _finish(self, call: _Call) -> None:
        """Wait for the call's generations (later outputs of one template in turn)."""
        try:
            while call.generation is not None:
                name, generation = call.generation
                value = generation.result()
                next(v for v in call.outputs if v.name == name).value = value
                self._advance(call)
        except Error as e:
            self._fail(call, e.message)
        # Its pages go back, and its queue closes: an open queue that ran the model lately
        # looks to the scheduler like a decoder about to send its next step, and the next
        # call's first step waited up to half a forward for it (~0.3 s after a long prefill).
        call.context = call.queue = None

    @staticmethod
    def _fail(call: _Call, cause: str) -> None:
        for out in call.outputs:
            if out.value is None:
                out.error = cause
        call.generation, call.context = None, None
