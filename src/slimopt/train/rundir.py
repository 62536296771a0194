"""Run directories: a fresh default for every run, no run started over another, ``--overwrite``.

A directory "holds a run" when it has any of a run's files (``config.json``, ``metrics.jsonl``,
``summary.json``, ``checkpoints/``, or a comparison's ``results.json``). Starting a run there
would mix or destroy the old one, so it is refused unless the run is resumed (``--resume``) or
replaced (``--overwrite``, which first renames the old run aside, an atomic step, then deletes
it). The default directory is new for every run: ``runs/<name>-<YYYYmmdd-HHMMSS>``.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from slimopt.train.checkpoint import MANIFEST

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "results.json")
RUNS = Path("runs")


def default_out(name: str) -> Path:
    """A directory under ``runs/`` that does not exist yet, named after ``name`` and the time."""
    base = RUNS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, number = base, 1
    while candidate.exists():
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate


def holds_run(path: Path) -> bool:
    """Whether ``path`` holds a run's files, or a comparison's (its runs are subdirectories)."""
    if not path.is_dir():
        return False
    return _has_run_files(path) or any(child.is_dir() and _has_run_files(child) for child in path.iterdir())


def _has_run_files(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_FILES)


def claim(out: Path, *, overwrite: bool) -> None:
    """Make ``out`` ready for a new run: refuse one that holds a run (``ValueError`` naming
    ``--resume``, ``--out`` and ``--overwrite``), or remove it first when ``overwrite``."""
    if not holds_run(out):
        return
    if not overwrite:
        raise ValueError(
            f"--out {out} already holds a run; continue it with --resume {out}, choose another --out, "
            "or pass --overwrite to replace it"
        )
    retired = out.with_name(f".{out.name}.replaced-{os.getpid()}")
    out.rename(retired)  # atomic: from here on the old run is gone from --out as a whole
    shutil.rmtree(retired)


def run_directory(resume: str | Path) -> Path:
    """The run a ``--resume`` path belongs to: the path itself, or for a checkpoint directory
    (``run/checkpoints/step-N``) the run two levels up."""
    path = Path(resume)
    return path.parent.parent if (path / MANIFEST).exists() else path
