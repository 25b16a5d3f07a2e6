"""The host bindings (pie/runtime/bindings/, one module per WIT interface) register exactly
the functions the WIT declares: none missing, none extra, none under a wrong interface."""

from __future__ import annotations

import re

from test_wit_api import gen

from pie.runtime.bindings import MODULES
from pie.runtime.bindings.common import Bindings


class _Interface:
    def __init__(self, registered: set, name: str):
        self.registered, self.name = registered, name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_func(self, name, func):
        self.registered.add((self.name, name))

    def add_resource(self, name, kind, drop):
        pass


class _Root:
    def __init__(self):
        self.registered: set[tuple[str, str]] = set()

    def add_instance(self, package: str) -> _Interface:
        return _Interface(self.registered, re.fullmatch(r"pie:inferlet/(.+)@0\.1\.0", package)[1])


class _Controller:
    class config:  # what messaging reads at registration
        class server:
            max_message_bytes = 1

    tokenizer = None


def test_bindings_register_exactly_the_wit_functions():
    root = _Root()
    b = Bindings(_Controller(), lambda store: None)  # type: ignore[arg-type]
    for module in MODULES:
        module.register(root, b)
    api = gen.load_api(gen.resolve_wit())
    declared = {(f.interface, f"[method]{f.name}" if f.is_method else f.name)
                for f in api.functions if not f.is_export}
    assert root.registered == declared
    assert len({m.__name__ for m in MODULES}) == len(MODULES)  # one module per interface
