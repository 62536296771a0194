"""End to end through the ``slimopt`` command line, on a tiny model and a small corpus."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import slimopt
from slimopt.cli import main
from slimopt.planner import plan_memory
from slimopt.train.bench import bench

pytestmark = pytest.mark.usefixtures("private_cache")


def run_args(workspace: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model", str(workspace / "tiny"), "--data", str(workspace / "text"), "--vocab-size", "300",
        "--seq-len", "32", "--batch-size", "8", "--micro-batch-size", "4", "--lr", "1e-2",
        "--eval-every", "4", "--eval-batches", "2", "--out", str(out), *extra,
    ]  # fmt: skip


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_runs_logs_evaluates_and_checkpoints(workspace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = [
        "train",
        "--optimizer",
        "galore_adamw8bit",
        "--rank",
        "8",
        "--steps",
        "12",
        *run_args(workspace, out),
    ]
    assert main(argv) == 0
    history = metrics(out)
    assert [r["step"] for r in history] == list(range(1, 13))
    assert history[-1]["loss"] < history[0]["loss"]
    assert [r["step"] for r in history if "val_loss" in r] == [4, 8, 12]
    assert history[0]["lr"] == 0.0 and max(r["lr"] for r in history) == pytest.approx(1e-2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["state_bytes"] > 0 and summary["val_ppl"] > 1
    assert (out / "checkpoints" / "step-00000012" / "manifest.json").exists()
    printed = capsys.readouterr()
    assert printed.out.startswith("galore_adamw8bit: finished 12 of 12 steps in ")
    assert f"files in {out}: config.json, metrics.jsonl" in printed.out
    assert f"with galore_adamw8bit (rank 8) on cpu; run directory {out}" in printed.err
    assert "step 4: validation loss" in printed.err and "perplexity" in printed.err
    # On the CPU the first two steps are counted exactly (activations and temporaries included):
    # what the planner predicts for the same model, optimizer and micro-batches.
    assert [r["step"] for r in history if "memory_bytes" in r] == [1, 2]
    planned = plan_memory(
        str(workspace / "tiny"), "galore_adamw8bit", rank=8, batch_size=4, seq_len=32,
        accumulation_steps=2, dtype="fp32", vocab_size=300,
    )  # fmt: skip
    assert summary["peak_memory_bytes"] == pytest.approx(planned.peak_bytes, rel=0.05)


@pytest.mark.parametrize(
    "mode",
    [[], ["--layerwise"], ["--layerwise", "--refresh-from", "micro_batch"]],
    ids=["stepping", "layerwise", "layerwise-micro-batch-refresh"],
)
def test_resumed_run_repeats_the_uninterrupted_one(workspace: Path, tmp_path: Path, mode: list[str]) -> None:
    common = [
        "--optimizer", "galore_adamw_ternary", "--rank", "8", "--update-proj-gap", "3", "--steps", "10", *mode
    ]  # fmt: skip
    assert main(["train", *common, *run_args(workspace, tmp_path / "whole")]) == 0
    assert main(["train", *common, "--save-every", "5", *run_args(workspace, tmp_path / "split")]) == 0
    checkpoints = tmp_path / "split" / "checkpoints"
    for step in (6, 7, 8, 9, 10):  # keep only the checkpoint of step 5, as if stopped there
        (checkpoints / f"step-{step:08d}" / "manifest.json").unlink(missing_ok=True)
    assert (
        main(
            ["train", *common, "--resume", str(tmp_path / "split"), *run_args(workspace, tmp_path / "split")]
        )
        == 0
    )
    whole, split = metrics(tmp_path / "whole"), metrics(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, 11))
    # One schedule step per optimizer step (2 micro-batches each): warm-up from 0 to the peak.
    assert whole[0]["lr"] == 0.0 and max(r["lr"] for r in whole) == pytest.approx(1e-2)
    assert whole[-1]["loss"] < whole[0]["loss"]
    for a, b in zip(whole, split, strict=True):
        assert a["loss"] == b["loss"] and a.get("val_loss") == b.get("val_loss") and a["lr"] == b["lr"]


def test_apollo_mini_trains_layerwise_and_resumes_exactly(workspace: Path, tmp_path: Path, capsys) -> None:
    """``--optimizer apollo_mini`` from the command line: its own rank (1), redraws every 3 steps,
    updates in backward, and a resumed run repeats the uninterrupted one."""
    common = ["--optimizer", "apollo_mini", "--update-proj-gap", "3", "--steps", "8", "--layerwise"]
    assert main(["train", *common, *run_args(workspace, tmp_path / "whole")]) == 0
    assert "with apollo_mini (rank 1, apollo_mini's own)" in capsys.readouterr().err
    assert main(["train", *common, "--save-every", "4", *run_args(workspace, tmp_path / "split")]) == 0
    for step in range(5, 9):  # keep only the checkpoint of step 4
        (tmp_path / "split" / "checkpoints" / f"step-{step:08d}" / "manifest.json").unlink(missing_ok=True)
    resumed = [
        "train",
        *common,
        "--resume",
        str(tmp_path / "split"),
        *run_args(workspace, tmp_path / "split"),
    ]
    assert main(resumed) == 0
    whole, split = metrics(tmp_path / "whole"), metrics(tmp_path / "split")
    assert whole[-1]["loss"] < whole[0]["loss"]
    assert [r["loss"] for r in whole] == [r["loss"] for r in split]


@pytest.mark.parametrize(
    ("dtype", "optimizer"), [("int8", "taco"), ("int8", "adamw8bit"), ("bf16+8", "apollo_mini")]
)
def test_weights_dtype_trains_resumes_exactly_and_is_planned(
    workspace: Path, tmp_path: Path, dtype: str, optimizer: str
) -> None:
    """``--dtype int8`` (codes in the checkpoint) and ``--dtype bf16+8`` (the correction in the
    optimizer's state): a resumed run repeats the uninterrupted one, and the first steps' measured
    peak is what the planner predicts for the same weights."""
    common = ["--optimizer", optimizer, "--dtype", dtype, "--steps", "6"]
    assert main(["train", *common, *run_args(workspace, tmp_path / "whole")]) == 0
    assert main(["train", *common, "--save-every", "3", *run_args(workspace, tmp_path / "split")]) == 0
    for step in range(4, 7):
        (tmp_path / "split" / "checkpoints" / f"step-{step:08d}" / "manifest.json").unlink(missing_ok=True)
    split = tmp_path / "split"
    resumed = ["train", *common, "--resume", str(split), *run_args(workspace, split)]
    assert main(resumed) == 0
    whole, split = metrics(tmp_path / "whole"), metrics(tmp_path / "split")
    assert whole[-1]["loss"] < whole[0]["loss"]
    assert [r["loss"] for r in whole] == [r["loss"] for r in split]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "whole" / "checkpoints" / "step-00000006" / "model.safetensors"))
    codes = [key for key in saved if key.endswith("weight_codes")]
    assert bool(codes) == (dtype == "int8") and all(saved[key].dtype == torch.int8 for key in codes)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    planned = plan_memory(
        str(workspace / "tiny"), optimizer, batch_size=4, seq_len=32, accumulation_steps=2, dtype=dtype,
        vocab_size=300,
    )  # fmt: skip
    assert summary["peak_memory_bytes"] == pytest.approx(planned.peak_bytes, rel=0.05)


def test_a_bad_weights_dtype_exits_2_naming_the_choices(workspace: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["train", "--dtype", "fp8", *run_args(workspace, tmp_path / "run")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "unknown weight dtype 'fp8'; valid: fp32, bf16, bf16+8, int8" in err
    assert not (tmp_path / "run").exists()


def test_sigint_saves_a_checkpoint_and_stops(workspace: Path, tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    argv = ["train", "--steps", "400", *run_args(workspace, out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "slimopt.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    done = threading.Event()

    def interrupt_after_a_few_steps() -> None:
        metrics_file = out / "metrics.jsonl"
        while not done.is_set():
            if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
                process.send_signal(signal.SIGINT)
                return
            done.wait(0.2)

    watcher = threading.Thread(target=interrupt_after_a_few_steps)
    watcher.start()
    try:
        _, stderr = process.communicate(timeout=300)
    finally:
        done.set()
        watcher.join()
    assert process.returncode == 130, stderr.decode()[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and 3 <= summary["steps"] < 400
    assert (out / "checkpoints" / f"step-{summary['steps']:08d}" / "manifest.json").exists()
    assert f"Continue with: slimopt train --resume {out}" in stderr.decode()


def test_compare_writes_results_table_and_plot(workspace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "compare"
    argv = [
        "compare",
        "--optimizers",
        "adamw,galore_adamw",
        "--rank",
        "8",
        "--steps",
        "4",
        *run_args(workspace, out),
    ]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["optimizer"] for r in results] == ["adamw", "galore_adamw"]
    table = (out / "results.md").read_text()
    assert "| adamw |" in table and "| galore_adamw |" in table and "| 1.000 |" in table
    assert table in capsys.readouterr().out
    assert (out / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_that_fails_costs_only_the_plot(workspace: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """The table is printed and saved before the plot; a failing plot is one warning line."""
    from slimopt.train import compare

    def broken(results, path) -> None:
        raise RuntimeError("no display backend")

    monkeypatch.setattr(compare, "plot_losses", broken)
    out = tmp_path / "compare"
    assert main(["compare", "--optimizers", "adamw", "--steps", "2", *run_args(workspace, out)]) == 0
    captured = capsys.readouterr()
    assert (out / "results.md").read_text() in captured.out and not (out / "losses.png").exists()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: losses.png not written (RuntimeError: no display backend)"]
    assert "results.md, results.json; one run directory" in captured.out


def test_config_file_supplies_options(workspace: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('optimizer = "adamw4bit"\nsteps = 2\n')
    out = tmp_path / "configured"
    assert main(["train", "--config", str(config), *run_args(workspace, out)]) == 0
    assert json.loads((out / "summary.json").read_text())["optimizer"] == "adamw4bit"
    assert len(metrics(out)) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--model", "llama_3m"], "unknown model 'llama_3m'; valid: llama_9m"),
        (["train", "--optimizer", "sgd"], "unknown optimizer 'sgd'; available: adamw"),
        (
            ["train", "--optimizer", "adamw8bit", "--rank", "8"],
            "'adamw8bit' does not project gradients, so it takes no --rank; projecting: galore_adamw",
        ),
        (
            ["train", "--data", "/nonexistent/corpus.txt"],
            "data path '/nonexistent/corpus.txt' does not exist",
        ),
        (
            ["train", "--batch-size", "10", "--micro-batch-size", "4"],
            "batch size 10 is not a positive multiple",
        ),
        (["train", "--config", "/nonexistent.toml"], "config file '/nonexistent.toml' does not exist"),
        (
            ["train", "--refresh-from", "micro_batch"],
            "refresh_from='micro_batch' is a layer-wise option: add --layerwise",
        ),
        (["train", "--resume", "/nonexistent/run"], "resume directory '/nonexistent/run' does not exist"),
        (
            ["train", "--tokenizer", "/nonexistent/tokenizer"],
            "cannot load tokenizer '/nonexistent/tokenizer'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv: list[str], message: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("slimopt: error: ") and message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_checkpoint_of_another_model_is_refused(workspace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "small"
    assert main(["train", "--steps", "1", *run_args(workspace, out)]) == 0
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2
    ).save_pretrained(tmp_path / "wider")
    argv = ["train", "--steps", "2", "--resume", str(out), *run_args(workspace, tmp_path / "resumed")]
    argv[argv.index("--model") + 1] = str(tmp_path / "wider")
    assert main(argv) == 2
    assert "is from another model" in capsys.readouterr().err


def files_of(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_an_out_that_holds_a_run_is_refused_and_left_as_it_was(
    workspace: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--steps", "3", *run_args(workspace, out)]) == 0
    before = files_of(out)
    capsys.readouterr()
    again = ["train", "--steps", "2", *run_args(workspace, out)]
    again[again.index("--model") + 1] = "llama_9m"  # another model: nothing of it may land there
    assert main(again) == 2
    err = capsys.readouterr().err
    assert err == (
        f"slimopt: error: --out {out} already holds a run; continue it with --resume {out}, choose "
        "another --out, or pass --overwrite to replace it\n"
    )
    assert files_of(out) == before


def test_overwrite_replaces_the_old_run_entirely(workspace: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--save-every", "2", *run_args(workspace, out)]) == 0
    assert main(["train", "--steps", "3", "--overwrite", *run_args(workspace, out)]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003"]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert "overwrite" not in json.loads((out / "config.json").read_text())
    assert not any(p.name.startswith(".run.replaced") for p in tmp_path.iterdir())


def test_the_default_out_is_new_for_every_run(workspace: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--steps", "1", *run_args(workspace, tmp_path / "unused")]
    del argv[argv.index("--out") : argv.index("--out") + 2]
    assert main(argv) == 0 and main(argv) == 0
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(run.name.startswith("tiny-adamw-") for run in runs)
    printed = capsys.readouterr()
    for run in runs:
        relative = Path("runs") / run.name
        assert f"run directory {relative}" in printed.err and f"files in {relative}:" in printed.out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
        (["--lr", "-1e-3"], "--lr must be a finite number > 0, got -0.001"),
        (["--lr=-1e-3"], "--lr must be a finite number > 0, got -0.001"),
        (["--warmup", "-1"], "--warmup must be a finite number >= 0, got -1.0"),
        (["--grad-clip", "-0.5"], "--grad-clip must be a finite number >= 0, got -0.5"),
        (["--steps", "0"], "--steps must be a positive integer, got 0"),
        (["--eval-every", "-2"], "--eval-every must be a positive integer, got -2"),
        (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        # Optimizer flags are read as Hugging Face's optim_args are (options.parse_option).
        (["--rank", "four"], "argument --rank: rank='four': expected int"),
        (["--scale", "big"], "argument --scale: scale='big': expected float"),
        # Non-finite values, and finite ones float32 cannot hold, are refused before training.
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0, got nan"),
        (["--lr", "1e300"], "--lr must be a finite number > 0, got 1e+300 (beyond float32's range"),
        (
            ["--optimizer", "apollo_adamw", "--norm-growth-limit", "inf"],
            "norm_growth_limit must be a finite number >= 1, or None for no limiter, got inf",
        ),
        # --weight-decay was read with the projection options' types, which lack it (a KeyError).
        (["--weight-decay", "inf"], "weight_decay must be a finite number >= 0, got inf"),
    ],
)
def test_each_bad_value_is_one_line_naming_the_flag(flags, message, workspace, tmp_path, capsys) -> None:
    try:
        code = main(["train", *run_args(workspace, tmp_path / "run"), *flags])
    except SystemExit as exit_:  # argparse's own checks exit from parse_args
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("slimopt: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"slimopt {slimopt.__version__}\n"


def test_device_cuda_without_a_gpu_is_refused(workspace, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--device", "cuda", *run_args(workspace, tmp_path / "run")]) == 2
    assert "--device cuda: no CUDA device is available; valid here: auto, cpu" in capsys.readouterr().err


@pytest.mark.parametrize(("preset", "rank"), [("llama_9m", 32), ("llama_60m", 128), ("llama_1b", 512)])
def test_the_default_rank_is_a_quarter_of_the_hidden_size(preset: str, rank: int, capsys) -> None:
    from slimopt.models import LLAMA_PRESETS

    assert LLAMA_PRESETS[preset].hidden == 4 * rank
    assert main(["memory", "--model", preset, "--optimizer", "galore_adamw", "--vocab-size", "512"]) == 0
    assert f"rank {rank} (the default: a quarter of the matrices' smaller side)" in capsys.readouterr().out


def test_a_rank_that_saves_nothing_warns(workspace: Path, tmp_path: Path, capsys) -> None:
    argv = ["train", "--optimizer", "galore_adamw", "--rank", "32", "--steps", "1"]
    assert main([*argv, *run_args(workspace, tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "slimopt: warning: rank 32 saves no optimizer state" in err and "choose a rank of at most" in err


def test_compare_names_each_bar_and_plots_every_run_distinctly(
    workspace: Path, tmp_path: Path, capsys
) -> None:
    from slimopt.train.compare import loss_figure

    argv = ["compare", "--optimizers", "adamw,galore_adamw,adamw8bit", "--rank", "8", "--steps", "4"]
    run = run_args(workspace, tmp_path / "compare")
    del run[run.index("--eval-every") : run.index("--eval-every") + 2]  # the default: a tenth of the steps
    assert main([*argv, *run]) == 0
    err = capsys.readouterr().err
    assert all(f"{name} {k}/3" in err for k, name in enumerate(["adamw", "galore_adamw", "adamw8bit"], 1))
    results = json.loads((tmp_path / "compare" / "results.json").read_text())
    figure = loss_figure(results)
    for axis in figure.axes:
        assert axis.get_xlabel() and axis.get_ylabel()
        styles = [(line.get_linestyle(), line.get_marker()) for line in axis.get_lines()]
        assert len(axis.get_lines()) == 3 and len(set(styles)) == 3
    validation = figure.axes[1]
    assert all(len(line.get_xdata()) > 1 for line in validation.get_lines())


def test_resume_says_where_it_starts_and_names_an_intact_checkpoint(workspace, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--save-every", "2", *run_args(workspace, out)]) == 0
    newest = out / "checkpoints" / "step-00000006"
    (newest / "optimizer.pt").write_bytes(b"damaged")
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 2
    intact = out / "checkpoints" / "step-00000004"
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is corrupt" in err and f"the newest intact checkpoint is {intact}" in err
    assert f"--resume {intact}" in err and err.count("\n") == 1
    assert main(["train", "--resume", str(intact)]) == 0
    assert f"resuming from step 4 of 6 ({intact})" in capsys.readouterr().err
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_commands_print_no_third_party_import_noise(tmp_path: Path) -> None:
    """transformers imports torchao when it is installed, which logs about kernels for other
    hardware; slimopt's commands keep those lines off the console."""
    result = subprocess.run(
        [sys.executable, "-m", "slimopt.cli", "memory", "--model", "llama_9m", "--optimizer", "adamw"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Failed to load" not in result.stderr and "_pytree" not in result.stderr


def torchrun(argv: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N -m slimopt.cli …`` (a free port of its own)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*command, "-m", "slimopt.cli", *argv], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.slow  # three runs under torchrun: about 60 s
@pytest.mark.parametrize("strategy", ["fsdp2", "zero1", "ddp"])
def test_torchrun_trains_like_one_process_and_resumes(workspace: Path, tmp_path: Path, strategy) -> None:
    """Two processes share each step's batch (4 sequences each): the losses are one process's,
    within fp32 reduction order (amplified by Adam at lr 1e-2, where a gradient entry near zero
    flips sign: 1.2e-4 measured after 8 steps; a process training on the wrong rows is off by
    1e-2). Resumed by two processes from the step-5 checkpoint, the run
    repeats itself exactly; FSDP2's sharded checkpoint also resumes in one process."""
    common = ["--optimizer", "galore_adamw", "--rank", "8", "--update-proj-gap", "3", "--steps", "10"]
    one = tmp_path / "one"
    # Under FSDP2 the run chooses proj_type right by itself (and records it in config.json, which
    # the one-process resume below relies on: it is not given again); one process is told.
    same_side = ["--proj-type", "right"] if strategy == "fsdp2" else []
    assert main(["train", *common, *same_side, *run_args(workspace, one)]) == 0
    two = tmp_path / "two"
    flags = [*common, "--distributed", strategy, "--save-every", "5"]
    finished = torchrun(["train", *flags, *run_args(workspace, two)])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "on 2 processes" in finished.stderr and "finished 10 of 10 steps" in finished.stdout
    if strategy == "fsdp2":
        assert "(proj_type right: FSDP2 splits the rows)" in finished.stderr
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and len(summary["state_bytes_per_process"]) == 2
    if strategy != "fsdp2":  # slimopt's hook all-reduces (and counts) the gradients
        synced = "projected"  # --grad-sync auto's choice for a projecting optimizer
        assert f"{synced} gradient sync" in finished.stderr and summary["grad_sync"] == synced
        assert f"{synced} gradient sync: " in finished.stdout
        assert all(record["grad_sync_bytes"] > 0 for record in metrics(two))
    if strategy != "ddp":  # the state is split: each process holds part of it
        assert (
            max(summary["state_bytes_per_process"])
            < json.loads((one / "summary.json").read_text())["state_bytes"]
        )
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), a["step"]
    resumed = tmp_path / "resumed"
    checkpoint = two / "checkpoints" / "step-00000005"
    again = torchrun(["train", *flags, "--resume", str(checkpoint), *run_args(workspace, resumed)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from step 5 of 10" in again.stderr
    for a, b in zip(metrics(two)[5:], metrics(resumed), strict=True):
        assert a["loss"] == b["loss"] and a.get("val_loss") == b.get("val_loss"), a["step"]
    if strategy == "fsdp2":  # the sharded checkpoint in one process
        alone = tmp_path / "alone"
        argv = [
            "train",
            *flags,
            "--distributed",
            "none",
            "--resume",
            str(checkpoint),
            *run_args(workspace, alone),
        ]
        assert main(argv) == 0
        for a, b in zip(metrics(two)[5:], metrics(alone), strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), a["step"]


def _saved_optimizer(out: Path, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step-{step:08d}" / "optimizer.pt", weights_only=True)


def test_resume_with_another_dtype_trains_as_it_says(workspace: Path, tmp_path: Path, capsys) -> None:
    """bf16 to bf16+8 on resume announced bf16+8 and wrote it to config.json but trained with no
    correction (param_rounding came back from the checkpoint); the reverse kept correcting. Now
    the correction starts at zero, or is dropped. int8 to bf16 blamed an intact checkpoint
    ("from another model") and sent the user to an older one; it names --dtype now."""
    out = tmp_path / "run"
    assert (
        main(["train", "--steps", "4", "--save-every", "2", "--dtype", "bf16", *run_args(workspace, out)])
        == 0
    )
    assert main(["train", "--resume", str(out), "--steps", "6", "--dtype", "bf16+8"]) == 0
    saved = _saved_optimizer(out, 6)
    assert {group["param_rounding"] for group in saved["param_groups"]} == {"corrected"}
    assert any(state["weight_correction"].any() for state in saved["state"].values())
    assert main(["train", "--resume", str(out), "--steps", "8", "--dtype", "bf16"]) == 0
    saved = _saved_optimizer(out, 8)
    assert {group["param_rounding"] for group in saved["param_groups"]} == {"nearest"}
    assert not any("weight_correction" in state for state in saved["state"].values())
    int8 = tmp_path / "int8"
    assert (
        main(["train", "--steps", "4", "--save-every", "2", "--dtype", "int8", *run_args(workspace, int8)])
        == 0
    )
    capsys.readouterr()
    assert main(["train", "--resume", str(int8), "--steps", "6", "--dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "holds int8 weights and this run's are bf16" in err and "resume with --dtype int8" in err
    assert "intact" not in err and err.count("\n") == 1
    assert json.loads((int8 / "config.json").read_text())["dtype"] == "int8"


def test_options_given_again_on_resume_apply(workspace: Path, tmp_path: Path) -> None:
    """--lr and --weight-decay given on resume were written to config.json and ignored: the
    checkpoint's groups and the schedule's peak rates came back with it."""
    first = tmp_path / "first"
    argv = [
        "train",
        "--steps",
        "4",
        "--save-every",
        "2",
        "--weight-decay",
        "0.1",
        *run_args(workspace, first),
    ]
    assert main(argv) == 0
    again = tmp_path / "again"
    checkpoint = first / "checkpoints" / "step-00000002"
    resumed = ["train", "--resume", str(checkpoint), "--steps", "4", "--lr", "0.02", "--weight-decay", "0"]
    assert main([*resumed, "--out", str(again)]) == 0
    assert [r["lr"] for r in metrics(again)] == [2 * r["lr"] for r in metrics(first)[2:]]
    assert {group["weight_decay"] for group in _saved_optimizer(again, 4)["param_groups"]} == {0.0}
    assert {group["weight_decay"] for group in _saved_optimizer(first, 4)["param_groups"]} == {0.1, 0.0}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--dtype", "int8"],
            "--dtype int8 with 2 processes under torchrun (ddp): int8 weights train in one",
        ),
        (["--layerwise"], "--layerwise with 2 processes under torchrun (ddp): DDP averages gradients"),
    ],
)
def test_what_torchruns_default_ddp_cannot_train_is_refused(
    flags, message, workspace: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Under torchrun without --distributed, two processes share the run by DDP: int8 weights
    crashed in DDP's broadcast on every process, and --layerwise raised a traceback; both are one
    line now, as with --distributed ddp, before anything is written."""
    from slimopt.train.parallel import Parallel

    monkeypatch.setattr("slimopt.train.loop.start_run", lambda strategy, device: Parallel("ddp", 0, 2))
    assert main(["train", *flags, *run_args(workspace, tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_validation_takes_the_same_rows_for_any_micro_batch_size(tmp_path: Path) -> None:
    """Validation took eval_batches × micro-batch rows, so two processes, or another
    --micro-batch-size, validated other rows than one process (5.09 against 5.06 on the same
    weights); it is eval_batches × batch_size rows now, however many at a time."""
    from slimopt.train.config import TrainConfig
    from slimopt.train.loop import evaluate

    from .conftest import tiny_llama

    model = tiny_llama()
    rows = torch.randint(0, 256, (40, 32), generator=torch.Generator().manual_seed(0))
    config = TrainConfig(batch_size=8, eval_batches=3, out=str(tmp_path / "unused"))
    losses = [evaluate(model, rows, config, torch.device("cpu"), size) for size in (8, 4, 2, 5)]
    whole = model(input_ids=rows[:24], labels=rows[:24]).loss.item()
    assert losses == pytest.approx([whole] * 4, rel=1e-6)


def test_distributed_none_under_torchrun_with_several_processes_is_refused(monkeypatch) -> None:
    """It started DDP (none was read as "the default")."""
    from slimopt.train.parallel import start_run

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="--distributed none trains in one process, but torchrun started 2"):
        start_run("none", "cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert start_run("none", "cpu").strategy is None


def test_distributed_flags_fail_in_one_line(workspace: Path, tmp_path: Path, capsys) -> None:
    assert main(["train", "--distributed", "fsdp2", *run_args(workspace, tmp_path / "a")]) == 2
    assert "--distributed fsdp2 runs under torchrun: torchrun --nproc_per_node N" in capsys.readouterr().err
    argv = ["train", "--distributed", "ddp", "--layerwise", *run_args(workspace, tmp_path / "b")]
    assert main(argv) == 2
    assert "--layerwise with --distributed ddp: DDP averages gradients" in capsys.readouterr().err
    galore = ("--optimizer", "galore_adamw")
    refusals = {
        ("--optimizer", "apollo_adamw"): "--grad-sync projected: apollo_adamw scales each raw gradient",
        ("--optimizer", "adamw8bit"): "--grad-sync projected: adamw8bit projects no gradient",
        ("--optimizer", "taco"): "--grad-sync projected: taco sketches each whole gradient",
        (*galore, "--distributed", "fsdp2"): "--grad-sync projected with --distributed fsdp2: FSDP2 reduce",
        # Refused once the run knows it is one process (not under torchrun).
        galore: "--grad-sync projected with one process: projections are synchronized among DDP's",
    }
    for flags, message in refusals.items():
        argv = ["train", "--grad-sync", "projected", *flags, *run_args(workspace, tmp_path / "c")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not any((tmp_path / name).exists() for name in "abc")
    argv = ["train", "--distributed", "zero1", "--dtype", "int8", *run_args(workspace, tmp_path / "c")]
    assert main(argv) == 2
    assert "--dtype int8 with --distributed zero1: int8 weights train in one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--distributed", "deepspeed"])
    error = capsys.readouterr().err
    assert "invalid choice: 'deepspeed'" in error and all(
        name in error for name in ("none", "zero1", "fsdp2")
    )


def bench_args(optimizers: str, out: Path, *extra: str) -> list[str]:
    """``slimopt bench`` of ``optimizers`` on llama_9m, one 1×16 step after one, JSON to ``out``."""
    return [
        "bench", "--model", "llama_9m", "--optimizers", optimizers, "--batch-size", "1", "--seq-len", "16",
        "--steps", "1", "--warmup", "1", "--json", str(out), *extra,
    ]  # fmt: skip


def test_bench_times_slimopt_beside_the_references(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    names = (
        "torch_adamw_foreach,torch_adamw_fused,adamw,adamw8bit,apollo_torch_mini,apollo_mini,torch_muon,muon"
    )
    assert main(bench_args(names, out)) == 0
    captured = capsys.readouterr()
    assert "skipping torch_adamw_fused (CUDA only)" in captured.err
    assert "| optimizer | training step s | optimizer step s | state MiB | peak MiB |" in captured.out
    rows = {row["optimizer"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        "torch_adamw_foreach", "adamw", "adamw8bit", "apollo_torch_mini", "apollo_mini", "torch_muon", "muon",
    }  # fmt: skip
    # Muon's matrices and AdamW's rest: torch's two optimizers hold what slimopt's one does.
    assert rows["muon"]["state_bytes"] == rows["torch_muon"]["state_bytes"]
    # The same fp32 moments as torch's AdamW; int8 keeps about a quarter of them. APOLLO-Mini
    # keeps the embedding's and head's moments, nearly all of apollo-torch's state, in int8.
    assert rows["adamw"]["state_bytes"] == rows["torch_adamw_foreach"]["state_bytes"]
    assert rows["apollo_mini"]["state_bytes"] < 0.5 * rows["apollo_torch_mini"]["state_bytes"]
    assert rows["adamw8bit"]["state_bytes"] < 0.3 * rows["adamw"]["state_bytes"]
    assert all(row["step_seconds"] > row["optimizer_step_seconds"] > 0 for row in rows.values())
    assert main(["bench", "--optimizers", "adam_w"]) == 2
    assert "unknown optimizer 'adam_w' for slimopt bench; valid: adamw," in capsys.readouterr().err
    assert main(["bench", "--steps", "0"]) == 2
    assert "--steps must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizers", ",", "--rank", "4"], "no optimizer to measure; name one or more of: adamw,"),
        (["--optimizers", "adamw8bit,galore_adamw", "--rank", "0"], "rank must be a positive integer, got 0"),
    ],
)
def test_bench_checks_every_optimizer_before_measuring_any(flags, message, capsys) -> None:
    """--optimizers , printed an empty table and exited 0; --rank 0 was refused only once the
    optimizers before the projecting one had been measured."""
    argv = ["bench", "--model", "llama_9m", "--batch", "1", "--seq", "16", "--steps", "1", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "measuring" not in err


def test_bench_with_int8_weights_measures_slimopt_and_says_why_not_the_references(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(bench_args("torch_adamw_foreach,adamw,taco", out, "--dtype", "int8")) == 0
    captured = capsys.readouterr()
    assert "skipping torch_adamw_foreach (int8 weights: the references would change the codes" in captured.err
    assert "int8 weights, 1×16 tokens" in captured.out
    saved = json.loads(out.read_text())
    assert saved["setting"]["dtype"] == "int8" and [r["optimizer"] for r in saved["rows"]] == [
        "adamw",
        "taco",
    ]
    plain = bench(
        ["adamw"], model="llama_9m", device=torch.device("cpu"), batch=1, seq=16, steps=1, dtype="bf16"
    )
    int8 = {row["optimizer"]: row for row in saved["rows"]}["adamw"]
    assert int8["state_bytes"] == plain[0]["state_bytes"]  # the same fp32 moments
    assert int8["peak_memory_bytes"] > 0
    assert "reference (int8 weights have no fused step)" in int8["fused_path"]


def test_fused_flag_reaches_the_optimizer(workspace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "fused"
    assert (
        main(["train", "--optimizer", "adamw8bit", "--steps", "2", "--fused", *run_args(workspace, out)]) == 0
    )
    assert "with adamw8bit (fused step) on cpu" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["optimizer_options"] == {"fused": True}
    argv = [
        "train",
        "--optimizer",
        "taco",
        "--steps",
        "2",
        "--fused",
        *run_args(workspace, tmp_path / "t"),
    ]
    assert main(argv) == 2
    assert "fused=True: the TACO rule has no fused step" in capsys.readouterr().err


def test_bench_fused_builds_slimopts_optimizers_fused(tmp_path: Path, capsys) -> None:
    """``--fused`` gives slimopt's optimizers ``fused=True`` (torch's Muon beside them keeps its
    own step); one that has no fused step is refused before anything is measured."""
    out = tmp_path / "bench.json"
    assert main(bench_args("torch_muon,muon", out, "--fused")) == 0
    assert "slimopt's fused steps on" in capsys.readouterr().out
    rows = {row["optimizer"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["muon"]["fused_path"] == ["fused"] * 3 and rows["torch_muon"]["fused_path"] is None
    assert main(bench_args("taco", tmp_path / "taco.json", "--fused")) == 2
    err = capsys.readouterr().err
    assert "the TACO rule has no fused step" in err and "measuring" not in err
