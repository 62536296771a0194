"""The one dispatcher: each update goes by slices of rows, through the fused step, with the
small tensors together, or through the reference path, as its ``Plan`` says; what the path
reports (``Outcome``) is settled here: a masked update's device flag recorded, a skipped one
taken back."""

from __future__ import annotations

from torch import Tensor

from slimopt.core.decisions import decides_on_device
from slimopt.core.fused import fused_update, together, update_together
from slimopt.core.outcome import NotCompiled, Outcome
from slimopt.core.record import Update, begin
from slimopt.core.reference import reference_update
from slimopt.core.rows import update_by_row_slices
from slimopt.core.units import skip, unstep
from slimopt.finite import Decisions


def apply_together(updates: list[Update], decisions: Decisions) -> list[Update]:
    """Apply the small tensors among ``updates`` that ``fused.together`` admits, in one call
    per device; return the others, in their order, for ``apply``."""
    batches: dict[object, list[Update]] = {}
    rest = []
    for update in updates:
        verdict = update.verdict
        decided = verdict is True or (isinstance(verdict, Tensor) and decides_on_device(update))
        if decided and together(update):
            batches.setdefault(update.unit.device, []).append(update)
        else:
            rest.append(update)
    for batch in batches.values():
        if len(batch) < 2:
            rest += batch
            continue
        for update in batch:
            update.keep = update.verdict if isinstance(update.verdict, Tensor) else None
        for update, outcome in zip(batch, update_together(batch), strict=True):
            settle(update, outcome, decisions)
    return rest


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
    settle(update, _path(update), decisions)


def _path(update: Update) -> Outcome:
    if update.plan.by_row_slices:
        return update_by_row_slices(update)
    begin(update)
    if update.plan.fused:
        try:
            return fused_update(update)
        except NotCompiled:
            pass
    return reference_update(update)


def settle(update: Update, outcome: Outcome, decisions: Decisions) -> None:
    """Record a masked update's device flag; take back the count of a skipped one."""
    if outcome is Outcome.MASKED:
        decisions.record(update, update.keep)
    elif outcome is Outcome.SKIPPED:
        unstep(update.plan, update.state)
