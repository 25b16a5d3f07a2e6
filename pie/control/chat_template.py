"""Render a model's Jinja chat template the way HF transformers does (sandboxed)."""

from __future__ import annotations

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def render_chat(
    template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True
) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def chat_prompt(template: str, user: str, system: str | None = None) -> str:
    """One user turn (after an optional system turn), ready for the assistant's reply."""
    messages = [{"role": "system", "content": system}] if system else []
    return render_chat(template, messages + [{"role": "user", "content": user}])
