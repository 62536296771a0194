"""The memory planner's predictions beside measured peaks, and the LLaMA-7B goal.

    python -m benchmarks.memory_planner                    # CPU: small models, exact live bytes
    python -m benchmarks.memory_planner --device cuda --llama-7b   # GPU: the 7B configurations
    python -m benchmarks.memory_planner --llama-7b --model llama_9m --rank 8   # the same path, small
    python -m benchmarks.memory_planner --llama-7b --predict   # only the planner's 7B breakdown

On the CPU the measured peak is the high-water mark of live tensor bytes of the same two training
steps the planner runs on the meta device, and, independently, the peak the CPU allocator saw
(torch.profiler's memory events). On CUDA it is ``torch.cuda.max_memory_allocated`` over
those steps; the script then trains the same configuration without any tracking for a few steps
to time the first step (which computes every projection basis) and the steady ones.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

from slimopt import build_optimizer, layerwise, state_nbytes
from slimopt.models import build_model
from slimopt.planner import measure_memory, plan_memory

GIB = 2**30
T = TypeVar("T")


def allocator_peak(run: Callable[[], T]) -> tuple[T, int]:
    """What ``run()`` returns, and the peak of bytes it allocated as the CPU allocator saw them
    (torch.profiler's memory events): a measurement independent of slimopt's LiveBytes."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = run()
    events, pending = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == torch._C._profiler._EventType.Allocation:
            events.append(event)
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_time_ns):
        live += event.extra_fields.alloc_size
        peak = max(peak, live)
    return result, peak


SMALL: dict[str, dict[str, Any]] = {
    "llama_20m adamw fp32, 8×256": dict(
        model="llama_20m", optimizer="adamw", batch_size=8, seq_len=256, dtype="fp32"
    ),
    "llama_20m galore_adamw8bit r64 layer-wise, 4×256": dict(
        model="llama_20m", optimizer="galore_adamw8bit", rank=64, layerwise=True, batch_size=4, seq_len=256
    ),
    "llama_35m galore_adamw_ternary r96 layer-wise ×2 accumulation, int8 bases": dict(
        model="llama_35m",
        optimizer="galore_adamw_ternary",
        rank=96,
        layerwise=True,
        accumulation_steps=2,
        basis_states="int8",
        batch_size=2,
        seq_len=256,
    ),
    "llama_35m adamw4bit, checkpointing, 4×256": dict(
        model="llama_35m", optimizer="adamw4bit", checkpointing=True, batch_size=4, seq_len=256
    ),
    "llama_60m galore_adamw r128 ×2 accumulation, fp32, 2×256": dict(
        model="llama_60m",
        optimizer="galore_adamw",
        rank=128,
        accumulation_steps=2,
        batch_size=2,
        seq_len=256,
        dtype="fp32",
    ),
    "llama_60m galore_adafactor r128 layer-wise, 4×256": dict(
        model="llama_60m", optimizer="galore_adafactor", rank=128, layerwise=True, batch_size=4, seq_len=256
    ),
}

# The goal: LLaMA-7B, bf16 weights, 1×256 tokens, layer-wise, GaLore rank 1024, T = 500.
LLAMA_7B: dict[str, dict[str, Any]] = {
    "ternary states, int8 bases": dict(optimizer="galore_adamw_ternary", basis_states="int8"),
    "ternary states, int8 bases, checkpointing": dict(
        optimizer="galore_adamw_ternary", basis_states="int8", checkpointing=True
    ),
    "int8 states, int8 bases": dict(optimizer="galore_adamw8bit", basis_states="int8"),
    "int8 states, fp32 bases": dict(optimizer="galore_adamw8bit"),
}
# Gradient accumulation (4 micro-batches of 1×256), planner only: refreshes from the whole step
# keep every projected gradient of the first step whole; from the first micro-batch, none.
LLAMA_7B_ACCUMULATION: dict[str, dict[str, Any]] = {
    "ternary states, int8 bases, ×4 accumulation": dict(
        optimizer="galore_adamw_ternary", basis_states="int8", accumulation_steps=4
    ),
    "ternary states, int8 bases, ×4 accumulation, refresh from micro-batch": dict(
        optimizer="galore_adamw_ternary",
        basis_states="int8",
        accumulation_steps=4,
        refresh_from="micro_batch",
    ),
}
LLAMA_7B_COMMON = dict(
    model="llama_7b",
    vocab_size=32000,
    rank=1024,
    layerwise=True,
    batch_size=1,
    seq_len=256,
    update_proj_gap=500,
)


def timed_steps(setting: dict[str, Any], device: torch.device, steps: int) -> dict[str, float]:
    """Seconds of the first step, of the projection refreshes inside it, and of a steady step
    (mean of the others) of a plain layer-wise loop; and the state bytes after them."""
    options = {k: v for k, v in setting.items() if k in ("rank", "basis_states", "update_proj_gap")}
    with torch.device(device):
        model = build_model(setting["model"], setting["vocab_size"], setting["seq_len"], weights="bf16")
    optimizer = build_optimizer(model, setting["optimizer"], lr=5e-3, **options)
    refresh_seconds: list[float] = []
    optimizer.engine.watch("refresh", _timer(refresh_seconds, device))
    handle = layerwise(optimizer)
    times, first_refresh = [], 0.0
    for _ in range(steps):
        batch = torch.randint(
            0, setting["vocab_size"], (setting["batch_size"], setting["seq_len"]), device=device
        )
        began = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        _synchronize(device)
        times.append(time.perf_counter() - began)
        if len(times) == 1:
            first_refresh = sum(refresh_seconds)
    handle.remove()
    return dict(
        first=times[0],
        first_refresh=first_refresh,
        steady=sum(times[1:]) / (len(times) - 1),
        state=state_nbytes(optimizer),
    )


