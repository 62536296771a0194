"""Shapes an update works in: a tensor's matrix view and the slices of rows a large matrix is
updated and stored by (``slimopt.codecs.rows``), and the size under which moments stay fp32."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# Matrices with more elements than this are updated (and stored) in slices of rows this big.
SLICE_NUMEL = 1 << 22
# Eager encodes and decodes on the CPU go through a moment in pieces of about this many elements
# (512 KiB of fp32), so that their temporaries stay in the core's cache and come from memory the
# allocator holds already instead of fresh pages (docs/results/storage.md).
PIECE_NUMEL = 1 << 17
# Moments (and slices of them) with fewer elements than this are stored fp32 in every format
# (``slimopt.codecs.moment_codec``): compressing them would save little and cost precision.
MIN_COMPRESSED_NUMEL = 4096


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, columns) of the 2-D view a tensor is updated, sliced and scaled in: ``shape[0] ×
    rest``, or one row for a vector or a scalar."""
    if len(shape) < 2:
        return 1, shape.numel()
    return shape[0], math.prod(shape[1:])


def sliced(shape: torch.Size) -> bool:
    """Whether a matrix of ``shape`` is updated and stored by slices of rows."""
    return len(shape) >= 2 and shape.numel() > SLICE_NUMEL


def row_slices(rows: int, cols: int, numel: int | None = None) -> list[slice]:
    """Consecutive row ranges of at most ``numel`` elements each (default ``SLICE_NUMEL``; at
    least one row), except that a last range under ``MIN_COMPRESSED_NUMEL`` elements joins the
    one before it: alone it would be stored fp32 (as any small moment is) and cost the matrix
    its storage format (a 2049×2048 matrix's bf16 moments became fp32, 8 bytes per parameter)."""
    step = max(1, (numel or SLICE_NUMEL) // max(cols, 1))
    if 0 < rows <= step:
        return [slice(0, rows)]
    starts = list(range(0, rows, step))
    if len(starts) > 1 and (rows - starts[-1]) * cols < MIN_COMPRESSED_NUMEL:
        starts.pop()
    return [
        slice(start, rows if index == len(starts) - 1 else starts[index + 1])
        for index, start in enumerate(starts)
    ]


def pieces(count: int, numel_each: int, multiple: int, device: torch.device) -> list[slice]:
    """The consecutive ranges of ``count`` units (blocks, rows) of ``numel_each`` elements each
    that an eager codec works through one after another, each a multiple of ``multiple`` units
    (but the last). On the CPU about ``PIECE_NUMEL`` elements each; elsewhere, and within
    ``as_on_a_gpu``, one range (on a GPU a launch per piece would cost more than the cache
    saves)."""
    if device.type != "cpu" or _AS_ON_A_GPU.get():
        return [slice(0, count)]
    step = max(multiple, PIECE_NUMEL // max(numel_each, 1) // multiple * multiple)
    if 0 < count <= step:
        return [slice(0, count)]
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


_AS_ON_A_GPU: ContextVar[bool] = ContextVar("as_on_a_gpu", default=False)


@contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """Within, codecs go through a moment in one piece on the CPU too, as on a GPU: the memory
    planner plans a GPU's step, and measures it so on the CPU to check the plan."""
    token = _AS_ON_A_GPU.set(True)
    try:
        yield
    finally:
        _AS_ON_A_GPU.reset(token)


def slices_to_update(rows: int, cols: int, *, meta: bool) -> list[tuple[int, slice]]:
    """(index, rows) of the slices an update goes through, one after the other.

    On the meta device (the memory planner's dry run) slices have no values, and a slice the
    size of the two before it allocates and frees what the second of them did (a slice's
    temporaries live on into the next one, not further), so it is left out: for a 7B model that
    is six thousand slices, which made ``slimopt memory`` take half a minute."""
    every = list(enumerate(row_slices(rows, cols)))
    if not meta or len(every) < 3:
        return every
    sizes = [part.stop - part.start for _, part in every]
    return [
        entry
        for position, entry in enumerate(every)
        if not (position >= 2 and sizes[position] == sizes[position - 1] == sizes[position - 2])
    ]


def fp32_row_slices(source: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, fp32 values) of each slice of rows of the matrix ``source`` an update goes
    through (``slices_to_update``): a copy for another dtype, the slice itself for fp32."""
    for _, rows in slices_to_update(*source.shape, meta=source.is_meta):
        yield rows.start, source[rows].float()
