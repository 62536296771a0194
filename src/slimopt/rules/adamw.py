"""AdamW (Loshchilov & Hutter), with torch.optim.AdamW's conventions: eps added to the
bias-corrected √v, decoupled weight decay applied by the optimizer shell."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from slimopt.checks import betas_errors, number_error, required_lr_errors


class AdamWRule:
    """Adam moments and direction ``m̂ / (√v̂ + eps)``."""

    moment_kinds: ClassVar[dict[str, str]] = {"exp_avg": "linear", "exp_avg_sq": "square"}
    elementwise: ClassVar[bool] = True
    reads_own_dtype: ClassVar[bool] = False
    factored_keys: ClassVar[tuple[str, ...]] = ()
    fused: ClassVar[str | None] = "adamw"
    # Hyperparameters of the rule besides lr and weight_decay, with torch.optim.AdamW's defaults.
    defaults: ClassVar[dict[str, Any]] = {"betas": (0.9, 0.999), "eps": 1e-8}
    # What each of ``defaults`` means, for the optimizers' docstrings.
    help: ClassVar[dict[str, str]] = {
        "betas": "decay rates of the moving averages of the gradient and of its square",
        "eps": "added to the square root of the second moment, for numerical stability",
    }

    def validate(self, group: dict[str, Any]) -> list[str]:
        errors = betas_errors(group["betas"]) + required_lr_errors(group["lr"], "AdamW")
        return errors + number_error("eps", group["eps"])

    def init_state(self, grad: Tensor, group: dict[str, Any], *, projected: bool) -> dict[str, Tensor]:
        return {"exp_avg": torch.zeros_like(grad), "exp_avg_sq": torch.zeros_like(grad)}

    def direction(self, grad: Tensor, state: dict[str, Tensor], age: int, group: dict[str, Any]) -> Tensor:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**age
        bias_correction2_sqrt = math.sqrt(1 - beta2**age)
        # One temporary, reused for the result: at LLaMA sizes allocation, not arithmetic,
        # dominates a CPU step.
        direction = exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(group["eps"])
        torch.div(exp_avg, direction, out=direction)
        return direction.div_(bias_correction1)

    def bias_correction(self, group: dict[str, Any], age: int) -> float:
        beta1, beta2 = group["betas"]
        return math.sqrt(1 - beta2**age) / (1 - beta1**age)

    def step_size(self, group: dict[str, Any], weights: Tensor, step: int) -> float:
        return group["lr"]
