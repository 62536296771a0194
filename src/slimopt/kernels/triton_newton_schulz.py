"""Muon's Newton–Schulz iteration on a stack of matrices as hand-written Triton kernels: each of
an iteration's three products is one launch for the whole stack, its scaling and sum in the
product's epilogue (accumulated in fp32, rounded once to bf16, as cuBLAS's bf16 ``addmm`` does).

Two of the three products are symmetric: the Gram matrix X·Xᵀ and b·A + c·A·A of a symmetric
A. Their kernels compute the tiles on and above the diagonal only and write each one twice (as
itself and, transposed, below the diagonal): half of those products' multiplications, a third
of the iteration's.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimopt.kernels.triton_parts import round_to_nearest_bf16

# Tile sizes (square tiles, so that a symmetric product's tile mirrors onto one tile). bf16
# tiles of 64 × 64 with steps of 32 along the inner dimension fit an H100's shared memory with
# room for pipelining.
BLOCK = 64
BLOCK_K = 32


def iterated(ortho: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """``slimopt.rules.muon.iterated`` of a stack (batch × rows × columns, bf16, wide and
    normalized: ``rules.muon.normalized_wide``), each iteration three launches for the stack."""
    a, b, c = coefficients
    batch, rows, _ = ortho.shape
    gram = ortho.new_empty(batch, rows, rows)
    update = torch.empty_like(gram)
    for _ in range(steps):
        product(ortho, ortho.mT, gram, alpha=1.0, symmetric=True)
        product(gram, gram, update, alpha=c, beta=b, added=gram, symmetric=True)
        new = torch.empty_like(ortho)
        product(update, ortho, new, alpha=1.0, beta=a, added=ortho)
        ortho = new
    return ortho


def product(
    left: Tensor,
    right: Tensor,
    out: Tensor,
    *,
    alpha: float,
    beta: float = 0.0,
    added: Tensor | None = None,
    symmetric: bool = False,
) -> None:
    """``out`` ← alpha·``left``·``right`` + beta·``added`` for each matrix of the stacks (bf16,
    any strides), in one launch. ``symmetric``: the result is known to be symmetric (square),
    and only the tiles on and above its diagonal are computed."""
    batch, rows, inner = left.shape
    columns = right.shape[-1]
    tiles_m, tiles_n = triton.cdiv(rows, BLOCK), triton.cdiv(columns, BLOCK)
    summand = out if added is None else added  # unread without ``added``
    _product_kernel[(tiles_m, tiles_n, batch)](
        left,
        right,
        summand,
        out,
        rows,
        columns,
        inner,
        *left.stride(),
        *right.stride(),
        *summand.stride(),
        *out.stride(),
        alpha,
        beta,
        ADDED=added is not None,
        SYMMETRIC=symmetric,
        # Triton's interpreter multiplies bf16 tiles as raw bits: there the kernel multiplies
        # them in fp32, which holds each product of two bf16 values exactly, as the GPU's bf16
        # products do.
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK=BLOCK,
        BLOCK_K=BLOCK_K,
    )


@triton.jit
def _product_kernel(
    left,
    right,
    summand,
    out,
    rows,
    columns,
    inner,
    left_batch,
    left_row,
    left_col,
    right_batch,
    right_row,
    right_col,
    summand_batch,
    summand_row,
    summand_col,
    out_batch,
    out_row,
    out_col,
    alpha,
    beta,
    ADDED: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    matrix = tl.program_id(2).to(tl.int64)
    # A symmetric result's tiles below the diagonal are written by their mirror images.
    if not SYMMETRIC or tile_m <= tile_n:
        m = tile_m * BLOCK + tl.arange(0, BLOCK)
        n = tile_n * BLOCK + tl.arange(0, BLOCK)
        k = tl.arange(0, BLOCK_K)
        left_tile = left + matrix * left_batch + m[:, None] * left_row + k[None, :] * left_col
        right_tile = right + matrix * right_batch + k[:, None] * right_row + n[None, :] * right_col
        total = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for start in range(0, inner, BLOCK_K):
            inside = (start + k) < inner
            x = tl.load(left_tile, mask=(m[:, None] < rows) & inside[None, :], other=0.0)
            y = tl.load(right_tile, mask=inside[:, None] & (n[None, :] < columns), other=0.0)
            if UPCAST:
                total = tl.dot(x.to(tl.float32), y.to(tl.float32), total, input_precision="ieee")
            else:
                total = tl.dot(x, y, total)
            left_tile += BLOCK_K * left_col
            right_tile += BLOCK_K * right_row
        total = total * alpha
        within = (m[:, None] < rows) & (n[None, :] < columns)
        if ADDED:
            place = summand + matrix * summand_batch + m[:, None] * summand_row + n[None, :] * summand_col
            total += beta * tl.load(place, mask=within, other=0.0).to(tl.float32)
        result = round_to_nearest_bf16(total)
        base = out + matrix * out_batch
        tl.store(base + m[:, None] * out_row + n[None, :] * out_col, result, mask=within)
        if SYMMETRIC and tile_m < tile_n:
            mirrored = base + n[:, None] * out_row + m[None, :] * out_col
            tl.store(mirrored, tl.trans(result), mask=(n[:, None] < rows) & (m[None, :] < columns))
