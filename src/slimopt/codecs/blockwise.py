"""Block-wise quantization against a code map (the bitsandbytes / torchao scheme).

A tensor is flattened and cut into blocks; each block is divided by its absolute maximum (kept
in fp32) and every element is stored as the index of the nearest map value: 8 bits per element,
or two 4-bit indices per byte.

The nearest value is found by one table lookup instead of a binary search over the midpoints
between map values: the top 17 bits of an fp32 number (sign, exponent and 8 mantissa bits) pick
a bucket of relative width 2⁻⁸, narrower than the gaps of the maps used here, so at most one
midpoint lies inside a bucket. The bucket's entry packs its first code and where in the bucket
that midpoint lies, as a key of the 15 bits below the bucket's (in value order: reversed for
negative numbers); the code is the first code, plus one past the midpoint. A second moment's
floor (positive values never take the zero code) is part of the table too. The codes are
``torch.bucketize``'s (tested), found faster on the CPU (docs/changes.md), and in a
compiled loop one lookup per element instead of two dependent ones.

An infinite element (a second moment whose (1 − β₂)·g² overflowed) saturates: its block's
absmax is the largest fp32 number, so decoding never multiplies a zero code by infinity.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from slimopt.checks import FLOAT32_MAX
from slimopt.codecs.base import Storage
from slimopt.codecs.slicing import pieces
from slimopt.memory import untracked

# The lookup's bucket of an fp32 number: its bits shifted right, keeping 17 bits; its key
# within the bucket: the 15 bits below. A table entry holds the first code above KEY_BITS bits.
LOOKUP_SHIFT = 15
LOOKUP_MASK = (1 << 17) - 1
KEY_MASK = (1 << LOOKUP_SHIFT) - 1
KEY_BITS = 16
THRESHOLD_MASK = (1 << KEY_BITS) - 1


class BlockwiseCodec:
    """Nearest-value quantization with a per-block absmax.

    ``positive_floor``: for non-negative tensors (second moments) a positive value never takes
    the zero code, so it never decodes to 0 and 1/√v stays finite.
    """

    parts = ("codes", "absmax")

    def __init__(self, code_map: Tensor, block_size: int, *, positive_floor: bool = False) -> None:
        self.code_map = code_map
        self.block_size = block_size
        self.bits = 4 if code_map.numel() <= 16 else 8
        # The zero code, which positive values skip with ``positive_floor``: part of the table.
        floor = int(torch.searchsorted(code_map, torch.zeros(()))) if positive_floor else None
        with untracked():  # codecs are cached for the whole process; so are their tables
            midpoints = (code_map[1:] + code_map[:-1]) / 2
            self._search = (code_map, _nearest_table(midpoints, floor))
        self._device_maps: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.storage = Storage("blockwise", block_size, self.bits)

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The map and the nearest-code table (``_nearest_table``), on ``device``."""
        if device not in self._device_maps:
            with untracked():  # a cache for the whole process, not memory of a training step
                self._device_maps[device] = tuple(t.to(device) for t in self._search)
        return self._device_maps[device]

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        flat, size = value.reshape(-1).float(), self.block_size
        blocks = -(-flat.numel() // size)
        parts = pieces(blocks, size, 1, value.device)
        if len(parts) == 1:  # the codes are quantize's own, not a copy of them
            codes, absmax = self._quantized(flat, parts[0])
            return {"codes": codes, "absmax": absmax}
        codes = torch.empty(blocks * size * self.bits // 8, dtype=torch.uint8, device=value.device)
        absmax = torch.empty(blocks, device=value.device)
        per_byte = 8 // self.bits
        for piece in parts:
            own = slice(piece.start * size // per_byte, piece.stop * size // per_byte)
            codes[own], absmax[piece] = self._quantized(flat, piece)
        return {"codes": codes, "absmax": absmax}

    def _quantized(self, flat: Tensor, piece: slice) -> tuple[Tensor, Tensor]:
        """The codes and absmax of blocks ``piece`` of ``flat``; its temporaries die here."""
        size = self.block_size
        values = flat[piece.start * size : piece.stop * size]
        # A whole number of blocks is viewed, not padded: no copy of a large moment.
        blocks = blocks_of(values, size) if values.numel() % size else values.view(-1, size)
        return quantize(blocks, self.storage, self.tables(flat.device))

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        codes, absmax = stored["codes"], stored["absmax"]
        size, per_byte = self.block_size, 8 // self.bits
        # Padded to whole blocks, each piece decoded into its place; the padding is cut off.
        value = torch.empty(absmax.numel() * size, device=codes.device)
        tables = self.tables(codes.device)
        for piece in pieces(absmax.numel(), size, 1, codes.device):
            own = codes[piece.start * size // per_byte : piece.stop * size // per_byte]
            dequantize(
                own, absmax[piece], self.storage, tables, out=value[piece.start * size : piece.stop * size]
            )
        return value[: shape.numel()].view(shape)


def quantize(blocks: Tensor, storage: Storage, tables: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """The codes (uint8; two 4-bit codes to a byte) and the fp32 absmax of the fp32 ``blocks``
    (blocks × block size), by the map and the nearest-code table of ``tables``."""
    absmax = blocks.abs().amax(dim=1).clamp_(max=FLOAT32_MAX)
    # Passed on unnamed: ``nearest_codes`` frees it as soon as it has read it.
    codes = nearest_codes((blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).reshape(-1), tables[1])
    codes = codes.to(torch.uint8)
    if storage.bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes, absmax


def dequantize(
    codes: Tensor, absmax: Tensor, storage: Storage, tables: tuple[Tensor, ...], out: Tensor | None = None
) -> Tensor:
    """The fp32 blocks (blocks × block size, padding included) that ``codes`` and ``absmax``
    stand for; written into the flat ``out`` when given (of their size)."""
    if storage.bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1)
    # int32 indices: half the memory traffic of the int64 ones plain indexing makes.
    values = torch.index_select(tables[0], 0, codes.reshape(-1).int(), out=out)
    return values.view(-1, storage.block_size).mul_(absmax.unsqueeze(1))


def blocks_of(flat: Tensor, block_size: int) -> Tensor:
    """The fp32 vector ``flat`` zero-padded to whole blocks, as (blocks, block_size)."""
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)


def nearest_codes(normalized: Tensor, table: Tensor) -> Tensor:
    """The int32 codes of the flat fp32 ``normalized`` by ``table`` (``_nearest_table``).
    Integer arithmetic on the bits, so that a compiled loop keeps it in vectors.
    ``normalized`` is only read (compiled loops that write into an intermediate of the step
    ran twice as long: docs/results/storage.md), and freed once read when the caller holds no
    other name of it: eagerly, two temporaries of its size at a time besides the lookup."""
    bits = normalized.view(torch.int32)
    # index_select takes the int32 buckets as they are (indexing would convert them to int64).
    entry = table.index_select(0, bits.bitwise_right_shift(LOOKUP_SHIFT).bitwise_and_(LOOKUP_MASK))
    keys = _to_keys_(bits.bitwise_right_shift(31), bits)
    del normalized, bits
    keys.gt_(entry.bitwise_and(THRESHOLD_MASK))  # past the midpoint: 1
    return entry.bitwise_right_shift_(KEY_BITS).add_(keys)


def _nearest_table(midpoints: Tensor, floor: int | None) -> Tensor:
    """Every bucket's first code (int32, above ``KEY_BITS`` bits) and the key after which its
    values take the next code (``KEY_MASK``: none do).

    ``torch.bucketize``'s code of x is the number of midpoints below x. Within a bucket
    [lo, hi] holding at most one midpoint, that midpoint is the first one at or above lo, so the
    code of x is code(lo) + (x > midpoints[code(lo)]). ``floor``: a code positive values never
    take (they take the next one). Raises ``ValueError`` for a map whose midpoints are too dense
    for that (two in one bucket).
    """
    ids = torch.arange(LOOKUP_MASK + 1, dtype=torch.int64) << LOOKUP_SHIFT
    ends = torch.stack([ids, ids | KEY_MASK]).to(torch.int32).view(torch.float32)
    low, high = ends.amin(dim=0), ends.amax(dim=0)  # negative numbers run backwards in bits
    first = torch.bucketize(low, midpoints)
    finite = low.isfinite() & high.isfinite()
    if int((torch.bucketize(high, midpoints) - first)[finite].max()) > 1:
        raise ValueError("code map too dense for the lookup table: two midpoints in one bucket")
    # After the last midpoint +inf: a value in the top bucket never moves past the last code.
    after = torch.cat([midpoints, midpoints.new_full((1,), torch.inf)])[first]
    inside = after <= high
    after_bits = after.view(torch.int32)
    threshold = torch.where(inside, _to_keys_(after_bits.bitwise_right_shift(31), after_bits), KEY_MASK)
    if floor is not None:
        positive = (ids < 1 << 31) & (first == floor)
        threshold = torch.where(positive, torch.where(ids == 0, 0, KEY_MASK), threshold)
        first = torch.where(positive & (ids > 0), floor + 1, first)
    return (first << KEY_BITS | threshold).int()


def _to_keys_(signs: Tensor, bits: Tensor) -> Tensor:
    """Overwrite ``signs`` (``bits`` shifted right by 31: all ones for negative numbers) with the
    keys of the fp32 numbers of int32 ``bits``, their positions within their buckets ascending
    with the value: the low bits, reversed for negative numbers. Returns ``signs``."""
    return signs.bitwise_xor_(bits).bitwise_and_(KEY_MASK)
