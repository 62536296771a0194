"""The planner's run: a model and its optimizer built from a ``PlanSetting``, two training steps
under ``slimopt.memory.LiveBytes`` (forward, backward, then the optimizer step or the layer-wise
hooks), and what was live at the peak, by term."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from slimopt.codecs.slicing import as_on_a_gpu
from slimopt.core.state import is_basis_key
from slimopt.distributed.grad_sync import SyncBytes, step_bytes
from slimopt.layerwise import layerwise
from slimopt.memory import LiveBytes, storage_nbytes, storages
from slimopt.meta_run import MetaRun
from slimopt.planner.report import TERMS, MemoryPlan
from slimopt.planner.setting import PlanSetting
from slimopt.process_memory import parameter_bytes, per_process
from slimopt.registry import build_optimizer
from slimopt.weight_formats import optimizer_options

# The first step creates the states and computes every basis; the second is a steady one.
STEPS = 2


def run(setting: PlanSetting, device: torch.device, progress: bool = False) -> MemoryPlan:
    """The plan of ``setting``: its two steps on ``device`` (the meta device: predicted; a real
    one: measured), with a bar of the micro-batches on stderr when ``progress``."""
    torch.manual_seed(0)
    model = setting.build_model(device)
    setting.check_rank(model)
    setting = replace(setting, vocab_size=model.config.vocab_size)  # the model's own, if not given
    projection = {"rank": setting.rank} if setting.rank is not None else {}
    options = setting.options
    storage = optimizer_options(setting.dtype, options)
    optimizer = build_optimizer(model, setting.optimizer, lr=1e-3, **projection, **options, **storage)
    k = setting.accumulation_steps
    handle = layerwise(optimizer, k, refresh_from=setting.refresh_from) if setting.layerwise else None
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
    with tracker, MetaRun(device), as_on_a_gpu():
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
    processes, sync = _per_process(setting, model, optimizer, at_peak)
    return MemoryPlan(
        setting=_with_chosen_rank(setting, optimizer),
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
        gpu_memory_bytes=None if setting.gpu_memory_gib is None else int(setting.gpu_memory_gib * 2**30),
        per_process=processes,
        grad_sync=sync,
    )


def _per_process(
    setting: PlanSetting, model: nn.Module, optimizer: Any, at_peak: dict[str, int]
) -> tuple[dict[str, int] | None, SyncBytes | None]:
    """Under ``setting.distributed``: process 0's terms (``slimopt.process_memory``) and, for DDP
    and ZeRO-1, the gradient-sync bytes per step; (None, None) for one process."""
    if setting.distributed is None:
        return None, None
    sync = step_bytes(model, optimizer) if setting.distributed in ("ddp", "zero1") else None
    # Projected sync under ZeRO-1 keeps every basis on every process (follow_bases).
    every_basis = sync is not None and sync.per_step is not None and setting.grad_sync != "full"
    parameters = parameter_bytes(model, optimizer)
    processes = per_process(
        at_peak, parameters, setting.distributed, setting.processes, every_basis=every_basis
    )
    return processes, sync


def _forward_backward(
    model: nn.Module, setting: PlanSetting, device: torch.device, tracker: LiveBytes
) -> None:
    """One micro-batch's forward and backward (its loss divided by the accumulation steps),
    tagged for the tracker."""
    tracker.tag = "forward"
    batch = torch.randint(0, model.config.vocab_size, (setting.batch_size, setting.seq_len))
    batch = batch.to(device)
    loss = model(input_ids=batch, labels=batch).loss / setting.accumulation_steps
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


def _with_chosen_rank(setting: PlanSetting, optimizer: Any) -> PlanSetting:
    """``setting`` with the rank the optimizer chose when none was given (``rank_defaulted``)."""
    ranks = [group["rank"] for group in optimizer.param_groups if "rank" in group]
    if setting.rank is None and ranks:
        return replace(setting, rank=ranks[0], rank_defaulted=True)
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
    """A probe for ``Engine.watch`` that records the largest temporary memory of any
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
