"""Generate the inferlet table of docs/inferlets.md from the tree (like the paper's Table 2).

Each inferlet's `src/lib.rs` opens with a doc header:

    //! `name`: one line saying what it does.
    //!
    //! A paragraph on the technique.
    //!
    //! Requirements: R1, R3
    //! Host APIs: ...
    //! Arguments: ...
    //! Output: ...

The table lists technique, requirements (R1 KV-cache control, R2 generation process, R3
computation and I/O), lines of code (non-blank, non-comment lines of src/) and component
size (built in release mode). `python inferlets/gen_doc.py` builds every inferlet and
rewrites the table; `--check` (used by the tests) only checks the headers and that the
table lists every inferlet with its current line count.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

INFERLETS = Path(__file__).resolve().parent
DOC = INFERLETS.parent / "docs" / "inferlets.md"
BEGIN, END = "<!-- inferlet-table:begin -->", "<!-- inferlet-table:end -->"
FIELDS = ("Requirements", "Host APIs", "Arguments", "Output")
# Crates that are infrastructure rather than techniques: kept out of the table.
NOT_TECHNIQUES = {"probe", "hello"}


@dataclass
class Inferlet:
    name: str
    summary: str
    requirements: str
    host_apis: str
    lines: int


def header(path: Path) -> dict[str, str]:
    """The `//!` doc header of a lib.rs: summary line, then the `Field: value` lines."""
    lines = [line[3:].strip() for line in path.read_text().splitlines() if line.startswith("//!")]
    if not lines:
        raise ValueError(f"{path}: no //! doc header")
    first = re.fullmatch(r"`([a-z0-9_]+)`: (.+)", lines[0])
    if not first:
        raise ValueError(f"{path}: the header must start with \"//! `name`: what it does\"")
    found = {"name": first.group(1), "summary": first.group(2)}
    for line in lines[1:]:
        for name in FIELDS:
            if line.startswith(name + ":"):
                found[name] = line[len(name) + 1:].strip()
    missing = [f for f in FIELDS if f not in found]
    if missing:
        raise ValueError(f"{path}: the header lacks {', '.join(missing)}")
    if not re.fullmatch(r"R[123](, R[123])*", found["Requirements"]):
        raise ValueError(f"{path}: Requirements must read like \"R1, R3\"")
    return found


def lines_of_code(crate: Path) -> int:
    """Non-blank lines of src/ that are not comments."""
    return sum(1 for f in sorted((crate / "src").rglob("*.rs")) for line in f.read_text().splitlines()
               if line.strip() and not line.strip().startswith("//"))


def inferlets() -> list[Inferlet]:
    out = []
    for crate in sorted(p for p in INFERLETS.iterdir() if (p / "Cargo.toml").is_file()):
        if crate.name in NOT_TECHNIQUES:
            continue
        h = header(crate / "src" / "lib.rs")
        if h["name"] != crate.name:
            raise ValueError(f"{crate}: the header names `{h['name']}`")
        out.append(Inferlet(crate.name, h["summary"], h["Requirements"], h["Host APIs"],
                            lines_of_code(crate)))
    return out


def table(items: list[Inferlet], sizes: dict[str, int]) -> str:
    rows = ["| Inferlet | What it does | Req. | LoC | Component |", "|---|---|---|---:|---:|"]
    for i in items:
        summary = i.summary.replace("|", "\\|")
        rows.append(f"| [`{i.name}`](../inferlets/{i.name}/src/lib.rs) | {summary} | {i.requirements} "
                    f"| {i.lines} | {sizes[i.name] / 1024:.0f} KB |")
    return "\n".join(rows)


def check() -> list[str]:
    """What is out of date in docs/inferlets.md (empty when it is current)."""
    text = DOC.read_text()
    problems = []
    for i in inferlets():
        row = re.search(rf"^\| \[`{i.name}`\].*\| (R[123, R]*) \| (\d+) \|", text, re.M)
        if not row:
            problems.append(f"{i.name} is missing from {DOC.name}")
        elif (row.group(1), int(row.group(2))) != (i.requirements, i.lines):
            problems.append(f"{i.name}: the table says {row.group(1)}, {row.group(2)} lines; "
                            f"the tree says {i.requirements}, {i.lines}")
    return problems


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        problems = check()
        print("\n".join(problems) or f"{DOC} is up to date")
        return 1 if problems else 0
    from pie.toolchain import build_inferlet

    items = inferlets()
    sizes = {i.name: build_inferlet(INFERLETS / i.name).stat().st_size for i in items}
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table(items, sizes) + "\n" + text[end:])
    print(f"wrote {DOC} ({len(items)} inferlets)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
