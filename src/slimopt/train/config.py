"""``TrainConfig``: every setting of a run as plain values, checked when made, and the form a
run's ``config.json`` keeps them in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimopt.checks import beyond_float32, number
from slimopt.distributed import STRATEGIES, strategy_error
from slimopt.distributed.grad_sync import GRAD_SYNCS, projected_sync_error
from slimopt.layerwise import check_refresh_from
from slimopt.registry import OPTIMIZERS, resolve_name
from slimopt.train.rundir import default_out
from slimopt.weight_formats import optimizer_options, weight_dtype


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
    bf16: bool = False  # bf16 autocast
    dtype: str = "fp32"  # how the weights are stored: fp32, bf16, bf16+8 or int8 (slimopt.weight_formats)
    checkpointing: bool = False
    layerwise: bool = False  # update each parameter inside backward (slimopt.layerwise)
    # Under torchrun: ddp (the default with several processes), zero1 or fsdp2; "none": one process.
    distributed: str | None = None
    refresh_from: str = "step"  # layer-wise: a refresh sees the step's gradient or its first micro-batch's
    # Under DDP: all-reduce GaLore projections (projected), whole gradients (full), or projected
    # where the optimizer projects (auto); slimopt.distributed.grad_sync.
    grad_sync: str = "auto"
    validation_fraction: float = 0.05
    max_documents: int | None = None
    optimizer_options: dict[str, Any] = field(default_factory=dict)  # rank, states, weight_decay, …

    def __post_init__(self) -> None:
        """Validate every value (``ValueError`` naming the flag and the value) and fill in the
        defaults that depend on others (``eval_every``, ``out``)."""
        for name in ("steps", "seq_len", "vocab_size", "batch_size", "eval_batches"):
            _check_count(name, getattr(self, name))
        if self.micro_batch_size is not None:
            _check_count("micro_batch_size", self.micro_batch_size)
        micro = self.micro_batch_size or self.batch_size
        if self.batch_size % micro:
            raise ValueError(
                f"batch size {self.batch_size} is not a positive multiple of the micro-batch size {micro}"
            )
        _check("lr", self.lr, "a finite number > 0", lambda v: v > 0)
        for name in ("warmup", "grad_clip"):
            _check(name, getattr(self, name), "a finite number >= 0", lambda v: v >= 0)
        _check_count("save_every", self.save_every, minimum=0)
        _check("min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]", lambda v: 0 <= v <= 1)
        _check("validation_fraction", self.validation_fraction, "a number in (0, 1)", lambda v: 0 < v < 1)
        if self.eval_every is None:
            self.eval_every = max(1, self.steps // 10)
        _check_count("eval_every", self.eval_every)
        if self.device not in DEVICES:
            raise ValueError(f"unknown --device {self.device!r}; valid: {', '.join(DEVICES)}")
        check_refresh_from(self.refresh_from, self.layerwise, "add --layerwise")
        self.dtype = weight_dtype(self.dtype)
        optimizer_options(self.dtype, self.optimizer_options)  # raises on a contradiction
        if self.distributed is not None and self.distributed not in ("none", *STRATEGIES):
            valid = ", ".join(("none", *STRATEGIES))
            raise ValueError(f"unknown --distributed {self.distributed!r}; valid: {valid}")
        self._check_grad_sync()
        if self.distributed in STRATEGIES:
            self.check_strategy(self.distributed)
        if self.resume and not Path(self.resume).is_dir():
            raise ValueError(f"resume directory {self.resume!r} does not exist")
        if self.out is None:
            self.out = str(default_out(f"{Path(self.model).name}-{self.optimizer}"))

    def check_strategy(self, strategy: str | None, processes: int | None = None) -> None:
        """Raise ``ValueError`` when this run cannot train with ``processes`` processes sharing
        it by ``strategy`` (None: one process; ``processes`` None: as many as ``--distributed``
        may start), naming the flags that chose them."""
        error = strategy_error(
            strategy, weights=self.dtype, layerwise=self.layerwise, grad_sync=self.grad_sync
        )
        if error is not None:
            setting, reason = error
            flag = {
                "weights": f"--dtype {self.dtype}",
                "layerwise": "--layerwise",
                "grad_sync": f"--grad-sync {self.grad_sync}",
            }[setting]
            how = f"--distributed {strategy}"
            if strategy is None:
                how = "one process"
            elif processes is not None:
                how = f"{processes} processes under torchrun ({strategy})"
            raise ValueError(f"{flag} with {how}: {reason}")

    def _check_grad_sync(self) -> None:
        """Raise ``ValueError`` for an unknown ``--grad-sync``, and for projected with an
        optimizer that needs whole gradients (naming why)."""
        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"unknown --grad-sync {self.grad_sync!r}; valid: {', '.join(GRAD_SYNCS)}")
        if self.grad_sync != "projected":
            return
        spec = OPTIMIZERS[resolve_name(self.optimizer)]
        scale_type = dict(spec.options).get("scale_type", spec.cls.projection_defaults.get("scale_type"))
        scale_type = self.optimizer_options.get("scale_type", scale_type)
        error = projected_sync_error(
            self.optimizer,
            projects=spec.projected and scale_type is None,
            scales=spec.projected and scale_type is not None,
        )
        if error is not None:
            raise ValueError(f"--grad-sync projected: {error}; use --grad-sync full or auto")

    def optimizer_settings(self) -> dict[str, Any]:
        """The optimizer's options: ``optimizer_options`` and what the weights' dtype needs."""
        return {**self.optimizer_options, **optimizer_options(self.dtype, self.optimizer_options)}

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


def _check(name: str, value: Any, expected: str, valid: Callable[[float], bool]) -> None:
    """Raise ``ValueError`` naming the flag unless ``value`` is a number finite in float32
    (``slimopt.checks.number``) that is ``valid``."""
    found = number(value)
    if found is None or not valid(found):
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} must be {expected}, got {value!r}{beyond_float32(value)}")


def _check_count(name: str, value: Any, minimum: int = 1) -> None:
    """Raise ``ValueError`` naming the flag unless ``value`` is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        flag = "--" + name.replace("_", "-")
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{flag} must be {expected}, got {value!r}")


