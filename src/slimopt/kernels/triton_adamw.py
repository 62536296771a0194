"""The fused AdamW step as one hand-written Triton kernel, for moments stored elementwise (fp32,
bf16, 8-bit and 4-bit blocks): each program reads one block of the gradient, decodes both
moments, updates them, encodes them and writes the parameter (or the direction of a projected
matrix), so a step is one launch and one pass over memory.

It computes what ``slimopt.codecs.storage`` and the reference codecs compute, operation for
operation: the same lookup for the nearest code, the same counter-based draws
(``slimopt.codecs.draws``) for stochastic rounding, indexed by element. A program covers one
quantization block, walked as two interleaved halves (even and odd elements), so the two 4-bit
codes of a byte are written by the program that computes them. Moments stored by rows and
columns (ternary, factored) need reductions across the whole matrix: ``triton_ternary`` takes
them in passes. With ``TRITON_INTERPRET=1`` set before this module is imported the
kernel runs on CPU tensors, which is how it is tested without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from slimopt.checks import FLOAT32_MAX
from slimopt.codecs.base import Storage
from slimopt.codecs.blockwise import KEY_BITS, KEY_MASK, LOOKUP_MASK, LOOKUP_SHIFT, THRESHOLD_MASK
from slimopt.kernels.triton_parts import (
    adamw_update,
    and_writes,
    parameter_target,
    round_to_bf16,
    write_target,
)

# Elements per program when no moment is stored in blocks.
PLAIN_BLOCK = 1024
# Storage kinds as the kernel's constants.
FP32, BF16, BLOCKS8, BLOCKS4 = range(4)

# The same numbers as the kernels' constants (Triton reads only tl.constexpr globals).
FP32_, BF16_, BLOCKS8_, BLOCKS4_ = (tl.constexpr(kind) for kind in (FP32, BF16, BLOCKS8, BLOCKS4))
LOOKUP_SHIFT_ = tl.constexpr(LOOKUP_SHIFT)
LOOKUP_MASK_ = tl.constexpr(LOOKUP_MASK)
KEY_MASK_ = tl.constexpr(KEY_MASK)
KEY_BITS_ = tl.constexpr(KEY_BITS)
THRESHOLD_MASK_ = tl.constexpr(THRESHOLD_MASK)
FLOAT32_MAX_ = tl.constexpr(FLOAT32_MAX)


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
    """``slimopt.kernels.adamw_step`` for the elementwise storages that
    ``slimopt.kernels.triton_step_of`` gives it: the arguments of its compiled step
    (``slimopt.kernels.adamw.adamw_step``: flat or matrix tensors, contiguous), the direction
    returned when ``weights`` is None."""
    numel = grad.numel()
    direction = grad.new_empty(grad.shape) if weights is None else None
    if numel == 0:
        return direction
    sizes = [storage.block_size for storage in storages if storage.kind == "blockwise"]
    block = sizes[0] if sizes else PLAIN_BLOCK
    streams = iter(seeds)
    args = []
    for parts, storage, table in zip(moments, storages, tables, strict=True):
        seed = next(streams) if storage.stochastic else hyper
        if storage.kind == "blockwise":
            args += [parts["codes"], parts["absmax"], *table, seed]
        else:
            args += [parts[""], hyper, hyper, hyper, seed]
    target, mode, weight_seed = parameter_target(weights, direction, streams, hyper)
    kinds = [_kind(storage) for storage in storages]
    _adamw_kernel[(triton.cdiv(numel, block),)](
        grad,
        target,
        weight_seed,
        hyper,
        hyper if keep is None else keep,
        numel,
        *args,
        M_KIND=kinds[0],
        V_KIND=kinds[1],
        MODE=mode,
        MASKED=keep is not None,
        HALF=block // 2,
    )
    return direction


def _kind(storage: Storage) -> int:
    if storage.kind == "blockwise":
        return BLOCKS4 if storage.bits == 4 else BLOCKS8
    return BF16 if storage.kind == "bf16" else FP32


@triton.jit
def _decode(values, absmax, table, index, pair, mask, program, KIND: tl.constexpr, ODD: tl.constexpr):
    """One half of a program's block of a moment, in fp32 (padding and masked elements: 0 for
    plain storage, whatever their code decodes to for blocks)."""
    if KIND == FP32_:
        value = tl.load(values + index, mask=mask, other=0.0)
    elif KIND == BF16_:
        value = tl.load(values + index, mask=mask, other=0.0).to(tl.float32)
    else:
        if KIND == BLOCKS8_:
            code = tl.load(values + index).to(tl.int32)
        elif ODD:
            code = tl.load(values + pair).to(tl.int32) >> 4
        else:
            code = tl.load(values + pair).to(tl.int32) & 15
        value = tl.load(table + code) * tl.load(absmax + program)
    return value


@triton.jit
def _nearest_codes(normalized, nearest):
    """``slimopt.codecs.blockwise.nearest_codes``: the bucket's entry, then its key compared."""
    bits = normalized.to(tl.int32, bitcast=True)
    entry = tl.load(nearest + ((bits >> LOOKUP_SHIFT_) & LOOKUP_MASK_))
    key = (bits ^ (bits >> 31)) & KEY_MASK_
    return (entry >> KEY_BITS_) + (key > (entry & THRESHOLD_MASK_)).to(tl.int32)


