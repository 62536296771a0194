"""Faults in one process: a full disk during a checkpoint write, Ctrl-C during evaluation, during a
checkpoint write, during a comparison and before training. Nothing saved is lost, every error
names its cause in one line, and the run resumes to exactly the uninterrupted run's losses.
(Processes killed with SIGKILL under torchrun: ``test_kills.py``.)"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
import torch

import slimopt.train.loop
from slimopt.cli import main
from slimopt.train.checkpoint import checkpoints, verify_checkpoint

from .test_cli import metrics, run_args

pytestmark = pytest.mark.usefixtures("private_cache")
STEPS = ["--steps", "6", "--save-every", "2", "--eval-every", "3"]


@pytest.fixture(scope="module")
def uninterrupted(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("faults") / "uninterrupted"
    assert main(["train", *run_args(workspace, out), *STEPS]) == 0
    return metrics(out)


def _losses(records: list[dict]) -> list[tuple[int, float, float | None]]:
    return [(r["step"], r["loss"], r.get("val_loss")) for r in records]


def _resume_and_compare(out: Path, uninterrupted: list[dict]) -> None:
    for checkpoint in checkpoints(out / "checkpoints"):
        verify_checkpoint(checkpoint)  # every checkpoint that looks complete is
    assert main(["train", "--resume", str(out)]) == 0
    assert _losses(metrics(out)) == _losses(uninterrupted)


def test_a_full_disk_during_a_checkpoint_write_keeps_the_earlier_ones(
    workspace: Path, tmp_path: Path, uninterrupted, monkeypatch, capsys
) -> None:
    out = tmp_path / "run"
    save = torch.save

    def out_of_space(value, file, *args, **kwargs):
        if "step-00000004" in str(file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return save(value, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", out_of_space)
    assert main(["train", *run_args(workspace, out), *STEPS]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("slimopt: error:") == 1
    error = err.splitlines()[-1]
    assert error.startswith("slimopt: error: could not write the checkpoint of step 4 ([Errno 28] No space")
    assert "the checkpoints before it" in error
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]  # no staging left
    monkeypatch.setattr(torch, "save", save)
    _resume_and_compare(out, uninterrupted)


def _interrupt_once(function):
    """``function`` that sends this process SIGINT the first time it is called, then runs."""
    sent = []

    def interrupted(*args, **kwargs):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
        return function(*args, **kwargs)

    return interrupted


@pytest.mark.parametrize("where", ["evaluate", "save_checkpoint"])
def test_ctrl_c_during_evaluation_or_a_checkpoint_write_finishes_it_and_stops(
    workspace: Path, tmp_path: Path, uninterrupted, where: str, monkeypatch, capsys
) -> None:
    """The signal only asks the loop to stop: the evaluation or the write in progress finishes,
    the step ends with a checkpoint, and the run continues exactly where it stopped."""
    out = tmp_path / "run"
    monkeypatch.setattr(slimopt.train.loop, where, _interrupt_once(getattr(slimopt.train.loop, where)))
    assert main(["train", *run_args(workspace, out), *STEPS]) == 130
    err = capsys.readouterr().err
    assert "interrupted at step" in err and f"--resume {out}" in err
    stopped = metrics(out)[-1]["step"]
    assert stopped < 6 and checkpoints(out / "checkpoints")[-1].name == f"step-{stopped:08d}"
    monkeypatch.undo()
    _resume_and_compare(out, uninterrupted)


def test_ctrl_c_during_a_comparison_keeps_its_finished_and_interrupted_runs(
    workspace: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    out = tmp_path / "compare"
    argv = ["compare", *run_args(workspace, out), *STEPS, "--optimizers", "adamw,adamw8bit"]
    evaluate = slimopt.train.loop.evaluate
    calls = []

    def interrupt_the_second_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the first run validates twice, at steps 3 and 6
            os.kill(os.getpid(), signal.SIGINT)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(slimopt.train.loop, "evaluate", interrupt_the_second_run)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert f"continue adamw8bit's run with: slimopt train --resume {out / 'adamw8bit'}" in err
    assert not (out / "results.json").exists()
    assert metrics(out / "adamw")[-1]["step"] == 6
    monkeypatch.undo()
    assert main(["train", "--resume", str(out / "adamw8bit")]) == 0
    alone = tmp_path / "alone"
    assert main(["train", *run_args(workspace, alone), *STEPS, "--optimizer", "adamw8bit"]) == 0
    assert _losses(metrics(out / "adamw8bit")) == _losses(metrics(alone))


def test_ctrl_c_before_training_writes_nothing(workspace: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "run"

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(slimopt.train.loop, "prepare_data", interrupted)
    assert main(["train", *run_args(workspace, out), *STEPS]) == 130
    assert (
        capsys.readouterr().err
        == "slimopt: interrupted outside a training step; saved runs are as they were\n"
    )
    assert not out.exists()


def test_a_torn_last_line_of_the_log_is_skipped_on_resume(
    workspace: Path, tmp_path: Path, uninterrupted
) -> None:
    """A process killed while appending to metrics.jsonl leaves half a line; resuming redoes
    that step and logs it whole. (Here the kill came at step 6's line, after the checkpoint of
    step 2: the later ones are moved out of the run's sight.)"""
    out = tmp_path / "run"
    assert main(["train", *run_args(workspace, out), *STEPS]) == 0
    log = out / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("".join(line + "\n" for line in lines[:5]) + lines[5][:17])
    for step in (4, 6):
        (out / "checkpoints" / f"step-{step:08d}").rename(out / f".hidden-{step}")
    assert main(["train", "--resume", str(out)]) == 0
    assert _losses(metrics(out)) == _losses(uninterrupted)
