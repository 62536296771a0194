"""The 7B measurement script's path, dry-run on a small model on the CPU.

The GPU run of ``python -m benchmarks.memory_planner --device cuda --llama-7b`` costs scarce
device time; this runs the same functions on llama_9m so that a broken script fails here first.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory_planner import LLAMA_7B, llama_7b_row, llama_7b_runs


@pytest.mark.slow  # four configurations measured: ~10 s
def test_llama_7b_script_runs_every_configuration_on_a_small_model() -> None:
    runs = list(llama_7b_runs(torch.device("cpu"), 2, model="llama_9m", rank=32, vocab_size=512))
    assert [run["name"] for run in runs] == list(LLAMA_7B)
    for run in runs:
        assert run["cuda"] is None
        # On the CPU the measurement is exact live bytes, which the planner predicts.
        assert abs(run["predicted"] - run["live"]) <= 1e-3 * run["live"]
        assert run["state"] > 0 and run["steady"] > 0 and run["first"] > run["first_refresh"] > 0
        assert llama_7b_row(run).startswith(f"| {run['name']} |")
    by_name = {run["name"]: run for run in runs}
    assert by_name["ternary states, int8 bases"]["state"] < by_name["int8 states, int8 bases"]["state"]
    assert by_name["int8 states, int8 bases"]["state"] < by_name["int8 states, fp32 bases"]["state"]
    measured_only = next(
        llama_7b_runs(torch.device("cpu"), 2, False, model="llama_9m", rank=32, vocab_size=512)
    )
    assert measured_only["predicted"] is None and "| — | — |" in llama_7b_row(measured_only)
