"""Workflows (Helium): an agentic application as a graph of operators, checked, optimized
and run inside one inferlet.

```python
spec = {"inputs": ["topic"],
        "nodes": {"pro": {"op": "llm", "template": "Argue for {{input:t}}.", "bind": {"t": "topic"}},
                  "con": {"op": "llm", "template": "Argue against {{input:t}}.", "bind": {"t": "topic"}},
                  "debate": {"op": "format", "text": "For: {a}\\nAgainst: {b}", "bind": {"a": "pro", "b": "con"}},
                  "judge": {"op": "llm", "template": "{{input:d}}\\nWho wins?", "bind": {"d": "debate"}}},
        "outputs": {"verdict": "judge"}}
plan = compile_workflow(spec)            # every mistake raises ValueError here
values = plan.run(Model.default(), {"topic": "tabs"})
```

Operators: `input` (named in "inputs"), `llm` (a prompt template whose `{{input:NAME}}`
slots are bound to other nodes; greedy, `max_tokens` (32) tokens, the reply through the
model's chat format unless `"raw": true`), `format` (Python `str.format` over bound nodes),
`fn` (a function passed to `run` by name: `functions={"name": f}`; strings in, a string
out).

`compile_workflow` checks the graph before any model call (an unknown node, a slot without a
binding or a binding without a slot, a cycle, an unknown function) and, each optional
(`Options`), optimizes it:
- **prune**: operators no output depends on are dropped;
- **merge**: operators with the same operation on the same inputs (after merging theirs)
  run once (LLM calls are greedy, so they are deterministic);
- **cache**: an LLM call's reply is kept in the instance's user store under a hash of its
  prompt, so a later run (the same workflow again, another one sharing a call) reads it;
- **prefixes**: the static text LLM templates begin with is laid out as a radix tree; each
  prefix shared by two or more calls is prefilled once and every call forks it (a call's
  prompt is still tokenized whole, so its reply is what one request of the same text
  gives); `pin` keeps those prefixes as persistent exports for later runs;
- **order**: among calls ready at once, those on the longest remaining path (in tokens to
  generate) start first.
Run: waves of every ready operator; the LLM calls of a wave generate together (each on its
own queue, so their steps batch). An operator that fails fails the operators reading it,
with the cause; `run` raises `Error` naming the first output that failed.
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass, field

_SLOT = re.compile(r"\{\{\s*input\s*:\s*(\w+)\s*\}\}")
# Functions `fn` operators may name when `run` is given these (the workflow inferlet does):
# strings in (`text`, or every binding for `join`, one per line in binding-name order).
FUNCTIONS = {
    "first_line": lambda text: text.strip().splitlines()[0] if text.strip() else "",
    "strip": lambda text: text.strip(),
    "upper": lambda text: text.upper(),
    "lower": lambda text: text.lower(),
    "join": lambda **parts: "\n".join(parts[k] for k in sorted(parts)),
}
OPS = ("llm", "format", "fn")


@dataclass(frozen=True)
class Options:
    """Which of Helium's optimizations a plan applies (`Options.naive()`: none)."""
    prune: bool = True
    merge: bool = True
    cache: bool = True
    prefixes: bool = True
    pin: bool = False
    order: bool = True
    # A shared prefix shorter than this is not prefilled on its own: its pass and the wait
    # for it before the forks read it cost more than the prompt tokens it saves (a trading
    # workflow's ~90-character role prompts made every query ~2x slower, ad-hoc runs of
    # benchmarks/workflows.py).
    min_prefix_chars: int = 400

    @staticmethod
    def naive() -> Options:
        """Every operator as declared, in declaration order, nothing reused."""
        return Options(prune=False, merge=False, cache=False, prefixes=False, pin=False, order=False)


@dataclass
class Node:
    """One operator of a workflow: `llm`, `format` or `fn`, with its bindings."""
    name: str
    op: str
    text: str  # the template (llm), the format string (format) or the function's name (fn)
    bind: dict[str, str]  # slot or field -> node or input name
    max_tokens: int = 32
    raw: bool = False


