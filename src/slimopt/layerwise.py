"""Layer-wise updates: each parameter steps inside backward and its gradient is freed at once.

``layerwise(optimizer, accumulation_steps=k)`` registers a post-accumulate-grad hook on every
parameter of a slimopt optimizer; afterwards the training loop only calls ``loss.backward()``
(once per micro-batch) and the handle does the rest, so the gradients of the whole model never
exist at the same time:

- **Accumulation.** A projected matrix whose basis is fixed for this optimizer step projects
  each micro-batch's gradient into its r×n space (in fp32), adds it to a buffer of that size
  and frees the gradient; it is updated on the k-th micro-batch. The buffer has the gradient's
  dtype, as ``.grad`` accumulation does (bf16 for a bf16 model). A parameter that needs its whole
  gradient this step (not projected, or projected with its basis refreshed from this step's
  gradient, as the stepping optimizer does) lets autograd accumulate ``.grad`` as usual and is
  updated, and its gradient freed, on the k-th micro-batch. With ``stagger`` (the default) only
  about 1/T of the projected matrices refresh in any one step; the exception is the first step,
  where every matrix finds its first basis, so with k > 1 all of the model's gradients coexist
  once. ``refresh_from="micro_batch"`` avoids that: a refresh due in a step is computed from
  the first micro-batch's gradient (instead of the whole step's) and every projected matrix
  accumulates r×n from the first micro-batch on. That basis sees 1/k of the step's data; with
  k = 1 both ways are the same.
- **Clipping** (``max_grad_norm``): the global norm is not known until backward ends, after the
  updates are made, so each tensor is clipped on its own: the gradient the update rule sees (the
  accumulated one; for a projected matrix its projection, whose norm is at most the full
  gradient's) is scaled to a norm of at most ``max_grad_norm``, as
  ``torch.nn.utils.clip_grad_norm_([p], max_grad_norm)`` would do to that tensor alone.
- **APOLLO** (a group with ``scale_type``) moves the weights by the raw gradient, scaled: its
  matrices need their whole gradient at every step, so they accumulate ``.grad`` as unprojected
  parameters do, and it is the raw gradient that is clipped.
- **Schedule.** A learning-rate ``scheduler`` given to the handle is stepped once per optimizer
  step, at the end of the k-th backward.
- **optimizer.step()** is not needed; called anyway it ends the current optimizer step early
  (``finish_step``) and does nothing at a step boundary, so loops and trainers that call it keep
  their meaning. A closure cannot be honoured and raises.
- **Parameters added or unfrozen later** are trained too: a group added with
  ``optimizer.add_param_group`` is hooked at once, and frozen parameters are hooked from the
  start, so ``requires_grad_()`` on them later needs nothing else.
- **Checkpoints** use the optimizer's normal ``state_dict`` between optimizer steps; asking for
  it halfway through an accumulation raises instead of losing the partial sums.

**Multi-process runs.** Under FSDP2 (``fully_shard``) a parameter's hook fires after the
reduce-scatter, with this process's rows of the averaged gradient: each process updates its own
rows, and what must be agreed on (a per-tensor clipping norm, a refresh's sketches, a skipped
step) is all-reduced within the hook, so the run equals stepping FSDP2 and one process. With
no-sync micro-batches (``set_requires_gradient_sync(False)``) FSDP2 sums the gradient itself and
the hooks fire once per step: use ``accumulation_steps=1`` then. Under DDP
a hook sees the process's own gradient before DDP averages it, and DDP keeps every gradient in
its buckets whatever the optimizer does, so layer-wise mode refuses to start there (use FSDP2).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch import Tensor

from slimopt.checks import beyond_float32, number
from slimopt.optimizers import SlimoptOptimizer
from slimopt.projection import project
from slimopt.sharding import local_view, split_by_rows

# The gradient a projection refresh in layer-wise mode is computed from.
REFRESH_FROM = ("step", "micro_batch")


def check_refresh_from(value: str, layer_wise: bool = True, remedy: str = "") -> None:
    """Raise ``ValueError`` for an unknown ``refresh_from``, or one other than "step" where
    layer-wise mode is off (``remedy`` says how to turn it on)."""
    if value not in REFRESH_FROM:
        raise ValueError(f"unknown refresh_from {value!r}; valid: {', '.join(REFRESH_FROM)}")
    if value != "step" and not layer_wise:
        raise ValueError(f"refresh_from={value!r} is a layer-wise option: {remedy}")


def _refuse_experts(groups: list[tuple[int, dict[str, Any]]]) -> None:
    """Raise ``ValueError`` naming the (index, group) pairs with ``experts=True``."""
    experts = [group.get("name", f"group {i}") for i, group in groups if group["experts"]]
    if experts:
        raise ValueError(
            f"layer-wise updates do not cover per-expert updates (param groups {experts} have "
            "experts=True: each expert projected, or orthogonalized by Muon, on its own); step "
            "the optimizer after backward, or update the experts in another optimizer stepped "
            "after backward"
        )


class LayerwiseHandle:
    """The hooks of one layer-wise optimizer; ``remove()`` (or leaving a ``with`` block)
    restores normal stepping with ``optimizer.step()``."""

    def __init__(
        self,
        optimizer: SlimoptOptimizer,
        accumulation_steps: int,
        max_grad_norm: float | None,
        scheduler: Any,
        refresh_from: str,
    ) -> None:
        _refuse_experts(list(enumerate(optimizer.param_groups)))
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.scheduler = scheduler
        self.refresh_from = refresh_from
        self.micro_step = 0  # index of the current micro-batch within its optimizer step
        self.optimizer_steps = 0  # optimizer steps completed under this handle
        self._groups = self._group_map()
        self._buffers: dict[Tensor, Tensor] = {}  # projected matrices: summed r×n gradients
        self._accumulating: set[Tensor] = set()  # whole-gradient parameters not yet updated
        self._callback_queued = False
        self._norms: list[Tensor] = []  # pre-clip norms of this step's updated tensors
        # Global norm of the gradients the rules saw in the last step, before clipping.
        self.last_grad_norm: Tensor | None = None
        self._hooks: list[Any] = []
        self._watched: set[Tensor] = set()
        self.watch(list(self._groups))
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
        self._hooks.append(optimizer.register_state_dict_pre_hook(self._before_state_dict))
        optimizer.attach_layerwise(self)

    def _before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``optimizer.step()`` ends a half-accumulated optimizer step early; a closure cannot be
        re-evaluated, as the updates run inside backward."""
        # torch passes step's own arguments, the optimizer first.
        if (args[1] if len(args) > 1 else kwargs.get("closure")) is not None:
            raise RuntimeError(
                "this optimizer is in layer-wise mode: its updates run inside backward, so a "
                "closure cannot be re-evaluated; call handle.remove() first"
            )
        with torch.no_grad():
            self.finish_step()

    def _before_state_dict(self, optimizer: Any) -> None:
        """Refuse a state dict halfway through an accumulation, whose partial sums it could not
        hold."""
        if self.pending:
            raise RuntimeError(
                f"layer-wise accumulation is at micro-batch {self.micro_step} of "
                f"{self.accumulation_steps}: save between optimizer steps"
            )

    def admit(self, group: dict[str, Any]) -> None:
        """Train a param group added while layer-wise (the optimizer's ``add_param_group`` calls
        this): hook its parameters. Raises ``ValueError`` for a group layer-wise mode cannot
        update, as at construction (``experts=True``, non-leaf tensors)."""
        _refuse_experts([(len(self.optimizer.param_groups) - 1, group)])
        self.watch(group["params"])

    def watch(self, params: list[Tensor]) -> None:
        """Hook ``params`` (the optimizer calls this for a group added while layer-wise).

        Frozen parameters are hooked too, so one unfrozen later (``requires_grad_()``) is
        trained from its first gradient on. Raises ``ValueError`` for a non-leaf tensor."""
        for param in params:
            if param.requires_grad and not param.is_leaf:
                raise ValueError(f"parameter {tuple(param.shape)} is not a leaf tensor; hooks need leaves")
        for param in params:
            if param in self._watched or not (param.is_floating_point() or param.is_complex()):
                continue
            frozen = not param.requires_grad
            # torch hooks only tensors that require gradients; the hook outlives the flag.
            param.requires_grad_(True)
            try:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_gradient))
            finally:
                param.requires_grad_(not frozen)
            self._watched.add(param)

    def _group_map(self) -> dict[Tensor, dict[str, Any]]:
        # Rebuilt at every backward: load_state_dict (accelerate.prepare, a resume) replaces the
        # optimizer's group dicts, and a stale one would keep a stale learning rate.
        return {p: g for g in self.optimizer.param_groups for p in g["params"]}

    @property
    def pending(self) -> bool:
        """Whether an optimizer step is half accumulated (some micro-batches seen, not all)."""
        return bool(self._buffers or self._accumulating)

    @property
    def accumulation_buffers(self) -> dict[Tensor, Tensor]:
        """The projected-gradient sums of the current optimizer step, by parameter."""
        return dict(self._buffers)

    def remove(self) -> None:
        """Remove the hooks; a half-accumulated step is dropped with a ``RuntimeWarning``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._watched.clear()
        if self.pending:
            warnings.warn(
                f"slimopt: layer-wise mode removed after {self.micro_step} of {self.accumulation_steps} "
                "micro-batches; their gradients are dropped",
                RuntimeWarning,
                stacklevel=2,
            )
            for param in self._accumulating:
                param.grad = None
        self._buffers.clear()
        self._accumulating.clear()
        if self.optimizer.layerwise_handle is self:
            self.optimizer.attach_layerwise(None)

    def __enter__(self) -> LayerwiseHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _on_gradient(self, param: Tensor) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
            self._groups = self._group_map()
        group = self._groups[param]
        last = self.micro_step == self.accumulation_steps - 1
        whole = param not in self._buffers and self.optimizer.engine.needs_whole_gradient(param, group)
        if whole and not self._refreshed_early(param, group):
            if last:
                self._step_whole(param, group)
            else:
                self._accumulating.add(param)
            return
        self._accumulate_projected(param, group, last)
        if last:
            self._step_projected(param, group)

    def _refreshed_early(self, param: Tensor, group: dict[str, Any]) -> bool:
        """With ``refresh_from="micro_batch"``, refresh a due basis from this micro-batch's
        gradient; whether the parameter can accumulate in its projected space from now on."""
        if self.refresh_from != "micro_batch" or param in self._accumulating:
            return False
        if not self.optimizer.engine.projects(param, group):
            return False
        # No basis (its first refresh failed): the step falls back to the whole gradient.
        return self.optimizer.engine.refreshed_basis(param, group, local_view(param.grad)) is not None

    def _accumulate_projected(self, param: Tensor, group: dict[str, Any], last: bool) -> None:
        basis = self.optimizer.engine.basis(param, group)
        grad = local_view(param.grad)
        dtype = grad.dtype
        total = project(grad.reshape(grad.shape[0], -1), basis)  # fp32
        param.grad = None
        buffer = self._buffers.get(param)
        if buffer is not None:
            total.add_(buffer)
        # Between micro-batches the sum is kept in the gradient's dtype, as autograd keeps .grad
        # (bf16 for a bf16 model: half the bytes of fp32); the finished sum stays fp32.
        self._buffers[param] = total if last else total.to(dtype)

    def _step_projected(self, param: Tensor, group: dict[str, Any]) -> None:
        grad = self._clip(param, self._buffers.pop(param))
        self.optimizer.engine.apply_update(param, group, grad, self.optimizer.engine.basis(param, group))

    def _step_whole(self, param: Tensor, group: dict[str, Any]) -> None:
        self._accumulating.discard(param)
        # APOLLO moves the weights by the raw gradient, scaled: that is what it keeps and clips.
        scaled = self.optimizer.engine.plan_of(param, group).scales_gradient
        raw = self._clip(param, local_view(param.grad)) if scaled else local_view(param.grad)
        prepared = self.optimizer.engine.gradient_in_space(param, group, raw)
        param.grad = None
        if not scaled:
            raw = None  # the gradient in the rule's space is all the update needs: free the rest
        if prepared is not None:
            grad, basis = prepared
            grad = grad if scaled else self._clip(param, grad)
            self.optimizer.engine.apply_update(param, group, grad, basis, raw=raw)

    def _clip(self, param: Tensor, grad: Tensor) -> Tensor:
        """``grad`` (of ``param``, this process's rows of it under FSDP2) scaled to a norm of at
        most ``max_grad_norm``; the norm is the whole tensor's."""
        norm = self.optimizer.engine.gradient_norm(param, grad)
        self._norms.append(norm)
        if self.max_grad_norm is None:
            return grad
        # No host synchronisation: the factor stays a tensor.
        factor = (self.max_grad_norm / (norm + 1e-6)).clamp_(max=1.0)
        return grad * factor

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.micro_step < self.accumulation_steps - 1:
            self.micro_step += 1
            return
        self._complete_step()

    def finish_step(self) -> None:
        """End the current optimizer step now: update every parameter with the micro-batches
        accumulated so far (Hugging Face's Trainer does this at the end of an epoch whose length
        is not a multiple of the accumulation). At a step boundary it does nothing."""
        if self.pending:
            self._groups = self._group_map()
            self._complete_step()

    def _complete_step(self) -> None:
        # Parameters that got no gradient in the last micro-batch but did in earlier ones.
        for param in list(self._buffers):
            self._step_projected(param, self._groups[param])
        for param in list(self._accumulating):
            self._step_whole(param, self._groups[param])
        self.micro_step = 0
        self.optimizer_steps += 1
        norms = self._norms
        self._norms = []
        self.last_grad_norm = torch.stack(norms).square().sum().sqrt() if norms else None
        if self.scheduler is not None:
            # The optimizer did step, inside backward: the scheduler, which watches
            # optimizer.step() for that, would warn that it is stepped first.
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=re.escape("Detected call of `lr_scheduler.step()` before")
                )
                self.scheduler.step()


