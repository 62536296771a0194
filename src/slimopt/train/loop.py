"""The training loop behind ``slimopt train``: readable top to bottom, configuration as plain values.

Data are packed token rows, visited in a seeded permutation per epoch, so the position in the
stream (a single integer) plus the RNG states restore the exact batch order on resume. The
learning rate warms up linearly and then follows a cosine to ``min_lr_ratio`` of its peak (the
GaLore paper's schedule). A SIGINT finishes the current step, saves a checkpoint and stops.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import random
import shlex
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slimopt import models
from slimopt.describe import describe as describe_optimizer
from slimopt.files import write_atomically
from slimopt.layerwise import layerwise
from slimopt.memory import LiveBytes, state_nbytes, state_tensors
from slimopt.registry import rank_origin
from slimopt.sharding import barrier, from_first, local_view
from slimopt.train import metrics
from slimopt.train.checkpoint import checkpoint_to_resume, save_checkpoint
from slimopt.train.config import TrainConfig, saved_config
from slimopt.train.data import Batches, Data, prepare_data
from slimopt.train.parallel import Parallel, start_run
from slimopt.train.report import count, messenger, progress_bar
from slimopt.train.resume import resume
from slimopt.train.rundir import RunLock, check_free, check_out, claim, run_directory
from slimopt.train.tokenizer import TextTokenizer


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """Multiplier of the peak learning rate at each step: linear warm-up from 0, then a cosine
    from 1 down to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_model(config: TrainConfig, vocab_size: int) -> nn.Module:
    """The run's model: a LLaMA preset, or a Hugging Face config file or directory
    (``slimopt.models.build_model``)."""
    weights = None if config.dtype == "fp32" else config.dtype  # fp32: as built, as before --dtype
    return models.build_model(
        config.model, vocab_size, config.seq_len, weights=weights, checkpointing=config.checkpointing
    )


def check_optimizer(config: TrainConfig, vocab_size: int) -> None:
    """Raise what building the run's optimizer raises (a bad option value), without building
    the model for real: it is made on the meta device."""
    from slimopt.registry import build_optimizer

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the real build warns, once
        model = build_model(config, vocab_size)
        build_optimizer(model, config.optimizer, lr=config.lr, **config.optimizer_settings())


