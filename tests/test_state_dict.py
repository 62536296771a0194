"""state_dict: weights_only loading and bit-exact resumption in the middle of a subspace."""

from __future__ import annotations

import io

import pytest
import torch

from slimopt import build_optimizer

from .conftest import tiny_llama


def train(model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        generator = torch.Generator().manual_seed(step)
        batch = torch.randint(0, 256, (4, 32), generator=generator)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def roundtrip(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("galore_adamw", torch.float32),
        ("galore_adamw", torch.bfloat16),
        ("galore_adafactor", torch.float32),
        ("galore_adafactor", torch.bfloat16),
        ("adamw", torch.bfloat16),
    ],
)
def test_resume_mid_subspace_is_bit_exact(name: str, dtype: torch.dtype) -> None:
    options = {"rank": 4, "update_proj_gap": 5} if name != "adamw" else {}
    lr = 1e-2 if name != "galore_adafactor" else None

    uninterrupted = tiny_llama(0).to(dtype)
    optimizer = build_optimizer(uninterrupted, name, lr=lr, **options)
    train(uninterrupted, optimizer, 12)

    first = tiny_llama(0).to(dtype)
    optimizer = build_optimizer(first, name, lr=lr, **options)
    train(first, optimizer, 7)  # stop between the refreshes at steps 5 and 10
    saved_model = roundtrip(first.state_dict())
    saved_optimizer = roundtrip(optimizer.state_dict())

    resumed = tiny_llama(1).to(dtype)
    resumed.load_state_dict(saved_model)
    optimizer = build_optimizer(resumed, name, lr=lr, **options)
    optimizer.load_state_dict(saved_optimizer)
    train(resumed, optimizer, 5, start=7)

    for (key, a), b in zip(uninterrupted.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), key


def test_state_dict_holds_only_tensors_and_numbers() -> None:
    model = tiny_llama(0).bfloat16()
    optimizer = build_optimizer(model, "galore_adamw", lr=1e-2, rank=4)
    train(model, optimizer, 2)
    state = optimizer.state_dict()["state"]
    for values in state.values():
        for value in values.values():
            assert isinstance(value, (torch.Tensor, int, float))
    loaded = roundtrip(optimizer.state_dict())
    optimizer.load_state_dict(loaded)
    for values in optimizer.state.values():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == torch.float32, key
