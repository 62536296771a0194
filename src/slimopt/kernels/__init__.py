"""Fused optimizer steps: read the gradient, decode both moments, update them, encode them and write
the parameter (or, for a projected matrix, the direction) in one compiled function.

The reference path (``slimopt.core.update.reference_update`` with ``slimopt.codecs``) runs a chain
of PyTorch operations, each a pass over memory; here the same arithmetic is written once as a
function of the stored tensors and compiled with ``torch.compile``, which fuses it into a few
loops: C++ with OpenMP on the CPU, Triton kernels on CUDA. The reference path stays the
definition: a fused step gives the same codes for the same fp32 values and parameters within fp32
round-off (the fused loops may contract a multiply and an add into one rounding).

Covered: the AdamW and Adafactor rules (``adafactor``), and Muon's (``muon``: a batch of
matrices of one shape, its Newton–Schulz iteration in torch's products or the Triton kernels of
``triton_newton_schulz``), with every storage format
(``slimopt.codecs.storage``), fp32 or bf16 parameters rounded to nearest or stochastically. On
CUDA, AdamW moments stored elementwise (fp32, bf16, 8- and 4-bit blocks) take the hand-written
Triton kernel of ``triton_adamw`` instead: one launch per tensor, no compilation per shape;
matrices with ternary states (ternary first moment with row and column scales, factored second
moment) take the four launches of ``triton_ternary``. Stochastic roundings draw from counter-based
streams (``slimopt.codecs.draws``) seeded as the reference path seeds them, so they draw the same
numbers. Small AdamW tensors (norms, biases) are updated together (``adamw_steps``): in one launch
of ``triton_multi_tensor`` on CUDA, in one compiled call elsewhere. Not covered
(``slimopt.options.fused_unsupported`` says why): TACO's rule, Muon in a projected subspace or on
matrices split across processes, complex parameters, tensors with
more than two dimensions under ternary states or Adafactor (their factored statistics are over the
last two). The steps take tensors, storage descriptors (``slimopt.codecs.base.Storage``) and
scalars; which step a rule takes, and its scalars, are decided in ``slimopt.core.fused``.
``policy`` says when the fused step is taken (auto mode, compilers), ``compiled`` how the steps
are compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from slimopt.codecs import storage as formats
from slimopt.codecs.base import Storage
from slimopt.kernels import adamw
from slimopt.kernels.arguments import Deferred, Moment, scalars
from slimopt.kernels.compiled import compile_settings, compiled, mark_dynamic
from slimopt.kernels.policy import (
    FUSED_CHOICES,
    FusedPolicy,
    compile_failure,
    compile_failures,
    compiler_error,
    triton_installed,
)

__all__ = [
    "FUSED_CHOICES",
    "FusedPolicy",
    "Moment",
    "Storage",
    "adafactor_step",
    "adamw_step",
    "adamw_steps",
    "compile_failures",
    "compile_settings",
    "compiler_error",
    "muon_step",
    "scalars",
    "triton_step_of",
]


def __getattr__(name: str) -> Any:
    # ``CompileFailure``: looked up on use (``policy.compile_failure``).
    if name == "CompileFailure":
        return compile_failure()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def adamw_step(
    grad: Tensor,
    moments: dict[str, Moment],
    hyper: Tensor,
    weights: Tensor | None,
    seeds: tuple[Tensor, ...] = (),
    keep: Tensor | None = None,
    *,
    triton: bool = False,
) -> Tensor | None:
    """One AdamW step of the fp32 matrix ``grad`` (rows × columns, contiguous): both moments
    (``exp_avg`` and ``exp_avg_sq``: stored parts by name, updated in place, their storage and
    lookup tables, as ``adafactor_step`` takes them) and, with ``weights`` (the parameter's
    matrix, fp32 or bf16, updated in place), the parameter; without, the direction is returned
    (a projected matrix projects it back itself).

    ``hyper`` is ``adamw.hyperparameters(...)``: values that change every step are data, not
    constants, so the compiled step is built once. ``seeds`` are the streams
    (``slimopt.codecs.draws``) of the stochastic roundings, in the reference path's order: each
    stochastic moment's, then the weights' when there is one more (bf16 weights rounded
    stochastically).

    ``keep``: a one-element bool tensor on the device, whether the gradient is finite. Where it
    is False nothing stored changes and the direction is zero: a non-finite gradient is skipped
    without the host reading the decision (no synchronisation).

    ``triton``: the hand-written Triton kernel takes the step where one covers the storage
    (``FusedPolicy.triton_on`` of the device), else ``torch.compile``'s."""
    parts, storages, tables = zip(*moments.values(), strict=True)
    matrix = grad.shape
    triton_step = triton_step_of(storages) if triton else None
    if triton_step is not None:
        return triton_step(grad, parts, storages, tables, hyper, weights, seeds, keep)
    if not any(storage.kind in formats.MATRIX_KINDS for storage in storages):
        # Elementwise storage: the step runs on flat vectors of dynamic length, one compiled
        # step for every shape (matrix index arithmetic of symbolic width is slower).
        grad, weights = grad.view(-1), None if weights is None else weights.view(-1)
        mark_dynamic(grad, weights, *(t for stored in parts for t in stored.values()))
    # Moments scaled by rows and columns compile once per matrix shape: with sizes as constants
    # the element → byte, digit and block arithmetic of ternary codes becomes multiplications
    # by constants instead of divisions by symbols, and Inductor drops the bounds checks that
    # kept the loops scalar (measured: docs/results/storage.md).
    with compile_settings():
        step = compiled(adamw.adamw_step)
        direction, deferred = step(grad, parts, storages, tables, hyper, weights, seeds, keep)
        _encode_in_phases(deferred, keep)
    return None if direction is None else direction.view(matrix)


