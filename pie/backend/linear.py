"""A linear layer without bias, y = x @ W.T, in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
