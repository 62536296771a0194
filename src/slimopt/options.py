"""The param-group schema: every option a slimopt group has besides its rule's hyperparameters,
with its default, and the validation of a whole group (one message per invalid setting).

Validation that needs to know how the group's tensors are placed across processes (split by
rows under FSDP2) stays with the optimizer, which holds that knowledge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slimopt import kernels
from slimopt.checks import beyond_float32, number, number_error
from slimopt.codecs import STATE_FORMATS, moment_formats
from slimopt.codecs.slicing import matrix_shape
from slimopt.projection import PROJ_METHODS, PROJ_TYPES
from slimopt.projection import sides as projection_sides
from slimopt.rules import UpdateRule
from slimopt.sharding import placement_error, split_by_rows
from slimopt.weight_formats.int8 import Int8Weight

SUBSPACE_POLICIES = ("keep", "reset", "rotate")
# APOLLO: how the rule's direction in the projected space scales the raw gradient (None: it is
# projected back, as GaLore does; ``slimopt.core.scaling``).
SCALE_TYPES = (None, "channel", "tensor")
# How a projection basis is stored: entries of orthonormal vectors lose little to 8 bits.
BASIS_STATES = ("fp32", "bf16", "int8")
# How an update is rounded into a bf16 parameter.
PARAM_ROUNDINGS = ("nearest", "stochastic", "corrected")


@dataclass(frozen=True)
class Option:
    """One option of a slimopt param group besides its rule's hyperparameters."""

    name: str
    default: Any
    type: type  # what a text value (a command-line flag, Hugging Face's optim_args) is read as
    part: str  # "projection" or "storage": which defaults it belongs to
    help: str
    accepts_none: bool = False  # written "none"
    layout: bool = False  # a change makes a unit's plan anew (its storage or path changes)
    # Whose value a loaded state dict keeps: "saved" (the checkpoint's, as torch.optim's
    # hyperparameters), "storage" (the loading optimizer's: moments and bases saved in another
    # format are re-encoded) or "own" (the loading optimizer's: how it runs here, how the weights
    # it was built for are rounded).
    on_load: str = "saved"
    given: bool = True  # False: ``build_optimizer`` sets it itself, a user does not


OPTIONS: tuple[Option, ...] = (
    Option("update_proj_gap", 200, int, "projection", "steps between projection refreshes"),
    Option("scale", 0.25, float, "projection", "scale of the update projected back (GaLore's alpha)"),
    Option(
        "proj_type",
        "std",
        str,
        "projection",
        f"which side is projected: {', '.join(PROJ_TYPES)}",
        layout=True,
    ),
    Option("proj_method", "subspace", str, "projection", f"how a basis is found: {', '.join(PROJ_METHODS)}"),
    # APOLLO's gradient scaling and its norm-growth limiter (None: off).
    Option(
        "scale_type",
        None,
        str,
        "projection",
        "APOLLO: scale the raw gradient by the projected direction, per channel or tensor "
        "(none: project the direction back, as GaLore does)",
        accepts_none=True,
        layout=True,
    ),
    Option(
        "norm_growth_limit",
        None,
        float,
        "projection",
        "APOLLO: largest growth of the scaled update's norm from one step to the next (none: no limit)",
        accepts_none=True,
    ),
    Option(
        "on_subspace_change",
        "rotate",
        str,
        "projection",
        f"what the moments do when the basis changes: {', '.join(SUBSPACE_POLICIES)}",
    ),
    Option(
        "stagger",
        True,
        bool,
        "projection",
        "spread the matrices' refreshes over the gap (false: all at once)",
    ),
    Option(
        "basis_states",
        "fp32",
        str,
        "projection",
        f"how a basis is stored: {', '.join(BASIS_STATES)}",
        layout=True,
        on_load="storage",
    ),
    # The first dimension of every parameter indexes independent matrices (a mixture of experts'
    # stacked expert weights): each gets its own moments (and basis, projected), as a 2-D
    # parameter would; Muon orthogonalizes each on its own.
    Option(
        "experts",
        False,
        bool,
        "projection",
        "update each expert of a stacked parameter as its own matrix",
        layout=True,
        given=False,
    ),
    Option(
        "states",
        "fp32",
        str,
        "storage",
        f"state storage: {', '.join(STATE_FORMATS)}, or one per moment as FIRST/SECOND",
        layout=True,
        on_load="storage",
    ),
    Option(
        "block_size",
        None,
        int,
        "storage",
        "quantization block size (none: the format's own)",
        accepts_none=True,
        layout=True,
        on_load="storage",
    ),
    Option(
        "param_rounding",
        "nearest",
        str,
        "storage",
        f"how an update is rounded into bf16 weights: {', '.join(PARAM_ROUNDINGS)}",
        layout=True,
        on_load="own",
    ),
    Option(
        "fused",
        None,
        bool,
        "storage",
        "the fused step (slimopt.kernels, compiled at the first step; false: the reference path; "
        "none: fused on CUDA only)",
        accepts_none=True,
        layout=True,
        on_load="own",
    ),
)
BY_NAME = {option.name: option for option in OPTIONS}

