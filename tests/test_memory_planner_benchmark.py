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


def test_the_presets_script_tabulates_and_plots_each_plan_term_by_term(tmp_path) -> None:
    """``benchmarks.presets_memory`` on a small preset: one row per plan whose terms sum to
    its peak, a goal only where the preset has one, and the plot written."""
    from argparse import Namespace

    from benchmarks.presets_memory import run
    from slimopt.planner import TERMS

    plot = tmp_path / "plot.png"
    optimizers = ["taco", "apollo_mini"]
    args = Namespace(out=str(tmp_path), plot=str(plot), models=["llama_9m"], optimizers=optimizers)
    args.dtype = "int8-embed"
    results = run(args)
    assert [(r["model"], r["optimizer"]) for r in results["rows"]] == [("llama_9m", o) for o in optimizers]
    for row in results["rows"]:
        assert sum(row["at_peak"][term] for term in TERMS) == row["peak_bytes"] and row["goal_gib"] is None
    table = (tmp_path / "results.md").read_text().splitlines()
    assert table[0].startswith("| model | optimizer | peak GiB | goal GiB | weights | states |")
    assert len(table) == 4 and table[2].startswith("| llama_9m | taco | ") and plot.stat().st_size > 0
