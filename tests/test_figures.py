"""Figures in the docs come from result files (benchmarks/figures.py): every cited figure
matches its JSON, no measured figure is written outside a marker, and the path language
and formatting do what benchmarks/figures.py says. Fast: no model, no server."""

from __future__ import annotations

import json

import pytest

from benchmarks import figures
from benchmarks.figures import FigureError, evaluate, format_value, parse_path, resolve

DATA = {
    "rows": [
        {"case": "concurrency 1", "system": "pie", "values": {"ms_per_token": 29.742}},
        {"case": "concurrency 1", "system": "vllm", "values": {"ms_per_token": 30.489}},
        {"case": "concurrency 8", "system": "pie", "values": {"ms_per_token": 58.43}},
    ],
    "launch": [{"concurrency": 64, "cold": True, "median_ms": 6.5}, {"concurrency": 64, "cold": False, "median_ms": 6.6}],
    "api_latency_us": {"control:tokenize": 37.01, "a.b": 1},
    "by_function": {"[method]future-token.get": 2.0},
    "date": "2026-11-22",
    "overhead": -0.0775,
}


# ---------------------------------------------------------------- the checks on the docs


def test_every_cited_figure_matches_its_result_file():
    problems = figures.check(figures.docs_files())
    assert not problems, "\n".join(problems) + "\n(python -m benchmarks.figures --write refreshes the texts)"


def test_no_measured_figure_outside_a_marker():
    found = [f"{file.relative_to(figures.ROOT)}:{line}: {figure!r}"
             for file in figures.docs_files() for line, figure in figures.unmarked(file)]
    assert not found, ("measured figures without a result file behind them (cite with <!--fig FILE.json PATH-->…"
                       "<!--/fig-->, or put <!--not-a-figure--> at the end of the line if it is not a measurement):\n" + "\n".join(found))


def test_the_docs_cite_figures_at_all():
    """A guard against the scan passing because the files moved: the docs do cite figures."""
    files = figures.docs_files()
    assert all(f.is_file() for f in files), [str(f) for f in files if not f.is_file()]
    assert sum(len(figures.markers(f)) for f in files) >= 50


# ---------------------------------------------------------------- the path language


def test_parse_path():
    assert parse_path('rows[case=concurrency 1,system=pie].values.ms_per_token') == [
        "rows", {"case": "concurrency 1", "system": "pie"}, "values", "ms_per_token"]
    assert parse_path('api_latency_us."control:tokenize"') == ["api_latency_us", "control:tokenize"]
    assert parse_path('by_function."[method]future-token.get"') == ["by_function", "[method]future-token.get"]
    assert parse_path("rows[-1].case") == ["rows", -1, "case"]
    assert parse_path('rows[case="a,b]",system=x]') == ["rows", {"case": "a,b]", "system": "x"}]


@pytest.mark.parametrize("bad", ["", "rows[", "rows[case]", "rows..x", "a.", '"open', "rows[]"])
def test_parse_path_refuses(bad):
    with pytest.raises(FigureError):
        parse_path(bad)


def test_resolve():
    assert resolve(DATA, "rows[case=concurrency 1,system=vllm].values.ms_per_token") == 30.489
    assert resolve(DATA, "rows[1].system") == "vllm"
    assert resolve(DATA, "rows[-1].case") == "concurrency 8"
    assert resolve(DATA, "launch[concurrency=64,cold=false].median_ms") == 6.6  # non-strings compare as JSON
    assert resolve(DATA, 'api_latency_us."a.b"') == 1
    assert resolve(DATA, 'by_function."[method]future-token.get"') == 2.0


@pytest.mark.parametrize("path, says", [
    ("rows[case=concurrency 1].values", "2 items match [case=concurrency 1]"),
    ("rows[case=concurrency 2,system=pie]", "0 items match"),
    ("rows[case=concurrency 1,system=pie].values.tokens_per_s", "rows[case=concurrency 1,system=pie].values: no key 'tokens_per_s' (keys: ms_per_token)"),
    ("rows[7]", "no index [7]"),
    ("missing", "top: no key 'missing'"),
    ("date[0]", "date: no index [0] (a str)"),
])
def test_resolve_says_where_it_stopped(path, says):
    with pytest.raises(FigureError, match=None) as e:
        resolve(DATA, path)
    assert says in str(e.value)


# ---------------------------------------------------------------- expressions and formatting


@pytest.fixture
def results(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(DATA))
    (tmp_path / "d.json").write_text(json.dumps({"x": 4}))
    return tmp_path


def test_evaluate(results):
    pie = "rows[case=concurrency 1,system=pie].values.ms_per_token"
    vllm = "rows[case=concurrency 1,system=vllm].values.ms_per_token"
    assert evaluate(f"c.json {pie}", results) == (29.742, None)
    assert evaluate(f"c.json {vllm} / {pie} :.2f", results) == (30.489 / 29.742, ".2f")
    assert evaluate("c.json overhead * 100 :+.0f", results) == (-7.75, "+.0f")
    assert evaluate(f"c.json {pie} / d.json x", results)[0] == 29.742 / 4  # a second file
    assert evaluate("c.json api_latency_us.\"a.b\" / 1000 * 8", results)[0] == 0.008
    assert evaluate("c.json launch[1].median_ms / launch[0].median_ms - 1 :.0%", results)[0] == 6.6 / 6.5 - 1
    assert evaluate("2 + c.json launch[0].median_ms", results)[0] == 8.5  # a number first