@dataclass
class Plan:
    """A checked and optimized workflow, ready to `run`."""
    inputs: list[str]
    nodes: dict[str, Node]  # after optimization, in an order that runs (topological)
    outputs: dict[str, str]
    options: Options
    priority: dict[str, int]
    anchors: list[str] = field(default_factory=list)  # shared template prefixes, longest first
    stats: dict[str, int] = field(default_factory=dict)

    def run(self, model, inputs: dict[str, str], functions: dict | None = None) -> dict[str, str]:
        """Run the plan on `model` with `inputs`; the outputs by name (`stats` says what it did)."""
        return _runner().Runner(self, model, functions or {}).run(inputs)

    def unpin(self, model) -> int:
        """Removes the persistent exports `Options.pin` made for this plan's prefixes."""
        return _runner().Runner(self, model, {}).unpin()


def compile_workflow(spec: dict, options: Options = Options(), functions: tuple[str, ...] | None = None) -> Plan:
    """The checked, optimized plan of `spec` (module docstring); `functions`, if given, the
    names `fn` operators may use."""
    inputs = list(spec.get("inputs", []))
    nodes = {name: _node(name, body, functions) for name, body in spec.get("nodes", {}).items()}
    outputs = dict(spec.get("outputs", {}))
    if not outputs:
        raise ValueError("workflow: no outputs, so nothing would run")
    for clash in set(inputs) & set(nodes):
        raise ValueError(f"workflow: {clash!r} is both an input and a node")
    known = set(inputs) | set(nodes)
    for node in nodes.values():
        for slot, source in node.bind.items():
            if source not in known:
                raise ValueError(f"node {node.name!r}: {slot!r} is bound to {source!r}, which is neither an input nor a node")
    for out, source in outputs.items():
        if source not in known:
            raise ValueError(f"output {out!r} names {source!r}, which is neither an input nor a node")
    order = _topological(nodes)
    stats = {"declared": len(nodes)}
    if options.prune:
        needed = _needed(nodes, outputs.values())
        order = [n for n in order if n in needed]
    nodes = {n: nodes[n] for n in order}
    if options.merge:
        nodes, outputs = _merge(nodes, outputs)
    stats["kept"] = len(nodes)
    priority = _priority(nodes) if options.order else {n: 0 for n in nodes}
    calls = [n for n in nodes.values() if n.op == "llm"]
    anchors = _anchors(calls, options.min_prefix_chars) if options.prefixes else []
    return Plan(inputs, nodes, outputs, options, priority, anchors, stats)


def static_prefix(node: Node) -> str:
    """An LLM call's template text before its first slot."""
    match = _SLOT.search(node.text)
    return node.text if match is None else node.text[: match.start()]


def fill(template: str, values: dict[str, str]) -> str:
    """`template` with each `{{input:NAME}}` slot (spaces allowed, as the checks allow them)
    replaced by values[NAME], in one pass: a value that itself reads like a slot stays text."""
    return _SLOT.sub(lambda match: values[match.group(1)], template)


def cache_key(model: str, prompt: str, max_tokens: int) -> str:
    """Where a greedy call's reply is kept: the model, the limit and the whole prompt."""
    return "workflow.llm." + hashlib.sha256(f"{model}\0{max_tokens}\0{prompt}".encode()).hexdigest()


def _node(name: str, body: dict, functions: tuple[str, ...] | None) -> Node:
    op = body.get("op")
    if op not in OPS:
        raise ValueError(f"node {name!r}: op must be one of {', '.join(OPS)}, got {op!r}")
    text = body.get("template" if op == "llm" else "text" if op == "format" else "function")
    if not isinstance(text, str):
        key = {"llm": "template", "format": "text", "fn": "function"}[op]
        raise ValueError(f"node {name!r}: {op} needs a string {key!r}")
    bind = dict(body.get("bind", {}))
    if op == "llm":
        slots = set(_SLOT.findall(text))
        if "{{" in _SLOT.sub("", text):
            raise ValueError(f"node {name!r}: template slots are {{{{input:NAME}}}} (letters, digits, _)")
    elif op == "format":
        try:
            slots = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
        except ValueError as e:
            raise ValueError(f"node {name!r}: format text: {e}") from None
    else:
        slots = set(bind)
        if functions is not None and text not in functions:
            raise ValueError(f"node {name!r}: unknown function {text!r} (given: {sorted(functions)})")
    for slot in sorted(slots - set(bind)):
        raise ValueError(f"node {name!r} reads {slot!r}, which no binding gives")
    for slot in sorted(set(bind) - slots):
        raise ValueError(f"node {name!r}: binding {slot!r} names no slot of its {op} text")
    max_tokens = body.get("max_tokens", 32)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"node {name!r}: max_tokens must be a positive integer")
    return Node(name, op, text, bind, max_tokens, bool(body.get("raw", False)))


