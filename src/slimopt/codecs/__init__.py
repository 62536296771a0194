"""State storage: how each optimizer moment is kept between steps.

A codec turns an fp32 moment into stored tensors (``encode``) and back (``decode``); the
optimizer decodes, lets the update rule work in fp32 and encodes again, one parameter at a
time, so no fp32 copy of a compressed state outlives its step. Which codec a moment gets
depends on the format (``states=``), on whether it is a first moment ("linear", signed) or a
second moment ("square", non-negative), and on its size.

| format    | first moment                         | second moment                                   |
|-----------|--------------------------------------|-------------------------------------------------|
| fp32      | fp32                                 | fp32                                            |
| bf16      | bf16, stochastic rounding            | bf16, stochastic rounding                       |
| int8      | dynamic map, signed, block 256       | dynamic map, unsigned, block 256, no zero for v>0 |
| int4      | 4-bit dynamic map, block 128         | 4-bit linear map without zero, block 128         |
| ternary   | {-1,0,+1}, SR, 5 per byte, scale     | factored row/column means (matrices of at least |
|           | row·col × per-block-of-8 byte        | 32×32), else int4                               |

Moments with fewer than ``MIN_COMPRESSED_NUMEL`` elements stay fp32. Ternary row and column
statistics cost 4 bytes per row (column), so they are kept only along dimensions of at least 32
(``slimopt.codecs.ternary.scale_layout``): a 1×n or n×1 matrix costs what a vector does.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Protocol

import torch
from torch import Tensor

from slimopt.codecs.blockwise import BlockwiseCodec
from slimopt.codecs.factored import FactoredCodec
from slimopt.codecs.maps import dynamic_map, linear_map_without_zero
from slimopt.codecs.plain import Bf16Codec, Fp32Codec
from slimopt.codecs.rows import MIN_COMPRESSED_NUMEL
from slimopt.codecs.ternary import MIN_SCALED_LENGTH, TernaryCodec, scale_layout

STATE_FORMATS = ("fp32", "bf16", "int8", "int4", "ternary")
DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 128, "ternary": 8}

__all__ = [
    "DEFAULT_BLOCK_SIZES",
    "MIN_COMPRESSED_NUMEL",
    "STATE_FORMATS",
    "Codec",
    "moment_codec",
    "state_key",
]


class Codec(Protocol):
    """Stored form of one moment."""

    parts: tuple[str, ...]  # names of the stored tensors; "" is the moment's own key
    stochastic: bool  # whether encode draws random numbers

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Return the stored tensors for an fp32 ``value``."""

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        """Return the fp32 moment of ``shape`` from its stored tensors."""


def state_key(moment: str, part: str) -> str:
    """The optimizer-state key of one stored tensor of ``moment`` (e.g. ``exp_avg.codes``)."""
    return f"{moment}.{part}" if part else moment


def moment_codec(states: str, kind: str, shape: torch.Size, block_size: int | None = None) -> Codec:
    """Return the codec for a moment of ``kind`` ("linear" or "square") and ``shape``.

    Raises ``ValueError`` for an unknown ``states`` or ``kind``.
    """
    if states not in STATE_FORMATS:
        raise ValueError(f"unknown states {states!r}; valid: {', '.join(STATE_FORMATS)}")
    if kind not in ("linear", "square"):
        raise ValueError(f"unknown moment kind {kind!r}; valid: linear, square")
    if states == "fp32" or shape.numel() < MIN_COMPRESSED_NUMEL:
        return _fp32()
    if states == "bf16":
        return _bf16()
    size = block_size or DEFAULT_BLOCK_SIZES[states]
    if states == "int8":
        return _int8(kind, size)
    if states == "ternary" and kind == "square":
        if len(shape) >= 2 and min(shape[-2:]) >= MIN_SCALED_LENGTH:
            return _factored()
        return _int4(kind, block_size or DEFAULT_BLOCK_SIZES["int4"])
    if states == "ternary":
        row_scale, col_scale = scale_layout(shape)
        return _ternary(size, row_scale, col_scale)
    return _int4(kind, size)


# Codecs are stateless apart from their maps: one instance per configuration.
@cache
def _fp32() -> Codec:
    return Fp32Codec()


@cache
def _bf16() -> Codec:
    return Bf16Codec()


@cache
def _factored() -> Codec:
    return FactoredCodec()


@cache
def _ternary(block_size: int, row_scale: bool, col_scale: bool) -> Codec:
    return TernaryCodec(block_size, row_scale=row_scale, col_scale=col_scale)


@cache
def _int8(kind: str, block_size: int) -> Codec:
    signed = kind == "linear"
    return BlockwiseCodec(dynamic_map(signed=signed), block_size, positive_floor=not signed)


@cache
def _int4(kind: str, block_size: int) -> Codec:
    if kind == "linear":
        return BlockwiseCodec(dynamic_map(signed=True, total_bits=4, exponent_bits=3), block_size)
    return BlockwiseCodec(linear_map_without_zero(4), block_size)
