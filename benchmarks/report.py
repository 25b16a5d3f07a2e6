"""Results on disk: one JSON per workload, one PNG per workload, and RESULTS.md over all.

RESULTS.md is regenerated from every harness JSON in the results folder, so running one
workload again refreshes its section and keeps the others. Ratios always read "× in Pie's
favour": above 1 Pie is better (faster, or more per second), below 1 the baseline is.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.run_info import cpu_label, machine_settings
from benchmarks.script_tables import GPU_FILES, SCRIPTS, VARIANTS, section
from benchmarks.workloads import Metric, Result, Row

FORMAT = "pie-bench/1"  # marks the harness's JSON files among other scripts' results
RUN = "run.json"  # what the last `python -m benchmarks` ran, when, and how long it took
HERE = Path(__file__).resolve().parent
ANALYSIS = HERE / "analysis.md"  # hand-written: where Pie loses, and why (profiles)


def machine() -> dict[str, Any]:
    """What every script records (CPU model and flags, cores, versions, load) plus memory and OS."""
    memory_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal"))
    return {**machine_settings(), "memory_gb": round(memory_kb / 2**20, 1), "os": platform.platform()}


def write_result(result: Result, out: Path, run_info: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result.workload}.json"
    stamp = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path.write_text(json.dumps({"format": FORMAT, **run_info, **stamp, **asdict(result)}, indent=2) + "\n")
    if result.rows:
        plot(result, out / f"{result.workload}.png")
    return path


def load_results(out: Path, order: tuple[str, ...]) -> list[dict[str, Any]]:
    """The harness's JSON files in `out`, in `order` of workloads."""
    found = [data for path in out.glob("*.json") if (data := json.loads(path.read_text())).get("format") == FORMAT]
    return sorted(found, key=lambda d: order.index(d["workload"]) if d["workload"] in order else len(order))


def _result(data: dict[str, Any]) -> Result:
    return Result(data["workload"], data["title"], [Metric(**m) for m in data["metrics"]],
                  [Row(**r) for r in data["rows"]], data["notes"], data["settings"], data.get("counts", []))


def systems_of(result: Result) -> list[str]:
    """Pie's variants first, then baselines, each in first-seen order."""
    seen = list(dict.fromkeys(row.system for row in result.rows))
    return [s for s in seen if s.startswith("pie")] + [s for s in seen if not s.startswith("pie")]


