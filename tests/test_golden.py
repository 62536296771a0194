"""The safety net under refactoring: every golden configuration (``tests/golden_runs.py``)
trains to state dicts and parameters bit-identical to the ones the code produced when the files
were written, and the checkpoints written then (``torch.save`` and DCP) load and continue
identically. The runs happen once, in a process whose CPU kernels are pinned, so the bits do not
depend on the machine. Plus a snapshot of the public names and of every import path the README
and the manual (``docs/``) document.
"""

from __future__ import annotations

import importlib
import json
import platform
from typing import Any

import pytest
import torch

import slimopt
from tests import golden_runs
from tests.golden_runs import MANIFEST, RUNS, GoldenRun

MANIFESTED = json.loads(MANIFEST.read_text())

same_torch_and_machine = pytest.mark.skipif(
    torch.__version__.split("+")[0] != MANIFESTED["torch"].split("+")[0]
    or platform.machine() != MANIFESTED["machine"],
    reason=f"golden digests were written with torch {MANIFESTED['torch']} on {MANIFESTED['machine']}; "
    "bits differ across versions and architectures",
)


@pytest.fixture(scope="module")
def found() -> dict[str, dict[str, Any]]:
    """Every golden run's digests, computed now in a pinned process."""
    return golden_runs.pinned_results()


@pytest.fixture(scope="module")
def expected(found) -> dict[str, Any]:
    """The manifest's digests for this kind of machine (``golden_runs.expected_runs``)."""
    return golden_runs.expected_runs(MANIFESTED, found)


def _differences(found: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What differs between two digests, named entry by entry."""
    names = sorted(found.keys() | expected.keys())
    return [
        f"{name}: {found.get(name)} != {expected.get(name)}"
        for name in names
        if found.get(name) != expected.get(name)
    ]


def test_a_machine_is_compared_with_the_set_of_digests_its_adamw_run_reproduces() -> None:
    """Two kinds of machine, two sets: each machine's own, found by its ``adamw`` run; a change
    of numbers reproduces neither and is compared with the first set (and fails there)."""

    def runs(bits: str) -> dict[str, Any]:
        return {"adamw": {"first": {"param/w": bits}}, "taco": {"first": {"param/w": bits + " taco"}}}

    manifest = {"runs": runs("intel"), "other machines": [{"written on": "AMD EPYC", "runs": runs("amd")}]}
    assert golden_runs.expected_runs(manifest, runs("amd")) == runs("amd")
    assert golden_runs.expected_runs(manifest, runs("intel")) == runs("intel")
    assert golden_runs.expected_runs(manifest, runs("changed")) == runs("intel")
    assert golden_runs.expected_runs(manifest, runs("changed"), strict=True) is None
    assert golden_runs.expected_runs({"runs": runs("intel")}, runs("amd")) == runs("intel")


def _recorded(run: GoldenRun, expected: dict[str, Any]) -> None:
    """Skip ``run`` where this kind of machine's set of digests has none of it: a configuration
    added after the set was written is added to the first set only (``--new-runs``, on the
    kind of machine that set is of)."""
    if run.label not in expected:
        pytest.skip(f"no digests of {run.label} for this kind of machine: written on the first kind only")


@same_torch_and_machine
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.label)
def test_three_steps_then_two_are_bit_identical_to_the_golden_run(run: GoldenRun, found, expected) -> None:
    _recorded(run, expected)
    assert _differences(found[run.label]["first"], expected[run.label]["first"]) == []
    assert _differences(found[run.label]["more"], expected[run.label]["more"]) == []


@same_torch_and_machine
@pytest.mark.parametrize("run", [run for run in RUNS if run.saved], ids=lambda run: run.label)
def test_a_golden_checkpoint_loads_and_continues_identically(run: GoldenRun, found, expected) -> None:
    _recorded(run, expected)
    assert _differences(found[run.label]["loaded"], expected[run.label]["loaded"]) == []
    assert _differences(found[run.label]["continued"], expected[run.label]["continued"]) == []


def test_loading_a_golden_checkpoint_gives_the_state_it_was_saved_with() -> None:
    """No pinning needed: loading moves bits without arithmetic, so this holds on any machine."""
    run = next(run for run in RUNS if run.label == "galore_adamw8bit (experts)")
    saved = torch.load(golden_runs.file_of(run), weights_only=True)
    net = run.net()
    optimizer = run.optimizer(net)
    net.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    assert _differences(golden_runs.digest(net, optimizer), MANIFESTED["runs"][run.label]["loaded"]) == []


@same_torch_and_machine
@pytest.mark.parametrize(
    "run", [run for run in RUNS if run.saved and "betas" in run.options], ids=lambda run: run.label
)
def test_a_checkpoint_saved_before_a_default_changed_continues_with_its_own_hyperparameters(
    run: GoldenRun, found, expected
) -> None:
    """The ternary optimizers' default β₁ went from 0.9 to 0.7 after their golden checkpoints
    were saved: an optimizer built with today's defaults takes 0.9 back from the checkpoint, as
    ``torch.optim`` does, and continues the old run bit for bit (the digest holds the groups)."""
    today = run.configuration.build(run.net(), **{k: v for k, v in run.options.items() if k != "betas"})
    assert today.defaults["betas"] != run.options["betas"]
    continued = expected[run.label]["continued"]
    assert _differences(found[run.label]["continued with today's defaults"], continued) == []


@same_torch_and_machine
@pytest.mark.parametrize("run", [run for run in RUNS if run.dcp], ids=lambda run: run.label)
def test_a_golden_distributed_checkpoint_loads_and_continues_identically(
    run: GoldenRun, found, expected
) -> None:
    continued = expected[run.label]["continued"]
    assert _differences(found[run.label]["continued from DCP"], continued) == []


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
    "Muon",
    "Muon4bit",
    "Muon8bit",
    "MuonTernary",
    "SlimoptOptimizer",
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
    """Every public name stays (names are only added: the base class's new one beside its old)."""
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
