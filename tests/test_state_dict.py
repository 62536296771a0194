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
    ("name", "dtype", "states"),
    [
        ("galore_adamw", torch.float32, None),
        ("galore_adamw", torch.bfloat16, None),
        ("galore_adafactor", torch.float32, None),
        ("galore_adafactor", torch.bfloat16, None),
        ("adamw", torch.bfloat16, None),
        # Compressed states, stochastic rounding included; rank 64 keeps the projected states
        # of this small model above the 4096 elements under which states stay fp32.
        ("adamw8bit", torch.bfloat16, None),
        ("galore_adamw4bit", torch.float32, None),
        ("galore_adamw_ternary", torch.float32, None),
        ("galore_adamw_ternary", torch.bfloat16, None),
        ("galore_adamw", torch.float32, "bf16"),
    ],
)
def test_resume_mid_subspace_is_bit_exact(name: str, dtype: torch.dtype, states: str | None) -> None:
    options: dict = {} if states is None else {"states": states}
    if name.startswith("galore"):
        options |= {"rank": 4 if name in ("galore_adamw", "galore_adafactor") and not states else 64}
        options |= {"update_proj_gap": 5}
    lr = 1e-2 if name != "galore_adafactor" else None

    uninterrupted = tiny_llama(0).to(dtype)
    optimizer = build_optimizer(uninterrupted, name, lr=lr, **options)
    train(uninterrupted, optimizer, 12)

    first = tiny_llama(0).to(dtype)
    optimizer = build_optimizer(first, name, lr=lr, **options)
    train(first, optimizer, 7)  # stop between the refreshes at steps 5 and 10
    stored = [(key, value) for state in optimizer.state.values() for key, value in state.items()]
    if name.endswith(("8bit", "4bit", "ternary")):
        assert any(key.endswith(".codes") for key, _ in stored)
    if states == "bf16":
        assert any(isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 for _, value in stored)
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