@torch.no_grad()
def evaluate(model: nn.Module, rows: Tensor, config: TrainConfig, device: torch.device, size: int) -> float:
    """Mean loss over the first ``eval_batches`` batches of ``batch_size`` validation rows,
    whatever the number of processes and the micro-batch size (every process evaluates all of
    them), run ``size`` rows at a time."""
    model.eval()
    total, count = 0.0, 0
    rows = rows[: config.eval_batches * config.batch_size]
    for first in range(0, len(rows), size):
        batch = rows[first : first + size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
            total += model(input_ids=batch, labels=batch).loss.float().item() * len(batch)
        count += len(batch)  # rows are alike in length: a row's share of the mean is its tokens'
    model.train()
    return total / count


def track_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> LiveBytes:
    """A ``LiveBytes`` that already counts what lives between steps (weights, buffers, optimizer
    state; this process's shards under FSDP2), so its ``peak`` over a training step is the step's
    exact peak of tensor memory. DDP's gradient buckets, which outlive the step inside its
    reducer, are counted from the backward pass that writes the gradients into them on."""
    tracker = LiveBytes()
    tensors = [*model.parameters(), *model.buffers(), *state_tensors(optimizer)]
    tracker.adopt([local_view(t) for t in tensors])
    return tracker


class _Interrupt:
    """Turns SIGINT into a flag the loop checks after each step."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> _Interrupt:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)


def train(
    config: TrainConfig, *, progress: bool = True, label: str | None = None, data: Data | None = None
) -> dict[str, Any]:
    """Run (or resume) training; return the summary that is also written to ``out/summary.json``.

    With ``progress`` a bar (named ``label``, default the optimizer) shows the steps and short
    messages go to stderr: the run directory, the device, a resumed step, each validation, and
    on SIGINT the command that continues the run. Under ``torchrun`` every process runs this
    (``slimopt.train.parallel``); the first one shows progress and writes the run's files.
    ``data``: ``prepare_data(config)``'s result, when the caller has it already (a comparison).
    Raises ``ValueError`` (a ``CheckpointError`` for checkpoints) for a run that cannot start,
    before anything on disk changes: the run directory is taken only once the data, the model,
    the optimizer and the checkpoint to resume from have all loaded."""
    parallel = start_run(config.distributed, config.device)
    try:
        return _prepare_and_train(config, parallel, progress, label, data)
    finally:
        # The model, the optimizer and what FSDP2 keeps of its last collectives (gloo's work
        # objects, holding tensors) are gone by now, while the process group and the interpreter
        # still live: destroyed at interpreter exit instead, after the group, such work aborted
        # the process now and then ("terminate called without an active exception").
        gc.collect()
        parallel.close()


def _prepare_and_train(
    config: TrainConfig, parallel: Parallel, progress: bool, label: str | None, data: Data | None
) -> dict[str, Any]:
    """``train``'s work; everything it builds is released when it returns."""
    run = _prepare(config, parallel, data)
    lock = _take_directory(run)
    try:
        return _train(run, progress, label)
    finally:
        if lock is not None:
            lock.release()


@dataclass
class _Run:
    """What a run trains with, all of it built before anything is written."""

    config: TrainConfig
    parallel: Parallel
    out: Path
    device: torch.device
    tokenizer: TextTokenizer
    validation_rows: Tensor
    model: nn.Module
    wrapped: nn.Module
    optimizer: Any
    sync: Any  # slimopt's gradient sync under DDP and ZeRO-1 (its bytes), else None
    schedule: Any
    batches: Batches
    checkpoint: Path | None  # the one resumed from
    start_step: int
    note: str  # what the run chose for the user, for the start line


def _prepare(config: TrainConfig, parallel: Parallel, data: Data | None) -> _Run:
    """Check the run directory and the checkpoint to resume from, then build the data, model,
    optimizer and schedule and load the checkpoint. Writes nothing; raises what ``train`` does."""
    config.check_strategy(parallel.strategy, parallel.world)
    config.micro_batches(parallel.world)
    config.out = from_first(config.out)  # a default name holds the time: the first process's
    out = Path(config.out)
    checkpoint = from_first(_first_process_checks(config, out) if parallel.main else None)
    if isinstance(checkpoint, Exception):
        raise checkpoint
    device = parallel.device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    tokenizer, train_rows, validation_rows = data or parallel.first_then_others(lambda: prepare_data(config))
    model = build_model(config, tokenizer.vocab_size).to(device)
    wrapped = parallel.wrap(model)
    optimizer = parallel.optimizer(model, config.optimizer, config.lr, config.optimizer_settings())
    sync = parallel.sync_gradients(wrapped, optimizer, config.grad_sync)
    note = _record_choices(config, getattr(optimizer, "optim", optimizer), parallel)
    warmup = int(config.warmup * config.steps) if config.warmup < 1 else int(config.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(config.steps, warmup, config.min_lr_ratio)
    )
    batches = Batches(train_rows, config.seed)
    start_step = 0
    if checkpoint is not None:
        state = resume(checkpoint, model, optimizer, schedule, config.optimizer_settings())
        batches.position, start_step = state["position"], state["step"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
    return _Run(
        config, parallel, out, device, tokenizer, validation_rows, model, wrapped, optimizer, sync,
        schedule, batches, checkpoint, start_step, note,
    )  # fmt: skip


def _first_process_checks(config: TrainConfig, out: Path) -> Path | Exception | None:
    """The checkpoint to resume from (None: a new run), or the error that stops the run: an
    ``out`` a new run may not take, a checkpoint past ``--steps`` or behind a newer one of its run."""
    try:
        if config.resume is None:
            check_out(out, overwrite=config.overwrite)
            return None
        here = run_directory(config.resume).resolve() == out.resolve()
        checkpoint = checkpoint_to_resume(config.resume, config.steps, continues_its_run=here)
        if here:
            check_free(out)
        else:
            check_out(out, overwrite=config.overwrite)
        return checkpoint
    except ValueError as error:
        return error


def _take_directory(run: _Run) -> RunLock | None:
    """Take the run directory (the first process; ``rundir.claim``) and write the run's start:
    ``config.json``, and the log without the steps a resumed run redoes."""
    config, out = run.config, run.out
    lock = problem = None
    if run.parallel.main:
        resuming_here = run.checkpoint is not None and run_directory(config.resume).resolve() == out.resolve()
        try:
            lock = claim(out, overwrite=config.overwrite, resume=resuming_here)
        except ValueError as error:
            problem = error
    problem = from_first(problem)
    if problem is not None:
        raise problem
    if run.parallel.main:
        if run.checkpoint is not None:
            metrics.keep_until(out / metrics.NAME, run.start_step)
        write_atomically(out / "config.json", json.dumps(saved_config(config), indent=1))
    return lock


def _train(run: _Run, progress: bool, label: str | None) -> dict[str, Any]:
    config, parallel, out, model, optimizer = run.config, run.parallel, run.out, run.model, run.optimizer
    say = messenger(progress and parallel.main)
    if run.checkpoint is not None:
        say(f"resuming from step {run.start_step} of {config.steps} ({run.checkpoint})")
    parameters = sum(p.numel() for p in model.parameters())
    where = str(run.device)
    if parallel.strategy is not None:
        synced = "" if run.sync is None else f", {run.sync.mode} gradient sync"
        where = f"{parallel.world} processes ({parallel.strategy}, {run.device.type}{synced})"
    paths = getattr(getattr(optimizer, "optim", optimizer), "fused_path", [])
    fused = " (fused step)" if paths and all(path == "fused" for path in paths) else ""
    say(
        f"training {config.model} ({count(parameters)} parameters, {config.dtype} weights) "
        f"with {config.optimizer}"
        f"{_rank_note(optimizer, config)}{run.note}{fused} on {where}; run directory {out}"
    )
    say(describe_optimizer(getattr(optimizer, "optim", optimizer), model, parameters=False))
    began = time.perf_counter()
    interrupted, peak = _steps(
        run,
        say,
        progress_bar(progress and parallel.main, config.steps, run.start_step, label or config.optimizer),
    )
    state_bytes = parallel.gather(state_nbytes(optimizer))
    peaks = parallel.gather(peak)
    if not parallel.main:
        return _finished(None)
    history = metrics.read(out / metrics.NAME)
    evaluations = [r for r in history if "val_loss" in r]
    summary: dict[str, Any] = {
        "optimizer": config.optimizer,
        "interrupted": interrupted,
        "out": str(out),
        "steps": history[-1]["step"] if history else run.start_step,
        "total_steps": config.steps,
        "seconds": time.perf_counter() - began,
        "final_train_loss": history[-1]["loss"] if history else None,
        "val_loss": evaluations[-1]["val_loss"] if evaluations else None,
        "val_ppl": evaluations[-1]["val_ppl"] if evaluations else None,
        "state_bytes": sum(state_bytes),
        "peak_memory_bytes": max(peaks),
        "tokens_per_s": sum(r["tokens_per_s"] for r in history) / max(1, len(history)),
        "parameters": parameters,
        "tokenizer": run.tokenizer.description,
        "device": str(run.device),
    }
    if parallel.strategy is not None:
        summary |= {
            "distributed": parallel.strategy,
            "processes": parallel.world,
            "state_bytes_per_process": state_bytes,
            "peak_memory_bytes_per_process": peaks,
        }
    sent = [r["grad_sync_bytes"] for r in history if "grad_sync_bytes" in r]
    if run.sync is not None and sent:
        summary |= {"grad_sync": run.sync.mode, "grad_sync_bytes_per_step": sum(sent) / len(sent)}
    write_atomically(out / "summary.json", json.dumps(summary, indent=1))
    return _finished(summary)


def _steps(run: _Run, say: Callable[[str], None], bar: Any) -> tuple[bool, int]:
    """The training steps from the run's start to ``--steps``, with validations, the log and
    checkpoints; returns whether SIGINT stopped them, and the peak memory of a step."""
    config, parallel = run.config, run.parallel
    handle = None  # layer-wise: the handle updates, clips (per tensor) and steps the schedule in backward
    if config.layerwise:
        accumulation = config.micro_batches(parallel.world)[1]
        clip = config.grad_clip or None
        handle = layerwise(
            run.optimizer,
            accumulation,
            max_grad_norm=clip,
            scheduler=run.schedule,
            refresh_from=config.refresh_from,
        )
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)  # a comparison trains several models in one process
    memory = peak = 0
    try:
        with _Interrupt() as interrupt:
            for step in range(run.start_step + 1, config.steps + 1):
                record, stop = _step(run, step, handle, interrupt)
                memory = record.get("memory_bytes", memory)
                peak = max(peak, memory)
                if step % config.eval_every == 0 or step == config.steps:
                    micro = config.micro_batches(parallel.world)[0]
                    record["val_loss"] = evaluate(run.wrapped, run.validation_rows, config, run.device, micro)
                    record["val_ppl"] = math.exp(record["val_loss"])
                    val_loss, val_ppl = record["val_loss"], record["val_ppl"]
                    say(f"step {step}: validation loss {val_loss:.4f}, perplexity {val_ppl:.2f}")
                if parallel.main:
                    metrics.append(run.out / metrics.NAME, record)
                bar.update(1)
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    lr=f"{record['lr']:.2e}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    mem=f"{memory / 2**20:.0f}MiB",
                )
                if stop:
                    checkpoint = _save(run, step)
                    again = (
                        "slimopt train" if parallel.strategy is None else "torchrun ... -m slimopt.cli train"
                    )
                    say(
                        f"interrupted at step {step} of {config.steps}; saved {checkpoint}. "
                        f"Continue with: {again} --resume {shlex.quote(str(run.out))}"
                    )
                    return True, peak
                if config.save_every and step % config.save_every == 0 and step != config.steps:
                    _save(run, step)
        finished_before = run.checkpoint is not None and run.start_step == config.steps
        if not finished_before or run.checkpoint.parent.parent != run.out:
            _save(run, config.steps)  # (a run resumed at --steps in its own directory has it)
        return False, peak
    finally:
        if handle is not None:
            handle.remove()
        bar.close()