def layerwise(
    optimizer: SlimoptOptimizer,
    accumulation_steps: int = 1,
    *,
    max_grad_norm: float | None = None,
    scheduler: Any = None,
    refresh_from: str = "step",
) -> LayerwiseHandle:
    """Switch a slimopt optimizer to layer-wise updates: each parameter steps inside backward.

    After this call the training loop only calls ``loss.backward()``, once per micro-batch; every
    parameter is updated, and its gradient freed, as soon as its last micro-batch's gradient is
    accumulated. While the handle is active ``optimizer.step()`` only ends a half-accumulated
    step early. The [layer-wise guide](../layerwise.md) explains accumulation, clipping and
    multi-process runs.

    Args:
        optimizer: the slimopt optimizer whose parameters are hooked.
        accumulation_steps: micro-batches (one ``loss.backward()`` each) per optimizer step.
        max_grad_norm: clip each tensor's gradient to this norm on its own (the global norm is not
            known until backward ends); None: no clipping.
        scheduler: an ``LRScheduler`` of this optimizer, stepped once per optimizer step.
        refresh_from: the gradient a projection refresh is computed from: ``"step"`` (the whole
            step's, as without layer-wise mode) or ``"micro_batch"`` (the step's first
            micro-batch's, so that no projected gradient is ever kept whole).

    Returns:
        The [LayerwiseHandle][slimopt.layerwise.LayerwiseHandle]; ``remove()`` it, or leave its
        ``with`` block, to step normally again.

    Raises:
        TypeError: an optimizer that is not slimopt's, or a scheduler that needs a metric
            (``ReduceLROnPlateau``).
        ValueError: a bad count, norm, scheduler or ``refresh_from``.
        RuntimeError: the optimizer is already layer-wise or, in a multi-process run, holds
            parameters that FSDP2 does not split (DDP's, replicated ones).
    """
    if not isinstance(optimizer, SlimoptOptimizer):
        raise TypeError(
            f"layer-wise mode needs a slimopt optimizer (slimopt.available_optimizers()), "
            f"got {type(optimizer).__name__}"
        )
    steps = accumulation_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
    clip = number(max_grad_norm)
    if max_grad_norm is not None and (clip is None or clip <= 0):
        raise ValueError(
            f"max_grad_norm must be a finite number > 0, or None for no clipping, got {max_grad_norm!r}"
            f"{beyond_float32(max_grad_norm)}"
        )
    check_refresh_from(refresh_from)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("ReduceLROnPlateau needs a metric: step it yourself, after evaluation")
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError("scheduler must be a learning-rate scheduler of this optimizer")
    if optimizer.layerwise_handle is not None:
        raise RuntimeError("this optimizer is already in layer-wise mode; remove() the first handle")
    _check_gradients_are_averaged(optimizer)
    return LayerwiseHandle(optimizer, accumulation_steps, max_grad_norm, scheduler, refresh_from)


def _check_gradients_are_averaged(optimizer: SlimoptOptimizer) -> None:
    """Raise ``RuntimeError`` when a hook would see a gradient not yet averaged over processes:
    in a multi-process run, every parameter must be split by rows (FSDP2 reduce-scatters before
    the hook fires)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return
    plain = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if not split_by_rows(p)]
    if plain:
        raise RuntimeError(
            f"layer-wise mode in a {torch.distributed.get_world_size()}-process run: parameters "
            f"{plain[:3]}{' …' if len(plain) > 3 else ''} are not split by FSDP2, so their hooks would "
            "see this process's gradient before it is averaged (DDP averages after backward, and "
            "keeps every gradient in its buckets anyway); shard the model with fully_shard (FSDP2) "
            "or step without layer-wise mode"
        )