PROJECTION_DEFAULTS: dict[str, Any] = {o.name: o.default for o in OPTIONS if o.part == "projection"}
STORAGE_DEFAULTS: dict[str, Any] = {o.name: o.default for o in OPTIONS if o.part == "storage"}
# The type each option's text is read as; ``rank``, whose presence makes a group projected, too.
OPTION_TYPES: dict[str, type] = {"rank": int, **{o.name: o.type for o in OPTIONS if o.given}}
NONE_OPTIONS = tuple(o.name for o in OPTIONS if o.accepts_none)
# The group keys a unit's plan depends on: changing one makes a new plan.
LAYOUT_OPTIONS = ("rule", "rank", *(o.name for o in OPTIONS if o.layout))
# What a loaded state dict does not bring (``Option.on_load``).
STORAGE_KEYS = tuple(o.name for o in OPTIONS if o.on_load == "storage")
OWN_KEYS = tuple(o.name for o in OPTIONS if o.on_load == "own")


def parse_option(key: str, text: str, kind: type | None = None) -> Any:
    """The value of optimizer option ``key`` written as ``text``, read as ``kind`` (None: its
    type in ``OPTION_TYPES``): the one reading of option text, for the command line's flags and
    Hugging Face's ``optim_args``. Booleans are true/false/1/0; ``NONE_OPTIONS`` may be none.
    Raises ``ValueError`` naming the key, the text and the type expected."""
    kind = OPTION_TYPES[key] if kind is None else kind
    if key in NONE_OPTIONS and text.lower() == "none":
        return None
    if kind is bool:
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0"):
            raise ValueError(f"{key}={text!r}: expected true or false")
        return lowered in ("true", "1")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{key}={text!r}: expected {kind.__name__}") from None


def is_projected(param: Tensor, group: dict[str, Any]) -> bool:
    """Whether ``param`` is projected: a non-empty tensor of two or more dimensions in a group
    with ``rank``."""
    return "rank" in group and param.dim() >= 2 and param.numel() > 0


def group_errors(group: dict[str, Any], rule: UpdateRule, owner: str) -> list[str]:
    """One message per invalid setting of the complete param ``group``, whose update rule is
    ``rule``, of an optimizer named ``owner``: the rule's hyperparameters, weight decay,
    storage, projection, complex parameters and ``fused``."""
    return (
        rule.validate(group)
        + _weight_decay_errors(group)
        + _storage_errors(group)
        + _projection_errors(group)
        + _complex_errors(group, rule, owner)
        + _fused_errors(group, rule)
    )


