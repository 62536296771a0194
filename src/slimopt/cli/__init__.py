"""``slimopt`` command line: argument parsing only; the work is in ``slimopt.train`` and
``slimopt.planner``. One module per command (``train``: train and compare, ``memory``,
``bench``), ``options`` for the flags they share.

    slimopt train --model llama_20m --optimizer galore_adamw --rank 128 --steps 1000 --out runs/x
    slimopt train --resume runs/x
    slimopt compare --optimizers adamw,galore_adamw,galore_adamw8bit --steps 300
    slimopt compare --preset demo
    slimopt memory --model llama_7b --optimizer galore_adamw8bit --rank 1024 --layerwise --gpu-memory 24

Every user error (a bad flag value, path, preset, optimizer, checkpoint, an ``--out`` that holds a
run) ends with one line ``slimopt: error: …`` and exit code 2, without a traceback; a warning is
one line ``slimopt: warning: …``. ``slimopt memory`` exits with 1 when the step does not fit the
card given with ``--gpu-memory``.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import warnings
from typing import Any, NoReturn

from slimopt import __version__
from slimopt.cli.bench import add_bench_flags, run_bench
from slimopt.cli.memory import add_memory_flags, run_memory
from slimopt.cli.train import PRESETS, add_run_flags, first_process, make_config, run_compare, run_train
from slimopt.distributed import STRATEGIES
from slimopt.distributed.grad_sync import GRAD_SYNCS
from slimopt.registry import available_optimizers
from slimopt.train.config import read_config_file

__all__ = ["build_parser", "join_negative_values", "main", "make_config", "resolve_options"]

# Loggers of packages that transformers imports when they are installed (torchao through its
# quantizers), which report at import time on kernels for other hardware: not slimopt's business.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
# "--lr -1e-3": argparse takes a value that starts with "-" and is no plain decimal for a flag.
NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class Parser(argparse.ArgumentParser):
    """argparse with every error on one line (``slimopt: error: …``, exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"slimopt: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="slimopt", description="Memory-lean LLM training and comparison.")
    parser.add_argument("--version", action="version", version=f"slimopt {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train one model with one optimizer")
    train.add_argument("--optimizer", help=f"one of: {', '.join(available_optimizers())} (default adamw)")
    train.add_argument(
        "--resume",
        help="run directory (its newest checkpoint) or checkpoint directory to continue from; the run's "
        "config.json supplies every option, flags given again override it",
    )
    train.add_argument(
        "--distributed",
        choices=("none", *STRATEGIES),
        help="under torchrun: ddp (the default there), zero1 (optimizer state split over the "
        "processes) or fsdp2 (parameters, gradients and state split by rows); none: one process",
    )
    train.add_argument(
        "--grad-sync",
        choices=GRAD_SYNCS,
        help="under ddp: all-reduce a GaLore-projected matrix's projection instead of its gradient "
        "between refreshes (projected), every whole gradient (full), or projected where the optimizer "
        "projects (auto, the default)",
    )
    add_run_flags(train)
    compare = commands.add_parser("compare", help="train the same model with several optimizers and compare")
    compare.add_argument("--optimizers", help="comma-separated names; the first is the reference")
    compare.add_argument("--preset", choices=list(PRESETS), help="a ready-made comparison")
    add_run_flags(compare)
    memory = commands.add_parser("memory", help="predict (or measure) the memory of a training step")
    add_memory_flags(memory)
    bench = commands.add_parser("bench", help="time training and optimizer steps beside the references")
    add_bench_flags(bench)
    return parser


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Preset, then config file, then flags given on the command line (later ones win)."""
    options: dict[str, Any] = dict(PRESETS[args.preset]) if getattr(args, "preset", None) else {}
    if getattr(args, "config", None):
        options |= read_config_file(args.config)
    options |= {
        k: v for k, v in vars(args).items() if v is not None and k not in ("command", "config", "preset")
    }
    return options


def join_negative_values(argv: list[str]) -> list[str]:
    """``--flag -1e-3`` as ``--flag=-1e-3``: argparse would read the number as an unknown flag
    and print its usage block instead of letting the value's check name it."""
    joined: list[str] = []
    for token in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and NUMBER.fullmatch(token):
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def _one_line_warning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
    print(f"slimopt: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slimopt`` console script; returns the exit code."""
    from slimopt.train.checkpoint import CheckpointError, CheckpointWriteError
    from slimopt.train.corpus import CorpusError

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    parser = build_parser()
    args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else argv))
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            options = resolve_options(args)
            if args.command == "train":
                summary = run_train(options)
                return 130 if summary["interrupted"] else 0
            if args.command == "memory":
                return run_memory(args)
            if args.command == "bench":
                return run_bench(args)
            results = run_compare(options, getattr(args, "preset", None))
            return 130 if results[-1]["interrupted"] else 0
        except (ValueError, CorpusError, CheckpointError) as error:
            if first_process():  # under torchrun every process fails alike: say it once
                print(f"slimopt: error: {error}", file=sys.stderr)
            return 2
        except CheckpointWriteError as error:  # not bad input: the disk or the file system
            print(f"slimopt: error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # outside training steps (which finish theirs, save and stop)
            print(
                "slimopt: interrupted outside a training step; saved runs are as they were", file=sys.stderr
            )
            return 130
