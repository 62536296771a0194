"""``slimopt bench``: optimizer-step and training-step time, state bytes and peak memory of
slimopt's optimizers beside the references, on one LLaMA preset, in one run.

Each optimizer trains a freshly built model (random init; weights stored as ``dtype`` says, by
default bf16 on CUDA and fp32 on the CPU) on random tokens: warm-up steps first (they create the
state, and compile fused steps), then timed steps, each timed whole (forward, backward,
optimizer step) and the optimizer step alone.
References are measured where their package is installed: torch's AdamW (``foreach``, and
``fused`` on CUDA), bitsandbytes' AdamW8bit, torchao's AdamW8bit and AdamW4bit, galore-torch's
GaLoreAdamW8bit. Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and the live tensor
bytes of a step on the CPU (``slimopt.memory.LiveBytes``).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from slimopt.memory import LiveBytes, state_tensors
from slimopt.registry import OPTIMIZERS, build_optimizer, resolve_name
from slimopt.weight_formats import INT8_PARTS, optimizer_options

# References: name → (package that must be installed, whether it needs CUDA, constructor).
REFERENCES: dict[str, tuple[str | None, bool, Callable[[nn.Module, float], Any]]] = {
    "torch_adamw_foreach": (
        None,
        False,
        lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, foreach=True),
    ),
    "torch_adamw_fused": (None, True, lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, fused=True)),
    "bnb_adamw8bit": (
        "bitsandbytes",
        False,
        lambda m, lr: _bitsandbytes().optim.AdamW8bit(m.parameters(), lr=lr),
    ),
    "torchao_adamw8bit": ("torchao", False, lambda m, lr: _torchao().AdamW8bit(m.parameters(), lr=lr)),
    "torchao_adamw4bit": ("torchao", False, lambda m, lr: _torchao().AdamW4bit(m.parameters(), lr=lr)),
    "galore_torch_adamw8bit": ("galore_torch", True, lambda m, lr: _galore_torch(m, lr)),  # rank 512
    "apollo_torch_mini": ("apollo_torch", False, lambda m, lr: _apollo_torch_mini(m, lr)),
    # torch.optim.Muon (torch 2.9 and later) for the matrices, torch's AdamW for the rest.
    "torch_muon": (None, False, lambda m, lr: _torch_muon(m, lr)),
}
# Weight dtypes only slimopt's optimizers write, and why.
SLIMOPT_ONLY = {
    **dict.fromkeys(INT8_PARTS, "the references would change the codes in place"),
    "bf16+8": "the references keep no correction",
}
# How a heading names ``fused=``.
FUSED_WORDS = {None: "auto", True: "on", False: "off"}
DEFAULT = (
    "torch_adamw_foreach,torch_adamw_fused,bnb_adamw8bit,torchao_adamw8bit,apollo_torch_mini,adamw,adamw8bit,"
    "galore_adamw8bit,apollo_mini"
)


def available(
    names: list[str], device: torch.device, dtype: str | None = None
) -> tuple[list[str], list[str]]:
    """``names`` split into those measurable here and those left out (with why). Raises
    ``ValueError`` for a name that is neither slimopt's nor a reference."""
    kept, skipped = [], []
    for name in names:
        if name in REFERENCES:
            package, cuda_only, _ = REFERENCES[name]
            if dtype in SLIMOPT_ONLY:
                skipped.append(f"{name} ({dtype} weights: {SLIMOPT_ONLY[dtype]})")
            elif cuda_only and device.type != "cuda":
                skipped.append(f"{name} (CUDA only)")
            elif package is not None and importlib.util.find_spec(package) is None:
                skipped.append(f"{name} ({package} is not installed)")
            elif name == "torch_muon" and not hasattr(torch.optim, "Muon"):
                skipped.append(f"{name} (torch {torch.__version__} has no torch.optim.Muon: 2.9 and later)")
            else:
                kept.append(name)
            continue
        try:
            resolve_name(name)
        except ValueError:
            valid = ", ".join([*OPTIMIZERS, *REFERENCES])
            raise ValueError(f"unknown optimizer {name!r} for slimopt bench; valid: {valid}") from None
        kept.append(name)
    return kept, skipped


