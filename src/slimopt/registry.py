"""Optimizer names and ``build_optimizer``: from a model to configured param groups.

A name is a configuration of the composable pieces (update rule × projection × state storage),
not a class of its own; the modules
whose weights are projected are chosen with Hugging Face's ``optim_target_modules`` semantics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from slimopt.optimizer import (
    PROJECTION_DEFAULTS,
    AdamW4bit,
    AdamWTernary,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    GaLoreOptimizer,
)

DEFAULT_RANK = 128

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
    rank ``rank``, default 128, plus any projection ``options``), ``"unprojected"`` (every other
    matrix) and ``"no_decay"`` (1-D parameters: biases and norms, without weight decay).
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
    groups = [
        {
            "name": "projected",
            "params": [p for i, p in params.items() if i in projected_ids],
            "rank": DEFAULT_RANK if rank is None else rank,
            **projection,
        },
        {
            "name": "unprojected",
            "params": [p for i, p in params.items() if i not in projected_ids and p.dim() >= 2],
        },
        {"name": "no_decay", "params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return spec.cls([g for g in groups if g["params"]], lr=lr, **options)
