"""Drawing tokens and scoring distributions from logits: one implementation for the
`sample` handler and fused passes, so both draw the same token for the same seed.

Greedy rows — every row of a plain greedy decode — are one `argmax` over the batch (the
same op HF's greedy uses, so outputs stay token-for-token equal). Rows with a temperature
are drawn one by one: they need per-row filters, and a seeded row its own generator.
"""

from __future__ import annotations

import numpy as np
import torch


def allowed_mask(mask: bytes, vocab: int) -> torch.Tensor:
    """A bool tensor over the vocabulary (True = may be drawn) from llguidance's bitmask
    layout: ceil(vocab / 32) little-endian u32 words, bit t of word w = token 32 w + t."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(bool))


def mask_bytes(vocab: int) -> int:
    return (vocab + 31) // 32 * 4


def draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
         seed: int, rng: torch.Generator) -> int:
    """One token from one row of logits: greedy at temperature 0; otherwise softmax at the
    temperature, then top-k, top-p (the top token always kept), min-p, renormalised by
    `multinomial`; seed >= 0 uses its own generator, else `rng`."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k or top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if top_k:
            keep[top_k:] = False
        if top_p < 1:
            # Keep the smallest prefix whose mass reaches top_p (the top token always).
            keep &= (torch.cumsum(sorted_probs, 0) - sorted_probs) < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    if min_p > 0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    generator = rng
    if seed >= 0:
        generator = torch.Generator(device="cpu").manual_seed(seed32(seed))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def draw_rows(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray,
              top_p: np.ndarray, min_p: np.ndarray, seed: np.ndarray,
              rng: torch.Generator) -> list[int]:
    """One token per row of `logits` [R, V]; greedy rows in one argmax."""
    out = [0] * len(temperature)
    greedy = np.flatnonzero(temperature == 0)
    if len(greedy):
        picks = torch.argmax(logits[torch.from_numpy(greedy)], dim=-1).tolist()
        for row, token in zip(greedy.tolist(), picks):
            out[row] = token
    for row in np.flatnonzero(temperature != 0).tolist():
        out[row] = draw(logits[row], float(temperature[row]), int(top_k[row]), float(top_p[row]),
                        float(min_p[row]), int(seed[row]), rng)
    return out


def seed32(seed: int) -> int:
    """torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so seeds that
    differ above them would draw alike: mix all 64 bits in first (splitmix64's finalizer)."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF
