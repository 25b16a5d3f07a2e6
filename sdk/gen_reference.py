"""Generate docs/sdk-reference.md: every public item of both SDKs with its signature and the
first sentence of its doc comment, read from the source.

Rust (`sdk/rust/inferlet/src/*.rs` but the generated `bindings.rs`): `pub fn`, `pub async
fn`, `pub struct`, `pub enum`, `pub const` at module level or in an `impl` block, and
`#[macro_export]` macros; `///` comments (or the `//!` of a module) are the docs. Python
(`sdk/python/inferlet/*.py`): the public functions, classes and methods of each module's
`__all__`, with their docstrings. An item without a doc comment is an error, so the reference
(and the docs that point into it) cannot miss a public name; `--check` (run by the tests)
also fails when docs/sdk-reference.md is stale. Standard library only.

Usage: python sdk/gen_reference.py [--check]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

SDK = Path(__file__).resolve().parent
RUST = SDK / "rust" / "inferlet" / "src"
PYTHON = SDK / "python" / "inferlet"
DOC_PATH = SDK.parent / "docs" / "sdk-reference.md"
RUST_ITEM = re.compile(r"^\s*pub (?:async )?(?:fn|struct|enum|const|trait|type) ")


def rust_items(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(signature, summary) of each public item of one Rust file, and the undocumented ones."""
    lines = path.read_text().splitlines()
    items, missing, docs, depth, impl = [], [], [], 0, None
    impl_depth = 0
    for i, line in enumerate(lines):
        code = line.split("//")[0] if not line.strip().startswith("///") else ""
        stripped = line.strip()
        if stripped.startswith("///"):
            docs.append(stripped[3:].strip())
        elif stripped.startswith("#["):
            pass  # attributes between the doc comment and the item
        elif match := re.match(r"^impl(?:<[^>]*>)?\s+(?:[\w:<>, ]+\s+for\s+)?([\w:]+)", stripped):
            impl, impl_depth, docs = match.group(1), depth, []
        elif stripped.startswith("macro_rules!") and i and "#[macro_export]" in lines[i - 1]:
            name = stripped.split("!")[1].split("{")[0].strip()
            _add(items, missing, f"inferlet::{name}!(...)", docs, path)
            docs = []
        elif RUST_ITEM.match(line) and (impl is None or depth == impl_depth + 1) and (impl or depth == 0):
            signature = stripped
            j = i
            while not re.search(r"[{;]\s*$", signature) and j + 1 < len(lines):
                j += 1
                signature += " " + lines[j].strip()
            signature = re.sub(r"\s*(\{|;)\s*$", "", signature).removeprefix("pub ")
            signature = re.sub(r"\s+", " ", signature).replace("( ", "(").replace(" )", ")")
            if impl:  # `fn name(...)` in `impl Type` -> `fn Type::name(...)`
                signature = re.sub(r"^((?:async )?fn )", rf"\g<1>{impl}::", signature)
            _add(items, missing, signature, docs, path)
            docs = []
        elif stripped and not stripped.startswith("//"):
            docs = []
        depth += code.count("{") - code.count("}")
        if impl is not None and depth <= impl_depth:
            impl = None
    return items, missing


def python_items(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(signature, summary) of each public function, class and method in `__all__`."""
    tree = ast.parse(path.read_text())
    exported = next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", None) == "__all__" for t in node.targets)), None)
    items, missing = [], []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
            continue
        if exported is not None and node.name not in exported:
            continue
        if isinstance(node, ast.FunctionDef):
            _add(items, missing, _py_signature(node), _docstring(node), path)
            continue
        fields = [f"{n.target.id}: {ast.unparse(n.annotation)}" for n in node.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        _add(items, missing, f"class {node.name}" + (f"({', '.join(fields)})" if fields else ""),
             _docstring(node), path)
        for member in node.body:
            if isinstance(member, ast.FunctionDef) and not member.name.startswith("_"):
                _add(items, missing, f"{node.name}.{_py_signature(member)}", _docstring(member), path)
    return items, missing


def _py_signature(node: ast.FunctionDef) -> str:
    if any(getattr(d, "id", None) == "property" for d in node.decorator_list):
        return f"{node.name}: {ast.unparse(node.returns)}" if node.returns else node.name
    args = re.sub(r"^(self|cls)(, )?", "", ast.unparse(node.args))
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({args}){returns}"


def _docstring(node) -> list[str]:
    text = ast.get_docstring(node) or ""
    return text.splitlines()


def _add(items: list, missing: list, signature: str, docs: list[str], path: Path) -> None:
    summary = _summary(docs)
    if not summary:
        missing.append(f"{path.relative_to(SDK.parent)}: {signature}")
    items.append((signature, summary))


def _summary(docs: list[str]) -> str:
    """The doc comment's first sentence (up to a period followed by a capital or the end;
    not `e.g.` or `i.e.`), or its first paragraph."""
    text = " ".join(line.strip() for line in docs).strip()
    paragraph = text.split("  ")[0]
    match = re.search(r"^(.+?(?<!e\.g)(?<!i\.e)\.)(\s+[A-Z`(\[]|$)", paragraph)
    return (match.group(1) if match else paragraph).strip()


def render() -> tuple[str, list[str]]:
    out = ["# SDK reference", "",
           "Generated by `python sdk/gen_reference.py` from the SDKs' source: every public item",
           "with its signature and the first sentence of its doc comment (read the source for the",
           "rest). The guides: [inferlets.md](inferlets.md) (Rust) and",
           "[python-inferlets.md](python-inferlets.md); the host API underneath: [api.md](api.md).", ""]
    missing: list[str] = []
    out += ["## Rust: the `inferlet` crate", ""]
    for path in sorted(RUST.glob("*.rs")):
        if path.name == "bindings.rs":
            continue
        items, absent = rust_items(path)
        missing += absent
        if items:
            out += [f"### `{path.stem}` ({path.relative_to(SDK.parent)})", ""]
            out += [f"- `{sig}` — {summary}" for sig, summary in items] + [""]
    out += ["## Python: the `inferlet` package", ""]
    for path in sorted(PYTHON.glob("*.py")):
        items, absent = python_items(path)
        missing += absent
        if items:
            out += [f"### `inferlet.{path.stem}` ({path.relative_to(SDK.parent)})", ""]
            out += [f"- `{sig}` — {summary}" for sig, summary in items] + [""]
    return "\n".join(out).rstrip() + "\n", missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale or an item is undocumented")
    args = parser.parse_args()
    text, missing = render()
    if missing:
        print("public items without a doc comment:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    if args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is stale: run python sdk/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
