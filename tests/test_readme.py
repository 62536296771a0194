"""The README's bytes-per-parameter table is what state_nbytes measures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from slimopt import GaLoreAdamW, state_nbytes

README = Path(__file__).resolve().parents[1] / "README.md"
ROW = re.compile(r"^\| (fp32|bf16|int8|int4|ternary) \| ([\d.]+) \| ([\d.]+) \|$", re.MULTILINE)


def bytes_per_param(states: str, rank: int | None) -> float:
    weight = torch.zeros(2048, 2048, requires_grad=True)
    group = {"params": [weight]} if rank is None else {"params": [weight], "rank": rank}
    optimizer = GaLoreAdamW([group], lr=1e-3, states=states)
    weight.grad = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    return state_nbytes(optimizer) / weight.numel()


def test_bytes_per_parameter_table_matches_state_nbytes() -> None:
    rows = ROW.findall(README.read_text())
    assert [row[0] for row in rows] == ["fp32", "bf16", "int8", "int4", "ternary"]
    for states, plain, projected in rows:
        assert bytes_per_param(states, None) == pytest.approx(float(plain), abs=5e-4), states
        assert bytes_per_param(states, 512) == pytest.approx(float(projected), abs=5e-4), states
    assert float(dict((r[0], r[1]) for r in rows)["ternary"]) <= 0.35
