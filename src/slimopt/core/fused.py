"""The fused path of one update (``slimopt.kernels``): moments and weights in one compiled step,
or for a projected matrix the direction, projected back as the reference path does; the small
AdamW tensors of a step together in one call; Muon's matrices of one shape in batches. Where
auto mode's fused step does not compile, its optimizer gives it up for good (``NotCompiled``, a
warning)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from slimopt import kernels
from slimopt.codecs import MIN_COMPRESSED_NUMEL
from slimopt.codecs.draws import stream_seed
from slimopt.codecs.slicing import slices_to_update
from slimopt.core.record import NotCompiled, Outcome, Update, begin
from slimopt.core.state import STEP
from slimopt.core.tensors import as_matrix, values
from slimopt.core.weights import matrix_of, update_weights_projected, weight_step
from slimopt.kernels import adafactor, adamw, muon
from slimopt.kernels.adafactor import AdafactorScalars
from slimopt.rules import AdamWRule


def fused_update(update: Update) -> Outcome:
    """The update through the fused step, after ``record.begin``, masked by ``update.keep``
    when there is one. Raises ``NotCompiled`` (nothing written) when auto mode could not
    compile it."""
    plan, state, group = update.plan, update.state, update.plan.group
    if plan.rule.fused == "muon":  # a batch of one
        return update_muon([update])[0]
    step = state[STEP]
    with matrix_of(plan, update.unit) as weights:
        moments = stored_moments(update)
        matrix = as_matrix(update.grad)
        if update.basis is None:  # moments and weights in one fused step
            fused_step(update, matrix, moments, weights)
        else:
            direction = fused_step(update, matrix, moments, None)
            lr = plan.rule.step_size(group, weights, step)
            write = weight_step(plan, state, weights, update.generator, lr, group["scale"], update.keep)
            for _, rows in slices_to_update(*weights.shape, meta=False):
                update_weights_projected(weights, direction, update.basis, rows, write)
    return Outcome.TAKEN if update.keep is None else Outcome.MASKED


def stored_moments(update: Update) -> dict[str, kernels.Moment]:
    """Each moment of the rule that the unit's state holds, in the rule's order, as the fused
    step takes it, on the gradient's device: its stored parts, their ``Storage`` and its lookup
    tables (blocks only)."""
    moments, state = {}, update.state
    for key, codec in update.storage.codecs.items():
        names = update.storage.keys[key]
        if names[codec.parts[0]] in state:
            parts = {part: state[name] for part, name in names.items()}
            moments[key] = fused_moment(codec, parts, update.grad.device)
    return moments


def fused_moment(codec: Any, parts: dict[str, Tensor], device: torch.device) -> kernels.Moment:
    """A moment as the fused step takes it: stored ``parts``, their ``Storage`` and the codec's
    lookup tables (blocks only)."""
    storage = codec.storage
    return parts, storage, codec.tables(device) if storage.kind == "blockwise" else ()


def fused_step(
    update: Update, grad: Tensor, moments: dict[str, kernels.Moment], weights: Tensor | None
) -> Tensor | None:
    """The rule's step through ``slimopt.kernels`` on the matrix ``grad``: ``moments`` (updated
    in place), Adafactor's raw factored statistics and ``weights`` (a contiguous matrix, updated
    in place), or, without weights, the direction returned. Stochastic roundings draw from the
    update's generator in the reference path's order: the moments', then the weights'. Raises
    ``NotCompiled`` when auto mode could not compile it (``fused=True`` raises the failure)."""
    plan, state, device = update.plan, update.state, grad.device
    draws = sum(storage.stochastic for _, storage, _ in moments.values())
    draws += weights is not None and plan.rounds_weights
    seeds = tuple(stream_seed(update.generator, device) for _ in range(draws))
    keys = plan.rule.factored_keys
    factored = tuple(state[key] for key in keys) if keys and keys[0] in state else None
    grad = grad.contiguous()
    with auto_gives_up(plan.policy, plan.group["fused"] is True):
        if plan.rule.fused == "adafactor":
            # The weights' RMS of ``scale_parameter`` is taken inside the compiled step.
            hyper = adafactor_hyperparameters(update, grad.device)
            scale_parameter = plan.group["scale_parameter"]
            return kernels.adafactor_step(
                grad, moments, factored, hyper, scale_parameter, weights, seeds, update.keep
            )
        hyper = adamw_hyperparameters(update, weights, grad.device)
        triton = plan.policy.triton_on(device.type)
        return kernels.adamw_step(grad, moments, hyper, weights, seeds, update.keep, triton=triton)


def adamw_hyperparameters(update: Update, weights: Tensor | None, device: torch.device) -> Tensor:
    """``kernels.adamw.hyperparameters`` of the update: the step size of the unit's step, moments of
    the update's age; without ``weights`` (a projected matrix's direction), scaled by the
    group's ``scale``."""
    rule, group = update.plan.rule, update.plan.group
    lr = rule.step_size(group, weights, update.state[STEP])
    scale = 1.0 if weights is not None else group["scale"]
    return adamw.hyperparameters(
        lr, group["betas"], group["eps"], group["weight_decay"], update.age, scale, device
    )


