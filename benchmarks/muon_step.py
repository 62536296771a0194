"""Muon's optimizer step on a LLaMA preset's matrices (attention and MLP weights: what Muon
steps; embeddings, head and norms left out), ``torch.optim.Muon`` beside slimopt's Muon on the
reference path and on the fused path (on CUDA also with the Triton iteration), each from the
same gradients, interleaved step by step so that a busy machine slows them alike.

    OMP_NUM_THREADS=1 python -m benchmarks.muon_step [--model llama_60m] [--steps 15] [--states fp32]
    python -m benchmarks.muon_step --device cuda --model llama_1b --dtype bf16

prints a markdown table: the median and fastest step, and the median's ratio to torch's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import slimopt
from slimopt import kernels
from slimopt.models import LLAMA_PRESETS, build_model
from slimopt.train.bench import matrices_and_rest

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(LLAMA_PRESETS), default="llama_60m")
    parser.add_argument("--steps", type=int, default=15, help="timed steps of each (after 2 untimed)")
    parser.add_argument("--states", default="fp32", help="slimopt's momentum storage (default fp32)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the weights' dtype")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be a positive integer, got {args.steps}")
    device = torch.device(args.device)
    torch.manual_seed(0)
    matrices, _ = matrices_and_rest(build_model(args.model, 32000, 256))
    options = {"lr": 1e-3, "adjust_lr_fn": "match_rms_adamw"}
    slimopts = {"reference path": {"fused": False}, "fused": {"fused": True}}
    makers = {"torch.optim.Muon": lambda params: torch.optim.Muon(params, **options)}
    for path, fused in slimopts.items():
        makers[f"slimopt Muon, {path}"] = lambda params, fused=fused: slimopt.Muon(
            params, states=args.states, **fused, **options
        )
    if device.type == "cuda":
        makers["slimopt Muon, fused, Triton iteration"] = lambda params: _with_triton_iteration(
            slimopt.Muon(params, fused=True, states=args.states, **options)
        )
    optimizers = {}
    for label, make in makers.items():
        params = [torch.nn.Parameter(m.detach().to(device, DTYPES[args.dtype])) for m in matrices]
        for param in params:
            param.grad = torch.randn_like(param) * 1e-3
        optimizers[label] = make(params)
    seconds: dict[str, list[float]] = {label: [] for label in optimizers}
    for step in range(2 + args.steps):
        for label, optimizer in optimizers.items():
            _synchronize(device)
            began = time.perf_counter()
            optimizer.step()
            _synchronize(device)
            if step >= 2:
                seconds[label].append(time.perf_counter() - began)
    base = statistics.median(seconds["torch.optim.Muon"])
    threads = f"{torch.get_num_threads()} thread(s)"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else threads
    print(f"{args.model}'s {len(matrices)} {args.dtype} matrices, {where}, torch {torch.__version__}")
    print()
    print("| optimizer | median step s | fastest s | median / torch's |")
    print("|---|---|---|---|")
    for label, times in seconds.items():
        median = statistics.median(times)
        print(f"| {label} | {median:.4f} | {min(times):.4f} | {median / base:.3f} |")


def _with_triton_iteration(optimizer: slimopt.Muon) -> slimopt.Muon:
    """``optimizer`` with the Newton–Schulz iteration in slimopt's Triton kernels on CUDA."""
    optimizer.engine.use_fused_policy(kernels.FusedPolicy(iteration=("cuda",)))
    return optimizer


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