def ratio(pie: float, baseline: float, metric: Metric) -> float:
    """× in Pie's favour."""
    if pie <= 0 or baseline <= 0:
        return float("nan")
    return pie / baseline if metric.higher_is_better else baseline / pie


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(row.case for row in result.rows))
    systems = systems_of(result)
    # Up to four panels side by side; more (serving's six) wrap into rows of three, so that
    # the figure stays readable at page width instead of growing to a strip.
    columns = len(result.metrics) if len(result.metrics) <= 4 else 3
    rows = math.ceil(len(result.metrics) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(max(6, 1.2 * len(cases) * columns + 3), 4 * rows),
                             squeeze=False)
    for ax in axes.flat[len(result.metrics):]:
        ax.set_visible(False)
    width = 0.8 / max(len(systems), 1)
    values = {(row.case, row.system): row.values for row in result.rows}
    for ax, metric in zip(axes.flat, result.metrics):
        for i, system in enumerate(systems):
            heights = [values.get((case, system), {}).get(metric.name, 0.0) for case in cases]
            ax.bar([c + (i - (len(systems) - 1) / 2) * width for c in range(len(cases))], heights, width, label=system)
        ax.set_xticks(range(len(cases)), cases, rotation=30 if len(cases) > 4 else 0, ha="right" if len(cases) > 4 else "center")
        better = "higher" if metric.higher_is_better else "lower"
        ax.set_title(f"{metric.name} ({metric.unit}; {better} is better)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(result.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isnan(value):
        return "n/a"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def round_ratios(pie: Row | None, baseline: Row | None, metric: Metric) -> list[float]:
    """The ratio in each round, where both rows kept their rounds (`<metric>_rounds`, in
    round order: the two systems ran one after the other in each). On a VM whose speed
    drifts 1.3-1.6x within an hour these pairs are steadier than the medians' ratio, and
    their range shows how far one run can be trusted."""
    key = f"{metric.name}_rounds"
    a = pie.extra.get(key) if pie is not None else None
    b = baseline.extra.get(key) if baseline is not None else None
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or len(a) < 2:
        return []
    pairs = [ratio(x, y, metric) for x, y in zip(a, b) if isinstance(x, (int, float)) and isinstance(y, (int, float))]
    return [r for r in pairs if not math.isnan(r)]


def table(result: Result, metric: Metric) -> list[str]:
    systems = systems_of(result)
    pies = [s for s in systems if s.startswith("pie")]
    baselines = [s for s in systems if not s.startswith("pie")]
    pairs = [(p, b) for p in pies for b in baselines]
    header = ["case", *systems, *(f"{p} vs {b}" for p, b in pairs)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = {(row.case, row.system): row for row in result.rows}
    values = {key: row.values.get(metric.name) for key, row in rows.items()}
    for case in dict.fromkeys(row.case for row in result.rows):
        cells = [case, *(_fmt(values.get((case, s))) for s in systems)]
        for p, b in pairs:
            pv, bv = values.get((case, p)), values.get((case, b))
            if pv is None or bv is None:
                cells.append("—")
                continue
            spread = round_ratios(rows.get((case, p)), rows.get((case, b)), metric)
            cells.append(f"{ratio(pv, bv, metric):.2f}×"
                         + (f" ({min(spread):.2f}–{max(spread):.2f})" if spread else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def counts_table(result: Result) -> list[str]:
    """The work behind the figures (Result.counts) in one table, a row per case and quantity:
    one value where every round did the same, else the range."""
    systems = systems_of(result)
    extra = {(row.case, row.system): row.extra for row in result.rows}

    def cell(value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, list):
            low, high = min(value), max(value)
            return _fmt(low) if low == high else f"{_fmt(low)}–{_fmt(high)}"
        return _fmt(value)

    keys = [key for key in result.counts if any(key in e for e in extra.values())]
    if not keys:
        return []
    lines = ["**work done** (what each system was asked and did; not a figure of merit)", "",
             "| case | quantity | " + " | ".join(systems) + " |", "|" + "---|" * (len(systems) + 2)]
    for case in dict.fromkeys(row.case for row in result.rows):
        for key in keys:
            cells = [cell(extra.get((case, s), {}).get(key)) for s in systems]
            if any(c != "—" for c in cells):
                lines.append("| " + " | ".join([case, key.replace("_", " "), *cells]) + " |")
    return lines + [""]


def machine_lines(newest: dict[str, Any], run: dict[str, Any] | None) -> list[str]:
    m = newest["machine"]
    flags = ", ".join(f"{flag} {'yes' if on else 'no'}" for flag, on in m.get("cpu_flags", {}).items())
    lines = ["## Machine, versions and settings", ""]
    if run:
        lines.append(f"- Run: `{run['command']}`, {run['started']} → {run['finished']}, "
                     f"**{run['duration_s'] / 60:.0f} min**; workloads {', '.join(run['workloads'])}.")
    lines += [f"- {cpu_label(m)}: {flags}; {m['cores']} cores, {m['memory_gb']} GB RAM; Python {m['python']}, "
              f"torch {m.get('torch')}; {m['os']}",
              f"- dtype {newest['dtype']}, model {newest['model']}"]
    for name, version in newest["versions"].items():
        settings = newest.get("system_settings", {}).get(name, {})
        lines.append(f"- {name}: {version}" + "".join(f"; {k}: {v}" for k, v in settings.items()))
    for name, reason in newest["not_run"].items():
        lines.append(f"- {name}: {reason}")
    return lines + [""]


def render(out: Path, results_md: Path, order: tuple[str, ...]) -> str:
    """RESULTS.md from every JSON in `out`: the harness's workloads, then the scripts'."""
    runs = load_results(out, order)
    run_path = out / RUN
    run = json.loads(run_path.read_text()) if run_path.is_file() else None
    lines = ["# Benchmark results", "",
             "Generated by `python -m benchmarks` (see docs/benchmarks.md); do not edit by hand.",
             "Medians over alternating rounds. Ratios are × in Pie's favour: > 1 Pie is better;",
             "in brackets, the least and greatest ratio of one round's pair (the systems ran one after",
             "the other in each round), where a workload keeps its rounds.", ""]
    scripts = {name: json.loads((out / f"{name}.json").read_text())
               for name in [*SCRIPTS, *VARIANTS, *GPU_FILES] if (out / f"{name}.json").is_file()}
    if runs:
        lines += machine_lines(max(runs, key=lambda r: r["date"]), run)
    # Sessions run on different machines: say so before any figure. By family/model too, as a
    # VM's model name may be the vendor's alone ("AMD EPYC" for a Zen 4 and a Zen 5).
    cpus = sorted({cpu_label(m) for m in [*(r.get("machine", {}) for r in runs), *(d.get("meta", d) for d in scripts.values())]
                   if m.get("cpu")})
    if len(cpus) > 1:
        lines += [f"**These results come from {len(cpus)} machines ({'; '.join(cpus)}):** each section "
                  "names its CPU; compare figures only within one machine.", ""]
    for data in runs:
        result = _result(data)
        lines += [f"## {result.title}", "",
                  f"`{data['workload']}.json`, {data['date']}, {cpu_label(data.get('machine', {}))}, "
                  f"rounds {data['rounds']}{', quick' if data['quick'] else ''}."]
        if result.rows:
            lines.append(f"![{result.workload}]({os.path.relpath(out / (result.workload + '.png'), results_md.parent)})")
        lines.append("")
        for metric in result.metrics if result.rows else []:
            lines += [f"**{metric.name}** ({metric.unit}, {'higher' if metric.higher_is_better else 'lower'} is better)", ""]
            lines += table(result, metric) + [""]
        lines += counts_table(result)
        lines += [f"- {note}" for note in result.notes] + ([""] if result.notes else [])
    images = os.path.relpath(out, results_md.parent)  # the scripts' sections link results/NAME.png
    for name, data in scripts.items():
        lines += [line.replace("](results/", f"]({images}/") for line in section(name, data)]
    if ANALYSIS.is_file():
        lines += [ANALYSIS.read_text().rstrip(), ""]
    text = "\n".join(lines)
    results_md.write_text(text)
    return text


def run_info(quick: bool, rounds: int, dtype: str, model: str, versions: dict[str, str],
             not_run: dict[str, str], system_settings: dict[str, dict[str, str]]) -> dict[str, Any]:
    return {"quick": quick, "rounds": rounds, "dtype": dtype, "model": model, "versions": versions,
            "system_settings": system_settings, "not_run": not_run, "machine": machine()}