def _step(run: _Run, step: int, handle: Any, interrupt: _Interrupt) -> tuple[dict[str, Any], bool]:
    """One optimizer step (its micro-batches, clipping, the update and the schedule): its log
    record, and whether any process was asked to stop."""
    config, parallel, device, model, optimizer = (
        run.config,
        run.parallel,
        run.device,
        run.model,
        run.optimizer,
    )
    micro, accumulation = config.micro_batches(parallel.world)
    began = time.perf_counter()
    loss = 0.0
    lr = run.schedule.get_last_lr()[0]
    # On the CPU the first steps of a run are counted exactly: the first creates the optimizer
    # state and bases, the second is a steady step (what slimopt memory plans).
    tracker = track_memory(model, optimizer) if device.type == "cpu" and step <= run.start_step + 2 else None
    with tracker or contextlib.nullcontext():
        for index in range(accumulation):
            batch = parallel.take(run.batches.take(micro * parallel.world)).to(device)
            # Gradients are synchronized once per step, by the last micro-batch's backward.
            last = index == accumulation - 1
            with contextlib.nullcontext() if last else parallel.no_sync(run.wrapped):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                    micro_loss = run.wrapped(input_ids=batch, labels=batch).loss / accumulation
                micro_loss.backward()
            loss += micro_loss.item()
            del batch, micro_loss
        if handle is None:
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            run.schedule.step()
        optimizer.zero_grad(set_to_none=True)
    # One all-reduce: the mean loss over the processes, and whether any was interrupted.
    loss, stop = parallel.sum([loss, float(interrupt.requested)])
    tokens = config.batch_size * config.seq_len
    record = {
        "step": step,
        "loss": loss / parallel.world,
        "lr": lr,
        "tokens_per_s": tokens / (time.perf_counter() - began),
    }
    if run.sync is not None:
        record["grad_sync_bytes"] = run.sync.take_sent()  # this process's, for the step's gradients
    if tracker is not None:
        record["memory_bytes"] = tracker.peak
    elif device.type == "cuda":
        record["memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return record, bool(stop)


def _save(run: _Run, step: int) -> Path:
    """Write the checkpoint of ``step`` (every process calls this) and return its path."""
    trainer_state = {
        "step": step,
        "position": run.batches.position,
        "schedule": run.schedule.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    return save_checkpoint(
        run.out / "checkpoints",
        step,
        run.model,
        run.optimizer,
        trainer_state,
        sharded=run.parallel.sharded_checkpoints,
    )


def _finished(summary: dict[str, Any] | None) -> dict[str, Any]:
    """The first process's summary on every process, once every process is done with its
    collectives: none tears its process group down while another still uses it."""
    summary = from_first(summary)
    barrier()
    return summary


def _record_choices(config: TrainConfig, optimizer: Any, parallel: Parallel) -> str:
    """Record in ``config`` what the optimizer chose where the user named nothing and the
    choice depends on where it runs (``proj_type``: ``right`` for weights FSDP2 splits by rows),
    so that resuming elsewhere (one process) builds the same layout; return a note for the
    start line."""
    projected = [group for group in getattr(optimizer, "param_groups", []) if "rank" in group]
    if not projected or "proj_type" in config.optimizer_options:
        return ""
    chosen = projected[0]["proj_type"]
    config.optimizer_options = {**config.optimizer_options, "proj_type": chosen}
    if chosen == "right" and parallel.strategy == "fsdp2":
        return " (proj_type right: FSDP2 splits the rows)"
    return ""


def _rank_note(optimizer: torch.optim.Optimizer, config: TrainConfig) -> str:
    ranks = [group["rank"] for group in optimizer.param_groups if "rank" in group]
    if not ranks:
        return ""
    origin = rank_origin(config.optimizer, given="rank" in config.optimizer_options)
    return f" (rank {ranks[0]})" if origin is None else f" (rank {ranks[0]}, {origin})"
