"""slimopt's optimizers: each one a choice of update rule and defaults over the
``torch.optim`` shell (``slimopt.core.shell.SlimoptOptimizer``), constructors and docs only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from torch import Tensor

from slimopt.core.hyperparameters import recording_given
from slimopt.core.shell import GaLoreOptimizer, SlimoptOptimizer
from slimopt.rules import AdafactorRule, AdamWRule, MuonRule, TACORule
from slimopt.rules.taco import TACO_DEFAULTS

# AdamWTernary's betas: a shorter first-moment average keeps less of the rounding noise.
TERNARY_BETAS = (0.7, 0.999)
# MuonTernary's momentum, for the same reason.
TERNARY_MOMENTUM = 0.5

__all__ = [
    "TACO",
    "APOLLOAdamW",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWTernary",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "GaLoreOptimizer",
    "Muon",
    "Muon4bit",
    "Muon8bit",
    "MuonTernary",
    "SlimoptOptimizer",
    "decoded_state",
]


class GaLoreAdamW(SlimoptOptimizer):
    """AdamW whose param groups with a ``rank`` key run in a GaLore low-rank subspace.

    Groups without ``rank`` reproduce ``torch.optim.AdamW``.
    """

    rule = AdamWRule()

    # Records what the caller gave: a constructor ``rule`` takes that rule's defaults for the rest.
    @recording_given
    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = AdamWRule.defaults["betas"],
        eps: float = AdamWRule.defaults["eps"],
        weight_decay: float = 1e-2,
        **options: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, options)


class APOLLOAdamW(GaLoreAdamW):
    """APOLLO (Zhu et al., 2024): AdamW moments of a random rank-r projection of each matrix in a
    group with ``rank``, used only to scale the raw gradient per channel (``scale_type=
    "channel"``) or as a whole (``"tensor"``; with rank 1 and ``scale=128``: APOLLO-Mini), with
    Fira's norm-growth limiter (``norm_growth_limit=1.01``; None: off). As in apollo-torch the
    projection is redrawn every ``update_proj_gap`` steps with the moments kept, and the update is
    multiplied by √``scale``. The projection is drawn from its seed whenever it is used, never
    stored. Groups without ``rank`` are plain AdamW (``proj_method="svd"`` is apollo-torch's
    ``proj="svd"``).
    """

    projection_defaults: ClassVar[dict[str, Any]] = {
        "proj_method": "random",
        "scale_type": "channel",
        "norm_growth_limit": 1.01,
        "scale": 1.0,
        "on_subspace_change": "keep",
        # A redraw costs nothing to spread, and apollo-torch redraws every matrix at once.
        "stagger": False,
    }


class GaLoreAdafactor(SlimoptOptimizer):
    """Adafactor (Hugging Face formulation) with GaLore projection for groups with ``rank``.

    ``lr=None`` uses Adafactor's relative step size. Projected matrices keep a whole second
    moment in the r×n space; unprojected matrices keep factored row/column statistics.
    """

    rule = AdafactorRule()

    @recording_given
    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        eps: tuple[float, float] = AdafactorRule.defaults["eps"],
        clip_threshold: float = AdafactorRule.defaults["clip_threshold"],
        decay_rate: float = AdafactorRule.defaults["decay_rate"],
        beta1: float | None = AdafactorRule.defaults["beta1"],
        weight_decay: float = 0.0,
        scale_parameter: bool = AdafactorRule.defaults["scale_parameter"],
        relative_step: bool | None = AdafactorRule.defaults["relative_step"],
        warmup_init: bool = AdafactorRule.defaults["warmup_init"],
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "eps": eps,
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "beta1": beta1,
            "weight_decay": weight_decay,
            "scale_parameter": scale_parameter,
            "relative_step": lr is None if relative_step is None else relative_step,
            "warmup_init": warmup_init,
        }
        super().__init__(params, defaults, options)


class GaLoreAdamW8bit(GaLoreAdamW):
    """GaLoreAdamW with block-wise 8-bit moments (``states="int8"``); without ``rank`` groups it
    is a plain 8-bit AdamW, exported as ``AdamW8bit``."""

    default_states = "int8"


class AdamW4bit(GaLoreAdamW):
    """AdamW with 4-bit moments (``states="int4"``); groups with ``rank`` are projected."""

    default_states = "int4"


class AdamWTernary(GaLoreAdamW):
    """AdamW with a ternary first moment and a factored second moment (``states="ternary"``);
    groups with ``rank`` are projected.

    Its default β₁ is 0.7, not AdamW's 0.9: every step rounds the first moment again, and the
    moving average keeps that rounding noise for about 1 / (1 − β₁²) steps. At β₁ = 0.9 the
    stored moment is off by 3–4 times its own norm and pretraining loses 6–10% of loss against
    fp32 AdamW; at 0.7 it stays within 2% on the rows measured, with less loss than at 0.5
    ([ternary states](../results/ternary.md)). A checkpoint brings its own ``betas``, as in
    ``torch.optim``: runs saved with 0.9 continue with 0.9.
    """

    default_states = "ternary"

    @recording_given
    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = TERNARY_BETAS,
        eps: float = AdamWRule.defaults["eps"],
        weight_decay: float = 1e-2,
        **options: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, **options)


class TACO(SlimoptOptimizer):
    """TACO: each matrix moves by one entry per column (its largest, ±m/n; ``slimopt.rules.taco``),
    taken from a per-column sketch of the gradient history (``k`` slots, ``beta``). Its groups
    take 2-D weights in ``nn.Linear``'s out × in layout (``transposed=True``: in × out);
    embeddings, the output head and vectors go to fallback groups with ``rule="adamw"`` (and
    AdamW's ``betas`` and ``eps``), as ``build_optimizer(model, "taco")`` arranges. Storage
    options apply to the fallback groups' moments.
    """

    rule = TACORule()
    rule_defaults: ClassVar[dict[str, tuple[str, ...]]] = {"adamw": ("betas", "eps")}

    @recording_given
    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,  # the best rate most often in benchmarks/taco.py (1e-3 to 1e-2)
        k: int = TACO_DEFAULTS["k"],
        beta: float = TACO_DEFAULTS["beta"],
        sketch_values: str = TACO_DEFAULTS["sketch_values"],
        history: str = TACO_DEFAULTS["history"],
        transposed: bool = TACORule.defaults["transposed"],
        betas: tuple[float, float] = AdamWRule.defaults["betas"],
        eps: float = AdamWRule.defaults["eps"],
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "k": k,
            "beta": beta,
            "sketch_values": sketch_values,
            "history": history,
            "transposed": transposed,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults, options)


class Muon(SlimoptOptimizer):
    """Muon: each matrix's momentum orthogonalized by a Newton–Schulz iteration
    (``slimopt.rules.muon``), with ``torch.optim.Muon``'s signature, defaults and arithmetic
    (with fp32 momentum it steps as torch's does, within the order of a product's rounding).
    Unlike torch's, it takes slimopt's options (``states`` for the momentum, ``fused``, …) and
    groups with ``rule="adamw"`` for what is not a matrix (embeddings, the output head, norms and
    biases, with AdamW's ``betas`` and ``eps`` unless the group gives them), as
    ``build_optimizer(model, "muon")`` arranges. ``transposed=True`` marks weights stored in ×
    out (``Conv1D``), so that the step's shape adjustment reads them as out × in; a group with
    a ``rank`` orthogonalizes the momentum in a GaLore subspace (``"galore_muon"``).
    """

    rule = MuonRule()

    @recording_given
    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = MuonRule.defaults["momentum"],
        nesterov: bool = MuonRule.defaults["nesterov"],
        ns_coefficients: tuple[float, float, float] = MuonRule.defaults["ns_coefficients"],
        eps: float = MuonRule.defaults["eps"],
        ns_steps: int = MuonRule.defaults["ns_steps"],
        adjust_lr_fn: str | None = MuonRule.defaults["adjust_lr_fn"],
        transposed: bool = MuonRule.defaults["transposed"],
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "transposed": transposed,
        }
        super().__init__(params, defaults, options)


class Muon8bit(Muon):
    """Muon with a block-wise 8-bit momentum (``states="int8"``)."""

    default_states = "int8"


class Muon4bit(Muon):
    """Muon with a block-wise 4-bit momentum (``states="int4"``) in blocks of 256 values (one
    fp32 scale per 256: 0.516 bytes per parameter; [Muon's results](../results/muon.md) measure the cost)."""

    default_states = "int4"
    default_block_size = 256


class MuonTernary(Muon):
    """Muon with a ternary momentum (``states="ternary"``: base-3 digits, block exponents, row
    and column scales).

    Its default momentum is 0.5, not Muon's 0.95: every step rounds the momentum again, the
    buffer keeps that rounding noise for about 1 / (1 − momentum²) steps, and the
    orthogonalization lifts the noise's small directions to the size of the signal's. On the
    architectures benchmark's LLaMA row, 0.95 ended 20% behind fp32 Muon, 0.5 within 5%
    ([Muon's results](../results/muon.md)). A checkpoint brings its own ``momentum``, as in ``torch.optim``.
    """

    default_states = "ternary"

    @recording_given
    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = TERNARY_MOMENTUM,
        **options: Any,
    ) -> None:
        super().__init__(params, lr, weight_decay, momentum, **options)


AdamW8bit = GaLoreAdamW8bit


def decoded_state(optimizer: SlimoptOptimizer, param: Tensor) -> dict[str, Tensor]:
    """The fp32 moments of ``param`` in ``optimizer``, whatever their storage format.

    Args:
        optimizer: a slimopt optimizer.
        param: one of its parameters.

    Returns:
        Each moment by state key, in the parameter's shape or a projected matrix's rank-r space
        (see [SlimoptOptimizer.decoded_state][slimopt.SlimoptOptimizer.decoded_state]).

    Raises:
        KeyError: a tensor that is not a parameter of ``optimizer``.
    """
    return optimizer.decoded_state(param)
