"""The fused AdamW step of a matrix with ternary states as hand-written Triton kernels: a ternary
first moment with row and column scales (``slimopt.codecs.ternary``) and a factored second
moment (``slimopt.codecs.factored``), the pair ``states="ternary"`` gives every matrix of at
least 32×32.

Both moments' new scales are reductions over the whole matrix, and each scale divides the values
the next one is taken of, so a step is four launches, each a pass that ends in the reduction the
next one needs:

1. the update, by strips of rows: decode both moments, update them, write the parameter (or the
   direction of a projected matrix), write the new first moment in fp32 to a scratch matrix (as
   the compiled step does), and reduce each row: the first moment's row scales, the second's row
   means, and per strip the second moment's column sums;
2. by chunks of column strips: the first moment's column scales (an atomic maximum across
   chunks) and the second's column means;
3. by tiles of blocks: each block's exponent;
4. by tiles of bytes: the digits, five rows to a byte, stochastically rounded with the draws of
   ``slimopt.codecs.draws`` by element, as the codec draws them.

Each kernel computes what the codecs compute, in their order of operations; the exponents'
scales are read from a table that PyTorch computed, so they are the codec's bit for bit. A step
skipped on the device (``keep`` False) stores nothing but a zero direction. With
``TRITON_INTERPRET=1`` set before this module is imported the kernels run on CPU tensors, which
is how they are tested without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimopt.checks import FLOAT32_MAX
from slimopt.codecs.base import Storage
from slimopt.codecs.ternary import EXPONENT_STEPS_PER_OCTAVE, TRITS_PER_BYTE, exponent_scale
from slimopt.kernels.triton_parts import (
    adamw_update,
    and_writes,
    parameter_target,
    random_words,
    write_target,
)
from slimopt.memory import untracked

# Tile sizes: rows of a strip, columns of a tile (one strip's row reductions stay in registers;
# the second moment's column sums are written once per strip). Strips of 8 rows give a
# 2048-row matrix 256 programs in pass 1, about two per multiprocessor of a large GPU.
STRIP_ROWS = 8
TILE_COLUMNS = 64
# Values read at a time when summing the second moment's row means.
SUM_CHUNK = 1024
# Rows of a program of pass 2 (a share of a column strip: thousands of programs on a large
# matrix, where one program per strip would leave most of a GPU idle).
CHUNK_ROWS = 256
EXPONENTS = 256  # an exponent is one byte
FLOAT32_MAX_ = tl.constexpr(FLOAT32_MAX)
STEPS_PER_OCTAVE_ = tl.constexpr(EXPONENT_STEPS_PER_OCTAVE)
TRITS_PER_BYTE_ = tl.constexpr(TRITS_PER_BYTE)


def handles(storages: tuple[Storage, Storage]) -> bool:
    """Whether these kernels cover moments stored as ``storages``: a ternary first moment with
    row and column scales (a matrix of at least 32×32 rows and columns, laid out as itself) and
    a factored second moment."""
    first, second = storages
    return first.kind == "ternary" and first.row_scale and first.col_scale and second.kind == "factored"


def adamw_step(
    grad: Tensor,
    moments: tuple[dict[str, Tensor], dict[str, Tensor]],
    storages: tuple[Storage, Storage],
    tables: tuple[tuple[Tensor, ...], tuple[Tensor, ...]],
    hyper: Tensor,
    weights: Tensor | None,
    seeds: tuple[Tensor, ...],
    keep: Tensor | None = None,
) -> Tensor | None:
    """``slimopt.kernels.adamw_step`` for storages that ``handles`` accepts: the arguments of
    its compiled step (``slimopt.kernels.adamw.adamw_step``; ``grad`` a contiguous rows ×
    columns matrix, ``weights`` its parameter), the direction returned when ``weights`` is None."""
    rows, cols = grad.shape
    direction = grad.new_empty(grad.shape) if weights is None else None
    first, second = moments
    block_size = storages[0].block_size
    streams = iter(seeds)
    first_seed = next(streams)  # the factored second moment draws nothing
    target, mode, weight_seed = parameter_target(weights, direction, streams, hyper)
    masked = keep is not None
    keep = hyper if keep is None else keep
    strips = triton.cdiv(rows, STRIP_ROWS)
    # The new first moment (as the compiled step keeps it), the second moment's new row means
    # (its old ones are read by every strip) and each strip's column sums.
    value = grad.new_empty(grad.shape)
    row_means = grad.new_empty(rows)
    column_sums = grad.new_empty(strips, cols)
    # The new column scales, gathered by atomic maxima of their bits (see _column_scales) into
    # zeros that pass 1 writes.
    col_max = torch.empty(cols, dtype=torch.int32, device=grad.device)
    col_scale = col_max.view(torch.float32)
    ceiling = FLOAT32_MAX / max(rows, cols)  # the factored codec's saturation
    scales = _exponent_scales(grad.device)
    _update_strips[(strips,)](
        grad, target, weight_seed, hyper, keep, value,
        first["trits"], first["exponents"], first["row"], first["col"], scales,
        second["row"], second["col"], row_means, column_sums, col_max, rows, cols, ceiling,
        MODE=mode, MASKED=masked, BLOCK=block_size, ROWS=STRIP_ROWS, COLUMNS=TILE_COLUMNS, CHUNK=SUM_CHUNK,
    )  # fmt: skip
    column_strips = triton.cdiv(cols, TILE_COLUMNS)
    _column_scales[(column_strips, triton.cdiv(rows, CHUNK_ROWS))](
        keep, value, first["row"], col_max, second["row"], second["col"], row_means, column_sums,
        rows, cols, strips, triton.cdiv(rows, column_strips), ceiling,
        MASKED=masked, ROWS=STRIP_ROWS, COLUMNS=TILE_COLUMNS, CHUNK_ROWS=CHUNK_ROWS,
    )  # fmt: skip
    block_rows = triton.cdiv(rows, block_size)
    _block_exponents[(triton.cdiv(block_rows, STRIP_ROWS), column_strips)](
        keep, value, first["row"], first["col"], col_scale, first["exponents"], scales,
        rows, cols, block_rows,
        MASKED=masked, BLOCK=block_size, ROWS=STRIP_ROWS, COLUMNS=TILE_COLUMNS,
    )  # fmt: skip
    byte_rows = triton.cdiv(rows, TRITS_PER_BYTE)
    _digits[(triton.cdiv(byte_rows, STRIP_ROWS), column_strips)](
        keep, value, first["row"], col_scale, first["exponents"], scales, first_seed, first["trits"],
        rows, cols, byte_rows,
        MASKED=masked, BLOCK=block_size, ROWS=STRIP_ROWS, COLUMNS=TILE_COLUMNS,
    )  # fmt: skip
    return direction


@functools.cache
def _exponent_scales(device: torch.device) -> Tensor:
    """The scale of every exponent, as the codec computes it, on ``device``."""
    with untracked():  # a cache shared by the steps, not memory of one
        return exponent_scale(torch.arange(EXPONENTS, dtype=torch.float32, device=device))


@triton.jit
def _writes(keep, MASKED: tl.constexpr):
    """1 where the step stores (its gradient is finite), else 0."""
    return tl.load(keep).to(tl.int32) if MASKED else tl.program_id(0) * 0 + 1


@triton.jit
def _nonzero(scale):
    """``slimopt.codecs.ternary.nonzero_scale``."""
    return tl.where(scale > 0, scale, 1.0)


@triton.jit
def _clamped(value):
    """``value`` saturated at the largest fp32 number, as the codec clamps it before scaling."""
    return tl.minimum(tl.maximum(value, -FLOAT32_MAX_), FLOAT32_MAX_)


@triton.jit
def _update_strips(
    grad,
    target,
    weight_seed,
    hyper,
    keep,
    value,
    trits,
    exponents,
    m_row,
    m_col,
    scales,
    v_row,
    v_col,
    row_means,
    column_sums,
    col_max,
    rows,
    cols,
    ceiling,
    MODE: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Pass 1: one strip of ``ROWS`` rows, tile by tile along them. The first strip also zeroes
    ``col_max`` for pass 2 (nothing else reads it in this pass)."""
    strip = tl.program_id(0)
    if strip == 0:
        for start in range(0, cols, CHUNK):
            chunk = start + tl.arange(0, CHUNK)
            tl.store(col_max + chunk, tl.zeros([CHUNK], dtype=tl.int32), mask=chunk < cols)
    writes = _writes(keep, MASKED)
    row = strip * ROWS + tl.arange(0, ROWS)
    real_row = row < rows
    # The factored codec's decode: row means over their mean, times column means.
    total = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, rows, CHUNK):
        chunk = start + tl.arange(0, CHUNK)
        total += tl.load(v_row + chunk, mask=chunk < rows, other=0.0)
    mean = tl.sum(total, 0) / rows
    v_rows = tl.load(v_row + row, mask=real_row, other=0.0) / tl.where(mean > 0, mean, 1.0)
    m_rows = tl.load(m_row + row, mask=real_row, other=0.0)
    # Digit row % 5 of byte row row // 5, as a divisor: 3 ** (row % 5).
    digit = row % TRITS_PER_BYTE_
    power = tl.where(digit == 1, 3, 1)
    power = tl.where(digit == 2, 9, power)
    power = tl.where(digit == 3, 27, power)
    power = tl.where(digit == 4, 81, power)
    byte_row = row // TRITS_PER_BYTE_
    block_row = row // BLOCK
    row_max = tl.zeros([ROWS], dtype=tl.float32)
    row_sum = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(0, cols, COLUMNS):
        col = start + tl.arange(0, COLUMNS)
        real_col = col < cols
        real = real_row[:, None] & real_col[None, :]
        index = row[:, None] * cols + col[None, :]
        g = tl.load(grad + index, mask=real, other=0.0)
        byte = tl.load(trits + byte_row[:, None] * cols + col[None, :], mask=real, other=0).to(tl.int32)
        sign = ((byte // power[:, None]) % 3).to(tl.float32) - 1
        exponent = tl.load(exponents + block_row[:, None] * cols + col[None, :], mask=real, other=0)
        m = sign * tl.load(scales + exponent.to(tl.int32)) * m_rows[:, None]
        m = m * tl.load(m_col + col, mask=real_col, other=0.0)[None, :]
        v = v_rows[:, None] * tl.load(v_col + col, mask=real_col, other=0.0)[None, :]
        m, v, direction = adamw_update(g, m, v, real, hyper)
        write_target(target, weight_seed, direction, index, real, hyper, writes, MODE)
        tl.store(value + index, m, mask=real)
        row_max = tl.maximum(row_max, tl.max(tl.abs(_clamped(m)), 1))
        row_sum += tl.sum(v, 1)
        tl.store(column_sums + strip * cols + col, tl.sum(v, 0), mask=real_col)
    # Only this strip reads its rows' scales: they are replaced here.
    tl.store(m_row + row, row_max, mask=and_writes(real_row, writes))
    tl.store(row_means + row, tl.minimum(row_sum / cols, ceiling), mask=real_row)


@triton.jit
def _column_scales(
    keep,
    value,
    m_row,
    col_max,
    v_row,
    v_col,
    row_means,
    column_sums,
    rows,
    cols,
    strips,
    rows_per_strip,
    ceiling,
    MASKED: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    CHUNK_ROWS: tl.constexpr,
):
    """Pass 2: ``COLUMNS`` columns of ``CHUNK_ROWS`` rows: their share of the first moment's
    column scales (maxima of the matrix divided by its new row scales), taken into ``col_max``
    by an atomic maximum of the fp32 bit patterns (non-negative numbers order as their bits
    do, and a maximum is the same in any order). The first chunk of each column strip also
    sums the second moment's column means from the strips' sums and stores a share of its row
    means."""
    program = tl.program_id(0)
    writes = _writes(keep, MASKED)
    col = program * COLUMNS + tl.arange(0, COLUMNS)
    real_col = col < cols
    largest = tl.zeros([COLUMNS], dtype=tl.float32)
    for start in range(tl.program_id(1) * CHUNK_ROWS, (tl.program_id(1) + 1) * CHUNK_ROWS, ROWS):
        row = start + tl.arange(0, ROWS)
        real = (row < rows)[:, None] & real_col[None, :]
        m = _clamped(tl.load(value + row[:, None] * cols + col[None, :], mask=real, other=0.0))
        m = m / _nonzero(tl.load(m_row + row, mask=row < rows, other=1.0))[:, None]
        largest = tl.maximum(largest, tl.max(tl.abs(m), 0))
    tl.atomic_max(col_max + col, largest.to(tl.int32, bitcast=True), mask=real_col)
    if tl.program_id(1) == 0:
        col_sum = tl.zeros([COLUMNS], dtype=tl.float32)
        for strip in range(0, strips):
            col_sum += tl.load(column_sums + strip * cols + col, mask=real_col, other=0.0)
        tl.store(v_col + col, tl.minimum(col_sum / rows, ceiling), mask=and_writes(real_col, writes))
        last = (program + 1) * rows_per_strip
        for start in range(program * rows_per_strip, last, ROWS):
            row = start + tl.arange(0, ROWS)
            real_row = (row < rows) & (row < last)
            means = tl.load(row_means + row, mask=real_row, other=0.0)
            tl.store(v_row + row, means, mask=and_writes(real_row, writes))


@triton.jit
def _scaled(value, m_row, m_col, row, col, rows, cols, real):
    """The new first moment at rows ``row`` and columns ``col``, divided by its row and column
    scales in the codec's order (0 outside the matrix)."""
    m = _clamped(tl.load(value + row[:, None] * cols + col[None, :], mask=real, other=0.0))
    m = m / _nonzero(tl.load(m_row + row, mask=row < rows, other=1.0))[:, None]
    return m / _nonzero(tl.load(m_col + col, mask=col < cols, other=1.0))[None, :]


@triton.jit
def _block_exponents(
    keep,
    value,
    m_row,
    m_col,
    col_scale,
    exponents,
    scales,
    rows,
    cols,
    block_rows,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """Pass 3: the exponents of a tile of ``ROWS`` block rows × ``COLUMNS`` columns: each the
    smallest whose scale is at least its block's largest scaled magnitude. The first tile of
    each column strip stores the strip's column scales (``col_scale``, from pass 2)."""
    writes = _writes(keep, MASKED)
    block = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    real_col = col < cols
    if tl.program_id(0) == 0:
        tl.store(m_col + col, tl.load(col_scale + col, mask=real_col), mask=and_writes(real_col, writes))
    block_max = tl.zeros([ROWS, COLUMNS], dtype=tl.float32)
    for offset in range(0, BLOCK):
        row = block * BLOCK + offset
        real = (row < rows)[:, None] & real_col[None, :]
        block_max = tl.maximum(
            block_max, tl.abs(_scaled(value, m_row, col_scale, row, col, rows, cols, real))
        )
    exponent = tl.ceil(tl.log2(block_max) * -STEPS_PER_OCTAVE_)
    exponent = tl.minimum(tl.maximum(exponent, 0.0), 255.0).to(tl.int32)
    exponent = tl.where(tl.load(scales + exponent) < block_max, exponent - 1, exponent)
    real = (block < block_rows)[:, None] & real_col[None, :]
    tl.store(
        exponents + block[:, None] * cols + col[None, :], exponent.to(tl.uint8), mask=and_writes(real, writes)
    )


@triton.jit
def _digits(
    keep,
    value,
    m_row,
    col_scale,
    exponents,
    scales,
    seed,
    trits,
    rows,
    cols,
    byte_rows,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """Pass 4: the bytes of a tile of ``ROWS`` byte rows × ``COLUMNS`` columns: digit k of byte
    row a is row 5a + k, -1, 0 or +1 stored as 0, 1, 2 (rows past the matrix: 0, as the codec
    pads them)."""
    writes = _writes(keep, MASKED)
    byte_row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    real_col = col < cols
    stream = tl.load(seed)
    packed = tl.zeros([ROWS, COLUMNS], dtype=tl.int32)
    for k in tl.static_range(TRITS_PER_BYTE_):
        # Most significant digit first: packed = Σ digit_k · 3^k.
        row = byte_row * TRITS_PER_BYTE_ + (TRITS_PER_BYTE_ - 1 - k)
        real = (row < rows)[:, None] & real_col[None, :]
        exponent = tl.load(exponents + (row // BLOCK)[:, None] * cols + col[None, :], mask=real, other=0)
        scale = tl.load(scales + exponent.to(tl.int32))
        scaled = _scaled(value, m_row, col_scale, row, col, rows, cols, real) / scale
        index = row[:, None] * cols + col[None, :]
        draws = ((random_words(stream, index) >> 8) & 0xFFFFFF).to(tl.float32) * (1.0 / 16777216)
        sign = tl.where(scaled > 0, 1, tl.where(scaled < 0, -1, 0))
        digit = tl.where(draws < tl.abs(scaled), sign, 0) + 1
        packed = packed * 3 + tl.where(real, digit, 0)
    real = (byte_row < byte_rows)[:, None] & real_col[None, :]
    tl.store(
        trits + byte_row[:, None] * cols + col[None, :], packed.to(tl.uint8), mask=and_writes(real, writes)
    )
