"""SGLang's `select`: which of several multi-token choices the model finds likeliest.

Each choice's tokens are scored after the context's pending tokens in one pass that writes
no KV (an output per choice token, with that token's log-probability); every choice's pass
is enqueued before any is awaited, so they share a batch, and the context is unchanged.
How a choice's token log-probabilities become its score is the known trap of `select`:
"sum" favours short choices, "mean" per token (SGLang's default) favours choices whose
later tokens are predictable once begun, and "unconditional" scores each token by how much
the context raises it: log p(token | context) - log p(token | a fresh start), averaged
(SGLang's unconditional-likelihood normalisation). The fresh start is the model's first EOS
token alone, the start of a new document for most models.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferlet.errors import Error

__all__ = ["NORMALIZE", "Selection", "select"]

NORMALIZE = ("sum", "mean", "unconditional")


@dataclass
class Selection:
    """The chosen `index` and `text`, every choice's `scores` (as normalised) and each
    choice's per-token log-probabilities after the context (`logprobs`)."""

    index: int
    text: str
    scores: list[float]
    logprobs: list[list[float]]


def select(ctx, choices: list[str], normalize: str = "mean") -> Selection:
    """`Context.select`: needs a pending token (fill the prompt, do not flush it), since the
    first token of each choice is predicted from it."""
    from inferlet.context import _logprobs, _output  # here: context imports this module (already loaded)

    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, not {normalize!r}")
    if not choices:
        raise ValueError("select needs at least one choice")
    if not ctx.pending:
        raise Error("invalid-argument", "select predicts each choice from the pending tokens: fill the "
                    "prompt and do not flush it")
    tokenized = [ctx.queue.tokenize(c) for c in choices]
    if empty := [c for c, t in zip(choices, tokenized) if not t]:
        raise ValueError(f"choices without tokens: {empty!r}")
    last = len(ctx.pending) - 1
    passes = [ctx._peek_outputs(t, [_output(index=last + i, logprobs_of=[tok]) for i, tok in enumerate(t)])
              for t in tokenized]
    fresh = []
    if normalize == "unconditional":
        start = ctx.queue.eos_tokens()[:1] or [0]
        fresh = [ctx._fresh_pass(start + t, [_output(index=i, logprobs_of=[tok]) for i, tok in enumerate(t)])
                 for t in tokenized]
    logprobs = [_logprobs(ctx._peeked(p)) for p in passes]
    if fresh:
        alone = [_logprobs(ctx._peeked(p)) for p in fresh]
        scores = [sum(a - b for a, b in zip(c, u)) / len(c) for c, u in zip(logprobs, alone)]
    else:
        scores = [sum(c) / (len(c) if normalize == "mean" else 1) for c in logprobs]
    best = max(range(len(choices)), key=lambda i: scores[i])
    return Selection(best, choices[best], scores, logprobs)
