"""Optimizer names and ``build_optimizer``: from a model to configured param groups.

A name is a configuration of the composable pieces (update rule × projection × state storage),
not a class of its own; the modules
whose weights are projected are chosen with Hugging Face's ``optim_target_modules`` semantics.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from slimopt.codecs.rows import matrix_shape
from slimopt.optimizer import (
    PROJECTION_DEFAULTS,
    AdamW4bit,
    AdamWTernary,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    GaLoreOptimizer,
)

# Projection and storage options, with the type a text value (a flag, optim_args) is read as.
OPTION_TYPES: dict[str, type] = {
    "rank": int,
    "update_proj_gap": int,
    "scale": float,
    "proj_type": str,
    "proj_method": str,
    "on_subspace_change": str,
    "stagger": bool,
    "basis_states": str,
    "states": str,
    "block_size": int,
    "param_rounding": str,
    "fused": bool,
}


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and whether its selected matrices are projected."""

    cls: type[GaLoreOptimizer]
    projected: bool


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(GaLoreAdamW, projected=False),
    "galore_adamw": OptimizerSpec(GaLoreAdamW, projected=True),
    "galore_adafactor": OptimizerSpec(GaLoreAdafactor, projected=True),
    "adafactor": OptimizerSpec(GaLoreAdafactor, projected=False),
    "adamw8bit": OptimizerSpec(GaLoreAdamW8bit, projected=False),
    "adamw4bit": OptimizerSpec(AdamW4bit, projected=False),
    "adamw_ternary": OptimizerSpec(AdamWTernary, projected=False),
    "galore_adamw8bit": OptimizerSpec(GaLoreAdamW8bit, projected=True),
    "galore_adamw4bit": OptimizerSpec(AdamW4bit, projected=True),
    "galore_adamw_ternary": OptimizerSpec(AdamWTernary, projected=True),
}


# Hugging Face's ``TrainingArguments.optim`` names for the same configurations, accepted
# wherever a name is (``adamw_torch_8bit`` is torchao's block-wise 8-bit AdamW, the same scheme).
HF_NAMES: dict[str, str] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_8bit": "adamw8bit",
    "adamw_bnb_8bit": "adamw8bit",
    "adamw_torch_8bit": "adamw8bit",
    "adamw_torch_4bit": "adamw4bit",
    "adafactor": "adafactor",
    "galore_adamw": "galore_adamw",
    "galore_adamw_8bit": "galore_adamw8bit",
    "galore_adafactor": "galore_adafactor",
}


def available_optimizers() -> list[str]:
    """Return slimopt's names for the optimizers ``build_optimizer`` accepts (it also takes the
    Hugging Face names of ``HF_NAMES``)."""
    return list(OPTIMIZERS)


def resolve_name(name: str) -> str:
    """slimopt's name for ``name`` (its own, or a Hugging Face ``optim`` name of ``HF_NAMES``).

    Raises ``ValueError`` naming the valid names.
    """
    if name in OPTIMIZERS:
        return name
    if name in HF_NAMES:
        return HF_NAMES[name]
    raise ValueError(
        f"unknown optimizer {name!r}; available: {', '.join(available_optimizers())} "
        f"(or Hugging Face's {', '.join(n for n in HF_NAMES if n not in OPTIMIZERS)})"
    )


