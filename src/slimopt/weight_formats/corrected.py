"""bf16 weights with an 8-bit correction: 24 bits per weight that keep updates far below bf16's
resolution, as FlashOptim's compressed master weights do.

The fp32 value x is held as its nearest bf16 b and a signed 8-bit code c of the remainder
x − b, in units of 1/127 of half of b's bf16 spacing (the remainder never exceeds that half):
x ≈ b + c · ulp(b) / 254. The forward pass reads b alone; the optimizer reads b + correction,
updates it in fp32 and splits it again. The code is rounded stochastically (unbiased), so
changes even below the correction's own resolution accumulate on average.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt.codecs.draws import floor_stochastically_

CODE_MAX = 127
# bf16 has 8 significant bits: for |b| in [2^(k−1), 2^k) its spacing is 2^(k−8), half that 2^(k−9).
HALF_SPACING_EXPONENT = -9


def _unit(weights: Tensor) -> Tensor:
    """The value of one correction code for each bf16 weight: half its spacing over 127."""
    _, exponent = torch.frexp(weights.float())
    return torch.ldexp(
        torch.full_like(weights, 1.0 / CODE_MAX, dtype=torch.float32), exponent + HALF_SPACING_EXPONENT
    )


def corrected(weights: Tensor, correction: Tensor) -> Tensor:
    """The fp32 values that bf16 ``weights`` and their int8 ``correction`` hold."""
    return _unit(weights).mul_(correction).add_(weights)


def split_(weights: Tensor, correction: Tensor, values: Tensor, generator: torch.Generator | None) -> None:
    """Write fp32 ``values`` (overwritten: the workspace) as their nearest bf16 into ``weights``
    and the remainder, rounded stochastically, into ``correction``."""
    weights.copy_(values)
    values.sub_(weights).div_(_unit(weights))
    correction.copy_(floor_stochastically_(values, generator).clamp_(-CODE_MAX, CODE_MAX))
