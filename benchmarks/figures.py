"""Figures in the docs are cited from the result files they come from, and checked.

Why: a hand-typed figure cannot be checked, goes stale when the benchmark runs again, and
(issue 14) several in the docs disagreed with the generated tables or had no result file
behind them at all. So a measured figure in markdown is a marker holding a path into a
JSON file under `benchmarks/results/`; the text between the markers is what a reader sees
(HTML comments do not render):

    Pie takes <!--fig completion.json rows[case=concurrency 1,system=pie].values.ms_per_token :.1f-->29.7<!--/fig--> ms

`python -m benchmarks.figures` checks every marker (exit 1, `file:line`, the path, what
the JSON gives and what the text says) and lists measured figures written outside one;
`python -m benchmarks.figures --write` rewrites the text between the markers from the
JSON files (after a benchmark run). `tests/test_figures.py` runs both checks.

Marker: `<!--fig EXPR [:FORMAT]-->TEXT<!--/fig-->`, on one line, not at its start (a line
starting with `<!--` is an HTML block: markdown would show it raw). Markers in code (fenced
or `inline`) are examples and are not checked.

- EXPR is `OPERAND [OP OPERAND]...` with OP one of `/ * - +`, evaluated left to right: a
  ratio such as "vLLM / Pie" is `completion.json rows[…].values.ms_per_token / rows[…].values.ms_per_token`,
  "t beats adaptive by 18%" is `batching.json rows[case=t]… / rows[case=adaptive]… - 1 :.0%`.
- OPERAND is `[FILE.json] PATH` or a number. FILE is relative to `benchmarks/results/`; an
  operand without one reads the marker's first file.
- PATH: segments joined by `.`: a key (`values`), a quoted key (`"control:tokenize"`, for
  keys holding `.`, `[` or spaces), `[N]` (a list index), `[k=v,k2=v2]` (the one list item
  whose fields equal those values; quote a value holding `,` or `]`).
- FORMAT: a Python format spec (`:.1f`, `:.0%`, `:+.0%`, `:,.0f`); without one, numbers
  show 3 significant digits (never an exponent: 1626, 242, 29.7, 0.469).

Opting out: a line holding `<!--not-a-figure-->` (at its end; in a table row, in its last
cell) is not scanned for unmarked figures: for configuration values, limits, defaults,
figures quoted from the paper and illustrative numbers, never for a measurement. Numbers in
fenced code blocks and in `inline code`, and bounds written with ≤ or ≥ (targets), are
not scanned either.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OPT_OUT = "<!--not-a-figure-->"
OPS = {"/": operator.truediv, "*": operator.mul, "-": operator.sub, "+": operator.add}

MARKER = re.compile(r"<!--fig\s+(?P<spec>.*?)\s*-->(?P<text>.*?)<!--/fig-->")
_NUM = r"\d[\d,]*(?:\.\d+)?"
_UNIT = r"(?:\s?(?:µs|us|ms|s|min|h|tok/s|tokens/s|agents/s|[KMG]B/s|%)|[×x])(?!\w)"
# A number (or a range of two) followed by a measurement unit, not part of a word or a version.
FIGURE = re.compile(rf"(?<![\w.]){_NUM}(?:\s?[–-]\s?{_NUM})?{_UNIT}")
_CODE = re.compile(r"(`+).*?\1")
_BOUND = re.compile(rf"[≤≥]\s?~?{_NUM}")


class FigureError(Exception):
    """A marker whose expression cannot be parsed or does not resolve."""


def docs_files(root: Path = ROOT) -> list[Path]:
    """The markdown files whose figures must be cited: docs/*.md (but api.md, generated from
    sdk/wit, which states limits, not measurements), benchmarks/analysis.md and README.md."""
    docs = [f for f in sorted((root / "docs").glob("*.md")) if f.name != "api.md"]
    return docs + [root / "benchmarks" / "analysis.md", root / "README.md"]


# ---------------------------------------------------------------- the path language


def _split_top(text: str, seps: str) -> list[str]:
    """Split on any char of `seps` outside brackets and double quotes (empty parts dropped)."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0 and ch in seps:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    if quoted or depth:
        raise FigureError(f"unbalanced quotes or brackets in {text!r}")
    return [p for p in (p.strip() for p in parts) if p]


def _unquote(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def parse_path(path: str) -> list[Any]:
    """`rows[case=a,system=b].values."x.y"[0]` → ['rows', {'case': 'a', 'system': 'b'}, 'values', 'x.y', 0]."""
    steps: list[Any] = []
    i = 0
    while i < len(path):
        ch = path[i]
        if ch == ".":
            if not steps or i + 1 == len(path) or path[i + 1] in ".[":
                raise FigureError(f"misplaced '.' in {path!r}")
            i += 1
            continue
        if ch == "[":
            depth, quoted, j = 0, False, i
            while j < len(path):
                if path[j] == '"':
                    quoted = not quoted
                elif not quoted and path[j] == "[":
                    depth += 1
                elif not quoted and path[j] == "]":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if j == len(path):
                raise FigureError(f"unclosed '[' in {path!r}")
            inner = path[i + 1:j].strip()
            if re.fullmatch(r"-?\d+", inner):
                steps.append(int(inner))
            else:
                selector = {}
                for pair in _split_top(inner, ","):
                    key, eq, value = pair.partition("=")
                    if not eq or not key.strip():
                        raise FigureError(f"selector [{inner}] in {path!r}: want [key=value,...] or [index]")
                    selector[_unquote(key)] = _unquote(value)
                if not selector:
                    raise FigureError(f"empty selector in {path!r}")
                steps.append(selector)
            i = j + 1
            continue
        if ch == '"':
            j = path.find('"', i + 1)
            if j < 0:
                raise FigureError(f"unclosed quote in {path!r}")
            steps.append(path[i + 1:j])
            i = j + 1
            continue
        m = re.compile(r'[^.\["\s]+').match(path, i)
        if not m:
            raise FigureError(f"unexpected {ch!r} in {path!r}")
        steps.append(m.group())
        i = m.end()
    if not steps:
        raise FigureError("empty path")
    return steps


def _matches(item: Any, selector: dict[str, str]) -> bool:
    if not isinstance(item, dict):
        return False
    for key, want in selector.items():
        if key not in item:
            return False
        got = item[key]
        if (got if isinstance(got, str) else json.dumps(got)) != want:
            return False
    return True


def resolve(data: Any, path: str) -> Any:
    """The value at `path` in `data`; FigureError saying where it stopped and what was there."""
    node, walked = data, ""
    for step in parse_path(path):
        if isinstance(step, int):
            if not isinstance(node, list) or not -len(node) <= step < len(node):
                raise FigureError(f"{walked or 'top'}: no index [{step}] ({_shape(node)})")
            node, walked = node[step], f"{walked}[{step}]"
        elif isinstance(step, dict):
            label = ",".join(f"{k}={v}" for k, v in step.items())
            if not isinstance(node, list):
                raise FigureError(f"{walked or 'top'}: [{label}] needs a list ({_shape(node)})")
            found = [item for item in node if _matches(item, step)]
            if len(found) != 1:
                raise FigureError(f"{walked or 'top'}: {len(found)} items match [{label}]"
                                  f" ({len(node)} items; keys of the first: {_keys(node)})")
            node, walked = found[0], f"{walked}[{label}]"
        else:
            if not isinstance(node, dict) or step not in node:
                raise FigureError(f"{walked or 'top'}: no key {step!r} ({_shape(node)})")
            node, walked = node[step], f"{walked}.{step}" if walked else step
    return node


def _keys(node: list) -> str:
    return ", ".join(node[0]) if node and isinstance(node[0], dict) else "-"


def _shape(node: Any) -> str:
    if isinstance(node, dict):
        keys = list(node)
        return "keys: " + ", ".join(map(str, keys[:12])) + (", …" if len(keys) > 12 else "")
    if isinstance(node, list):
        return f"a list of {len(node)}"
    return f"a {type(node).__name__}"


# ---------------------------------------------------------------- expressions and formatting


@dataclass
class Figure:
    """One marker: where it is, what it says, what it cites."""

    file: Path
    line: int
    spec: str
    text: str
    span: tuple[int, int]  # of the text between the markers, within the line

    @property
    def where(self) -> str:
        try:
            name = self.file.relative_to(ROOT)
        except ValueError:
            name = self.file
        return f"{name}:{self.line}"


def parse_spec(spec: str) -> tuple[list[tuple[str, str | None, str | float]], str | None]:
    """`FILE PATH / PATH :.2f` → ([('', FILE, PATH), ('/', FILE, PATH)], '.2f')."""
    tokens = _split_top(spec, " \t")
    fmt = None
    if tokens and tokens[-1].startswith(":"):
        fmt = tokens.pop()[1:]
    operands: list[tuple[str, str | None, str | float]] = []
    op, first_file = "", None
    i = 0
    while i < len(tokens):
        if operands or op:
            if tokens[i] not in OPS:
                raise FigureError(f"expected one of {' '.join(OPS)} before {tokens[i]!r} in {spec!r}")
            op, i = tokens[i], i + 1
            if i == len(tokens):
                raise FigureError(f"nothing after {op!r} in {spec!r}")
        file = None
        if tokens[i].endswith(".json"):
            file, i = tokens[i], i + 1
            first_file = first_file or file
            if i == len(tokens):
                raise FigureError(f"no path after {file!r} in {spec!r}")
        token = tokens[i]
        i += 1
        if file is None and re.fullmatch(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", token):
            operands.append((op, None, float(token)))
        else:
            if first_file is None:
                raise FigureError(f"no result file (FILE.json) before {token!r} in {spec!r}")
            operands.append((op, file or first_file, token))
        op = op or "="
    if not operands:
        raise FigureError("empty marker")
    return operands, fmt


def evaluate(spec: str, results: Path | None = None, cache: dict[Path, Any] | None = None) -> tuple[Any, str | None]:
    """The value a marker cites, and its format spec; result files are read from `results`
    (default benchmarks/results/)."""
    results = RESULTS if results is None else results
    cache = {} if cache is None else cache
    operands, fmt = parse_spec(spec)
    value: Any = None
    for op, file, path in operands:
        if file is None:
            operand = path
        else:
            where = results / file
            if where not in cache:
                if not where.is_file():
                    raise FigureError(f"no result file {file} in {results}")
                cache[where] = json.loads(where.read_text())
            operand = resolve(cache[where], str(path))
        if len(operands) > 1 and (isinstance(operand, bool) or not isinstance(operand, (int, float))):
            raise FigureError(f"{path}: {operand!r} is not a number")
        if op in ("", "="):
            value = operand
        elif op == "/":
            if operand == 0:
                raise FigureError(f"{path} is 0: cannot divide")
            value = value / operand
        else:
            value = OPS[op](value, operand)
    return value, fmt


def format_value(value: Any, fmt: str | None = None) -> str:
    """The text a marker shows: `fmt` as a Python format spec, else 3 significant digits."""
    if fmt is not None:
        try:
            return format(value, fmt)
        except (TypeError, ValueError) as e:
            raise FigureError(f"format {fmt!r} of {value!r}: {e}") from e
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int) or isinstance(value, str):
        return str(value)
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return f"{value:g}"
        decimals = max(0, 2 - math.floor(math.log10(abs(value))))
        return f"{value:.{decimals}f}"
    raise FigureError(f"{value!r} is not a figure (a {type(value).__name__})")


# ---------------------------------------------------------------- scanning markdown


def _lines_outside_fences(text: str):
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fence = stripped[:3]
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        yield number, line


def markers(file: Path) -> list[Figure]:
    """Every marker in a markdown file, but those in code (fenced or `inline`): examples."""
    found = []
    for number, line in _lines_outside_fences(file.read_text()):
        code = [m.span() for m in _CODE.finditer(line)]
        for m in MARKER.finditer(line):
            if not any(a <= m.start() < b for a, b in code):
                found.append(Figure(file, number, m.group("spec"), m.group("text"), m.span("text")))
        if "<!--fig" in _CODE.sub("", MARKER.sub("", line)):
            found.append(Figure(file, number, "", "", (0, 0)))  # unclosed: reported by check
    return found


def unmarked(file: Path) -> list[tuple[int, str]]:
    """(line, figure) for every measured-looking number outside a marker, code and opt-outs."""
    hits = []
    for number, line in _lines_outside_fences(file.read_text()):
        if OPT_OUT in line:
            continue
        text = MARKER.sub(" ", line)
        text = re.sub(r"<!--.*?-->", " ", text)
        text = _CODE.sub(" ", text)
        text = _BOUND.sub(" ", text)
        hits += [(number, m.group()) for m in FIGURE.finditer(text)]
    return hits


def check(files: list[Path], results: Path | None = None, write: bool = False) -> list[str]:
    """Problems with the markers in `files` ('file:line: …'); with write, fix the texts first."""
    problems, cache = [], {}
    for file in files:
        lines = file.read_text().splitlines(keepends=True)
        fixes: list[tuple[Figure, str]] = []
        starts = set()
        for fig in markers(file):
            if lines[fig.line - 1].lstrip().startswith("<!--fig") and fig.line not in starts:
                starts.add(fig.line)
                problems.append(f"{fig.where}: a marker starts the line, which makes the line an HTML block in "
                                "markdown (shown raw): put a word before it")
            if not fig.spec:
                problems.append(f"{fig.where}: '<!--fig' without a closing '-->TEXT<!--/fig-->' on the same line")
                continue
            try:
                expected = format_value(*evaluate(fig.spec, results, cache))
            except FigureError as e:
                problems.append(f"{fig.where}: {fig.spec}: does not resolve: {e}")
                continue
            if expected != fig.text:
                fixes.append((fig, expected))
                if not write:
                    problems.append(f"{fig.where}: {fig.spec}: the JSON gives {expected!r}, the text says {fig.text!r}")
        if write:
            for fig, expected in reversed(fixes):  # right to left: earlier spans stay valid
                line = lines[fig.line - 1]
                lines[fig.line - 1] = line[:fig.span[0]] + expected + line[fig.span[1]:]
            if fixes:
                file.write_text("".join(lines))
    return sorted(problems, key=_line_order)


def _line_order(problem: str) -> tuple[str, int]:
    m = re.match(r"(.*?):(\d+):", problem)
    return (m.group(1), int(m.group(2))) if m else (problem, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the text between the markers from the JSON files")
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: docs/*.md, benchmarks/analysis.md, README.md)")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or docs_files()
    problems = check(files, write=args.write)
    for file in files:
        fig = Figure(file, 0, "", "", (0, 0))
        for number, figure in unmarked(file):
            fig.line = number
            problems.append(f"{fig.where}: {figure!r} is not cited: wrap it in <!--fig FILE.json PATH-->…<!--/fig-->, "
                            f"or put {OPT_OUT} at the end of the line if it is not a measurement")
    for problem in problems:
        print(problem)
    count = sum(len(markers(f)) for f in files)
    print(f"{count} cited figures in {len(files)} files; {len(problems)} problems"
          + (" (texts rewritten from the JSON files)" if args.write else ""), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
