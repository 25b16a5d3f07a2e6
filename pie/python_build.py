"""Build a Python inferlet (a module with `def main(args)`) into a component.

componentize-py embeds CPython and the program's modules into one component of the
`pie:inferlet` world; `--stub-wasi` leaves it without WASI imports, as the world requires.
Builds are cached by content (the program's directory, the SDK, the WIT and the tool's
version), so rebuilding an unchanged program is instant; the server separately caches the
compiled machine code by the component's hash.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tempfile
from pathlib import Path

from pie.config import PathsConfig
from pie.toolchain import REPO, WIT_DIR, WORLD, ToolchainError, find_tool, say

SDK_DIR = REPO / "sdk" / "python"
# The interpreter inferlet of `pie run --interpret` (built like any Python inferlet, once).
INTERPRETER = SDK_DIR / "runner" / "interpret.py"
# The most source `python_bundle` sends as a launch argument (the server reads frames of at
# least 1 MiB); a bigger program is built instead.
MAX_BUNDLE_BYTES = 512 * 1024
ENTRY = """\
import wit_world
import inferlet
import {module} as program


class WitWorld(wit_world.WitWorld):
    def run(self) -> None:
        inferlet.run_main(program.main)
"""


def build_python_inferlet(source: Path, console=None, cache: Path | None = None) -> Path:
    """Build `source` (my_inferlet.py) into a component; returns the cached component's path."""
    source = _checked_source(source)
    module = source.stem
    if not module.isidentifier():
        raise ToolchainError(f"{source.name}: the file name must be a Python module name")
    tool = find_tool("componentize-py", "componentize-py")
    key = _content_key(source, tool)
    out_dir = (cache or PathsConfig().cache) / "python"
    component = out_dir / f"{module}-{key[:16]}.wasm"
    if component.is_file():
        say(console, f"Up to date: {component}")
        return component
    out_dir.mkdir(parents=True, exist_ok=True)
    say(console, f"Building {source.name} with componentize-py (embeds CPython; ~20 s)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pie_entry.py").write_text(ENTRY.format(module=module))
        partial = component.with_suffix(".partial")
        cmd = [tool, "-d", str(WIT_DIR), "-w", WORLD, "componentize", "--stub-wasi",
               "-p", tmp, "-p", str(SDK_DIR), "-p", str(source.parent), "pie_entry", "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ToolchainError(f"componentize-py failed for {source}:\n{done.stderr[-3000:]}")
        partial.rename(component)
    say(console, f"Built {component} ({component.stat().st_size / 2**20:.1f} MB)")
    return component


def _checked_source(source: Path) -> Path:
    """`source` resolved, once it is known to be an existing .py file."""
    source = Path(source).resolve()
    if source.suffix != ".py":
        raise ToolchainError(f"{source} is not a Python file (a Python inferlet is a .py module with `def main(args)`)")
    if not source.is_file():
        raise ToolchainError(f"no such file: {source}")
    return source


def _content_key(source: Path, tool: str) -> str:
    """A hash of everything the component is made from."""
    digest = hashlib.sha256()
    version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    digest.update(version.encode())
    files = sorted(source.parent.glob("*.py")) + sorted(SDK_DIR.rglob("*.py")) + sorted(WIT_DIR.glob("*.wit"))
    for path in files:
        digest.update(str(path.name).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def python_bundle(source: Path) -> str:
    """`source` and the other .py files of its folder as the interpreter's first argument:
    {"main": MODULE, "files": {MODULE: SOURCE, ...}} (sdk/python/runner/interpret.py)."""
    source = _checked_source(source)
    files = {path.stem: path.read_text() for path in sorted(source.parent.glob("*.py")) if path.stem.isidentifier()}
    text = json.dumps({"main": source.stem, "files": files})
    if len(text.encode()) > MAX_BUNDLE_BYTES:
        raise ToolchainError(f"{source.parent} holds {len(text.encode()) // 1024} KiB of Python, over the "
                             f"{MAX_BUNDLE_BYTES // 1024} KiB --interpret sends at launch: build it (pie run without --interpret)")
    return text
