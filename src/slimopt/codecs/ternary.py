"""Ternary storage: every element is -1, 0 or +1 times a scale, five elements to a byte.

Writing is unbiased stochastic rounding: an element x with scale s >= |x| becomes sign(x)·s with
probability |x|/s and 0 otherwise, so E[decode(encode(x))] = x. Round-to-nearest would freeze a
moving average whose per-step change is below s/2 (the change would round away every step);
stochastic rounding moves it by the right amount on average. Element i draws the i-th number of
a counter-based stream (``slimopt.codecs.draws``), so a fused step draws the same.

The rounding noise of an element grows with s/|x|, so the scale must follow the magnitudes
closely. It is the product of

- a row scale and a column scale (row maxima, then column maxima of the row-normalized
  matrix): a GaLore moment has rows or columns along singular directions whose magnitudes
  differ by orders of magnitude. Each vector costs 4 bytes per row (column), so it is kept only
  where it costs at most 1/8 byte per element, i.e. along a dimension of at least 32 rows
  (columns): a 1×n or n×1 matrix, or a vector, gets a single scale;
- a per-block part, one byte per block of 8: the block's maximum rounded up to a power of
  2^(1/4) (code e stands for 2^(-e/4)).

Five ternary digits fit in a byte (3^5 = 243), so a large matrix costs 1/5 + 1/8 = 0.325 bytes
per element. Infinite values saturate at the largest fp32 number.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import torch
from torch import Tensor

from slimopt.codecs.draws import stream_seed, uniform
from slimopt.codecs.plain import FLOAT32_MAX
from slimopt.codecs.rows import matrix_shape

TRITS_PER_BYTE = 5
EXPONENT_STEPS_PER_OCTAVE = 4

_POWERS_OF_THREE = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)
# _DIGITS[b] are the five ternary digits of byte b, least significant first.
_DIGITS = torch.stack([(torch.arange(256) // 3**k) % 3 for k in range(TRITS_PER_BYTE)], dim=1).to(torch.uint8)


@cache
def _tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """(powers of three, digits of every byte) on ``device``, copied there once."""
    return _POWERS_OF_THREE.to(device), _DIGITS.to(device)


def _safe(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, 1.0)


def _pad(flat: Tensor, multiple: int) -> Tensor:
    padding = -flat.numel() % multiple
    return torch.cat([flat, flat.new_zeros(padding)]) if padding else flat


# A row (column) scale is kept when the matrix has at least this many columns (rows): 4 bytes
# per row over 32 columns is 1/8 byte per element.
MIN_SCALED_LENGTH = 32


def scale_layout(shape: torch.Size) -> tuple[bool, bool]:
    """(row scale?, column scale?) for a moment of ``shape``; at least one is kept."""
    rows, cols = matrix_shape(shape)
    col_scale = rows >= MIN_SCALED_LENGTH
    return cols >= MIN_SCALED_LENGTH or not col_scale, col_scale


class TernaryCodec:
    """{-1, 0, +1} × row scale × column scale × per-block power-of-2^(1/4) scale."""

    stochastic = True

    def __init__(self, block_size: int, *, row_scale: bool, col_scale: bool) -> None:
        self.block_size = block_size
        self.row_scale = row_scale
        self.col_scale = col_scale
        self.parts = ("codes", "exponents") + ("row",) * row_scale + ("col",) * col_scale

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        stored: dict[str, Tensor] = {}
        rows, cols = matrix_shape(value.shape)
        normalized = value.float().reshape(rows, cols).clamp(-FLOAT32_MAX, FLOAT32_MAX)
        if self.row_scale:
            stored["row"] = normalized.abs().amax(dim=1)
            normalized.div_(_safe(stored["row"]).unsqueeze(1))
        if self.col_scale:
            stored["col"] = normalized.abs().amax(dim=0)
            normalized.div_(_safe(stored["col"]))
        blocks = _pad(normalized.reshape(-1), self.block_size).view(-1, self.block_size)
        block_max = blocks.abs().amax(dim=1)
        exponents = torch.ceil(-EXPONENT_STEPS_PER_OCTAVE * torch.log2(block_max)).clamp_(0, 255)
        # log2 rounding must not leave the scale below the block maximum.
        exponents = torch.where(_exponent_scale(exponents) < block_max, exponents - 1, exponents)
        stored["exponents"] = exponents.to(torch.uint8)
        blocks.div_(_exponent_scale(exponents).unsqueeze(1))
        stored["codes"] = _ternarize(blocks.reshape(-1), generator)
        return stored

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        exponents = stored["exponents"]
        digits = _tables(exponents.device)[1].index_select(0, stored["codes"].int()).reshape(-1)
        signs = digits[: exponents.numel() * self.block_size].float().sub_(1).view(-1, self.block_size)
        values = (signs * _exponent_scale(exponents.float()).unsqueeze(1)).reshape(-1)[: shape.numel()]
        values = values.view(matrix_shape(shape))
        if self.row_scale:
            values = values * stored["row"].unsqueeze(1)
        if self.col_scale:
            values = values * stored["col"]
        return values.view(shape)


def _exponent_scale(exponents: Tensor) -> Tensor:
    return torch.exp2(-exponents / EXPONENT_STEPS_PER_OCTAVE)


def _ternarize(normalized: Tensor, generator: torch.Generator | None) -> Tensor:
    """Stochastically round values in [-1, 1] to {-1, 0, +1}; pack five digits to a byte."""
    draws = uniform(stream_seed(generator, normalized.device), normalized.numel())
    # Digits 0, 1, 2 stand for -1, 0, +1.
    digits = torch.where(draws < normalized.abs(), normalized.sign(), 0.0).add_(1).to(torch.uint8)
    digits = _pad(digits, TRITS_PER_BYTE).view(-1, TRITS_PER_BYTE)
    return (digits * _tables(digits.device)[0]).sum(dim=1, dtype=torch.uint8)
