"""Drawing tokens and scoring distributions from logits: one implementation for the
`sample` handler and fused passes, so both draw the same token for the same seed.

Rows are handled a batch at a time, because per-row work is what a decode step of many
sequences pays for:

- greedy rows (temperature 0) are one `argmax` over the batch (as `torch.max`'s indices, the
  same first maximum as the `argmax` HF's greedy uses, so outputs stay token-for-token equal to it);
- the other rows get their filters in batched ops (`filtered_probs`): one softmax at the
  row's temperature, one `topk` for top-k and top-p instead of a full sort of the
  vocabulary per row (a sort of 49k floats costs ~4 ms on a CPU core, a 256-wide `topk`
  ~0.15 ms), min-p against each row's maximum;
- seeded rows are then drawn one by one by `multinomial`, each from its own generator (the
  seed must decide the draw whatever else is in the batch); unseeded rows together, one
  uniform each against the cumulative distribution (`_inverse_cdf`).

The filtered probabilities are bit-for-bit those of filtering the row alone with a full
sort (softmax and `cumsum` are per row; `topk` returns the sorted prefix), so a seeded row
draws the same token in a pass of any batch as in `sample`.
"""

from __future__ import annotations

import numpy as np
import torch

# Widths tried in turn for top-p rows without top-k before the whole vocabulary: a row
# whose most likely 256 tokens already reach top_p (the usual case for an LM) costs one
# narrow `topk`; flat distributions, or top_p near 1, need the wider looks.
TOP_P_WIDTHS = (256, 4096)


def allowed_mask(mask: bytes, vocab: int) -> torch.Tensor:
    """A bool tensor over the vocabulary (True = may be drawn) from llguidance's bitmask
    layout: ceil(vocab / 32) little-endian u32 words, bit t of word w = token 32 w + t."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(bool))


def allowed_masks(masks: list[bytes], vocab: int) -> torch.Tensor:
    """`allowed_mask` of several rows at once: bool [len(masks), vocab]."""
    packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(masks), -1)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.astype(bool))


def mask_bytes(vocab: int) -> int:
    return (vocab + 31) // 32 * 4


def filtered_probs(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray,
                   top_p: np.ndarray, min_p: np.ndarray) -> torch.Tensor:
    """Probabilities [R, V] to draw from, for rows with temperature > 0: softmax at the
    temperature, then top-k, then top-p (keep the smallest prefix of the sorted
    distribution whose mass reaches top_p; the top token always), then min-p (keep
    p >= min_p * max p). Not renormalised: the draw does that."""
    dev = logits.device
    temps = torch.from_numpy(np.asarray(temperature, dtype=np.float32)).to(dev)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    vocab = probs.shape[-1]
    top_k = np.minimum(np.asarray(top_k, dtype=np.int64), vocab)
    top_p = np.asarray(top_p, dtype=np.float32)
    rows = np.flatnonzero((top_k > 0) | (top_p < 1))
    index = lambda r: torch.from_numpy(r).to(dev)  # noqa: E731
    for width in TOP_P_WIDTHS + (vocab,):
        if not len(rows):
            break
        ks = top_k[rows]
        width = min(vocab, max(int(ks.max()), width if (ks == 0).any() else 0))
        if width == vocab:
            values, order = torch.sort(probs[index(rows)], dim=-1, descending=True)
        else:
            values, order = torch.topk(probs[index(rows)], width, dim=-1)
        cum = torch.cumsum(values, dim=-1)
        # A top-p row keeps position `width` too if the mass before it is below top_p: look
        # wider. (`cum` and the rule's `cum - p` round differently, hence the margin.)
        short = (ks == 0) & (cum[:, -1].cpu().numpy() < top_p[rows] + 1e-4) & (width < vocab)
        done = np.flatnonzero(~short)
        if len(done):
            probs[index(rows[done])] = _keep(probs[index(rows[done])], values[index(done)],
                                             order[index(done)], cum[index(done)],
                                             top_k[rows[done]], top_p[rows[done]])
        rows = rows[short]
    min_p = np.asarray(min_p, dtype=np.float32)
    if np.any(min_p > 0):
        floor = torch.from_numpy(min_p).to(dev)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    return probs


def _keep(probs: torch.Tensor, values: torch.Tensor, order: torch.Tensor, cum: torch.Tensor,
          top_k: np.ndarray, top_p: np.ndarray) -> torch.Tensor:
    """Rows of `probs` with only the kept part of their sorted prefix (`values` at
    `order`, running mass `cum`) left non-zero."""
    dev = probs.device
    position = torch.arange(values.shape[-1], device=dev)
    k = torch.from_numpy(np.where(top_k > 0, top_k, values.shape[-1])).to(dev)
    p = torch.from_numpy(np.where(top_p < 1, top_p, np.inf).astype(np.float32)).to(dev)
    keep = (position[None, :] < k[:, None]) & ((cum - values) < p[:, None])
    return torch.zeros_like(probs).scatter_(-1, order, torch.where(keep, values, torch.zeros_like(values)))


def draw_rows(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray,
              top_p: np.ndarray, min_p: np.ndarray, seed: np.ndarray,
              rng: torch.Generator) -> list[int]:
    """One token per row of `logits` [R, V] (masked entries -inf): greedy rows in one
    argmax; the others from `filtered_probs`, a seeded row (seed >= 0) with its own
    generator, unseeded rows together from `rng`."""
    temperature = np.asarray(temperature, dtype=np.float32)
    seed = np.asarray(seed, dtype=np.int64)
    out = np.zeros(len(temperature), dtype=np.int64)
    greedy = np.flatnonzero(temperature == 0)
    if len(greedy):
        rows = logits if len(greedy) == len(out) else logits[torch.from_numpy(greedy).to(logits.device)]
        # torch.max's indices, argmax's contract (the first maximum; NaN wins), in a quarter
        # of the time: [128, 49152] fp32 3.3 against 11.9 ms (Xeon with AMX, 2 vCPUs).
        out[greedy] = torch.max(rows, dim=-1).indices.cpu().numpy()
    hot = np.flatnonzero(temperature != 0)
    if len(hot):
        probs = filtered_probs(logits[torch.from_numpy(hot).to(logits.device)], temperature[hot],
                               np.asarray(top_k)[hot], np.asarray(top_p)[hot],
                               np.asarray(min_p)[hot]).cpu()
        seeded = seed[hot] >= 0
        for j in np.flatnonzero(seeded).tolist():
            generator = torch.Generator(device="cpu").manual_seed(seed32(int(seed[hot[j]])))
            out[hot[j]] = int(torch.multinomial(probs[j], 1, generator=generator))
        free = np.flatnonzero(~seeded)
        if len(free):
            out[hot[free]] = _inverse_cdf(probs[torch.from_numpy(free)], rng).numpy()
    return out.tolist()


def _inverse_cdf(probs: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """One index per row of non-negative weights [R, V], drawn in proportion to them: one
    uniform per row against the running sum (in float64). `multinomial` draws one
    exponential per vocabulary entry (~1 ms a row); a seeded row must keep it, for its
    draws to stay the ones `sample` always made, but an unseeded row need not."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand(len(probs), 1, generator=rng, dtype=torch.float64) * total
    picks = torch.searchsorted(cdf, u, right=True)[:, 0]
    # u rounds up to the total at worst: then the last index with weight.
    last = torch.searchsorted(cdf, total, right=False)[:, 0]
    return torch.minimum(picks, last)


def seed32(seed: int) -> int:
    """torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so seeds that
    differ above them would draw alike: mix all 64 bits in first (splitmix64's finalizer)."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF
