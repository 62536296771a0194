"""Gradients that hold a synchronized projection instead of a gradient in their parameter's
shape: a gradient sync that all-reduces GaLore projections (``slimopt.distributed.grad_sync``)
packs each one into the start of its parameter's ``.grad``, the rest zeros, and the optimizer's
next step reads it from there (``take``). Which parameters hold one, their projections' shapes
(one per unit: each expert of a stacked parameter has its own), and whether a step read them.
"""

from __future__ import annotations

import torch
from torch import Tensor

# What a backward into a ``.grad`` that still holds a packed projection would make of it.
STILL_PACKED = (
    "holds a synchronized projection packed by slimopt's projected gradient sync, which a "
    "backward would add a gradient to: call optimizer.zero_grad() after each step, and "
    "accumulate micro-batches under DDP's no_sync() (one synchronized backward per step)"
)


class PackedGradients:
    """The parameters whose ``.grad`` holds a packed projection, with its shapes (None where a
    unit's gradient is whole), until the gradients are zeroed: ``unread`` counts those no step
    has read yet."""

    def __init__(self) -> None:
        self._held: dict[Tensor, list[torch.Size | None] | None] = {}  # None: read by a step
        self.unread = 0

    def pack(self, param: Tensor, shapes: list[torch.Size | None]) -> None:
        """Record that ``param``'s ``.grad`` now holds its units' projections of ``shapes``.
        Raises ``RuntimeError`` when it held one already (it was added to, not replaced)."""
        if param in self._held:
            raise RuntimeError(f"the gradient of parameter {tuple(param.shape)} {STILL_PACKED}")
        self._held[param] = shapes
        self.unread += 1

    def take(self, param: Tensor) -> list[torch.Size | None] | None:
        """The shapes of the projections ``param``'s ``.grad`` holds for a step to read (once),
        or None: it holds a gradient."""
        shapes = self._held.get(param)
        if shapes is not None:
            self._held[param] = None
            self.unread -= 1
        return shapes

    def before_backward(self, param: Tensor) -> None:
        """Called as a gradient of ``param`` arrives in backward: forget a projection its
        ``.grad`` no longer holds (zeroed, or set to None); raise ``RuntimeError`` when it still
        does."""
        if param not in self._held:
            return
        grad = param.grad
        if grad is not None and bool(grad.any()):
            raise RuntimeError(f"the gradient of parameter {tuple(param.shape)} {STILL_PACKED}")
        if self._held.pop(param) is not None:
            self.unread -= 1

    def clear(self) -> None:
        """Forget every packed projection: the gradients were zeroed (``zero_grad``), or the
        state replaced (``load_state_dict``)."""
        self._held.clear()
        self.unread = 0
