"""Block-wise quantization against a code map (the bitsandbytes / torchao scheme).

A tensor is flattened and cut into blocks; each block is divided by its absolute maximum (kept
in fp32) and every element is stored as the index of the nearest map value: 8 bits per element,
or two 4-bit indices per byte.

The nearest value is found by a table lookup instead of a binary search over the midpoints
between map values: the top 17 bits of an fp32 number (sign, exponent and 8 mantissa bits) pick
a bucket of relative width 2⁻⁸, narrower than the gaps of the maps used here, so at most one
midpoint lies inside a bucket, and one comparison with the midpoint after the bucket's first
code finishes the search. The codes are ``torch.bucketize``'s (tested), 3× faster on the CPU.

An infinite element (a second moment whose (1 − β₂)·g² overflowed) saturates: its block's
absmax is the largest fp32 number, so decoding never multiplies a zero code by infinity.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from slimopt.codecs.plain import FLOAT32_MAX
from slimopt.memory import untracked

# The lookup's bucket of an fp32 number: its bits shifted right, keeping 17 bits.
LOOKUP_SHIFT = 15
LOOKUP_MASK = (1 << 17) - 1


class BlockwiseCodec:
    """Nearest-value quantization with a per-block absmax.

    ``positive_floor``: for non-negative tensors (second moments) a positive value never takes
    the zero code, so it never decodes to 0 and 1/√v stays finite.
    """

    parts = ("codes", "absmax")
    stochastic = False

    def __init__(self, code_map: Tensor, block_size: int, *, positive_floor: bool = False) -> None:
        self.code_map = code_map
        self.block_size = block_size
        self.bits = 4 if code_map.numel() <= 16 else 8
        self.positive_floor = positive_floor
        # Index of the zero code (computed once on the CPU: no device sync per encode).
        self.zero_code = int(torch.searchsorted(code_map, torch.zeros(())))
        with untracked():  # codecs are cached for the whole process; so are their tables
            midpoints = (code_map[1:] + code_map[:-1]) / 2
            # After the last midpoint +inf: a value in the top bucket never moves past the last code.
            self._search = (code_map, torch.cat([midpoints, midpoints.new_full((1,), torch.inf)]))
            self._search += (_first_codes(midpoints),)
        self._device_maps: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The map, its midpoints (then +inf) and the first code of every bucket, on ``device``."""
        if device not in self._device_maps:
            with untracked():  # a cache for the whole process, not memory of a training step
                self._device_maps[device] = tuple(t.to(device) for t in self._search)
        return self._device_maps[device]

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        _, midpoints, first_codes = self.tables(value.device)
        blocks = _blocks(value, self.block_size)
        absmax = blocks.abs().amax(dim=1).clamp_(max=FLOAT32_MAX)
        normalized = (blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).reshape(-1)
        bucket = normalized.view(torch.int32).bitwise_right_shift(LOOKUP_SHIFT).bitwise_and_(LOOKUP_MASK)
        codes = first_codes.index_select(0, bucket)
        del bucket
        codes += normalized > midpoints.index_select(0, codes.int())
        if self.positive_floor:
            lifted = (normalized > 0) & (codes == self.zero_code)
            codes = torch.where(lifted, self.zero_code + 1, codes)
        if self.bits == 4:
            codes = codes[0::2] | (codes[1::2] << 4)
        return {"codes": codes, "absmax": absmax}

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        values, _, _ = self.tables(stored["codes"].device)
        codes = stored["codes"]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1)
        # int32 indices: half the memory traffic of the int64 ones plain indexing makes.
        blocks = values.index_select(0, codes.int()).view(-1, self.block_size) * stored["absmax"].unsqueeze(1)
        return _unblock(blocks, shape)


def _first_codes(midpoints: Tensor) -> Tensor:
    """The code of the smallest value of every bucket of fp32 numbers (uint8).

    ``torch.bucketize``'s code of x is the number of midpoints below x. Within a bucket
    [lo, hi] holding at most one midpoint, that midpoint is the first one at or above lo, so the
    code of x is code(lo) + (x > midpoints[code(lo)]). Raises ``ValueError`` for a map whose
    midpoints are too dense for that (two in one bucket).
    """
    ids = torch.arange(LOOKUP_MASK + 1, dtype=torch.int64) << LOOKUP_SHIFT
    ends = torch.stack([ids, ids | ((1 << LOOKUP_SHIFT) - 1)]).to(torch.int32).view(torch.float32)
    low, high = ends.amin(dim=0), ends.amax(dim=0)  # negative numbers run backwards in bits
    first = torch.bucketize(low, midpoints)
    finite = low.isfinite() & high.isfinite()
    if int((torch.bucketize(high, midpoints) - first)[finite].max()) > 1:
        raise ValueError("code map too dense for the lookup table: two midpoints in one bucket")
    return first.to(torch.uint8)


def _blocks(value: Tensor, block_size: int) -> Tensor:
    """``value`` flattened, zero-padded to whole blocks, as (blocks, block_size) fp32."""
    flat = value.reshape(-1).float()
    padding = -flat.numel() % block_size
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(-1, block_size)


def _unblock(blocks: Tensor, shape: torch.Size) -> Tensor:
    return blocks.reshape(-1)[: shape.numel()].view(shape)
