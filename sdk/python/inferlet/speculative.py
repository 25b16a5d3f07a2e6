"""Speculative decoding (the twin of Rust's `inferlet::speculative`): a cheap drafter guesses
the next tokens, one forward pass verifies them all (an output at every drafted position,
sampled greedily), and the longest prefix the model agrees with is kept, plus the model's
own token after it. The output equals plain greedy decoding; each pass yields one token or
more."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferlet.futures import wait_all
from inferlet.sampling import Sampler, Stop

__all__ = ["MAX_DRAFT", "Drafter", "JacobiDrafter", "NgramDrafter", "Speculation", "generate_speculative"]

MAX_DRAFT = 8  # the most drafted tokens verified by one pass


class Drafter:
    """Guesses how the token sequence continues."""

    def draft(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` guessed next tokens after `tokens` (the whole sequence so far)."""
        raise NotImplementedError

    def feedback(self, draft: list[int], predicted: list[int], accepted: int) -> None:
        """Told after each verification: the draft, the model's greedy token after each
        prefix of it (one more than the draft), and how many drafted tokens were accepted."""


class NgramDrafter(Drafter):
    """Prompt lookup: the most recent earlier occurrence of the sequence's last `n` tokens
    (then shorter suffixes down to 1), and what followed it."""

    def __init__(self, n: int):
        self.n = n

    def draft(self, tokens: list[int], max_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix."""
        for n in range(min(self.n, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + max_tokens]
        return []


class JacobiDrafter(Drafter):
    """Jacobi decoding as a drafter: the guess for the next `n` tokens is the model's own
    output for those positions in the previous pass, padded by repeating the last token."""

    def __init__(self, n: int):
        self.n = n
        self.guess: list[int] = []

    def draft(self, tokens: list[int], max_tokens: int) -> list[int]:
        """The previous pass's outputs after the accepted ones, padded to `n`."""
        size = min(self.n, max_tokens)
        guess, self.guess = self.guess[:size], []
        pad = guess[-1] if guess else (tokens[-1] if tokens else None)
        return guess + [pad] * (size - len(guess)) if pad is not None else guess

    def feedback(self, draft: list[int], predicted: list[int], accepted: int) -> None:
        """Keep the model's outputs after the accepted prefix as the next guess."""
        self.guess = predicted[accepted + 1:]


@dataclass
class Speculation:
    """What `generate_speculative` produced: the text and tokens (without the EOS token),
    verification passes (`steps`; the first also runs the prompt), drafted and accepted
    tokens in total."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


def generate_speculative(ctx, drafter: Drafter, stop: Stop) -> Speculation:
    """Greedy decoding of `ctx` (which must have a pending token, e.g. after `fill_chat`)
    until `stop`, verifying `drafter`'s guesses: per step, one forward pass over the pending
    tokens plus the draft with an output at the last pending token and every drafted one;
    the accepted prefix and the model's next token are kept, the rest truncated away."""
    out, greedy = Speculation(), Sampler.greedy()
    while len(out.tokens) < stop.max_tokens:
        room = stop.max_tokens - len(out.tokens) - 1
        draft = drafter.draft(ctx.tokens, min(room, MAX_DRAFT))[:min(room, MAX_DRAFT)]
        base = len(ctx)
        ctx.fill_tokens(draft)
        pending = len(ctx.pending)
        embeds = ctx.forward_pending(list(range(pending - len(draft) - 1, pending)))
        predicted = wait_all([ctx.queue.sample(e, greedy) for e in embeds])
        accepted = next((i for i, (d, p) in enumerate(zip(draft, predicted)) if d != p), len(draft))
        drafter.feedback(draft, predicted, accepted)
        out.steps, out.drafted, out.accepted = out.steps + 1, out.drafted + len(draft), out.accepted + accepted
        ctx.truncate(base + accepted)
        ctx.fill_tokens([predicted[accepted]])  # the accepted tokens are committed; the bonus stays pending
        ended = False
        for token in predicted[:accepted + 1]:
            if token in stop.eos:
                ended = True
                break
            out.tokens.append(token)
            if len(out.tokens) >= stop.max_tokens:
                break
        if ended:
            break
        if stop.strings and (cut := stop.cut(ctx.queue.detokenize(out.tokens))) is not None:
            out.text = cut
            return out
    out.text = ctx.queue.detokenize(out.tokens)
    return out
