"""The pieces the hand-written Triton kernels share (``triton_adamw``, ``triton_ternary``,
``triton_multi_tensor``): AdamW's update of a block, the write of the parameter or of the
direction, bf16 rounding (to nearest, and stochastic from ``slimopt.codecs.draws``' streams), so
every kernel writes what the reference path writes, operation for operation.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimopt.codecs.draws import MULTIPLIERS

# What a kernel writes to the parameter: nothing (the direction is returned), fp32, bf16 to
# nearest, bf16 stochastically.
DIRECTION, WEIGHTS_FP32, WEIGHTS_BF16, WEIGHTS_BF16_STOCHASTIC = range(4)
# The same numbers as the kernels' constants (Triton reads only tl.constexpr globals).
DIRECTION_, WEIGHTS_FP32_, WEIGHTS_BF16_ = (tl.constexpr(m) for m in (DIRECTION, WEIGHTS_FP32, WEIGHTS_BF16))
MULTIPLIERS_0, MULTIPLIERS_1 = (tl.constexpr(multiplier) for multiplier in MULTIPLIERS)


def parameter_target(
    weights: Tensor | None, direction: Tensor | None, streams: Iterator[Tensor], hyper: Tensor
) -> tuple[Tensor | None, int, Tensor]:
    """What a kernel writes and how (its ``MODE``): the ``weights``, fp32 or bf16 (rounded
    stochastically with the next of ``streams`` where one is left, else to nearest), or else the
    ``direction``; and the weights' stream (``hyper`` stands in where there is none)."""
    if weights is None:
        return direction, DIRECTION, hyper
    if weights.dtype == torch.float32:
        return weights, WEIGHTS_FP32, hyper
    stream = next(streams, None)
    return (weights, WEIGHTS_BF16, hyper) if stream is None else (weights, WEIGHTS_BF16_STOCHASTIC, stream)


@triton.jit
def random_words(seed, index):
    """``slimopt.codecs.draws.random_words``: the int32 hash of draw ``index`` of stream ``seed``."""
    words = index ^ seed
    words ^= (words >> 16) & 0xFFFF
    words *= MULTIPLIERS_0
    words ^= (words >> 15) & 0x1FFFF
    words *= MULTIPLIERS_1
    return words ^ ((words >> 15) & 0x1FFFF)


@triton.jit
def round_to_bf16(value, seed, index):
    """``slimopt.codecs.plain.round_to_bf16_with_stream`` for the elements at ``index``."""
    noise = (random_words(seed, index) >> 16) & 0xFFFF
    bits = (value.to(tl.int32, bitcast=True) + noise) & -65536
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def round_to_nearest_bf16(value):
    """``value`` to the nearest bf16, ties to even, in integer arithmetic: conversions differ
    between Triton's backends (its interpreter truncates)."""
    bits = value.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def and_writes(mask, writes):
    """``mask`` where ``writes`` (0 or 1) is 1. (Triton's interpreter rejects a block mask
    and-ed with a scalar one.)"""
    return (mask.to(tl.int32) * writes) != 0


@triton.jit
def adamw_update(g, m, v, real, hyper):
    """The AdamW rule on one half block: new moments (0 on padding, which the reference encodes
    from zeros) and the direction, in ``slimopt.kernels``' order of operations."""
    new1 = tl.load(hyper)
    beta2 = tl.load(hyper + 1)
    new2 = tl.load(hyper + 2)
    eps = tl.load(hyper + 3)
    correction1 = tl.load(hyper + 4)
    correction2_sqrt = tl.load(hyper + 5)
    # torch.lerp's two forms, chosen by the weight as it chooses them.
    m = tl.where(new1 < 0.5, m + new1 * (g - m), g - (g - m) * (1 - new1))
    v = v * beta2 + new2 * g * g
    direction = m / (tl.sqrt(v) / correction2_sqrt + eps) / correction1
    return tl.where(real, m, 0.0), tl.where(real, v, 0.0), direction


@triton.jit
def write_target(target, weight_seed, direction, index, mask, hyper, writes, MODE: tl.constexpr):
    """The direction (zero unless ``writes`` is 1), or the parameter moved along it (``w·decay +
    alpha·direction``, if ``writes`` is 1)."""
    if MODE == DIRECTION_:
        tl.store(target + index, tl.where(writes != 0, direction, 0.0), mask=mask)
    else:
        mask = and_writes(mask, writes)
        decay = tl.load(hyper + 6)
        alpha = tl.load(hyper + 7)
        updated = tl.load(target + index, mask=mask, other=0.0).to(tl.float32) * decay + alpha * direction
        if MODE == WEIGHTS_FP32_:
            tl.store(target + index, updated, mask=mask)
        elif MODE == WEIGHTS_BF16_:
            tl.store(target + index, round_to_nearest_bf16(updated), mask=mask)
        else:
            tl.store(target + index, round_to_bf16(updated, tl.load(weight_seed), index), mask=mask)
