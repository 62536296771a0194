"""``slimopt`` command line: argument parsing only; the work is in ``slimopt.train``.

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
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

from slimopt import __version__
from slimopt.distributed import STRATEGIES
from slimopt.layerwise import REFRESH_FROM
from slimopt.options import PROJECTION_DEFAULTS, STORAGE_DEFAULTS
from slimopt.registry import OPTIMIZERS, OPTION_TYPES, available_optimizers, parse_option, resolve_name
from slimopt.train.config import read_config_file
from slimopt.train.models import LLAMA_PRESETS
from slimopt.weight_formats import weight_dtype

# Flags that configure the optimizer rather than the run, with their types (``stagger``, a
# boolean that is on by default, is left to config files and the Python API; ``fused`` is
# --fused / --no-fused, left out meaning auto).
OPTIMIZER_FLAGS: dict[str, type] = {
    **{name: kind for name, kind in OPTION_TYPES.items() if kind is not bool},
    "weight_decay": float,
    "fused": bool,
}

# The README's main command (the demo): three optimizers on the built-in corpus in minutes on two CPU cores.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {
        "optimizers": "adamw,galore_adamw,galore_adamw8bit,galore_adamw_ternary",
        "model": "llama_9m",
        "vocab_size": 4096,
        "steps": 150,
        "batch_size": 16,
        "seq_len": 128,
        "lr": 3e-3,
        "rank": 64,
        "update_proj_gap": 50,
        "eval_every": 50,
        "eval_batches": 8,
    }
}
# Loggers of packages that transformers imports when they are installed (torchao through its
# quantizers), which report at import time on kernels for other hardware: not slimopt's business.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
# "--lr -1e-3": argparse takes a value that starts with "-" and is no plain decimal for a flag.
NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


DTYPE_HELP = (
    "how the weights are stored: fp32, bf16, bf16+8 (bf16 and an 8-bit correction, 24 bits) or "
    "int8 (linear weights as int8 codes, stochastic rounding; the rest bf16)"
)


def _weight_dtype(text: str) -> str:
    try:
        return weight_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class Parser(argparse.ArgumentParser):
    """argparse with every error on one line (``slimopt: error: …``, exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"slimopt: error: {message}\n")


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


def _run_flags(parser: argparse.ArgumentParser) -> None:
    from slimopt.train.config import DEVICES, TrainConfig

    defaults = TrainConfig()
    parser.add_argument("--config", help="YAML or TOML file with any of these options")
    parser.add_argument("--model", help=f"preset ({', '.join(LLAMA_PRESETS)}) or a Hugging Face config path")
    parser.add_argument(
        "--data", help="shakespeare (default), a .txt/.md/.jsonl file or directory, or hf:NAME[:CONFIG]"
    )
    parser.add_argument(
        "--tokenizer", help="Hugging Face tokenizer name or path (default: BPE trained on the data)"
    )
    parser.add_argument("--vocab-size", type=int, help=f"BPE vocabulary (default {defaults.vocab_size})")
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {defaults.steps})")
    parser.add_argument("--batch-size", type=int, help=f"sequences per step (default {defaults.batch_size})")
    parser.add_argument(
        "--micro-batch-size", type=int, help="sequences per forward pass (gradient accumulation)"
    )
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {defaults.seq_len})")
    parser.add_argument("--lr", type=float, help=f"peak learning rate (default {defaults.lr})")
    parser.add_argument(
        "--warmup", type=float, help="warm-up steps, or a fraction of the steps if < 1 (default 0.1)"
    )
    parser.add_argument(
        "--grad-clip", type=float, help="global gradient-norm clip, 0 to disable (default 1.0)"
    )
    parser.add_argument(
        "--eval-every", type=int, help="steps between validations (default: a tenth of --steps)"
    )
    parser.add_argument(
        "--eval-batches", type=int, help=f"validation batches (default {defaults.eval_batches})"
    )
    parser.add_argument("--save-every", type=int, help="steps between checkpoints (default: only at the end)")
    parser.add_argument(
        "--out",
        help="run directory (default: a new runs/<model>-<optimizer>-<time>, printed at start and end)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="replace a run already in --out (default: refuse)",
    )
    parser.add_argument(
        "--device", choices=DEVICES, help="auto (CUDA when available; the default), cpu or cuda"
    )
    parser.add_argument("--seed", type=int, help="random seed (default 0)")
    parser.add_argument("--bf16", action="store_true", default=None, help="bf16 autocast")
    parser.add_argument("--dtype", type=_weight_dtype, help=f"{DTYPE_HELP} (default fp32)")
    parser.add_argument("--checkpointing", action="store_true", default=None, help="activation checkpointing")
    parser.add_argument(
        "--layerwise",
        action="store_true",
        default=None,
        help="update each parameter inside backward and free its gradient (clipping becomes per tensor)",
    )
    parser.add_argument(
        "--refresh-from",
        choices=REFRESH_FROM,
        help="with --layerwise: compute projection refreshes from the whole step's gradient (step, "
        "the default) or from its first micro-batch's (micro_batch: no projected gradient kept whole)",
    )
    parser.add_argument("--max-documents", type=int, help="read at most this many documents (default: all)")
    _optimizer_flags(parser)


