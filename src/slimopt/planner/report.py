"""What the planner reports: a ``MemoryPlan`` (the peak, each term at the peak, what outlives a
step, the largest temporaries, per process), its printed breakdown and verdict, and its JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from slimopt.distributed.grad_sync import SyncBytes
from slimopt.planner.setting import PlanSetting
from slimopt.registry import rank_origin

TERMS = (
    "weights",
    "gradients",
    "optimizer_states",
    "projection_bases",
    "accumulation_buffers",
    "activations",
    "workspace",
)
# What a CUDA process needs beyond its tensors: the context (~0.5 GiB on recent GPUs), cuBLAS
# workspaces and the caching allocator's rounding and fragmentation.
CUDA_OVERHEAD_BYTES = 1 << 30


@dataclass
class MemoryPlan:
    """A predicted (or measured) training step. Bytes throughout.

    Attributes:
        setting: what was planned.
        parameters: the model's parameter count.
        peak_bytes: the largest count of live bytes over the planned steps.
        peak_at: which step and phase holds the peak.
        at_peak: each term (weights, gradients, states, bases, activations, workspace, …) at the
            moment of the peak.
        persistent: what outlives a step: weights, optimizer states, bases.
        refresh_workspace_bytes: the largest temporary of one projection refresh.
        update_workspace_bytes: the largest temporary of one parameter's update.
        step_peaks: the peak of each planned step.
        measured: whether the steps ran for real (``measure_memory``).
        device: where they ran.
        cuda_max_memory_allocated: on CUDA, the allocator's own peak.
        gpu_memory_bytes: the card's memory, when given.
        extra: further numbers of the run.
        per_process: under ``distributed``, process 0's terms and peak.
        grad_sync: under DDP and ZeRO-1, the bytes a process all-reduces per step, with full and
            with projected sync.
    """

    setting: PlanSetting
    parameters: int
    peak_bytes: int
    peak_at: str
    at_peak: dict[str, int]
    persistent: dict[str, int]
    refresh_workspace_bytes: int
    update_workspace_bytes: int
    step_peaks: list[int]
    measured: bool = False
    device: str = "meta"
    cuda_max_memory_allocated: int | None = None
    gpu_memory_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    per_process: dict[str, int] | None = None
    grad_sync: SyncBytes | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the peak (of the busiest process, in a multi-process plan) plus CUDA's own
        overhead fits the card (None: no card given)."""
        if self.gpu_memory_bytes is None:
            return None
        peak = self.peak_bytes if self.per_process is None else self.per_process["peak"]
        return peak + CUDA_OVERHEAD_BYTES <= self.gpu_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """Everything, as plain JSON-able values (the setting flat: ``PlanSetting.as_dict``),
        with ``fits`` added."""
        return {**asdict(self), "setting": self.setting.as_dict(), "fits": self.fits}

    def report(self) -> str:
        """A human-readable breakdown and verdict."""
        s = self.setting
        lines = [
            f"{s.model} ({self.parameters / 1e9:.2f}B parameters, {s.dtype} weights), "
            f"optimizer {s.optimizer}"
            + (f" rank {s.rank}" if s.rank else "")
            + (f" ({rank_origin(s.optimizer, False)})" if s.rank_defaulted else "")
            + (" layer-wise" if s.layerwise else "")
            + (" (refreshes from the first micro-batch)" if s.refresh_from == "micro_batch" else "")
            + f", {s.batch_size}×{s.seq_len} tokens × {s.accumulation_steps} micro-batches"
            + (", activation checkpointing" if s.checkpointing else ""),
            f"{'measured' if self.measured else 'predicted'} peak: {_size(self.peak_bytes)} ({self.peak_at})",
            "",
            "at the peak:",
        ]
        lines += [f"  {term.replace('_', ' '):<22}{_size(self.at_peak[term]):>12}" for term in TERMS]
        lines += [
            "",
            "between steps: "
            + ", ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in self.persistent.items()),
            f"largest temporaries: projection refresh {_size(self.refresh_workspace_bytes)}, "
            f"one parameter's update {_size(self.update_workspace_bytes)}",
        ]
        first_step_whole = s.layerwise and s.accumulation_steps > 1 and s.refresh_from == "step"
        if first_step_whole and self.peak_at.startswith("step 1") and self.at_peak["gradients"]:
            lines.append(
                "hint: the first step keeps each projected gradient whole until its first basis is "
                "computed; refresh_from='micro_batch' (--refresh-from micro_batch) keeps them r×n"
            )
        if self.cuda_max_memory_allocated is not None:
            lines.append(f"torch.cuda.max_memory_allocated: {_size(self.cuda_max_memory_allocated)}")
        peak = self.peak_bytes
        if self.per_process is not None:
            terms = self.per_process
            peak = terms["peak"]
            lines += [
                "",
                f"per process, {s.distributed} over {s.processes} processes (process 0, the busiest): "
                f"peak {_size(peak)}",
            ]
            lines += [
                f"  {term.replace('_', ' '):<22}{_size(value):>12}"
                for term, value in terms.items()
                if term not in ("peak", "state_between_steps")
            ]
            lines.append(
                f"optimizer state and bases kept between steps: {_size(terms['state_between_steps'])}"
            )
        if self.grad_sync is not None:
            lines.append(_sync_line(self.grad_sync, s.distributed))
        if self.gpu_memory_bytes is not None:
            verdict = "fits" if self.fits else "does not fit"
            lines.append(
                f"verdict: {verdict} in {self.gpu_memory_bytes / 2**30:g} GiB (needs "
                f"{_size(peak + CUDA_OVERHEAD_BYTES)} with 1 GiB for CUDA's context and allocator)"
            )
        return "\n".join(lines)


def _sync_line(sync: SyncBytes, strategy: str | None) -> str:
    """How many bytes each process all-reduces per step for the gradients."""
    line = f"gradient sync per step and process ({strategy}): full {_size(sync.full)}"
    if sync.per_step is None:
        return line
    fewer = sync.full / sync.per_step
    return (
        f"{line}; projected {_size(sync.per_step)} on average ({_size(sync.steady)} at a step that "
        f"refreshes no basis; a matrix is sent whole at its refreshes), {fewer:.1f}× fewer"
    )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def plan_as_json(plan: MemoryPlan) -> str:
    """The plan as indented JSON (``peak_bytes`` and every term in bytes)."""
    return json.dumps(plan.to_dict(), indent=1, default=str)
