"""The launch budget: operations that touch tensor data in one optimizer step on the fused path
(counted with torch.profiler on the CPU, so a regression shows without a GPU).

- Per unprojected tensor: 1, the fused step (one compiled region: decode, update, encode, write).
- Per projected matrix: 5, the projection (matmul), the fused step in r×n, the weights' decay
  (where, then mul_) and the back-projection (one addmm_).
- Adafactor: as AdamW per unprojected tensor (its reductions, the factored statistics, the RMS
  clipping and the weights' RMS of ``scale_parameter``, are loops of the one compiled region).
  Per projected matrix 10: its step size is then a tensor on the device (the weights' RMS:
  norm, divide, clamp, multiply), which ``addmm_`` cannot take as a factor, so the direction is
  projected back by a matmul, scaled (2) and subtracted.
- Per tensor with stochastically rounded moments, one seed draw (randint) per such moment (bf16:
  2, ternary: 1); a ternary moment is encoded in three more compiled regions (row and column
  scales, block exponents, digits: ``slimopt.codecs.storage``), each a pass that Inductor
  would otherwise fuse with the next into slower loops.
- Tensors under 4096 elements (norms, biases: fp32 moments in every storage format) share one
  compiled region per step, not one each, plus 1 to stack their step sizes
  (``slimopt.kernels.adamw_steps``).
- Per tensor, 1 per finiteness vote (its minimum and maximum: ``slimopt.finite``; on CUDA one
  multi-tensor norm serves all tensors instead): a projected matrix votes on its gradient and
  on the projected gradient.
- Per step: 3 for the decision on non-finite gradients, taken for all tensors at once (the
  votes stacked, tested, combined per tensor), and 3 more for the projected gradients' when there are
  projected matrices, and 3 to combine the two for the projected matrices; the fused path
  leaves the decisions on the device (``slimopt.finite``) and the step ends with 1 more, which
  gathers them for the host to read later. Nothing waits for the device.

The reference path takes about 45 operations for one unprojected int8 tensor.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import profile

import slimopt

from .conftest import like_cuda

# Operations that only describe tensors (views; dtype or device conversions that are no-ops for
# fp32 CPU tensors), read a vote back to the host, allocate the step's scalars or look up a
# compiled region: none makes a pass over tensor data.
METADATA = {
    "aten::view",
    "aten::reshape",
    "aten::slice",
    "aten::select",
    "aten::numpy_T",
    "aten::detach_",
    "aten::lift_fresh",
    "aten::empty",
    "aten::to",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "TorchDynamo Cache Lookup",
}
PER_TENSOR = {"unprojected": 1, "projected": 5}
PER_ADAFACTOR_TENSOR = {"unprojected": 1, "projected": 10}
VOTES = {"unprojected": 1, "projected": 2}
# Per tensor, by storage format: seed draws and compiled regions beyond the fused step's one.
SEEDS = {"fp32": 0, "int8": 0, "int4": 0, "bf16": 2, "ternary": 1}
PHASES = {"fp32": 0, "int8": 0, "int4": 0, "bf16": 0, "ternary": 3}
# The decisions: per kind of tensor (its vote), and per step (gathering them for the host).
PER_VOTE = 3
PER_STEP = 1
COMBINE = 3  # the projected matrices' two votes: both stacked, and-ed
COUNT = 6


def _operations_per_step(groups: list[dict], states: str, rule: str = "adamw") -> Counter:
    if rule == "adamw":
        optimizer = slimopt.GaLoreAdamW(groups, lr=1e-3, states=states, fused=True)
    else:  # relative step, the weights' RMS, momentum
        optimizer = slimopt.GaLoreAdafactor(groups, beta1=0.9, states=states, fused=True)
    like_cuda(optimizer, flags=True)  # the decisions stay on the device, as on CUDA
    generator = torch.Generator().manual_seed(0)
    for group in groups:
        for param in group["params"]:
            param.grad = torch.randn(param.shape, generator=generator)
    optimizer.step()
    optimizer.step()  # compiled, state created: a steady step follows
    with profile() as prof:
        optimizer.step()
    top = [
        e
        for e in prof.events()
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("Optimizer.step")
    ]
    return Counter(e.name for e in top if e.name not in METADATA)


@pytest.mark.parametrize(
    ("rule", "states"),
    [("adamw", states) for states in ("fp32", "int8", "int4", "bf16", "ternary")]
    + [("adafactor", "fp32"), ("adafactor", "int8"), ("adafactor", "ternary")],
)
@pytest.mark.parametrize("kinds", [("unprojected",), ("unprojected", "projected")], ids=["plain", "mixed"])
def test_fused_step_stays_within_its_launch_budget(kinds, rule, states) -> None:
    groups = []
    for kind in kinds:
        params = [torch.nn.Parameter(torch.randn(512, 256)) for _ in range(COUNT)]
        groups.append({"params": params} if kind == "unprojected" else {"params": params, "rank": 32})
    counted = _operations_per_step(groups, states, rule)
    fused = PER_TENSOR if rule == "adamw" else PER_ADAFACTOR_TENSOR
    per_tensor = {kind: fused[kind] + VOTES[kind] + SEEDS[states] + PHASES[states] for kind in kinds}
    budget = sum(COUNT * per_tensor[kind] for kind in kinds) + PER_VOTE * len(kinds) + PER_STEP
    budget += COMBINE * ("projected" in kinds)
    assert sum(counted.values()) <= budget, dict(counted)
    compiled = sum(count for name, count in counted.items() if name.startswith("Torch-Compiled Region"))
    assert compiled == COUNT * len(kinds) * (1 + PHASES[states])


def test_small_tensors_share_one_compiled_region() -> None:
    """Norms and biases take one compiled region between them, where each took its own: a
    compiled call costs about 100 µs of dynamo, more than updating a few thousand elements."""
    small = [torch.nn.Parameter(torch.randn(512)) for _ in range(COUNT)]
    params = [*small, torch.nn.Parameter(torch.randn(512, 256))]
    counted = _operations_per_step([{"params": params}], "int8")
    compiled = sum(count for name, count in counted.items() if name.startswith("Torch-Compiled Region"))
    assert compiled == 2, dict(counted)  # the small tensors together, the matrix on its own
    stacked_step_sizes = 1
    budget = len(params) * VOTES["unprojected"] + compiled + stacked_step_sizes + PER_VOTE + PER_STEP
    assert sum(counted.values()) <= budget, dict(counted)
