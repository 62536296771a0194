"""Helpers the test files share: how far one result is from a reference, deterministic
gradients and token batches, and the training loop over them. (The table of configurations
generic tests run over is ``configurations.py``.)"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

Tensors = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def relative_error(actual: Tensors, expected: Tensors) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64, over a tensor or over lists or dicts of
    tensors taken as one vector (a dict's entries in ``expected``'s key order)."""
    return (
        (_flat(actual, expected) - _flat(expected, expected)).norm() / _flat(expected, expected).norm()
    ).item()


def _flat(tensors: Tensors, order: Tensors) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        return tensors.detach().double().flatten()
    if isinstance(tensors, Mapping):
        tensors = [tensors[key] for key in order]  # type: ignore[union-attr]
    return torch.cat([t.detach().double().flatten() for t in tensors])


def gradient(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A deterministic gradient with a decaying spectrum, different at every step."""
    generator = torch.Generator().manual_seed(1000 + step)
    if len(shape) < 2:
        return torch.randn(shape, generator=generator)
    rows, cols = shape[0], math.prod(shape[1:])
    k = min(rows, cols)
    spectrum = torch.logspace(0, -2, k)
    left = torch.linalg.qr(torch.randn(rows, k, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(cols, k, generator=generator)).Q
    return ((left * spectrum) @ right.T).reshape(shape)


def token_batch(step: int, shape: tuple[int, int] = (4, 32), vocab: int = 256) -> torch.Tensor:
    """Step ``step``'s batch of random tokens, the same in every process and every run."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(step))


def train_language_model(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, shape: tuple[int, int] = (4, 32)
) -> None:
    """One optimizer step of a causal language ``model`` per step in ``steps``, on
    ``token_batch(step, shape)`` (so a run split at any step continues as an unsplit one)."""
    for step in steps:
        batch = token_batch(step, shape)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def step_on_gradients(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, steps: range) -> None:
    """One optimizer step per step in ``steps``, each parameter given ``gradient(step, its shape)``."""
    for step in steps:
        for param in params:
            param.grad = gradient(step, tuple(param.shape))
        optimizer.step()


def steady_step_peak(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    weights: str,
    slice_numel: int,
    size: int = 2048,
) -> int:
    """The temporary bytes of a second step (the state exists) of ``make_optimizer([weight])``
    on a size×size bf16 weight (``weights``: "bf16" or "int8", an ``Int8Weight``) with a bf16
    gradient, when updates go by slices of ``slice_numel`` elements."""
    from slimopt.codecs import slicing
    from slimopt.memory import LiveBytes
    from slimopt.weight_formats import Int8Weight

    previous, slicing.SLICE_NUMEL = slicing.SLICE_NUMEL, slice_numel
    try:
        torch.manual_seed(0)
        value = torch.randn(size, size, dtype=torch.bfloat16)
        weight = nn.Parameter(Int8Weight.from_float(value) if weights == "int8" else value)
        optimizer = make_optimizer([weight])
        weight.grad = torch.randn(size, size, dtype=torch.bfloat16)
        optimizer.step()
        tracker = LiveBytes()
        with tracker:
            optimizer.step()
    finally:
        slicing.SLICE_NUMEL = previous
    return tracker.peak
