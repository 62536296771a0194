"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): a sign of
momentum, one moment per parameter.

The direction is ``sign(β₁·m + (1 − β₁)·g)``, every element ±1 (0 where the interpolation is 0);
the moment then moves to ``β₂·m + (1 − β₂)·g``. Weight decay is decoupled, as in AdamW (the
optimizer shell applies it). Its step is the learning rate per element whatever the gradient's
size, so the paper advises rates 3–10 times smaller than AdamW's; on the small models of
docs/results/ternary.md AdamW's own rates were best.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from slimopt.checks import betas_errors, required_lr_errors


class LionRule:
    """Lion's moment and direction ``sign(lerp(m, g, 1 − β₁))``."""

    moment_kinds: ClassVar[dict[str, str]] = {"exp_avg": "linear"}
    elementwise: ClassVar[bool] = True
    reads_own_dtype: ClassVar[bool] = False
    factored_keys: ClassVar[tuple[str, ...]] = ()
    fused: ClassVar[str | None] = None
    # The paper's defaults (and bitsandbytes' and lion-pytorch's).
    defaults: ClassVar[dict[str, Any]] = {"betas": (0.9, 0.99)}
    help: ClassVar[dict[str, str]] = {
        "betas": "β₁ mixes moment and gradient for the update's sign, β₂ is the moment's decay rate",
    }

    def validate(self, group: dict[str, Any]) -> list[str]:
        # β = 1 is meaningful here (β₁ = 1: the sign of the moment alone), unlike in Adam.
        return betas_errors(group["betas"], one_allowed=True) + required_lr_errors(group["lr"], "Lion")

    def init_state(self, grad: Tensor, group: dict[str, Any], *, projected: bool) -> dict[str, Tensor]:
        return {"exp_avg": grad.new_zeros(grad.shape)}

    def direction(self, grad: Tensor, state: dict[str, Tensor], age: int, group: dict[str, Any]) -> Tensor:
        beta1, beta2 = group["betas"]
        exp_avg = state["exp_avg"]
        direction = exp_avg.lerp(grad, 1 - beta1).sign_()
        exp_avg.lerp_(grad, 1 - beta2)
        return direction

    def bias_correction(self, group: dict[str, Any], age: int) -> float:
        return 1.0

    def step_size(self, group: dict[str, Any], weights: Tensor, step: int) -> float:
        return group["lr"]
