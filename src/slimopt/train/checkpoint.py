"""Training checkpoints that are written atomically and verified before anything is loaded.

A checkpoint is a directory ``step-NNNNNNNN`` holding ``model.safetensors``, ``optimizer.pt`` and
``trainer.pt`` (both ``torch.load(..., weights_only=True)``-loadable) and, written last, a
``manifest.json`` with every file's size and SHA-256. It is assembled in a hidden temporary
directory and renamed into place, so an interrupted save leaves the previous checkpoints as they
were and never a directory that looks complete. Loading reads and checks everything (manifest,
hashes, parameter names and shapes) before it touches the model or the optimizer.

In a multi-process run (``slimopt.train.parallel``) the first process writes these files (after
ZeRO has gathered the optimizer state onto it), except under FSDP2, where every process writes
its shards of model and optimizer into ``sharded/`` (``slimopt.distributed.checkpoint``) in
place of the first two files. A sharded checkpoint loads into any number of processes, one
included.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimopt.files import move_into_place
from slimopt.weight_formats import stored_dtype

MANIFEST = "manifest.json"
FILES = ("model.safetensors", "optimizer.pt", "trainer.pt")
SHARDED = "sharded"  # the DCP directory of a checkpoint written by every process
SHARDED_FILES = ("trainer.pt", f"{SHARDED}/.metadata")
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or from another model."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are missing, truncated or altered: an older one may be intact."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a failing file system); the
    checkpoints written before it are as they were."""


def save_checkpoint(
    directory: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer: dict[str, Any],
    *,
    sharded: bool = False,
) -> Path:
    """Write the checkpoint of ``step`` under ``directory`` and return its path.

    ``trainer`` holds the rest of the run's state (scheduler, RNG states, data position, …) as
    tensors and plain Python values. In a multi-process run every process calls this; with
    ``sharded`` (FSDP2) each writes its own shards, otherwise the first process writes alone.
    """
    from safetensors.torch import save_model
    from torch.distributed.checkpoint.api import CheckpointException

    from slimopt.distributed import checkpoint as sharded_checkpoint
    from slimopt.sharding import barrier, process_rank

    first = process_rank() == 0
    directory = Path(directory)
    final = directory / f"{PREFIX}{step:08d}"
    staging = directory / f".{final.name}.tmp"
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO: the whole state onto the first process
        optimizer.consolidate_state_dict(to=0)
    try:
        if first:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
        barrier()
        if sharded:
            sharded_checkpoint.write(staging / SHARDED, model, optimizer)
        if first:
            if not sharded:
                save_model(model, str(staging / "model.safetensors"))
                torch.save(optimizer.state_dict(), staging / "optimizer.pt")
            torch.save(trainer, staging / "trainer.pt")
            _seal(staging, step, SHARDED if sharded else "whole")
            move_into_place(staging, final)  # re-saving a step replaces it
            _fsync(directory)
    except (OSError, CheckpointException) as error:
        if first:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {step} ({_cause(error)}); the checkpoints "
            f"before it in {directory} are as they were"
        ) from error
    barrier()
    return final


def _seal(staging: Path, step: int, layout: str) -> None:
    """Write the manifest of the finished files in ``staging`` (last), then flush everything
    to the disk: a checkpoint with a manifest is complete."""
    files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    described = {name: _describe(staging / name) for name in files}
    manifest = {"step": step, "layout": layout, "files": described}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for path in staging.rglob("*"):
        _fsync(path)


def _cause(error: BaseException) -> str:
    """The first line of what went wrong (DCP gathers the processes' failures into one)."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, failure = next(iter(failures.items()))
        return f"process {rank}: {_cause(failure[0] if isinstance(failure, tuple) else failure)}"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint with the highest step under ``directory`` that has a manifest, or None.

    Raises ``CheckpointError`` when ``directory`` does not exist."""
    complete = checkpoints(directory)
    return complete[-1] if complete else None


def checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoints under ``directory`` that have a manifest, oldest first. Raises
    ``CheckpointError`` when ``directory`` does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    return sorted(p for p in directory.glob(f"{PREFIX}*") if (p / MANIFEST).exists())


def newest_intact(directory: str | Path, before: Path) -> Path | None:
    """The newest checkpoint under ``directory`` older than ``before`` that verifies, or None."""
    for path in reversed(checkpoints(directory)):
        if path.name < before.name:
            try:
                verify_checkpoint(path)
            except CheckpointError:
                continue
            return path
    return None


def step_of(path: Path) -> int:
    """The step of the checkpoint directory ``path`` (``step-00000012``: 12)."""
    return int(path.name[len(PREFIX) :])


def checkpoint_to_resume(resume: str | Path, steps: int, *, continues_its_run: bool) -> Path:
    """The checkpoint ``--resume`` names: a checkpoint directory, or a run's (or a checkpoint
    directory's parent's) newest complete one.

    Raises ``CheckpointError`` when there is none, when it is past ``steps`` (the run would
    end before it began), and, when the run continues in its own directory
    (``continues_its_run``), when a newer checkpoint of the run verifies: training from the
    older one would replace it. Checks nothing of the files' contents but the newer ones'."""
    path = Path(resume)
    if (path / MANIFEST).exists():
        directory, checkpoint = path.parent, path
    else:
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        checkpoint = latest_checkpoint(directory)
        if checkpoint is None:
            raise CheckpointError(f"no checkpoint under {str(resume)!r} to resume from")
    step = step_of(checkpoint)
    if step > steps:
        raise CheckpointError(
            f"--steps {steps} is below the step of the checkpoint to resume from ({checkpoint}, step "
            f"{step}); pass --steps {step} or more"
        )
    if continues_its_run:
        for newer in [c for c in checkpoints(directory) if c.name > checkpoint.name]:
            try:
                verify_checkpoint(newer)
            except CheckpointError:
                continue  # a damaged one would be replaced when the run gets there again
            raise CheckpointError(
                f"{newer} is newer than {checkpoint}; continuing from step {step} in the same run "
                "would replace it: resume the run's newest checkpoint, or continue this one into "
                "another directory with --out"
            )
    return checkpoint