def output_head(model: nn.Module) -> nn.Module | None:
    """Return the model's output projection (``get_output_embeddings()`` or ``lm_head``), if any."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if isinstance(head, nn.Module):
        return head
    return getattr(model, "lm_head", None)


def select_target_modules(model: nn.Module, target_modules: str | list[str] | None = None) -> list[str]:
    """Return the names of the ``nn.Linear`` modules selected by ``target_modules``.

    ``None``: every linear layer except the output head (the attention and MLP projections of a
    transformer). ``"all-linear"``: every linear layer. A string: a regular expression that must
    match a module name in full. A list: module names, substrings of names, or full-match regexes.
    Raises ``ValueError`` when nothing is selected.
    """
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    if target_modules is None:
        head = output_head(model)
        selected = [name for name, module in linears.items() if module is not head]
    elif isinstance(target_modules, str) and target_modules.replace("_", "-") == "all-linear":
        selected = list(linears)
    elif isinstance(target_modules, str):
        selected = [name for name in linears if re.fullmatch(target_modules, name)]
    else:
        keys = list(target_modules)
        selected = [
            name
            for name in linears
            if any(key == name or key in name or re.fullmatch(key, name) for key in keys)
        ]
    if not selected:
        shown = ", ".join(list(linears)[:8]) + (", …" if len(linears) > 8 else "")
        raise ValueError(
            f"target_modules={target_modules!r} matches no nn.Linear module; "
            f"linear modules of this model: {shown or 'none'}"
        )
    return selected


def default_rank(matrices: list[Tensor]) -> int:
    """The GaLore paper's rank, r = n/4: a quarter of the smaller dimension most of ``matrices``
    share (a transformer's hidden size: 1024 for LLaMA-7B, 512 for LLaMA-1B)."""
    sides = Counter(min(matrix_shape(matrix.shape)) for matrix in matrices)
    return max(1, sides.most_common(1)[0][0] // 4)


def warn_if_projection_saves_nothing(matrices: list[Tensor], rank: int) -> None:
    """A ``UserWarning`` when moments in a rank-``rank`` space plus the bases take as many
    numbers as the moments of the whole matrices (2·m·n): projection would only cost."""
    full = projected = 0
    breakeven = None
    for matrix in matrices:
        long, short = sorted(matrix_shape(matrix.shape), reverse=True)
        if short == 0:
            continue
        r = min(rank, short)
        full += 2 * long * short
        projected += 2 * long * r + r * short  # moments in the projected space, then the basis
        limit = (2 * long * short) // (2 * long + short)
        breakeven = limit if breakeven is None else min(breakeven, limit)
    if full and projected >= full:
        warnings.warn(
            f"rank {rank} saves no optimizer state: projected moments and bases hold {projected:,} "
            f"numbers, the unprojected moments {full:,}; choose a rank of at most {breakeven}",
            UserWarning,
            stacklevel=3,
        )


def build_optimizer(
    model: nn.Module,
    name: str,
    *,
    lr: float | None,
    rank: int | None = None,
    target_modules: str | list[str] | None = None,
    **options: Any,
) -> GaLoreOptimizer:
    """Return optimizer ``name`` (slimopt's or Hugging Face's, see ``resolve_name``) configured
    for ``model``.

    The param groups, each named by ``group["name"]``, in this order (empty ones left out):
    ``"projected"`` (projecting optimizers only: the weights of the selected linear modules,
    rank ``rank``, default ``default_rank`` of them, plus any projection ``options``),
    ``"unprojected"`` (every other matrix) and ``"no_decay"`` (1-D parameters: biases and norms,
    without weight decay). A rank at which projection saves no state warns.
    Remaining ``options`` (``weight_decay``, ``betas``, …) go to the optimizer class. Raises
    ``ValueError`` for an unknown name, for projection options on an unprojected optimizer, or
    for a target selection that matches nothing.
    """
    name = resolve_name(name)
    spec = OPTIMIZERS[name]
    projection = {key: options.pop(key) for key in list(options) if key in PROJECTION_DEFAULTS}
    if not spec.projected and (rank is not None or target_modules is not None or projection):
        given = ["rank"] * (rank is not None) + ["target_modules"] * (target_modules is not None)
        raise ValueError(
            f"optimizer {name!r} does not project gradients; remove {', '.join(given + list(projection))} "
            f"or choose one of: {', '.join(n for n, s in OPTIMIZERS.items() if s.projected)}"
        )
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    projected_ids: set[int] = set()
    if spec.projected:
        modules = dict(model.named_modules())
        for module_name in select_target_modules(model, target_modules):
            weight = modules[module_name].weight
            if weight.requires_grad:
                projected_ids.add(id(weight))
    projected = [p for i, p in params.items() if i in projected_ids]
    if spec.projected and projected:
        rank = default_rank(projected) if rank is None else rank
        warn_if_projection_saves_nothing(projected, rank)
    groups = [
        {"name": "projected", "params": projected, "rank": rank, **projection},
        {
            "name": "unprojected",
            "params": [p for i, p in params.items() if i not in projected_ids and p.dim() >= 2],
        },
        {"name": "no_decay", "params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return spec.cls([g for g in groups if g["params"]], lr=lr, **options)
