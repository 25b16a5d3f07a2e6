"""The interpreter inferlet behind `pie run --interpret FILE.py`: runs a Python inferlet from
its source, sent at launch, with no build.

A `pie build` snapshots CPython with the program's modules in it (componentize-py, ~9 s)
and the server compiles the new component to machine code (~7-12 s): ~21 s from a one-line
edit to a running program (benchmarks/results/frontends.json). This component is built and
compiled once (it changes only with the SDK); each launch gets the program as its first
argument, a JSON bundle {"main": MODULE, "files": {MODULE: SOURCE, ...}} (the file and its
sibling .py files), which it compiles and imports from memory, then calls `main` with the
remaining arguments: the edit loop costs a launch. Differences from a built program: module
top-level code runs at launch, not at build; the standard-library modules it can import are
those imported below (and whatever they import), not whatever the program imports at its
top; tracebacks and end reasons name the program's files as usual.
"""

import argparse  # noqa: F401  (the standard library an inferlet may import: loaded here, at build time)
import base64  # noqa: F401
import bisect  # noqa: F401
import collections  # noqa: F401
import copy  # noqa: F401
import dataclasses  # noqa: F401
import datetime  # noqa: F401
import enum  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import hashlib  # noqa: F401
import heapq  # noqa: F401
import html  # noqa: F401
import importlib
import importlib.util
import itertools  # noqa: F401
import json
import math  # noqa: F401
import random  # noqa: F401
import re  # noqa: F401
import statistics  # noqa: F401
import string  # noqa: F401
import sys
import textwrap  # noqa: F401
import time  # noqa: F401
import typing  # noqa: F401
import urllib.parse  # noqa: F401

import inferlet  # noqa: F401  (the SDK, for the program to import)
import inferlet.semvar  # noqa: F401
import inferlet.workflow  # noqa: F401

# Where the program's files appear to be: this file's folder, so that the SDK's end reasons
# attribute frames to the program's own code (inferlet.errors.describe).
HOME = __file__.rpartition("/")[0] + "/"


class SourceLoader:
    """Loads one module of the bundle from its source text."""

    def __init__(self, name: str, source: str):
        self.name, self.source = name, source

    def create_module(self, spec):
        """The default module object."""
        return None

    def exec_module(self, module) -> None:
        """Compile and run the module's source in it."""
        module.__file__ = f"{HOME}{self.name}.py"
        exec(compile(self.source, module.__file__, "exec"), module.__dict__)


class BundleFinder:
    """Finds the bundle's modules (first on sys.meta_path while the program runs)."""

    def __init__(self, files: dict[str, str]):
        self.files = files

    def find_spec(self, name: str, path=None, target=None):
        """A spec for a module of the bundle; None for any other."""
        if name not in self.files:
            return None
        return importlib.util.spec_from_loader(name, SourceLoader(name, self.files[name]))


def main(args: list[str]) -> None:
    if not args:
        raise ValueError("the interpreter needs a program bundle as its first argument (pie run --interpret FILE.py)")
    bundle = json.loads(args[0])
    sys.meta_path.insert(0, BundleFinder(bundle["files"]))
    sys.argv = [f"{bundle['main']}.py", *args[1:]]
    program = importlib.import_module(bundle["main"])
    if not callable(getattr(program, "main", None)):
        raise ValueError(f"{bundle['main']}.py defines no main(args) function")
    program.main(args[1:])
