"""The safety net under refactoring: every golden configuration (``tests/golden_runs.py``)
trains to state dicts and parameters bit-identical to the ones the code produced when the files
were written, and the checkpoints written then (``torch.save`` and DCP) load and continue
identically. Plus a snapshot of the public names and of every import path the README and the
manual (``docs/``) document.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import torch

import slimopt
from slimopt.distributed import checkpoint as dcp_checkpoint
from tests import golden_runs
from tests.golden_runs import FIRST_STEPS, MANIFEST, MORE_STEPS, RUNS, GoldenRun

MANIFESTED = json.loads(MANIFEST.read_text())
LATER = range(FIRST_STEPS, FIRST_STEPS + MORE_STEPS)

pytestmark = pytest.mark.skipif(
    torch.__version__.split("+")[0] != MANIFESTED["torch"].split("+")[0],
    reason=f"golden files were written with torch {MANIFESTED['torch']}; bits differ across versions",
)


def _differences(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What differs between two digests, named entry by entry."""
    names = sorted(found.keys() | expected.keys())
    return [
        f"{name}: {found.get(name)} != {expected.get(name)}"
        for name in names
        if found.get(name) != expected.get(name)
    ]


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.label)
def test_three_steps_then_two_are_bit_identical_to_the_golden_run(run: GoldenRun) -> None:
    expected = MANIFESTED["runs"][run.label]
    with golden_runs.one_thread():
        net = run.net()
        optimizer = run.optimizer(net)
        golden_runs.train(run, net, optimizer, range(FIRST_STEPS))
        assert _differences(golden_runs.digest(net, optimizer), expected["first"]) == []
        golden_runs.train(run, net, optimizer, LATER)
        assert _differences(golden_runs.digest(net, optimizer), expected["more"]) == []


@pytest.mark.parametrize("run", [run for run in RUNS if run.saved], ids=lambda run: run.label)
def test_a_golden_checkpoint_loads_and_continues_identically(run: GoldenRun) -> None:
    saved = torch.load(golden_runs.file_of(run), weights_only=True)
    with golden_runs.one_thread():
        net = run.net()
        optimizer = run.optimizer(net)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        assert _differences(golden_runs.digest(net, optimizer), MANIFESTED["runs"][run.label]["first"]) == []
        golden_runs.train(run, net, optimizer, LATER)
    assert _differences(golden_runs.digest(net, optimizer), MANIFESTED["runs"][run.label]["more"]) == []


@pytest.mark.parametrize(
    "run", [run for run in RUNS if run.saved and "betas" in run.options], ids=lambda run: run.label
)
def test_a_checkpoint_saved_before_a_default_changed_continues_with_its_own_hyperparameters(
    run: GoldenRun,
) -> None:
    """The ternary optimizers' default β₁ went from 0.9 to 0.7 after their golden checkpoints
    were saved: an optimizer built with today's defaults takes 0.9 back from the checkpoint, as
    ``torch.optim`` does, and continues the old run bit for bit."""
    saved = torch.load(golden_runs.file_of(run), weights_only=True)
    with golden_runs.one_thread():
        net = run.net()
        optimizer = run.configuration.build(net, **{k: v for k, v in run.options.items() if k != "betas"})
        assert optimizer.defaults["betas"] != run.options["betas"]
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        assert {tuple(group["betas"]) for group in optimizer.param_groups} == {run.options["betas"]}
        golden_runs.train(run, net, optimizer, LATER)
    assert _differences(golden_runs.digest(net, optimizer), MANIFESTED["runs"][run.label]["more"]) == []


@pytest.mark.parametrize("run", [run for run in RUNS if run.dcp], ids=lambda run: run.label)
def test_a_golden_distributed_checkpoint_loads_and_continues_identically(run: GoldenRun) -> None:
    with golden_runs.one_thread():
        net = run.net()
        optimizer = run.optimizer(net)
        dcp_checkpoint.load(golden_runs.dcp_of(run), net, optimizer)
        golden_runs.train(run, net, optimizer, LATER)
    assert _differences(golden_runs.digest(net, optimizer), MANIFESTED["runs"][run.label]["more"]) == []


PUBLIC_NAMES = [
    "APOLLOAdamW",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWTernary",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "GaLoreOptimizer",
    "LayerwiseHandle",
    "TACO",
    "available_optimizers",
    "build_optimizer",
    "decoded_state",
    "describe",
    "export_weights",
    "layerwise",
    "quantize_weights",
    "select_target_modules",
    "state_nbytes",
]


def test_the_public_names_are_unchanged() -> None:
    assert sorted(slimopt.__all__) == PUBLIC_NAMES
    assert all(hasattr(slimopt, name) for name in PUBLIC_NAMES)


def _resolves(path: str) -> bool:
    module, _, attribute = path.partition(":")
    if attribute:
        return hasattr(importlib.import_module(module), attribute)
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def test_every_import_path_the_readme_documented_still_resolves() -> None:
    paths = MANIFESTED["import_paths"]
    assert len(paths) > 20
    assert [path for path in paths if not _resolves(path)] == []


def test_what_import_slimopt_alone_made_reachable_still_is() -> None:
    """``import slimopt`` then ``slimopt.distributed.spread_refreshes(...)``: paths that worked
    as attributes (written at dabd4eb) keep working without importing their module."""
    expected = MANIFESTED["attribute_paths"]
    assert golden_runs.attribute_paths(expected) == expected


def test_the_readme_documents_no_import_path_outside_the_snapshot() -> None:
    """A newly documented path joins the snapshot (regenerate), so it is kept from then on."""
    assert sorted(golden_runs.documented_paths() - set(MANIFESTED["import_paths"])) == []
