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

The package: ``setting`` (``PlanSetting``: what is planned, checked before anything is built),
``run`` (the two steps and their terms) and ``report`` (``MemoryPlan``, its breakdown, JSON).
"""

from __future__ import annotations

from typing import Any

import torch

from slimopt.planner.report import CUDA_OVERHEAD_BYTES, TERMS, MemoryPlan, plan_as_json
from slimopt.planner.run import STEPS, run
from slimopt.planner.setting import PlanSetting

__all__ = [
    "CUDA_OVERHEAD_BYTES",
    "STEPS",
    "TERMS",
    "MemoryPlan",
    "PlanSetting",
    "measure_memory",
    "plan_as_json",
    "plan_memory",
]


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
    vocab_size: int | None = None,
    gpu_memory_gib: float | None = None,
    processes: int = 1,
    distributed: str | None = None,
    grad_sync: str = "auto",
    device: str = "meta",
    progress: bool = False,
    **optimizer_options: Any,
) -> MemoryPlan:
    """Predict the memory of training ``model`` with ``optimizer``, to the byte.

    The planner runs two training steps on the meta device: every tensor a step creates is
    counted and none is computed, so a 7B plan takes seconds ([measured against real
    steps](../results/memory.md)). On a real ``device`` the steps run for real and the plan is a
    measurement (see [measure_memory][slimopt.planner.measure_memory]).

    Args:
        model: a LLaMA preset (``slimopt.models.LLAMA_PRESETS``: ``"llama_7b"``, …) or a Hugging
            Face config file or directory.
        optimizer: a registry name ([available_optimizers][slimopt.available_optimizers]).
        rank: the projection's rank (None: the optimizer's default).
        layerwise: update each parameter inside backward ([layerwise][slimopt.layerwise.layerwise]).
        refresh_from: layer-wise mode's option of that name: ``"step"`` or ``"micro_batch"``.
        batch_size: sequences per micro-batch.
        seq_len: tokens per sequence.
        accumulation_steps: micro-batches per optimizer step.
        checkpointing: activation checkpointing, as ``slimopt train --checkpointing``.
        dtype: how the weights are stored: ``"fp32"``, ``"bf16"``, ``"bf16+8"`` (bf16 and an
            8-bit correction, which the optimizer keeps in its state and the plan counts there),
            ``"int8"`` (linear weights int8, the rest bf16), ``"int8-embed"`` (the input embedding
            too) or ``"int8-all"`` (the output head too).
        vocab_size: replaces the model's vocabulary size (None: a preset's, or a config file's).
        gpu_memory_gib: a card's memory; the plan's ``fits`` says whether the peak and CUDA's own
            overhead fit in it.
        processes: processes of a multi-process run (with ``distributed``).
        distributed: ``"ddp"``, ``"zero1"`` or ``"fsdp2"``: the plan then also holds, in
            ``per_process``, the step of the busiest process, and ``fits`` judges that one.
        grad_sync: under ``"ddp"`` and ``"zero1"``, how gradients are all-reduced (``"full"``,
            ``"projected"``, ``"auto"``); ``plan.grad_sync`` holds the bytes per step of both.
        device: ``"meta"`` to plan, a real device to measure.
        progress: show a bar of the micro-batches on stderr.
        **optimizer_options: go to [build_optimizer][slimopt.build_optimizer] (``states``,
            ``update_proj_gap``, …).

    Returns:
        The plan, a [MemoryPlan][slimopt.planner.MemoryPlan], with the peak, each term (weights,
        gradients, states, bases, activations, workspace) at the peak, and what outlives a step.

    Raises:
        ValueError: a bad model, optimizer, size, dtype or rank, naming it.
    """
    fields = {k: v for k, v in locals().items() if k not in ("device", "progress", "optimizer_options")}
    setting = PlanSetting.checked(**fields, options=optimizer_options)
    return run(setting, torch.device(device), progress)


def measure_memory(model: str, optimizer: str, *, device: str = "cpu", **settings: Any) -> MemoryPlan:
    """Run the planner's two steps for real on ``device`` and report what they used.

    On CUDA ``cuda_max_memory_allocated`` holds the allocator's own peak over the same steps. On
    the CPU the state codecs run as on a GPU, in one piece per moment
    (``slimopt.codecs.slicing.as_on_a_gpu``), so that the measurement checks the GPU's plan; a CPU
    training step goes through them in smaller pieces, and peaks lower.

    Args:
        model: as for [plan_memory][slimopt.planner.plan_memory].
        optimizer: as for ``plan_memory``.
        device: where the steps run: ``"cpu"``, ``"cuda"``, ….
        **settings: the other arguments of ``plan_memory``.

    Returns:
        The measured [MemoryPlan][slimopt.planner.MemoryPlan] (``measured`` is True).

    Raises:
        ValueError: as ``plan_memory``.
    """
    return plan_memory(model, optimizer, device=device, **settings)
