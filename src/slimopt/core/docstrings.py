"""The Args, Keyword Args and Raises sections of an optimizer class's docstring (Google style,
as the manual's reference renders them): the constructor's parameters, each explained by the
shell or by an update rule, then every option of ``slimopt.options.OPTIONS`` with the class's
own default. Generated, so that a new option or hyperparameter is documented where it is
defined, once."""

from __future__ import annotations

import inspect
from typing import Any

from slimopt.options import OPTIONS
from slimopt.rules import RULES

# The constructor parameters that belong to the shell, not to an update rule.
SHELL_HELP = {
    "params": "the parameters to optimize, or dicts defining param groups, as in torch.optim",
    "lr": "learning rate",
    "weight_decay": "decoupled weight decay (multiplies the weights by 1 − lr · weight_decay)",
}


def optimizer_sections(cls: Any) -> str:
    """The sections for optimizer class ``cls`` (a ``SlimoptOptimizer`` subclass). Raises
    ``TypeError`` for a constructor parameter that neither the shell nor a rule explains."""
    explained = {**SHELL_HELP, **cls.rule.help}
    for rule, names in cls.rule_defaults.items():
        explained.update({name: RULES[rule].help[name] for name in names if name not in explained})
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    args = []
    for parameter in parameters:
        if parameter.kind is parameter.VAR_KEYWORD:
            args.append(f"**{parameter.name}: the options below, per param group or as every group's default")
        elif parameter.name in explained:
            args.append(f"{parameter.name}: {explained[parameter.name]}")
        else:
            raise TypeError(f"{cls.__name__}: constructor parameter {parameter.name!r} has no help text")
    return "\n".join(
        [
            "Args:",
            *(f"    {line}" for line in args),
            "",
            "Keyword Args:",
            *(f"    {line}" for line in _option_lines(cls.option_defaults())),
            "",
            "Raises:",
            "    TypeError: an option this optimizer does not have.",
            "    ValueError: a hyperparameter or option out of range, naming it and its valid values.",
        ]
    )


def _option_lines(defaults: dict[str, Any]) -> list[str]:
    """One line per option: its name, type, meaning and the default in ``defaults``."""
    lines = [
        "rank (int): makes a group projected: its parameters of two or more dimensions in a "
        "rank-``rank`` subspace (without it, the plain rule)",
        f"rule (str): a group's update rule, one of {', '.join(sorted(RULES))} "
        "(default: the optimizer's own)",
    ]
    for option in OPTIONS:
        value = defaults[option.name]
        lines.append(
            f"{option.name} ({option.type.__name__}): {option.help}. "
            f"Default: {'None' if value is None else repr(value)}."
        )
    return lines
