"""Projected against full gradient sync under DDP: bytes, validation loss and time of the same run.

Each round trains the same model twice with ``slimopt train`` under ``torchrun`` (2 gloo
processes on this machine, one thread each), once with ``--grad-sync full`` and once with
``--grad-sync projected``, alternating which goes first; the table gives each run's gradient bytes
all-reduced per step by a process (``grad_sync_bytes``, summed over the steps), its final
validation loss and its steps' median time (from ``tokens_per_s`` of every logged step; a
step's time covers forward, backward, the synchronization and the optimizer step).

    python -m benchmarks.grad_sync [--model llama_20m] [--rank 32] [--steps 40] [--rounds 2]

The defaults are a LLaMA whose matrices dominate (hidden 256, 4 layers, a 512-token BPE
vocabulary), galore_adamw at rank n/8, no clipping (a clip would see different norms: see the
manual).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("full", "projected")


def train(mode: str, args: argparse.Namespace, out: Path) -> dict:
    """One ``slimopt train`` run under ``torchrun`` with ``--grad-sync mode``: its summary and
    its per-step records."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.processes}",
        "-m", "slimopt.cli", "train", "--distributed", "ddp", "--grad-sync", mode, "--device", "cpu",
        "--model", args.model, "--optimizer", args.optimizer, "--rank", str(args.rank),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--vocab-size", str(args.vocab_size), "--eval-every", str(args.steps), "--grad-clip", "0",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if finished.returncode != 0:
        raise RuntimeError(f"slimopt train --grad-sync {mode} failed:\n{finished.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "records": records}


def row(run: dict, args: argparse.Namespace) -> dict:
    """What the table shows of one run."""
    records, summary = run["records"], run["summary"]
    tokens = args.batch_size * args.seq_len
    return {
        "bytes": sum(r["grad_sync_bytes"] for r in records),
        "val_loss": summary["val_loss"],
        "step_s": statistics.median(tokens / r["tokens_per_s"] for r in records[1:]),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="llama_20m", help="preset (default llama_20m: hidden 256, 4 layers)"
    )
    parser.add_argument("--optimizer", default="galore_adamw")
    parser.add_argument("--rank", type=int, default=32, help="GaLore's rank (default 32: n/8)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running both modes (default 2)")
    parser.add_argument("--json", help="also write every run's figures as JSON here")
    args = parser.parse_args(argv)
    if min(args.rank, args.steps, args.batch_size, args.seq_len, args.processes, args.rounds) < 1:
        parser.error("--rank, --steps, --batch-size, --seq-len, --processes and --rounds must be positive")
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            order = MODES if index % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[mode].append(row(train(mode, args, Path(scratch) / f"{mode}-{index}"), args))
    full, projected = runs["full"], runs["projected"]
    print(f"{args.model}, {args.optimizer} rank {args.rank}, {args.steps} steps of {args.batch_size}×"
          f"{args.seq_len} tokens, {args.processes} gloo processes, {args.rounds} rounds")  # fmt: skip
    print("| round | full: bytes | projected: bytes | ratio | full: val loss | projected: val loss | "
          "relative | full: step s | projected: step s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for index, (f, p) in enumerate(zip(full, projected, strict=True), start=1):
        relative = abs(p["val_loss"] - f["val_loss"]) / f["val_loss"]
        losses = f"{f['val_loss']:.6f} | {p['val_loss']:.6f} | {relative:.1e}"
        print(
            f"| {index} | {f['bytes']:,} | {p['bytes']:,} | {f['bytes'] / p['bytes']:.2f} | {losses} | "
            f"{f['step_s']:.3f} | {p['step_s']:.3f} |"
        )
    medians = [statistics.median(run["step_s"] for run in runs[mode]) for mode in MODES]
    print(f"median step over the rounds: full {medians[0]:.4f} s, projected {medians[1]:.4f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return runs


if __name__ == "__main__":
    main()
