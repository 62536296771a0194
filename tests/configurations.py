"""The table of slimopt configurations that generic tests run over (as torch's ``OptimizerInfo``
table does for ``torch.optim``): every registry name on a small network, projected where the
name projects, plus per-expert projection, each with what it can and cannot do: where its fused
step runs (``fused_on``, torch's ``supports_fused_on``) and the option variants the fused-step
tests run it with (``fused_inputs``, ``triton_inputs``: torch's ``optim_inputs_func``).

The network's matrices are 128×64 and 64×128 (rank 32): projected moments of 4096 elements, so
compressed formats are stored compressed, not left fp32 for being small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import slimopt
from slimopt.registry import OPTIMIZERS
from slimopt.rules import MuonRule, TACORule

RANK = 32
# Rates at which 20 steps on the toy regression lower the loss clearly for every rule.
LEARNING_RATES = {"taco": 1e-2, "adafactor": 1e-2, "galore_adafactor": 1e-2}


class Experts(nn.Module):
    """A mixture of experts' stacked weights (4 experts of 32×64): build_optimizer projects each
    expert on its own (its class name says Experts)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter((torch.randn(4, 32, 64) * 0.1).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eoi->bo", x, self.weight) / 4


class Net(nn.Module):
    """64 → 128 → 64 with a layer norm (vectors: the unprojected no-decay group), and experts."""

    def __init__(self, experts: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128, dtype=dtype)
        self.down = nn.Linear(128, 64, dtype=dtype)
        self.norm = nn.LayerNorm(64, dtype=dtype)
        self.experts = Experts(dtype) if experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm(self.down(torch.tanh(self.up(x))))
        return out if self.experts is None else out + self.experts(x).repeat(1, 2)


def make_net(seed: int = 0, experts: bool = False, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net(experts, dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(16, 64, generator=generator)
    return inputs.to(dtype), torch.sin(inputs * 1.5).to(dtype)


def loss_of(net: nn.Module, step: int) -> torch.Tensor:
    inputs, target = batch(step, next(net.parameters()).dtype)
    return nn.functional.mse_loss(net(inputs).float(), target.float())


@dataclass(frozen=True)
class Configuration:
    """One optimizer of the table: how to build it for a network, and what it can do."""

    label: str
    name: str  # registry name
    experts: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    # Option variants the fused step is checked with against the reference path on the test
    # LLaMA, and those the hand-written Triton kernels are checked with (Triton's interpreter).
    fused_inputs: tuple[dict[str, Any], ...] = ()
    triton_inputs: tuple[dict[str, Any], ...] = ()

    @property
    def projected(self) -> bool:
        return OPTIMIZERS[self.name].projected

    @property
    def fused_on(self) -> tuple[str, ...]:
        """The device types where ``fused=True`` takes the fused step for every group (none:
        refused at construction, naming why)."""
        spec = OPTIMIZERS[self.name]
        scales = spec.projected and {**spec.cls.option_defaults(), **dict(spec.options)}["scale_type"]
        subspace_muon = spec.projected and spec.cls.rule.fused == "muon"
        return () if spec.cls.rule.fused is None or scales or subspace_muon else ("cpu", "cuda")

    @property
    def lr(self) -> float:
        return LEARNING_RATES.get(self.name, 3e-3)

    @property
    def adam_like(self) -> bool:
        """Whether its groups have AdamW's ``betas`` (what OneCycleLR's momentum cycles)."""
        return "betas" in self.build(make_net()).defaults

    @property
    def matrices_only(self) -> bool:
        """Whether its own rule takes matrices only (TACO's, Muon's: build_optimizer gives the
        rest groups with ``rule="adamw"``)."""
        return isinstance(OPTIMIZERS[self.name].cls.rule, (MuonRule, TACORule))

    @property
    def complex_ok(self) -> bool:
        """Whether complex parameters are updated (as real pairs, as torch.optim does): an
        elementwise rule in unprojected groups only; elsewhere refused at construction."""
        return not self.projected and OPTIMIZERS[self.name].cls.rule.elementwise

    def build(self, net: nn.Module, **overrides: Any) -> slimopt.SlimoptOptimizer:
        options = {"lr": self.lr, **self.options, **overrides}
        if self.projected and OPTIMIZERS[self.name].rank is None:
            options.setdefault("rank", RANK)  # APOLLO-Mini keeps its own rank, 1
        return slimopt.build_optimizer(net, self.name, **options)

    def net(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> Net:
        return make_net(seed, self.experts, dtype)


# By name: the fused step's variants (storage formats one moment each, stochastic rounding,
# Adafactor's relative step, the weights' RMS and momentum with every stored format, projected
# whole second moments), and the Triton kernels' (elementwise formats and ternary).
FUSED_INPUTS: dict[str, tuple[dict[str, Any], ...]] = {
    "adamw": ({}, {"states": "bf16"}, {"states": "ternary/fp32"}, {"states": "int8/bf16"}),
    "adamw8bit": ({}, {"param_rounding": "stochastic"}),
    "adamw4bit": ({},),
    "galore_adamw": ({"rank": 8},),
    "galore_adamw8bit": ({"rank": 8},),
    "adamw_ternary": ({},),
    "galore_adamw_ternary": ({"rank": 8},),
    "adafactor": (
        {"lr": None},
        {"states": "int8", "beta1": 0.9, "weight_decay": 0.1},
        {"states": "int4", "beta1": 0.9, "scale_parameter": False},
        {"states": "ternary", "beta1": 0.9},
    ),
    "galore_adafactor": (
        {"rank": 8, "states": "int8"},
        {"rank": 8, "states": "ternary", "beta1": 0.9, "lr": None},
    ),
}
TRITON_INPUTS: dict[str, tuple[dict[str, Any], ...]] = {
    "adamw": ({}, {"states": "bf16"}, {"states": "int8/bf16"}),
    "adamw8bit": ({}, {"param_rounding": "stochastic"}),
    "adamw4bit": ({},),
    "galore_adamw8bit": ({"rank": 8},),
    "adamw_ternary": ({}, {"param_rounding": "stochastic"}),
}

CONFIGURATIONS: list[Configuration] = [
    Configuration(
        name, name, fused_inputs=FUSED_INPUTS.get(name, ()), triton_inputs=TRITON_INPUTS.get(name, ())
    )
    for name in slimopt.available_optimizers()
]
CONFIGURATIONS.append(Configuration("galore_adamw8bit (experts)", "galore_adamw8bit", experts=True))
CONFIGURATIONS.append(
    Configuration("galore_adamw (bf16 basis)", "galore_adamw", options={"basis_states": "bf16"})
)


def by_label() -> Callable[[Configuration], str]:
    return lambda configuration: configuration.label


def train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """``optimizer`` steps on the toy regression; the losses before each step."""
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = loss_of(net, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
