"""How to pick each token (drawn on the host) and when to stop generating."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from wit_world.imports import inference, output_text


@dataclass(frozen=True)
class Sampler:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters; a seed makes
    the draw reproducible (`Context.generate` uses seed, seed + 1, ... per step)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @staticmethod
    def greedy() -> Sampler:
        """Always the most likely token."""
        return Sampler()

    @staticmethod
    def top_p_sampling(temperature: float, p: float) -> Sampler:
        """Rust's `Sampler::top_p` (the suffix: `top_p` is a field here)."""
        return Sampler(temperature=temperature, top_p=p)

    @staticmethod
    def top_k_sampling(temperature: float, k: int) -> Sampler:
        """Rust's `Sampler::top_k`."""
        return Sampler(temperature=temperature, top_k=k)

    def with_seed(self, seed: int | None) -> Sampler:
        """The same sampler with another seed."""
        return replace(self, seed=seed)

    def to_host(self) -> output_text.Sampler:
        """The WIT record for host calls that take a sampler."""
        return output_text.Sampler(self.temperature, self.top_k, self.top_p, self.seed)


@dataclass
class Stop:
    """Stop after `max_tokens`, at an EOS token (not included in the output), or once the
    output contains a stop string (cut before it)."""

    max_tokens: int
    eos: list[int] = field(default_factory=list)
    strings: list[str] = field(default_factory=list)

    def cut(self, text: str) -> str | None:
        """The output cut before the first stop string, if it contains one."""
        found = [text.find(s) for s in self.strings if s in text]
        return text[: min(found)] if found else None


@dataclass(frozen=True)
class Echo:
    """How `Context.generate(..., echo=Echo(...))` sends its text to the client while it is
    drawn (`inference.run-text`): each piece as one message `prefix`, the text (a JSON
    string literal with `json`), `suffix`. The host detokenizes and sends, holding back what
    could begin a stop string, so the inferlet is woken once at the end instead of once per
    token (~0.35 ms of control-process CPU a wake on a Zen 5, docs/fused-pass.md 2.6)."""

    prefix: str = ""
    suffix: str = ""
    json: bool = False

    def to_host(self, stop: Stop) -> inference.TextEcho:
        """The WIT record for `stop`'s strings; its EOS tokens are left out of the text."""
        return inference.TextEcho(prefix=self.prefix, suffix=self.suffix, json=self.json,
                                  stop_strings=list(stop.strings), hidden=list(stop.eos))
