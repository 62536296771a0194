"""The training loop behind ``slimopt train``: readable top to bottom, configuration as plain values.

Data are packed token rows, visited in a seeded permutation per epoch, so the position in the
stream (a single integer) plus the RNG states restore the exact batch order on resume. The
learning rate warms up linearly and then follows a cosine to ``min_lr_ratio`` of its peak (the
GaLore paper's schedule). A SIGINT finishes the current step, saves a checkpoint and stops.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slimopt.describe import describe as describe_optimizer
from slimopt.distributed import STRATEGIES, barrier, from_first, local_view
from slimopt.layerwise import check_refresh_from, layerwise
from slimopt.memory import LiveBytes, state_nbytes, state_tensors
from slimopt.registry import OPTIMIZERS, resolve_name
from slimopt.train.checkpoint import (
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    newest_intact,
    save_checkpoint,
)
from slimopt.train.corpus import load_corpus, split_documents
from slimopt.train.models import build_llama, enable_checkpointing
from slimopt.train.parallel import Parallel, start_run
from slimopt.train.rundir import claim, default_out, run_directory
from slimopt.train.tokenizer import (
    TextTokenizer,
    bpe_tokenizer,
    default_cache_dir,
    pack,
    pretrained_tokenizer,
)


@dataclass
class TrainConfig:
    """Everything a run needs; the CLI flags map one to one onto these fields."""

    model: str = "llama_20m"
    optimizer: str = "adamw"
    data: str = "shakespeare"
    tokenizer: str | None = None  # None: byte-level BPE trained on the training split
    vocab_size: int = 8192
    steps: int = 1000
    batch_size: int = 64  # sequences per optimizer step
    micro_batch_size: int | None = None  # sequences per forward pass (per process); None: all at once
    seq_len: int = 256
    lr: float = 1e-3
    warmup: float = 0.1  # a fraction of the steps if < 1, else a number of steps
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    eval_every: int | None = None  # None: a tenth of the steps (10 validations per run)
    eval_batches: int = 20
    save_every: int = 0  # 0: only at the end (and on SIGINT)
    out: str | None = None  # None: runs/<model>-<optimizer>-<time>, new for every run
    overwrite: bool = False  # replace a run already in ``out`` (else starting there is refused)
    device: str = "auto"  # auto (CUDA when available), cpu or cuda
    resume: str | None = None
    seed: int = 0
    bf16: bool = False
    checkpointing: bool = False
    layerwise: bool = False  # update each parameter inside backward (slimopt.layerwise)
    distributed: str | None = None  # under torchrun: ddp (its default), zero1 or fsdp2; none: one process
    refresh_from: str = "step"  # layer-wise: a refresh sees the step's gradient or its first micro-batch's
    validation_fraction: float = 0.05
    max_documents: int | None = None
    optimizer_options: dict[str, Any] = field(default_factory=dict)  # rank, states, weight_decay, …

    def __post_init__(self) -> None:
        """Validate every value (``ValueError`` naming the flag and the value) and fill in the
        defaults that depend on others (``eval_every``, ``out``)."""
        for name in ("steps", "seq_len", "vocab_size", "batch_size", "eval_batches"):
            _check(name, getattr(self, name), "a positive integer", lambda v: v > 0)
        if self.micro_batch_size is not None:
            _check("micro_batch_size", self.micro_batch_size, "a positive integer", lambda v: v > 0)
        micro = self.micro_batch_size or self.batch_size
        if self.batch_size % micro:
            raise ValueError(
                f"batch size {self.batch_size} is not a positive multiple of the micro-batch size {micro}"
            )
        _check("lr", self.lr, "a positive number", lambda v: v > 0)
        for name in ("warmup", "grad_clip", "save_every"):
            _check(name, getattr(self, name), "a number >= 0", lambda v: v >= 0)
        _check("min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        if self.eval_every is None:
            self.eval_every = max(1, self.steps // 10)
        _check("eval_every", self.eval_every, "a positive integer", lambda v: v > 0)
        if self.device not in DEVICES:
            raise ValueError(f"unknown --device {self.device!r}; valid: {', '.join(DEVICES)}")
        check_refresh_from(self.refresh_from, self.layerwise, "add --layerwise")
        if self.distributed == "none":
            self.distributed = None
        if self.distributed is not None and self.distributed not in STRATEGIES:
            valid = ", ".join(("none", *STRATEGIES))
            raise ValueError(f"unknown --distributed {self.distributed!r}; valid: {valid}")
        if self.layerwise and self.distributed in ("ddp", "zero1"):
            raise ValueError(
                f"--layerwise with --distributed {self.distributed}: DDP averages gradients after "
                "backward, so layer-wise updates would see unaveraged ones; use --distributed fsdp2"
            )
        if self.resume and not Path(self.resume).is_dir():
            raise ValueError(f"resume directory {self.resume!r} does not exist")
        if self.out is None:
            self.out = str(default_out(f"{Path(self.model).name}-{self.optimizer}"))

    def micro_batches(self, processes: int) -> tuple[int, int]:
        """Sequences per forward pass of each process, and micro-batches per step, when
        ``processes`` share each step's batch. Raises ``ValueError`` when they do not divide it."""
        micro = self.micro_batch_size or max(1, self.batch_size // processes)
        if self.batch_size % (micro * processes):
            raise ValueError(
                f"batch size {self.batch_size} is not a multiple of the micro-batch size {micro} × "
                f"{processes} processes"
            )
        return micro, self.batch_size // (micro * processes)


DEVICES = ("auto", "cpu", "cuda")


def _check(name: str, value: Any, expected: str, valid: Callable[[Any], bool]) -> None:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
        raise ValueError(f"{flag} must be {expected}, got {value!r}")


def resolve_device(name: str) -> torch.device:
    """The device of ``--device`` (auto: CUDA when available); raises ``ValueError`` for cuda
    without a CUDA device."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; valid here: auto, cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """Multiplier of the peak learning rate at each step: linear warm-up from 0, then a cosine
    from 1 down to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Batches:
    """Rows of packed tokens in a seeded permutation per epoch; ``position`` counts rows served,
    so it alone restores the order on resume."""

    def __init__(self, rows: Tensor, seed: int) -> None:
        self.rows, self.seed, self.position = rows, seed, 0
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def take(self, count: int) -> Tensor:
        picked = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.rows))
            if epoch != self._epoch:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._epoch, self._order = epoch, torch.randperm(len(self.rows), generator=generator)
            picked.append(self.rows[self._order[index]])
            self.position += 1
        return torch.stack(picked)


