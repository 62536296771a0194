"""The fine-tuning comparison script end to end, on a tiny setting."""

from __future__ import annotations

import json

import pytest

from benchmarks import finetune_genre

pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.mark.slow  # pretraining and nine fine-tunes: ~7 s
def test_finetune_comparison_runs_end_to_end(tmp_path) -> None:
    pytest.importorskip("peft")
    finetune_genre.main(["--tiny", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {r["row"]: r for r in results["rows"]}
    assert list(rows) == [row.name for row in finetune_genre.ROWS]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows.values())
    assert 0.0 < results["majority"] < 1.0
    full = rows["full, AdamW"]
    assert (
        rows["full, AdamW ternary"]["state_bytes"]
        < rows["full, AdamW int8"]["state_bytes"]
        < full["state_bytes"]
    )
    assert rows["GaLore r=4"]["state_bytes"] < rows["GaLore r=8"]["state_bytes"] < full["state_bytes"]
    assert rows["LoRA r=4"]["trainable_parameters"] < rows["LoRA r=8"]["trainable_parameters"]
    assert rows["LoRA r=8"]["trainable_parameters"] < full["trainable_parameters"] / 5
    assert "| GaLore r=8, ternary |" in (tmp_path / "results.md").read_text()
