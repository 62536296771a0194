"""Exact accounting of memory: the bytes of an optimizer's state, and a tracker of live tensor
bytes that works on any device, the meta device included.

``LiveBytes`` is a ``TorchDispatchMode``: every tensor an operator creates is counted from the
moment its storage exists until it is freed, so its ``peak`` is the exact high-water mark of
tensor bytes during the block (storages shared by views count once). On the meta device nothing
is computed, which is how the planner runs a training step of a 7B model on a laptop; on the CPU
it measures what ``torch.cuda.max_memory_allocated`` measures on a GPU, without the allocator's
rounding.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def state_tensors(optimizer: Optimizer) -> list[Tensor]:
    """Every tensor in ``optimizer.state`` (step counters and other Python numbers left out); of a
    ``ZeroRedundancyOptimizer``, this process's part: the optimizer it wraps, and of slimopt's, the
    bases it follows too (``local_optimizers``)."""
    if hasattr(optimizer, "local_optimizers"):
        parts = optimizer.local_optimizers()
    else:
        parts = [getattr(optimizer, "optim", optimizer)]
    return [
        value
        for part in parts
        for state in part.state.values()
        for value in state.values()
        if isinstance(value, Tensor)
    ]


def state_nbytes(optimizer: Optimizer) -> int:
    """The bytes of every tensor in ``optimizer.state``.

    Moments or their codes, scales, factored statistics and projection bases are counted, the
    padding of the last quantization block included; step counters and other Python numbers are
    not. Any ``torch.optim`` optimizer is measured the same way.

    Args:
        optimizer: the optimizer, after its first step (before it, the state is empty).

    Returns:
        The bytes.
    """
    return sum(value.numel() * value.element_size() for value in state_tensors(optimizer))


def storages(tensor: Tensor) -> list[Any]:
    """The storages behind ``tensor``: its own, or those of the tensors a wrapper subclass holds
    when it holds nothing else (an int8 weight's codes and scales). A DTensor, which holds its
    device mesh too, keeps its own (empty) storage: its local shard is counted where it is made."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        if all(isinstance(value, Tensor) for value in inner):
            return [storage for value in inner for storage in storages(value)]
    return [tensor.untyped_storage()]


def storage_nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        for storage in storages(tensor):
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


_untracked_depth = 0


@contextmanager
def untracked() -> Iterator[None]:
    """Tensors created inside the block are not counted by any ``LiveBytes``: for caches that
    live as long as the process (a codec's lookup table on a device), not memory of a step."""
    global _untracked_depth
    _untracked_depth += 1
    try:
        yield
    finally:
        _untracked_depth -= 1


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created inside the block.

    ``live`` is the current count, ``peak`` its maximum and ``window_peak`` the maximum since
    the last ``reset_window()``. Tensors that exist before the block are not counted: add them
    with ``adopt`` (the planner adopts the weights). Each storage remembers the ``tag`` that was
    set when it appeared (the planner tags by phase: forward, backward, optimizer). ``on_peak``,
    if given, is called at each new peak, so a caller can record what was alive at that moment.
    """

    def __init__(self, on_peak: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.window_peak = 0
        self.tag = ""
        self.on_peak = on_peak
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._tags: dict[int, str] = {}

    def reset_window(self) -> int:
        """Start a new window for ``window_peak``; returns the bytes live now."""
        self.window_peak = self.live
        return self.live

    def live_by_tag(self, exclude: set[int]) -> dict[str, int]:
        """Bytes live now by creation tag, leaving out the storages whose ids are in ``exclude``."""
        totals: dict[str, int] = {}
        for key, size in self._sizes.items():
            if key not in exclude:
                tag = self._tags[key]
                totals[tag] = totals.get(tag, 0) + size
        return totals

    def adopt(self, tensors: Iterable[Tensor]) -> None:
        """Count tensors created outside the block (weights, a model's buffers)."""
        for tensor in tensors:
            self._track(tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if _untracked_depth:
            return result
        # An output on an input's storage (a view, an in-place or out= result) is no allocation.
        inputs = {
            id(storage)
            for value in tree_flatten((args, kwargs))[0]
            if isinstance(value, Tensor)
            for storage in storages(value)
        }
        for value in tree_flatten(result)[0]:
            if isinstance(value, Tensor):
                self._track(value, inputs)
        return result

    def _track(self, tensor: Tensor, inputs: set[int] = frozenset()) -> None:
        for storage in storages(tensor):
            self._track_storage(storage, inputs)

    def _track_storage(self, storage: Any, inputs: set[int]) -> None:
        key, size = id(storage), storage.nbytes()
        known = self._sizes.get(key)
        if known == size or (known is None and key in inputs):
            return
        if known is None:
            weakref.finalize(storage, self._free, key)
            self._tags[key] = self.tag
        self._sizes[key] = size
        self.live += size - (known or 0)
        self.window_peak = max(self.window_peak, self.live)
        if self.live > self.peak:
            self.peak = self.live
            if self.on_peak is not None:
                self.on_peak()

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._tags.pop(key, None)