def _timer(seconds: list[float], device: torch.device) -> Callable[[], Any]:
    """A probe for ``SlimoptOptimizer.watch`` that appends each call's seconds to ``seconds``."""

    @contextmanager
    def timed() -> Iterator[None]:
        _synchronize(device)
        began = time.perf_counter()
        yield
        _synchronize(device)
        seconds.append(time.perf_counter() - began)

    return timed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def llama_7b_runs(
    device: torch.device, steps: int, predict: bool = True, **overrides: Any
) -> Iterator[dict[str, Any]]:
    """Predicted and measured peaks, state bytes and step times of each ``LLAMA_7B`` configuration.

    ``overrides`` replace entries of ``LLAMA_7B_COMMON`` (a small model for a dry run);
    ``predict=False`` leaves the planner out (``predicted`` None), to save device time.
    """
    for name, extra in LLAMA_7B.items():
        setting = {**LLAMA_7B_COMMON, **overrides, **extra}
        predicted = plan_memory(**setting).peak_bytes if predict else None
        measured = measure_memory(**setting, device=device.type)
        cuda_peak, live_peak = measured.cuda_max_memory_allocated, measured.peak_bytes
        del measured
        gc.collect()  # the measured model and optimizer hold reference cycles (wrapped methods)
        timing = timed_steps(setting, device, steps)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield dict(name=name, predicted=predicted, cuda=cuda_peak, live=live_peak, **timing)


def llama_7b_row(run: dict[str, Any]) -> str:
    cuda, predicted = ("—" if run[k] is None else f"{run[k] / GIB:.2f}" for k in ("cuda", "predicted"))
    return (
        f"| {run['name']} | {predicted} | {cuda} | {run['live'] / GIB:.2f} | "
        f"{run['state'] / GIB:.2f} | {run['steady']:.3f} | {run['first']:.1f} | {run['first_refresh']:.1f} |"
    )


def llama_7b_predictions(**overrides: Any) -> Iterator[str]:
    """Table rows of the planner's breakdown (GiB) for the 7B configurations, without running them."""
    terms = ("weights", "gradients", "optimizer_states", "projection_bases", "accumulation_buffers")
    terms += ("activations", "workspace")
    for name, extra in {**LLAMA_7B, **LLAMA_7B_ACCUMULATION}.items():
        plan = plan_memory(**{**LLAMA_7B_COMMON, **overrides, **extra})
        between = plan.persistent["optimizer_states"] + plan.persistent["projection_bases"]
        cells = [f"{plan.peak_bytes / GIB:.2f}", plan.peak_at.split(",")[0]]
        cells += [f"{plan.at_peak[term] / GIB:.2f}" for term in terms] + [f"{between / GIB:.2f}"]
        yield f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--llama-7b", action="store_true", help="the 7B configurations (needs a large GPU)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per 7B configuration")
    parser.add_argument("--model", default="llama_7b", help="with --llama-7b: another preset, for a dry run")
    parser.add_argument("--rank", type=int, default=1024, help="with --llama-7b: the GaLore rank")
    parser.add_argument("--vocab-size", type=int, default=32000, help="with --llama-7b: the vocabulary")
    parser.add_argument(
        "--predict", action="store_true", help="with --llama-7b: the planner's breakdown only"
    )
    parser.add_argument(
        "--no-predict", action="store_true", help="with --llama-7b: measure only (saves device time)"
    )
    args = parser.parse_args()
    overrides = dict(model=args.model, rank=args.rank, vocab_size=args.vocab_size)
    if args.llama_7b and args.predict:
        print(
            "| configuration | peak | at | weights | gradients | states | bases | accumulation | activations "
            "| workspace | states + bases between steps |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in llama_7b_predictions(**overrides):
            print(row, flush=True)
        return
    if args.llama_7b:
        print(
            f"| {args.model}, layer-wise, r{args.rank} | predicted GiB | max_memory_allocated GiB "
            "| live bytes GiB | state GiB | step s | first step s | refreshes in it s |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for run in llama_7b_runs(torch.device(args.device), args.steps, not args.no_predict, **overrides):
            print(llama_7b_row(run), flush=True)
        return
    print(
        "| configuration (vocab 32000) | predicted bytes | measured bytes | error | allocator bytes "
        "| peak at |"
    )
    print("|---|---|---|---|---|---|")
    for name, setting in SMALL.items():
        predicted = plan_memory(**setting)
        measured, allocated = allocator_peak(partial(measure_memory, **setting, device=args.device))
        reference = measured.cuda_max_memory_allocated or measured.peak_bytes
        error = (predicted.peak_bytes - reference) / reference
        allocator = f"{allocated:,}" if args.device == "cpu" else "—"
        print(
            f"| {name} | {predicted.peak_bytes:,} | {reference:,} | {error:+.4%} | {allocator} "
            f"| {predicted.peak_at} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
