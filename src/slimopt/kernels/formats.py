"""Every storage format as the fused step reads and writes it: a moment's stored tensors to an
fp32 matrix and back, written as plain tensor code that ``torch.compile`` fuses with the update.

Each function does what its codec in ``slimopt.codecs`` does, in the same order of floating-point
operations, on the (rows, columns) matrix the update works in; stochastic formats draw from the
counter-based stream of ``slimopt.codecs.draws`` by element index, as their codecs do, so a fused
step writes the codes the reference path would for the same values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slimopt.codecs.blockwise import LOOKUP_MASK, LOOKUP_SHIFT, BlockwiseCodec
from slimopt.codecs.draws import draw_indices, random_words, uniform_from_words
from slimopt.codecs.factored import FactoredCodec
from slimopt.codecs.plain import FLOAT32_MAX, Bf16Codec, Fp32Codec, round_to_bf16_with_stream
from slimopt.codecs.ternary import EXPONENT_STEPS_PER_OCTAVE, TRITS_PER_BYTE, TernaryCodec

# Formats whose scales follow rows and columns: their moments are decoded as matrices.
MATRIX_KINDS = ("ternary", "factored")


@dataclass(frozen=True)
class Storage:
    """How one moment is stored, as the compiled step needs to know it (lookup tables are passed
    as tensors): the format, and for blocks their size, code width and zero handling, for
    ternary storage which scale vectors it keeps."""

    kind: str = "fp32"  # fp32, bf16, blockwise, ternary or factored
    block_size: int = 0
    bits: int = 8
    positive_floor: bool = False
    zero_code: int = 0
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
        return Storage("blockwise", codec.block_size, codec.bits, codec.positive_floor, codec.zero_code)
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
    exponents = parts["exponents"]
    codes = parts["codes"].view(-1).int()
    digits = torch.stack([(codes // 3**k) % 3 for k in range(TRITS_PER_BYTE)], dim=1).reshape(-1)
    signs = digits[: exponents.numel() * storage.block_size].float().sub(1).view(-1, storage.block_size)
    values = _unpad(signs * _exponent_scale(exponents.float()).unsqueeze(1), rows * cols).view(rows, cols)
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
    where it is False every part keeps what it holds (a step skipped on the device)."""
    if storage.kind == "fp32":
        store(parts[""].view(value.shape), value, keep)
    elif storage.kind == "bf16":
        store(parts[""].view(value.shape), round_to_bf16(value, seed), keep)
    elif storage.kind == "factored":
        ceiling = FLOAT32_MAX / max(value.shape[0], value.shape[1])
        store(parts["row"], value.mean(dim=-1).clamp(max=ceiling), keep)
        store(parts["col"], value.mean(dim=-2).clamp(max=ceiling), keep)
    elif storage.kind == "blockwise":
        blocks = (
            value
            if value.shape == blocks_shape(parts, storage)
            else _pad(value.reshape(-1), storage.block_size)
        )
        _encode_blockwise(blocks, parts, storage, table, keep)
    else:
        _encode_ternary(value, parts, storage, seed, keep)


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
    _, midpoints, first_codes = table
    absmax = blocks.abs().amax(dim=1).clamp(max=FLOAT32_MAX)
    normalized = (blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).reshape(-1)
    bucket = normalized.view(torch.int32).bitwise_right_shift(LOOKUP_SHIFT).bitwise_and(LOOKUP_MASK)
    codes = first_codes[bucket].int()
    codes = codes + (normalized > midpoints[codes]).int()
    if storage.positive_floor:
        codes = torch.where((normalized > 0) & (codes == storage.zero_code), storage.zero_code + 1, codes)
    if storage.bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    store(parts["codes"].view(-1), codes.to(torch.uint8), keep)
    store(parts["absmax"], absmax, keep)


def _encode_ternary(
    value: Tensor, parts: dict[str, Tensor], storage: Storage, seed: Tensor, keep: Tensor | None
) -> None:
    scaled, _ = ternary_exponents(ternary_scales(value, parts, storage, keep), parts, storage, keep)
    ternary_codes(scaled, parts, seed, keep)


# Ternary encoding in three phases, each one pass that ends in a reduction of its own shape:
# rows and columns, blocks, bytes of five digits. Compiled as one function Inductor fuses the
# phases into loops that recompute across them (6.2 ms for a 1376×520 matrix on 2 CPU cores);
# compiled one by one, 1.5 ms.


def ternary_scales(value: Tensor, parts: dict[str, Tensor], storage: Storage, keep: Tensor | None) -> Tensor:
    """Phase 1: the row and column scales (written to ``parts``) and the matrix divided by them.
    (``keep``, in every phase: as ``encode``'s.)"""
    normalized = value.clamp(-FLOAT32_MAX, FLOAT32_MAX)
    if storage.row_scale:
        row = normalized.abs().amax(dim=1)
        normalized = normalized / torch.where(row > 0, row, 1.0).unsqueeze(1)
        store(parts["row"], row, keep)
    if storage.col_scale:
        col = normalized.abs().amax(dim=0)
        normalized = normalized / torch.where(col > 0, col, 1.0)
        store(parts["col"], col, keep)
    return normalized


def ternary_exponents(
    normalized: Tensor, parts: dict[str, Tensor], storage: Storage, keep: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Phase 2: each block's exponent (written to ``parts``) and the blocks divided by their
    scales, flat, padded to whole blocks; then the scales, which the caller drops: returned so
    that Inductor writes them out once per block, where it would otherwise compute both
    ``exp2`` of each block once per element, in a scalar loop (3.0 instead of 3.7 ms for
    4.2M elements)."""
    blocks = _pad(normalized.reshape(-1), storage.block_size)
    block_max = blocks.abs().amax(dim=1)
    exponents = torch.ceil(-EXPONENT_STEPS_PER_OCTAVE * torch.log2(block_max)).clamp(0, 255)
    exponents = torch.where(_exponent_scale(exponents) < block_max, exponents - 1, exponents)
    store(parts["exponents"], exponents.to(torch.uint8), keep)
    scale = _exponent_scale(exponents)
    return (blocks / scale.unsqueeze(1)).reshape(-1), scale


def ternary_codes(scaled: Tensor, parts: dict[str, Tensor], seed: Tensor, keep: Tensor | None) -> None:
    """Phase 3: the digits, stochastically rounded with draws of stream ``seed``, five to a byte."""
    draws = uniform_from_words(random_words(seed, draw_indices(scaled.numel(), scaled.device)))
    digits = torch.where(draws < scaled.abs(), scaled.sign(), 0.0).add(1).int()
    digits = torch.nn.functional.pad(digits, (0, -digits.numel() % TRITS_PER_BYTE)).view(-1, TRITS_PER_BYTE)
    packed = sum(digits[:, k] * 3**k for k in range(TRITS_PER_BYTE))
    store(parts["codes"], packed.to(torch.uint8), keep)


def _exponent_scale(exponents: Tensor) -> Tensor:
    return torch.exp2(-exponents / EXPONENT_STEPS_PER_OCTAVE)


def _pad(flat: Tensor, block_size: int) -> Tensor:
    """``flat`` padded with zeros to whole blocks, as blocks × block_size."""
    return torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)


def _unpad(blocks: Tensor, numel: int) -> Tensor:
    return blocks.reshape(-1)[:numel]
