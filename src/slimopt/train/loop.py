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

from slimopt.layerwise import check_refresh_from, layerwise
from slimopt.memory import LiveBytes, state_nbytes, state_tensors
from slimopt.registry import build_optimizer
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
    micro_batch_size: int | None = None  # sequences per forward pass; None = batch_size
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
        if self.resume and not Path(self.resume).is_dir():
            raise ValueError(f"resume directory {self.resume!r} does not exist")
        if self.out is None:
            self.out = str(default_out(f"{Path(self.model).name}-{self.optimizer}"))

    @property
    def accumulation(self) -> int:
        return self.batch_size // (self.micro_batch_size or self.batch_size)


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
def evaluate(model: nn.Module, rows: Tensor, config: TrainConfig, device: torch.device) -> float:
    """Mean loss over the first ``eval_batches`` micro-batches of the validation rows."""
    model.eval()
    size = config.micro_batch_size or config.batch_size
    losses = []
    for start in range(0, min(len(rows), config.eval_batches * size), size):
        batch = rows[start : start + size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
            losses.append(model(input_ids=batch, labels=batch).loss.float().item())
    model.train()
    return sum(losses) / len(losses)


def track_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> LiveBytes:
    """A ``LiveBytes`` that already counts what lives between steps (weights, buffers, optimizer
    state), so its ``peak`` over a training step is the step's exact peak of tensor memory."""
    tracker = LiveBytes()
    tracker.adopt([*model.parameters(), *model.buffers(), *state_tensors(optimizer)])
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
    on SIGINT the command that continues the run. Raises ``ValueError`` (a ``CheckpointError``
    for checkpoints) for a run that cannot start, before anything is written."""
    say = _messenger(progress)
    out = Path(config.out)
    resuming_here = config.resume is not None and run_directory(config.resume).resolve() == out.resolve()
    if not resuming_here:
        claim(out, overwrite=config.overwrite)
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    tokenizer, train_rows, validation_rows = prepare_data(config)
    model = build_model(config, tokenizer.vocab_size).to(device)
    optimizer = build_optimizer(model, config.optimizer, lr=config.lr, **config.optimizer_options)
    warmup = int(config.warmup * config.steps) if config.warmup < 1 else int(config.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(config.steps, warmup, config.min_lr_ratio)
    )
    batches = Batches(train_rows, config.seed)
    start = 0
    metrics_path = out / "metrics.jsonl"
    if config.resume:
        checkpoint, state = _resume(config.resume, model, optimizer)
        schedule.load_state_dict(state["schedule"])
        batches.position, start = state["position"], state["step"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        say(f"resuming from step {start} of {config.steps} ({checkpoint})")
        # Steps logged after the checkpoint are redone: drop them from the log.
        if metrics_path.exists():
            kept = [
                line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= start
            ]
            metrics_path.write_text("".join(line + "\n" for line in kept))
    out.mkdir(parents=True, exist_ok=True)
    saved_config = {k: v for k, v in asdict(config).items() if k != "overwrite"}
    (out / "config.json").write_text(json.dumps(saved_config, indent=1))
    parameters = sum(p.numel() for p in model.parameters())
    say(
        f"training {config.model} ({_count(parameters)} parameters) with {config.optimizer}"
        f"{_rank_note(optimizer, config)} on {device}; run directory {out}"
    )

    def save(step: int) -> Path:
        trainer_state = {
            "step": step,
            "position": batches.position,
            "schedule": schedule.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        return save_checkpoint(out / "checkpoints", step, model, optimizer, trainer_state)

    def log(record: dict[str, Any]) -> None:
        with metrics_path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")

    # Layer-wise: the handle updates, clips (per tensor) and steps the schedule inside backward.
    handle = None
    if config.layerwise:
        handle = layerwise(
            optimizer,
            config.accumulation,
            max_grad_norm=config.grad_clip or None,
            scheduler=schedule,
            refresh_from=config.refresh_from,
        )

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # a comparison trains several models in one process
    bar = _progress(progress, config.steps, start, label or config.optimizer)
    tokens_per_step = config.batch_size * config.seq_len
    summary: dict[str, Any] = {"optimizer": config.optimizer, "interrupted": False, "out": str(out)}
    memory = 0
    began_run = time.perf_counter()
    with _Interrupt() as interrupt:
        for step in range(start + 1, config.steps + 1):
            began = time.perf_counter()
            loss = 0.0
            lr = schedule.get_last_lr()[0]
            # On the CPU the first steps of a run are counted exactly: the first creates the
            # optimizer state and bases, the second is a steady step (what slimopt memory plans).
            tracker = track_memory(model, optimizer) if device.type == "cpu" and step <= start + 2 else None
            with tracker or contextlib.nullcontext():
                for _ in range(config.accumulation):
                    batch = batches.take(config.micro_batch_size or config.batch_size).to(device)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                        micro_loss = model(input_ids=batch, labels=batch).loss / config.accumulation
                    micro_loss.backward()
                    loss += micro_loss.item()
                    del batch, micro_loss
                if handle is None:
                    if config.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                    optimizer.step()
                    schedule.step()
                optimizer.zero_grad(set_to_none=True)
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
            if step % config.eval_every == 0 or step == config.steps:
                record["val_loss"] = evaluate(model, validation_rows, config, device)
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
            if interrupt.requested:
                summary["interrupted"] = True
                checkpoint = save(step)
                say(
                    f"interrupted at step {step} of {config.steps}; saved {checkpoint}. "
                    f"Continue with: slimopt train --resume {shlex.quote(str(out))}"
                )
                break
            if config.save_every and step % config.save_every == 0 and step != config.steps:
                save(step)
        else:
            save(config.steps)
    if handle is not None:
        handle.remove()
    bar.close()
    history = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    evaluations = [r for r in history if "val_loss" in r]
    summary |= {
        "steps": history[-1]["step"] if history else start,
        "total_steps": config.steps,
        "seconds": time.perf_counter() - began_run,
        "final_train_loss": history[-1]["loss"] if history else None,
        "val_loss": evaluations[-1]["val_loss"] if evaluations else None,
        "val_ppl": evaluations[-1]["val_ppl"] if evaluations else None,
        "state_bytes": state_nbytes(optimizer),
        "peak_memory_bytes": max((r["memory_bytes"] for r in history if "memory_bytes" in r), default=0),
        "tokens_per_s": sum(r["tokens_per_s"] for r in history) / max(1, len(history)),
        "parameters": parameters,
        "tokenizer": tokenizer.description,
        "device": str(device),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


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
