"""Running a compiled workflow (`inferlet.workflow.Plan.run`): waves of ready operators,
the LLM calls of a wave generating together, each on its own queue."""

from __future__ import annotations

import hashlib

from inferlet.context import Context
from inferlet.errors import Error
from inferlet.io import chat, store_get, store_set
from inferlet.sampling import Sampler, Stop
from inferlet.workflow import Node, Plan, cache_key, fill, static_prefix

_MARK = "\ue000PIE-WORKFLOW\ue000"  # where the user's text goes in the chat format


class Runner:
    """Runs one plan's operators in waves on a model (used by `Plan.run`)."""
    def __init__(self, plan: Plan, model, functions: dict):
        self.plan, self.model, self.functions = plan, model, functions
        self.queue = model.create_queue()
        self.opening = self.closing = ""
        if any(n.op == "llm" and not n.raw for n in plan.nodes.values()):
            rendered = self.queue.apply_chat_template([chat("user", _MARK)], True)
            self.opening, _, self.closing = rendered.partition(_MARK)
        self.contexts: dict[str, Context] = {}  # prefilled anchors, by their text
        self.stats = plan.stats
        for key in ("llm_calls", "cache_hits", "prefixes_prefilled", "prefixes_imported"):
            self.stats[key] = 0

    def run(self, inputs: dict[str, str]) -> dict[str, str]:
        """Run every operator; the plan's outputs by name."""
        plan = self.plan
        missing = [name for name in plan.inputs if name not in inputs]
        if missing:
            raise Error("invalid-argument", f"workflow input {missing[0]!r} is missing (inputs: {plan.inputs})")
        extra = sorted(set(inputs) - set(plan.inputs))
        if extra:
            raise Error("invalid-argument", f"{extra[0]!r} is not an input of this workflow (inputs: {plan.inputs})")
        for node in plan.nodes.values():
            if node.op == "fn" and node.text not in self.functions:
                raise Error("invalid-argument", f"node {node.name!r}: function {node.text!r} was not given to run")
        values: dict[str, str] = dict(inputs)
        errors: dict[str, str] = {}
        pending = list(plan.nodes)
        while pending:
            ready = [n for n in pending if all(s in values or s in errors for s in plan.nodes[n].bind.values())]
            ready.sort(key=lambda n: -plan.priority[n])
            local = [n for n in ready if plan.nodes[n].op != "llm"]
            for name in local:
                self._local(plan.nodes[name], values, errors)
            if not local:
                self._llm_wave([plan.nodes[n] for n in ready], values, errors)
            pending = [n for n in pending if n not in values and n not in errors]
        out = {}
        for name, source in plan.outputs.items():
            if source in errors:
                raise Error("inference-failed", f"output {name!r}: node {source!r} failed: {errors[source]}")
            out[name] = values[source]
        return out

    @staticmethod
    def _failed_input(node: Node, errors: dict[str, str]) -> str | None:
        return next((f"its input {s!r} failed ({errors[s]})" for s in node.bind.values() if s in errors), None)

    def _local(self, node: Node, values: dict[str, str], errors: dict[str, str]) -> None:
        if (cause := self._failed_input(node, errors)) is not None:
            errors[node.name] = cause
            return
        args = {slot: values[source] for slot, source in node.bind.items()}
        try:
            result = node.text.format(**args) if node.op == "format" else self.functions[node.text](**args)
            if not isinstance(result, str):
                raise TypeError(f"returned {type(result).__name__}, not str")
            values[node.name] = result
        except Exception as e:  # a user's function: its failure is the node's
            errors[node.name] = f"{type(e).__name__}: {e}"

    def _prompt(self, node: Node, values: dict[str, str]) -> str:
        text = fill(node.text, {slot: values[source] for slot, source in node.bind.items()})
        return text if node.raw else self.opening + text + self.closing

    def _llm_wave(self, nodes: list[Node], values: dict[str, str], errors: dict[str, str]) -> None:
        to_start = []
        for node in nodes:
            if (cause := self._failed_input(node, errors)) is not None:
                errors[node.name] = cause
                continue
            prompt = self._prompt(node, values)
            key = cache_key(self.model.name, prompt, node.max_tokens)
            if self.plan.options.cache and (hit := store_get(key)) is not None:
                values[node.name] = hit
                self.stats["cache_hits"] += 1
                continue
            to_start.append((node, prompt, key))
        try:
            self._prefill([t for node, _, _ in to_start if (t := self._anchor_text(node)) is not None])
        except Error as e:
            for node, _, _ in to_start:
                errors[node.name] = f"prefilling its prefix failed: {e.message}"
            return
        started = []
        for node, prompt, key in to_start:
            try:
                started.append((node, key, self._start(node, prompt)))
            except Error as e:
                errors[node.name] = e.message
        for node, key, generation in started:
            try:
                values[node.name] = generation.result()
                self.stats["llm_calls"] += 1
                if self.plan.options.cache:
                    store_set(key, values[node.name])
            except Error as e:
                errors[node.name] = e.message

    def _start(self, node: Node, prompt: str):
        queue = self.model.create_queue()
        anchor = self._anchor(node)
        ctx = anchor.fork(queue) if anchor is not None else Context(queue)
        tokens = queue.tokenize(prompt)
        held, keep = ctx.tokens, 0
        while keep < min(len(held), len(tokens) - 1) and held[keep] == tokens[keep]:
            keep += 1
        ctx.truncate(keep)
        ctx.fill_tokens(tokens[keep:])
        return ctx.start_generate(Sampler.greedy(), Stop(node.max_tokens, eos=queue.eos_tokens()))

    def _anchor_text(self, node: Node) -> str | None:
        """The deepest shared template prefix `node` begins with, as the text its context
        holds (after the chat format's opening), or None."""
        prefix = static_prefix(node)
        anchor = next((a for a in self.plan.anchors if prefix.startswith(a)), None)
        if anchor is None:
            return None
        return anchor if node.raw else self.opening + anchor

    def _anchor(self, node: Node) -> Context | None:
        text = self._anchor_text(node)
        return None if text is None else self.contexts[text]

    def unpin(self) -> int:
        """Removes the persistent exports `pin` made for this plan's prefixes; how many."""
        removed = 0
        for node in self.plan.nodes.values():
            prefix = static_prefix(node) if node.op == "llm" else ""
            for anchor in (a for a in self.plan.anchors if prefix.startswith(a)):
                try:
                    Context.unexport(_export_name(anchor if node.raw else self.opening + anchor))
                    removed += 1
                except Error:
                    pass  # not pinned, or removed already (another node of the same prefix)
        return removed

    def _prefill(self, texts: list[str]) -> None:
        """Contexts for the prefixes in `texts` not held yet: imported where pinned, else
        prefilled together (each on a queue of its own, so their passes batch), then waited
        for once (forks run on other queues: a prefix must be written before they read it)."""
        fresh = []
        for text in dict.fromkeys(t for t in texts if t not in self.contexts):
            tokens = self.queue.tokenize(text)
            if self.plan.options.pin:
                # flush runs all but the last token, so an export holds tokens[:-1]
                ctx = Context.imported(self.queue, _export_name(text))
                if ctx is not None and ctx.tokens == tokens[:-1]:
                    ctx.fill_tokens(tokens[-1:])
                    self.stats["prefixes_imported"] += 1
                    self.contexts[text] = ctx
                    continue
            ctx = Context(self.model.create_queue())
            ctx.fill_tokens(tokens)
            ctx.flush()
            fresh.append((text, ctx))
        for text, ctx in fresh:
            ctx.queue.synchronize()
            self.stats["prefixes_prefilled"] += 1
            if self.plan.options.pin:
                ctx.export(_export_name(text), persistent=True)
            self.contexts[text] = ctx


def _export_name(text: str) -> str:
    return "workflow.prefix." + hashlib.sha256(text.encode()).hexdigest()[:24]