def _topological(nodes: dict[str, Node]) -> list[str]:
    """Node names, each after every node it reads (declaration order otherwise); a cycle is
    an error naming it."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2 or name not in nodes:
            return
        if state.get(name) == 1:
            cycle = path[path.index(name):] + [name]
            raise ValueError("workflow: a cycle (each node reads the next): " + " -> ".join(cycle))
        state[name] = 1
        for source in nodes[name].bind.values():
            visit(source, path + [name])
        state[name] = 2
        order.append(name)

    for name in nodes:
        visit(name, [])
    return order


def _needed(nodes: dict[str, Node], roots) -> set[str]:
    needed, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in nodes and name not in needed:
            needed.add(name)
            stack.extend(nodes[name].bind.values())
    return needed


def _merge(nodes: dict[str, Node], outputs: dict[str, str]) -> tuple[dict[str, Node], dict[str, str]]:
    """Hash-consing in topological order: a node equal to an earlier one (same op, text,
    limits, and inputs that are the same after merging) is replaced by it."""
    alias: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    kept: dict[str, Node] = {}
    for name, node in nodes.items():
        bind = {slot: alias.get(source, source) for slot, source in node.bind.items()}
        key = (node.op, node.text, node.max_tokens, node.raw, tuple(sorted(bind.items())))
        if key in seen:
            alias[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = Node(name, node.op, node.text, bind, node.max_tokens, node.raw)
    return kept, {out: alias.get(source, source) for out, source in outputs.items()}


def _priority(nodes: dict[str, Node]) -> dict[str, int]:
    """Tokens to generate on the longest path from each node to the end (critical path)."""
    readers: dict[str, list[str]] = {n: [] for n in nodes}
    for node in nodes.values():
        for source in node.bind.values():
            if source in readers:
                readers[source].append(node.name)
    priority: dict[str, int] = {}
    for name in reversed(list(nodes)):
        own = nodes[name].max_tokens if nodes[name].op == "llm" else 0
        priority[name] = own + max((priority[r] for r in readers[name]), default=0)
    return priority


def _anchors(calls: list[Node], min_chars: int) -> list[str]:
    """The radix tree's shared nodes: every static prefix two or more calls begin with (a
    template's own, or the common part of two templates'), at least `min_chars` long;
    longest first, so a call forks the deepest one it begins with."""
    prefixes = [static_prefix(c) for c in calls]
    counts: dict[str, int] = {}
    for p in prefixes:
        counts[p] = counts.get(p, 0) + 1
    anchors = {p for p, n in counts.items() if n > 1}
    distinct = sorted(counts)
    for a, b in zip(distinct, distinct[1:]):  # sorted: a common prefix is shared by neighbours
        common = _common(a, b)
        anchors.add(common)
    return sorted((a for a in anchors if len(a) >= min_chars), key=len, reverse=True)


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# The runner needs the SDK's host bindings. It is imported here, when this module is, because
# an inferlet's imports are resolved when it is built (componentize-py snapshots them): an
# import inside a function would look for the standard library at run time, which a
# component cannot read (the instance traps). The host tests load this file alone.
try:
    from inferlet import workflow_run as _workflow_run
except ImportError:
    _workflow_run = None


def _runner():
    if _workflow_run is None:
        raise RuntimeError("inferlet.workflow runs plans inside an inferlet only (no SDK bindings here)")
    return _workflow_run