def fused_unsupported(rule: UpdateRule, group: dict[str, Any], param: Tensor) -> str | None:
    """Why the fused step (``slimopt.kernels``) cannot update ``param`` of ``group`` exactly
    under ``rule``, or None."""
    if rule.fused is None:
        name = type(rule).__name__.removesuffix("Rule")
        return f"the {name} rule has no fused step (AdamW, Adafactor and Muon only)"
    if rule.fused == "muon" and is_projected(param, group):
        return "Muon in a projected subspace (galore_muon) has no fused step"
    if rule.fused == "muon" and split_by_rows(param):
        return "Muon's matrices split across processes (FSDP2) have no fused step"
    if rule.fused == "adafactor" and param.dim() > 2:
        return "Adafactor's factored statistics of tensors with more than 2 dimensions have no fused step"
    if "ternary" in str(group["states"]).split("/") and param.dim() > 2:
        return "ternary states of tensors with more than 2 dimensions have no fused step"
    if param.is_complex():
        return "complex parameters have no fused step"
    if "rank" in group and group.get("scale_type") is not None and param.dim() >= 2:
        return "APOLLO's gradient scaling (scale_type) has no fused step"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"{param.dtype} parameters have no fused step (fp32 and bf16 only)"
    if isinstance(param, Int8Weight):
        return "int8 weights have no fused step"
    if group["param_rounding"] == "corrected":
        return "bf16 weights with an 8-bit correction (param_rounding='corrected') have no fused step"
    return None


def _fused_errors(group: dict[str, Any], rule: UpdateRule) -> list[str]:
    """``fused=True`` is a promise: every parameter of the group takes the fused step."""
    choice = group["fused"]
    if choice not in kernels.FUSED_CHOICES:
        return [f"fused must be None (auto), True or False, got {choice!r}"]
    if choice is not True:
        return []
    reasons = {reason for p in group["params"] if (reason := fused_unsupported(rule, group, p))}
    for device_type in {p.device.type for p in group["params"] if not p.is_meta}:
        compiler = kernels.compiler_error(device_type)
        if compiler:
            reasons.add(compiler)
    return [f"fused=True: {reason}; use fused=None (auto) or False" for reason in sorted(reasons)]


def _complex_errors(group: dict[str, Any], rule: UpdateRule, owner: str) -> list[str]:
    """Complex parameters are updated as real pairs (as torch.optim does), which is exact
    only for an elementwise rule without projection."""
    shapes = [
        tuple(p.shape)
        for p in group["params"]
        if p.is_complex() and (is_projected(p, group) or not rule.elementwise)
    ]
    if not shapes:
        return []
    where = "a projected group (with rank)" if rule.elementwise else owner
    return [
        f"complex parameters {shapes} cannot be updated by {where}; put them in a param "
        "group without rank of an AdamW optimizer (updated as real pairs, like torch.optim)"
    ]


def _storage_errors(group: dict[str, Any]) -> list[str]:
    errors = []
    rounding = group["param_rounding"]
    if rounding not in PARAM_ROUNDINGS:
        errors.append(f"unknown param_rounding {rounding!r}; valid: {', '.join(PARAM_ROUNDINGS)}")
    elif rounding == "stochastic":
        shapes = [tuple(p.shape) for p in group["params"] if p.dtype == torch.float16]
        if shapes:
            errors.append(
                f"param_rounding='stochastic' rounds to bf16, but parameters {shapes} are float16; "
                "use bf16 parameters or param_rounding='nearest'"
            )
    elif rounding == "corrected":
        shapes = [
            tuple(p.shape)
            for p in group["params"]
            if p.dtype != torch.bfloat16 and not isinstance(p, Int8Weight) and p.is_floating_point()
        ]
        if shapes:
            errors.append(
                f"param_rounding='corrected' keeps an 8-bit correction of bf16 weights, but parameters "
                f"{shapes} are not bf16; cast them to bf16 (quantize_weights(model, 'bf16')) or use "
                "param_rounding='nearest'"
            )
    try:
        moment_formats(group["states"])
    except ValueError as error:
        errors.append(str(error))
    size = group["block_size"]
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, int) or size < 4 or size & (size - 1)
    ):
        errors.append(
            f"block_size must be a power of two >= 4 (or None for the format's default), got {size!r}"
        )
    return errors


