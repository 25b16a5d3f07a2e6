"""What every benchmark script records about its run next to its figures: the machine (CPU
model and the flags that decide which kernels run, cores, versions, load), the command, and
the order in which systems were measured in each round (rotated, so none is always first)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import urllib.request
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pie.client import http_url

# The /proc/cpuinfo flags that decide which kernels torch (oneDNN) runs: bf16 matmuls are
# emulated without avx512_bf16 or AMX, int8 ones (weight_dtype = int8) want avx512_vnni or AMX,
# so a figure means little without them.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")

# AMD's microarchitectures by (family, model ranges), as Linux's arch/x86/kernel/cpu/amd.c
# tells them apart (X86_FEATURE_ZEN1 ... ZEN5). A VM's "model name" may be only "AMD EPYC",
# and results of a Zen 5 were once filed and described as a Zen 4's
# (benchmarks/results/epyc-zen5/), so every result records this next to the raw numbers.
_AMD_ZEN: dict[int, tuple[tuple[str, tuple[tuple[int, int], ...]], ...]] = {
    0x17: (("Zen/Zen+", ((0x00, 0x2F), (0x50, 0x5F))),
           ("Zen 2", ((0x30, 0x4F), (0x60, 0x7F), (0x90, 0x91), (0xA0, 0xAF)))),
    0x19: (("Zen 3", ((0x00, 0x0F), (0x20, 0x2F), (0x40, 0x5F))),
           ("Zen 4", ((0x10, 0x1F), (0x60, 0x7F), (0xA0, 0xAF)))),
    0x1A: (("Zen 5", ((0x00, 0x2F), (0x40, 0x4F), (0x60, 0x7F))),),
}


def cpu_microarchitecture(vendor: str, family: int | None, model: int | None) -> str | None:
    """The microarchitecture of a CPU from /proc/cpuinfo's vendor_id, "cpu family" and
    "model" (AMD only: "Zen 4" for family 25 model 17); None where the mapping does not know
    it (Intel's models are not mapped here). Results folders are named from it
    (docs/benchmarks.md)."""
    if vendor != "AuthenticAMD" or family is None or model is None:
        return None
    for name, ranges in _AMD_ZEN.get(family, ()):
        if any(low <= model <= high for low, high in ranges):
            return name
    return "Zen (family 17h)" if family == 0x17 else None


def cpu_label(m: dict) -> str:
    """A recorded machine's CPU as a reader should see it: "AMD EPYC (family 26 model 2, Zen 5)";
    files written before `cpu_microarchitecture` was recorded get it from their family/model."""
    cpu = m.get("cpu") or "CPU not recorded"
    if not m.get("cpu_family_model"):
        return cpu
    family, _, model = m["cpu_family_model"].partition("/")
    arch = m.get("cpu_microarchitecture")
    if arch is None and cpu.startswith("AMD") and family.isdigit() and model.isdigit():
        arch = cpu_microarchitecture("AuthenticAMD", int(family), int(model))
    return f"{cpu} (family {family} model {model}" + (f", {arch})" if arch else ")")


def machine_settings() -> dict:
    """CPU model (with its family and model numbers and the microarchitecture they mean: a VM
    may name only the vendor, "AMD EPYC" for Zen 1, Zen 4 and Zen 5 alike), which of CPU_FLAGS
    it has, cores, torch and Python versions, and the load averages (1, 5, 15 min) when the
    run ended — others' work on a shared machine skews every figure: what every benchmark
    script records next to its figures."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []

    def field(name: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lines
                     if line.split(":", 1)[0].strip() == name), "")

    flags = set(field("flags").split())
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    family, model = field("cpu family"), field("model")
    return {"cpu": field("model name") or platform.processor() or platform.machine(),
            "cpu_family_model": f"{family}/{model}" if family else None,
            "cpu_microarchitecture": cpu_microarchitecture(field("vendor_id"), int(family) if family.isdigit() else None,
                                                           int(model) if model.isdigit() else None),
            "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS}, "cores": os.cpu_count(),
            "torch": torch_version, "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def rotated(items: list, round_: int) -> list:
    """`items` in the order round `round_` measures them: each round starts one further on,
    so no system is always first (warm caches, the turbo budget, a neighbour's burst)."""
    shift = round_ % len(items)
    return list(items[shift:]) + list(items[:shift])


def alternate(order: list[list[str]], calls: dict[str, Callable[[], object]], repeats: int = 1) -> dict[str, list[float]]:
    """Seconds each call took, per side: each round of `order` runs every side's call
    `repeats` times in that round's order (`rotated`), so no side always goes first."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for names in order:
        for name in names:
            for _ in range(repeats):
                started = time.perf_counter()
                calls[name]()
                seconds[name].append(time.perf_counter() - started)
    return seconds


def write_results(out: str | Path, results: dict) -> None:
    """A script's results as indented JSON at `out` (its folder made if missing)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


def command_line() -> str:
    return " ".join(["python", *sys.argv])


def served_model(url: str) -> str | None:
    """The model a running server serves (its /health), None if it does not say."""
    with urllib.request.urlopen(f"{http_url(url)}/health", timeout=10) as response:
        return json.loads(response.read()).get("model")


def served_model_files() -> tuple[Path, str]:
    """The default model's directory (as `pie serve` resolves it) and its chat template:
    what the client-side application scripts render their prompts with."""
    from pie.backend.weights import resolve_model_dir
    from pie.config import load_config

    config = load_config()
    model_dir = resolve_model_dir(config.model.path, config.paths.cache)
    return model_dir, json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
