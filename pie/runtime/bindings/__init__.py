"""The host side of the WIT world `pie:inferlet/inferlet` (sdk/wit): one module per WIT
interface, each registering its functions on one linker shared by every instance. A call
finds its instance's `HostState` (and through it the `InstanceSession` of pie/control) from
the store it runs in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wasmtime import Engine
from wasmtime.component import Linker

from pie.control.controller import Controller
from pie.runtime.bindings import (
    allocate,
    forward,
    futures,
    grammar,
    http,
    inference,
    input_image,
    input_text,
    kvs,
    memory,
    messaging,
    output_text,
    runtime,
    scheduling,
    tokenize,
    types,
)
from pie.runtime.bindings.common import Bindings
from pie.runtime.host import HostState

MODULES = (types, futures, runtime, messaging, kvs, http, allocate, forward, input_text,
           input_image, tokenize, output_text, grammar, inference, memory, scheduling)


def build_linker(engine: Engine, controller: Controller, lookup: Callable[[Any], HostState]) -> Linker:
    """One linker for every instance: each host function finds its instance through the store."""
    linker = Linker(engine)
    b = Bindings(controller, lookup)
    with linker.root() as root:
        for module in MODULES:
            module.register(root, b)
    return linker
