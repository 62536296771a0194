"""The flags several ``slimopt`` commands share: the optimizer's options and the weights' dtype,
each read as ``slimopt.options.parse_option`` reads Hugging Face's ``optim_args``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from slimopt.options import BY_NAME, OPTION_TYPES, parse_option
from slimopt.registry import OPTIMIZERS
from slimopt.weight_formats import weight_dtype

# Flags that configure the optimizer rather than the run, with their types: every option of the
# table a user gives (``slimopt.options.OPTIONS``; a boolean is --name / --no-name, left out
# meaning its default), and weight decay.
OPTIMIZER_FLAGS: dict[str, type] = {**OPTION_TYPES, "weight_decay": float}

DTYPE_HELP = (
    "how the weights are stored: fp32, bf16, bf16+8 (bf16 and an 8-bit correction, 24 bits), "
    "int8 (linear weights as int8 codes, stochastic rounding; the rest bf16), int8-embed (the "
    "input embedding int8 too) or int8-all (the embedding and the output head int8 too)"
)


def read_weight_dtype(text: str) -> str:
    """argparse's reading of ``--dtype``: a weight dtype or an alias of one."""
    try:
        return weight_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# The options some optimizer defaults otherwise than the table (APOLLO's projection, the storage
# each class is named for).
_OWN_DEFAULTS = {"states"} | {
    key for spec in OPTIMIZERS.values() for key in (*spec.cls.projection_defaults, *dict(spec.options))
}


def _option_help(name: str) -> str:
    if name == "rank":
        return "GaLore rank (default: a quarter of the projected matrices' smaller side, r = n/4)"
    if name == "weight_decay":
        return "decoupled weight decay (default 0.01)"
    option = BY_NAME[name]
    if name in _OWN_DEFAULTS:
        return f"{option.help} (default: the optimizer's own)"
    default = option.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    return f"{option.help} (default {'none' if default is None else default})"


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for each of ``OPTIMIZER_FLAGS`` to ``parser``."""
    for name, kind in OPTIMIZER_FLAGS.items():
        if kind is bool:
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, help=_option_help(name))
        else:
            parser.add_argument(
                f"--{name.replace('_', '-')}", type=_option_reader(name, kind), help=_option_help(name)
            )


def _option_reader(name: str, kind: type) -> Callable[[str], Any]:
    """argparse's reading of optimizer flag ``name``: ``parse_option``, which Hugging Face's
    ``optim_args`` read with too; its error becomes argparse's (exit 2, one line)."""

    def read(text: str) -> Any:
        try:
            return parse_option(name, text, kind)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return read
