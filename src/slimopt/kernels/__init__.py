"""Fused optimizer steps: read the gradient, decode both moments, update them, encode them and
write the parameter (or, for a projected matrix, the direction) in one compiled function.

The reference path (``slimopt.optimizer`` with ``slimopt.codecs``) runs a chain of PyTorch
operations, each a pass over memory; here the same arithmetic is written once as a function of
the stored tensors and compiled with ``torch.compile``, which fuses it into a few loops: C++ with
OpenMP on the CPU, Triton kernels on CUDA. The reference path stays the definition: a fused step
gives the same codes for the same fp32 values and parameters within fp32 round-off (the fused
loops may contract a multiply and an add into one rounding).

Covered: the AdamW rule with fp32, int8 and int4 states (deterministic formats), fp32 or bf16
parameters rounded to nearest. Not covered (``unsupported`` says why): bf16 and ternary states
and stochastic rounding of parameters, which draw random numbers the fused loops would draw
differently, Adafactor, complex parameters.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from slimopt.codecs.blockwise import LOOKUP_MASK, LOOKUP_SHIFT, BlockwiseCodec
from slimopt.codecs.plain import FLOAT32_MAX, Fp32Codec
from slimopt.memory import untracked

# What ``fused=`` accepts: None chooses the fused path where it exists and runs on CUDA.
FUSED_CHOICES = (None, True, False)
# Tensor lengths are marked dynamic (one compiled step serves every size); everything else,
# block sizes and code widths included, stays a constant of the compiled loops: a block
# reduction of symbolic length is several times slower. One compiled step per storage pair
# and weight dtype, a handful per model: more than dynamo's default of 8 variants per function,
# past which it would run the step eagerly.
COMPILE_SETTINGS = {
    "recompile_limit": 64,
    "automatic_dynamic_shapes": False,
    "assume_static_by_default": True,
}


@dataclass(frozen=True)
class Storage:
    """How one moment is stored, as the compiled step needs to know it (its tables are passed
    as tensors): ``block_size`` 0 for fp32, else the block, code width and zero handling."""

    block_size: int = 0
    bits: int = 8
    positive_floor: bool = False
    zero_code: int = 0


# Why auto mode gave up the fused step in this process (a compile failure); empty while it has not.
_auto_failure: list[str] = []


def __getattr__(name: str) -> Any:
    # ``CompileFailure``: what torch.compile raises when a backend (Inductor's C++ or Triton
    # code) fails to build. Looked up on use: importing torch._dynamo costs over a second.
    if name == "CompileFailure":
        import torch._dynamo.exc

        return torch._dynamo.exc.BackendCompilerFailed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def auto_available(device_type: str) -> bool:
    """Whether ``fused=None`` takes the fused step on ``device_type``: on CUDA, with Triton, as
    long as no fused step has failed to compile in this process."""
    return device_type == "cuda" and not _auto_failure and compiler_error(device_type) is None


def auto_failure() -> str | None:
    """Why auto mode gave up the fused step in this process, or None."""
    return _auto_failure[0] if _auto_failure else None


def give_up_auto(reason: str) -> None:
    """Stop taking the fused step in auto mode for the rest of the process (after ``reason``)."""
    _auto_failure.append(reason)


def storage_of(codec: Any) -> Storage | None:
    """The ``Storage`` of a codec the fused step handles, else None."""
    if isinstance(codec, Fp32Codec):
        return Storage()
    if isinstance(codec, BlockwiseCodec):
        return Storage(codec.block_size, codec.bits, codec.positive_floor, codec.zero_code)
    return None


def unsupported(rule: Any, group: dict[str, Any], param: Tensor) -> str | None:
    """Why the fused step cannot update ``param`` of ``group`` exactly, or None."""
    from slimopt.rules import AdamWRule

    if not isinstance(rule, AdamWRule):
        return f"the {type(rule).__name__.removesuffix('Rule')} rule has no fused step (AdamW only)"
    if group["states"] not in ("fp32", "int8", "int4"):
        return f"states={group['states']!r} draws random numbers; fused steps cover fp32, int8 and int4"
    if group["param_rounding"] == "stochastic" and param.dtype == torch.bfloat16:
        return "param_rounding='stochastic' draws random numbers; fused steps round to nearest"
    if param.is_complex():
        return "complex parameters have no fused step"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"{param.dtype} parameters have no fused step (fp32 and bf16 only)"
    return None


def compiler_error(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build the fused step for ``device_type`` here, or None: it
    needs a C++ compiler for the CPU and Triton for CUDA."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile needs Triton for CUDA, and it is not installed"
    if device_type == "cpu" and not any(
        shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c
    ):
        return "torch.compile needs a C++ compiler for the CPU (g++ or clang++), and none is on PATH"
    return None


# Both moments' stored parts by name, their storages, and their lookup tables (empty for fp32).
Moments = tuple[dict[str, Tensor], dict[str, Tensor]]
Storages = tuple[Storage, Storage]
Tables = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]


def adamw_step(
    grad: Tensor, moments: Moments, storages: Storages, tables: Tables, hyper: Tensor, weights: Tensor | None
) -> Tensor | None:
    """One AdamW step of a flat fp32 ``grad``: both moments (stored parts by name, updated in
    place) and, with ``weights`` (flat, fp32 or bf16, updated in place), the parameter; without,
    the direction is returned (a projected matrix projects it back itself).

    ``hyper`` is ``hyperparameters(...)``: values that change every step are data, not
    constants, so the compiled step is built once. ``tables`` are each blockwise moment's map,
    midpoints and first codes (empty for fp32)."""
    flat = tuple({part: tensor.view(-1) for part, tensor in parts.items()} for parts in moments)
    if is_in_torch_dispatch_mode(include_infra_modes=False):
        # Under a mode that watches every operation (slimopt.memory.LiveBytes, counting a step's
        # memory) dynamo cannot compile, and it would never try this function again: run it
        # as it is, compiled the next time no mode watches.
        return _adamw_step(grad, flat, storages, tables, hyper, weights)
    for tensor in (grad, weights, *(t for parts in flat for t in parts.values())):
        if tensor is not None and tensor.numel() > 1:
            torch._dynamo.mark_dynamic(tensor, 0)
    with torch._dynamo.config.patch(**COMPILE_SETTINGS):
        return _compiled()(grad, flat, storages, tables, hyper, weights)


def hyperparameters(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    age: int,
    scale: float,
    device: Any,
) -> Tensor:
    """The step's scalars as one fp32 tensor on ``device``, each computed in double precision
    and rounded once, as the reference path's Python floats are when an operation takes them.
    The tensor is shared by every parameter with the same scalars (read only): one host-to-device
    copy per group and step, not one per parameter."""
    beta1, beta2 = (float(beta) for beta in betas)
    return _hyperparameters(
        float(lr), beta1, beta2, float(eps), float(weight_decay), age, scale, torch.device(device)
    )


@functools.lru_cache(maxsize=256)
def _hyperparameters(
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    age: int,
    scale: float,
    device: torch.device,
) -> Tensor:
    values = [
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        1 - beta1**age,
        (1 - beta2**age) ** 0.5,
        1 - lr * weight_decay,
        -lr * scale,
    ]
    with untracked():  # a cache shared by the steps, not memory of one
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


@functools.cache
def _compiled() -> Any:
    return torch.compile(_adamw_step)


def _adamw_step(
    grad: Tensor, moments: Moments, storages: Storages, tables: Tables, hyper: Tensor, weights: Tensor | None
) -> Tensor | None:
    new1, beta2, new2, eps, correction1, correction2_sqrt, decay, alpha = hyper.unbind()
    numel = grad.numel()
    (m_parts, v_parts), (m_store, v_store) = moments, storages
    block = m_store.block_size  # both moments of a tensor are stored alike (fp32, or blocks of one size)
    if block:
        # The whole step in blocks × block_size: the per-block scales broadcast along rows.
        count = m_parts["absmax"].numel()
        padding = count * block - numel
        grad = (torch.nn.functional.pad(grad, (0, padding)) if padding else grad).view(count, block)
    exp_avg = _decode(m_parts, m_store, tables[0])
    exp_avg_sq = _decode(v_parts, v_store, tables[1])
    # The reference rule's operations, in its order (slimopt.rules.adamw).
    exp_avg = torch.lerp(exp_avg, grad, new1)  # new1, new2: the weights of the new gradient
    exp_avg_sq = exp_avg_sq * beta2 + new2 * grad * grad
    direction = exp_avg / (exp_avg_sq.sqrt() / correction2_sqrt + eps) / correction1
    if block and padding:
        # The reference encodes the moment padded with zeros; a decoded padding need not be zero
        # (the 4-bit second-moment map has no zero), so it is cleared before the block scales.
        real = (torch.arange(count * block, device=grad.device) < numel).view(count, block)
        exp_avg, exp_avg_sq = exp_avg * real, exp_avg_sq * real
    _encode(exp_avg, m_parts, m_store, tables[0])
    _encode(exp_avg_sq, v_parts, v_store, tables[1])
    direction = direction.reshape(-1)
    if block and padding:
        direction = direction[:numel]
    if weights is None:
        return direction
    target = weights.float() * decay + alpha * direction
    weights.copy_(target.to(weights.dtype))
    return None


def _decode(parts: dict[str, Tensor], storage: Storage, table: tuple[Tensor, ...]) -> Tensor:
    """A moment as fp32: flat for fp32 storage, else blocks × block_size."""
    if not storage.block_size:
        return parts[""]
    codes = parts["codes"]
    if storage.bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=1).reshape(-1)
    return table[0][codes.int()].view(-1, storage.block_size) * parts["absmax"].unsqueeze(1)


def _encode(value: Tensor, parts: dict[str, Tensor], storage: Storage, table: tuple[Tensor, ...]) -> None:
    """Write ``value`` (as ``_decode`` shapes it) into the stored parts."""
    if not storage.block_size:
        parts[""].copy_(value)
        return
    _, midpoints, first_codes = table
    absmax = value.abs().amax(dim=1).clamp(max=FLOAT32_MAX)
    normalized = (value / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).reshape(-1)
    bucket = normalized.view(torch.int32).bitwise_right_shift(LOOKUP_SHIFT).bitwise_and(LOOKUP_MASK)
    codes = first_codes[bucket].int()
    codes = codes + (normalized > midpoints[codes]).int()
    if storage.positive_floor:
        codes = torch.where((normalized > 0) & (codes == storage.zero_code), storage.zero_code + 1, codes)
    if storage.bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    parts["codes"].copy_(codes.to(torch.uint8))
    parts["absmax"].copy_(absmax)
