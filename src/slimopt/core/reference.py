"""The reference path of one update: decode the moments to fp32, run the rule, encode them, and
write the weights (a projected direction projected back a slice of rows at a time, or the raw
gradient scaled by it: APOLLO, ``slimopt.core.scaling``). The definition every fused step is
checked against."""

from __future__ import annotations

from slimopt.codecs.slicing import slices_to_update
from slimopt.core.moments import decode_all, encode
from slimopt.core.outcome import Outcome
from slimopt.core.record import Update
from slimopt.core.scaling import limited, scaling_factor, write_scaled
from slimopt.core.state import STEP
from slimopt.core.tensors import as_matrix, matrix_of
from slimopt.core.weights import update_weights, update_weights_projected, weight_step


def reference_update(update: Update) -> Outcome:
    """The update through the reference path, after ``record.begin``. A device flag
    ``update.keep`` (the fused step that would have masked by it did not compile) is read here."""
    plan, state, group = update.plan, update.state, update.plan.group
    if update.keep is not None and not bool(update.keep):
        return Outcome.SKIPPED
    moments = decode_all(plan, state, update.grad.shape, update.layout)
    direction = plan.rule.direction(update.grad, {**state, **moments}, update.age, group)
    encode(plan, state, moments, update.generator, update.layout)
    with matrix_of(update.unit) as weights:
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
