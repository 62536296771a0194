"""Update rules: the optimizer math on fp32 tensors, independent of projection and storage.

A rule owns the moments of one parameter (``init_state``), turns a gradient into an update
direction while advancing those moments (``direction``) and says how large a step to take
(``step_size``). It never knows whether the gradient it sees was projected. ``moment_kinds``
tells the projection how each moment transforms when the basis changes.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from slimopt.rules.adafactor import AdafactorRule
from slimopt.rules.adamw import AdamWRule
from slimopt.rules.lion import LionRule
from slimopt.rules.muon import MuonRule
from slimopt.rules.taco import TACORule

__all__ = ["RULES", "AdafactorRule", "AdamWRule", "LionRule", "MuonRule", "TACORule", "UpdateRule"]


class SparseDirection(Protocol):
    """A direction a rule returns in a form of its own rather than as a dense tensor (TACO's one
    entry per column): a matrix already, which ``add_to`` adds to the weights."""

    def add_to(self, weights: Tensor, alpha: float, first_row: int = 0) -> None:
        """``weights`` += alpha · direction, in place; ``weights`` holds the matrix's rows from
        ``first_row`` (the writes go a slice of rows at a time)."""


class UpdateRule(Protocol):
    """What the optimizer shell needs from an update rule."""

    # state key -> "linear" (first-moment-like) or "square" (second-moment-like)
    moment_kinds: dict[str, str]
    # whether each element's update depends only on that element (then a large matrix may be
    # updated a slice of rows at a time). A rule that is not may still take matrices split by
    # rows across processes (FSDP2) if it has ``sharded_direction`` (``MuonRule``): its
    # direction for this process's rows, its whole-matrix part computed by one process.
    elementwise: bool
    # whether ``init_state`` and ``direction`` take the gradient in its own dtype (bf16), reading
    # it a slice of rows at a time in fp32, so that the shell makes no fp32 copy of a matrix
    reads_own_dtype: bool
    # statistics the rule keeps as they are, not through a codec, when it factors its second
    # moment (Adafactor's row and column means of a matrix): their state keys, or ()
    factored_keys: tuple[str, ...]
    # which fused step of ``slimopt.kernels`` computes this rule ("adamw", "adafactor"), or None
    fused: str | None
    # the rule's hyperparameters besides lr and weight_decay, with their defaults: a param group
    # whose ``rule`` is not its optimizer's own takes these, not the optimizer's
    defaults: dict[str, Any]
    # what each of ``defaults`` means, one line each (the optimizers' docstrings show them)
    help: dict[str, str]

    def validate(self, group: dict[str, Any]) -> list[str]:
        """Return one message per invalid hyperparameter of ``group`` (empty when valid)."""

    def init_state(self, grad: Tensor, group: dict[str, Any], *, projected: bool) -> dict[str, Tensor]:
        """Return zero moments for a (projected) fp32 gradient like ``grad``."""

    def direction(
        self, grad: Tensor, state: dict[str, Tensor], age: int, group: dict[str, Any]
    ) -> Tensor | SparseDirection:
        """Advance the moments in ``state`` with ``grad`` (step number ``age``, from 1) and return
        the update direction, which the shell scales by ``-step_size``: a tensor like ``grad``,
        or a ``SparseDirection``."""

    def bias_correction(self, group: dict[str, Any], age: int) -> float:
        """The factor of the direction at moment age ``age`` that is bias correction (1.0 for a
        rule without): APOLLO's norm-growth limiter compares norms without it, as apollo-torch
        does (``slimopt.core.scaling``)."""

    def step_size(self, group: dict[str, Any], weights: Tensor, step: int) -> float | Tensor:
        """Return the learning rate for step ``step`` (from 1) of a parameter with values
        ``weights``: a number, or a 0-d tensor on the parameter's device when it depends on the
        weights. ``step`` counts the parameter's steps, not the age of its moments (a subspace
        change with the "reset" policy restarts the moments, not the schedule)."""


# A param group's ``rule`` (None: its optimizer's own) by name.
RULES: dict[str, UpdateRule] = {
    "adamw": AdamWRule(),
    "adafactor": AdafactorRule(),
    "lion": LionRule(),
    "taco": TACORule(),
    "muon": MuonRule(),
}
