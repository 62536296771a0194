"""Counter-based random bits for stochastic rounding: draw i of a stream is a hash of i and the
stream's seed, so any part of a stream can be computed anywhere, in any order and in one pass
(the reference path, a compiled fused step, a Triton program) and gives the same bits.

A stream's seed is one number drawn from the caller's generator (seeded by parameter and step,
so a resumed run draws what an uninterrupted one does); it stays on the generator's device, so
drawing it does not wait for the device. The hash is Chris Wellons' "lowbias32" shape: two
multiply-xorshift rounds, a bijection of 32-bit words. Words are int32 bit patterns: products
wrap modulo 2³², as PyTorch's integer kernels, Inductor's loops and Triton's do, and right
shifts are masked so that they shift zeros in. Compiled, a draw costs about a nanosecond; in
eager PyTorch a few times ``torch.rand``.
"""

from __future__ import annotations

import torch
from torch import Tensor

MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
SEED_LIMIT = 1 << 31
INT32_LIMIT = 1 << 31


def stream_seed(generator: torch.Generator | None, device: torch.device) -> Tensor:
    """A one-element int32 tensor on ``device``: the seed of the next stream of ``generator``
    (the default generator when None). Successive calls give independent streams."""
    source = generator.device if generator is not None else torch.device(device)
    if source.type == "meta":
        source = torch.device("cpu")
    seed = torch.randint(0, SEED_LIMIT, (1,), generator=generator, device=source, dtype=torch.int32)
    return seed.to(device, non_blocking=True)


def draw_indices(count: int, device: torch.device, start: int = 0) -> Tensor:
    """Draw indices start … start+count−1 as int32 (wrapping past 2³¹: a stream repeats after
    2³² draws)."""
    if start + count <= INT32_LIMIT:
        return torch.arange(start, start + count, device=device, dtype=torch.int32)
    return torch.arange(start, start + count, device=device, dtype=torch.int64).to(torch.int32)


def random_words(seed: Tensor, indices: Tensor) -> Tensor:
    """32 random bits (an int32 bit pattern) for each int32 draw index in ``indices`` of stream
    ``seed``."""
    words = indices ^ seed
    words.bitwise_xor_(words.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    words.mul_(MULTIPLIERS[0])
    words.bitwise_xor_(words.bitwise_right_shift(15).bitwise_and_(0x1FFFF))
    words.mul_(MULTIPLIERS[1])
    return words.bitwise_xor_(words.bitwise_right_shift(15).bitwise_and_(0x1FFFF))


def uniform_from_words(words: Tensor) -> Tensor:
    """fp32 values in [0, 1) on a grid of 2⁻²⁴ (as ``torch.rand``'s), from ``random_words``."""
    return words.bitwise_right_shift(8).bitwise_and_(0xFFFFFF).float().mul_(2.0**-24)


def uniform(seed: Tensor, count: int, start: int = 0) -> Tensor:
    """Draws ``start`` … ``start + count − 1`` of stream ``seed`` as fp32 values in [0, 1)."""
    return uniform_from_words(random_words(seed, draw_indices(count, seed.device, start)))


def floor_stochastically_(values: Tensor, generator: torch.Generator | None) -> Tensor:
    """``values`` rounded in place to an integer below or above, up with probability equal to
    the fractional part, so the rounding is unbiased: ⌊x + u⌋ with u the next stream of
    ``generator``'s draws (``stream_seed``), one per element."""
    draws = uniform(stream_seed(generator, values.device), values.numel()).view(values.shape)
    return values.add_(draws).floor_()
