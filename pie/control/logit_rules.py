"""`inference.logit-rules`: one output's bias, penalties and bans, as the sparse additive
bias the backend applies to its logits row before sampling (`Passes.bias_*`).

Why here and not in the backend: the penalties depend on what the sequence has drawn, and
in a host-side run only the control layer sees each draw (`Pass.advance` calls `seen`), so
the backend stays stateless — one sparse `logits[row, ids] += values` per row. A run of
N steps sends at most (bias + distinct tokens drawn + banned) entries a step.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from pie.control.errors import ErrorKind, HostError


@dataclass(slots=True, eq=False)
class LogitRules:
    bias: list[tuple[int, float]] = field(default_factory=list)
    presence: float = 0.0
    frequency: float = 0.0
    counts: Counter[int] = field(default_factory=Counter)  # token -> times seen
    banned: list[int] = field(default_factory=list)
    banned_until: int = 0

    @classmethod
    def of(cls, bias: list[tuple[int, float]], presence: float, frequency: float, seen: list[int],
           banned: list[int], banned_until: int) -> LogitRules:
        return cls(list(bias), presence, frequency, Counter(seen), list(banned), banned_until)

    def validate(self, vocab: int, max_entries: int) -> None:
        """Errors (invalid-argument) name the field: an id outside the vocabulary, a value
        that is not a finite number, more entries than the model's context holds."""
        def invalid(message: str) -> HostError:
            return HostError(ErrorKind.INVALID_ARGUMENT, f"logit-rules: {message}")

        for name, ids in (("bias", [t for t, _ in self.bias]), ("seen", list(self.counts)), ("banned", self.banned)):
            if any(not 0 <= t < vocab for t in ids):
                raise invalid(f"a {name} token id is not below the vocabulary size {vocab}")
        if len(self.bias) > vocab or self.counts.total() > max_entries or len(self.banned) > vocab:
            raise invalid(f"at most {vocab} bias and banned entries and {max_entries} seen tokens")
        if not all(math.isfinite(v) for _, v in self.bias):
            raise invalid("every bias must be a finite number")
        if not (math.isfinite(self.presence) and math.isfinite(self.frequency)):
            raise invalid("the penalties must be finite numbers")

    def see(self, token: int) -> None:
        """A run drew `token`: it counts for the penalties and toward `banned_until`."""
        self.counts[token] += 1

    def entries(self) -> tuple[list[int], list[float]]:
        """This step's (token ids, additive biases); a banned token gets -inf."""
        ids = [t for t, _ in self.bias]
        values = [v for _, v in self.bias]
        if self.presence or self.frequency:
            for token, count in self.counts.items():
                ids.append(token)
                values.append(-(self.presence + self.frequency * count))
        if self.banned and self.counts.total() < self.banned_until:
            ids += self.banned
            values += [-math.inf] * len(self.banned)
        return ids, values
