"""The README's bytes-per-parameter table is what state_nbytes measures."""

from __future__ import annotations

import json
import math
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


def _cases(module) -> tuple[int, int]:
    """(cases that behave as torch.optim, deliberate differences) of a conformance module: each
    test's parametrizations multiplied out."""
    conforming = deliberate = 0
    for name, test in vars(module).items():
        if not name.startswith("test_"):
            continue
        marks = getattr(test, "pytestmark", [])
        count = math.prod(len(mark.args[1]) for mark in marks if mark.name == "parametrize")
        if any(mark.name == "deliberate" for mark in marks):
            deliberate += count
        else:
            conforming += count
    return conforming, deliberate


def test_the_conformance_counts_are_the_suites() -> None:
    from tests import test_torch_optim_conformance

    conforming, deliberate = _cases(test_torch_optim_conformance)
    claim = re.search(
        r"Of its (\d+) cases, (\d+) behave as torch.optim does and (\d+) are deliberate", README.read_text()
    )
    assert claim is not None
    assert tuple(int(n) for n in claim.groups()) == (conforming + deliberate, conforming, deliberate)


SHORT_COMMAND = "slimopt compare --preset demo --steps 12 --eval-every 6"
SHORT_ROW = re.compile(r"^\| (\w+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", re.MULTILINE)


@pytest.mark.usefixtures("private_cache")
def test_the_quoted_short_comparison_reproduces(tmp_path, capsys) -> None:
    """The README quotes a 12-step comparison on the built-in corpus; on this kind of machine (2
    threads) it reproduces every validation loss to the documented 2e-4 (1e-3 for ternary
    states, where a last-bit difference becomes another stochastic rounding), so the numbers
    cannot drift from the code unnoticed."""
    from slimopt.cli import main

    text = README.read_text()
    section = text[text.index(SHORT_COMMAND) :]
    quoted = {name: float(loss) for name, loss in SHORT_ROW.findall(section[: section.index("\n\n", 200)])}
    assert list(quoted) == ["adamw", "galore_adamw", "galore_adamw8bit", "galore_adamw_ternary"]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        argv = [*SHORT_COMMAND.split()[1:], "--out", str(tmp_path / "short")]
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    results = json.loads((tmp_path / "short" / "results.json").read_text())
    for result in results:
        tolerance = 1e-3 if result["optimizer"].endswith("ternary") else 2e-4
        assert result["val_loss"] == pytest.approx(quoted[result["optimizer"]], abs=tolerance), result[
            "optimizer"
        ]
