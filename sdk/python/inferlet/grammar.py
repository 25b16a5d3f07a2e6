"""Grammar-constrained generation: the output is guaranteed to parse (the twin of Rust's
`inferlet::Grammar`).

The host compiles the grammar for the model's tokenizer (llguidance) and masks every draw to
the tokens the grammar allows next; `Context.generate(sampler, stop, grammar=g)` runs on the
host with the matcher advanced there, so the inferlet is not woken per token. Put the EOS
tokens in `stop.eos`: once the grammar is complete only they are allowed.
"""

from __future__ import annotations

import json

from wit_world.imports import grammar

from inferlet.errors import host

__all__ = ["Grammar"]


class Grammar:
    """A compiled grammar and its parse state over the output so far (one output: compile
    another for another generation)."""

    def __init__(self, queue, kind: grammar.GrammarKind, source: str):
        self.queue = queue
        self.matcher = host(grammar.compile, queue.raw, kind, source)

    @staticmethod
    def json_schema(queue, schema: str | dict) -> Grammar:
        """Output that is JSON valid against `schema` (JSON Schema, as text or a dict)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return Grammar(queue, grammar.GrammarKind.JSON_SCHEMA, text)

    @staticmethod
    def regex(queue, pattern: str) -> Grammar:
        """Output that matches `pattern` as a whole (Rust regex syntax)."""
        return Grammar(queue, grammar.GrammarKind.REGEX, pattern)

    @staticmethod
    def lark(queue, source: str) -> Grammar:
        """Output in the language of a Lark grammar (`start: ...`)."""
        return Grammar(queue, grammar.GrammarKind.LARK, source)

    @staticmethod
    def ebnf(queue, source: str) -> Grammar:
        """Output in the language of an EBNF grammar in GBNF notation (`root ::= ...`)."""
        return Grammar(queue, grammar.GrammarKind.EBNF, source)

    @staticmethod
    def choices(queue, options: list[str]) -> Grammar:
        """Output that is exactly one of `options` (a regex alternation of the literals)."""
        if not options:
            raise ValueError("Grammar.choices needs at least one option")
        return Grammar.regex(queue, "|".join(_regex_literal(o) for o in options))

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        return self.matcher.is_accepting()

    def id(self) -> int:
        """The matcher's id, as passes name it (`grammar-mask.matcher`)."""
        return self.matcher.id()


def _regex_literal(text: str) -> str:
    """`text` as a regex matching only itself (Rust regex syntax)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)
