"""What the planner plans: one training setting (``PlanSetting``), checked before anything is
built, and the model it builds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimopt import models
from slimopt.checks import number
from slimopt.distributed import STRATEGIES as PROCESS_STRATEGIES
from slimopt.distributed import strategy_error
from slimopt.distributed.grad_sync import GRAD_SYNCS
from slimopt.layerwise import check_refresh_from
from slimopt.registry import OPTIMIZERS, resolve_name
from slimopt.targets import projected_weights
from slimopt.weight_formats import weight_dtype


@dataclass(frozen=True)
class PlanSetting:
    """One training step to plan: the model, the optimizer (a registry name) and its
    ``options`` (``build_optimizer``'s: ``states``, ``update_proj_gap``, …), the batch and the
    processes; see ``plan_memory`` for each field. ``rank_defaulted``: the rank is the one the
    optimizer chose (none was given)."""

    model: str
    optimizer: str
    rank: int | None = None
    layerwise: bool = False
    refresh_from: str = "step"
    batch_size: int = 1
    seq_len: int = 256
    accumulation_steps: int = 1
    checkpointing: bool = False
    dtype: str = "bf16"
    vocab_size: int | None = None  # None: the model's own
    gpu_memory_gib: float | None = None
    processes: int = 1
    distributed: str | None = None
    grad_sync: str = "auto"
    options: dict[str, Any] = field(default_factory=dict)
    rank_defaulted: bool = False

    @classmethod
    def checked(cls, **fields: Any) -> PlanSetting:
        """The setting of ``fields``, its optimizer and weights' dtype in their canonical names;
        raises ``ValueError`` naming a bad model, optimizer, size, dtype, rank, process count or
        strategy (and what training refuses: int8 weights or layer-wise mode under a strategy
        that cannot take them)."""
        setting = cls(**fields)
        model = setting.model
        if model not in models.LLAMA_PRESETS and not Path(model).exists():
            presets = ", ".join(models.LLAMA_PRESETS)
            raise ValueError(f"unknown model {model!r}; valid: {presets} or a Hugging Face config path")
        for key in ("batch_size", "seq_len", "accumulation_steps", "vocab_size"):
            value = getattr(setting, key)
            if key == "vocab_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key.replace('_', ' ')} must be a positive integer, got {value!r}")
        setting = replace(
            setting, optimizer=resolve_name(setting.optimizer), dtype=weight_dtype(setting.dtype)
        )
        gpu = setting.gpu_memory_gib
        found = number(gpu)
        if gpu is not None and (found is None or found <= 0):
            raise ValueError(f"gpu memory must be a finite positive number of GiB, got {gpu!r}")
        check_refresh_from(setting.refresh_from, setting.layerwise, "set layerwise (--layerwise)")
        rank = setting.rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        processes, strategy = setting.processes, setting.distributed
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes must be a positive integer, got {processes!r}")
        if strategy is not None and strategy not in PROCESS_STRATEGIES:
            raise ValueError(f"unknown distributed {strategy!r}; valid: {', '.join(PROCESS_STRATEGIES)}")
        if processes > 1 and strategy is None:
            raise ValueError(
                f"{processes} processes: say how they share the work (distributed: ddp, zero1 or fsdp2)"
            )
        if setting.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"unknown grad sync {setting.grad_sync!r}; valid: {', '.join(GRAD_SYNCS)}")
        error = strategy_error(
            strategy, weights=setting.dtype, layerwise=setting.layerwise, grad_sync=setting.grad_sync
        )
        if error is not None:  # what training refuses is not planned
            what = {"weights": f"dtype {setting.dtype}", "layerwise": "layerwise"}.get(
                error[0], f"grad sync {setting.grad_sync}"
            )
            raise ValueError(f"{what} with distributed {strategy}: {error[1]}")
        return setting

    def as_dict(self) -> dict[str, Any]:
        """The setting as a flat dict, as plans print it: the optimizer's options among the
        fields, ``rank_defaulted`` only where it holds."""
        fields = asdict(self)
        options = fields.pop("options")
        if not fields["rank_defaulted"]:
            del fields["rank_defaulted"]
        return {**fields, **options}

    def build_model(self, device: torch.device) -> nn.Module:
        """The model on ``device``, built directly in its dtype and in training mode
        (``slimopt.models.build_model``)."""
        with torch.device(device):
            return models.build_model(
                self.model,
                self.vocab_size,
                self.seq_len,
                weights=self.dtype,
                checkpointing=self.checkpointing,
            )

    def check_rank(self, model: nn.Module) -> None:
        """Raise ``ValueError`` when the rank is larger than a matrix the optimizer projects."""
        if self.rank is None or not OPTIMIZERS[self.optimizer].projected:
            return
        for name, weight in projected_weights(model, self.options.get("target_modules")).items():
            shape = weight.shape[-2:]  # an expert's matrix, for stacked experts
            if self.rank > min(shape):
                raise ValueError(
                    f"rank {self.rank} is larger than the matrix {name} ({shape[0]}×{shape[1]}); "
                    f"valid ranks: 1 to {min(shape)}"
                )
