"""Fused optimizer steps: read the gradient, decode both moments, update them, encode them and
write the parameter (or, for a projected matrix, the direction) in one compiled function.

The reference path (``slimopt.core.reference`` with ``slimopt.codecs``) runs a chain of PyTorch
operations, each a pass over memory; here the same arithmetic is written once as a function of
the stored tensors and compiled with ``torch.compile``, which fuses it into a few loops: C++ with
OpenMP on the CPU, Triton kernels on CUDA. The reference path stays the definition: a fused step
gives the same codes for the same fp32 values and parameters within fp32 round-off (the fused
loops may contract a multiply and an add into one rounding).

Covered: the AdamW and Adafactor rules (``adafactor``) with every storage format (``formats``),
fp32 or bf16 parameters rounded to nearest or stochastically. On CUDA, AdamW moments stored
elementwise (fp32, bf16, 8- and 4-bit blocks) take the hand-written Triton kernel of
``triton_adamw`` instead: one launch per tensor, no compilation per shape; matrices with ternary
states (ternary first moment with row and column scales, factored second moment) take the four
launches of ``triton_ternary``. Stochastic roundings
draw from counter-based streams (``slimopt.codecs.draws``) seeded as the reference path seeds
them, so they draw the same numbers. Small AdamW tensors (norms, biases) are updated together
(``adamw_steps``): in one launch of ``triton_multi_tensor`` on CUDA, in one compiled call
elsewhere. Not covered (``slimopt.options.fused_unsupported`` says why): TACO's rule, complex
parameters, tensors with more than two dimensions under ternary states or Adafactor (their
factored statistics are over the last two). The steps take tensors, storage descriptors
(``formats.Storage``) and scalars; which step a rule takes, and its scalars, are decided in
``slimopt.core.fused``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from slimopt.kernels import formats
from slimopt.kernels.formats import Moment, Storage, scalars, storage_of

__all__ = [
    "FUSED_CHOICES",
    "Moment",
    "Storage",
    "adafactor_step",
    "adamw_step",
    "adamw_steps",
    "compile_settings",
    "hyperparameters",
    "scalars",
    "storage_of",
]

# What ``fused=`` accepts: None chooses the fused path where it exists and runs on CUDA.
FUSED_CHOICES = (None, True, False)
# Sizes of elementwise moments are marked dynamic (one compiled step serves every size);
# everything else, block sizes and code widths included, stays a constant of the compiled loops:
# a block reduction of symbolic length is several times slower. One compiled step per storage
# pair and weight dtype, and for moments scaled by rows and columns one per matrix shape, a
# handful to a few dozen per model (a few hundred in one test session): more than dynamo's
# default of 8 variants per function, past which it would run the step eagerly.
COMPILE_SETTINGS = {
    "recompile_limit": 256,
    "automatic_dynamic_shapes": False,
    "assume_static_by_default": True,
}
# Inductor's options for the compiled steps. Every table index in them is in range by
# construction (an 8-bit code into a map of 256 values, a 4-bit one into 16, a 17-bit bucket
# into a table of 2**17 entries), so the bounds check Inductor puts before each lookup only
# costs time (measured: benchmarks/RESULTS.md, "State storage").
INDUCTOR_OPTIONS = {"assert_indirect_indexing": False}


# Devices whose fused step for elementwise storage is the hand-written Triton kernel
# (``triton_adamw``); the tests add "cpu" to run it in Triton's interpreter.
TRITON_DEVICE_TYPES = ("cuda",)


# Why auto mode gave up the fused step in this process (a compile failure); empty while it has not.
_auto_failure: list[str] = []


def __getattr__(name: str) -> Any:
    # ``CompileFailure``: what torch.compile raises when a backend (Inductor's C++ or Triton
    # code) fails to build. Looked up on use: importing torch._dynamo costs over a second.
    if name == "CompileFailure":
        import torch._dynamo.exc

        return torch._dynamo.exc.BackendCompilerFailed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compile_failures() -> tuple[type[Exception], ...]:
    """What a fused step raises when its code fails to build: ``CompileFailure``, and Triton's
    compilation error for the hand-written kernel where Triton is installed."""
    failures: tuple[type[Exception], ...] = (__getattr__("CompileFailure"),)
    if _triton_installed():
        from triton.compiler.errors import CompilationError

        failures += (CompilationError,)
    return failures


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


def resume_auto() -> None:
    """Take the fused step in auto mode again after ``give_up_auto`` (a process that fixed its
    compiler; tests that give it up on purpose)."""
    _auto_failure.clear()


def compiler_error(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot build the fused step for ``device_type`` here, or None: it
    needs a C++ compiler for the CPU and Triton for CUDA."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python"
    if device_type == "cuda" and not _triton_installed():
        return "torch.compile needs Triton for CUDA, and it is not installed"
    if device_type == "cpu" and not any(
        shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c
    ):
        return "torch.compile needs a C++ compiler for the CPU (g++ or clang++), and none is on PATH"
    return None


# Both moments' stored parts by name, their storages, and their lookup tables (empty but for blocks).
Moments = tuple[dict[str, Tensor], dict[str, Tensor]]
Storages = tuple[Storage, Storage]
Tables = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]


def adamw_step(
    grad: Tensor,
    moments: Moments,
    storages: Storages,
    tables: Tables,
    hyper: Tensor,
    weights: Tensor | None,
    seeds: tuple[Tensor, ...] = (),
    keep: Tensor | None = None,
) -> Tensor | None:
    """One AdamW step of the fp32 matrix ``grad`` (rows × columns, contiguous): both moments
    (stored parts by name, updated in place) and, with ``weights`` (the parameter's matrix,
    fp32 or bf16, updated in place), the parameter; without, the direction is returned (a
    projected matrix projects it back itself).

    ``hyper`` is ``hyperparameters(...)``: values that change every step are data, not
    constants, so the compiled step is built once. ``tables`` are each blockwise moment's map
    and nearest-code table. ``seeds`` are the streams (``slimopt.codecs.draws``) of the
    stochastic roundings, in the reference path's order: each stochastic moment's, then the
    weights' when there is one more (bf16 weights rounded stochastically).

    ``keep``: a one-element bool tensor on the device, whether the gradient is finite. Where it
    is False nothing stored changes and the direction is zero: a non-finite gradient is skipped
    without the host reading the decision (no synchronisation)."""
    matrix = grad.shape
    triton_step = triton_step_of(storages) if grad.device.type in TRITON_DEVICE_TYPES else None
    if triton_step is not None:
        return triton_step(grad, moments, storages, tables, hyper, weights, seeds, keep)
    if not any(storage.kind in formats.MATRIX_KINDS for storage in storages):
        # Elementwise storage: the step runs on flat vectors of dynamic length, one compiled
        # step for every shape (matrix index arithmetic of symbolic width is slower).
        grad, weights = grad.view(-1), None if weights is None else weights.view(-1)
        _mark_dynamic(grad, weights, *(t for parts in moments for t in parts.values()))
    # Moments scaled by rows and columns compile once per matrix shape: with sizes as constants
    # the element → byte, digit and block arithmetic of ternary codes becomes multiplications
    # by constants instead of divisions by symbols, and Inductor drops the bounds checks that
    # kept the loops scalar (measured: benchmarks/RESULTS.md, "State storage").
    with compile_settings():
        step = _compiled(_adamw_step)
        direction, deferred = step(grad, moments, storages, tables, hyper, weights, seeds, keep)
        _encode_in_phases(deferred, keep)
    return None if direction is None else direction.view(matrix)


def adamw_steps(
    grads: list[Tensor],
    moments: list[Moments],
    hypers: Tensor,
    weights: list[Tensor],
    keeps: list[Tensor | None],
) -> None:
    """One AdamW step of each of several tensors with fp32 moments, in one call: what
    ``adamw_step`` does for grad ``i`` (contiguous, fp32 or bf16: read as fp32), its two
    moments' parts and its ``weights`` (contiguous, fp32 or bf16 rounded to nearest), with row
    ``i`` of ``hypers`` (stacked ``hyperparameters``) and ``keeps[i]``.

    On a Triton device, one launch of the multi-tensor kernel (``triton_multi_tensor``), where a
    launch per tensor costs more than the update of a norm's few thousand elements. Elsewhere
    one compiled call, where each call pays dynamo's guards and wrappers (benchmarks/RESULTS.md,
    "State storage"): grouped, a model's norms and biases pay them once. Shapes are constants
    there: one compilation per set of tensors, which a model keeps from step to step."""
    if hypers.device.type in TRITON_DEVICE_TYPES and _triton_installed():
        from slimopt.kernels import triton_multi_tensor

        triton_multi_tensor.adamw_steps(grads, moments, hypers, weights, keeps)
        return
    with compile_settings():
        _compiled(_adamw_steps)(grads, moments, hypers, weights, keeps)


def adafactor_step(
    grad: Tensor,
    moments: dict[str, Moment],
    factored: tuple[Tensor, Tensor] | None,
    hyper: Tensor,
    scale_parameter: bool,
    weights: Tensor | None,
    seeds: tuple[Tensor, ...] = (),
    keep: Tensor | None = None,
) -> Tensor | None:
    """One Adafactor step of the fp32 matrix ``grad`` (rows × columns, contiguous), as
    ``adamw_step`` is one of AdamW: the moments present (``exp_avg`` with momentum,
    ``exp_avg_sq`` unless the second moment is ``factored`` into raw row and column statistics)
    and the ``weights`` updated in place, or the direction returned without weights.
    ``hyper``: ``adafactor.hyperparameters``; ``scale_parameter``: whether the step size is
    multiplied by the weights' RMS."""
    from slimopt.kernels import adafactor

    if not any(storage.kind in formats.MATRIX_KINDS for _, storage, _ in moments.values()):
        # As for AdamW: one compiled step for every shape, but where ternary codes are indexed.
        parts = (t for stored, _, _ in moments.values() for t in stored.values())
        _mark_dynamic(grad, weights, *(factored or ()), *parts)
    with compile_settings():
        step = _compiled(adafactor.adafactor_step)
        direction, deferred = step(grad, moments, factored, hyper, scale_parameter, weights, seeds, keep)
        _encode_in_phases(deferred, keep)
    return direction


