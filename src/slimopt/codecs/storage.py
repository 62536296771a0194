"""Every storage format as plain tensor code of a moment's stored parts, for the fused steps
(``slimopt.kernels``), which compile it with the update: decode the parts to an fp32 matrix, and
write a new value into them in place, where a one-element ``keep`` flag can leave them as they
are (a step skipped on the device). Each format's arithmetic is its codec's own function
(``blockwise.quantize``, ``ternary.block_exponents``, …), which the codec runs eagerly on the
reference path; stochastic formats draw from the stream of ``slimopt.codecs.draws`` by element
index, so a fused step writes the codes the reference path would for the same values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt.codecs import blockwise, factored, ternary
from slimopt.codecs.base import Storage, store
from slimopt.codecs.plain import round_to_bf16

# Formats whose scales follow rows and columns: their moments are decoded as matrices.
MATRIX_KINDS = ("ternary", "factored")


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
        return factored.product(parts["row"], parts["col"])
    if storage.kind == "blockwise":
        blocks = blockwise.dequantize(parts["codes"], parts["absmax"], storage, table)
        return (
            blocks
            if shape == blocks_shape(parts, storage)
            else blocks.reshape(-1)[: shape.numel()].view(shape)
        )
    grid_rows, grid_cols = ternary.grid(*shape)
    digits = ternary.digits_by_arithmetic(parts["trits"], grid_rows, grid_cols)
    scales = ternary.block_scales(parts["exponents"], storage.block_size, grid_rows, grid_cols)
    values = ((digits - 1) * scales).view(shape)
    return ternary.scaled_by_lines(values, parts.get("row"), parts.get("col"))


def encode_into(
    value: Tensor,
    parts: dict[str, Tensor],
    storage: Storage,
    table: tuple[Tensor, ...],
    seed: Tensor | None,
    keep: Tensor | None = None,
) -> None:
    """Write the fp32 matrix ``value`` into the stored parts (in place); ``seed``: the stream of
    a stochastic format's draws (unused by the others). ``keep``: a one-element bool tensor;
    where it is False every part keeps what it holds. Ternary moments are written in passes
    instead (below), one compiled call each."""
    if storage.kind == "fp32":
        store(parts[""].view(value.shape), value, keep)
    elif storage.kind == "bf16":
        store(parts[""].view(value.shape), round_to_bf16(value, seed), keep)
    elif storage.kind == "factored":
        row, col = factored.means(value)
        store(parts["row"], row, keep)
        store(parts["col"], col, keep)
    else:
        blocks = (
            value
            if value.shape == blocks_shape(parts, storage)
            else blockwise.blocks_of(value.reshape(-1), storage.block_size)
        )
        codes, absmax = blockwise.quantize(blocks, storage, table)
        store(parts["codes"].view(-1), codes, keep)
        store(parts["absmax"], absmax, keep)


def blocks_shape(parts: dict[str, Tensor], storage: Storage) -> torch.Size:
    """The (blocks, block size) shape of a blockwise moment's padded values. (Where a matrix
    has this shape, it is its blocks: nothing is padded.)"""
    return torch.Size((parts["absmax"].shape[0], storage.block_size))


# A ternary moment's three passes (``slimopt.codecs.ternary``) writing the stored parts; each
# pass reads the scales the passes before it stored. ``keep``: as ``encode_into``'s.


def write_line_scales(value: Tensor, parts: dict[str, Tensor], storage: Storage, keep: Tensor | None) -> None:
    """Pass 1: the row and column scales of the fp32 matrix ``value``."""
    row, col = ternary.line_scales(value, storage)
    if row is not None:
        store(parts["row"], row, keep)
    if col is not None:
        store(parts["col"], col, keep)


def write_exponents(value: Tensor, parts: dict[str, Tensor], storage: Storage, keep: Tensor | None) -> Tensor:
    """Pass 2: each block's exponent; returned, the blocks' scales, so that pass 3 reads them
    rather than compute ``exp2`` for every element."""
    normalized = ternary.normalized_by_lines(value, parts.get("row"), parts.get("col"))
    exponents, scales = ternary.block_exponents(ternary.on_grid(normalized), storage.block_size)
    store(parts["exponents"], exponents, keep)
    return scales


def write_trits(
    value: Tensor,
    scales: Tensor,
    parts: dict[str, Tensor],
    storage: Storage,
    seed: Tensor,
    keep: Tensor | None,
) -> None:
    """Pass 3: the digits, stochastically rounded with draws of stream ``seed``."""
    normalized = ternary.on_grid(ternary.normalized_by_lines(value, parts.get("row"), parts.get("col")))
    store(parts["trits"], ternary.packed_trits(normalized, scales, storage.block_size, seed), keep)