@pytest.mark.parametrize("spec, says", [
    ("nope.json x", "no result file"),
    ("rows[0].case", "no result file (FILE.json) before"),
    ("c.json date / 2", "'2026-11-22' is not a number"),
    ("c.json overhead / 0", "cannot divide"),
    ("c.json overhead overhead", "expected one of / * - + before 'overhead'"),
    ("c.json overhead /", "nothing after"),
    ("c.json", "no path after"),
])
def test_evaluate_refuses(results, spec, says):
    with pytest.raises(FigureError) as e:
        evaluate(spec, results)
    assert says in str(e.value)


@pytest.mark.parametrize("value, fmt, text", [
    (29.742971, None, "29.7"), (1626.07, None, "1626"), (242.317, None, "242"), (0.46884, None, "0.469"),
    (3.19, None, "3.19"), (17, None, "17"), (True, None, "true"), ("x", None, "x"), (0.0, None, "0"),
    (0.6979, ".0%", "70%"), (-0.0775, "+.0%", "-8%"), (1.0172, ".1%", "101.7%"), (0.5322, ".2f", "0.53"),
    (2386, ",", "2,386"), (27120.56, ",.1f", "27,120.6"),
])
def test_format_value(value, fmt, text):
    assert format_value(value, fmt) == text


def test_format_value_refuses():
    with pytest.raises(FigureError):
        format_value({"a": 1})
    with pytest.raises(FigureError):
        format_value("text", ".1f")


# ---------------------------------------------------------------- check, write, scan


def test_check_reports_then_write_fixes(results, tmp_path):
    doc = tmp_path / "doc.md"
    pie = "c.json rows[case=concurrency 1,system=pie].values.ms_per_token"
    doc.write_text(f"intro\n| Pie | <!--fig {pie} :.1f-->31.0<!--/fig--> ms | <!--fig c.json nope-->1<!--/fig--> |\n"
                   f"ok <!--fig {pie} :.2f-->29.74<!--/fig--> and <!--fig {pie}\n"
                   f"<!--fig {pie} :.2f-->29.74<!--/fig--> starts a line\n"
                   f"an example: `<!--fig c.json nope-->1<!--/fig-->`\n```\n<!--fig c.json nope-->1<!--/fig-->\n```\n")
    problems = figures.check([doc], results)
    assert problems[0] == f"{doc}:2: {pie} :.1f: the JSON gives '29.7', the text says '31.0'"
    assert problems[1].startswith(f"{doc}:2: c.json nope: does not resolve: top: no key 'nope'")
    assert problems[2] == f"{doc}:3: '<!--fig' without a closing '-->TEXT<!--/fig-->' on the same line"
    assert problems[3] == (f"{doc}:4: a marker starts the line, which makes the line an HTML block in markdown "
                           "(shown raw): put a word before it")
    assert len(problems) == 4
    figures.check([doc], results, write=True)
    assert doc.read_text().splitlines()[1] == (
        f"| Pie | <!--fig {pie} :.1f-->29.7<!--/fig--> ms | <!--fig c.json nope-->1<!--/fig--> |")
    assert len(figures.check([doc], results)) == 3


def test_unmarked_finds_measured_figures_only(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "Pie takes 29.7 ms per token, 242 tok/s, 0.53× of vLLM, +70%, 15 GB/s.",  # 1: five figures
        "Cited: <!--fig c.json x-->29.7<!--/fig--> ms and <!--fig c.json y-->0.53<!--/fig-->×.",  # 2: none
        "Targets: ≤ 15 ms per token, ≥ 750 tokens/s; the key `timeout_s = 30 s`.",  # 3: none
        "A default of 30 s. <!--not-a-figure-->",  # 4: opted out
        "```",
        "took 3.2 s",  # 6: fenced
        "```",
        "Ranges 0.57–0.97× and 31-36 ms; version 0.32, 4 × 32 workers, 8 agents, sha256 0x1f.",  # 8: two
        "tokens/s 1.7 % 3 s/agent 5x",  # 9: three
    ]) + "\n")
    assert figures.unmarked(doc) == [
        (1, "29.7 ms"), (1, "242 tok/s"), (1, "0.53×"), (1, "70%"), (1, "15 GB/s"),
        (8, "0.57–0.97×"), (8, "31-36 ms"), (9, "1.7 %"), (9, "3 s"), (9, "5x")]


def test_main_exit_codes(results, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "RESULTS", results)
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text("took <!--fig c.json rows[0].values.ms_per_token :.1f-->29.7<!--/fig--> ms\n")
    bad.write_text("took 3 s\n")
    assert figures.main([str(good)]) == 0
    assert figures.main([str(bad)]) == 1
    assert "bad.md:1: '3 s' is not cited" in capsys.readouterr().out
