"""Processes killed mid-run: one of two torchrun processes (FSDP2, sharded checkpoints after
every step) is killed with SIGKILL at a planted point (``scripts/faulty_train.py``): as a step begins,
inside a DCP checkpoint write, just before a checkpoint's manifest, or its shard write fails
for a full disk. Afterwards every checkpoint that looks complete verifies, and ``--resume``
continues from the newest to exactly the uninterrupted run's losses.

CI tries the three points below; ``SLIMOPT_KILL_POINTS=N`` adds random distinct ones (seeded) up
to N.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from slimopt.train.checkpoint import checkpoints, verify_checkpoint

from .test_cli import metrics, run_args

pytestmark = pytest.mark.usefixtures("private_cache")

STEPS = 6
FIXED_POINTS = [("step", 1, 4), ("dcp-after", 0, 3), ("enospc", 1, 3)]
KINDS = ("step", "dcp-before", "dcp-after", "manifest", "enospc")


def _points() -> list[tuple[str, int, int]]:
    wanted = int(os.environ.get("SLIMOPT_KILL_POINTS", len(FIXED_POINTS)))
    chooser = random.Random(27)
    points = list(FIXED_POINTS)
    while len(points) < wanted:
        kind = chooser.choice(KINDS)
        point = (kind, 0 if kind == "manifest" else chooser.randrange(2), chooser.randint(1, STEPS))
        if point not in points:
            points.append(point)
    return points


def _torchrun(entry: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *entry]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=300, env=env)


def _flags(workspace: Path, out: Path) -> list[str]:
    options = ["--optimizer", "galore_adamw8bit", "--rank", "8", "--update-proj-gap", "3"]
    schedule = ["--steps", str(STEPS), "--save-every", "1", "--eval-every", "3", "--distributed", "fsdp2"]
    return ["train", *options, *schedule, *run_args(workspace, out)]


def _losses(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("val_loss")) for r in metrics(out)]


@pytest.fixture(scope="module")
def uninterrupted(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    out = tmp_path_factory.mktemp("kills") / "uninterrupted"
    finished = _torchrun(["-m", "slimopt.cli"], _flags(workspace, out))
    assert finished.returncode == 0, finished.stderr[-3000:]
    return _losses(out)


@pytest.mark.slow  # two torchrun launches per point: about 25 s each
@pytest.mark.parametrize(("point", "rank", "count"), _points())
def test_a_killed_run_resumes_exactly_from_its_newest_complete_checkpoint(
    workspace: Path, tmp_path: Path, uninterrupted, point: str, rank: int, count: int
) -> None:
    out = tmp_path / "run"
    script = str(Path(__file__).parent / "scripts" / "faulty_train.py")
    failed = _torchrun([script], [point, str(rank), str(count), "--", *_flags(workspace, out)])
    assert failed.returncode != 0, "the planted fault never fired"
    if point == "enospc":
        assert "could not write the checkpoint of step" in failed.stderr
        assert "No space left on device" in failed.stderr
    complete = checkpoints(out / "checkpoints")
    for checkpoint in complete:  # no partial checkpoint passes for a complete one
        verify_checkpoint(checkpoint)
        assert json.loads((checkpoint / "manifest.json").read_text())["layout"] == "sharded"
    assert len(complete) < STEPS
    if complete:
        again = _torchrun(["-m", "slimopt.cli"], ["train", "--resume", str(out)])
        assert f"resuming from step {int(complete[-1].name[5:])} of {STEPS}" in again.stderr
    else:  # killed before its first checkpoint: nothing to resume, the run starts over
        again = _torchrun(["-m", "slimopt.cli"], [*_flags(workspace, out), "--overwrite"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(out) == uninterrupted