@triton.jit
def _encode(
    even,
    odd,
    values,
    absmax,
    nearest,
    seed,
    index_even,
    index_odd,
    pair,
    mask_even,
    mask_odd,
    program,
    writes,
    KIND: tl.constexpr,
):
    """Store both halves of a program's block of a moment (padding elements arrive as 0), if
    ``writes``."""
    mask_even = and_writes(mask_even, writes)
    mask_odd = and_writes(mask_odd, writes)
    whole = and_writes(pair >= 0, writes)
    if KIND == FP32_:
        tl.store(values + index_even, even, mask=mask_even)
        tl.store(values + index_odd, odd, mask=mask_odd)
    elif KIND == BF16_:
        seed_value = tl.load(seed)
        tl.store(values + index_even, round_to_bf16(even, seed_value, index_even), mask=mask_even)
        tl.store(values + index_odd, round_to_bf16(odd, seed_value, index_odd), mask=mask_odd)
    else:
        scale = tl.minimum(tl.maximum(tl.max(tl.abs(even), 0), tl.max(tl.abs(odd), 0)), FLOAT32_MAX_)
        divisor = tl.where(scale > 0, scale, 1.0)
        code_even = _nearest_codes(even / divisor, nearest)
        code_odd = _nearest_codes(odd / divisor, nearest)
        if KIND == BLOCKS8_:
            tl.store(values + index_even, code_even.to(tl.uint8), mask=whole)
            tl.store(values + index_odd, code_odd.to(tl.uint8), mask=whole)
        else:
            tl.store(values + pair, (code_even | (code_odd << 4)).to(tl.uint8), mask=whole)
        tl.store(absmax + program, scale, mask=writes != 0)


@triton.jit
def _adamw_kernel(
    grad,
    target,
    weight_seed,
    hyper,
    keep,
    numel,
    m_values,
    m_absmax,
    m_map,
    m_nearest,
    m_seed,
    v_values,
    v_absmax,
    v_map,
    v_nearest,
    v_seed,
    M_KIND: tl.constexpr,
    V_KIND: tl.constexpr,
    MODE: tl.constexpr,
    MASKED: tl.constexpr,
    HALF: tl.constexpr,
):
    program = tl.program_id(0)
    pair = program * HALF + tl.arange(0, HALF)
    index_even = 2 * pair
    index_odd = index_even + 1
    mask_even = index_even < numel
    mask_odd = index_odd < numel
    # A skipped step (a non-finite gradient, decided on the device) stores nothing but a zero
    # direction: every store below is masked by it.
    writes = tl.load(keep).to(tl.int32) if MASKED else program * 0 + 1
    m_even, v_even, d_even = adamw_update(
        tl.load(grad + index_even, mask=mask_even, other=0.0),
        _decode(m_values, m_absmax, m_map, index_even, pair, mask_even, program, M_KIND, False),
        _decode(v_values, v_absmax, v_map, index_even, pair, mask_even, program, V_KIND, False),
        mask_even, hyper,
    )  # fmt: skip
    m_odd, v_odd, d_odd = adamw_update(
        tl.load(grad + index_odd, mask=mask_odd, other=0.0),
        _decode(m_values, m_absmax, m_map, index_odd, pair, mask_odd, program, M_KIND, True),
        _decode(v_values, v_absmax, v_map, index_odd, pair, mask_odd, program, V_KIND, True),
        mask_odd, hyper,
    )  # fmt: skip
    _encode(
        m_even, m_odd, m_values, m_absmax, m_nearest, m_seed,
        index_even, index_odd, pair, mask_even, mask_odd, program, writes, M_KIND,
    )  # fmt: skip
    _encode(
        v_even, v_odd, v_values, v_absmax, v_nearest, v_seed,
        index_even, index_odd, pair, mask_even, mask_odd, program, writes, V_KIND,
    )  # fmt: skip
    write_target(target, weight_seed, d_even, index_even, mask_even, hyper, writes, MODE)
    write_target(target, weight_seed, d_odd, index_odd, mask_odd, hyper, writes, MODE)
