"""``slimopt memory``: predict (or measure) the memory of a training step."""

from __future__ import annotations

import argparse

from slimopt.cli.options import DTYPE_HELP, OPTIMIZER_FLAGS, add_optimizer_flags, read_weight_dtype
from slimopt.distributed import STRATEGIES
from slimopt.distributed.grad_sync import GRAD_SYNCS
from slimopt.layerwise import REFRESH_FROM
from slimopt.models import LLAMA_PRESETS
from slimopt.registry import available_optimizers


def add_memory_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``slimopt memory``'s flags to ``parser``."""
    parser.add_argument(
        "--model", required=True, help=f"preset ({', '.join(LLAMA_PRESETS)}) or a Hugging Face config path"
    )
    parser.add_argument("--optimizer", required=True, help=f"one of: {', '.join(available_optimizers())}")
    parser.add_argument(
        "--batch-size",
        "--batch",
        dest="batch",
        type=int,
        default=1,
        help="sequences per micro-batch (default 1)",
    )
    parser.add_argument(
        "--seq-len", "--seq", dest="seq", type=int, default=256, help="tokens per sequence (default 256)"
    )
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
    parser.add_argument(
        "--dtype", type=read_weight_dtype, default="bf16", help=f"{DTYPE_HELP} (default bf16)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="vocabulary (default: the model's own; 32000 for the LLaMA presets, 128256 for llama3_8b)",
    )
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
        "--grad-sync",
        choices=GRAD_SYNCS,
        default="auto",
        help="with --distributed ddp or zero1: how the gradients are synchronized (the bytes of "
        "both are printed; under zero1 projected sync keeps every basis on every process); default auto",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the plan as JSON (bytes, peak in peak_bytes)"
    )
    parser.add_argument(
        "--measure", metavar="DEVICE", help="run the step for real on cpu or cuda instead of predicting it"
    )
    add_optimizer_flags(parser)


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
        "grad_sync": args.grad_sync,
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
