"""The one dispatcher: whether each update's gradient is finite, decided for all of a step's
updates at once (``slimopt.finite``: read on the host in one read for the reference path, left on
the device as a flag for the fused path, which masks its writes with it); then each update goes
by slices of rows, through the fused step, with the small tensors together, or through the
reference path, as its ``Plan`` says, the reference path taking over wherever auto mode's fused
step did not compile. What the path reports (``Outcome``) is settled here: a masked update's
device flag recorded, a skipped one taken back.

The reference path (``reference_update``) decodes the moments to fp32, runs the rule, encodes
them and writes the weights (a projected direction projected back a slice of rows at a time, or
the raw gradient scaled by it: APOLLO, ``slimopt.core.scaling``): the definition every fused
step is checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from slimopt import finite
from slimopt.codecs.slicing import slices_to_update
from slimopt.core.fused import fused_update, muon_batch, together, update_muon, update_together
from slimopt.core.moments import decode_all, encode
from slimopt.core.plan import Plan
from slimopt.core.record import NotCompiled, Outcome, Update, begin
from slimopt.core.rows import update_by_row_slices
from slimopt.core.scaling import limited, scaling_factor, write_scaled
from slimopt.core.state import STEP, started
from slimopt.core.tensors import as_matrix, real
from slimopt.core.units import skip, unstep
from slimopt.core.weights import matrix_of, update_weights, update_weights_projected, weight_step
from slimopt.finite import Decisions


def decides_on_device(update: Update) -> bool:
    """Whether ``update`` takes its non-finite decision on the device: on the fused path on a
    device where its optimizer's policy keeps the flags (``FusedPolicy.flags_on``), once its
    state exists (a first step creates the state on the host)."""
    plan = update.plan
    return plan.flags_on_device and plan.fused and started(update.state)


def decide(updates: list[Update]) -> list[bool | Tensor]:
    """For each update, whether its gradient is finite: a bool read on the host, or for an
    update deciding on the device a flag left there."""
    grads, groups, on_device = [], [], []
    for update in updates:
        plan = update.plan
        grads.append(real(update.grad))
        groups.append(None if plan.sharding is None else plan.sharding.group)
        on_device.append(plan.flags_on_device and decides_on_device(update))
    flags = finite.finite_flags(grads, groups, host_reads=not any(on_device))
    return finite.decisions(flags, on_device)


def combined(first: list[bool | Tensor], second: list[bool | Tensor]) -> list[bool | Tensor]:
    """Each pair of decisions combined: host bools by ``and``, device flags in one vector
    operation for all of them (not one per parameter)."""
    both: list[bool | Tensor] = []
    on_device: list[int] = []
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        if a is False or b is False:
            both.append(False)
        elif a is True or b is True:
            both.append(b if a is True else a)
        else:  # two device flags
            both.append(a)
            on_device.append(index)
    if on_device:
        vector = torch.stack([first[k] for k in on_device]) & torch.stack([second[k] for k in on_device])
        for position, k in enumerate(on_device):
            both[k] = vector[position]
    return both


def apply_together(updates: list[Update], decisions: Decisions) -> list[Update]:
    """Apply the updates that take a grouped fused step: the small tensors that
    ``fused.together`` admits, in one call per device, and Muon's matrices, in batches of one
    shape (``fused.muon_batch``) of at most ``MUON_BATCH_ELEMENTS``; return the others, in
    their order, for ``apply``."""
    small: dict[object, list[Update]] = {}
    matrices: dict[object, list[Update]] = {}
    rest = []
    for update in updates:
        verdict = update.verdict
        decided = verdict is True or (isinstance(verdict, Tensor) and decides_on_device(update))
        batch = muon_batch(update) if decided else None
        if decided and together(update):
            small.setdefault(update.unit.device, []).append(update)
        elif batch is not None:
            matrices.setdefault(batch, []).append(update)
        else:
            rest.append(update)
    for batch in small.values():
        if len(batch) < 2:
            rest += batch
            continue
        _apply_batch(batch, update_together, decisions)
    for batch in matrices.values():
        for part in _limited(batch):
            for update in part:
                begin(update, own_dtype=True)
            _apply_batch(part, update_muon, decisions)
    return rest


# The most elements a batch of Muon's matrices stacks, by device type: on a GPU its products and
# their bf16 temporaries stay within a few hundred MiB (a larger matrix goes alone); on the CPU one
# matrix at a time, so that its passes and its iteration find it in the core's cache, where a
# batch's passes evict it (measured: docs/results/muon.md).
MUON_BATCH_ELEMENTS = {"cpu": 1, "cuda": 2**24}


def _limited(batch: list[Update]) -> list[list[Update]]:
    """``batch`` in consecutive parts of at most ``MUON_BATCH_ELEMENTS`` elements of its device
    type (at least one update each)."""
    limit = MUON_BATCH_ELEMENTS.get(batch[0].grad.device.type, MUON_BATCH_ELEMENTS["cuda"])
    size = max(1, limit // max(batch[0].grad.numel(), 1))
    return [batch[start : start + size] for start in range(0, len(batch), size)]


def _apply_batch(
    batch: list[Update], step: Callable[[list[Update]], list[Outcome]], decisions: Decisions
) -> None:
    """``step`` of ``batch`` (each update masked by its device flag), or the reference path of
    each update where auto mode's step did not compile, in this batch or an earlier one (the
    batches of a step are formed before any runs); each outcome settled."""
    for update in batch:
        update.keep = update.verdict if isinstance(update.verdict, Tensor) else None
    try:
        if not batch[0].plan.fused:  # one optimizer's policy for the whole batch
            raise NotCompiled
        outcomes = step(batch)
    except NotCompiled:
        outcomes = [reference_update(_with_fp32_gradient(update)) for update in batch]
    for update, outcome in zip(batch, outcomes, strict=True):
        settle(update, outcome, decisions)


def apply(update: Update, decisions: Decisions) -> None:
    """Apply ``update`` (its gradient in the basis' space) unless its verdict says the gradient
    is not finite; a device flag is read here when the update does not decide on the device."""
    verdict = update.verdict
    if isinstance(verdict, Tensor) and not decides_on_device(update):
        verdict = bool(verdict)
    if verdict is False:
        skip(update.plan, update.state, "non-finite gradient")
        return
    update.keep = verdict if isinstance(verdict, Tensor) else None
    outcome = _path(update)
    if outcome is not Outcome.TAKEN:
        settle(update, outcome, decisions)


def _path(update: Update) -> Outcome:
    # By slices of rows the gradient stays in its dtype: each slice is read as fp32 in turn (by
    # the update, or on the reference path by a rule that reads it so itself: TACO's, Adafactor's).
    plan = update.plan
    fused = plan.fusable and plan.fused
    reads_own = plan.rule.reads_own_dtype and update.basis is None and not fused
    begin(update, own_dtype=plan.by_row_slices or reads_own)
    if plan.by_row_slices:
        return update_by_row_slices(update)
    if fused:
        try:
            return fused_update(update)
        except NotCompiled:
            pass
    return reference_update(update)


def _with_fp32_gradient(update: Update) -> Update:
    """``update`` with its gradient in fp32, as the reference path reads it (a grouped fused step
    began it in the gradient's own dtype)."""
    update.grad = update.grad.float()
    return update


def settle(update: Update, outcome: Outcome, decisions: Decisions) -> None:
    """Record a masked update's device flag; take back the count of a skipped one."""
    if outcome is Outcome.MASKED:
        decisions.record(update, update.keep)
    elif outcome is Outcome.SKIPPED:
        unstep(update.plan, update.state)


def rule_direction(plan: Plan, update: Update, state: dict[str, Tensor]) -> Tensor:
    """The rule's direction for ``update``; for a rule that is not elementwise on a matrix split
    by rows (Muon under FSDP2, ``sharded_direction``), with its whole-matrix part computed by
    one process, the parameter's owner by its ordinal."""
    sharding = plan.sharding
    if sharding is None or plan.rule.elementwise:
        return plan.rule.direction(update.grad, state, update.age, plan.group)
    on_owner = partial(sharding.on_owner, ordinal=plan.place.ordinal)
    shape = (sharding.rows, *update.grad.shape[1:])
    return plan.rule.sharded_direction(update.grad, state, plan.group, on_owner, shape)


def reference_update(update: Update) -> Outcome:
    """The update through the reference path, after ``record.begin``. A device flag
    ``update.keep`` (the fused step that would have masked by it did not compile) is read here."""
    plan, state, group = update.plan, update.state, update.plan.group
    if update.keep is not None and not bool(update.keep):
        return Outcome.SKIPPED
    moments = decode_all(update.storage, state, update.grad.shape)
    direction = rule_direction(plan, update, {**state, **moments})
    encode(update.storage, state, moments, update.generator)
    with matrix_of(plan, update.unit) as weights:
        lr = plan.rule.step_size(group, weights, state[STEP])
        if update.basis is None:
            update_weights(
                weights, as_matrix(direction), weight_step(plan, state, weights, update.generator, lr, 1.0)
            )
            return Outcome.TAKEN
        step = weight_step(plan, state, weights, update.generator, lr, group["scale"])
        if plan.scales_gradient:
            factor = scaling_factor(plan, update.grad, direction, update.basis)
            write_scaled(weights, update.raw, limited(plan, state, update.raw, factor, update.age), step)
            return Outcome.TAKEN
        # Back-projected a slice of rows at a time: no full-size fp32 update of a large matrix.
        for _, rows in slices_to_update(*weights.shape, meta=weights.is_meta):
            update_weights_projected(weights, direction, update.basis, rows, step)
    return Outcome.TAKEN
