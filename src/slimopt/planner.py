"""The memory planner: will a training step fit on this card, and where do the bytes go?

``plan_memory`` builds the model and the optimizer on the meta device (shapes and dtypes, no
memory, no arithmetic) and runs two real optimizer steps of them — forward, backward, then the
optimizer step or the layer-wise hooks — under ``slimopt.memory.LiveBytes``. Every tensor the
real run creates is created here too, by the same code: weights, gradients, optimizer states,
projection bases, accumulation buffers and the optimizer's temporaries are therefore exact.
Activations are exact for the code that runs on the meta device; the one known difference from
a GPU is attention, where the planner runs the flash-attention path that PyTorch takes on CPU and
CUDA. ``measure_memory`` runs the same two steps for real on the CPU or a GPU (where it also
reads ``torch.cuda.max_memory_allocated``), which is how the planner is checked.

Two steps, because the first one differs: it creates the optimizer states and computes every
projection basis; the second is a steady step (with ``stagger``, a few matrices refresh in it).
The peak is the larger of the two.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slimopt import models
from slimopt.checks import number
from slimopt.core.state import is_basis_key
from slimopt.distributed import STRATEGIES as PROCESS_STRATEGIES
from slimopt.distributed import strategy_error
from slimopt.layerwise import check_refresh_from, layerwise
from slimopt.memory import LiveBytes, storage_nbytes, storages
from slimopt.meta_run import MetaRun
from slimopt.process_memory import parameter_bytes, per_process
from slimopt.registry import OPTIMIZERS, build_optimizer, rank_origin, resolve_name
from slimopt.targets import projected_weights
from slimopt.weight_formats import optimizer_options, weight_dtype

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
STEPS = 2


@dataclass
class MemoryPlan:
    """A predicted (or measured) training step. Bytes throughout."""

    setting: dict[str, Any]
    parameters: int
    peak_bytes: int
    peak_at: str  # which step and phase holds the peak
    at_peak: dict[str, int]  # each term of TERMS at the moment of the peak
    persistent: dict[str, int]  # what outlives a step: weights, optimizer states, bases
    refresh_workspace_bytes: int  # largest temporary of one projection refresh
    update_workspace_bytes: int  # largest temporary of one parameter's update
    step_peaks: list[int]
    measured: bool = False
    device: str = "meta"
    cuda_max_memory_allocated: int | None = None
    gpu_memory_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    per_process: dict[str, int] | None = None  # process 0's terms and peak under ``distributed``

    @property
    def fits(self) -> bool | None:
        """Whether the peak (of the busiest process, in a multi-process plan) plus CUDA's own
        overhead fits the card (None: no card given)."""
        if self.gpu_memory_bytes is None:
            return None
        peak = self.peak_bytes if self.per_process is None else self.per_process["peak"]
        return peak + CUDA_OVERHEAD_BYTES <= self.gpu_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """Everything, as plain JSON-able values, with ``fits`` added."""
        return {**asdict(self), "fits": self.fits}

    def report(self) -> str:
        """A human-readable breakdown and verdict."""
        s = self.setting
        lines = [
            f"{s['model']} ({self.parameters / 1e9:.2f}B parameters, {s['dtype']} weights), "
            f"optimizer {s['optimizer']}"
            + (f" rank {s['rank']}" if s.get("rank") else "")
            + (f" ({rank_origin(s['optimizer'], False)})" if s.get("rank_defaulted") else "")
            + (" layer-wise" if s["layerwise"] else "")
            + (" (refreshes from the first micro-batch)" if s["refresh_from"] == "micro_batch" else "")
            + f", {s['batch_size']}×{s['seq_len']} tokens × {s['accumulation_steps']} micro-batches"
            + (", activation checkpointing" if s["checkpointing"] else ""),
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
        first_step_whole = s["layerwise"] and s["accumulation_steps"] > 1 and s["refresh_from"] == "step"
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
                f"per process, {s['distributed']} over {s['processes']} processes (process 0, the busiest): "
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
        if self.gpu_memory_bytes is not None:
            verdict = "fits" if self.fits else "does not fit"
            lines.append(
                f"verdict: {verdict} in {self.gpu_memory_bytes / 2**30:g} GiB (needs "
                f"{_size(peak + CUDA_OVERHEAD_BYTES)} with 1 GiB for CUDA's context and allocator)"
            )
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def plan_memory(
    model: str,
    optimizer: str,
    *,
    rank: int | None = None,
    layerwise: bool = False,
    refresh_from: str = "step",
    batch_size: int = 1,
    seq_len: int = 256,
    accumulation_steps: int = 1,
    checkpointing: bool = False,
    dtype: str = "bf16",
    vocab_size: int = 32000,
    gpu_memory_gib: float | None = None,
    processes: int = 1,
    distributed: str | None = None,
    device: str = "meta",
    progress: bool = False,
    **optimizer_options: Any,
) -> MemoryPlan:
    """Predict the memory of training ``model`` with ``optimizer`` (a registry name).

    ``model`` is a LLaMA preset (``slimopt.models.LLAMA_PRESETS``) or a Hugging Face config
    file or directory; ``dtype`` is how the weights are stored (``slimopt.weight_formats``:
    "fp32", "bf16", "bf16+8" — bf16 and an 8-bit correction, which the optimizer keeps in its
    state and the plan counts there — or
    "int8" linear weights with the rest bf16); ``batch_size`` sequences
    of ``seq_len`` tokens per micro-batch, ``accumulation_steps`` micro-batches per step;
    ``refresh_from`` is ``slimopt.layerwise``'s option of that name. With ``distributed``
    ("ddp", "zero1" or "fsdp2") the plan also holds, in ``per_process``, the step of the busiest
    of ``processes`` processes (``slimopt.process_memory``), and ``fits`` judges that one.
    ``optimizer_options`` go to ``build_optimizer`` (``states``, ``update_proj_gap``, …). On a
    real ``device`` the steps run for real and the plan is a measurement (see ``measure_memory``).
    ``progress`` shows a bar of the micro-batches on stderr (a 7B plan takes seconds:
    docs/results/memory.md).
    Raises ``ValueError`` naming a bad model, optimizer, size, dtype or rank.
    """
    setting = _setting({k: v for k, v in locals().items() if k not in ("device", "progress")})
    return _run(setting, optimizer_options, torch.device(device), progress)


def measure_memory(model: str, optimizer: str, *, device: str = "cpu", **settings: Any) -> MemoryPlan:
    """Run the planner's two steps for real on ``device`` and report what they used.

    Same arguments as :func:`plan_memory`. On CUDA ``cuda_max_memory_allocated`` holds the
    allocator's own peak over the same steps.
    """
    return plan_memory(model, optimizer, device=device, **settings)


def _setting(arguments: dict[str, Any]) -> dict[str, Any]:
    setting = {k: v for k, v in arguments.items() if k != "optimizer_options"}
    model, name = setting["model"], setting["optimizer"]
    if model not in models.LLAMA_PRESETS and not Path(model).exists():
        raise ValueError(
            f"unknown model {model!r}; valid: {', '.join(models.LLAMA_PRESETS)} or a Hugging Face config path"
        )
    setting["optimizer"] = resolve_name(name)
    for key in ("batch_size", "seq_len", "accumulation_steps", "vocab_size"):
        value = setting[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{key.replace('_', ' ')} must be a positive integer, got {value!r}")
    setting["dtype"] = weight_dtype(setting["dtype"])
    gpu = setting["gpu_memory_gib"]
    found = number(gpu)
    if gpu is not None and (found is None or found <= 0):
        raise ValueError(f"gpu memory must be a finite positive number of GiB, got {gpu!r}")
    check_refresh_from(setting["refresh_from"], setting["layerwise"], "set layerwise (--layerwise)")
    rank = setting["rank"]
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    processes, strategy = setting["processes"], setting["distributed"]
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive integer, got {processes!r}")
    if strategy is not None and strategy not in PROCESS_STRATEGIES:
        raise ValueError(f"unknown distributed {strategy!r}; valid: {', '.join(PROCESS_STRATEGIES)}")
    if processes > 1 and strategy is None:
        raise ValueError(
            f"{processes} processes: say how they share the work (distributed: ddp, zero1 or fsdp2)"
        )
    error = strategy_error(strategy, weights=setting["dtype"], layerwise=setting["layerwise"])
    if error is not None:  # what training refuses is not planned
        what = f"dtype {setting['dtype']}" if error[0] == "weights" else "layerwise"
        raise ValueError(f"{what} with distributed {strategy}: {error[1]}")
    return setting


def build_model(setting: dict[str, Any], device: torch.device) -> nn.Module:
    """The model of a planner ``setting`` (``model``, ``vocab_size``, ``seq_len``, ``dtype``,
    ``checkpointing``) on ``device``, built directly in its dtype and in training mode
    (``slimopt.models.build_model``)."""
    with torch.device(device):
        return models.build_model(
            setting["model"],
            setting["vocab_size"],
            setting["seq_len"],
            weights=setting["dtype"],
            checkpointing=setting["checkpointing"],
        )


def _check_rank(model: nn.Module, setting: dict[str, Any], options: dict[str, Any]) -> None:
    rank = setting["rank"]
    if rank is None or not OPTIMIZERS[setting["optimizer"]].projected:
        return
    for name, weight in projected_weights(model, options.get("target_modules")).items():
        shape = weight.shape[-2:]  # an expert's matrix, for stacked experts
        if rank > min(shape):
            raise ValueError(
                f"rank {rank} is larger than the matrix {name} ({shape[0]}×{shape[1]}); "
                f"valid ranks: 1 to {min(shape)}"
            )


def _run(
    setting: dict[str, Any], options: dict[str, Any], device: torch.device, progress: bool = False
) -> MemoryPlan:
    torch.manual_seed(0)
    model = build_model(setting, device)
    _check_rank(model, setting, options)
    projection = {"rank": setting["rank"]} if setting["rank"] is not None else {}
    storage = optimizer_options(setting["dtype"], options)
    optimizer = build_optimizer(model, setting["optimizer"], lr=1e-3, **projection, **options, **storage)
    k = setting["accumulation_steps"]
    handle = layerwise(optimizer, k, refresh_from=setting["refresh_from"]) if setting["layerwise"] else None
    params = list(model.parameters())
    weights = params + list(model.buffers())

    def categorize() -> dict[str, int]:
        """Bytes of each term among the storages live now."""
        return _terms(tracker, _known_tensors(params, weights, optimizer, handle))

    position = {"step": 1}
    snapshot: dict[str, Any] = {}

    def on_peak() -> None:
        snapshot.update(terms=categorize(), step=position["step"], phase=tracker.tag)

    tracker = LiveBytes(on_peak)
    tracker.adopt(weights)
    workspace = {"refresh": 0, "update": 0}
    for phase in ("refresh", "update"):
        optimizer.engine.watch(phase, _window(tracker, workspace, phase))
    cuda_base = _cuda_start(device, weights)
    step_peaks = []
    # One unit per micro-batch's forward and backward, and one per optimizer step.
    bar = _progress_bar(progress, STEPS * (k + 1), "measuring" if device.type != "meta" else "planning")
    with tracker, MetaRun(device):
        for step in range(1, STEPS + 1):
            position["step"] = step
            for _ in range(k):
                _forward_backward(model, setting, device, tracker)
                bar.update(1)
            if handle is None:
                tracker.tag = "optimizer"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            bar.update(1)
            step_peaks.append(tracker.peak)
    bar.close()
    cuda_peak = None if cuda_base is None else torch.cuda.max_memory_allocated(device) - cuda_base
    if handle is not None:
        handle.remove()
    between_steps = categorize()
    at_peak = {term: snapshot["terms"][term] for term in TERMS}
    processes = None
    if setting["distributed"] is not None:
        parameters = parameter_bytes(model, optimizer)
        processes = per_process(at_peak, parameters, setting["distributed"], setting["processes"])
    return MemoryPlan(
        setting={**_with_chosen_rank(setting, optimizer), **options},
        parameters=sum(p.numel() for p in params),
        peak_bytes=tracker.peak,
        peak_at=f"step {snapshot['step']}, {_phase_name(snapshot['phase'], handle is not None)}",
        at_peak=at_peak,
        persistent={
            term: between_steps[term] for term in ("weights", "optimizer_states", "projection_bases")
        },
        refresh_workspace_bytes=workspace["refresh"],
        update_workspace_bytes=workspace["update"],
        step_peaks=step_peaks,
        measured=device.type != "meta",
        device=str(device),
        cuda_max_memory_allocated=cuda_peak,
        gpu_memory_bytes=None
        if setting["gpu_memory_gib"] is None
        else int(setting["gpu_memory_gib"] * 2**30),
        per_process=processes,
    )


def _forward_backward(
    model: nn.Module, setting: dict[str, Any], device: torch.device, tracker: LiveBytes
) -> None:
    """One micro-batch's forward and backward (its loss divided by the accumulation steps),
    tagged for the tracker."""
    tracker.tag = "forward"
    batch = torch.randint(0, setting["vocab_size"], (setting["batch_size"], setting["seq_len"]))
    batch = batch.to(device)
    loss = model(input_ids=batch, labels=batch).loss / setting["accumulation_steps"]
    tracker.tag = "backward"
    loss.backward()


def _known_tensors(
    params: list[Tensor], weights: list[Tensor], optimizer: Any, handle: Any
) -> dict[str, list[Tensor]]:
    """The tensors of each known term: ``weights`` (parameters and buffers), the gradients of
    ``params``, states, bases and layer-wise accumulation buffers."""
    states = [(key, v) for s in optimizer.state.values() for key, v in s.items() if isinstance(v, Tensor)]
    return {
        "weights": weights,
        "gradients": [p.grad for p in params if p.grad is not None],
        # bf16 weights' 8-bit corrections among them: optimizer state, as state_nbytes counts it.
        "optimizer_states": [v for key, v in states if not is_basis_key(key)],
        "projection_bases": [v for key, v in states if is_basis_key(key)],
        "accumulation_buffers": list(handle.accumulation_buffers.values()) if handle else [],
    }


def _terms(tracker: LiveBytes, known: dict[str, list[Tensor]]) -> dict[str, int]:
    """Bytes of each known term, of activations (storages created in forward) and of the
    workspace (every other live storage)."""
    terms = {term: storage_nbytes(tensors) for term, tensors in known.items()}
    by_tag = tracker.live_by_tag(
        {id(storage) for ts in known.values() for t in ts for storage in storages(t)}
    )
    terms["activations"] = by_tag.pop("forward", 0)  # created in forward, not a known term
    terms["workspace"] = sum(by_tag.values())
    return terms


def _cuda_start(device: torch.device, weights: list[Tensor]) -> int | None:
    """On CUDA, the allocated bytes besides the weights, with the peak statistics reset."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) - storage_nbytes(weights)


