"""Unquantized state storage: fp32 as is, and bf16 written with stochastic rounding."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from slimopt.codecs.base import Storage
from slimopt.codecs.draws import draw_indices, random_words, stream_seed


class Fp32Codec:
    """Stores the fp32 tensor itself: decode and encode are free and share memory."""

    parts = ("",)
    storage = Storage()

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        return {"": value}

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        return stored[""]


def round_to_bf16_stochastically(value: Tensor, generator: torch.Generator | None) -> Tensor:
    """``value`` in bf16, rounded up or down with probabilities that make it unbiased: the 16
    fp32 mantissa bits that bf16 drops are compared with 16 random bits (the next stream of
    ``generator``, ``slimopt.codecs.draws``)."""
    return round_to_bf16_with_stream(value, stream_seed(generator, value.device))


def round_to_bf16(value: Tensor, seed: Tensor | None) -> Tensor:
    """``value`` in bf16: stochastically with draws of stream ``seed``, else to nearest."""
    return value.to(torch.bfloat16) if seed is None else round_to_bf16_with_stream(value, seed)


def round_to_bf16_with_stream(value: Tensor, seed: Tensor) -> Tensor:
    """``round_to_bf16_stochastically`` with the draws of stream ``seed``: element i adds the 16
    high bits of draw i below bf16's mantissa (the reference path and the fused step share it)."""
    bits = value.float().view(torch.int32)
    words = random_words(seed, draw_indices(bits.numel(), bits.device)).view(bits.shape)
    noise = words.bitwise_right_shift(16).bitwise_and(0xFFFF)
    rounded = (bits + noise).bitwise_and(-65536)  # clear the low 16 bits
    return rounded.view(torch.float32).to(torch.bfloat16)


class Bf16Codec:
    """Stores bf16. Rounding is stochastic and unbiased: the 16 fp32 mantissa bits that bf16
    drops are compared with 16 random bits, so E[decode(encode(x))] = x and small EMA steps
    are not lost to round-to-nearest."""

    parts = ("",)
    storage = Storage("bf16")

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        return {"": round_to_bf16_stochastically(value, generator)}

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        return stored[""].float()
