"""An elementwise rule on a large unprojected matrix, one slice of rows at a time, so no
full-size fp32 temporary exists; its moments are stored by slices (``slimopt.codecs.rows``)."""

from __future__ import annotations

from slimopt.codecs.slicing import slices_to_update
from slimopt.core.fused import fused_moment, fused_step
from slimopt.core.moments import stored_parts
from slimopt.core.record import NotCompiled, Outcome, Update
from slimopt.core.state import STEP
from slimopt.core.tensors import as_matrix
from slimopt.core.weights import matrix_of, update_weights, weight_step


def update_by_row_slices(update: Update) -> Outcome:
    """The update a slice of rows at a time (after ``record.begin``), each slice through the
    fused step or the reference path (``update.keep``: as for ``fused.fused_update``; read on
    the host when a fused step does not compile midway, the earlier slices having been masked
    by it)."""
    plan, state, group = update.plan, update.state, update.plan.group
    first = update.age == 1  # the moments were created by ``begin``: each slice starts from zero
    storages = plan.row_storages()
    stored = {key: stored_parts(state, key, storage.sizes) for key, storage in storages.items()}
    with matrix_of(plan, update.unit) as weights:
        grad = as_matrix(update.grad)
        lr = plan.rule.step_size(group, weights, state[STEP])
        write = weight_step(plan, state, weights, update.generator, lr, 1.0)
        fused = not first and plan.fused
        for index, rows in slices_to_update(*weights.shape, meta=weights.is_meta):
            slice_grad = grad[rows].float()
            if fused:
                moments = {
                    key: fused_moment(
                        storage.codecs[index][0], storage.parts(stored[key], index), grad.device
                    )
                    for key, storage in storages.items()
                }
                try:
                    fused_step(update, slice_grad, moments, weights[rows])
                    continue
                except NotCompiled:
                    fused = False
            if update.keep is not None:
                # The fused step did not compile: decide on the host (earlier slices were masked).
                if not bool(update.keep):
                    return Outcome.SKIPPED
                update.keep = None
            if first:
                moments = plan.rule.init_state(slice_grad, group, projected=False)
            else:
                moments = {key: storage.decode(stored[key], index) for key, storage in storages.items()}
            direction = plan.rule.direction(slice_grad, moments, update.age, group)
            # Each fp32 temporary is let go once read: the gradient's slice before the moments
            # are encoded, each decoded moment as it is encoded (each encode's own temporaries
            # then reuse their memory).
            del slice_grad
            for key, storage in storages.items():
                storage.encode(stored[key], index, moments.pop(key), update.generator)
            update_weights(weights[rows], direction, write.of_rows(rows))
    return Outcome.TAKEN if update.keep is None else Outcome.MASKED
