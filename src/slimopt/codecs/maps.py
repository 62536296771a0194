"""Quantization maps: the values a code stands for, as a sorted 1-D fp32 tensor in [-1, 1].

The dynamic map is the dynamic-exponent data type of Dettmers (arXiv 1511.04561, used by
bitsandbytes): each decade 10^-k … 10^-(k-1) gets a linear grid of fraction values, and decades
closer to 1 get more of them. The linear map without zero is torchao's 4-bit second-moment map:
a zero code would make 1/√v explode.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_map(signed: bool, total_bits: int = 8, exponent_bits: int | None = None) -> Tensor:
    """Return the ``2**total_bits`` values of the dynamic-exponent map, ascending.

    ``exponent_bits`` (default ``total_bits - 1``) is the number of decades. The map always
    holds 0 and 1.0; a signed one holds the negative of every other positive value.
    """
    magnitude_bits = total_bits - 1
    decades = magnitude_bits if exponent_bits is None else exponent_bits
    values: list[float] = [0.0, 1.0]

    def add_decade(exponent: int, bins: int) -> None:
        # fp32 arithmetic throughout, so the values equal bitsandbytes' to the last bit.
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float32)
        centres = (edges[:-1] + edges[1:]) / 2.0 * 10.0**exponent
        values.extend(centres.tolist())
        if signed:
            values.extend((-centres).tolist())

    for level in range(decades):
        # A signed map spends one bit on the sign, so it has half as many fraction values.
        bins = 2 ** (level + magnitude_bits - decades + (0 if signed else 1))
        add_decade(level - (decades - 1), bins)
    leftover = 2 ** (magnitude_bits - decades) - 1
    if leftover > 0:
        add_decade(0, leftover)
    if len(values) != 2**total_bits:
        raise ValueError(
            f"a dynamic map with total_bits={total_bits}, exponent_bits={decades} has {len(values)} "
            f"values, not {2**total_bits}"
        )
    return torch.tensor(sorted(values), dtype=torch.float32)


def linear_map_without_zero(total_bits: int = 4) -> Tensor:
    """Return ``k / 2**total_bits`` for ``k = 1 … 2**total_bits``: no code decodes to zero."""
    levels = 2**total_bits
    return torch.arange(1, levels + 1, dtype=torch.float32) / levels