def prepare_data(config: TrainConfig) -> tuple[TextTokenizer, Tensor, Tensor]:
    """Tokenizer, training rows and validation rows of the configured corpus."""
    documents = load_corpus(config.data, max_documents=config.max_documents)
    train_texts, validation_texts = split_documents(documents, config.validation_fraction)
    if config.tokenizer:
        tokenizer = pretrained_tokenizer(config.tokenizer)
    else:
        tokenizer = bpe_tokenizer(train_texts, config.vocab_size, default_cache_dir())
    train_rows = pack(tokenizer.encode(train_texts), config.seq_len, tokenizer.eos_id)
    validation_rows = pack(tokenizer.encode(validation_texts), config.seq_len, tokenizer.eos_id)
    return tokenizer, train_rows, validation_rows


def build_model(config: TrainConfig, vocab_size: int) -> nn.Module:
    """A LLaMA preset, or a Hugging Face config file or directory."""
    if Path(config.model).exists():
        from transformers import AutoConfig, LlamaForCausalLM

        hf_config = AutoConfig.from_pretrained(config.model)
        hf_config.vocab_size = vocab_size
        model = LlamaForCausalLM(hf_config)
    else:
        model = build_llama(config.model, vocab_size, max_seq_len=config.seq_len)
    if config.checkpointing:
        enable_checkpointing(model)
    return model


