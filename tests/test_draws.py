"""Counter-based draws (``slimopt.codecs.draws``): uniform, independent streams, and the same bits
however a stream is computed (whole, in parts, compiled), which is what lets a fused step round
exactly as the reference path does."""

from __future__ import annotations

import pytest
import torch

from slimopt.codecs.draws import draw_indices, random_words, stream_seed, uniform, uniform_from_words


def _seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32)


def test_draws_are_uniform_on_the_unit_interval() -> None:
    draws = uniform(_seed(12345), 1 << 20)
    assert float(draws.min()) >= 0.0 and float(draws.max()) < 1.0
    # Kolmogorov–Smirnov distance to U(0, 1); 1.63/√n is the 1% critical value.
    sorted_draws = draws.double().sort().values
    grid = torch.arange(1, draws.numel() + 1, dtype=torch.float64) / draws.numel()
    assert float((sorted_draws - grid).abs().max()) < 1.63 / draws.numel() ** 0.5
    neighbours = torch.corrcoef(torch.stack([draws[:-1], draws[1:]]))[0, 1]
    assert abs(float(neighbours)) < 5e-3


def test_streams_of_different_seeds_are_uncorrelated() -> None:
    first, second = uniform(_seed(7), 1 << 18), uniform(_seed(8), 1 << 18)
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 1e-2


def test_any_part_of_a_stream_is_computed_alone() -> None:
    seed = _seed(99)
    whole = random_words(seed, draw_indices(10_000, torch.device("cpu")))
    part = random_words(seed, torch.arange(4321, 5000, dtype=torch.int32))
    assert torch.equal(part, whole[4321:5000])


def test_compiled_draws_equal_eager_ones() -> None:
    def draws(seed: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return uniform_from_words(random_words(seed, draw_indices(count.numel(), count.device)))

    seed, count = _seed(2024), torch.empty(3001)
    assert torch.equal(torch.compile(draws)(seed, count), draws(seed, count))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_seeds_come_from_the_generator(device: str) -> None:
    def seeds() -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(5)
        return [stream_seed(generator, torch.device(device)) for _ in range(3)]

    first, again = seeds(), seeds()
    assert all(seed.device.type == device and seed.dtype == torch.int32 for seed in first)
    if device == "cpu":
        assert [int(s) for s in first] == [int(s) for s in again]
        assert len({int(s) for s in first}) == 3
