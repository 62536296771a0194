"""The flags several ``slimopt`` commands share: the optimizer's options and the weights' dtype,
each read as ``slimopt.registry.parse_option`` reads Hugging Face's ``optim_args``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from slimopt.options import PROJECTION_DEFAULTS, STORAGE_DEFAULTS
from slimopt.registry import OPTION_TYPES, parse_option
from slimopt.weight_formats import weight_dtype

# Flags that configure the optimizer rather than the run, with their types (``stagger``, a
# boolean that is on by default, is left to config files and the Python API; ``fused`` is
# --fused / --no-fused, left out meaning auto).
OPTIMIZER_FLAGS: dict[str, type] = {
    **{name: kind for name, kind in OPTION_TYPES.items() if kind is not bool},
    "weight_decay": float,
    "fused": bool,
}

DTYPE_HELP = (
    "how the weights are stored: fp32, bf16, bf16+8 (bf16 and an 8-bit correction, 24 bits) or "
    "int8 (linear weights as int8 codes, stochastic rounding; the rest bf16)"
)


def read_weight_dtype(text: str) -> str:
    """argparse's reading of ``--dtype``: a weight dtype or an alias of one."""
    try:
        return weight_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _option_help(name: str) -> str:
    if name == "rank":
        return "GaLore rank (default: a quarter of the projected matrices' smaller side, r = n/4)"
    default = {**PROJECTION_DEFAULTS, **STORAGE_DEFAULTS}.get(name)
    if name == "states":
        return (
            "state storage: fp32, bf16, int8, int4 or ternary, or one per moment as FIRST/SECOND "
            "(default: the optimizer's own)"
        )
    if name == "weight_decay":
        return "decoupled weight decay (default 0.01)"
    shown = "the format's own" if default is None else default
    return f"optimizer option {name} (default {shown})"


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for each of ``OPTIMIZER_FLAGS`` to ``parser``."""
    for name, kind in OPTIMIZER_FLAGS.items():
        if kind is bool:
            parser.add_argument(
                f"--{name}",
                action=argparse.BooleanOptionalAction,
                help="the fused step (slimopt.kernels; compiled at the first step; times in "
                "docs/results/storage.md); --no-fused: the reference path; default: fused on CUDA only",
            )
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
