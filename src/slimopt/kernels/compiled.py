"""How the fused steps are compiled: ``torch.compile`` with Inductor's options, once per
function, under ``COMPILE_SETTINGS``; run as they are under a mode that watches every operation."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

# Sizes of elementwise moments are marked dynamic (one compiled step serves every size);
# everything else, block sizes and code widths included, stays a constant of the compiled loops:
# a block reduction of symbolic length is several times slower. One compiled step per storage
# pair and weight dtype, and for moments scaled by rows and columns one per matrix shape, a
# handful to a few dozen per model (a few hundred in one test session): more than dynamo's
# default of 8 variants per function, past which it would run the step eagerly.
COMPILE_SETTINGS = {
    "recompile_limit": 256,
    "automatic_dynamic_shapes": False,
    "assume_static_by_default": True,
}
# Inductor's options for the compiled steps. Every table index in them is in range by
# construction (an 8-bit code into a map of 256 values, a 4-bit one into 16, a 17-bit bucket
# into a table of 2**17 entries), so the bounds check Inductor puts before each lookup only
# costs time (measured: docs/results/storage.md).
INDUCTOR_OPTIONS = {"assert_indirect_indexing": False}
# For a step whose intermediate roundings are part of its definition (Muon's bf16 iteration
# starts from the bf16 rounding of its step and of that step's norm): Inductor otherwise keeps a
# fused intermediate in fp32, which moves every element the iteration starts from.
EXACT_CASTS = {**INDUCTOR_OPTIONS, "emulate_precision_casts": True}


def compiled(function: Callable[..., Any], *, exact_casts: bool = False) -> Callable[..., Any]:
    """``function`` compiled (to be called with ``COMPILE_SETTINGS`` in effect); with
    ``exact_casts``, every rounding to a lower precision that it writes is kept (``EXACT_CASTS``).

    Under a mode that watches every operation (slimopt.memory.LiveBytes, counting a step's
    memory) dynamo cannot compile, and it would never try the function again: it runs as it
    is, compiled the next time no mode watches."""
    if is_in_torch_dispatch_mode(include_infra_modes=False):
        return function
    return _compile(function, exact_casts)


@functools.cache
def _compile(function: Callable[..., Any], exact_casts: bool) -> Callable[..., Any]:
    return torch.compile(function, options=EXACT_CASTS if exact_casts else INDUCTOR_OPTIONS)


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """``COMPILE_SETTINGS`` in effect, for the compiled steps called inside. Entering them costs
    about as much as a guard check (entered per compiled call, a noticeable part of a step), so
    ``step()`` enters them once for all its tensors and the steps inside skip it."""
    if getattr(_settings, "entered", False):
        yield
        return
    with torch._dynamo.config.patch(**COMPILE_SETTINGS):
        _settings.entered = True
        try:
            yield
        finally:
            _settings.entered = False


# Whether this thread is inside ``compile_settings``.
_settings = threading.local()


def mark_dynamic(*tensors: Tensor | None) -> None:
    """Mark every size of ``tensors`` dynamic: one compiled function serves every shape.
    (Stored moments keep their marks from step to step: marking again would cost as much.)"""
    for tensor in tensors:
        if tensor is not None:
            marked = getattr(tensor, "_dynamo_dynamic_indices", ())
            for dim, size in enumerate(tensor.shape):
                if size > 1 and dim not in marked:
                    torch._dynamo.mark_dynamic(tensor, dim)
