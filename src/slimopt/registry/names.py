"""Optimizer names: slimopt's (each a configuration of the composable pieces, update rule ×
projection × state storage, not a class of its own) and Hugging Face's ``TrainingArguments.optim``
names for the same configurations, with Hugging Face's projection defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimopt.optimizers import (
    TACO,
    AdamW4bit,
    AdamWTernary,
    APOLLOAdamW,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    Muon,
    Muon4bit,
    Muon8bit,
    MuonTernary,
    SlimoptOptimizer,
)


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class, whether its selected matrices are projected, the name's own rank
    and projection options where the class has no such default (APOLLO-Mini's), and how the
    moments of the matrices it does not project (the embedding, the output head) are stored
    unless ``states`` or ``unprojected_states`` is given (None: as the others)."""

    cls: type[SlimoptOptimizer]
    projected: bool
    rank: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    unprojected_states: str | None = None


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
    "apollo_adamw": OptimizerSpec(APOLLOAdamW, projected=True),
    # int8 moments for the embedding and head: measured to cost nothing (docs/results/weights.md),
    # where fp32 ones were nearly all of APOLLO-Mini's state.
    "apollo_mini": OptimizerSpec(
        APOLLOAdamW,
        projected=True,
        rank=1,
        options=(("scale_type", "tensor"), ("scale", 128.0)),
        unprojected_states="int8",
    ),
    "taco": OptimizerSpec(TACO, projected=False),
    "muon": OptimizerSpec(Muon, projected=False),
    "muon8bit": OptimizerSpec(Muon8bit, projected=False),
    "muon4bit": OptimizerSpec(Muon4bit, projected=False),
    "muon_ternary": OptimizerSpec(MuonTernary, projected=False),
    "galore_muon": OptimizerSpec(Muon, projected=True),
    "galore_muon8bit": OptimizerSpec(Muon8bit, projected=True),
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
    "apollo_adamw": "apollo_adamw",
}


# Hugging Face's defaults for the projection of its names (``Trainer``'s GaLore and APOLLO
# setups), where they differ from slimopt's: a rank of 128 rather than a quarter of the
# matrices' smaller side, and APOLLO's projection.
HF_GALORE_DEFAULTS: dict[str, Any] = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "galore_adamw": HF_GALORE_DEFAULTS,
    "galore_adamw_8bit": HF_GALORE_DEFAULTS,
    "galore_adafactor": HF_GALORE_DEFAULTS,
    "apollo_adamw": {
        **HF_GALORE_DEFAULTS,
        "scale": 1.0,
        "proj_method": "random",
        "scale_type": "channel",
    },
}


def hugging_face_defaults(name: str) -> dict[str, Any]:
    """Hugging Face's defaults for the projection options of its optimizer name ``name``
    (``rank``, ``update_proj_gap``, ``scale``, ``proj_type``; APOLLO's ``proj`` and
    ``scale_type``), as ``Trainer`` passes them; none for a name that does not project."""
    return dict(HF_DEFAULTS.get(name, {}))


def available_optimizers() -> list[str]:
    """Slimopt's names of the optimizers [build_optimizer][slimopt.build_optimizer] accepts.

    It also takes Hugging Face's ``optim`` names (``HF_NAMES``), with Hugging Face's defaults.

    Returns:
        The names, in the registry's order.
    """
    return list(OPTIMIZERS)


def rank_origin(name: str, given: bool) -> str | None:
    """Where the rank of optimizer ``name`` (slimopt's name) came from when the user gave none
    (``given`` False): the name's own (APOLLO-Mini's 1), or ``default_rank``'s; None when given."""
    if given:
        return None
    if OPTIMIZERS[name].rank is not None:
        return f"{name}'s own"
    return "the default: a quarter of the matrices' smaller side"


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