def _optimizer_flags(parser: argparse.ArgumentParser) -> None:
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
    _run_flags(train)
    compare = commands.add_parser("compare", help="train the same model with several optimizers and compare")
    compare.add_argument("--optimizers", help="comma-separated names; the first is the reference")
    compare.add_argument("--preset", choices=list(PRESETS), help="a ready-made comparison")
    _run_flags(compare)
    memory = commands.add_parser("memory", help="predict (or measure) the memory of a training step")
    _memory_flags(memory)
    bench = commands.add_parser("bench", help="time training and optimizer steps beside the references")
    _bench_flags(bench)
    return parser


def _bench_flags(parser: argparse.ArgumentParser) -> None:
    from slimopt.train.bench import DEFAULT, REFERENCES
    from slimopt.train.config import DEVICES

    parser.add_argument(
        "--model", default="llama_60m", choices=list(LLAMA_PRESETS), help="preset (default llama_60m)"
    )
    parser.add_argument(
        "--optimizers",
        default=DEFAULT,
        help=f"comma-separated slimopt names and references ({', '.join(REFERENCES)}); default {DEFAULT}",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="auto", help="auto (CUDA when available), cpu or cuda"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--rank", type=int, help="GaLore rank (default: a quarter of the smaller side)")
    parser.add_argument(
        "--dtype", type=_weight_dtype, help=f"{DTYPE_HELP} (default: bf16 on CUDA, fp32 on the CPU)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run_bench(args: argparse.Namespace) -> int:
    """Print the table (and write JSON); optimizers that cannot run here are named on stderr."""
    from slimopt.train.bench import available, bench, heading, table, write_json
    from slimopt.train.config import resolve_device

    setting = {key: getattr(args, key) for key in ("model", "dtype", "batch", "seq", "steps", "warmup")}
    device = resolve_device(args.device)
    names, skipped = available(
        [n.strip() for n in args.optimizers.split(",") if n.strip()], device, args.dtype
    )
    for reason in skipped:
        print(f"slimopt: skipping {reason}", file=sys.stderr)
    progress = lambda name: print(f"slimopt: measuring {name}", file=sys.stderr)  # noqa: E731
    rows = bench(names, device=device, rank=args.rank, progress=progress, **setting)
    print(table(rows, heading({**setting, "device": device})))
    if args.json:
        print(
            f"slimopt: wrote {write_json(rows, {**setting, 'device': str(device)}, args.json)}",
            file=sys.stderr,
        )
    return 0


def _memory_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help=f"preset ({', '.join(LLAMA_PRESETS)}) or a Hugging Face config path"
    )
    parser.add_argument("--optimizer", required=True, help=f"one of: {', '.join(available_optimizers())}")
    parser.add_argument("--batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches per optimizer step (default 1)"
    )
    parser.add_argument("--layerwise", action="store_true", help="layer-wise updates (slimopt.layerwise)")
    parser.add_argument(
        "--refresh-from",
        choices=REFRESH_FROM,
        default="step",
        help="with --layerwise: refreshes from the step's gradient (default) or its first micro-batch's",
    )
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--dtype", type=_weight_dtype, default="bf16", help=f"{DTYPE_HELP} (default bf16)")
    parser.add_argument("--vocab-size", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--gpu-memory", type=float, help="the card's memory in GiB, for a verdict")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes of a multi-GPU run (default 1; needs --distributed)",
    )
    parser.add_argument(
        "--distributed", choices=STRATEGIES, help="how the processes share the work: ddp, zero1 or fsdp2"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the plan as JSON (bytes, peak in peak_bytes)"
    )
    parser.add_argument(
        "--measure", metavar="DEVICE", help="run the step for real on cpu or cuda instead of predicting it"
    )
    _optimizer_flags(parser)


def run_memory(args: argparse.Namespace) -> int:
    """Print the plan; return 1 when it does not fit the given card."""
    from slimopt.planner import measure_memory, plan_as_json, plan_memory

    options = {k: getattr(args, k) for k in OPTIMIZER_FLAGS if getattr(args, k) is not None}
    setting = {
        "batch_size": args.batch,
        "seq_len": args.seq,
        "accumulation_steps": args.accumulation,
        "layerwise": args.layerwise,
        "refresh_from": args.refresh_from,
        "checkpointing": args.checkpointing,
        "dtype": args.dtype,
        "vocab_size": args.vocab_size,
        "gpu_memory_gib": args.gpu_memory,
        "processes": args.processes,
        "distributed": args.distributed,
        **options,
    }
    if args.measure is not None:
        if args.measure not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {args.measure!r} for --measure; valid: cpu, cuda")
        if args.measure == "cuda" and not __import__("torch").cuda.is_available():
            raise ValueError("--measure cuda: no CUDA device is available")
        plan = measure_memory(args.model, args.optimizer, device=args.measure, progress=True, **setting)
    else:
        plan = plan_memory(args.model, args.optimizer, progress=True, **setting)
    print(plan_as_json(plan) if args.json else plan.report())
    return 1 if plan.fits is False else 0


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Preset, then config file, then flags given on the command line (later ones win)."""
    options: dict[str, Any] = dict(PRESETS[args.preset]) if getattr(args, "preset", None) else {}
    if getattr(args, "config", None):
        options |= read_config_file(args.config)
    options |= {
        k: v for k, v in vars(args).items() if v is not None and k not in ("command", "config", "preset")
    }
    return options


def make_config(options: dict[str, Any], optimizer: str | None = None, *, strict: bool = True):
    """A ``TrainConfig`` from resolved options; raises ``ValueError`` naming a bad value.

    ``strict=False`` (compare) lets projection options pass for the optimizers that do not project,
    and leaves a name with a rank of its own (``apollo_mini``) at that rank."""
    from slimopt.train.config import TrainConfig

    names = {f.name for f in fields(TrainConfig)} - {"optimizer_options", "optimizer"}
    unknown = sorted(set(options) - names - set(OPTIMIZER_FLAGS) - {"optimizers", "optimizer"})
    if unknown:
        valid = ", ".join(sorted(names | set(OPTIMIZER_FLAGS)))
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; valid: {valid}")
    name = optimizer or options.get("optimizer", "adamw")
    name = resolve_name(name)
    model = options.get("model")
    if model is not None and model not in LLAMA_PRESETS and not Path(model).exists():
        raise ValueError(
            f"unknown model {model!r}; valid: {', '.join(LLAMA_PRESETS)} or a Hugging Face config path"
        )
    run = {k: v for k, v in options.items() if k in names}
    extras = {k: v for k, v in options.items() if k in OPTIMIZER_FLAGS}
    if not OPTIMIZERS[name].projected:
        projection = sorted(k for k in extras if k not in STORAGE_DEFAULTS and k != "weight_decay")
        if projection and strict:
            flags = ", ".join("--" + k.replace("_", "-") for k in projection)
            galore = ", ".join(n for n, spec in OPTIMIZERS.items() if spec.projected)
            raise ValueError(
                f"{name!r} does not project gradients, so it takes no {flags}; projecting: {galore}"
            )
        extras = {k: v for k, v in extras.items() if k not in projection}
    if not strict and OPTIMIZERS[name].rank is not None:
        # A comparison's shared rank is GaLore's; APOLLO-Mini keeps its own (at another it is not Mini).
        extras.pop("rank", None)
    return TrainConfig(optimizer=name, optimizer_options=extras, **run)


def run_train(options: dict[str, Any]) -> dict[str, Any]:
    from slimopt.train.loop import train
    from slimopt.train.report import describe
    from slimopt.train.rundir import run_directory

    if options.get("resume"):
        # Continue the run as it was configured; flags given now override its config.json.
        run = run_directory(options["resume"])
        saved = run / "config.json"
        if saved.is_file():
            base = json.loads(saved.read_text())
            for key in ("resume", "out"):  # a run continues in its own directory, wherever it is now
                base.pop(key, None)
            options = {**base.pop("optimizer_options", {}), **base, **options}
        options.setdefault("out", str(run))
    summary = train(make_config(options))
    if _first_process():
        print(describe(summary))
    return summary


def run_compare(options: dict[str, Any], preset: str | None) -> list[dict[str, Any]]:
    from slimopt.train.compare import compare
    from slimopt.train.rundir import default_out

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "slimopt compare trains in one process; under torchrun run slimopt train, once per optimizer"
        )
    names = [n.strip() for n in str(options.pop("optimizers", "adamw,galore_adamw")).split(",") if n.strip()]
    out = Path(options.pop("out", None) or default_out(preset or "compare"))
    # Every run is checked before the first one starts (a comparison stopped halfway is not mixed).
    configs = [
        make_config({**options, "out": str(out / name), "overwrite": False}, optimizer=name, strict=False)
        for name in names
    ]
    return compare(configs, out, overwrite=bool(options.get("overwrite")))


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
            if _first_process():  # under torchrun every process fails alike: say it once
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


def _first_process() -> bool:
    """Whether this is the process that talks (the only one, or torchrun's rank 0)."""
    return os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    sys.exit(main())