def load_resumed(checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``load_checkpoint``, whose error also names the newest intact checkpoint older than a
    damaged ``checkpoint``, to resume from instead (one that does not fit the run is not
    damaged: an older one of the same run would not fit either)."""
    try:
        return load_checkpoint(checkpoint, model, optimizer)
    except CheckpointDamaged as error:
        older = newest_intact(checkpoint.parent, before=checkpoint)
        if older is None:
            raise
        raise CheckpointError(f"{error}; the newest intact checkpoint is {older}: --resume {older}") from None


def verify_checkpoint(path: str | Path) -> None:
    """Raise ``CheckpointDamaged`` unless every file of the checkpoint at ``path`` is present
    and matches the size and SHA-256 its manifest records."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointDamaged(f"{path} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointDamaged(f"{manifest_path} is corrupt: {error}") from error
    required = SHARDED_FILES if manifest.get("layout") == SHARDED else FILES
    for name in sorted({*required, *expected}):
        file = path / name
        if not file.exists():
            raise CheckpointDamaged(f"checkpoint {path} is incomplete: {name} is missing")
        if _describe(file) != expected.get(name):
            raise CheckpointDamaged(f"checkpoint {path} is corrupt: {name} does not match its manifest entry")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Verify the checkpoint at ``path``, then restore ``model`` and ``optimizer`` from it and
    return the trainer state. Raises ``CheckpointError`` (and changes nothing) when a file is
    missing, truncated or altered, or when the parameters do not match ``model``. In a
    multi-process run every process calls this; the first one verifies the files."""
    from safetensors.torch import load_file

    from slimopt.distributed import checkpoint as sharded_checkpoint
    from slimopt.sharding import from_first, is_sharded, process_rank

    path = Path(path)
    problem = None
    if process_rank() == 0:
        try:
            verify_checkpoint(path)
        except CheckpointDamaged as error:
            problem = str(error)
    problem = from_first(problem)
    if problem is not None:
        raise CheckpointDamaged(problem)
    layout = json.loads((path / MANIFEST).read_text()).get("layout", "whole")
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    if layout == SHARDED:
        if hasattr(optimizer, "consolidate_state_dict"):
            raise CheckpointError(
                f"checkpoint {path} was written by FSDP2 processes; ZeRO-1 resumes from its own "
                "checkpoints: resume it with --distributed fsdp2, ddp, or one process"
            )
        try:
            sharded_checkpoint.load(path / SHARDED, model, optimizer)
        except ValueError as error:
            raise CheckpointError(f"checkpoint {path}: {error}") from None
        return trainer
    if any(is_sharded(p) for p in model.parameters()):
        raise CheckpointError(
            f"checkpoint {path} holds whole tensors (written by one process, DDP or ZeRO-1); FSDP2 "
            "resumes from the sharded checkpoints of FSDP2 runs: resume this run with --distributed "
            "ddp or zero1, or in one process"
        )
    weights = load_file(str(path / "model.safetensors"))
    own = model.state_dict()
    _check_weights_dtype(path, own, weights)
    _check_model(path, own, weights)
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
    model.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(optimizer_state)
    return trainer


def _check_weights_dtype(path: Path, own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    """Int8 weights (codes and scales) load only into int8 weights and float ones only into
    float ones; fp32, bf16 and bf16 with a correction load into each other (rounded to nearest
    where the run's weights hold less)."""
    saved, ours = stored_dtype(weights), stored_dtype(own)
    if (saved == "int8") != (ours == "int8"):
        instead = "int8" if saved == "int8" else f"{saved} (or another float dtype)"
        raise CheckpointError(
            f"checkpoint {path} holds {saved} weights and this run's are {ours}: int8 weights do not "
            f"turn into float ones or back on resume; resume with --dtype {instead}"
        )


def _check_model(path: Path, own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    """Every saved tensor must be a tensor of the model's state ``own`` of the same shape, and
    every model parameter must be saved (tied parameters are saved once under one of their
    names)."""
    for name, tensor in weights.items():
        if name not in own or own[name].shape != tensor.shape:
            shape = tuple(own[name].shape) if name in own else "absent"
            raise CheckpointError(
                f"checkpoint {path} is from another model: {name} has shape {tuple(tensor.shape)} there, "
                f"{shape} in this model"
            )
    saved = {own[name].data_ptr() for name in weights}
    missing = [name for name, tensor in own.items() if tensor.data_ptr() not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path} is from another model: it has no {missing[0]}")


def _describe(file: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with file.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 22), b""):
            digest.update(chunk)
    return {"bytes": file.stat().st_size, "sha256": digest.hexdigest()}


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
