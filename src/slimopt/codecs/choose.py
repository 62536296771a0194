"""Which codec a moment gets: by format (``states=``, one for both moments or one each),
kind ("linear" first moments, "square" second moments) and shape (see the table in
``slimopt.codecs``)."""

from __future__ import annotations

from functools import cache

import torch

from slimopt.codecs.base import Codec
from slimopt.codecs.blockwise import BlockwiseCodec
from slimopt.codecs.factored import FactoredCodec
from slimopt.codecs.maps import dynamic_map, linear_map_without_zero
from slimopt.codecs.plain import Bf16Codec, Fp32Codec
from slimopt.codecs.slicing import MIN_COMPRESSED_NUMEL
from slimopt.codecs.ternary import MIN_SCALED_LENGTH, TernaryCodec, scale_layout

STATE_FORMATS = ("fp32", "bf16", "int8", "int4", "ternary")
DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 128, "ternary": 8}


def moment_formats(states: str) -> tuple[str, str]:
    """The formats of the first and of the second moment that ``states`` names: one format for
    both, or one each as ``"first/second"`` (``"ternary/fp32"``: a ternary first moment, an fp32
    second one). Raises ``ValueError`` naming a bad ``states``."""
    parts = tuple(states.split("/")) if isinstance(states, str) else ()
    if len(parts) == 1:
        parts = (parts[0], parts[0])
    if len(parts) != 2 or any(part not in STATE_FORMATS for part in parts):
        raise ValueError(
            f"unknown states {states!r}; valid: {', '.join(STATE_FORMATS)}, or one for each moment "
            "as 'first/second' (e.g. 'ternary/fp32')"
        )
    return parts[0], parts[1]


def moment_codec(states: str, kind: str, shape: torch.Size, block_size: int | None = None) -> Codec:
    """Return the codec for a moment of ``kind`` ("linear": first moments, "square": second
    moments) and ``shape``, in the format ``states`` gives that kind (``moment_formats``).

    Raises ``ValueError`` for an unknown ``states`` or ``kind``.
    """
    if kind not in ("linear", "square"):
        raise ValueError(f"unknown moment kind {kind!r}; valid: linear, square")
    states = moment_formats(states)[0 if kind == "linear" else 1]
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
