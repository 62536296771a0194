"""What a resumed run takes from its checkpoint and what from its configuration.

The checkpoint brings the state: weights, moments and bases, the schedule's position, the data's
position and the random number generators. The run's configuration (``config.json`` with the
flags given again) brings the settings. ``torch.optim``'s ``load_state_dict`` takes a state
dict's hyperparameters, and a scheduler's takes its peak learning rates, so on their own an
option given again on resume (``--lr``, ``--weight-decay``, ``--update-proj-gap`` …) would be
written to ``config.json``, announced, and ignored; here the values the run was built with win.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimopt.train.checkpoint import load_resumed


def resume(
    checkpoint: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LambdaLR,
    settings: Iterable[str],
) -> dict[str, Any]:
    """Load ``checkpoint`` into ``model``, ``optimizer`` and ``schedule`` and return the rest of
    the run's state (``load_resumed``; raises what it raises). The optimizer's groups keep the
    values of ``settings`` (the options the run's configuration sets) they were built with, and
    the schedule its peak learning rates, at the checkpoint's point of the schedule."""
    settings = list(settings)
    built = [{key: group[key] for key in settings if key in group} for group in optimizer.param_groups]
    peaks = list(schedule.base_lrs)
    state = load_resumed(checkpoint, model, optimizer)
    schedule.load_state_dict(state["schedule"])
    for group, values in zip(optimizer.param_groups, built, strict=True):
        group.update(values)
    if schedule.base_lrs != peaks:
        schedule.base_lrs = peaks
        rates = [
            peak * factor(schedule.last_epoch)
            for peak, factor in zip(peaks, schedule.lr_lambdas, strict=True)
        ]
        for group, peak, rate in zip(optimizer.param_groups, peaks, rates, strict=True):
            group["initial_lr"], group["lr"] = peak, rate
        schedule._last_lr = rates  # what get_last_lr() reports, as step() would set it
    return state
