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


class RescaledBlock(nn.Module):
    """Mixin of a block rebuilt at a rescaled shape: `rescale_out(block(rescale_in(x)))`. `rescaled` makes the
    subclass of the block's own class, so the block stays an instance of it (a `MixerBlock`)."""

    rescale_in: Rescale
    rescale_out: Rescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rescale_out(super().forward(self.rescale_in(x)))


def rescaled(block: nn.Module, shape: tuple[int, int], rescaled_shape: tuple[int, int]) -> nn.Module:
    """`block` (already rebuilt at `rescaled_shape` [S1, C1]) between the rescale layers to and from the
    model's [S, C], as an instance of `Rescaled<BlockClass>`."""
    block.rescale_in = Rescale(*shape, *rescaled_shape)
    block.rescale_out = Rescale(*rescaled_shape, *shape)
    block.__class__ = _rescaled_class(type(block))
    return block


def _rescaled_class(cls: type[nn.Module]) -> type[nn.Module]:
    name = f"Rescaled{cls.__name__}"
    if name not in globals():  # one class per block class, importable from here (so models pickle)
        globals()[name] = type(name, (RescaledBlock, cls), {"__module__": __name__, "__qualname__": name})
    return globals()[name]
