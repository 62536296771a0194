"""Every storage format as the fused step reads and writes it: a moment's stored tensors to an
fp32 matrix and back, written as plain tensor code that ``torch.compile`` fuses with the update.

Each function does what its codec in ``slimopt.codecs`` does, in the same order of floating-point
operations, on the (rows, columns) matrix the update works in; stochastic formats draw from the
counter-based stream of ``slimopt.codecs.draws`` by element index, as their codecs do, so a fused
step writes the codes the reference path would for the same values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slimopt.checks import FLOAT32_MAX
from slimopt.codecs.blockwise import BlockwiseCodec, nearest_codes
from slimopt.codecs.draws import draw_indices, random_words, uniform_from_words
from slimopt.codecs.factored import FactoredCodec
from slimopt.codecs.plain import Bf16Codec, Fp32Codec, round_to_bf16_with_stream
from slimopt.codecs.ternary import (
    EXPONENT_STEPS_PER_OCTAVE,
    TRITS_PER_BYTE,
    TernaryCodec,
    exponent_scale,
    grid,
    nonzero_scale,
)
from slimopt.memory import untracked

# Formats whose scales follow rows and columns: their moments are decoded as matrices.
MATRIX_KINDS = ("ternary", "factored")


@dataclass(frozen=True)
class Storage:
    """How one moment is stored, as the compiled step needs to know it (lookup tables are passed
    as tensors): the format, and for blocks their size and code width, for ternary storage
    which scale vectors it keeps."""

    kind: str = "fp32"  # fp32, bf16, blockwise, ternary or factored
    block_size: int = 0
    bits: int = 8
    row_scale: bool = False
    col_scale: bool = False

    @property
    def stochastic(self) -> bool:
        return self.kind in ("bf16", "ternary")


# A ternary moment a compiled step leaves to its caller to encode in phases (below): its new
# value, its stream of draws, its stored parts and its storage.
Deferred = tuple[Tensor, Tensor, dict[str, Tensor], Storage]


def storage_of(codec: Any) -> Storage | None:
    """The ``Storage`` of a codec the fused step handles, else None."""
    if isinstance(codec, Fp32Codec):
        return Storage()
    if isinstance(codec, Bf16Codec):
        return Storage("bf16")
    if isinstance(codec, BlockwiseCodec):
        return Storage("blockwise", codec.block_size, codec.bits)
    if isinstance(codec, TernaryCodec):
        return Storage("ternary", codec.block_size, row_scale=codec.row_scale, col_scale=codec.col_scale)
    if isinstance(codec, FactoredCodec):
        return Storage("factored")
    return None


def decode(
    parts: dict[str, Tensor], storage: Storage, table: tuple[Tensor, ...], shape: torch.Size
) -> Tensor:
    """The fp32 moment of ``shape`` from its stored parts: a matrix (rows, columns), a flat
    vector, or for blockwise storage ``blocks_shape``: its blocks as stored, padding included."""
    if storage.kind == "fp32":
        return parts[""].view(shape)
    if storage.kind == "bf16":
        return parts[""].view(shape).float()
    if storage.kind == "factored":
        row, col = parts["row"], parts["col"]
        total = row.mean(dim=-1, keepdim=True)
        return (row / torch.where(total > 0, total, 1.0)).unsqueeze(-1) * col.unsqueeze(-2)
    if storage.kind == "blockwise":
        codes = parts["codes"].view(-1)
        if storage.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1)
        blocks = table[0][codes.int()].view(-1, storage.block_size) * parts["absmax"].unsqueeze(1)
        return blocks if shape == blocks_shape(parts, storage) else _unpad(blocks, shape.numel()).view(shape)
    rows, cols = shape
    grid_rows, grid_cols = grid(rows, cols)
    values = (_ternary_digits(parts["trits"], grid_rows, grid_cols) - 1) * _ternary_scales(
        parts["exponents"], storage.block_size, grid_rows, grid_cols
    )
    values = values.view(rows, cols)
    if storage.row_scale:
        values = values * parts["row"].unsqueeze(1)
    if storage.col_scale:
        values = values * parts["col"]
    return values


def encode(
    value: Tensor,
    parts: dict[str, Tensor],
    storage: Storage,
    table: tuple[Tensor, ...],
    seed: Tensor,
    keep: Tensor | None = None,
) -> None:
    """Write the fp32 matrix ``value`` into the stored parts (in place); ``seed``: the stream of
    a stochastic format's draws (unused by the others). ``keep``: a one-element bool tensor;
    where it is False every part keeps what it holds (a step skipped on the device). Ternary
    moments are encoded in phases instead (below), one compiled call each."""
    if storage.kind == "fp32":
        store(parts[""].view(value.shape), value, keep)
    elif storage.kind == "bf16":
        store(parts[""].view(value.shape), round_to_bf16(value, seed), keep)
    elif storage.kind == "factored":
        ceiling = FLOAT32_MAX / max(value.shape[0], value.shape[1])
        store(parts["row"], value.mean(dim=-1).clamp(max=ceiling), keep)
        store(parts["col"], value.mean(dim=-2).clamp(max=ceiling), keep)
    else:
        blocks = (
            value
            if value.shape == blocks_shape(parts, storage)
            else _pad(value.reshape(-1), storage.block_size)
        )
        _encode_blockwise(blocks, parts, storage, table, keep)


def store(target: Tensor, value: Tensor, keep: Tensor | None) -> None:
    """``target`` ← ``value``, unless the one-element bool ``keep`` is False (then unchanged)."""
    target.copy_(value if keep is None else torch.where(keep, value, target))


def blocks_shape(parts: dict[str, Tensor], storage: Storage) -> torch.Size:
    """The (blocks, block size) shape of a blockwise moment's padded values. (Where a matrix
    has this shape, it is its blocks: nothing is padded.)"""
    return torch.Size((parts["absmax"].shape[0], storage.block_size))


def round_to_bf16(value: Tensor, seed: Tensor | None) -> Tensor:
    """``value`` in bf16: stochastically with draws of stream ``seed``, else to nearest."""
    return value.to(torch.bfloat16) if seed is None else round_to_bf16_with_stream(value, seed)


def _encode_blockwise(
    blocks: Tensor, parts: dict[str, Tensor], storage: Storage, table: tuple[Tensor, ...], keep: Tensor | None
) -> None:
    absmax = blocks.abs().amax(dim=1).clamp(max=FLOAT32_MAX)
    normalized = (blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).reshape(-1)
    codes = nearest_codes(normalized, table[1])
    if storage.bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    store(parts["codes"].view(-1), codes.to(torch.uint8), keep)
    store(parts["absmax"], absmax, keep)


# Ternary encoding in three phases, each one pass over the new moment that ends in a reduction of
# its own shape: rows and columns, blocks, bytes of five digits. Compiled as one function
# Inductor fuses the phases into loops that recompute across them; compiled one by one they are
# four times faster (docs/results/storage.md). Each phase divides the moment by the scales the
# phases before it stored, as the codec does, rather than reading a divided copy: on the grid the
# scales are vectors along a row, so this costs no more than reading a copy, and an update
# allocates no matrix-sized temporaries beyond the moment itself (fresh pages from the
# allocator cost as much as a pass over memory here).


def ternary_scales(value: Tensor, parts: dict[str, Tensor], storage: Storage, keep: Tensor | None) -> None:
    """Phase 1: the row and column scales of the fp32 matrix ``value``, written to ``parts``.
    (``keep``, in every phase: as ``encode``'s.)"""
    normalized = value.clamp(-FLOAT32_MAX, FLOAT32_MAX)
    if storage.row_scale:
        row = normalized.abs().amax(dim=1)
        normalized = normalized / nonzero_scale(row).unsqueeze(1)
        store(parts["row"], row, keep)
    if storage.col_scale:
        store(parts["col"], normalized.abs().amax(dim=0), keep)


def ternary_exponents(
    value: Tensor, parts: dict[str, Tensor], storage: Storage, keep: Tensor | None
) -> Tensor:
    """Phase 2: each block's exponent, written to ``parts``; returned, the blocks' scales (blocks ×
    columns of the grid, ``slimopt.codecs.ternary.grid``) for phase 3, so that it reads them
    rather than compute ``exp2`` for every element."""
    normalized = _normalized(value, parts, storage)
    grid_rows, grid_cols = grid(*normalized.shape)
    padding = -grid_rows % storage.block_size
    blocks = torch.nn.functional.pad(normalized.reshape(grid_rows, grid_cols), (0, 0, 0, padding))
    block_max = blocks.view(-1, storage.block_size, grid_cols).abs().amax(dim=1)
    exponents = torch.ceil(-EXPONENT_STEPS_PER_OCTAVE * torch.log2(block_max)).clamp(0, 255)
    exponents = torch.where(exponent_scale(exponents) < block_max, exponents - 1, exponents)
    store(parts["exponents"], exponents.to(torch.uint8).view(-1), keep)
    return exponent_scale(exponents)


def ternary_codes(
    value: Tensor,
    scales: Tensor,
    parts: dict[str, Tensor],
    storage: Storage,
    seed: Tensor,
    keep: Tensor | None,
) -> None:
    """Phase 3: the digits of ``value`` divided by its row, column and block ``scales``,
    stochastically rounded with draws of stream ``seed``, five grid rows to a byte row."""
    grid_rows, grid_cols = grid(*value.shape)
    scales = _by_grid_row(scales, storage.block_size, grid_rows)
    scaled = _normalized(value, parts, storage).reshape(grid_rows, grid_cols) / scales
    words = random_words(seed, draw_indices(scaled.numel(), scaled.device))
    draws = uniform_from_words(words).view(grid_rows, grid_cols)
    digits = torch.where(draws < scaled.abs(), scaled.sign(), 0.0).add(1)
    padding = -grid_rows % TRITS_PER_BYTE
    digits = torch.nn.functional.pad(digits, (0, 0, 0, padding)).view(-1, TRITS_PER_BYTE, grid_cols)
    packed = sum(digits[:, k] * 3**k for k in range(TRITS_PER_BYTE))
    store(parts["trits"], packed.to(torch.uint8).view(-1), keep)


def _normalized(value: Tensor, parts: dict[str, Tensor], storage: Storage) -> Tensor:
    """``value`` divided by the row and column scales in ``parts``, in the codec's order."""
    normalized = value.clamp(-FLOAT32_MAX, FLOAT32_MAX)
    if storage.row_scale:
        normalized = normalized / nonzero_scale(parts["row"]).unsqueeze(1)
    if storage.col_scale:
        normalized = normalized / nonzero_scale(parts["col"])
    return normalized


def _ternary_digits(trits: Tensor, grid_rows: int, grid_cols: int) -> Tensor:
    """The digits (0, 1, 2 as fp32) of a grid_rows × grid_cols grid: row r is digit r mod 5 of
    byte row r // 5. Written as float arithmetic on each row's bytes, one vector per row, so
    the update's loop decodes as it goes: the byte plus a half, times 3^-k, floored, is the
    byte's leading digits exactly (a byte is below 243, so the half keeps the product at least
    1/162 from an integer, far beyond fp32's rounding)."""
    byte_rows = -(-grid_rows // TRITS_PER_BYTE)
    trits = trits.view(byte_rows, grid_cols).float() + 0.5
    trits = trits.unsqueeze(1).expand(byte_rows, TRITS_PER_BYTE, grid_cols).reshape(-1, grid_cols)[:grid_rows]
    digit = (torch.arange(grid_rows, device=trits.device) % TRITS_PER_BYTE).unsqueeze(1)
    inverse_power = torch.full_like(digit, 1.0, dtype=torch.float32)
    for k in range(1, TRITS_PER_BYTE):
        inverse_power = torch.where(digit == k, 3.0**-k, inverse_power)
    leading = torch.floor(trits * inverse_power)
    return leading - 3 * torch.floor((leading + 0.5) * (1 / 3))


def _ternary_scales(exponents: Tensor, block_size: int, grid_rows: int, grid_cols: int) -> Tensor:
    """Each element's block scale on the grid."""
    return _by_grid_row(exponent_scale(exponents.view(-1, grid_cols).float()), block_size, grid_rows)


def _by_grid_row(per_block: Tensor, block_size: int, grid_rows: int) -> Tensor:
    """A (blocks, columns) tensor on the grid's rows: row r takes block row r // block_size."""
    blocks, grid_cols = per_block.shape
    return per_block.unsqueeze(1).expand(blocks, block_size, grid_cols).reshape(-1, grid_cols)[:grid_rows]


def _pad(flat: Tensor, block_size: int) -> Tensor:
    """``flat`` padded with zeros to whole blocks, as blocks × block_size."""
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)


def _unpad(blocks: Tensor, numel: int) -> Tensor:
    return blocks.reshape(-1)[:numel]


# One moment as the fused steps take it: its stored parts by name, their storage, its lookup
# tables (empty but for blocks).
Moment = tuple[dict[str, Tensor], Storage, tuple[Tensor, ...]]


@functools.lru_cache(maxsize=256)
def scalars(values: tuple[float, ...], device: torch.device) -> Tensor:
    """``values`` as an fp32 tensor on ``device``, each rounded once from double precision,
    cached: shared by every parameter with the same scalars (read only), one host-to-device
    copy per group and step, not one per parameter."""
    with untracked():  # a cache shared by the steps, not memory of one
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
