"""Runs are never lost: whatever the user types, a run directory changes only once every check of
the new run has passed, and only a slimopt run is ever replaced (``slimopt.train.rundir``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slimopt.cli import main

from .test_cli import files_of, metrics, run_args

pytestmark = pytest.mark.usefixtures("private_cache")


def _train(workspace: Path, out: Path, *extra: str) -> int:
    return main(["train", *run_args(workspace, out), *extra])


@pytest.fixture
def run(workspace: Path, tmp_path: Path, capsys) -> Path:
    """A finished run of 4 steps with checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    assert _train(workspace, out, "--steps", "4", "--save-every", "2") == 0
    capsys.readouterr()
    return out


def test_resume_with_steps_below_the_checkpoint_is_refused_and_changes_nothing(run: Path, capsys) -> None:
    """``--steps 2`` below the newest checkpoint (step 4) used to print "finished 4 of 2 steps"
    and write the step-4 weights into step-2, replacing the real one."""
    before = files_of(run)
    assert main(["train", "--resume", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--steps 2 is below the step of the checkpoint to resume from" in err and "step 4" in err
    assert err.count("\n") == 1
    assert files_of(run) == before


def test_an_older_checkpoint_continues_only_into_another_directory(run: Path, tmp_path: Path, capsys) -> None:
    """From step 2 in the run's own directory it would replace the intact step-4 checkpoint;
    into a new ``--out`` it branches off and leaves the run as it was."""
    before = files_of(run)
    older = run / "checkpoints" / "step-00000002"
    assert main(["train", "--resume", str(older)]) == 2
    err = capsys.readouterr().err
    assert "step-00000004 is newer than" in err and "another directory with --out" in err
    assert files_of(run) == before
    branch = tmp_path / "branch"
    assert main(["train", "--resume", str(older), "--out", str(branch)]) == 0
    assert [r["step"] for r in metrics(branch)] == [3, 4]
    assert metrics(branch)[-1]["loss"] == metrics(run)[-1]["loss"]  # the same steps again
    assert files_of(run) == before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data", "/nonexistent/corpus.txt"], "data path '/nonexistent/corpus.txt' does not exist"),
        (
            ["--optimizer", "galore_adamw", "--rank", "8", "--proj-type", "diagonal"],
            "unknown proj_type 'diagonal'",
        ),
        (["--tokenizer", "/nonexistent/tokenizer"], "cannot load tokenizer"),
    ],
)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_overwrite_with_bad_input_leaves_the_old_run(
    workspace: Path, run: Path, flags, message, command, capsys, monkeypatch
) -> None:
    """``--overwrite`` used to delete the old run before the rest of the input was checked."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = files_of(run)
    argv = [command, *run_args(workspace, run), "--steps", "2", "--overwrite", *flags]
    if command == "compare":
        optimizer = argv.index("--optimizer") if "--optimizer" in argv else None
        if optimizer is not None:
            del argv[optimizer : optimizer + 2]
        argv += ["--optimizers", "adamw,galore_adamw"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert files_of(run) == before


def test_a_moved_run_resumes_where_it_is_now(workspace: Path, run: Path, tmp_path: Path, capsys) -> None:
    """``--resume`` used to continue into the ``out`` its config.json recorded: a moved run
    wrote a new directory at the old path."""
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(str(run), str(moved))
    assert main(["train", "--resume", str(moved), "--steps", "6"]) == 0
    assert not run.exists()
    assert [r["step"] for r in metrics(moved)] == list(range(1, 7))
    assert (moved / "checkpoints" / "step-00000006").is_dir()
    assert "out" not in json.loads((moved / "config.json").read_text())


def test_relative_paths_resume_from_another_working_directory(
    workspace: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(workspace / "text", home / "text")
    shutil.copytree(workspace / "tiny", home / "tiny")
    monkeypatch.chdir(home)
    argv = run_args(Path("."), Path("run"))
    assert main(["train", *argv, "--steps", "2"]) == 0
    config = json.loads((home / "run" / "config.json").read_text())
    assert config["data"] == str(home / "text") and config["model"] == str(home / "tiny")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", str(home / "run"), "--steps", "3"]) == 0
    assert [r["step"] for r in metrics(home / "run")] == [1, 2, 3]
    assert not (tmp_path / "run").exists()


def _hugging_face_folder(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["X"]}))
    (path / "model.safetensors").write_bytes(b"weights")


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_directory_holding_a_model_folder_is_never_a_run_to_replace(
    workspace: Path, tmp_path: Path, overwrite, capsys
) -> None:
    """A child holding ``config.json`` (a Hugging Face model folder) used to count as a run:
    ``--overwrite`` on its parent deleted it."""
    parent = tmp_path / "models"
    _hugging_face_folder(parent / "my-model")
    before = files_of(parent)
    assert _train(workspace, parent, "--steps", "1", *overwrite) == 2
    err = capsys.readouterr().err
    assert f"--out {parent} holds files that are not a slimopt run's (my-model)" in err
    assert files_of(parent) == before
    # The model folder itself, whose config.json a run would have overwritten.
    assert _train(workspace, parent / "my-model", "--steps", "1", *overwrite) == 2
    assert (
        "holds files that are not a slimopt run's (config.json, model.safetensors)" in capsys.readouterr().err
    )
    assert files_of(parent) == before


def test_out_dot_is_refused_in_one_clear_line(workspace: Path, run: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(run)
    before = files_of(run)
    assert _train(workspace, Path("."), "--steps", "1", "--overwrite") == 2
    err = capsys.readouterr().err
    assert "--out . holds the working directory; --overwrite would delete it" in err
    assert files_of(run) == before


_HOLD_LOCK = """
import fcntl, sys, time
stream = open(sys.argv[1], "a+")
fcntl.flock(stream, fcntl.LOCK_EX)
stream.seek(0); stream.truncate(); stream.write("pid 4242\\n"); stream.flush()
print("locked", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks")
def test_a_run_still_training_can_be_neither_replaced_nor_resumed(workspace: Path, run: Path, capsys) -> None:
    """A second shell's ``--overwrite`` used to delete a run another process was still writing."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(run / ".slimopt.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = files_of(run)
        assert _train(workspace, run, "--steps", "1", "--overwrite") == 2
        assert f"--out {run} is in use by a running slimopt process (pid 4242" in capsys.readouterr().err
        assert main(["train", "--resume", str(run), "--steps", "5"]) == 2
        assert f"run {run} is in use by a running slimopt process (pid 4242" in capsys.readouterr().err
        assert files_of(run) == before
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert main(["train", "--resume", str(run), "--steps", "5"]) == 0  # free again once it ends


def test_fsdp2_records_its_projection_side_so_one_process_resumes_it(workspace: Path, tmp_path: Path) -> None:
    """Under FSDP2 a projecting optimizer chooses ``proj_type="right"`` (the basis on the side
    FSDP2 does not split); config.json used not to record it, so resuming in one process built
    ``std`` and was refused. One FSDP2 process (gloo, torchrun's environment) is enough to show it."""
    out = tmp_path / "fsdp2"
    argv = ["train", "--optimizer", "galore_adamw", "--rank", "8", "--steps", "2", *run_args(workspace, out)]
    environment = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "slimopt.cli", *argv, "--distributed", "fsdp2"]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "(proj_type right: FSDP2 splits the rows)" in finished.stderr
    assert json.loads((out / "config.json").read_text())["optimizer_options"]["proj_type"] == "right"
    assert main(["train", "--resume", str(out), "--distributed", "none", "--steps", "3"]) == 0
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
