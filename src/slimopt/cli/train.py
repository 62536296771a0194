"""``slimopt train`` and ``slimopt compare``: the flags of a run, the run's configuration from
a preset, a config file and the flags, and the work, which is ``slimopt.train``'s."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from slimopt.cli.options import DTYPE_HELP, OPTIMIZER_FLAGS, add_optimizer_flags, read_weight_dtype
from slimopt.layerwise import REFRESH_FROM
from slimopt.models import LLAMA_PRESETS
from slimopt.options import STORAGE_DEFAULTS
from slimopt.registry import OPTIMIZERS, resolve_name

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


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of a training run (``train``'s and ``compare``'s) to ``parser``."""
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
        "--eval-batches",
        type=int,
        help=f"validation batches of --batch-size sequences (default {defaults.eval_batches})",
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
    parser.add_argument("--dtype", type=read_weight_dtype, help=f"{DTYPE_HELP} (default fp32)")
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
    add_optimizer_flags(parser)


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
    if first_process():
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


def first_process() -> bool:
    """Whether this is the process that talks (the only one, or torchrun's rank 0)."""
    return os.environ.get("RANK", "0") == "0"
