"""The keys of a unit's optimizer state and what kind each is: the one place they are spelled.

A unit's state (``optimizer.state[param]``, or an expert's part of it under ``expert{i}.``) holds

- counters: ``step`` (updates taken), ``moment_step`` (the moments' age; present once the first
  update created them), ``nonfinite_skips``, ``seed`` (the unit's random streams),
  ``refresh_offset`` (a projected unit's staggered refresh) and ``basis_draw`` (the step a random
  projection was drawn at);
- a projected unit's basis: ``basis_left`` and ``basis_right``, each stored by its codec's parts
  (``basis_left.codes``, ``basis_left.absmax``, …);
- kept tensors, the same in any storage format: APOLLO's limiter norm and bf16 weights' 8-bit
  correction;
- moments: the rule's (``UpdateRule.moment_kinds``; stored by their codec's parts, as
  ``exp_avg.codes``), and statistics a rule keeps as they are (Adafactor's factored ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STEP = "step"
MOMENT_STEP = "moment_step"
SKIPS = "nonfinite_skips"
SEED = "seed"
REFRESH_OFFSET = "refresh_offset"
DRAW = "basis_draw"
COUNTERS = (STEP, MOMENT_STEP, SKIPS, SEED, REFRESH_OFFSET, DRAW)

BASIS_KEYS = ("basis_left", "basis_right")

LIMITER = "limiter_norm"
CORRECTION = "weight_correction"
KEPT = (LIMITER, CORRECTION)

# What any unit may hold whatever its rule (besides its rule's moments).
SHELL_KEYS = frozenset({*COUNTERS, *BASIS_KEYS, *KEPT})


def started(state: Mapping[str, Any]) -> bool:
    """Whether the unit's moments exist (its first update creates them)."""
    return MOMENT_STEP in state


def is_basis_key(key: str, *, random: bool | None = None) -> bool:
    """Whether a state key (``basis_left``, ``basis_right.codes``, ``basis_draw``) holds part of a
    basis: of either kind, or with ``random`` of a random projection (True) or stored factors."""
    kinds = {None: (*BASIS_KEYS, DRAW), True: (DRAW,), False: BASIS_KEYS}[random]
    return key.split(".")[0] in kinds
