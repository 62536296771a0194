"""Optimizer names and ``build_optimizer``: ``names`` (slimopt's names and Hugging Face's, each a
configuration of update rule × projection × state storage), ``ranks`` (the default rank and
the warning for one that saves nothing) and ``build`` (from a model to configured param
groups)."""

from slimopt.registry.build import ROW_SPLIT_PROJ_TYPE, TACO_FALLBACK, build_optimizer
from slimopt.registry.names import (
    HF_DEFAULTS,
    HF_NAMES,
    OPTIMIZERS,
    OptimizerSpec,
    available_optimizers,
    hugging_face_defaults,
    rank_origin,
    resolve_name,
)
from slimopt.registry.ranks import default_rank, warn_if_projection_saves_nothing

__all__ = [
    "HF_DEFAULTS",
    "HF_NAMES",
    "OPTIMIZERS",
    "ROW_SPLIT_PROJ_TYPE",
    "TACO_FALLBACK",
    "OptimizerSpec",
    "available_optimizers",
    "build_optimizer",
    "default_rank",
    "hugging_face_defaults",
    "rank_origin",
    "resolve_name",
    "warn_if_projection_saves_nothing",
]
