"""Render a model's Jinja chat template the way HF transformers does (sandboxed)."""

from __future__ import annotations

from functools import lru_cache

from jinja2 import Template
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


@lru_cache(maxsize=16)
def _compiled(template: str) -> Template:
    """The template compiled once: a sandbox and a compile per call cost ~2.8 ms of every
    `text_completion` (its `apply-chat-template` call, measured with 16 at once)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat(
    template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> str:
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def chat_prompt(template: str, user: str, system: str | None = None) -> str:
    """One user turn (after an optional system turn), ready for the assistant's reply."""
    messages = [{"role": "system", "content": system}] if system else []
    return render_chat(template, messages + [{"role": "user", "content": user}])
