"""Run directories: a fresh default for every run, nothing of anyone's ever overwritten.

A run directory holds a run's files (``config.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoints/``); a comparison's holds ``results.json``, ``results.md``, ``losses.png`` and one
run directory per optimizer. A new run starts only in a directory that does not exist or is
empty: one that holds a run is refused unless the run is resumed (``--resume``) or replaced
(``--overwrite``), and one that holds anything else (a model folder, the working directory) is
always refused, ``--overwrite`` or not, since slimopt would delete what it did not write.

A run holds a lock (``.slimopt.lock``, ``fcntl.flock``) for as long as its process lives, so a
second process can neither resume nor replace a run that is still training; the lock goes with
the process however it ends. ``--overwrite`` renames the old run aside (an atomic step) under
that lock, and deletes it only when the new run is about to write its first file: every check of
the new run's input comes first. The default directory is new for every run:
``runs/<name>-<YYYYmmdd-HHMMSS>``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import IO

from slimopt.train.checkpoint import MANIFEST

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints")
COMPARISON_FILES = ("results.json", "results.md", "losses.png")
LOCK = ".slimopt.lock"
# Keys every slimopt run's config.json has (a Hugging Face model's config.json has none of them).
CONFIG_KEYS = ("model", "optimizer", "steps", "seed", "optimizer_options")
RUNS = Path("runs")


def default_out(name: str) -> Path:
    """A directory under ``runs/`` that does not exist yet, named after ``name`` and the time."""
    base = RUNS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, number = base, 1
    while candidate.exists():
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate


def is_run(path: Path) -> bool:
    """Whether ``path`` is a slimopt run's directory (it has one of a run's files, and a
    ``config.json`` there is a run's)."""
    if not path.is_dir() or not any((path / name).exists() for name in RUN_FILES):
        return False
    config = path / "config.json"
    return not config.exists() or _is_run_config(config)


def _is_run_config(path: Path) -> bool:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(values, dict) and all(key in values for key in CONFIG_KEYS)


def foreign_entries(path: Path) -> list[str]:
    """The names of what ``path`` holds that no slimopt run or comparison wrote."""
    written = (*RUN_FILES, *COMPARISON_FILES)
    ours = {*written, LOCK, *(f".{name}.tmp" for name in written)}  # and a write a kill cut short
    foreign = []
    for entry in sorted(path.iterdir()):
        if entry.name in ours and (entry.name != "config.json" or _is_run_config(entry)):
            continue
        if entry.is_dir() and is_run(entry) and not foreign_entries(entry):
            continue  # one optimizer's run of a comparison
        foreign.append(entry.name)
    return foreign


def check_out(out: Path, *, overwrite: bool) -> None:
    """Raise ``ValueError`` unless a new run may start in ``out``, changing nothing: ``out``
    must not exist, be empty, or (with ``overwrite``) hold only a slimopt run or comparison
    that no process is running, and must not hold the working directory."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory; choose another --out")
    if not any(out.iterdir()):
        return
    foreign = foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(
            f"--out {out} holds files that are not a slimopt run's ({shown}); choose a new or empty "
            "directory (--overwrite replaces only a slimopt run)"
        )
    in_use = _locked_by(out)
    if in_use is not None:
        raise ValueError(
            f"--out {out} is in use by a running slimopt process ({in_use}); wait for it to end or "
            "choose another --out"
        )
    if not overwrite:
        raise ValueError(
            f"--out {out} already holds a run; continue it with --resume {out}, choose another --out, "
            "or pass --overwrite to replace it"
        )
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise ValueError(
            f"--out {out} holds the working directory; --overwrite would delete it: run from elsewhere "
            "or choose another --out"
        )


def check_free(run: Path) -> None:
    """Raise ``ValueError`` when a running slimopt process holds the run ``run`` (its lock)."""
    in_use = _locked_by(run)
    if in_use is not None:
        raise ValueError(
            f"run {run} is in use by a running slimopt process ({in_use}); wait for it to end "
            "before resuming it"
        )


class RunLock:
    """The lock a run holds on its directory for its process's lifetime (``release`` ends it)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream: IO[str] | None = stream

    def release(self) -> None:
        """Give the directory up (the process's end does so too)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def claim(out: Path, *, overwrite: bool, resume: bool = False) -> RunLock:
    """Take ``out`` for a run about to write its first file, and return its lock.

    A new run: ``check_out`` again, then an old run there (``overwrite``) is renamed aside and
    deleted under its own lock. ``resume``: the run already in ``out`` continues (refused while
    another process holds it). Raises ``ValueError`` naming the problem."""
    if resume:
        check_free(out)
    else:
        check_out(out, overwrite=overwrite)
        if out.exists() and any(out.iterdir()):
            _replace(out)
    out.mkdir(parents=True, exist_ok=True)
    stream = _try_lock(out)
    if stream is None:
        raise ValueError(f"--out {out} was taken by another slimopt process while this one started")
    return RunLock(stream)


def _replace(out: Path) -> None:
    """Delete the run (or comparison) in ``out``: renamed aside first, under its lock, so that
    from that instant ``out`` holds none of it."""
    stream = _try_lock(out, mark=False)
    if stream is None:
        raise ValueError(f"--out {out} is in use by a running slimopt process; choose another --out")
    try:
        retired = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(retired)
    finally:
        stream.close()
    shutil.rmtree(retired)


def _try_lock(directory: Path, *, mark: bool = True) -> IO[str] | None:
    """The open lock file of ``directory`` with an exclusive lock held (and, with ``mark``, this
    process's id written in it), or None when another process holds it. On a platform without
    ``fcntl`` nothing is locked."""
    try:
        import fcntl
    except ImportError:  # not POSIX: runs are not protected from a second process
        return open(os.devnull, "w")
    stream = open(directory / LOCK, "a+")  # noqa: SIM115 (held open as the lock)
    try:
        fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        stream.close()
        return None
    if mark:
        stream.seek(0)
        stream.truncate()
        stream.write(f"pid {os.getpid()}\n")
        stream.flush()
    return stream


def _locked_by(directory: Path) -> str | None:
    """Who holds ``directory``'s lock (or a lock of one of its runs), or None."""
    for candidate in [directory, *(d for d in directory.iterdir() if d.is_dir())]:
        if not (candidate / LOCK).exists():
            continue
        stream = _try_lock(candidate, mark=False)
        if stream is None:
            holder = (candidate / LOCK).read_text().strip() or "pid unknown"
            return holder if candidate == directory else f"{holder}, in {candidate}"
        stream.close()
    return None


def run_directory(resume: str | Path) -> Path:
    """The run a ``--resume`` path belongs to: the path itself, or for a checkpoint directory
    (``run/checkpoints/step-N``) the run two levels up."""
    path = Path(resume)
    return path.parent.parent if (path / MANIFEST).exists() else path