def _encode_in_phases(deferred: tuple[formats.Deferred, ...], keep: Tensor | None) -> None:
    """Encode each ternary moment a compiled step left to its caller (its new value, stream,
    stored parts and storage), one compiled phase after another (``formats``)."""
    for value, seed, parts, storage in deferred:
        _compiled(formats.ternary_scales)(value, parts, storage, keep)
        scales = _compiled(formats.ternary_exponents)(value, parts, storage, keep)
        _compiled(formats.ternary_codes)(value, scales, parts, storage, seed, keep)


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
    lr, eps, weight_decay = float(lr), float(eps), float(weight_decay)
    values = (
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        1 - beta1**age,
        (1 - beta2**age) ** 0.5,
        1 - lr * weight_decay,
        -lr * scale,
    )
    return scalars(values, torch.device(device))


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_step_of(storages: Storages) -> Callable[..., Tensor | None] | None:
    """The hand-written Triton step (``adamw_step``'s arguments) that covers moments stored as
    ``storages``, or None: ``triton_adamw``'s for elementwise formats (blocks of one even size
    where both are blockwise), ``triton_ternary``'s for a ternary first moment with row and
    column scales beside a factored second moment."""
    if not _triton_installed():
        return None
    if any(storage.kind in formats.MATRIX_KINDS for storage in storages):
        from slimopt.kernels import triton_ternary

        return triton_ternary.adamw_step if triton_ternary.handles(storages) else None
    sizes = {storage.block_size for storage in storages if storage.kind == "blockwise"}
    if len(sizes) > 1 or any(size % 2 for size in sizes):
        return None
    from slimopt.kernels import triton_adamw

    return triton_adamw.adamw_step


