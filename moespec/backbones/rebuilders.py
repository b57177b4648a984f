"""Block rebuilders: how to rebuild one residual-block family at a rescaled shape [S1, C1] (Sparse-MLP).

A rebuilder knows its block's shape (tokens S, channels C) and how to make a fresh block of the same
structure at [S1, C1] with given FFN widths. Only MLP-Mixer blocks are registered: Sparse-MLP is defined
on MLP-Mixer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from timm.models.mlp_mixer import MixerBlock
from torch import nn


@dataclass(frozen=True)
class BlockRebuilder:
    shape: Callable[[nn.Module], tuple[int, int]]  # block -> (tokens S, channels C)
    token_sublayer: str  # the FFN over the token axis (its items are channel rows of length S)
    channel_sublayer: str  # the FFN over the channel axis
    rebuild: Callable[[nn.Module, int, int, int, int], nn.Module]  # (block, S1, C1, token hidden, channel hidden)


BLOCK_REBUILDERS: dict[type[nn.Module], BlockRebuilder] = {}
"""Block class -> its rebuilder; subclasses use their nearest registered base's."""


def register_rebuilder(block: type[nn.Module], *, token_sublayer: str, channel_sublayer: str,
                       shape: Callable[[nn.Module], tuple[int, int]]) -> Callable[[Callable], Callable]:
    """Register the decorated `rebuild(block, S1, C1, token hidden, channel hidden)` for `block`'s class."""

    def wrap(rebuild: Callable) -> Callable:
        BLOCK_REBUILDERS[block] = BlockRebuilder(shape, token_sublayer, channel_sublayer, rebuild)
        return rebuild

    return wrap


def find_rebuilder(block: nn.Module) -> BlockRebuilder | None:
    for cls in type(block).__mro__:
        if cls in BLOCK_REBUILDERS:
            return BLOCK_REBUILDERS[cls]
    return None


@register_rebuilder(MixerBlock, token_sublayer="mlp_tokens", channel_sublayer="mlp_channels",
                    shape=lambda block: (block.mlp_tokens.fc1.in_features, block.mlp_channels.fc1.in_features))
def _rebuild_mixer_block(block: MixerBlock, tokens: int, channels: int, token_hidden: int,
                         channel_hidden: int) -> MixerBlock:
    """A fresh MixerBlock at [tokens, channels], with the same norm, activation, dropout and drop-path."""
    mlp, norm = block.mlp_tokens, block.norm1
    new = MixerBlock(channels, tokens, mlp_ratio=(1.0, 1.0), mlp_layer=type(mlp), act_layer=type(mlp.act),
                     norm_layer=lambda dim, **kw: type(norm)(dim, eps=norm.eps, **kw), drop=mlp.drop1.p)
    new.drop_path = block.drop_path
    new.mlp_tokens = type(mlp)(tokens, token_hidden, act_layer=type(mlp.act), drop=mlp.drop1.p)
    new.mlp_channels = type(mlp)(channels, channel_hidden, act_layer=type(mlp.act), drop=mlp.drop1.p)
    return new

