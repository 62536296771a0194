"""The rank of a projection that ``build_optimizer`` chooses when none is given, and the
warning for a rank at which projection saves no optimizer state."""

from __future__ import annotations

import warnings
from collections import Counter

from torch import Tensor

from slimopt.codecs.slicing import matrix_shape


def default_rank(matrices: list[Tensor]) -> int:
    """The GaLore paper's rank, r = n/4: a quarter of the smaller dimension most of ``matrices``
    share (a transformer's hidden size: 1024 for LLaMA-7B, 512 for LLaMA-1B)."""
    sides = Counter(min(matrix_shape(matrix.shape)) for matrix in matrices)
    return max(1, sides.most_common(1)[0][0] // 4)


def warn_if_projection_saves_nothing(matrices: list[Tensor], rank: int, stored_basis: bool = True) -> None:
    """A ``UserWarning`` when moments in a rank-``rank`` space plus the bases (``stored_basis``:
    not APOLLO's random projections, which are drawn again) take as many numbers as the moments
    of the whole matrices (2·m·n): projection would only cost."""
    full = projected = 0
    breakeven = None
    for matrix in matrices:
        long, short = sorted(matrix_shape(matrix.shape), reverse=True)
        if short == 0:
            continue
        r = min(rank, short)
        basis = short if stored_basis else 0
        full += 2 * long * short
        projected += 2 * long * r + r * basis  # moments in the projected space, then the basis
        limit = (2 * long * short) // (2 * long + basis)
        breakeven = limit if breakeven is None else min(breakeven, limit)
    if full and projected >= full:
        warnings.warn(
            f"rank {rank} saves no optimizer state: projected moments and bases hold {projected:,} "
            f"numbers, the unprojected moments {full:,}; choose a rank of at most {breakeven}",
            UserWarning,
            stacklevel=3,
        )