def adafactor_hyperparameters(update: Update, device: torch.device) -> Tensor:
    """``kernels.adafactor.hyperparameters`` of the update: its group's scalars, the step size
    of the unit's step before ``scale_parameter``."""
    group, beta1 = update.plan.group, update.plan.group["beta1"]
    scalars = AdafactorScalars(
        second_moment_weight=math.pow(update.age, group["decay_rate"]),
        eps_squared=group["eps"][0],
        eps_rms=group["eps"][1],
        clip_threshold=group["clip_threshold"],
        one_minus_beta1=0.0 if beta1 is None else 1 - beta1,
        weight_decay=group["weight_decay"],
        step_size=update.plan.rule.unscaled_step_size(group, update.state[STEP]),
    )
    return adafactor.hyperparameters(scalars, device)


def together(update: Update) -> bool:
    """Whether ``update`` joins the grouped fused step (``kernels.adamw_steps``): unprojected,
    under ``MIN_COMPRESSED_NUMEL`` elements (so its moments are fp32 in every storage format),
    AdamW on the fused path, weights rounded to nearest."""
    plan, unit = update.plan, update.unit
    if update.basis is not None or unit.numel() >= MIN_COMPRESSED_NUMEL or unit.is_complex():
        return False
    if not isinstance(plan.rule, AdamWRule) or not plan.fused:
        return False
    return not plan.rounds_weights and values(unit).is_contiguous()


def update_together(batch: list[Update]) -> list[Outcome]:
    """Every update of ``batch`` in one ``kernels.adamw_steps`` call. Raises ``NotCompiled``
    (nothing written) when auto mode could not compile it (on CUDA: the Triton kernel);
    ``fused=True`` raises the failure."""
    grads, moments, hypers, weights = [], [], [], []
    for update in batch:
        begin(update, own_dtype=True)
        own = values(update.unit)
        hypers.append(adamw_hyperparameters(update, own, update.grad.device))
        stored = stored_moments(update)
        moments.append(tuple(parts for parts, _, _ in stored.values()))
        grads.append(update.grad)
        weights.append(own)
    promised = any(u.plan.group["fused"] is True for u in batch)
    with auto_gives_up(batch[0].plan.policy, promised):
        triton = batch[0].plan.policy.triton_on(batch[0].unit.device.type)  # one device, one optimizer
        keeps = [u.keep for u in batch]
        kernels.adamw_steps(grads, moments, torch.stack(hypers), weights, keeps, triton=triton)
    return [Outcome.TAKEN if u.keep is None else Outcome.MASKED for u in batch]


def muon_batch(update: Update) -> tuple[Any, ...] | None:
    """The batch ``update`` joins in Muon's fused step (``update_muon``), or None: a whole matrix
    (not projected) on the fused path, with the others of its device, group, shape, weight dtype
    and momentum storage."""
    plan = update.plan
    if plan.rule.fused != "muon" or not plan.fused or update.basis is not None:
        return None
    (codec,) = plan.storage(plan.layout(update.grad.shape)).codecs.values()  # Muon's one moment
    weights = values(update.unit)
    return (weights.device, id(plan.group), tuple(update.grad.shape), weights.dtype, codec.storage)


def update_muon(batch: list[Update]) -> list[Outcome]:
    """Every update of ``batch`` (begun: ``record.begin``; ``muon_batch`` gives each the same
    batch) in one ``kernels.muon_step`` call. Raises ``NotCompiled`` (nothing written) when auto
    mode could not compile it; ``fused=True`` raises the failure."""
    first = batch[0]
    plan, group, device = first.plan, first.plan.group, first.grad.device
    grads, moments, weights, keeps = [], [], [], []
    seeds: tuple[list[Tensor | None], list[Tensor | None]] = ([], [])
    storage, table = None, ()
    for update in batch:
        ((parts, storage, table),) = stored_moments(update).values()
        grads.append(update.grad)
        moments.append(parts)
        weights.append(values(update.unit))
        keeps.append(update.keep)
        # Drawn in the reference path's order: the buffer's rounding, then the weights'.
        seeds[0].append(stream_seed(update.generator, device) if storage.stochastic else None)
        seeds[1].append(stream_seed(update.generator, device) if plan.rounds_weights else None)
    lr = plan.rule.step_size(group, weights[0], first.state[STEP])
    ratio = plan.rule.ratio(tuple(first.grad.shape), group)
    hyper = muon.hyperparameters(group["momentum"], lr, group["weight_decay"], ratio, device)
    iteration = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
    with auto_gives_up(plan.policy, group["fused"] is True):
        triton = plan.policy.iteration_on(device.type)
        kernels.muon_step(
            grads,
            moments,
            storage,
            table,
            hyper,
            weights,
            seeds,
            keeps,
            iteration,
            group["nesterov"],
            triton=triton,
        )
    return [Outcome.TAKEN if u.keep is None else Outcome.MASKED for u in batch]


@contextmanager
def auto_gives_up(policy: kernels.FusedPolicy, promised: bool) -> Iterator[None]:
    """Around a fused step's call: where its code fails to build, the failure raised as it is
    when the step was ``promised`` (``fused=True``), else auto mode's answer (``give_up_auto``)
    and ``NotCompiled`` (nothing was written)."""
    try:
        yield
    except kernels.compile_failures() as error:
        if promised:
            raise
        give_up_auto(policy, error)
        raise NotCompiled from error


def give_up_auto(policy: kernels.FusedPolicy, error: Exception) -> None:
    """Auto mode's answer to a fused step that did not compile: the reference path from now on
    (it promised only the fastest exact path, and the reference path is one), with a warning."""
    cause = getattr(error, "inner_exception", error)
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    policy.give_up(reason)
    warnings.warn(
        f"slimopt: the fused step did not compile ({reason}); fused=None uses the reference path from now on",
        RuntimeWarning,
        stacklevel=8,
    )
