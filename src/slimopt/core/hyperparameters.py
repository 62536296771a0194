"""Which hyperparameters a param group takes when its update rule is not its optimizer's own.

A slimopt optimizer's constructor gives its rule's hyperparameters defaults (``GaLoreAdamW``:
AdamW's betas and eps). A group whose ``rule`` names another rule, or a constructor ``rule``,
takes that rule's defaults for what it leaves out instead; the optimizer's ``lr`` and
``weight_decay`` apply whatever the rule. To tell what a constructor's caller left out, each
optimizer's constructor records the arguments it was given (decorated with
``recording_given``; a constructor without it counts every argument as given).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from slimopt.rules import RULES, UpdateRule


def recording_given(init: Callable[..., None]) -> Callable[..., None]:
    """``init``, an optimizer subclass's constructor, that first records the names of the
    arguments its caller gave, as the optimizer's ``_given`` (which the shell's constructor takes
    and removes): only the outermost of nested constructors records, since an inner one is
    called with every argument."""
    signature = inspect.signature(init)
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(init)
    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        if "_given" not in self.__dict__:
            arguments = signature.bind(self, *args, **kwargs).arguments
            self._given = {*arguments, *arguments.get(extra, {})} - {extra}
        init(self, *args, **kwargs)

    return recording


def constructor_defaults(
    rule: str | None, own: UpdateRule, defaults: dict[str, Any], given: set[str] | None
) -> dict[str, Any]:
    """A constructor's ``defaults`` for its groups: as they are when ``rule`` (the constructor's
    ``rule`` option) is None or the optimizer's ``own``; else ``lr``, ``weight_decay`` and the
    hyperparameters its caller gave (``given``; None: all of them), with ``rule``'s defaults for
    the rest, as a param group of that rule gets them."""
    if rule not in RULES or type(RULES[rule]) is type(own):
        return defaults
    kept = {key: value for key, value in defaults.items() if given is None or key in given}
    kept |= {key: defaults[key] for key in ("lr", "weight_decay") if key in defaults}
    return {**RULES[rule].defaults, **kept}


def fill_rule_defaults(group: dict[str, Any], default: UpdateRule, kept: dict[str, tuple[str, ...]]) -> None:
    """Give ``group`` (as passed to ``add_param_group``), when its ``rule`` is not the
    optimizer's ``default`` rule (its constructor's), that rule's defaults for the
    hyperparameters it does not set, but for those ``kept[rule]`` names (taken from the
    optimizer's defaults, as TACO's AdamW fallback takes its betas and eps)."""
    rule = group.get("rule")
    if rule in RULES and type(RULES[rule]) is not type(default):
        for key, value in RULES[rule].defaults.items():
            if key not in kept.get(rule, ()):
                group.setdefault(key, value)