def bench(
    names: list[str],
    *,
    model: str,
    device: torch.device,
    batch: int,
    seq: int,
    steps: int,
    warmup: int = 2,
    rank: int | None = None,
    lr: float = 1e-3,
    dtype: str | None = None,
    fused: bool | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """One row per optimizer of ``names``, each training preset ``model`` on ``batch``
    sequences of ``seq`` tokens: median seconds of a training step and of its optimizer step
    over ``steps`` after ``warmup``, state bytes, peak memory bytes (see the module docstring).
    ``dtype``: how the weights are stored (``slimopt.weight_formats``; None: bf16 on CUDA, fp32
    on the CPU). ``fused``: the ``fused=`` option of slimopt's optimizers (the references have
    their own). Raises ``ValueError`` naming a bad count or option, or for no optimizer, before
    anything is measured."""
    for flag, value in (("batch-size", batch), ("seq-len", seq), ("steps", steps)):
        if value < 1:
            raise ValueError(f"--{flag} must be a positive integer, got {value}")
    if warmup < 0:
        raise ValueError(f"--warmup must be an integer >= 0, got {warmup}")
    if not names:
        raise ValueError(
            f"no optimizer to measure; name one or more of: {', '.join([*OPTIMIZERS, *REFERENCES])}"
        )
    weights = dtype or ("bf16" if device.type == "cuda" else "fp32")
    ours = [name for name in names if name not in REFERENCES]
    shapes = _model(model, torch.device("meta"), weights) if ours else None
    for name in ours:  # every one is built (on the meta device) before any is measured
        _optimizer(shapes, name, lr, rank, dtype, fused)
    rows = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for name in names:
        progress(name)
        torch.manual_seed(0)
        trained = _model(model, device, weights)
        optimizer = _optimizer(trained, name, lr, rank, dtype, fused)
        vocab = trained.config.vocab_size
        step_seconds, optimizer_seconds = [], []
        for step in range(warmup + steps):
            tokens = torch.randint(0, vocab, (batch, seq), device=device)
            began = _now(device)
            trained(input_ids=tokens, labels=tokens).loss.backward()
            stepping = _now(device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ended = _now(device)
            if step >= warmup:
                step_seconds.append(ended - began)
                optimizer_seconds.append(ended - stepping)
        peak = _peak(trained, optimizer, device, batch, seq)
        rows.append(
            {
                "optimizer": name,
                "step_seconds": statistics.median(step_seconds),
                "optimizer_step_seconds": statistics.median(optimizer_seconds),
                "state_bytes": state_bytes(optimizer),
                "peak_memory_bytes": peak,
                "fused_path": getattr(optimizer, "fused_path", None),
            }
        )
        del trained, optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    return rows


def heading(setting: dict[str, Any]) -> str:
    """The line above a table of ``bench`` rows: its ``setting`` (bench's arguments)."""
    return (
        f"{setting['model']} on {setting['device']} (torch {torch.__version__}), "
        f"{setting['dtype'] or 'default'} weights, {setting['batch']}×{setting['seq']} tokens, "
        f"slimopt's fused steps {FUSED_WORDS[setting.get('fused')]}, "
        f"median of {setting['steps']} steps after {setting['warmup']}"
    )


def table(rows: list[dict[str, Any]], setting: str) -> str:
    """The rows as a Markdown table with the setting above it."""
    lines = [
        setting,
        "",
        "| optimizer | training step s | optimizer step s | state MiB | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        peak = row["peak_memory_bytes"]
        shown = "— (compiled)" if peak is None else f"{peak / 2**20:.1f}"
        lines.append(
            f"| {row['optimizer']} | {row['step_seconds']:.4f} | {row['optimizer_step_seconds']:.4f} | "
            f"{row['state_bytes'] / 2**20:.1f} | {shown} |"
        )
    return "\n".join(lines)


def write_json(rows: list[dict[str, Any]], setting: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    return path


def _model(name: str, device: torch.device, weights: str) -> nn.Module:
    from slimopt.models import build_model

    with torch.device(device):
        return build_model(name, None, 2048, weights=weights)


def _optimizer(
    model: nn.Module, name: str, lr: float, rank: int | None, dtype: str | None, fused: bool | None
) -> Any:
    if name in REFERENCES:
        return REFERENCES[name][2](model, lr)
    projection = {"rank": rank} if rank is not None and OPTIMIZERS[resolve_name(name)].projected else {}
    storage = optimizer_options(dtype, {}) if dtype else {}
    return build_optimizer(model, name, lr=lr, fused=fused, **projection, **storage)


def _peak(
    model: nn.Module, optimizer: Any, device: torch.device, batch_size: int, seq_len: int
) -> int | None:
    """Peak memory of the steps so far on CUDA; on the CPU, of one more step counted by
    ``LiveBytes``, or None for a compiled step (torch.compile does not run under the dispatch
    mode that counts, so the count would be of another, eager, execution)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    compiled = "torchao" in type(optimizer).__module__ or "fused" in (
        getattr(optimizer, "fused_path", None) or []
    )
    if compiled:
        return None
    tracker = LiveBytes()
    tracker.adopt([*model.parameters(), *model.buffers(), *_state(optimizer)])
    batch = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), device=device)
    with tracker:
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tracker.peak


def _state(optimizer: Any) -> list[torch.Tensor]:
    """State tensors, with tensor subclasses (torchao) flattened to their inner tensors."""
    tensors = []
    for value in state_tensors(optimizer):
        if hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            tensors += [getattr(value, n) for n in names]
        elif value.dim() > 0:
            tensors.append(value)
    return tensors


def state_bytes(optimizer: Any) -> int:
    """Bytes of every state tensor of ``optimizer``, torchao's tensor subclasses counted by their
    inner tensors and 0-d step counters left out."""
    return sum(t.numel() * t.element_size() for t in _state(optimizer))


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _bitsandbytes() -> Any:
    import bitsandbytes

    return bitsandbytes


def _torchao() -> Any:
    from torchao import optim

    return optim


def _galore_torch(model: nn.Module, lr: float) -> Any:
    """galore-torch's 8-bit GaLoreAdamW as its README sets it up: the attention and MLP weights
    projected at rank 512 (the anchors' setting), everything else plain."""
    from galore_torch import GaLoreAdamW8bit

    matrices, rest = matrices_and_rest(model)
    projected = {"params": matrices, "rank": 512, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
    return GaLoreAdamW8bit([{"params": rest}, projected], lr=lr)


def _apollo_torch_mini(model: nn.Module, lr: float) -> Any:
    """apollo-torch's APOLLO-Mini as its README sets it up: the attention and MLP weights at
    rank 1 with tensor-wise scaling and scale 128, everything else AdamW."""
    from apollo_torch import APOLLOAdamW

    matrices, rest = matrices_and_rest(model)
    projected = {"params": matrices, "rank": 1, "proj": "random", "scale_type": "tensor", "scale": 128}
    return APOLLOAdamW([{"params": rest}, {**projected, "update_proj_gap": 200, "proj_type": "std"}], lr=lr)


class _Together:
    """Optimizers stepped as one (a reference that needs two), their states read as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> dict[Tensor, Any]:
        return {param: state for optimizer in self.optimizers for param, state in optimizer.state.items()}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _torch_muon(model: nn.Module, lr: float) -> Any:
    """torch.optim.Muon as its documentation sets it up: the attention and MLP weights Muon
    (``adjust_lr_fn="match_rms_adamw"``, so that one rate serves both, as slimopt's ``muon``),
    everything else torch's AdamW (foreach)."""
    matrices, rest = matrices_and_rest(model)
    muon = torch.optim.Muon(matrices, lr=lr, adjust_lr_fn="match_rms_adamw")
    return _Together(muon, torch.optim.AdamW(rest, lr=lr, weight_decay=0.1, foreach=True))


def matrices_and_rest(model: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """The attention and MLP weights (every matrix but the embedding and head), and the rest."""
    matrices = [
        p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n
    ]
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]