def resolve_device(name: str) -> torch.device:
    """The device of ``--device`` (auto: CUDA when available); raises ``ValueError`` for cuda
    without a CUDA device."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; valid here: auto, cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def saved_config(config: TrainConfig) -> dict[str, Any]:
    """``config`` as a run's ``config.json`` keeps it (what ``--resume`` reads back): without
    ``overwrite`` and ``out`` (a run continues in its own directory, wherever that is now), and
    with local paths (``--model``, ``--data``, ``--tokenizer``) made absolute, so that a run
    resumes from any working directory."""
    values = {k: v for k, v in asdict(config).items() if k not in ("overwrite", "out")}
    for key in ("model", "tokenizer"):
        if values[key] is not None and Path(values[key]).exists():
            values[key] = str(Path(values[key]).resolve())
    data = values["data"]
    if data.startswith("hf:") and Path(data[3:].partition(":")[0]).exists():
        name, colon, rest = data[3:].partition(":")
        values["data"] = f"hf:{Path(name).resolve()}{colon}{rest}"
    elif data != "shakespeare" and not data.startswith("hf:") and Path(data).exists():
        values["data"] = str(Path(data).resolve())
    return values


def read_config_file(path: str) -> dict[str, Any]:
    """The options of a TOML or YAML config file (``slimopt train --config``), dashes in their
    names read as underscores. Raises ``ValueError`` for a missing file, another suffix, or
    contents that are not a mapping."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {path!r} does not exist")
    text = file.read_text()
    if file.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        values = tomllib.loads(text)
    elif file.suffix in (".yaml", ".yml"):
        import yaml

        values = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"config file {path!r} must end in .toml, .yaml or .yml")
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of option names to values")
    return {key.replace("-", "_"): value for key, value in values.items()}
