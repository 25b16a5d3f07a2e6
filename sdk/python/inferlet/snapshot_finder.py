"""Imports at run time: only what the build imported.

`pie build` (componentize-py) runs the inferlet's module at build time and snapshots the
initialized interpreter; at run time the component has no file system, so importing a
module that is not already loaded would make CPython probe `sys.path` and trap ("wasm
`unreachable` instruction executed"). `SnapshotFinder`, first on `sys.meta_path` while
`main` runs, turns that into an `ImportError` that says what to do. At build time the SDK
runs argparse once through its usage, help and error paths, so that the modules it imports
inside functions (which differ between Python versions: `shutil`, `textwrap`, `locale`,
`_colorize`, `difflib`, ...) are in the snapshot and argparse works unchanged.
"""

from __future__ import annotations

import _imp
import argparse
import contextlib
import io
import sys

__all__ = ["SnapshotFinder"]


class SnapshotFinder:
    """A meta path finder that refuses modules a component would have to load from files."""

    @staticmethod
    def find_spec(name: str, path=None, target=None):
        """Refuse to load `name` from files (None for modules compiled into the interpreter)."""
        if name in sys.builtin_module_names or _imp.is_frozen(name):
            return None  # compiled in: the built-in and frozen importers load it without files
        raise ImportError(f"module {name!r} was not imported when the inferlet was built, and a "
                          f"component cannot load modules at run time (it has no file system): "
                          f"import it at the top of your module", name=name)


def _import_what_argparse_imports_lazily() -> None:
    """Exercise argparse at build time (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="warm-up", description="Loads argparse's lazy imports.")
    parser.add_argument("--number", type=int, choices=[1, 2], help="a number")
    parser.add_argument("name", nargs="?")
    parser.format_usage()
    parser.format_help()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        parser.parse_args(["--numbr", "3"])
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        parser.parse_args(["--number", "3"])


_import_what_argparse_imports_lazily()
