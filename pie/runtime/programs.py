"""Programs (inferlet components) keyed by the SHA-256 of their bytes, compiled once.

Compiled artifacts are cached on disk (`<cache>/programs/<hash>.cwasm`), so a restart
deserializes (~3 ms) instead of recompiling; loaded components stay in memory.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

from wasmtime import Engine, WasmtimeError
from wasmtime.component import Component

log = logging.getLogger("pie.runtime")


class InvalidProgram(ValueError):
    """Bytes that are not a valid WebAssembly component for this runtime."""


class ProgramStore:
    def __init__(self, engine: Engine, cache_dir: Path):
        self.engine = engine
        self.dir = cache_dir / "programs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.loaded: dict[str, Component] = {}
        self.builtins: dict[str, str] = {}  # name -> hash

    def add(self, data: bytes) -> str:
        """Compile and cache `data`; return its hash (idempotent)."""
        digest = hashlib.sha256(data).hexdigest()
        if self.exists(digest):
            return digest
        try:
            component = Component(self.engine, data)
        except WasmtimeError as e:
            raise InvalidProgram(f"not a valid inferlet component: {str(e).splitlines()[0]}") from None
        artifact = self.dir / f"{digest}.cwasm"
        partial = artifact.with_suffix(".partial")
        partial.write_bytes(component.serialize())
        partial.rename(artifact)
        with self.lock:
            self.loaded[digest] = component
        return digest

    def add_builtin(self, name: str, path: Path) -> str:
        digest = self.add(path.read_bytes())
        self.builtins[name] = digest
        return digest

    def builtin_names(self) -> list[str]:
        return sorted(self.builtins)

    def exists(self, digest: str) -> bool:
        return digest in self.loaded or (self.dir / f"{digest}.cwasm").is_file()

    def resolve(self, program: str) -> str:
        """A built-in name or a hash → the hash, or KeyError."""
        digest = self.builtins.get(program, program)
        if not self.exists(digest):
            raise KeyError(program)
        return digest

    def load(self, digest: str) -> Component:
        with self.lock:
            component = self.loaded.get(digest)
        if component is None:
            component = Component.deserialize_file(self.engine, str(self.dir / f"{digest}.cwasm"))
            with self.lock:
                self.loaded[digest] = component
        return component
