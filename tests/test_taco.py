"""TACO's rule core (``slimopt.rules.taco``): the column-wise one-sparse direction against a
brute-force maximizer, the sketch against the dense moving average it approximates."""

from __future__ import annotations

import itertools

import pytest
import torch

from slimopt.rules import taco


def _normalized_one_to_one(direction: torch.Tensor) -> float:
    """The dimension-normalized 1→1 operator norm: the largest column ℓ1 norm, times n/m."""
    rows, cols = direction.shape
    return float(direction.abs().sum(dim=0).max()) * cols / rows


@pytest.mark.parametrize("shape", [(3, 2), (2, 3), (3, 3)])
def test_the_direction_is_the_maximizer_over_the_unit_ball(shape) -> None:
    """A linear function's maximum over the unit ball (a product of scaled ℓ1 balls, one per
    column) is at a vertex: every column ±(m/n) at one row. All vertices are tried."""
    rows, cols = shape
    generator = torch.Generator().manual_seed(0)
    scale = taco.direction_scale(shape)
    vertices = [(sign * scale, row) for row in range(rows) for sign in (-1, 1)]
    for _ in range(5):
        grad = torch.randn(shape, generator=generator)
        best = max(
            sum(value * float(grad[row, col]) for col, (value, row) in enumerate(choice))
            for choice in itertools.product(vertices, repeat=cols)
        )
        direction = taco.dense_direction(*taco.column_top1(grad), shape)
        assert _normalized_one_to_one(direction) == pytest.approx(1.0)
        assert float((grad * direction).sum()) == pytest.approx(best, rel=1e-6)
        assert ((direction != 0).sum(dim=0) == 1).all()
        assert torch.allclose(direction[direction != 0].abs(), torch.tensor(scale))


def test_the_update_touches_one_entry_per_column() -> None:
    weights = torch.randn(6, 4)
    before = weights.clone()
    rows, signs = taco.column_top1(torch.randn(6, 4))
    taco.apply_direction(weights, rows, signs, step=0.1)
    changed = weights != before
    assert (changed.sum(dim=0) == 1).all()
    expected = before - 0.1 * taco.dense_direction(rows, signs, (6, 4))
    assert torch.allclose(weights, expected)


def test_a_sketch_with_a_slot_for_every_row_is_the_dense_average() -> None:
    """k ≥ m, fp32 values: the sketch's source equals the dense moving average's, step by step,
    and its values are the average's exactly."""
    shape = (12, 7)
    generator = torch.Generator().manual_seed(1)
    sketch = taco.empty_sketch(shape, 16, "fp32", torch.device("cpu"))
    average = torch.zeros(shape)
    for _ in range(20):
        grad = torch.randn(shape, generator=generator) * torch.rand(shape, generator=generator)
        taco.update_sketch(sketch, grad, 0.9)
        expected = taco.dense_ema_source(average, grad, 0.9)
        for ours, theirs in zip(taco.sketch_source(sketch, shape), expected, strict=True):
            assert torch.equal(ours, theirs)
        dense = torch.zeros(shape).scatter_(0, sketch["sketch_rows"].long(), taco.sketch_values(sketch))
        assert torch.equal(dense, average)


def test_a_persistent_heavy_hitter_survives_eviction() -> None:
    """Row 3 of every column gets a steady 1.0; every step another row gets a one-off spike of
    3.0, which enters above it ((1 − β)·3 against (1 − β)·1) and decays. With k = 4, more slots
    than spikes that outweigh row 3 at any time, the spikes come and go while row 3 stays and,
    once its average passes theirs, is the source."""
    shape, beta = (40, 5), 0.9
    sketch = taco.empty_sketch(shape, 4, "fp8", torch.device("cpu"))
    for step in range(30):
        grad = torch.zeros(shape)
        grad[3] = 1.0
        grad[(step * 7 + 11) % 40 if (step * 7 + 11) % 40 != 3 else 0] = 3.0
        taco.update_sketch(sketch, grad, beta)
        if step >= 10:
            rows, signs = taco.sketch_source(sketch, shape)
            assert (rows == 3).all() and (signs == 1).all(), step
            assert (sketch["sketch_rows"] == 3).any(dim=0).all()


def test_vanilla_takes_the_gradient() -> None:
    grad = torch.randn(9, 5)
    rows, signs = taco.column_top1(grad)
    assert torch.equal(rows, grad.abs().argmax(dim=0))
    assert torch.equal(signs, torch.sign(grad[rows, torch.arange(5)]))


@pytest.mark.parametrize(("rows", "k", "values", "expected"), [
    (4096, 16, "fp8", 52),
    (4096, 27, "fp8", 85),
    (40000, 16, "fp8", 84),
    (4096, 16, "fp32", 100),
    (8, 16, "fp8", 28),
])  # fmt: skip
def test_bytes_per_column_are_as_documented(rows, k, values, expected) -> None:
    assert taco.sketch_nbytes_per_column(rows, k, values) == expected
    sketch = taco.empty_sketch((rows, 3), k, values, torch.device("cpu"))
    stored = sum(t.numel() * t.element_size() for t in sketch.values())
    assert stored == 3 * expected


def test_fp8_values_keep_a_columns_largest_slot_to_a_few_percent() -> None:
    shape = (64, 8)
    sketch = taco.empty_sketch(shape, 4, "fp8", torch.device("cpu"))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    taco.update_sketch(sketch, grad, 0.0)  # β = 0: the slots hold the gradient's top 4
    top = grad.abs().topk(4, dim=0).values
    held = taco.sketch_values(sketch).abs().sort(dim=0, descending=True).values
    assert torch.allclose(held, top, rtol=0.07)
