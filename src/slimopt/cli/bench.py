"""``slimopt bench``: time training and optimizer steps beside the reference optimizers."""

from __future__ import annotations

import argparse
import sys

from slimopt.cli.options import DTYPE_HELP, read_weight_dtype
from slimopt.models import LLAMA_PRESETS


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``slimopt bench``'s flags to ``parser``."""
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
    parser.add_argument(
        "--batch-size", "--batch", dest="batch", type=int, default=8, help="sequences per step (default 8)"
    )
    parser.add_argument(
        "--seq-len", "--seq", dest="seq", type=int, default=256, help="tokens per sequence (default 256)"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--rank", type=int, help="GaLore rank (default: a quarter of the smaller side)")
    parser.add_argument(
        "--dtype", type=read_weight_dtype, help=f"{DTYPE_HELP} (default: bf16 on CUDA, fp32 on the CPU)"
    )
    parser.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        help="slimopt's optimizers take their fused steps, or not (default: auto, on CUDA)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run_bench(args: argparse.Namespace) -> int:
    """Print the table (and write JSON); optimizers that cannot run here are named on stderr."""
    from slimopt.train.bench import available, bench, heading, table, write_json
    from slimopt.train.config import resolve_device

    keys = ("model", "dtype", "batch", "seq", "steps", "warmup", "fused")
    setting = {key: getattr(args, key) for key in keys}
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