def _compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` compiled (to be called with ``COMPILE_SETTINGS`` in effect).

    Under a mode that watches every operation (slimopt.memory.LiveBytes, counting a step's
    memory) dynamo cannot compile, and it would never try the function again: it runs as it
    is, compiled the next time no mode watches."""
    if is_in_torch_dispatch_mode(include_infra_modes=False):
        return function
    return _compile(function)


@functools.cache
def _compile(function: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(function, options=INDUCTOR_OPTIONS)


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """``COMPILE_SETTINGS`` in effect, for the compiled steps called inside. Entering them costs
    about as much as a guard check (entered per compiled call, a noticeable part of a step), so
    ``step()`` enters them once for all its tensors and the steps inside skip it."""
    if getattr(_settings, "entered", False):
        yield
        return
    with torch._dynamo.config.patch(**COMPILE_SETTINGS):
        _settings.entered = True
        try:
            yield
        finally:
            _settings.entered = False


# Whether this thread is inside ``compile_settings``.
_settings = threading.local()


def _mark_dynamic(*tensors: Tensor | None) -> None:
    """Mark every size of ``tensors`` dynamic: one compiled function serves every shape.
    (Stored moments keep their marks from step to step: marking again would cost as much.)"""
    for tensor in tensors:
        if tensor is not None:
            marked = getattr(tensor, "_dynamo_dynamic_indices", ())
            for dim, size in enumerate(tensor.shape):
                if size > 1 and dim not in marked:
                    torch._dynamo.mark_dynamic(tensor, dim)


def _adamw_steps(
    grads: list[Tensor],
    moments: list[Moments],
    hypers: Tensor,
    weights: list[Tensor],
    keeps: list[Tensor | None],
) -> None:
    """``adamw_steps``' compiled part."""
    storages = (Storage(), Storage())
    for index, (grad, pair, target, keep) in enumerate(zip(grads, moments, weights, keeps, strict=True)):
        _adamw_step(grad.view(-1).float(), pair, storages, ((), ()), hypers[index], target.view(-1), (), keep)


def _adamw_step(
    grad: Tensor,
    moments: Moments,
    storages: Storages,
    tables: Tables,
    hyper: Tensor,
    weights: Tensor | None,
    seeds: tuple[Tensor, ...],
    keep: Tensor | None,
) -> tuple[Tensor | None, tuple[formats.Deferred, ...]]:
    """``adamw_step``'s compiled part: it returns the direction (None with ``weights``) and, for
    each ternary moment, its new value, stream, stored parts and storage, which the caller
    encodes in phases."""
    new1, beta2, new2, eps, correction1, correction2_sqrt, decay, alpha = hyper.unbind()
    streams = iter(seeds)
    grad_shape = shape = grad.shape
    numel, padding = grad.numel(), 0
    if storages[0].kind == "blockwise" and storages[0].block_size == storages[1].block_size:
        # Both moments in blocks of one size: the whole step in blocks × block_size, where the
        # per-block scales broadcast along rows.
        shape = formats.blocks_shape(moments[0], storages[0])
        padding = shape.numel() - numel
        grad = torch.nn.functional.pad(grad.reshape(-1), (0, padding)).view(shape)
    exp_avg, exp_avg_sq = (
        formats.decode(parts, storage, table, shape)
        for parts, storage, table in zip(moments, storages, tables, strict=True)
    )
    # The reference rule's operations, in its order (slimopt.rules.adamw).
    exp_avg = torch.lerp(exp_avg, grad, new1)  # new1, new2: the weights of the new gradient
    exp_avg_sq = exp_avg_sq * beta2 + new2 * grad * grad
    direction = exp_avg / (exp_avg_sq.sqrt() / correction2_sqrt + eps) / correction1
    if padding:
        # The reference encodes the moment padded with zeros; a decoded padding need not be zero
        # (the 4-bit second-moment map has no zero), so it is cleared before the block scales.
        real = (torch.arange(shape.numel(), device=grad.device) < numel).view(shape)
        exp_avg, exp_avg_sq = exp_avg * real, exp_avg_sq * real
        direction = direction.reshape(-1)[:numel]
    direction = direction.reshape(grad_shape)
    deferred = []
    for value, parts, storage, table in zip((exp_avg, exp_avg_sq), moments, storages, tables, strict=True):
        seed = next(streams) if storage.stochastic else None
        if storage.kind == "ternary":
            deferred.append((value, seed, parts, storage))  # the caller encodes it in phases
        else:
            formats.encode(value, parts, storage, table, seed, keep)
    if weights is None:
        return direction if keep is None else torch.where(keep, direction, 0.0), tuple(deferred)
    target = weights.float() * decay + alpha * direction
    if weights.dtype == torch.bfloat16:
        target = formats.round_to_bf16(target, next(streams, None))
    formats.store(weights, target, keep)
    return None, tuple(deferred)