def adamw_steps(
    grads: list[Tensor],
    moments: list[adamw.Moments],
    hypers: Tensor,
    weights: list[Tensor],
    keeps: list[Tensor | None],
    *,
    triton: bool = False,
) -> None:
    """One AdamW step of each of several tensors with fp32 moments, in one call: what
    ``adamw_step`` does for grad ``i`` (contiguous, fp32 or bf16: read as fp32), its two
    moments' parts and its ``weights`` (contiguous, fp32 or bf16 rounded to nearest), with row
    ``i`` of ``hypers`` (stacked ``adamw.hyperparameters``) and ``keeps[i]``.

    With ``triton`` (``FusedPolicy.triton_on`` of the device), one launch of the multi-tensor
    kernel (``triton_multi_tensor``), where a launch per tensor costs more than the update of a
    norm's few thousand elements. Elsewhere one compiled call, where each call pays dynamo's
    guards and wrappers (docs/changes.md): grouped, a model's norms and biases pay them
    once. Shapes are constants there: one compilation per set of tensors, which a model keeps
    from step to step."""
    if triton:
        from slimopt.kernels import triton_multi_tensor

        triton_multi_tensor.adamw_steps(grads, moments, hypers, weights, keeps)
        return
    with compile_settings():
        compiled(adamw.adamw_steps)(grads, moments, hypers, weights, keeps)


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
        mark_dynamic(grad, weights, *(factored or ()), *parts)
    with compile_settings():
        step = compiled(adafactor.adafactor_step)
        direction, deferred = step(grad, moments, factored, hyper, scale_parameter, weights, seeds, keep)
        _encode_in_phases(deferred, keep)
    return direction


def muon_step(
    grads: list[Tensor],
    moments: list[dict[str, Tensor]],
    storage: Storage,
    table: tuple[Tensor, ...],
    hyper: Tensor,
    weights: list[Tensor],
    seeds: tuple[list[Tensor | None], list[Tensor | None]],
    keeps: list[Tensor | None],
    iteration: tuple[tuple[float, float, float], int, float],
    nesterov: bool,
    *,
    triton: bool = False,
) -> None:
    """One Muon step of a batch of matrices of one shape (``muon``): the gradients (fp32 or
    bf16), each one's momentum buffer (stored parts, updated in place; all stored as
    ``storage``, with its lookup ``table``) and ``weights`` (fp32 or bf16, updated in place).
    ``hyper``: ``muon.hyperparameters(...)``; ``seeds``: each matrix's stream for its buffer's
    stochastic rounding and for its weights' (None where it draws none); ``keeps``: each
    matrix's device flag, as for ``adamw_step``; ``iteration``: the Newton–Schulz
    coefficients, steps and eps. ``triton``: the iteration in the Triton kernels of
    ``triton_newton_schulz`` (``FusedPolicy.iteration_on`` of the device), else in torch's
    batched products (the library's GEMMs: compiled, Inductor would round each product before
    its scaled sum, where ``baddbmm`` rounds once)."""
    from slimopt.kernels import muon
    from slimopt.rules.muon import iterated

    coefficients, steps, eps = iteration
    with compile_settings():
        starts, deferred = compiled(muon.momentum_steps, exact_casts=True)(
            grads, moments, storage, table, hyper, seeds[0], keeps, nesterov, eps
        )
        for ternary, keep in zip(deferred, keeps[: len(deferred)], strict=True):  # all, or none
            _encode_in_phases((ternary,), keep)
        ortho: Tensor | list[Tensor]
        if triton:
            from slimopt.kernels import triton_newton_schulz

            ortho = triton_newton_schulz.iterated(torch.stack(starts), coefficients, steps)
        elif starts[0].device.type == "cpu":
            # Matrix by matrix: one matrix's iteration stays in the core's cache, a stack's
            # does not (measured: docs/results/muon.md).
            ortho = [iterated(start, coefficients, steps) for start in starts]
        else:
            ortho = iterated(torch.stack(starts), coefficients, steps)
        compiled(muon.write_weights)(weights, ortho, hyper, seeds[1], keeps)


def _encode_in_phases(deferred: tuple[Deferred, ...], keep: Tensor | None) -> None:
    """Encode each ternary moment a compiled step left to its caller (its new value, stream,
    stored parts and storage), one compiled pass after another (``slimopt.codecs.storage``)."""
    for value, seed, parts, storage in deferred:
        compiled(formats.write_line_scales)(value, parts, storage, keep)
        scales = compiled(formats.write_exponents)(value, parts, storage, keep)
        compiled(formats.write_trits)(value, scales, parts, storage, seed, keep)


def triton_step_of(storages: tuple[Storage, ...]) -> Callable[..., Tensor | None] | None:
    """The hand-written Triton step (``adamw.adamw_step``'s arguments) that covers moments stored as
    ``storages``, or None: ``triton_adamw``'s for elementwise formats (blocks of one even size
    where both are blockwise), ``triton_ternary``'s for a ternary first moment with row and
    column scales beside a factored second moment."""
    if not triton_installed():
        return None
    if any(storage.kind in formats.MATRIX_KINDS for storage in storages):
        from slimopt.kernels import triton_ternary

        return triton_ternary.adamw_step if triton_ternary.handles(storages) else None
    sizes = {storage.block_size for storage in storages if storage.kind == "blockwise"}
    if len(sizes) > 1 or any(size % 2 for size in sizes):
        return None
    from slimopt.kernels import triton_adamw

    return triton_adamw.adamw_step
