"""Programs (inferlet components) keyed by the SHA-256 of their bytes, compiled once.

Compiled artifacts are cached on disk (`<cache>/programs/<hash>.cwasm`), so a restart
deserializes (~3 ms) instead of recompiling; loaded components stay in memory. An artifact
that does not load with this engine (compiled by another wasmtime version or engine
configuration) is compiled again when its program is added.

Every uploaded program has owners: the users who uploaded it. Only they may launch it or
learn that it exists, unless one of them uploaded it `public` (then every user may launch
it); built-in programs are public. Owners are kept in memory: after a restart a user
uploads again (the compiled artifact is on disk, so that costs a hash, not a compile).
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


WASM_MAGIC = b"\0asm"
CORE_MODULE_VERSION = b"\x01\x00\x00\x00"  # the version field of a core module; a component's is 0d 00 01 00


def check_component_bytes(data: bytes) -> None:
    """Say what the bytes are when they are not a component at all, before wasmtime (which
    would parse anything that is not binary wasm as the text format: random bytes are "input
    was not valid utf-8", Python source "expected `(`")."""
    build = "build the inferlet with `pie build CRATE_DIR` or `pie build FILE.py` and upload the .wasm it prints"
    if not data:
        raise InvalidProgram(f"the program is empty; {build}")
    if not data.startswith(WASM_MAGIC):
        text = data[:4096]
        looks_like = ("source text" if text.isascii() and b"\0" not in text
                      else "not WebAssembly (no \\0asm header)")
        raise InvalidProgram(f"the program is {looks_like}: {len(data)} bytes starting "
                             f"{data[:8]!r}; {build}")
    if data[4:8] == CORE_MODULE_VERSION:
        raise InvalidProgram("the program is a core WebAssembly module, not a component: Pie runs "
                             "components of the pie:inferlet world; `pie build` turns the module cargo "
                             "builds into one (wasm-tools component new)")


class ProgramStore:
    def __init__(self, engine: Engine, cache_dir: Path):
        self.engine = engine
        self.dir = cache_dir / "programs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.loaded: dict[str, Component] = {}
        self.builtins: dict[str, str] = {}  # name -> hash
        self.owners: dict[str, set[str]] = {}  # hash -> users who uploaded it
        self.public: set[str] = set()  # hashes any user may launch

    def add(self, data: bytes, owner: str | None = None, public: bool = False) -> str:
        """Compile and cache `data` (once), record `owner` as one of its owners; return its
        hash. `public` lets every user launch it."""
        digest = hashlib.sha256(data).hexdigest()
        with self.lock:
            if owner is not None:
                self.owners.setdefault(digest, set()).add(owner)
            if public:
                self.public.add(digest)
        if self._cached(digest):
            return digest
        check_component_bytes(data)
        try:
            component = Component(self.engine, data)
        except WasmtimeError as e:
            cause = str(e).split("Caused by:")[-1].strip().splitlines()
            raise InvalidProgram(f"not a valid inferlet component: {cause[0].strip() if cause else e} "
                                 f"(a damaged or truncated file? build it again with `pie build`)") from None
        artifact = self.dir / f"{digest}.cwasm"
        partial = artifact.with_suffix(".partial")
        partial.write_bytes(component.serialize())
        partial.rename(artifact)
        with self.lock:
            self.loaded[digest] = component
        return digest

    def add_builtin(self, name: str, path: Path) -> str:
        digest = self.add(path.read_bytes(), public=True)
        self.builtins[name] = digest
        return digest

    def builtin_names(self) -> list[str]:
        return sorted(self.builtins)

    def visible(self, digest: str, user: str) -> bool:
        """Whether `user` may launch (and learn of) the program `digest`."""
        with self.lock:
            return digest in self.public or user in self.owners.get(digest, ())

    def exists(self, digest: str, user: str) -> bool:
        """Whether the program is stored and `user` may launch it: another user's private
        program is answered exactly like a missing one."""
        return self.visible(digest, user) and self._stored(digest)

    def _stored(self, digest: str) -> bool:
        return digest in self.loaded or (self.dir / f"{digest}.cwasm").is_file()

    def _cached(self, digest: str) -> bool:
        """Whether `digest` is loaded, or its artifact on disk loads with this engine (then
        it is kept loaded); False means it must be compiled."""
        with self.lock:
            if digest in self.loaded:
                return True
        artifact = self.dir / f"{digest}.cwasm"
        if not artifact.is_file():
            return False
        try:
            component = Component.deserialize_file(self.engine, str(artifact))
        except WasmtimeError as e:
            cause = str(e).split("Caused by:")[-1].strip().splitlines()
            log.info("compiling %s again: its cached artifact does not load (%s)", digest[:12],
                     cause[0].strip() if cause else "")
            return False
        with self.lock:
            self.loaded.setdefault(digest, component)
        return True

    def resolve(self, program: str, user: str) -> str:
        """A built-in name or a hash `user` may launch → the hash, or KeyError."""
        digest = self.builtins.get(program, program)
        if not self.exists(digest, user):
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