def _phase_name(phase: str, layerwise: bool) -> str:
    """How the plan names the phase of its peak."""
    if phase == "backward" and layerwise:
        return "backward with layer-wise updates"
    return {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}[phase]


def _with_chosen_rank(setting: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """``setting`` with the rank the optimizer chose when none was given (``rank_defaulted``)."""
    ranks = [group["rank"] for group in optimizer.param_groups if "rank" in group]
    if setting["rank"] is None and ranks:
        return {**setting, "rank": ranks[0], "rank_defaulted": True}
    return setting


class _NoBar:
    """What ``_progress_bar`` returns when disabled: tqdm (the ``train`` extra) is not needed."""

    def update(self, count: int) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


def _progress_bar(enabled: bool, total: int, label: str) -> Any:
    """A bar of the phases the planner runs, on stderr (nothing when not ``enabled``)."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit="phase", leave=False)


def _window(tracker: LiveBytes, record: dict[str, int], key: str) -> Callable[[], Any]:
    """A probe for ``SlimoptOptimizer.watch`` that records the largest temporary memory of any
    call in ``record[key]``."""

    @contextmanager
    def window() -> Iterator[None]:
        outer_window = tracker.window_peak
        entry = tracker.reset_window()
        try:
            yield
        finally:
            record[key] = max(record[key], tracker.window_peak - entry)
            tracker.window_peak = max(outer_window, tracker.window_peak)

    return window


def plan_as_json(plan: MemoryPlan) -> str:
    """The plan as indented JSON (``peak_bytes`` and every term in bytes)."""
    return json.dumps(plan.to_dict(), indent=1, default=str)
