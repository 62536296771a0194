"""Should the fused step be the CPU default? For each optimizer, the reference path
(``fused=False``) against the fused step (``fused=True``) on the CPU: the first step (the fused
one compiles there, each row in a fresh process with an empty Inductor cache, so the compile is
counted whole), the median steady step, and how far a steady step raises the process's
resident memory (its high-water mark reset first), measured in a second process whose glibc
mmap threshold is fixed at 64 KiB, so that freed buffers leave the process and the mark follows
what the step allocates: slimopt's tensors, a compiled step's buffers, anything else.

Parameters are a LLaMA preset's (``benchmarks.refresh_speed.llama_parameters``) with random
gradients, as ``benchmarks.state_storage`` steps them.

    python -m benchmarks.cpu_fused_default [--model llama_60m] [--threads 1] [--optimizers adamw,adamw8bit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

# torch_adamw: torch.optim.AdamW(foreach=True), the yardstick (one row, no fused choice).
OPTIMIZERS = ("torch_adamw", "adamw", "adamw8bit", "adamw_ternary", "adafactor")


def one_row(model_name: str, name: str, fused: bool, steps: int) -> dict[str, float]:
    """The first step's seconds, the median of ``steps`` steady ones, and the bytes a steady
    step adds to the resident set at its peak, in this process (Linux)."""
    from benchmarks.state_storage import parameters_with_gradients
    from slimopt import build_optimizer

    model = parameters_with_gradients(model_name, "cpu")
    if name == "torch_adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    else:
        optimizer = build_optimizer(model, name, lr=1e-3, fused=fused)
    start = time.perf_counter()
    optimizer.step()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident size
    before = _status_bytes("VmRSS")
    optimizer.step()
    return {"first": first, "steady": statistics.median(times), "temporary": _status_bytes("VmHWM") - before}


def _status_bytes(field: str) -> int:
    """A size field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_60m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--row", nargs=2, metavar=("NAME", "FUSED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row is not None:  # one row, in a process of its own
        print(json.dumps(one_row(args.model, args.row[0], args.row[1] == "True", args.steps)))
        return
    print(f"{args.model}, {args.threads} thread(s), torch {torch.__version__}, seconds and MiB")
    print("| optimizer | path | first step | steady step | steady step: peak resident growth |")
    print("|---|---|---:|---:|---:|")
    for name in args.optimizers.split(","):
        for fused in (False,) if name == "torch_adamw" else (False, True):
            with tempfile.TemporaryDirectory() as cache:
                row = _row_process(args, name, fused, {"TORCHINDUCTOR_CACHE_DIR": cache})
                # Memory in a second process (the compiled step cached by then): a fixed mmap
                # threshold slows the reference path's many temporaries, so no timing there.
                memory = _row_process(
                    args, name, fused, {"TORCHINDUCTOR_CACHE_DIR": cache, "MALLOC_MMAP_THRESHOLD_": "65536"}
                )
            row["temporary"] = memory["temporary"]
            path = "torch" if name == "torch_adamw" else "fused" if fused else "reference"
            print(
                f"| {name} | {path} | {row['first']:.2f} | {row['steady']:.3f} | "
                f"{row['temporary'] / 2**20:.1f} |",
                flush=True,
            )


def _row_process(args: argparse.Namespace, name: str, fused: bool, environment: dict[str, str]) -> dict:
    """``one_row`` in a fresh process with ``environment`` added."""
    command = [sys.executable, "-m", "benchmarks.cpu_fused_default", "--model", args.model]
    command += ["--steps", str(args.steps), "--row", name, str(fused)]
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **environment}
    output = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return json.loads(output.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
