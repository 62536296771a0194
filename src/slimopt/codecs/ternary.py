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

Blocks and bytes run down the columns (``grid``): in a matrix of at least 32 rows, byte (a, c)
holds the digits of rows 5a … 5a+4 of column c and block (b, c) covers rows 8b … 8b+7 of it (the
last byte and block are padded). A pass over the matrix row by row then reads the codes and
exponents of a row as contiguous vectors, as it reads the row's values: the fused step decodes
in its vector loop instead of gathering bytes and exponents element by element (measured:
docs/changes.md). A matrix of
fewer rows is laid out as one column of its elements in order: padding a few rows to a whole
block would cost more than the layout saves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache

import torch
from torch import Tensor

from slimopt.checks import FLOAT32_MAX
from slimopt.codecs.base import Storage
from slimopt.codecs.draws import stream_seed, uniform
from slimopt.codecs.slicing import matrix_shape, pieces
from slimopt.memory import untracked

TRITS_PER_BYTE = 5
EXPONENT_STEPS_PER_OCTAVE = 4

# _DIGITS[b] are the five ternary digits of byte b, least significant first.
_DIGITS = torch.stack([(torch.arange(256) // 3**k) % 3 for k in range(TRITS_PER_BYTE)], dim=1).to(torch.uint8)


@cache
def _digit_table(device: torch.device) -> Tensor:
    """The digits of every byte on ``device``, copied there once."""
    with untracked():  # a cache for the whole process, not memory of a training step
        return _DIGITS.to(device)


def nonzero_scale(scale: Tensor) -> Tensor:
    """``scale`` with zeros read as ones (an all-zero row or column stays zero)."""
    return torch.where(scale > 0, scale, 1.0)


def _pad_rows(grid: Tensor, multiple: int) -> Tensor:
    """``grid`` with zero rows added up to a multiple of ``multiple`` rows."""
    padding = -grid.shape[0] % multiple
    return torch.cat([grid, grid.new_zeros(padding, grid.shape[1])]) if padding else grid


# A row (column) scale is kept when the matrix has at least this many columns (rows): 4 bytes
# per row over 32 columns is 1/8 byte per element.
MIN_SCALED_LENGTH = 32


def scaled_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, columns) of the matrix a ternary moment of ``shape`` is scaled and laid out as. A
    3-D moment (a mixture of experts' stacked experts × rows × columns, as the factored second
    moment reads it too) is the (experts·rows) × columns matrix of its experts' rows, so that each
    row and each column gets a scale as a linear layer's do; ``shape[0] × rest`` would give an
    expert one scale (fewer than 32 experts: no column scales) and blocks along memory, which
    trained Mixtral 1.5–2% worse (docs/results/ternary.md). Any other shape: ``matrix_shape``."""
    if len(shape) == 3:
        return shape[0] * shape[1], shape[2]
    return matrix_shape(shape)


def grid(rows: int, cols: int) -> tuple[int, int]:
    """The (rows, columns) that blocks and bytes of a rows × cols matrix run down: the matrix
    itself from ``MIN_SCALED_LENGTH`` rows, else one column of all its elements."""
    return (rows, cols) if rows >= MIN_SCALED_LENGTH else (rows * cols, 1)


def scale_layout(shape: torch.Size) -> tuple[bool, bool]:
    """(row scale?, column scale?) for a moment of ``shape``; at least one is kept."""
    rows, cols = scaled_shape(shape)
    col_scale = rows >= MIN_SCALED_LENGTH
    return cols >= MIN_SCALED_LENGTH or not col_scale, col_scale


class TernaryCodec:
    """{-1, 0, +1} × row scale × column scale × per-block power-of-2^(1/4) scale."""

    def __init__(self, block_size: int, *, row_scale: bool, col_scale: bool) -> None:
        self.block_size = block_size
        self.row_scale = row_scale
        self.col_scale = col_scale
        self.parts = ("trits", "exponents") + ("row",) * row_scale + ("col",) * col_scale
        self.storage = Storage("ternary", block_size, row_scale=row_scale, col_scale=col_scale)

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        matrix = value.float().reshape(scaled_shape(value.shape))
        rows, cols = matrix.shape
        grid_rows, grid_cols = grid(rows, cols)
        parts = self._pieces(rows, cols, matrix.device)
        stored = self._line_scales(matrix, parts)
        stored["exponents"] = matrix.new_empty(
            (-(-grid_rows // self.block_size), grid_cols), dtype=torch.uint8
        )
        stored["trits"] = matrix.new_empty((-(-grid_rows // TRITS_PER_BYTE), grid_cols), dtype=torch.uint8)
        seed = stream_seed(generator, matrix.device)
        for piece in parts:
            self._encode_piece(matrix, piece, stored, seed)
        stored["exponents"], stored["trits"] = stored["exponents"].view(-1), stored["trits"].view(-1)
        return stored

    def _line_scales(self, matrix: Tensor, parts: list[slice]) -> dict[str, Tensor]:
        """The row scales and the column scales of ``matrix`` (those the codec keeps), the row
        scales piece by piece and the column maxima taken over the pieces in place: no piece's
        scales outlive it."""
        stored: dict[str, Tensor] = {}
        for piece in parts:
            row, col = line_scales(matrix[piece], self.storage)
            if row is not None:
                stored.setdefault("row", matrix.new_empty(matrix.shape[0]))[piece] = row
            if col is not None and "col" in stored:
                torch.maximum(stored["col"], col, out=stored["col"])
            elif col is not None:
                stored["col"] = col
        return stored

    def _pieces(self, rows: int, cols: int, device: torch.device) -> list[slice]:
        """The pieces of rows the codec goes through (``slicing.pieces``), whole blocks and bytes
        of the grid: the matrix itself from ``MIN_SCALED_LENGTH`` rows (a matrix of fewer rows,
        whose grid is one column, goes whole)."""
        if grid(rows, cols)[1] != cols:
            return [slice(0, rows)]
        return pieces(rows, cols, math.lcm(self.block_size, TRITS_PER_BYTE), device)

    def _encode_piece(self, matrix: Tensor, piece: slice, stored: dict[str, Tensor], seed: Tensor) -> None:
        """The block exponents and digits of rows ``piece`` of ``matrix`` into ``stored`` (its
        scales complete, its codes as grid rows); the piece's temporaries die here."""
        grid_cols = stored["trits"].shape[1]
        row = stored.get("row")
        normalized = normalized_by_lines(
            matrix[piece], None if row is None else row[piece], stored.get("col")
        )
        normalized = normalized.view(-1, grid_cols)
        exponents, scales = block_exponents(normalized, self.block_size)
        first = piece.start * matrix.shape[1] // grid_cols  # the piece's first grid row
        stored["exponents"][first // self.block_size :][: scales.shape[0]] = exponents.view(-1, grid_cols)
        trits = packed_trits(normalized, scales, self.block_size, seed, first * grid_cols).view(-1, grid_cols)
        stored["trits"][first // TRITS_PER_BYTE :][: trits.shape[0]] = trits

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        rows, cols = scaled_shape(shape)
        value = stored["trits"].new_empty((rows, cols), dtype=torch.float32)
        for piece in self._pieces(rows, cols, value.device):
            value[piece] = self._decoded_piece(stored, piece, rows, cols)
        return value.view(shape)

    def _decoded_piece(self, stored: Mapping[str, Tensor], piece: slice, rows: int, cols: int) -> Tensor:
        """Rows ``piece`` of the decoded rows × cols matrix."""
        grid_cols = grid(rows, cols)[1]
        first = piece.start * cols // grid_cols  # the piece's first grid row
        grid_rows = (piece.stop - piece.start) * cols // grid_cols
        trits = stored["trits"].view(-1, grid_cols)[first // TRITS_PER_BYTE :][
            : -(-grid_rows // TRITS_PER_BYTE)
        ]
        # A table lookup of each byte's five digits: in eager PyTorch faster than the arithmetic
        # of ``digits_by_arithmetic``, which a compiled loop vectorizes instead (same digits).
        digits = _digit_table(trits.device).index_select(0, trits.reshape(-1).int())
        # (bytes, columns, digit) → rows in order: digit k of byte row a is row 5a + k.
        digits = digits.view(-1, grid_cols, TRITS_PER_BYTE).transpose(1, 2).reshape(-1, grid_cols)
        signs = digits[:grid_rows].float().sub_(1)
        exponents = stored["exponents"].view(-1, grid_cols)[first // self.block_size :]
        scales = block_scales(
            exponents[: -(-grid_rows // self.block_size)], self.block_size, grid_rows, grid_cols
        )
        row = stored.get("row")
        # No name holds the unscaled values: each product frees the one before.
        return scaled_by_lines(
            (signs * scales).view(-1, cols), None if row is None else row[piece], stored.get("col")
        )


# Encoding is three passes over the moment, each ending in a reduction of its own shape: the row
# and column scales, the blocks' exponents, the digits packed to bytes. The codec runs them in
# order; the fused step compiles each on its own (``slimopt.kernels``): compiled as one function,
# Inductor fuses them into loops that recompute across them, four times slower
# (docs/results/storage.md). Each pass divides the moment by the scales the passes before it
# found, rather than reading a divided copy: the scales are vectors along a row, so this costs
# no more than reading a copy, and no matrix-sized temporary outlives a pass.


def line_scales(matrix: Tensor, storage: Storage) -> tuple[Tensor | None, Tensor | None]:
    """The row scales (row maxima) and the column scales (column maxima of the row-normalized
    matrix) of the fp32 ``matrix`` that ``storage`` keeps; None for one it does not."""
    row = matrix.abs().amax(dim=1).clamp_(max=FLOAT32_MAX) if storage.row_scale else None
    col = normalized_by_lines(matrix, row, None).abs().amax(dim=0) if storage.col_scale else None
    return row, col


def normalized_by_lines(matrix: Tensor, row: Tensor | None, col: Tensor | None) -> Tensor:
    """``matrix``, saturated, divided by its row and column scales (a new tensor)."""
    normalized = matrix.clamp(-FLOAT32_MAX, FLOAT32_MAX)
    if row is not None:
        normalized.div_(nonzero_scale(row).unsqueeze(1))
    if col is not None:
        normalized.div_(nonzero_scale(col))
    return normalized


def scaled_by_lines(values: Tensor, row: Tensor | None, col: Tensor | None) -> Tensor:
    """Decoded ``values`` times their row and column scales."""
    if row is not None:
        values = values * row.unsqueeze(1)
    if col is not None:
        values = values * col
    return values


def on_grid(matrix: Tensor) -> Tensor:
    """The rows × cols ``matrix`` as its grid (``grid``)."""
    return matrix.reshape(grid(*matrix.shape))


def block_exponents(normalized: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """The exponent codes (uint8, flat) of the blocks of the normalized values, given as rows of
    the grid (``on_grid``: all of them, or a piece from a block's first row), and the scales they
    stand for (blocks × columns of the grid), which ``packed_trits`` divides by."""
    grid_cols = normalized.shape[1]
    blocks = _pad_rows(normalized, block_size)
    block_max = blocks.view(-1, block_size, grid_cols).abs().amax(dim=1)
    exponents = torch.ceil(-EXPONENT_STEPS_PER_OCTAVE * torch.log2(block_max)).clamp_(0, 255)
    # log2 rounding must not leave the scale below the block maximum.
    exponents = torch.where(exponent_scale(exponents) < block_max, exponents - 1, exponents)
    return exponents.to(torch.uint8).view(-1), exponent_scale(exponents)


def _digits(scaled: Tensor, draws: Tensor) -> Tensor:
    """Digits 0, 1, 2 (uint8) for -1, 0, +1: +1 where the draw is below a positive value, -1
    where it is below the magnitude of a negative one. Two formulations of the same digits: a
    compiled loop vectorizes ``torch.where`` and not uint8 arithmetic, eager PyTorch runs the
    sum of two comparisons four times faster than ``torch.where`` (docs/results/storage.md)."""
    if torch.compiler.is_compiling():
        return torch.where(draws < scaled.abs(), scaled.sign(), 0.0).add_(1).to(torch.uint8)
    return (draws < scaled).to(torch.uint8).add_((scaled < -draws).logical_not_())


def packed_trits(normalized: Tensor, scales: Tensor, block_size: int, seed: Tensor, start: int = 0) -> Tensor:
    """The digits of the normalized values (grid rows, as ``block_exponents`` takes them)
    divided by their blocks' ``scales``, stochastically rounded with draws of stream ``seed``
    (element i of the grid in row-major order takes draw i; ``start``: the index of the first
    element given), five grid rows to a byte row. Divides ``normalized`` in place."""
    grid_rows, grid_cols = normalized.shape
    # Divided as blocks, the scales broadcast: no matrix-sized tensor of scales.
    scaled = _pad_rows(normalized, block_size)
    scaled.view(-1, block_size, grid_cols).div_(scales.unsqueeze(1))
    scaled = scaled[:grid_rows]
    draws = uniform(seed, scaled.numel(), start).view(grid_rows, grid_cols)
    digits = _digits(scaled, draws)
    digits = _pad_rows(digits, TRITS_PER_BYTE).view(-1, TRITS_PER_BYTE, grid_cols)
    packed = digits[:, 0]
    for k in range(1, TRITS_PER_BYTE):
        packed = packed + digits[:, k] * 3**k
    return packed.view(-1)


def digits_by_arithmetic(trits: Tensor, grid_rows: int, grid_cols: int) -> Tensor:
    """The digits (0, 1, 2 as fp32) of a grid_rows × grid_cols grid: row r is digit r mod 5 of
    byte row r // 5. Written as float arithmetic on each row's bytes, one vector per row, so a
    compiled loop decodes as it goes: the byte plus a half, times 3^-k, floored, is the byte's
    leading digits exactly (a byte is below 243, so the half keeps the product at least 1/162
    from an integer, far beyond fp32's rounding)."""
    byte_rows = -(-grid_rows // TRITS_PER_BYTE)
    trits = trits.view(byte_rows, grid_cols).float() + 0.5
    trits = trits.unsqueeze(1).expand(byte_rows, TRITS_PER_BYTE, grid_cols).reshape(-1, grid_cols)[:grid_rows]
    digit = (torch.arange(grid_rows, device=trits.device) % TRITS_PER_BYTE).unsqueeze(1)
    inverse_power = torch.full_like(digit, 1.0, dtype=torch.float32)
    for k in range(1, TRITS_PER_BYTE):
        inverse_power = torch.where(digit == k, 3.0**-k, inverse_power)
    leading = torch.floor(trits * inverse_power)
    return leading - 3 * torch.floor((leading + 0.5) * (1 / 3))


def block_scales(exponents: Tensor, block_size: int, grid_rows: int, grid_cols: int) -> Tensor:
    """Each element's block scale on the grid."""
    return _by_grid_row(exponent_scale(exponents.view(-1, grid_cols).float()), block_size, grid_rows)


def _by_grid_row(per_block: Tensor, block_size: int, grid_rows: int) -> Tensor:
    """A (blocks, columns) tensor on the grid's rows: row r takes block row r // block_size."""
    blocks, grid_cols = per_block.shape
    return per_block.unsqueeze(1).expand(blocks, block_size, grid_cols).reshape(-1, grid_cols)[:grid_rows]


def exponent_scale(exponents: Tensor) -> Tensor:
    """The block scale each exponent code stands for: 2^(-e/4)."""
    return torch.exp2(-exponents / EXPONENT_STEPS_PER_OCTAVE)