@torch.no_grad()
def evaluate(model: nn.Module, rows: Tensor, config: TrainConfig, device: torch.device, size: int) -> float:
    """Mean loss over the first ``eval_batches`` batches of ``size`` validation rows (every
    process of a run evaluates the same ones)."""
    model.eval()
    losses = []
    for first in range(0, min(len(rows), config.eval_batches * size), size):
        batch = rows[first : first + size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
            losses.append(model(input_ids=batch, labels=batch).loss.float().item())
    model.train()
    return sum(losses) / len(losses)


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


def train(config: TrainConfig, *, progress: bool = True, label: str | None = None) -> dict[str, Any]:
    """Run (or resume) training; return the summary that is also written to ``out/summary.json``.

    With ``progress`` a bar (named ``label``, default the optimizer) shows the steps and short
    messages go to stderr: the run directory, the device, a resumed step, each validation, and
    on SIGINT the command that continues the run. Under ``torchrun`` every process runs this
    (``slimopt.train.parallel``); the first one shows progress and writes the run's files.
    Raises ``ValueError`` (a ``CheckpointError`` for checkpoints) for a run that cannot start,
    before anything is written."""
    parallel = start_run(config.distributed, config.device)
    try:
        return _train(config, parallel, progress, label)
    finally:
        parallel.close()


def _train(config: TrainConfig, parallel: Parallel, progress: bool, label: str | None) -> dict[str, Any]:
    say = _messenger(progress and parallel.main)
    micro, accumulation = config.micro_batches(parallel.world)
    config.out = from_first(config.out)  # a default name holds the time: the first process's
    out = Path(config.out)
    resuming_here = config.resume is not None and run_directory(config.resume).resolve() == out.resolve()
    problem = None
    if parallel.main and not resuming_here:
        try:
            claim(out, overwrite=config.overwrite)
        except ValueError as error:
            problem = str(error)
    problem = from_first(problem)
    if problem is not None:
        raise ValueError(problem)
    device = parallel.device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    tokenizer, train_rows, validation_rows = parallel.first_then_others(lambda: prepare_data(config))
    model = build_model(config, tokenizer.vocab_size).to(device)
    wrapped = parallel.wrap(model)
    options, note = _options_for(config, parallel)
    optimizer = parallel.optimizer(model, config.optimizer, config.lr, options)
    warmup = int(config.warmup * config.steps) if config.warmup < 1 else int(config.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(config.steps, warmup, config.min_lr_ratio)
    )
    batches = Batches(train_rows, config.seed)
    start_step = 0
    metrics_path = out / "metrics.jsonl"
    if config.resume:
        checkpoint, state = _resume(config.resume, model, optimizer)
        schedule.load_state_dict(state["schedule"])
        batches.position, start_step = state["position"], state["step"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        say(f"resuming from step {start_step} of {config.steps} ({checkpoint})")
        # Steps logged after the checkpoint are redone: drop them from the log.
        if metrics_path.exists() and parallel.main:
            lines = metrics_path.read_text().splitlines()
            kept = [line for line in lines if json.loads(line)["step"] <= start_step]
            metrics_path.write_text("".join(line + "\n" for line in kept))
    if parallel.main:
        out.mkdir(parents=True, exist_ok=True)
        saved_config = {k: v for k, v in asdict(config).items() if k != "overwrite"}
        (out / "config.json").write_text(json.dumps(saved_config, indent=1))
    parameters = sum(p.numel() for p in model.parameters())
    where = str(device)
    if parallel.strategy is not None:
        where = f"{parallel.world} processes ({parallel.strategy}, {device.type})"
    paths = getattr(getattr(optimizer, "optim", optimizer), "fused_path", [])
    fused = " (fused step)" if paths and all(path == "fused" for path in paths) else ""
    say(
        f"training {config.model} ({_count(parameters)} parameters) with {config.optimizer}"
        f"{_rank_note(optimizer, config)}{note}{fused} on {where}; run directory {out}"
    )
    say(describe_optimizer(getattr(optimizer, "optim", optimizer), model, parameters=False))

    def save(step: int) -> Path:
        trainer_state = {
            "step": step,
            "position": batches.position,
            "schedule": schedule.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        sharded = parallel.sharded_checkpoints
        return save_checkpoint(out / "checkpoints", step, model, optimizer, trainer_state, sharded=sharded)

    def log(record: dict[str, Any]) -> None:
        if parallel.main:
            with metrics_path.open("a") as stream:
                stream.write(json.dumps(record) + "\n")

    # Layer-wise: the handle updates, clips (per tensor) and steps the schedule inside backward.
    handle = None
    if config.layerwise:
        handle = layerwise(
            optimizer,
            accumulation,
            max_grad_norm=config.grad_clip or None,
            scheduler=schedule,
            refresh_from=config.refresh_from,
        )

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # a comparison trains several models in one process
    bar = _progress(progress and parallel.main, config.steps, start_step, label or config.optimizer)
    tokens_per_step = config.batch_size * config.seq_len
    summary: dict[str, Any] = {"optimizer": config.optimizer, "interrupted": False, "out": str(out)}
    memory = peak = 0
    began_run = time.perf_counter()
    with _Interrupt() as interrupt:
        for step in range(start_step + 1, config.steps + 1):
            began = time.perf_counter()
            loss = 0.0
            lr = schedule.get_last_lr()[0]
            # On the CPU the first steps of a run are counted exactly: the first creates the
            # optimizer state and bases, the second is a steady step (what slimopt memory plans).
            tracker = None
            if device.type == "cpu" and step <= start_step + 2:
                tracker = track_memory(model, optimizer)
            with tracker or contextlib.nullcontext():
                for _ in range(accumulation):
                    batch = parallel.take(batches.take(micro * parallel.world)).to(device)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                        micro_loss = wrapped(input_ids=batch, labels=batch).loss / accumulation
                    micro_loss.backward()
                    loss += micro_loss.item()
                    del batch, micro_loss
                if handle is None:
                    if config.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                    optimizer.step()
                    schedule.step()
                optimizer.zero_grad(set_to_none=True)
            # One all-reduce: the mean loss over the processes, and whether any was interrupted.
            loss, interrupted = parallel.sum([loss, float(interrupt.requested)])
            loss /= parallel.world
            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "tokens_per_s": tokens_per_step / (time.perf_counter() - began),
            }
            if tracker is not None:
                record["memory_bytes"] = memory = tracker.peak
            elif device.type == "cuda":
                record["memory_bytes"] = memory = torch.cuda.max_memory_allocated(device)
            peak = max(peak, memory)
            if step % config.eval_every == 0 or step == config.steps:
                record["val_loss"] = evaluate(wrapped, validation_rows, config, device, micro)
                record["val_ppl"] = math.exp(record["val_loss"])
                val_loss, val_ppl = record["val_loss"], record["val_ppl"]
                say(f"step {step}: validation loss {val_loss:.4f}, perplexity {val_ppl:.2f}")
            log(record)
            bar.update(1)
            bar.set_postfix(
                loss=f"{loss:.3f}",
                lr=f"{lr:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                mem=f"{memory / 2**20:.0f}MiB",
            )
            if interrupted:
                summary["interrupted"] = True
                checkpoint = save(step)
                again = "slimopt train" if parallel.strategy is None else "torchrun ... -m slimopt.cli train"
                say(
                    f"interrupted at step {step} of {config.steps}; saved {checkpoint}. "
                    f"Continue with: {again} --resume {shlex.quote(str(out))}"
                )
                break
            if config.save_every and step % config.save_every == 0 and step != config.steps:
                save(step)
        else:
            save(config.steps)
    if handle is not None:
        handle.remove()
    bar.close()
    state_bytes = parallel.gather(state_nbytes(optimizer))
    peaks = parallel.gather(peak)
    if not parallel.main:
        return _finished(None)
    history = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    evaluations = [r for r in history if "val_loss" in r]
    summary |= {
        "steps": history[-1]["step"] if history else start_step,
        "total_steps": config.steps,
        "seconds": time.perf_counter() - began_run,
        "final_train_loss": history[-1]["loss"] if history else None,
        "val_loss": evaluations[-1]["val_loss"] if evaluations else None,
        "val_ppl": evaluations[-1]["val_ppl"] if evaluations else None,
        "state_bytes": sum(state_bytes),
        "peak_memory_bytes": max(peaks),
        "tokens_per_s": sum(r["tokens_per_s"] for r in history) / max(1, len(history)),
        "parameters": parameters,
        "tokenizer": tokenizer.description,
        "device": str(device),
    }
    if parallel.strategy is not None:
        summary |= {
            "distributed": parallel.strategy,
            "processes": parallel.world,
            "state_bytes_per_process": state_bytes,
            "peak_memory_bytes_per_process": peaks,
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return _finished(summary)


def _finished(summary: dict[str, Any] | None) -> dict[str, Any]:
    """The first process's summary on every process, once every process is done with its
    collectives: none tears its process group down while another still uses it."""
    summary = from_first(summary)
    barrier()
    return summary


def _options_for(config: TrainConfig, parallel: Parallel) -> tuple[dict[str, Any], str]:
    """The optimizer options of the run, and a note on what the strategy changed: under FSDP2 a
    projected optimizer keeps its basis on the unsplit side unless told otherwise."""
    options = dict(config.optimizer_options)
    projected = OPTIMIZERS[resolve_name(config.optimizer)].projected
    if parallel.strategy == "fsdp2" and projected and "proj_type" not in options:
        options["proj_type"] = "right"
        return options, " (proj_type right: FSDP2 splits the rows)"
    return options, ""


def describe(summary: dict[str, Any]) -> str:
    """The end of a run in a few human lines: results, and where the files are."""
    done = "interrupted after" if summary["interrupted"] else "finished"
    lines = [
        f"{summary['optimizer']}: {done} {summary['steps']} of {summary['total_steps']} steps in "
        f"{_duration(summary['seconds'])} on {summary['device']}"
    ]
    if summary["final_train_loss"] is not None:
        results = f"training loss {summary['final_train_loss']:.4f}"
        if summary["val_loss"] is not None:
            results += f", validation loss {summary['val_loss']:.4f} (perplexity {summary['val_ppl']:.2f})"
        lines.append("  " + results)
    lines.append(
        f"  optimizer state {summary['state_bytes'] / 2**20:.2f} MiB, peak memory "
        f"{summary['peak_memory_bytes'] / 2**20:.1f} MiB, {summary['tokens_per_s']:.0f} tokens/s"
    )
    lines.append(f"  files in {summary['out']}: config.json, metrics.jsonl, summary.json, checkpoints/")
    return "\n".join(lines)


def _count(number: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if number >= scale:
            return f"{number / scale:.1f}{suffix}"
    return str(number)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{seconds:.1f} s" if seconds < 60 else f"{minutes} min {rest} s"


def _resume(resume: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Path, dict[str, Any]]:
    """Load the checkpoint ``--resume`` names (a run: its newest; or a checkpoint directory)."""
    path = Path(resume)
    if (path / MANIFEST).exists():
        directory, checkpoint = path.parent, path
    else:
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        checkpoint = latest_checkpoint(directory)
        if checkpoint is None:
            raise ValueError(f"no checkpoint under {resume!r} to resume from")
    try:
        return checkpoint, load_checkpoint(checkpoint, model, optimizer)
    except CheckpointError as error:
        older = newest_intact(directory, before=checkpoint)
        if older is None:
            raise
        raise CheckpointError(f"{error}; the newest intact checkpoint is {older}: --resume {older}") from None


def _rank_note(optimizer: torch.optim.Optimizer, config: TrainConfig) -> str:
    ranks = [group["rank"] for group in optimizer.param_groups if "rank" in group]
    if not ranks:
        return ""
    if "rank" in config.optimizer_options:
        return f" (rank {ranks[0]})"
    return f" (rank {ranks[0]}, the default: a quarter of the matrices' smaller side)"


def _messenger(enabled: bool) -> Callable[[str], None]:
    """Prints a line to stderr without breaking a progress bar (nothing when not ``enabled``)."""
    from tqdm.auto import tqdm

    def say(message: str) -> None:
        if enabled:
            tqdm.write(message, file=sys.stderr)

    return say


def _progress(enabled: bool, total: int, initial: int, label: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, desc=label
    )