def _projection_errors(group: dict[str, Any]) -> list[str]:
    errors = []
    if group["experts"] not in (True, False):
        errors.append(f"experts must be True or False, got {group['experts']!r}")
    elif group["experts"]:
        shapes = [tuple(p.shape) for p in group["params"] if p.dim() != 3]
        if shapes:
            errors.append(
                f"experts=True takes 3-D parameters (experts × rows × columns), got shapes {shapes}; "
                "put them in a group without experts"
            )
    if "rank" not in group:
        return errors
    rank, gap = group["rank"], group["update_proj_gap"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        errors.append(f"rank must be a positive integer, got {rank!r}")
    if isinstance(gap, bool) or not isinstance(gap, int) or gap <= 0:
        errors.append(f"update_proj_gap must be a positive integer, got {gap!r}")
    errors += number_error("scale", group["scale"], strict=True)
    for key, valid in (
        ("scale_type", SCALE_TYPES),
        ("proj_type", PROJ_TYPES),
        ("proj_method", PROJ_METHODS),
        ("on_subspace_change", SUBSPACE_POLICIES),
        ("basis_states", BASIS_STATES),
    ):
        if group[key] not in valid:
            errors.append(f"unknown {key} {group[key]!r}; valid: {', '.join(map(str, valid))}")
    return errors + _scaling_errors(group)


def _scaling_errors(group: dict[str, Any]) -> list[str]:
    """APOLLO's options, and the combinations of projection options that cannot be exact."""
    errors = []
    limit, scale_type = group["norm_growth_limit"], group["scale_type"]
    if limit is not None:
        found = number(limit)
        if found is None or found < 1:
            errors.append(
                f"norm_growth_limit must be a finite number >= 1, or None for no limiter, got "
                f"{limit!r}{beyond_float32(limit)}"
            )
        elif scale_type is None:
            errors.append(
                "norm_growth_limit limits APOLLO's scaled gradient: set scale_type ('channel' or "
                "'tensor'), or norm_growth_limit=None"
            )
    if scale_type == "channel" and group["proj_type"] == "full":
        errors.append(
            "scale_type='channel' scales the unprojected side's channels, but proj_type='full' "
            "projects both sides; use scale_type='tensor' or a one-sided proj_type"
        )
    if group["proj_method"] == "random":
        if group["on_subspace_change"] == "rotate":
            errors.append(
                "proj_method='random' draws an unrelated projection at each refresh, which no "
                "rotation maps the moments into; use on_subspace_change='keep' (APOLLO's) or 'reset'"
            )
        if group["basis_states"] != "fp32":
            errors.append(
                f"basis_states={group['basis_states']!r}: proj_method='random' stores no basis (it "
                "is drawn again from its seed); leave basis_states='fp32'"
            )
    return errors


def _weight_decay_errors(group: dict[str, Any]) -> list[str]:
    return number_error("weight_decay", group["weight_decay"])


def sharding_errors(group: dict[str, Any], rule: UpdateRule, owner: str) -> list[str]:
    """DTensors split by rows are updated shard by shard, which is exact for an elementwise
    rule, for a rule whose whole-matrix part one process computes (Muon's
    ``sharded_direction``), and for a projection whose basis is on the unsplit side (right, r×n)
    found by the subspace method from all-reduced sketches, or drawn alike on every process
    (random)."""
    errors = [error for p in group["params"] if (error := placement_error(p)) is not None]
    split = [p for p in group["params"] if split_by_rows(p)]
    if errors or not split:
        return errors
    if group["experts"]:
        return [
            f"experts=True: parameters {[tuple(p.shape) for p in split]} are split by rows "
            "(FSDP2), so no process holds whole experts to project; shard them by experts "
            "outside FSDP2, or leave them out of the experts group"
        ]
    if not rule.elementwise and not hasattr(rule, "sharded_direction"):
        return [
            f"{owner} needs whole tensors for its update (it is not elementwise), but "
            f"parameters {[tuple(p.shape) for p in split]} are split by rows; use an AdamW "
            "optimizer under FSDP2"
        ]
    projected = [p for p in split if is_projected(p, group)]
    if projected and group["proj_method"] == "svd":
        errors.append(
            f"proj_method={group['proj_method']!r} needs whole gradients, but parameters "
            f"{[tuple(p.shape) for p in projected]} are split by rows; use proj_method='subspace' "
            "(or 'random')"
        )
    left = [
        tuple(p.shape)
        for p in projected
        if group["proj_type"] in PROJ_TYPES and projection_sides(matrix_shape(p.shape), group["proj_type"])[0]
    ]
    if left:
        errors.append(
            f"proj_type={group['proj_type']!r} puts the basis of {left} on the rows, which are split "
            "across processes; use proj_type='right' (basis r×n, replicated) under FSDP2"
        )
    return errors
