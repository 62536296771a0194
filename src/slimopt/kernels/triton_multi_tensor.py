"""The grouped AdamW step of small tensors (norms, biases: fp32 moments in every storage format)
as one launch of a hand-written Triton kernel, where one launch per tensor would cost more than
the tensor's update.

Each program updates one chunk of one tensor: the tensors' addresses (gradient, weights, both
moments, the skip flag) and sizes travel as a table on the device, which the kernel reads and
turns into pointers, as Triton's grouped-GEMM tutorial does. The arithmetic is the per-tensor
kernel's (``slimopt.kernels.triton_adamw``): the same update and the same rounding of bf16
weights, so either kernel writes what the reference path writes. Gradients are read in their
own dtype (fp32 or bf16): no conversion launch per tensor.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimopt.kernels.triton_parts import (
    WEIGHTS_BF16,
    WEIGHTS_FP32,
    WEIGHTS_FP32_,
    adamw_update,
    and_writes,
    write_target,
)
from slimopt.memory import untracked

# Elements per program: a small tensor (under 4096 elements) takes at most four.
CHUNK = 1024
# Columns of the table, one row per tensor.
GRAD, WEIGHTS, EXP_AVG, EXP_AVG_SQ, KEEP, NUMEL, COLUMNS = range(7)
GRAD_, WEIGHTS_, EXP_AVG_, EXP_AVG_SQ_, KEEP_, NUMEL_, COLUMNS_ = (
    tl.constexpr(column) for column in (GRAD, WEIGHTS, EXP_AVG, EXP_AVG_SQ, KEEP, NUMEL, COLUMNS)
)


def adamw_steps(
    grads: list[Tensor],
    moments: list[tuple[dict[str, Tensor], dict[str, Tensor]]],
    hypers: Tensor,
    weights: list[Tensor],
    keeps: list[Tensor | None],
) -> None:
    """``slimopt.kernels.adamw_steps``: one launch for every gradient dtype and weight dtype
    among the tensors (one launch in a model of one dtype)."""
    kinds: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for index, (grad, target) in enumerate(zip(grads, weights, strict=True)):
        kinds.setdefault((grad.dtype, target.dtype), []).append(index)
    device = hypers.device
    for (grad_dtype, weight_dtype), indices in kinds.items():
        rows = [
            [
                grads[i].data_ptr(),
                weights[i].data_ptr(),
                moments[i][0][""].data_ptr(),
                moments[i][1][""].data_ptr(),
                (_always(device) if keeps[i] is None else keeps[i]).data_ptr(),
                grads[i].numel(),
            ]
            for i in indices
        ]
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        longest = max(grads[i].numel() for i in indices)
        _adamw_steps_kernel[(len(indices), triton.cdiv(longest, CHUNK))](
            table,
            hypers[indices] if len(indices) < len(grads) else hypers,
            GRAD_BF16=grad_dtype == torch.bfloat16,
            MODE=WEIGHTS_BF16 if weight_dtype == torch.bfloat16 else WEIGHTS_FP32,
            CHUNK=CHUNK,
        )


@functools.cache
def _always(device: torch.device) -> Tensor:
    """A one-element True on ``device``: the skip flag of a tensor decided on the host."""
    with untracked():  # a cache for the whole process, not memory of a step
        return torch.ones((), dtype=torch.bool, device=device)


@triton.jit
def _adamw_steps_kernel(table, hypers, GRAD_BF16: tl.constexpr, MODE: tl.constexpr, CHUNK: tl.constexpr):
    tensor = tl.program_id(0)
    row = table + tensor * COLUMNS_
    index = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = index < tl.load(row + NUMEL_)
    if GRAD_BF16:
        grad = tl.load(row + GRAD_).to(tl.pointer_type(tl.bfloat16))
    else:
        grad = tl.load(row + GRAD_).to(tl.pointer_type(tl.float32))
    if MODE == WEIGHTS_FP32_:
        target = tl.load(row + WEIGHTS_).to(tl.pointer_type(tl.float32))
    else:
        target = tl.load(row + WEIGHTS_).to(tl.pointer_type(tl.bfloat16))
    exp_avg = tl.load(row + EXP_AVG_).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + EXP_AVG_SQ_).to(tl.pointer_type(tl.float32))
    # A skipped step (a non-finite gradient, decided on the device) stores nothing.
    writes = (tl.load(tl.load(row + KEEP_).to(tl.pointer_type(tl.int8))) != 0).to(tl.int32)
    hyper = hypers + tensor * 8
    m, v, direction = adamw_update(
        tl.load(grad + index, mask=mask, other=0.0).to(tl.float32),
        tl.load(exp_avg + index, mask=mask, other=0.0),
        tl.load(exp_avg_sq + index, mask=mask, other=0.0),
        mask,
        hyper,
    )
    stored = and_writes(mask, writes)
    tl.store(exp_avg + index, m, mask=stored)
    tl.store(exp_avg_sq + index, v, mask=stored)
    write_target(target, hyper, direction, index, mask, hyper, writes, MODE)
