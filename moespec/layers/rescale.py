"""Sparse-MLP's rescale sub-layers (Lou et al. 2022, "Sparse-MLP")."""

from __future__ import annotations

import torch
from torch import nn


class Rescale(nn.Module):
    """[B, S, C] -> [B, S1, C1]: one linear map over the token axis, then one over the channel axis.

    Before a rebuilt block it is the pro-token rescale [S, C] -> [S1, C1]; after it, the pro-channel rescale
    [S1, C1] -> [S, C].
    """

    def __init__(self, tokens_in: int, channels_in: int, tokens_out: int, channels_out: int):
        super().__init__()
        self.tokens = nn.Linear(tokens_in, tokens_out)
        self.channels = nn.Linear(channels_in, channels_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.channels(self.tokens(x.transpose(1, 2)).transpose(1, 2))
